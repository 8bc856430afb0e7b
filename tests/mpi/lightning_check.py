"""RingReduceStrategy under Lightning at 2 ranks, against plain PyTorch in one process on the
whole batch: `lightning.pytorch`, and the last case the standalone `pytorch_lightning`.
Usage: lightning_check.py DIRECTORY (shared by the ranks, for checkpoints).

Each case prints "CASE <name> ok" on every rank; a failure raises with the case's name.
"""
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:
    import pytorch_lightning
except ImportError:          # the test expects case_pytorch_lightning only where it is installed
    pytorch_lightning = None

import ringreduce as hvd
import ringreduce.lightning
from ringreduce.lightning import RingReduceStrategy
from checks import expect

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2, "run at 2 ranks"
DIRECTORY = Path(sys.argv[1])
PER_RANK = 4                      # batch per rank; one process takes PER_RANK * n
BATCHES = 7                       # per rank per epoch: an odd count ends on a partial accumulation

generator = torch.Generator().manual_seed(1234)
X = torch.randn(BATCHES * PER_RANK * n, 6, generator=generator)
Y = torch.randn(BATCHES * PER_RANK * n, 1, generator=generator)
VX = torch.randn(4 * PER_RANK * n, 6, generator=generator)
VY = torch.randn(4 * PER_RANK * n, 1, generator=generator)


def trainer(package=pl, **kwargs) -> pl.Trainer:
    """`package`'s Trainer: lightning.pytorch's, or pytorch_lightning's."""
    options = dict(accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0)
    options.update(kwargs)
    return package.Trainer(**options)


def loader(x, y) -> DataLoader:
    """Lightning swaps the sampler for a DistributedSampler (shuffled for training)."""
    return DataLoader(TensorDataset(x, y), batch_size=PER_RANK)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in module.state_dict().values()
                      if t.is_floating_point()])


def same_on_every_rank(tensor: torch.Tensor, what: str) -> None:
    hvd.check_consistency([(what, tensor)])     # bit for bit, naming it otherwise


def close(got, want, what, tolerance=2e-5) -> None:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    error = (got - want).abs().max().item()
    assert error <= tolerance * (1 + want.abs().max().item()), \
        f"{what}: off by {error:.3g}\n got {got.reshape(-1)[:6]}\nwant {want.reshape(-1)[:6]}"


def network(seed: int, batch_norm: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    middle = [nn.BatchNorm1d(8)] if batch_norm else []
    return nn.Sequential(nn.Linear(6, 8), *middle, nn.Tanh(), nn.Linear(8, 1))


class RegressionSteps:
    """The module's steps, for either package's LightningModule."""

    def __init__(self, net: nn.Module, optimizer: str = "sgd"):
        super().__init__()
        self.net, self.optimizer_name = net, optimizer
        self.losses: list[float] = []
        self.synced_batch_norm = False

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        self.synced_batch_norm |= any(isinstance(m, hvd.SyncBatchNorm) for m in self.modules())
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]


class Regression(RegressionSteps, pl.LightningModule):
    pass


if pytorch_lightning is not None:
    class StandaloneRegression(RegressionSteps, pytorch_lightning.LightningModule):
        pass


def whole_batches(epoch: int):
    """The batches one process takes: Lightning gives each rank a DistributedSampler (shuffled,
    seed 0, set_epoch each epoch), so rank k's batch b is order[k::n][b*PER_RANK:...], and
    together the ranks' batch b is order[b*PER_RANK*n:(b+1)*PER_RANK*n]."""
    sampler = DistributedSampler(range(len(X)), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    order = torch.tensor(list(sampler))
    whole = PER_RANK * n
    return [order[b * whole:(b + 1) * whole] for b in range(BATCHES)]


def reference_fit(net, epochs, accumulate, clip):
    """One process, the whole batch (every rank's shard of it), the same schedule."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    losses = []
    for epoch in range(epochs):
        for b, batch in enumerate(whole_batches(epoch)):
            loss = F.mse_loss(net(X[batch]), Y[batch])
            losses.append(loss.item())
            (loss / accumulate).backward()
            if (b + 1) % accumulate == 0 or b == BATCHES - 1:
                nn.utils.clip_grad_norm_(net.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
    net.eval()
    with torch.no_grad():
        val_loss = F.mse_loss(net(VX), VY).item()
    return losses, val_loss


def case_fit_matches_one_process():
    """strategy="ringreduce" with SyncBatchNorm, gradient accumulation (the epoch ends on a
    partial one), clipping and an LR schedule: bitwise-identical parameters on every rank, the
    loss curve and validation loss of one process on the whole batch."""
    model = Regression(network(0))
    fit = trainer(strategy="ringreduce", max_epochs=2, accumulate_grad_batches=2,
                  gradient_clip_val=0.3, sync_batchnorm=True)
    assert isinstance(fit.strategy, RingReduceStrategy)
    assert (fit.world_size, fit.global_rank, fit.local_rank) == (n, r, hvd.local_rank())
    assert fit.is_global_zero == (r == 0)
    fit.fit(model, loader(X, Y), loader(VX, VY))
    assert model.synced_batch_norm, "sync_batchnorm=True did not swap in ringreduce's"
    assert type(model.net[1]) is nn.BatchNorm1d, "SyncBatchNorm not reverted after fit"
    same_on_every_rank(flat(model), "parameters and statistics after fit")

    reference = network(0)
    losses, val_loss = reference_fit(reference, 2, 2, 0.3)
    curve = torch.tensor(hvd.allgather_object(model.losses), dtype=torch.float64).mean(0)
    close(curve, losses, "loss curve (mean over ranks) vs one process")
    close(flat(model), flat(reference), "parameters vs one process")
    metrics = {k: v.item() for k, v in fit.callback_metrics.items()}
    every = hvd.allgather_object(metrics)
    assert all(m == every[0] for m in every), f"sync_dist metrics differ: {every}"
    close(metrics["val_loss"], val_loss, "val_loss (sync_dist) vs one process")
    close(metrics["train_loss"], losses[-1], "last train_loss (sync_dist) vs one process")


class CountingCheckpointIO(TorchCheckpointIO):
    saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        CountingCheckpointIO.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


def case_checkpoint_resume():
    """Adam: 4 epochs straight equal, bit for bit, 2 epochs + a checkpoint
    (written by rank 0 only) + a resumed run to 4; a checkpoint loaded for testing has the
    saved parameters on every rank."""
    directory = DIRECTORY / "checkpoints"
    straight = Regression(network(1, batch_norm=False), "adam")
    keep = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit = trainer(strategy=RingReduceStrategy(), max_epochs=4, enable_checkpointing=True,
                  callbacks=[keep], plugins=[CountingCheckpointIO()])
    fit.fit(straight, loader(X, Y))
    saves = hvd.allgather_object(CountingCheckpointIO.saves)
    assert saves == [4, 0], f"checkpoints written per rank: {saves} (want rank 0 only)"
    assert (directory / "epoch=1.ckpt").exists()

    resumed = Regression(network(2, batch_norm=False), "adam")      # other initial values
    again = trainer(strategy=RingReduceStrategy(), max_epochs=4)
    again.fit(resumed, loader(X, Y), ckpt_path=directory / "epoch=1.ckpt")
    same_on_every_rank(flat(resumed), "resumed parameters")
    assert torch.equal(flat(resumed), flat(straight)), \
        "resumed run differs from the straight run"

    loaded = Regression(network(3, batch_norm=False), "adam")
    tester = trainer(strategy="ringreduce")
    tester.validate(loaded, loader(VX, VY), ckpt_path=directory / "epoch=3.ckpt")
    assert torch.equal(flat(loaded), flat(straight)), "validate(ckpt_path) parameters"


class TwoHeads(pl.LightningModule):
    """Manual optimization, two optimizers over disjoint parameters, each clipping between
    manual_backward and step, as under DDP (the strategy synchronizes at the end of the pass:
    Lightning's documented pattern needs no synchronize() of ours)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)
        self.automatic_optimization = False

    def training_step(self, batch, index):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        self.manual_backward(F.mse_loss(self.a(x), y))
        self.clip_gradients(opt_a, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_a.step()
        opt_b.zero_grad()
        self.manual_backward(F.l1_loss(self.b(x), y))
        self.clip_gradients(opt_b, gradient_clip_val=0.02, gradient_clip_algorithm="value")
        opt_b.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.a.parameters(), lr=0.1),
                torch.optim.Adam(self.b.parameters(), lr=0.01))


def case_manual_optimization():
    model = TwoHeads()
    trainer(strategy="ringreduce", max_epochs=1).fit(model, loader(X, Y))
    same_on_every_rank(flat(model), "two-optimizer parameters")
    torch.manual_seed(4)
    a, b = nn.Linear(6, 1), nn.Linear(6, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.01)
    for batch in whole_batches(0):
        x, y = X[batch], Y[batch]
        opt_a.zero_grad()
        F.mse_loss(a(x), y).backward()
        nn.utils.clip_grad_norm_(a.parameters(), 0.05)
        opt_a.step()
        opt_b.zero_grad()
        F.l1_loss(b(x), y).backward()
        nn.utils.clip_grad_value_(b.parameters(), 0.02)
        opt_b.step()
    close(flat(model), torch.cat([flat(a), flat(b)]), "manual optimization vs one process")


class Ones(pl.LightningModule):
    """A weight of ones whose gradient is 1 on every rank; what the step sees is recorded, and
    LightningModule.all_gather (torch's WORLD group) runs in validation."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.seen, self.gathered = [], []

    def training_step(self, batch, index):
        return self.weight.sum()

    def on_before_optimizer_step(self, optimizer):
        self.seen.append(self.weight.grad.clone())

    def validation_step(self, batch, index):
        self.gathered.append(self.all_gather(torch.tensor([float(self.global_rank)])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def case_one_reduction_a_step():
    """With op=Sum the step sees the sum once (backward's synchronize() is not followed by
    another, which reduced every gradient twice); self.all_gather takes torch's WORLD."""
    model = Ones()
    data = loader(X[:8], Y[:8])
    trainer(strategy=RingReduceStrategy(op=hvd.Sum), max_steps=2, limit_val_batches=1,
            val_check_interval=1).fit(model, data, data)
    assert model.seen and all(torch.equal(g, torch.full((2,), float(n))) for g in model.seen), \
        model.seen
    assert model.gathered and all(torch.equal(g.reshape(-1), torch.arange(n).float())
                                  for g in model.gathered), model.gathered


def case_bf16_mixed():
    model = Regression(network(5, batch_norm=False))
    trainer(strategy="ringreduce", max_epochs=1, precision="bf16-mixed").fit(model, loader(X, Y))
    same_on_every_rank(flat(model), "bf16-mixed parameters")


def case_collectives():
    strategy = RingReduceStrategy()
    assert strategy.distributed_sampler_kwargs == {"num_replicas": n, "rank": r}
    value = torch.tensor([float(r + 1), 10.0 * r])
    assert torch.equal(strategy.reduce(value, reduce_op="sum"), torch.tensor([3.0, 10.0]))
    assert torch.equal(strategy.reduce(value), torch.tensor([1.5, 5.0]))
    assert torch.equal(strategy.reduce(value, reduce_op="max"), torch.tensor([2.0, 10.0]))
    counts = strategy.reduce(torch.tensor(r + 2))                 # 2 and 3: mean 2.5
    assert counts.dtype == torch.get_default_dtype() and counts.item() == 2.5
    assert strategy.reduce("not a tensor") == "not a tensor"
    assert strategy.reduce_boolean_decision(r == 0) is False
    assert strategy.reduce_boolean_decision(r == 0, all=False) is True
    gathered = strategy.all_gather(torch.tensor([float(r)]))
    assert torch.equal(gathered, torch.tensor([[0.0], [1.0]]))
    x = torch.tensor(float(r + 1), requires_grad=True)
    weights = torch.tensor([1.0, 2.0])
    (strategy.all_gather(x, sync_grads=True) * weights).sum().backward()
    # every rank's loss uses every rank's x: the gradient is summed over ranks, as torch's
    assert x.grad.item() == n * weights[r].item(), x.grad
    assert strategy.broadcast({"from": r}, src=1) == {"from": 1}
    strategy.barrier("case_collectives")
    expect(hvd.UsageError, "not a ringreduce ProcessSet", strategy.reduce, value,
           group=object())


def case_pytorch_lightning():
    """The standalone pytorch_lightning's Trainer, with strategy="ringreduce" and with a
    RingReduceStrategy of its flavour (ringreduce.lightning.pl): SyncBatchNorm, accumulation
    ending on a partial group, clipping; bitwise-identical parameters on every rank, those of
    one process on the whole batch."""
    flavour = ringreduce.lightning.pl
    assert issubclass(flavour.RingReduceStrategy, pytorch_lightning.strategies.ParallelStrategy)
    reference = network(0)
    reference_fit(reference, 1, 2, 0.3)
    for how, strategy in (("by name", "ringreduce"), ("instance", flavour.RingReduceStrategy())):
        model = StandaloneRegression(network(0))
        fit = trainer(pytorch_lightning, strategy=strategy, max_epochs=1,
                      accumulate_grad_batches=2, gradient_clip_val=0.3, sync_batchnorm=True)
        assert isinstance(fit.strategy, flavour.RingReduceStrategy), type(fit.strategy)
        assert (fit.world_size, fit.global_rank) == (n, r)
        fit.fit(model, loader(X, Y))
        assert model.synced_batch_norm, "sync_batchnorm=True did not swap in ringreduce's"
        assert type(model.net[1]) is nn.BatchNorm1d, "SyncBatchNorm not reverted after fit"
        same_on_every_rank(flat(model), f"pytorch_lightning parameters ({how})")
        close(flat(model), flat(reference), f"pytorch_lightning ({how}) vs one process")


CASES = [case_collectives, case_fit_matches_one_process, case_checkpoint_resume,
         case_manual_optimization, case_one_reduction_a_step, case_bf16_mixed,
         *([case_pytorch_lightning] if pytorch_lightning is not None else [])]
for case in CASES:
    try:
        case()
    except Exception as e:
        raise AssertionError(f"rank {r}: {case.__name__} failed: {e!r}") from e
    print(f"CASE {case.__name__} ok rank {r}", flush=True)
    hvd.barrier()
hvd.shutdown()
print(f"OK rank {r}", flush=True)
