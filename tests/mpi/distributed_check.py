"""torch.distributed on the "ringreduce" backend (ringreduce/distributed/__init__.py) under a real mpiexec.

Usage: distributed_check.py [lightning]

Every collective against gloo's result on a gloo group of the same launch (reductions, within
float tolerance) or a reference built from every rank's inputs (data movement, exact), with our
results bitwise identical across ranks; subgroups; send/recv (a sender's tensor of another
size or dtype: an error, the receiver's tensor untouched; receives matched in the order made;
a receive no one waits for yet still takes a peer's large send); the errors; the dtypes only
moved (bool, uint16/64, float8, complex64), bool reductions, DDP with a bool buffer; DDP (plain,
small buckets, gradient_as_bucket_view, static_graph, find_unused_parameters, no_sync with
accumulation, fp16_compress_hook, hooks whose callbacks start collectives: PowerSGD) against
one process on the whole batch; DDP's join() with uneven inputs and ZeroRedundancyOptimizer
against gloo; FSDP (fully_shard) against DDP, its state saved and loaded by
torch.distributed.checkpoint (also async_save on a group of its own beside training calls) and
its whole state loaded from rank 0 alone (broadcast_from_rank0); torchmetrics syncing to the
whole-data value; Hugging Face Accelerate (prepare, gather_for_metrics) against one process;
pipelining (GPipe, 1F1B) and tensor parallelism against one process; thousands of small calls
on both front doors leaving no objects alive.
With `lightning` (2 ranks): first our Lightning strategy, which starts torch.distributed's
default group on our backend (torchmetrics syncs through it), then Lightning's own DDP
strategy with process_group_backend="ringreduce", which starts it by env:// (torch's
init_process_group), then a stalled rank's report. Each case prints "CASE <name> ok rank <r>".
"""
import datetime
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as hvd
import ringreduce.distributed as rrd
from checks import check_equal, expect, run_cases
from models import Embedder, Net

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
LIGHTNING = "lightning" in sys.argv[1:]
STALL_CHECK_TIME = 1.0 if LIGHTNING else 60.0      # (case_stall's report, at 2 ranks)
hvd.init(stall_check_time=STALL_CHECK_TIME)
r, n = hvd.rank(), hvd.size()
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


# ---------------------------------------------------------------- helpers

def rand(*shape, seed=0, rank=None):
    """Rank `rank`'s (default: this rank's) input: the same on every call."""
    g = torch.Generator().manual_seed(1000 * seed + (r if rank is None else rank))
    return torch.randn(*shape, generator=g)


def close(got, want, what, rtol=1e-5, atol=1e-6):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    assert torch.allclose(got, want, rtol=rtol, atol=atol), \
        f"{what}: off by {(got - want).abs().max().item():.3g}"


def everywhere(t, what):
    """Bitwise identical on every rank."""
    hvd.check_consistency([(what, t)])


def against_gloo(fn, what, rtol=1e-5):
    """fn(group) on our default group and on gloo's: close, ours identical everywhere."""
    ours, theirs = fn(None), fn(GLOO)
    close(ours, theirs, what, rtol=rtol)
    everywhere(ours, what)
    return ours


def reduced(x, op=SUM, group=None, async_op=False):
    x = x.clone()
    work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
    if async_op:
        assert work.get_future().wait()[0] is x
        work.wait()
    return x


# ---------------------------------------------------------------- collectives

def case_all_reduce():
    x, positive = rand(37), 1 + 0.1 * rand(37, seed=1)
    for op, t in ((SUM, x), (dist.ReduceOp.PRODUCT, positive), (dist.ReduceOp.MIN, x),
                  (dist.ReduceOp.MAX, x)):
        against_gloo(lambda g: reduced(t, op, g), f"all_reduce {op}")
    total = reduced(x, SUM, GLOO)
    close(reduced(x, AVG), total / n, "all_reduce AVG")
    close(reduced(x, dist._make_nccl_premul_sum(0.5)), total * 0.5, "all_reduce PREMUL_SUM")
    close(reduced(x, SUM, async_op=True), total, "all_reduce async_op")
    big = rand(300_000, seed=2)          # the node's blocks, not its slots
    against_gloo(lambda g: reduced(big, SUM, g), "all_reduce 1.2 MB")
    ints = torch.arange(10, dtype=torch.int64) * (r + 1)
    check_equal(reduced(ints), torch.arange(10) * (n * (n + 1) // 2), "all_reduce int64")
    strided = rand(8, 6, seed=3).t()     # not contiguous: reduced, written back in place
    against_gloo(lambda g: reduced(strided, SUM, g), "all_reduce transposed")


def case_all_reduce_coalesced():
    def run(group):
        tensors = [rand(5, seed=4), rand(2, 3, seed=5)]
        dist.all_reduce_coalesced(tensors, group=group)
        return torch.cat([t.reshape(-1) for t in tensors])
    against_gloo(run, "all_reduce_coalesced")


def case_coalesced():
    """FSDP's coalescing manager: several all_gather_into_tensor / reduce_scatter_tensor calls
    become one allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced."""
    outs, ins = [torch.empty(3 * n), torch.empty(n, 2)], [rand(3, seed=40), rand(2, seed=41)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for out, x in zip(outs, ins):
            dist.all_gather_into_tensor(out, x)
    cm.wait()
    for out, seed, width in ((outs[0], 40, 3), (outs[1], 41, 2)):
        want = torch.cat([rand(width, seed=seed, rank=k) for k in range(n)])
        check_equal(out.reshape(-1), want, f"coalesced all_gather_into_tensor seed {seed}")
    outs = [torch.empty(3), torch.empty(2, 2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], rand(3 * n, seed=42))
        dist.reduce_scatter_tensor(outs[1], rand(2 * n, 2, seed=43))
    cm.wait()
    for out, seed, shape in ((outs[0], 42, (3 * n,)), (outs[1], 43, (2 * n, 2))):
        whole = sum(rand(*shape, seed=seed, rank=k) for k in range(n))
        close(out.reshape(-1), whole.reshape(n, -1)[r], f"coalesced reduce_scatter_tensor {seed}")

    def uneven():
        with dist._coalescing_manager():
            dist.reduce_scatter_tensor(torch.empty(3), rand(3 * n + 1, seed=44))
    expect(ValueError, "must hold" if n > 1 else "4 torch.float32 elements arrived", uneven)

    def older_form():
        with dist._coalescing_manager(device=torch.device("cpu")):
            dist.all_reduce(torch.ones(2))
    expect(hvd.UnsupportedError, "coalescing manager given a device", older_form)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after refusal")


def case_broadcast():
    for src in range(n):
        x = rand(5, 3, seed=6)
        dist.broadcast(x, src=src)
        check_equal(x, rand(5, 3, seed=6, rank=src), f"broadcast from {src}")


def case_all_gather():
    outputs = [torch.empty(4, 2) for _ in range(n)]
    dist.all_gather(outputs, rand(4, 2, seed=7))
    for k in range(n):
        check_equal(outputs[k], rand(4, 2, seed=7, rank=k), f"all_gather from {k}")
    want = torch.cat([rand(3, seed=8, rank=k) for k in range(n)])
    for shape in ((3 * n,), (n, 3)):
        out = torch.empty(shape)
        work = dist.all_gather_into_tensor(out, rand(3, seed=8), async_op=True)
        work.wait()
        check_equal(out.reshape(-1), want, f"all_gather_into_tensor {shape}")


def case_calls_keep_nothing_alive():
    """Hundreds of small calls, each kind on both front doors, leave no objects behind: a
    per-call object kept alive (the stall watch once kept each call's closures to name it in
    a report) is promoted by the garbage collector and later swept by a full collection, a
    pause of ~80 ms with torch loaded, every ~100k calls."""
    x = torch.ones(256)
    calls = {"allreduce_ (small way)": lambda: hvd.allreduce_(x, op=hvd.Max),
             "allreduce_async_ + synchronize": lambda: hvd.synchronize(
                 hvd.allreduce_async_(x, op=hvd.Max)),
             "allreduce_ of 1 MiB (general path)": lambda: hvd.allreduce_(
                 torch.ones(1 << 18), op=hvd.Max),
             "broadcast_ (signature check)": lambda: hvd.broadcast_(x, 0),
             "dist.all_reduce async": lambda: dist.all_reduce(x, dist.ReduceOp.MAX,
                                                              async_op=True).wait(),
             "dist.broadcast": lambda: dist.broadcast(x, 0)}
    kept = {}
    for what, call in calls.items():
        for _ in range(10):
            call()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            for _ in range(500):
                call()
            kept[what] = len(gc.get_objects()) - before
        finally:
            gc.enable()
    assert all(k < 50 for k in kept.values()), f"objects left by 500 calls: {kept}"
    check_equal(x, torch.ones(256), "the calls' tensor")


def case_reduce_scatter():
    def listed(group, op=SUM):
        out = torch.empty(4)
        dist.reduce_scatter(out, [rand(4, seed=10 + k) for k in range(n)], op=op, group=group)
        return out

    def tensor(group, op=SUM):
        out = torch.empty(2, 3)
        dist.reduce_scatter_tensor(out, rand(2 * n, 3, seed=20), op=op, group=group)
        return out

    for run in (listed, tensor):
        ours, theirs = run(None), run(GLOO)
        close(ours, theirs, f"reduce_scatter ({run.__name__})")
        close(run(None, AVG), theirs / n, f"reduce_scatter AVG ({run.__name__})")


def case_all_to_all():
    counts = [[(a + b) % 3 + 1 for b in range(n)] for a in range(n)]     # rows a sends b

    def rows(k):
        return 100 * k + torch.arange(sum(counts[k]), dtype=torch.float32).unsqueeze(1) \
            * torch.ones(1, 2)

    def mine_from(k):
        start = sum(counts[k][:r])
        return rows(k)[start:start + counts[k][r]]

    out = torch.empty(sum(counts[k][r] for k in range(n)), 2)
    dist.all_to_all_single(out, rows(r), [counts[k][r] for k in range(n)], counts[r])
    check_equal(out, torch.cat([mine_from(k) for k in range(n)]), "all_to_all_single uneven")
    even = torch.empty(2 * n)
    dist.all_to_all_single(even, 10 * r + torch.arange(2.0 * n))
    want = torch.cat([10 * k + torch.arange(2.0 * r, 2.0 * r + 2) for k in range(n)])
    check_equal(even, want, "all_to_all_single even")
    outputs = [torch.empty(counts[k][r]) for k in range(n)]
    dist.all_to_all(outputs, [torch.full((counts[r][k],), float(r)) for k in range(n)])
    for k in range(n):
        check_equal(outputs[k], torch.full((counts[k][r],), float(k)), f"all_to_all from {k}")


def case_strided_inputs():
    """Tensors that are not contiguous, which gloo takes (all_to_all_single aside) and the
    Horovod-style collectives refuse as Horovod's do: the backend copies them, and writes an
    in-place result back."""
    def strided(seed):
        return rand(3, 2 * n, seed=seed).t()     # (2n, 3), not contiguous

    def coalesced(group):
        tensors = [strided(50), strided(51)]
        dist.all_reduce_coalesced(tensors, group=group)
        return torch.cat([t.reshape(-1) for t in tensors])

    def broadcast(group):
        x = strided(52)
        dist.broadcast(x, src=n - 1, group=group)
        return x

    def gathered(group):
        outs = [torch.empty(2 * n, 3) for _ in range(n)]
        dist.all_gather(outs, strided(53), group=group)
        into = torch.empty(2 * n * n, 3)
        dist.all_gather_into_tensor(into, strided(54), group=group)
        return torch.cat([*outs, into])

    def reduced(group):         # (on the root; then each rank's rows)
        x, out = strided(55), torch.empty(2, 3)
        dist.reduce(x, dst=0, group=group)
        dist.reduce_scatter_tensor(out, strided(56), group=group)
        return torch.cat([x, out]) if r == 0 else out

    for run in (coalesced, broadcast, gathered):
        against_gloo(run, f"{run.__name__}, not contiguous")
    close(reduced(None), reduced(GLOO), "reduce and reduce_scatter_tensor, not contiguous")
    got = torch.empty(2 * n, 3)
    dist.all_to_all_single(got, strided(57))
    want = torch.cat([rand(3, 2 * n, seed=57, rank=k).t()[2 * r:2 * r + 2] for k in range(n)])
    check_equal(got, want, "all_to_all_single, not contiguous")
    # input_split_sizes must cover the input's rows, as gloo checks (alltoall itself sends the
    # rows they cover, as Horovod's)
    expect(ValueError, "input_split_sizes", dist.all_to_all_single, torch.empty(n, 3),
           torch.ones(n + 1, 3), [1] * n, [1] * n)


def case_reduce_gather_scatter():
    root = n - 1
    x = rand(6, seed=30)
    ours, theirs = x.clone(), x.clone()
    dist.reduce(ours, dst=root)
    dist.reduce(theirs, dst=root, group=GLOO)
    if r == root:
        close(ours, theirs, "reduce")
    gathered = [torch.empty(6) for _ in range(n)] if r == 0 else None
    dist.gather(x, gathered, dst=0)
    if r == 0:
        for k in range(n):
            check_equal(gathered[k], rand(6, seed=30, rank=k), f"gather from {k}")
    out = torch.empty(2, 2)
    pieces = [torch.full((2, 2), 10.0 * k) for k in range(n)] if r == 1 % n else None
    dist.scatter(out, pieces, src=1 % n)
    check_equal(out, torch.full((2, 2), 10.0 * r), "scatter")
    dist.barrier()
    dist.barrier(async_op=True).wait()


def case_send_recv():
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(3, 2)
    works = [dist.isend(rand(3, 2, seed=40), right, tag=7), dist.irecv(got, left, tag=7)]
    for work in works:
        work.wait()
    check_equal(got, rand(3, 2, seed=40, rank=left), "isend/irecv ring")
    got = torch.empty(4)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(r)), right),
           dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.get_future().wait()
    check_equal(got, torch.full((4,), float(left)), "batch_isend_irecv")
    if r == 0:
        anywhere = torch.empty(2)
        assert dist.recv(anywhere, tag=9) == n - 1
        check_equal(anywhere, torch.full((2,), 5.0), "recv from any source")
    elif r == n - 1:
        dist.send(torch.full((2,), 5.0), 0, tag=9)
    # a sender's tensor of another size or dtype: an error naming both on the receiver, whose
    # tensor is left as it was; the next message of that tag arrives whole (also a large one,
    # which MPI sends only once its receive is posted)
    large = 1 << 15     # float32s: 128 KiB
    sent = [torch.ones(3), torch.ones(5), torch.ones(4, dtype=torch.int32), torch.ones(3),
            torch.ones(large), torch.ones(large + 1), torch.ones(large, dtype=torch.int32),
            torch.ones(4), torch.arange(4.0), torch.arange(4.0)]
    if r == 0:
        works = [dist.isend(tensor, 1, tag=11) for tensor in sent]
        for work in works:
            work.wait()
    elif r == 1:
        for got, fragments in [
                (torch.full((4,), 7.0), ["rank 0 sent 3 float32 elements (12 bytes)",
                                         "4 float32 elements ((4,), 16 bytes)", "left as it"]),
                (torch.full((2, 2), 7.0), ["sent 5 float32 elements (20 bytes)", "((2, 2),"]),
                (torch.full((4,), 7.0), ["sent 4 int32 elements", "of 4 float32 elements"]),
                (torch.full((4, 2), 7.0)[:, 0], ["sent 3 float32", "4 float32 elements"]),
                (torch.full((4,), 7.0), [f"sent {large} float32 elements ({4 * large} bytes)",
                                         "4 float32 elements ((4,), 16 bytes)"]),
                (torch.full((large,), 7.0), [f"sent {large + 1} float32", f"of {large} float32"]),
                (torch.full((large,), 7.0), [f"sent {large} int32", f"of {large} float32"]),
                (torch.full((large,), 7.0), ["sent 4 float32", f"of {large} float32"])]:
            expect(hvd.RingReduceError, fragments, dist.recv, got, 0, tag=11)
            check_equal(got, torch.full(got.shape, 7.0), "a receive that failed")
        got = torch.empty(2, 2)
        dist.recv(got, 0, tag=11)
        check_equal(got, torch.arange(4.0).reshape(2, 2), "a receive after those that failed")
        columns = torch.zeros(4, 2)
        dist.recv(columns[:, 1], 0, tag=11)     # (not contiguous: it lands, then is copied)
        check_equal(columns, torch.stack([torch.zeros(4), torch.arange(4.0)], 1),
                    "a receive into a strided tensor")
    # receives that a message could match get them in the order they were made, whichever
    # is waited for first; one from another sender is not held back by them
    # (small and large ones mixed)
    lengths = [large, 2, large, 2, 2, large]
    sends = [dist.isend(torch.full((length,), float(k)), 0, tag=21)
             for k, length in enumerate(lengths)] if r == n - 1 else []
    if r == 0:
        got = [torch.empty(length) for length in lengths]
        works = [dist.irecv(got[k], None if k % 2 else n - 1, tag=21)
                 for k in range(len(lengths))]
        for k in (4, 2, 5, 1, 3, 0):
            works[k].wait()
        for k, length in enumerate(lengths):
            check_equal(got[k], torch.full((length,), float(k)), f"receive {k} of tag 21")
        assert {work.source_rank() for work in works} == {n - 1}
    for work in sends:
        work.wait()
    # a receive nobody waits for yet still takes its bytes (a peer's large send waits for
    # that): here rank 0 waits in an all_reduce while rank 1's send of 4 MiB completes
    big = torch.arange(1 << 20, dtype=torch.float32)
    if r == 0:
        got = torch.empty(1 << 20)
        work = dist.irecv(got, 1, tag=22)
        check_equal(reduced(torch.ones(2), SUM), torch.full((2,), float(n)),
                    "an all_reduce while a receive is pending")
        work.wait()
        check_equal(got, big, "a large receive waited for after an all_reduce")
    else:
        if r == 1:
            dist.send(big, 0, tag=22)
        reduced(torch.ones(2), SUM)
    # on one rank alone, a thread of its own waits in a large receive while the main thread
    # all_reduces with every rank
    if r == 0:
        got, outcome = torch.empty(1 << 20), []

        def receive():
            try:
                outcome.append(dist.recv(got, 1, tag=26))
            except Exception as error:
                outcome.append(error)

        waiter = threading.Thread(target=receive)
        waiter.start()
        check_equal(reduced(torch.ones(2), SUM), torch.full((2,), float(n)),
                    "an all_reduce beside another thread's receive")
        waiter.join(60)
        assert not waiter.is_alive() and outcome == [1], outcome
        check_equal(got, big + 1, "a large receive on a thread of one rank")
    else:
        if r == 1:
            dist.send(big + 1, 0, tag=26)
        reduced(torch.ones(2), SUM)
    # every rank receives from its left while it waits for its own large send to the right
    got = torch.empty(1 << 20)
    work = dist.irecv(got, left, tag=25)
    dist.send(big + r, right, tag=25)
    work.wait()
    check_equal(got, big + left, "large sends and receives around the ring")
    # every dtype's bytes, an empty tensor, a strided one sent
    for k, t in enumerate([torch.empty(0), torch.arange(6, dtype=torch.bfloat16),
                           torch.tensor([True, False]), torch.arange(3.0).to(torch.complex64),
                           torch.arange(8, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.arange(4.0).reshape(2, 2).t()]):
        if r == 0:
            dist.send(t, n - 1, tag=30 + k)
        elif r == n - 1:
            got = torch.empty(t.shape, dtype=t.dtype)
            dist.recv(got, 0, tag=30 + k)
            assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), k
    # a receive still waiting when its group is destroyed fails, naming it
    pair = dist.new_group([0, n - 1])
    if r == 0:
        orphan = dist.irecv(torch.empty(2), n - 1, group=pair, tag=5)
    if r in (0, n - 1):
        dist.destroy_process_group(pair)
    if r == 0:
        expect(hvd.RingReduceError, ["recv from rank 1 (tag 5)",
                                     "the group was destroyed before the message came"],
               orphan.wait)
    if n >= 3:      # rank 1 sends to rank 0 only after rank 0 has received rank n-1's
        if r == 0:
            first, second = torch.empty(1), torch.empty(1)
            from_1 = dist.irecv(first, 1, tag=23)
            dist.irecv(second, n - 1, tag=23).wait()
            dist.send(torch.ones(1), 1, tag=24)
            from_1.wait()
            check_equal(torch.cat([first, second]), torch.tensor([1.0, float(n - 1)]),
                        "receives from two senders")
        elif r == 1:
            dist.recv(torch.empty(1), 0, tag=24)
            dist.send(torch.ones(1), 0, tag=23)
        elif r == n - 1:
            dist.send(torch.full((1,), float(n - 1)), 0, tag=23)
    # torch's wait(timeout): a receive not complete by then raises; it stays posted
    if r == 0:
        late = torch.empty(2)
        work = dist.irecv(late, n - 1, tag=13)
        expect(hvd.RingReduceError, ["recv from rank", "wait()'s timeout"], work.wait,
               datetime.timedelta(seconds=0.2))
    dist.barrier()
    if r == n - 1:
        dist.send(torch.full((2,), 3.0), 0, tag=13)
    elif r == 0:
        assert work.wait()
        check_equal(late, torch.full((2,), 3.0), "a receive waited for again after a timeout")
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": r, "pad": "x" * 10 * r})
    assert objects == [{"rank": k, "pad": "x" * 10 * k} for k in range(n)], objects
    box = [f"from {n - 1}"] if r == n - 1 else [None]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [f"from {n - 1}"], box
    gathered = [None] * n if r == 1 else None
    dist.gather_object(("at", r), gathered, dst=1)
    assert gathered == ([("at", k) for k in range(n)] if r == 1 else None), gathered
    mine = [None]
    dist.scatter_object_list(mine, [f"to {k}" for k in range(n)] if r == n - 1 else None,
                             src=n - 1)
    assert mine == [f"to {r}"], mine


def case_subgroup():
    ends = [0, n - 1]
    ours, gloo = dist.new_group(ends), dist.new_group(ends, backend="gloo")
    if r in ends:
        assert dist.get_backend(ours) == "ringreduce"
        # answered as by a group with a backend per device (torch's helpers ask)
        assert ours._device_types == [torch.device("cpu"), torch.device("cuda")]
        assert ours._get_backend(torch.device("cpu")) is ours and not ours.supports_splitting
        assert dist.distributed_c10d._get_pg_default_device(ours) == torch.device("cpu")
        x = rand(9, seed=50)
        close(reduced(x, SUM, ours), reduced(x, SUM, gloo), "all_reduce on [0, n-1]")
        outputs = [torch.empty(9) for _ in ends]
        dist.all_gather(outputs, x, group=ours)
        for k, global_rank in enumerate(ends):
            check_equal(outputs[k], rand(9, seed=50, rank=global_rank), "subgroup all_gather")
        y = x.clone()
        dist.broadcast(y, src=n - 1, group=ours)
        check_equal(y, rand(9, seed=50, rank=n - 1), "subgroup broadcast")
        if r == 0:
            dist.send(torch.full((2,), 3.0), n - 1, group=ours)
        else:
            got = torch.empty(2)
            dist.recv(got, 0, group=ours)
            check_equal(got, torch.full((2,), 3.0), "subgroup send/recv")
        dist.destroy_process_group(ours)        # (members only)
        dist.destroy_process_group(gloo)
    again = dist.new_group(ends)                # a new set under a new label
    if r in ends:
        check_equal(reduced(torch.ones(2), SUM, again), torch.full((2,), 2.0), "group again")
        dist.destroy_process_group(again)
    # a group of rank 0 alone, used by rank 0 alone while the others reduce on the default
    # group (a set of one takes the small way, asynchronous calls too, on the caller's thread)
    alone = dist.new_group([0])
    if r == 0:
        x = rand(5, seed=51)
        check_equal(reduced(x, AVG, alone, async_op=True), x, "AVG on a group of one")
        check_equal(reduced(x, dist.ReduceOp.MAX, alone, async_op=True), x,
                    "MAX on a group of one")
        dist.destroy_process_group(alone)
    check_equal(reduced(torch.ones(3)), torch.full((3,), float(n)), "beside a group of one")


def case_threads_each_on_a_group_of_its_own():
    """Two threads calling collectives at once, each on a group of its own, in an order that
    differs between ranks (the documented way: one group's calls pair by position)."""
    groups = [dist.new_group(list(range(n))) for _ in range(2)]
    results, errors = {}, []

    def calls(k):
        try:
            got = []
            for i in range(40):
                if (i + k + r) % 3 == 0:
                    time.sleep(0.001)           # another interleaving on each rank
                x = torch.arange(5.0) + 10 * i + 1000 * k * r      # exact sums
                if k == 0:
                    dist.all_reduce(x, group=groups[0])
                else:
                    dist.broadcast(x, src=n - 1, group=groups[1])
                got.append(x)
            results[k] = got
        except Exception as e:                  # reported below, on the case's thread
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(results) == 2, errors or "a thread did not finish"
    for i in range(40):
        check_equal(results[0][i], (torch.arange(5.0) + 10 * i) * n, f"all_reduce {i}")
        check_equal(results[1][i], torch.arange(5.0) + 10 * i + 1000 * (n - 1),
                    f"broadcast {i}")
    for group in groups:
        dist.destroy_process_group(group)


def case_errors():
    shaped = torch.ones(3 if r == 0 else 4)
    expect(hvd.MismatchError, ["shape", "(3,)", "(4,)"], dist.all_reduce, shaped)
    typed = torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64)
    expect(hvd.MismatchError, ["dtype", "float32", "float64"], dist.all_reduce, typed)
    expect(hvd.MismatchError, "shape", dist.all_gather_into_tensor,
           torch.empty(n * shaped.numel()), shaped)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")
    expect(hvd.UnsupportedError, ["ReduceOp.BAND", "integer or bool"], dist.all_reduce,
           torch.ones(2), op=dist.ReduceOp.BAND)
    expect(hvd.UnsupportedError, ["ReduceOp.BOR is not supported", "BXOR by all_reduce and"],
           dist.all_reduce_coalesced, [torch.ones(2, dtype=torch.int64)], op=dist.ReduceOp.BOR)
    group = dist.group.WORLD
    expect(hvd.UnsupportedError, "one tensor per call", group.allreduce,
           [torch.ones(1), torch.ones(1)], dist.AllreduceOptions())
    expect(ValueError, "GLOO", dist.monitored_barrier)


def case_one_rank_errs():
    """A mistake made on rank 0 alone: an error there, the others' results right, and the
    group usable after it."""
    def async_then_wait(x, op=SUM):         # rank 0 begins on its thread, the others queue
        work = dist.all_reduce(x, op=op, async_op=r == 0)
        return work.wait() if work is not None else None
    expect(hvd.MismatchError, ["shape", "(3,)", "(4,)"], async_then_wait,
           torch.ones(3 if r == 0 else 4))
    expect(hvd.MismatchError, "op", async_then_wait, torch.ones(2),
           dist.ReduceOp.MAX if r == 0 else SUM)
    want = [rand(2, seed=50, rank=k) for k in range(n)]
    outputs = [torch.empty(2) for _ in range(n - 1 if r == 0 else n)]
    if r == 0:
        expect(ValueError, ["allgather on rank 0", f"takes {n} output"], dist.all_gather,
               outputs, rand(2, seed=50))
    else:
        dist.all_gather(outputs, rand(2, seed=50))
        for k in range(n):
            check_equal(outputs[k], want[k], f"all_gather from {k} beside rank 0's mistake")
    out = torch.empty(2 * n + (1 if r == 0 else 0))
    if r == 0:
        expect(ValueError, "all_gather_into_tensor on rank 0", dist.all_gather_into_tensor,
               out, rand(2, seed=50))
    else:
        dist.all_gather_into_tensor(out, rand(2, seed=50))
        check_equal(out, torch.cat(want), "all_gather_into_tensor beside rank 0's mistake")
    # wrong output_split_sizes on rank 0: the error from the future and from wait(), each time
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    got = torch.empty(2 * n)
    splits = [2] * n if r else [1] * (n - 1) + [n + 1]
    work = dist.all_to_all_single(got, x, output_split_sizes=splits, async_op=True)
    if r == 0:
        expect(ValueError, "output_split_sizes", work.get_future().wait)
        expect(ValueError, "output_split_sizes", work.wait)
        expect(ValueError, "output_split_sizes", work.wait)
        assert isinstance(work.exception(), ValueError) and not work.is_success()
    else:
        work.wait()
        want = torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * k
                          for k in range(n)])
        check_equal(got, want, "all_to_all_single beside rank 0's mistake")
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_one_rank_refuses_its_inputs():
    """A mistake in rank 0's inputs, found before its collective could begin: ValueError
    (an unsupported op: UnsupportedError) there, at once a MismatchError quoting it on every
    other rank (not a wait for a call never made), and the group usable after each."""
    def refused(call, words, error=ValueError):
        if r == 0:
            expect(error, ["on rank 0", words], call, True)
        else:
            expect(hvd.MismatchError, ["rank 0", words], call, False)
    rows = [torch.ones(2) for _ in range(n)]
    refused(lambda bad: dist.reduce_scatter(torch.empty(2), rows + [torch.ones(2)] * bad),
            f"takes {n} input")
    refused(lambda bad: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n + bad)),
            f"multiple of {n}")
    refused(lambda bad: dist.scatter(torch.empty(2), (rows[:n - 1] if bad else rows)
                                     if r == 0 else None, src=0),
            f"takes {n} input")
    refused(lambda bad: dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n + bad)),
            "does not divide")
    refused(lambda bad: dist.all_to_all([torch.empty(1) for _ in range(n)],
                                        [torch.ones(1) for _ in range(n + bad)]),
            f"takes {n} input")
    refused(lambda bad: dist.all_reduce(torch.ones(2, dtype=torch.bool if bad else torch.uint8),
                                        op=AVG),
            "bool tensor takes SUM")
    refused(lambda bad: dist.broadcast(torch.ones(4).to_sparse() if bad else torch.ones(4),
                                       src=0),
            "dense tensors", TypeError)
    # a root or an op that rank 0 alone gets wrong (found before the call could begin)
    bad = n + 3
    refused(lambda bad_root: dist.broadcast(torch.ones(2), src=bad if bad_root else 0),
            f"rank {bad} is not a rank of")
    refused(lambda bad_root: dist.reduce(torch.ones(2), dst=bad if bad_root else 0),
            f"rank {bad} is not a rank of")
    refused(lambda bad_root: dist.gather(torch.ones(2), None, dst=bad if bad_root else 0),
            f"rank {bad} is not a rank of")
    refused(lambda bad_op: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND if bad_op
                                           else SUM),
            "ReduceOp.BAND takes integer or bool tensors", hvd.UnsupportedError)
    refused(lambda bad_op: dist.reduce(torch.ones(2), dst=0,
                                       op=dist.ReduceOp.BOR if bad_op else SUM),
            "ReduceOp.BOR takes integer or bool tensors", hvd.UnsupportedError)
    refused(lambda bad_op: dist.reduce_scatter_tensor(
        torch.empty(1, dtype=torch.int64), torch.ones(n, dtype=torch.int64),
        op=dist.ReduceOp.BXOR if bad_op else SUM),
        "ReduceOp.BXOR is not supported", hvd.UnsupportedError)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_one_rank_calls_another_kind():
    """Rank 0 alone calls another kind of collective at a position of the group's sequence
    (small ones inline or queued, large ones on the general path): a MismatchError naming
    each rank's kind on every rank at once, not a wait for calls never made; then the group
    is usable."""
    small, big = rand(4, seed=60), rand(1 << 15, seed=61)

    def mixed(mine, theirs, kinds):
        expect(hvd.MismatchError, ["'collective' differs", "rank 0", *kinds],
               mine if r == 0 else theirs)
        check_equal(reduced(torch.full((2,), r + 1.0)), torch.full((2,), n * (n + 1) / 2),
                    "all_reduce after the mismatch")

    mixed(dist.barrier, lambda: dist.all_reduce(small.clone()), ["barrier", "allreduce"])
    mixed(lambda: dist.all_reduce(small.clone(), async_op=True).wait(),
          lambda: dist.broadcast(small.clone(), src=0), ["allreduce", "broadcast"])
    mixed(lambda: dist.all_gather_into_tensor(torch.empty(n * big.numel()), big),
          lambda: dist.all_reduce(big.clone(), async_op=True).wait(),
          ["allgather", "allreduce"])
    mixed(lambda: dist.reduce_scatter_tensor(torch.empty(big.numel()), big.repeat(n)),
          dist.barrier, ["reducescatter", "barrier"])
    # the calls with a root, each made of one without: rank 0 would have kept a result
    mixed(lambda: dist.reduce(small.clone(), dst=0), lambda: dist.all_reduce(small.clone()),
          ["'reduce'", "'allreduce'"])
    rows = [torch.empty(4) for _ in range(n)]
    mixed(lambda: dist.gather(small, rows, dst=0), lambda: dist.all_gather(rows, small),
          ["'gather'", "'allgather'"])
    # a bitwise op (an allgather within) where the others sum, or take another bitwise op
    flags = torch.arange(4, dtype=torch.int32)
    for theirs, name in ((SUM, "Sum"), (dist.ReduceOp.BOR, "BOR")):
        expect(hvd.MismatchError, ["'op' differs", "rank 0: 'BAND'", name], dist.all_reduce,
               flags.clone(), op=dist.ReduceOp.BAND if r == 0 else theirs)
    mixed(lambda: dist.scatter(torch.empty(4), [small] * n, src=0),
          lambda: dist.all_to_all_single(torch.empty(4 * n), small.repeat(n)),
          ["'scatter'", "'alltoall'"])
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_one_rank_names_another_root():
    """The last rank alone names itself the root of a reduce, gather, scatter or broadcast,
    where the others name rank 0: a MismatchError on every rank, and no output written (a
    reduce or gather had two roots keep a result, a scatter failed on one rank alone with a
    shape error); then the group is usable."""
    root = n - 1 if r == n - 1 else 0
    x = torch.full((2,), r + 1.0)

    def refused(call, output):
        before = output.clone()
        expect(hvd.MismatchError, ["'root_rank' differs", "rank 0: 0", f"rank {n - 1}: {n - 1}"],
               call)
        check_equal(output, before, "an output after a refused call")

    refused(lambda: dist.reduce(x, dst=root), x)
    rows = [torch.zeros(2) for _ in range(n)]
    refused(lambda: dist.gather(x, rows if r == root else None, dst=root), torch.stack(rows))
    out = torch.zeros(2)
    sent = [torch.full((2,), k + 10.0) for k in range(n)]
    refused(lambda: dist.scatter(out, sent if r == root else None, src=root), out)
    refused(lambda: dist.broadcast(x, src=root), x)
    dist.scatter(out, sent if r == 0 else None, src=0)
    check_equal(out, torch.full((2,), r + 10.0), "scatter after them")
    dist.reduce(x, dst=0)
    if r == 0:
        check_equal(x, torch.full((2,), n * (n + 1) / 2), "reduce after them")


def sparse_entries(k, length=6):
    """Rank k's sparse COO vector, not coalesced: a row every rank shares, and a row of its
    own k + 1 times (duplicates add up; each rank holds another number of entries); integer
    values, so every sum is exact."""
    indices = torch.tensor([[length - 1] + [k] * (k + 1)])
    values = torch.tensor([10.0] + [k + 1.0] * (k + 1))
    return torch.sparse_coo_tensor(indices, values, (length,))


def case_sparse_all_reduce():
    """A sparse COO tensor (a sparse embedding's gradient, as DDP hands it over) reduced as
    gloo reduces one: the sum of every rank's entries, coalesced and written over the input,
    exact and identical on every rank, for SUM, AVG and PREMUL_SUM, synchronous or not; a
    rank that passes a dense tensor, a sparse one of another size or an op we do not reduce
    fails every rank's call at once; DDP on a model with a sparse embedding trains to one
    process's parameters."""
    total = sum(sparse_entries(k).to_dense() for k in range(n))
    for label, op, scale in (("SUM", SUM, 1.0), ("AVG", AVG, 1.0 / n),
                             ("PREMUL_SUM", dist._make_nccl_premul_sum(0.5), 0.5)):
        for async_op in (False, True):
            mine = sparse_entries(r)
            work = dist.all_reduce(mine, op=op, async_op=async_op)
            if async_op:
                assert work.get_future().wait()[0] is mine
                work.wait()
            what = f"sparse all_reduce {label} async_op={async_op}"
            assert mine.is_sparse and mine.is_coalesced(), f"{what}: not coalesced sparse"
            if label == "AVG":      # each rank's values divided, then added: not exact
                close(mine.to_dense(), total * scale, what)
            else:
                check_equal(mine.to_dense(), total * scale, what)
            everywhere(mine.to_dense(), what)
            everywhere(mine._indices(), f"{what}: indices")
    theirs = sparse_entries(r)
    dist.all_reduce(theirs, group=GLOO)
    ours = reduced(sparse_entries(r))
    check_equal(ours._indices(), theirs._indices(), "sparse all_reduce's indices, as gloo's")
    check_equal(ours._values(), theirs._values(), "sparse all_reduce's values, as gloo's")
    if n > 1:       # (mistakes that need another rank)
        expect(hvd.MismatchError, ["'collective' differs", "sparse_allreduce", "allreduce"],
               dist.all_reduce, sparse_entries(r) if r == 0 else torch.ones(6))
        expect(hvd.MismatchError, ["'dense shape' differs", "(6,)", "(7,)"], dist.all_reduce,
               sparse_entries(r, 6 if r == 0 else 7))
    if r == 0:
        expect(hvd.UnsupportedError, ["sparse tensor on rank 0", "not MAX"], dist.all_reduce,
               sparse_entries(r), op=dist.ReduceOp.MAX)
    else:
        expect(hvd.MismatchError, ["mistake in the arguments of rank 0", "not MAX"],
               dist.all_reduce, sparse_entries(r))
    # the other calls take dense tensors only, as gloo: a TypeError naming the call and rank
    rows = 12       # (divides by 1 to 4)
    for kind, call in (
            ("broadcast", lambda: dist.broadcast(sparse_entries(r, rows), src=0)),
            ("allgather", lambda: dist.all_gather([torch.empty(rows) for _ in range(n)],
                                                  sparse_entries(r, rows))),
            ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(
                torch.empty(rows * n), sparse_entries(r, rows))),
            ("reduce", lambda: dist.reduce(sparse_entries(r, rows), dst=0)),
            ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(
                torch.empty(rows // n), sparse_entries(r, rows))),
            ("all_to_all_single", lambda: dist.all_to_all_single(
                torch.empty(rows), sparse_entries(r, rows)))):
        expect(TypeError, [kind, f"rank {r}", "dense tensors"], call)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")
    reference, wrapped = train(Embedder, batches=tokens), train(Embedder, DDP, batches=tokens)
    assert wrapped.embedding.weight.grad.is_sparse, "DDP's embedding gradient is not sparse"
    same_model(wrapped, reference, "DDP, sparse embedding")


def tokens(step):
    """A batch of rows of 5 tokens for Embedder, with labels."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 20, (BATCH, 5), generator=g), torch.randint(0, 3, (BATCH,), generator=g)


# dtypes we do not reduce, which torch's callers still move: DDP broadcasts a model's buffers
# (a transformer's bool causal mask), libraries gather bool and uint tensors
MOVED = (torch.bool, torch.uint16, torch.uint64, torch.float8_e4m3fn, torch.complex64)


def moved(dtype, k, rows=2):
    """Rank k's input of `dtype`: `rows` rows of 3, different on every rank."""
    base = torch.arange(rows * 3).reshape(rows, 3) + 7 * k
    if dtype == torch.bool:
        return base % (k + 2) == 0
    if dtype == torch.complex64:
        return torch.complex(base.float(), -base.float())
    return base.to(torch.float32 if dtype.is_floating_point else torch.int64).to(dtype)


def same_bits(got, want, what):
    """Same dtype, shape and bytes (float8 has no torch.equal)."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    check_equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8), what)


def case_dtypes_moved_and_bool_reduced():
    """Every data-moving collective takes any dtype of 1, 2, 4 or 8 bytes an element, on both
    front doors, the dtype still in the signature; bool reduces as gloo reduces it; DDP takes
    a model with a bool buffer."""
    root = n - 1
    for dtype in MOVED:
        what = f"{dtype} "
        x = moved(dtype, r)
        dist.broadcast(x, src=root)
        same_bits(x, moved(dtype, root), what + "broadcast")
        outs = [torch.empty(2, 3, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, moved(dtype, r))
        for k in range(n):
            same_bits(outs[k], moved(dtype, k), what + f"all_gather from {k}")
        out = torch.empty(2 * n, 3, dtype=dtype)
        dist.all_gather_into_tensor(out, moved(dtype, r))
        same_bits(out, torch.cat([moved(dtype, k) for k in range(n)]), what + "into tensor")
        got = torch.empty(n, 3, dtype=dtype)
        dist.all_to_all_single(got, moved(dtype, r, rows=n))
        same_bits(got, torch.stack([moved(dtype, k, rows=n)[r] for k in range(n)]),
                  what + "all_to_all_single")
        whole = torch.cat([moved(dtype, k) for k in range(n)])
        same_bits(hvd.allgather(moved(dtype, r)), whole, what + "hvd.allgather")
        same_bits(hvd.broadcast(moved(dtype, r), root), moved(dtype, root), what + "hvd.broadcast")
    strided = moved(torch.bool, r, rows=3).t()          # not contiguous: written back in place
    dist.broadcast(strided, src=0)
    same_bits(strided, moved(torch.bool, 0, rows=3).t(), "bool broadcast transposed")
    typed = torch.zeros(3, dtype=torch.bool if r == 0 else torch.uint8)
    if n > 1:
        expect(hvd.MismatchError, ["dtype", "bool", "uint8"], dist.broadcast, typed, src=0)
    flags = torch.stack([moved(torch.bool, k) for k in range(n)])
    for op, want in ((SUM, flags.any(0)), (dist.ReduceOp.MAX, flags.any(0)),
                     (dist.ReduceOp.MIN, flags.all(0)), (dist.ReduceOp.PRODUCT, flags.all(0))):
        for async_op in (False, True):
            check_equal(reduced(moved(torch.bool, r), op, async_op=async_op), want,
                        f"bool all_reduce {op} async_op={async_op}")
    kept = moved(torch.bool, r)
    dist.reduce(kept, dst=root, op=dist.ReduceOp.MIN)
    check_equal(kept, flags.all(0) if r == root else moved(torch.bool, r), "bool reduce MIN")
    expect(ValueError, ["bool", "not AVG"], dist.all_reduce, moved(torch.bool, r), AVG)
    # BAND, BOR, BXOR as gloo has them, on integer and bool tensors
    folds = {dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
             dist.ReduceOp.BXOR: torch.bitwise_xor}
    for dtype in (torch.uint8, torch.int32, torch.int64, torch.bool):
        mine = [moved(dtype, k) if dtype == torch.bool else (torch.arange(6).reshape(2, 3)
                * (k + 3) + k).to(dtype) for k in range(n)]
        for op, fold in folds.items():
            want = mine[0]
            for k in range(1, n):
                want = fold(want, mine[k])
            for async_op in (False, True):
                same_bits(reduced(mine[r], op, async_op=async_op), want,
                          f"{dtype} all_reduce {op} async_op={async_op}")
            kept = mine[r].clone().t()      # (not contiguous: written in place)
            dist.reduce(kept, dst=root, op=op)
            same_bits(kept, want.t() if r == root else mine[r].t(), f"{dtype} reduce {op}")
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")
    same_model(train(Masked, DDP), train(Masked), "DDP with a bool buffer")


def case_bool_and_complex_in_every_reduction():
    """Bool tensors reduce as gloo reduces them in every reduction (reduce_scatter in both
    forms, all_reduce_coalesced, the coalescing manager's all_reduce), and complex ones in
    reduce and reduce_scatter, which torch hands the backend as they are (all_reduce's it
    turns into real ones first)."""
    flags = torch.stack([moved(torch.bool, k, rows=n).reshape(-1) for k in range(n)])
    width = flags.shape[1] // n
    for op, want in ((SUM, flags.any(0)), (dist.ReduceOp.MAX, flags.any(0)),
                     (dist.ReduceOp.MIN, flags.all(0)), (dist.ReduceOp.PRODUCT, flags.all(0))):
        mine = want[r * width:(r + 1) * width]
        out = torch.empty(width, dtype=torch.bool)
        dist.reduce_scatter_tensor(out, flags[r].clone(), op=op)
        check_equal(out, mine, f"bool reduce_scatter_tensor {op}")
        out = torch.empty(width, dtype=torch.bool)
        dist.reduce_scatter(out, list(flags[r].clone().chunk(n)), op=op)
        check_equal(out, mine, f"bool reduce_scatter {op}")
    outs = [torch.empty(width, dtype=torch.bool) for _ in range(2)]
    with dist._coalescing_manager():
        for out in outs:
            dist.reduce_scatter_tensor(out, flags[r].clone())
    for out in outs:
        check_equal(out, flags.any(0)[r * width:(r + 1) * width],
                    "bool reduce_scatter_tensor SUM, coalesced")
    pair = [flags[r][:3].clone(), flags[r][3:].clone()]
    dist.all_reduce_coalesced(pair)
    check_equal(torch.cat(pair), flags.any(0), "bool all_reduce_coalesced SUM")
    pair = [flags[r][:3].clone(), flags[r][3:].clone()]
    with dist._coalescing_manager():
        for t in pair:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
    check_equal(torch.cat(pair), flags.all(0), "bool all_reduce MIN, coalesced")

    def mixed():        # (torch's all_reduce_coalesced refuses mixed dtypes itself)
        with dist._coalescing_manager():
            dist.all_reduce(flags[r].clone())
            dist.all_reduce(torch.ones(2))
    expect(hvd.ArgumentTypeError, "mixes bool tensors", mixed)

    def waves(k, rows=2 * n):
        return torch.complex(rand(rows, 3, seed=60, rank=k), rand(rows, 3, seed=61, rank=k))
    whole = sum(waves(k) for k in range(n))
    root = n - 1
    for op, want in ((SUM, whole), (AVG, whole / n)):
        kept = waves(r).t()         # (not contiguous: written in place)
        dist.reduce(kept, dst=root, op=op)
        close(kept.t(), want if r == root else waves(r), f"complex reduce {op}")
        out = torch.empty(2, 3, dtype=torch.complex64)
        dist.reduce_scatter_tensor(out, waves(r), op=op)
        close(out, want[2 * r:2 * r + 2], f"complex reduce_scatter_tensor {op}")
        out = torch.empty(2, 3, dtype=torch.complex64)
        dist.reduce_scatter(out, list(waves(r).chunk(n)), op=op)
        close(out, want[2 * r:2 * r + 2], f"complex reduce_scatter {op}")
    expect(hvd.ArgumentTypeError, ["complex", "not MAX"], dist.reduce, waves(r), dst=0,
           op=dist.ReduceOp.MAX)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_works_polled_and_their_values():
    """A Work polled with is_completed() alone, as gloo's users may, completes with its outputs
    written (without wait()); its future's value is gloo's (all_gather: the output list;
    gather: the root's list, elsewhere none; all_gather_into_tensor: the output's chunk per
    rank); a synchronous all_reduce of a parameter's transposed view runs, as on gloo."""
    root = n - 1
    gathered = [torch.empty(2) for _ in range(n)]
    flat = torch.empty(2 * n)
    gather_list = [torch.empty(2) for _ in range(n)] if r == root else None
    scattered = torch.empty(2)
    rows = torch.empty(n)
    summed = torch.empty(2)
    kept = rand(2, seed=71)
    strided = rand(4, 3, seed=72).t()
    calls = {
        "all_gather": lambda: dist.all_gather(gathered, rand(2, seed=70), async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(flat, rand(2, seed=70),
                                                                      async_op=True),
        "gather": lambda: dist.gather(rand(2, seed=70), gather_list, dst=root, async_op=True),
        "scatter": lambda: dist.scatter(scattered, [rand(2, seed=73, rank=k) for k in range(n)]
                                        if r == root else None, src=root, async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(
            rows, torch.arange(n, dtype=torch.float32) + 10 * r, async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            summed, rand(2 * n, seed=74), async_op=True),
        "reduce": lambda: dist.reduce(kept, dst=root, async_op=True),
        "all_reduce, transposed": lambda: dist.all_reduce(strided, async_op=True),
    }
    works = {what: call() for what, call in calls.items()}
    deadline = time.monotonic() + 30
    for what, work in works.items():
        while not work.is_completed():
            assert time.monotonic() < deadline, f"{what}: never completed while polled"
            time.sleep(0.001)
    want = [rand(2, seed=70, rank=k) for k in range(n)]
    for k in range(n):
        check_equal(gathered[k], want[k], f"all_gather polled, from {k}")
    check_equal(flat, torch.cat(want), "all_gather_into_tensor polled")
    if r == root:
        for k in range(n):
            check_equal(gather_list[k], want[k], f"gather polled, from {k}")
    check_equal(scattered, rand(2, seed=73, rank=r), "scatter polled")
    check_equal(rows, torch.tensor([10.0 * k + r for k in range(n)]), "all_to_all_single polled")
    close(summed, sum(rand(2 * n, seed=74, rank=k) for k in range(n))[2 * r:2 * r + 2],
          "reduce_scatter_tensor polled")
    close(kept, sum(rand(2, seed=71, rank=k) for k in range(n)) if r == root
          else rand(2, seed=71), "reduce polled")
    close(strided, sum(rand(4, 3, seed=72, rank=k) for k in range(n)).t(),
          "all_reduce transposed, polled")
    values = {what: work.get_future().wait() for what, work in works.items()}
    assert len(values["all_gather"]) == n and all(
        v is t for v, t in zip(values["all_gather"], gathered)), "all_gather's value"
    assert len(values["gather"]) == (n if r == root else 0), "gather's value"
    chunks = values["all_gather_into_tensor"]
    assert len(chunks) == n and all(c.shape == (2,) for c in chunks), "into tensor's value"
    check_equal(torch.cat(chunks), flat, "all_gather_into_tensor's value")
    weight = nn.Parameter(rand(4, 3, seed=75))
    dist.all_reduce(weight.t())         # (in place on a view of a leaf: as gloo, no error)
    close(weight.detach(), sum(rand(4, 3, seed=75, rank=k) for k in range(n)),
          "all_reduce of a parameter's transposed view")


# ---------------------------------------------------------------- DDP, FSDP, torchmetrics

BATCH = 24          # divides by 1, 2, 3 (and each half by 2 and 3)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def shard(t):
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


class WithUnused(nn.Module):
    """Net with a layer the forward never uses (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.net, self.unused = Net(), nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


class Masked(nn.Module):
    """Net with a bool buffer, as a causal mask is (DDP broadcasts buffers)."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.register_buffer("keep", torch.arange(10) % 3 != 0)

    def forward(self, x):
        return self.net(x).masked_fill(~self.keep, 0.0)


def train(make, wrap=None, steps=3, accumulate=1, batches=None):
    """SGD with momentum on `batches(step)` (default: `data`); `wrap` makes the distributed
    model (then each rank takes its shard of every micro-batch), None trains one process on
    the whole batch."""
    torch.manual_seed(0)
    model = make()
    stepper = wrap(model) if wrap is not None else model
    opt = torch.optim.SGD(stepper.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = (batches or data)(step)
        opt.zero_grad()
        for k, (mx, my) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            if wrap is not None:
                mx, my = shard(mx), shard(my)
            last = k == accumulate - 1
            sync = stepper.no_sync() if wrap is not None and not last else nullcontext()
            with sync:
                F.cross_entropy(stepper(mx), my).backward()
        opt.step()
    return model


def same_model(got, want, what, rtol=1e-6, atol=1e-7):
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        close(full.detach(), q.detach(), f"{what}: {name}", rtol=rtol, atol=atol)
        everywhere(full.detach(), f"{what}: {name}")


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


def uneven(group, zero=False):
    """DDP over `group` (None: the default one) inside `join()`, rank k taking 2 + 2k steps of
    its own data (uneven inputs: the ranks that run out shadow the others' collectives), with
    Adam, or ZeroRedundancyOptimizer (each rank steps its shard, then broadcasts it: joined
    too, so that a rank that ran out also shadows those broadcasts)."""
    torch.manual_seed(0)
    model = mlp()
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.002)
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
    same_model(uneven(None), uneven(GLOO), "DDP join() with uneven inputs, against gloo",
               rtol=1e-5, atol=1e-6)
    same_model(uneven(None, zero=True), uneven(GLOO, zero=True),
               "DDP join() and ZeroRedundancyOptimizer, against gloo", rtol=1e-5, atol=1e-6)


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
               train(Net, with_hook(powerSGD_hook.powerSGD_hook, power_sgd, GLOO), steps=4),
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


# ---------------------------------------------------------------- Lightning (2 ranks)

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
    member; the default group goes on, and a group made after works."""
    before = dist.new_group(list(range(n)))
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


def case_init_that_torch_refuses_then_again():
    """torch refusing an argument of our init_process_group (a CPU device_id, on every rank)
    after the store is up: every rank raises torch's ValueError at once (rank 0's store, the
    server, outlives the others' connects, which waited out the timeout before), and the
    next call starts the default group."""
    global GLOO
    dist.destroy_process_group()
    expect(ValueError, "device_id", rrd.init_process_group, device_id=torch.device("cpu"))
    assert not dist.is_initialized()
    rrd.init_process_group()
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "the default group again")
    GLOO = dist.new_group(backend="gloo")


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


# ---------------------------------------------------------------- run

def announced(case):
    def run():
        start = time.monotonic()
        case()
        print(f"CASE {case.__name__} ok rank {r} ({time.monotonic() - start:.1f} s)", flush=True)

    run.__name__ = case.__name__
    return run


first = [case_lightning_ringreduce_strategy, case_lightning_ddp] if LIGHTNING else []
run_cases([announced(case) for case in first], r)
if not dist.is_initialized():
    rrd.init_process_group()
assert dist.get_backend() == "ringreduce" and dist.get_world_size() == n
GLOO = dist.new_group(backend="gloo")
cases = [case_all_reduce, case_all_reduce_coalesced, case_coalesced, case_broadcast,
         case_all_gather, case_calls_keep_nothing_alive, case_reduce_scatter, case_all_to_all,
         case_strided_inputs, case_reduce_gather_scatter, case_send_recv, case_subgroup,
         case_threads_each_on_a_group_of_its_own, case_errors,
         case_one_rank_errs, case_one_rank_refuses_its_inputs,
         case_one_rank_calls_another_kind, case_one_rank_names_another_root,
         case_sparse_all_reduce,
         case_dtypes_moved_and_bool_reduced, case_bool_and_complex_in_every_reduction,
         case_works_polled_and_their_values, case_ddp,
         case_ddp_hooks_that_start_collectives, case_ddp_hook_raises_on_one_rank,
         case_ddp_bucket_fails_on_one_rank, case_ddp_join_and_zero, case_fsdp,
         case_torchmetrics, case_accelerate, case_pipelining, case_tensor_parallel,
         case_a_group_does_not_outlive_a_restart, case_init_that_torch_refuses_then_again]
# Alone, a rank has no peer to send to, to make a subgroup of two with, or to disagree with.
PEERS_NEEDED = (case_send_recv, case_subgroup, case_errors, case_one_rank_errs,
                case_one_rank_refuses_its_inputs, case_one_rank_calls_another_kind,
                case_one_rank_names_another_root)
cases = [case for case in cases if n > 1 or case not in PEERS_NEEDED]
run_cases([announced(case) for case in cases + ([case_stall] if LIGHTNING else [])], r)
dist.destroy_process_group()
print(f"OK rank {r}", flush=True)
