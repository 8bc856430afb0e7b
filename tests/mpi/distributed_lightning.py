"""Lightning on the "ringreduce" backend (2 ranks): our strategy, which starts torch.distributed's
default group on our backend, and Lightning's own DDP strategy with
process_group_backend="ringreduce" (env://); a group that does not outlive a restart, an
init that torch refuses then again, and a stalled rank's report."""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ringreduce as hvd
import ringreduce.distributed as rrd
from checks import check_equal, expect
import distributed_common as common
from distributed_common import STALL_CHECK_TIME, SUM, close, n, r, reduced, same_model


def lightning_module(pl, torchmetrics):
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(6, 3)
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3,
                                                                           average="micro")

        def training_step(self, batch, index):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, index):
            x, y = batch
            self.accuracy.update(self.net(x), y)

        def on_validation_epoch_end(self):
            self.log("accuracy", self.accuracy.compute())      # synced through torch.distributed
            self.accuracy.reset()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    return Module()


LX = torch.randn(32, 6, generator=torch.Generator().manual_seed(3))
LY = LX[:, :3].argmax(1)


def fit(strategy, label):
    """A Trainer fit on 2 ranks: 4 steps of 4 rows per rank, then validation; returns the
    module, and checks the parameters and the synced accuracy."""
    import lightning.pytorch as pl
    import torchmetrics
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    module = lightning_module(pl, torchmetrics)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=n, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(TensorDataset(LX, LY), batch_size=4)
    trainer.fit(module, loader, loader)
    assert dist.is_initialized() and dist.get_backend() == "ringreduce", dist.get_backend()
    # One process: Lightning's DistributedSampler shuffles (seed 0, epoch 0) and gives rank k
    # order[k::n], so the ranks' batch b together is order[4 * n * b:4 * n * (b + 1)].
    order = list(DistributedSampler(range(len(LX)), num_replicas=1, rank=0, seed=0))
    reference = lightning_module(pl, torchmetrics).net
    opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    for b in range(len(LX) // (4 * n)):
        batch = order[4 * n * b:4 * n * (b + 1)]
        opt.zero_grad()
        F.cross_entropy(reference(LX[batch]), LY[batch]).backward()
        opt.step()
    same_model(module.net, reference, f"{label} fit", rtol=1e-5, atol=1e-6)
    whole = (module.net(LX).argmax(1) == LY).float().mean()
    close(trainer.callback_metrics["accuracy"], whole, f"{label}: torchmetrics accuracy")


def case_lightning_ringreduce_strategy():
    import ringreduce.lightning  # noqa: F401  (registers strategy="ringreduce")

    assert not dist.is_initialized()
    fit("ringreduce", "strategy='ringreduce'")    # it starts the default group, ours
    dist.destroy_process_group()


def case_lightning_ddp():
    from lightning.pytorch.strategies import DDPStrategy

    assert not dist.is_initialized()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)      # Lightning's MPIEnvironment picks them
    fit(DDPStrategy(process_group_backend="ringreduce"), "DDPStrategy")


def case_a_group_does_not_outlive_a_restart():
    """ringreduce shut down and started again (as an elastic restart does): a group from
    new_group() before it refuses its calls with an error saying to make it again, on every
    member (also one that ran a call before: a group keeps the set it ran on while that
    stays open); the default group goes on, and a group made after works; a group destroyed
    refuses a call made on the object itself."""
    before = dist.new_group(list(range(n)))
    check_equal(reduced(torch.ones(2), SUM, before), torch.full((2,), float(n)), "before")
    hvd.shutdown()
    hvd.init(stall_check_time=STALL_CHECK_TIME)
    expect(hvd.RingReduceError, ["closed when ringreduce shut down", f"on rank {r}",
                                 "make the group again with dist.new_group() after init()"],
           dist.all_reduce, torch.ones(2), group=before)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "the default group after")
    after = dist.new_group(list(range(n)))
    check_equal(reduced(torch.ones(2), SUM, after), torch.full((2,), float(n)),
                "a group made after")
    dist.destroy_process_group(after)
    expect(hvd.RingReduceError, ["which was destroyed"], after.allreduce, [torch.ones(2)])


def case_init_that_torch_refuses_then_again():
    """torch refusing an argument of our init_process_group (a CPU device_id, on every rank)
    after the store is up: every rank raises torch's ValueError at once (rank 0's store, the
    server, outlives the others' connects, which waited out the timeout before), and the
    next call starts the default group. (The default group destroyed refuses a call made on
    the object itself, though ringreduce's global set it ran on stays open.)"""
    default = dist.group.WORLD
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "the default group")
    dist.destroy_process_group()
    expect(hvd.RingReduceError, ["which was destroyed"], default.allreduce, [torch.ones(2)])
    expect(ValueError, "device_id", rrd.init_process_group, device_id=torch.device("cpu"))
    assert not dist.is_initialized()
    rrd.init_process_group()
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "the default group again")
    common.GLOO = dist.new_group(backend="gloo")


def case_stall():
    """A rank that comes 2.5 s late to an all_reduce on a group of its own: the other logs our
    stall report naming that group's first call. Then ranks that wait for each other on two
    sets: rank 0 all_reduces on the group, then on the default group; rank 1 the other way
    round, its first asynchronous, and the second 2.5 s late: each one's report says where the
    other waits, in a collective it has not begun itself (the test reads them); both results
    are right."""
    late = dist.new_group(list(range(n)))
    if r == 0:
        print(f"STALL GROUP '{late.group_name}'", flush=True)
    if r == 1:
        time.sleep(2.5)
    check_equal(reduced(torch.ones(3), SUM, late), torch.full((3,), float(n)),
                "all_reduce after a stall")
    grouped, default = torch.ones(3), torch.full((2,), 2.0)
    if r == 0:
        dist.all_reduce(grouped, group=late)
        dist.all_reduce(default)
    else:
        work = dist.all_reduce(default, async_op=True)
        time.sleep(2.5)
        dist.all_reduce(grouped, group=late)
        work.wait()
    check_equal(grouped, torch.full((3,), float(n)), "all_reduce on a group, crossed")
    check_equal(default, torch.full((2,), 2.0 * n), "all_reduce on the default group, crossed")
    dist.destroy_process_group(late)
