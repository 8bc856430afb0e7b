"""Training on the "ringreduce" backend against one process on the whole batch: DDP (plain, small
buckets, gradient_as_bucket_view, static_graph, find_unused_parameters, no_sync with
accumulation, fp16_compress_hook, hooks whose callbacks start collectives: PowerSGD, a hook or
bucket failing on one rank), DDP's join() with uneven inputs and ZeroRedundancyOptimizer
against gloo, FSDP (fully_shard) and torch.distributed.checkpoint, torchmetrics, Hugging Face
Accelerate, pipelining and tensor parallelism."""
import os
import shutil
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as hvd
from checks import check_equal, expect
from models import Net
import distributed_common as common
from distributed_common import BATCH, close, data, everywhere, n, r, rand, reduced, same_model, shard, train, WithUnused


def case_ddp():
    reference = train(Net)
    same_model(train(Net, DDP), reference, "DDP")
    same_model(train(Net, lambda m: DDP(m, bucket_cap_mb=0.002)), reference, "DDP small buckets")
    same_model(train(Net, lambda m: DDP(m, gradient_as_bucket_view=True)), reference,
               "DDP gradient_as_bucket_view")
    same_model(train(Net, lambda m: DDP(m, static_graph=True)), reference, "DDP static_graph")
    unused = train(WithUnused, lambda m: DDP(m, find_unused_parameters=True))
    same_model(unused, train(WithUnused), "DDP find_unused_parameters")
    same_model(train(Net, DDP, accumulate=2), train(Net, accumulate=2), "DDP no_sync")

    def hooked(model):
        ddp = DDP(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp

    same_model(train(Net, hooked), reference, "DDP fp16_compress_hook", rtol=1e-3, atol=1e-4)


def uneven(group, zero=False, find_unused=False):
    """DDP over `group` (None: the default one) inside `join()`, rank k taking 2 + 2k steps of
    its own data (uneven inputs: the ranks that run out shadow the others' collectives), with
    Adam, or ZeroRedundancyOptimizer (each rank steps its shard, then broadcasts it: joined
    too, so that a rank that ran out also shadows those broadcasts)."""
    torch.manual_seed(0)
    model = mlp()
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.002,
              find_unused_parameters=find_unused)
    if zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=0.01, process_group=group)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(10 + r)
    with Join([ddp, opt] if zero else [ddp]):
        for _ in range(2 + 2 * r):
            x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    return model


def case_ddp_join_and_zero():
    """The ranks that run out of data first (DDP's join() for uneven inputs) and
    ZeroRedundancyOptimizer: against the same on gloo, identical on every rank."""
    same_model(uneven(None), uneven(common.GLOO), "DDP join() with uneven inputs, against gloo",
               rtol=1e-5, atol=1e-6)
    same_model(uneven(None, zero=True), uneven(common.GLOO, zero=True),
               "DDP join() and ZeroRedundancyOptimizer, against gloo", rtol=1e-5, atol=1e-6)
    # with find_unused_parameters, DDP's join hook hands the group's allreduce a bare tensor
    # (its map of used parameters), not a list: it was taken for a list of its elements
    same_model(uneven(None, find_unused=True), uneven(common.GLOO, find_unused=True),
               "DDP join() with find_unused_parameters, against gloo", rtol=1e-5, atol=1e-6)


def counted_average_hook(state, bucket):
    """Sums the bucket, then, in the future's callback, starts another collective (counting
    the ranks) and waits for it there, as PowerSGD's callbacks do."""
    def divide(fut):
        count = torch.ones(1)
        dist.all_reduce(count, async_op=True).get_future().wait()
        return fut.value()[0].div_(count)

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(divide)


def with_hook(hook, make_state=lambda group: None, group=None, **options):
    """DDP over `group` (None: the default one) with a communication hook."""
    def wrap(model):
        ddp = DDP(model, process_group=group, **options)
        ddp.register_comm_hook(make_state(group), hook)
        return ddp

    return wrap


def power_sgd(group):
    return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2)


def case_ddp_hooks_that_start_collectives():
    """A communication hook whose callbacks start collectives and wait for them (PowerSGD's
    way): they run on the thread that finished the bucket's allreduce, while the training
    thread starts the next buckets', in an order that differs between ranks; the names they
    get pair them all the same. Exact against one process; PowerSGD against gloo (one bucket:
    with several, gloo aborts) and, with several buckets, identical on every rank."""
    same_model(train(Net, with_hook(counted_average_hook, bucket_cap_mb=0.002)), train(Net),
               "DDP, a hook starting a collective in its callback, small buckets")
    same_model(train(Net, with_hook(powerSGD_hook.powerSGD_hook, power_sgd), steps=4),
               train(Net, with_hook(powerSGD_hook.powerSGD_hook, power_sgd, common.GLOO), steps=4),
               "PowerSGD against gloo's")
    several = train(Net, with_hook(powerSGD_hook.powerSGD_hook, power_sgd, bucket_cap_mb=0.002),
                    steps=4)
    for name, p in several.named_parameters():
        everywhere(p.detach(), f"PowerSGD, small buckets: {name}")


def one_step_lost(wrap, calls, steps, wrong, fragments, what, **tolerance):
    """Net trained `steps` steps through `wrap` (a DDP), `calls["step"]` telling its hooks the
    step: step `wrong` raises a RuntimeError holding `fragments` (this rank's), and the model
    then equals one process trained on the other steps' batches."""
    torch.manual_seed(0)
    model = Net()
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def step(k):
        calls["step"] = k
        x, y = data(k)
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x)), shard(y)).backward()
        opt.step()

    for k in range(steps):
        if k != wrong:
            step(k)
        else:
            expect(RuntimeError, fragments, step, k)
    kept = [k for k in range(steps) if k != wrong]
    same_model(model, train(Net, steps=len(kept), batches=lambda i: data(kept[i])), what,
               **tolerance)


def case_ddp_hook_raises_on_one_rank():
    """The last rank's hook callback raises at step 1, before starting the collective its
    callbacks start on every other rank (a mistake made on one rank only). There: the
    callback's error; on the others, at once, a MismatchError quoting it for the collective
    that will not come (not a stall, nor a wrong pairing with that rank's next call, which
    gloo matches by order). The training then goes on: step 1 is lost on every rank alike, so
    the model equals one process trained on the other batches. (With one bucket: once one
    bucket failed, DDP waits for no other, on any backend, and their reductions land in the
    buckets of the next step.) Then the same with a callback given to add_done_callback."""
    steps, wrong, bad = 4, 1, n - 1
    calls = {"step": 0}

    def hook(state, bucket):
        step = calls["step"]    # (a callback may run late: after an error DDP waits for no more)

        def divide(fut):
            if r == bad and step == wrong:
                raise ValueError(f"hook mistake on rank {r}")
            count = torch.ones(1)
            dist.all_reduce(count, async_op=True).get_future().wait()
            return fut.value()[0].div_(count)

        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(divide)

    fragments = (f"hook mistake on rank {bad}" if r == bad else
                 ["MismatchError", f"on rank {bad} a callback of collective",
                  f"raised ValueError: hook mistake on rank {bad}"])
    one_step_lost(with_hook(hook), calls, steps, wrong, fragments,  # one bucket: see docstring
                  "DDP after one rank's hook raised at one step")
    # The same mistake in a callback given to add_done_callback (torch logs its error, with a
    # traceback, on that rank): the others' collective started there fails the same way.
    finished, seen = threading.Event(), []

    def note(fut):
        try:
            if r == bad:
                raise ValueError(f"callback mistake on rank {r}")
            dist.all_reduce(torch.ones(2), async_op=True).wait()
        except hvd.MismatchError as exc:
            seen.append(str(exc))
        finally:
            finished.set()

    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.get_future().add_done_callback(note)
    work.wait()
    assert finished.wait(60), "add_done_callback's callback did not finish"
    if r != bad:
        assert seen and f"on rank {bad} a callback of collective" in seen[0] \
            and f"raised ValueError: callback mistake on rank {bad}" in seen[0], seen
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_ddp_bucket_fails_on_one_rank():
    """DDP's own allreduce (no hook) on every rank but the last, whose hook sends the bucket
    in float16 at step 1 (a mistake made on one rank only; DDP's default otherwise). Every
    rank's backward raises an error naming the MismatchError, at that step: on the hookless
    ranks DDP's reducer reads the failed future in C++ (torch's set_exception leaves it a
    success there, and the reducer then read an empty list: the process crashed). Training
    goes on, and the model equals one process trained on the other batches."""
    steps, wrong, bad = 4, 1 if n > 1 else None, n - 1
    calls = {"step": 0}

    def hook(state, bucket):
        if calls["step"] == wrong:
            return default_hooks.fp16_compress_hook(state, bucket)
        return default_hooks.allreduce_hook(state, bucket)

    one_step_lost(with_hook(hook) if r == bad else DDP, calls, steps, wrong,
                  ["MismatchError", "'dtype' differs", f"rank {bad}: 'float16'"],
                  "DDP after one rank's bucket failed at one step", rtol=1e-5, atol=1e-6)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16),
                         nn.ReLU(), nn.Linear(16, 10))


def case_fsdp():
    from torch.distributed.fsdp import fully_shard

    def sharded(model):
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    trained = train(mlp, sharded)
    same_model(trained, train(mlp, DDP), "FSDP (fully_shard) against DDP")
    # its sharded state through torch.distributed.checkpoint (each rank writes its shards; the
    # plan is gathered and scattered as objects) into a fresh model: the same parameters
    import torch.distributed.checkpoint as dcp
    box = [tempfile.mkdtemp(prefix="dcp-") if r == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        dcp.save({"model": trained.state_dict()}, checkpoint_id=box[0])
        torch.manual_seed(1)
        fresh = sharded(mlp())
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=box[0])
        fresh.load_state_dict(state["model"])
        for (name, p), q in zip(fresh.named_parameters(), trained.parameters()):
            check_equal(p.full_tensor(), q.full_tensor(), f"FSDP state saved and loaded: {name}")
        # the whole state on rank 0 alone (cpu_offload), loaded into a fresh model by
        # broadcast_from_rank0, where torch asks the group which devices it serves
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, set_model_state_dict)
        whole = get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
        assert (len(whole) > 0) == (r == 0), f"rank {r} holds {len(whole)} entries"
        torch.manual_seed(2)
        loaded = sharded(mlp())
        set_model_state_dict(loaded, whole, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        for (name, p), q in zip(loaded.named_parameters(), trained.parameters()):
            check_equal(p.full_tensor(), q.full_tensor(), f"broadcast_from_rank0: {name}")
        # async_save on a group of its own (its collectives run on the saving thread) while
        # this thread goes on reducing on the default group
        saving = dist.new_group(list(range(n)))
        future = dcp.async_save({"model": trained.state_dict()}, checkpoint_id=box[0] + "/async",
                                process_group=saving)
        for k in range(20):
            check_equal(reduced(torch.full((3,), float(k))), torch.full((3,), float(k * n)),
                        "all_reduce beside async_save")
        future.result()
        torch.manual_seed(3)
        fresh = sharded(mlp())
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=box[0] + "/async")
        fresh.load_state_dict(state["model"])
        for (name, p), q in zip(fresh.named_parameters(), trained.parameters()):
            check_equal(p.full_tensor(), q.full_tensor(), f"async_save, loaded: {name}")
        dist.destroy_process_group(saving)
        dist.barrier()
    finally:
        if r == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def case_torchmetrics():
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator().manual_seed(7)
    values, logits = torch.randn(60, generator=g), torch.randn(60, 4, generator=g)
    labels = torch.randint(0, 4, (60,), generator=g)     # (60: a shard per rank at 1 to 6)
    mean, accuracy = MeanMetric(), MulticlassAccuracy(num_classes=4, average="micro")
    mean.update(shard(values))
    accuracy.update(shard(logits), shard(labels))
    close(mean.compute(), values.mean(), "MeanMetric")
    whole = (logits.argmax(1) == labels).float().mean()
    close(accuracy.compute(), whole, "MulticlassAccuracy")


def case_accelerate():
    """Hugging Face Accelerate on our default group, started before Accelerator() (which then
    keeps it; on CPUs it takes cpu=True): prepare() wraps the model in DDP on that group and
    gives rank k the loader's batches k, k + n, ..., so training matches one process on the
    whole batch; gather_for_metrics returns every row once though the last rank runs short;
    reduce and gather_object go through the group too."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, gather_object
    from torch.utils.data import DataLoader, TensorDataset

    saved, threads = dict(os.environ), torch.get_num_threads()
    try:    # (Accelerate sets env:// variables and, where OMP_NUM_THREADS is unset, threads)
        accelerator = Accelerator(cpu=True)
        assert (accelerator.num_processes, accelerator.process_index) == (n, r)
        assert accelerator.distributed_type == DistributedType.MULTI_CPU   # (LOCAL_RANK set)
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps = [data(step) for step in range(3)]
        rows = TensorDataset(torch.cat([x for x, _ in steps]), torch.cat([y for _, y in steps]))
        model, opt, loader = accelerator.prepare(model, opt,
                                                 DataLoader(rows, batch_size=BATCH // n))
        assert isinstance(model, DDP) and model.process_group is dist.group.WORLD
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
        same_model(accelerator.unwrap_model(model), train(Net), "Accelerate")
        table = torch.arange(20.0).reshape(10, 2)     # 5 batches: short at 2 to 4 ranks
        seen = [accelerator.gather_for_metrics(batch) for (batch,) in
                accelerator.prepare(DataLoader(TensorDataset(table), batch_size=2))]
        check_equal(torch.cat(seen), table, "Accelerate gather_for_metrics")
        check_equal(accelerator.reduce(torch.tensor([r + 1]), reduction="sum"),
                    torch.tensor([n * (n + 1) // 2]), "Accelerate reduce")
        assert gather_object([r]) == list(range(n)), "Accelerate gather_object"
        accelerator.wait_for_everyone()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
    assert dist.get_backend() == "ringreduce"


def case_pipelining():
    """torch.distributed.pipelining: a stage per rank (its activations and gradients sent with
    batch_isend_irecv), GPipe and 1F1B over 4 micro-batches: each stage's gradients those of
    one process running the whole model on the whole batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    whole = nn.Sequential(*[nn.Linear(6, 6) for _ in range(n)])
    x, y = rand(8, 6, seed=3, rank=0), rand(8, 6, seed=4, rank=0)
    F.mse_loss(whole(x), y, reduction="sum").backward()
    mine = whole[r]
    want = [p.grad.clone() for p in mine.parameters()]
    for schedule in (ScheduleGPipe, Schedule1F1B):
        mine.zero_grad()
        stage = PipelineStage(mine, r, n, torch.device("cpu"))
        run = schedule(stage, n_microbatches=4, scale_grads=False,
                       loss_fn=lambda out, target: F.mse_loss(out, target, reduction="sum"))
        run.step(*([x] if r == 0 else []), **({"target": y} if r == n - 1 else {}))
        for p, g in zip(mine.parameters(), want):
            close(p.grad, g, f"{schedule.__name__}: stage {r}'s gradient", rtol=1e-4, atol=1e-5)


def case_tensor_parallel():
    """torch.distributed.tensor.parallel on a mesh of every rank: a column-wise then a
    row-wise sharded layer (DTensor's collectives, through torch's functional ones), trained
    against one process. The last rank alone feeding a shorter batch gets, as every rank does,
    our MismatchError when the output is read (functional collectives complete lazily)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 6 * n), nn.ReLU(), nn.Linear(6 * n, 4))

    sharded, whole = make(), make()
    parallelize_module(sharded, init_device_mesh("cpu", (n,)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for model in (sharded, whole):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            F.mse_loss(model(rand(6, 8, seed=step, rank=0)), rand(6, 4, seed=step + 5, rank=0)
                       ).backward()
            opt.step()
    same_model(sharded, whole, "tensor parallel", rtol=1e-5, atol=1e-6)
    if n > 1:
        rows = 5 if r == n - 1 else 6
        expect(hvd.MismatchError, ["'shape' differs", f"rank {n - 1}: (5, 4)"],
               lambda: float(sharded(rand(rows, 8, seed=9, rank=0)).sum()))
        x = rand(6, 8, seed=9, rank=0)
        close(sharded(x).detach() + 0, whole(x).detach(), "tensor parallel after")  # (+0: waits)
