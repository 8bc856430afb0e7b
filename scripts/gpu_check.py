"""The GPU check (run by scripts/gpu_check.sh under mpiexec -n 2, and 4 for the GPU node way;
the ranks share GPU 0 on a machine with one, and take a GPU each by local rank where there are
more).

1. allreduce of CUDA tensors for every dtype and op, on the GPU node way (CUDA IPC), the
   staging path and (where the MPI supports it) the CUDA-aware path, against a reference built
   from every rank's inputs, and bitwise identical across ranks; grouped, in-place, async,
   scaled and compressed variants, one-shot and two-shot;
2. a few DistributedOptimizer steps of a small model against one process on the whole batch
   (rtol 1e-5), on each path; collectives after work queued on a side stream (allreduce,
   Adasum, a custom compressor's bucket, a broadcast read from another stream);
3. busbw of allreduce from 1 MiB to 256 MiB on each path, next to its yardsticks in the same
   run: for staging, the same allreduce of host tensors and the pinned copy down and back up
   (both ranks at once); for CUDA-aware, the GPU's device-to-device copy (`--json FILE`: that
   table, with the run's metadata);
4. the collectives that move data (Horovod's, SyncBatchNorm) and the torch.distributed
   backend on CUDA tensors: each collective DDP and FSDP call, against a reference built from
   every rank's inputs (exact), and DDP training against one process.
Each case reports on its own and the next still runs, so that one failing does not hide the
others (the ranks stay in step: a case's collectives run on every rank whatever it found).
On 2 ranks (sharing GPU 0) the MPI moves the data; on 1 rank (a set of one) the reductions
run in device memory, by our CUDA kernels. Every rank prints 'OK rank <r>' at the end.
"""
import argparse
import functools
import hashlib
import json
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as hvd
import ringreduce.distributed as rrd
from bench_common import metadata
from ringreduce.gpu import cuda_aware

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
# Lengths that take the small-message path, the ring, and more than one staging piece.
LENGTHS = [0, 1, 17, 40_001, 1_300_007]
SIZES_MIB = [1, 4, 16, 64, 256]
world = MPI.COMM_WORLD


def inputs(rank, length, dtype, op, device):
    """Small integers, so every reduction is exact in every dtype."""
    g = torch.Generator().manual_seed(7919 * rank + 31 * length + int(op))
    lo, hi = (-2, 3) if op == hvd.Product else (-8, 9)
    x = torch.randint(0 if dtype == torch.uint8 else lo, hi, (length,), generator=g)
    return x.to(dtype).to(device)


def reference(length, dtype, op, n, pre=1.0, post=1.0):
    xs = torch.stack([inputs(k, length, dtype, op, "cpu").double() * pre for k in range(n)])
    out = {hvd.Sum: lambda: xs.sum(0), hvd.Average: lambda: xs.sum(0),
           hvd.Min: lambda: xs.min(0).values, hvd.Max: lambda: xs.max(0).values,
           hvd.Product: lambda: xs.prod(0)}[op]().to(dtype)
    if op == hvd.Average:
        out = out / n if dtype.is_floating_point else (out.double() * (1.0 / n)).to(dtype)
    return out * post if post != 1.0 else out


def differs_across_ranks(t):
    """Collective (every rank calls it, with None where its call failed): why the ranks'
    results differ, or None."""
    raw = b"" if t is None else t.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    digests = world.allgather(hashlib.blake2b(raw).digest())
    return "results differ across ranks" if len(set(digests)) > 1 else None


def mismatch(got, want):
    """Why `got` is not exactly `want`, or None."""
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    return None if torch.equal(got, want) else f"got {got[:6]} want {want[:6]}"


def check(got, want, what):
    problem = mismatch(got, want)
    assert problem is None, f"{what}: {problem}"


def checked(what, device, call, want, failures):
    """One allreduce case, reported rather than raised, so that the cases after it still
    run: `call()` makes the result, which must equal `want` exactly, lie on `device` and
    agree across ranks. The agreement is a collective that every rank makes, whether its
    own call failed or not, so the ranks stay in step."""
    got = None
    try:
        got = call()
        problem = f"result on {got.device}" if got.device != device else mismatch(got, want)
    except Exception as error:      # (a refusal or a failure: the next case still runs)
        problem = f"{type(error).__name__}: {error}"
    across = differs_across_ranks(got)      # (on every rank, whatever it found)
    problem = problem or across
    if problem:
        failures.append(f"{what}: {problem}")
        print(f"rank {world.rank}: FAILED {what}: {problem}", flush=True)


def check_allreduce(path, device):
    """Every case runs and reports; raises at the end, naming how many failed."""
    n, failures = hvd.size(), []
    for dtype in DTYPES:
        for op in OPS:
            for length in LENGTHS:
                checked(f"{path} allreduce {dtype} {op.name} length {length}", device,
                        lambda: hvd.allreduce(inputs(hvd.rank(), length, dtype, op, device),
                                              op=op),
                        reference(length, dtype, op, n), failures)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        checked(f"{path} scaled {dtype}", device,
                lambda: hvd.allreduce_(inputs(hvd.rank(), 40_001, dtype, hvd.Average, device),
                                       op=hvd.Average, prescale_factor=2.0,
                                       postscale_factor=0.5),
                reference(40_001, dtype, hvd.Average, n, 2.0, 0.5), failures)
    shapes = ((5, torch.float32), (300_001, torch.bfloat16), (7, torch.int64))
    for i, (k, d) in enumerate(shapes):     # one grouped call per case, its i-th result checked
        checked(f"{path} grouped, tensor {i}", device,
                lambda: hvd.grouped_allreduce([inputs(hvd.rank(), size, kind, hvd.Sum, device)
                                               for size, kind in shapes], op=hvd.Sum)[i],
                reference(k, d, hvd.Sum, n), failures)
    checked(f"{path} fp16-compressed async", device,
            lambda: hvd.synchronize(hvd.allreduce_async(
                inputs(hvd.rank(), 70_001, torch.float32, hvd.Sum, device), op=hvd.Sum,
                compression=hvd.Compression.fp16)),
            reference(70_001, torch.float32, hvd.Sum, n), failures)
    for dtype in (torch.float16, torch.bfloat16):   # rounding: as torch's own add, bit for bit
        g = [torch.Generator().manual_seed(k) for k in range(n)]
        xs = [torch.randn(300_007, generator=gk).to(dtype) for gk in g]
        checked(f"{path} rounding {dtype}", device,
                lambda: hvd.allreduce(xs[hvd.rank()].to(device), op=hvd.Sum),
                xs[0] if n == 1 else xs[0] + xs[1], failures)
    assert not failures, f"{path}: {len(failures)} allreduce cases failed (above)"
    print(f"rank {hvd.rank()}: {path}: allreduce of every dtype and op matches", flush=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8 * 8 * 8, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def train(model, batches, distributed, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             first_bucket_bytes=4096, **options)
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def check_training(path, device):
    """Each rank trains on its half of every batch; one process trains on whole batches. In
    full float32 (no TF32) with deterministic cuDNN, so that only the reduction differs."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 1, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g))
               for _ in range(5)]
    torch.manual_seed(1)
    initial = Net().to(device).state_dict()
    single = Net().to(device)
    single.load_state_dict(initial)
    train(single, [(x.to(device), y.to(device)) for x, y in batches], False)
    r, n = hvd.rank(), hvd.size()
    mine = [(x.chunk(n)[r].to(device), y.chunk(n)[r].to(device)) for x, y in batches]
    differ = []     # (checked after both layouts, so that a rank failing goes on in step)
    for options in ({}, {"gradient_as_bucket_view": True}):
        model = Net().to(device)
        model.load_state_dict(initial)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        train(model, mine, True, **options)
        hvd.check_consistency(model)
        differ += [f"{path} {options}: '{name}' differs from the single-process run by "
                   f"{(a - b).abs().max().item():.3g}"
                   for (name, a), b in zip(model.named_parameters(), single.parameters())
                   if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    assert not differ, "; ".join(differ)
    print(f"rank {r}: {path}: 5 optimizer steps match the single-process run", flush=True)


def check_ordering(path, device):
    """Work queued on a side stream, behind a long sleep, is what the collectives see: a plain
    allreduce, Adasum (which reduces on the host), a bucket under a compressor of the user's
    own (its compression queued on the caller's stream), and a broadcast's result read at once
    from another stream. Where a collective read before the stream got there, it would see the
    zeros (or ones) that stood there before."""
    n, side = hvd.size(), torch.cuda.Stream(device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        t = torch.zeros(1 << 20, device=device)
        torch.cuda._sleep(200_000_000)      # ~0.1 s of the GPU's cycles
        t.fill_(1.0)
        summed = hvd.allreduce(t, op=hvd.Sum)
    check(summed, torch.full((1 << 20,), float(n)), f"{path}: allreduce after a side stream")
    if n & (n - 1) == 0:        # (Adasum: a power of two ranks)
        with torch.cuda.stream(side):
            a = torch.zeros(4096, device=device)
            torch.cuda._sleep(200_000_000)
            a.fill_(2.0)
            combined = hvd.allreduce(a, op=hvd.Adasum)      # Adasum(x, x) is x
        check(combined, torch.full((4096,), 2.0), f"{path}: Adasum after a side stream")

    class Slow(hvd.Compression.none):      # a compressor of the user's own
        @staticmethod
        def compress(tensor):
            torch.cuda._sleep(200_000_000)
            return tensor.half() * 1, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.float()

    model = torch.nn.Linear(64, 64, bias=False).to(device)
    torch.nn.init.constant_(model.weight, 1.0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters(),
                                         compression=Slow, op=hvd.Sum)
    with torch.cuda.stream(side):
        model(torch.ones(1, 64, device=device)).sum().backward()   # every gradient 1
        optimizer.step()
    torch.cuda.synchronize()
    check(model.weight.detach(), torch.full((64, 64), 1.0 - n),
          f"{path}: a custom compressor's bucket after a side stream")
    b = (torch.full((3000,), 5.0, device=device) if hvd.rank() == 0
         else torch.zeros(3000, device=device))
    got = hvd.synchronize(hvd.broadcast_async(b, root_rank=0))
    with torch.cuda.stream(side):           # read at once from another stream
        seen = got.clone()
    side.synchronize()
    check(seen, torch.full((3000,), 5.0), f"{path}: a broadcast read from another stream")
    print(f"rank {hvd.rank()}: {path}: collectives wait for the caller's stream", flush=True)


def check_backend(device):
    """The torch.distributed backend with CUDA tensors (on the staging path with an MPI that
    cannot take device pointers); returns the names of the cases that failed."""
    rrd.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    failed = []

    def ints(rank, length, dtype=torch.int64):
        g = torch.Generator().manual_seed(101 * rank + length)
        return torch.randint(-8, 9, (length,), generator=g).to(dtype)

    def mine(length, dtype=torch.int64):
        return ints(r, length, dtype).to(device)

    def every(length, dtype=torch.int64):
        return torch.stack([ints(k, length, dtype) for k in range(n)])

    def case_allreduce():
        failures = []   # (reported at the end: every rank makes every call, whatever it found)
        for dtype in (torch.int64, torch.float32, torch.bfloat16):
            for op, want in ((dist.ReduceOp.SUM, lambda x: x.sum(0)),
                             (dist.ReduceOp.MAX, lambda x: x.amax(0)),
                             (dist.ReduceOp.MIN, lambda x: x.amin(0))):
                for length in (3, 1000, 300_001):
                    def reduced():
                        t = mine(length, dtype)
                        dist.all_reduce(t, op=op)
                        return t
                    checked(f"dist.all_reduce {dtype} {op} {length}", device, reduced,
                            want(every(length, dtype).double()).to(dtype), failures)
        assert not failures, f"{len(failures)} all_reduce cases failed (above)"
        t = mine(5000, torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).wait()
        check(t, (every(5000, torch.float32).double().sum(0) / n).float(), "AVG async")

    def case_async_future():
        works = [dist.all_reduce(mine(k, torch.float32), async_op=True) for k in (7, 70_001)]
        for k, work in zip((7, 70_001), works):
            got = work.get_future().wait()[0]
            check(got, every(k, torch.float32).sum(0), f"future of {k}")

    def case_broadcast():
        t = mine(40_000)
        dist.broadcast(t, src=n - 1)
        check(t, ints(n - 1, 40_000), "broadcast")

    def case_all_gather():
        out = torch.empty(n * 1000, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(out, mine(1000))
        check(out, every(1000).reshape(-1), "all_gather_into_tensor")
        outs = [torch.empty(10, dtype=torch.int64, device=device) for _ in range(n)]
        dist.all_gather(outs, mine(10))
        check(torch.cat(outs), every(10).reshape(-1), "all_gather")

    def case_reduce_scatter():
        out = torch.empty(1000, dtype=torch.int64, device=device)
        dist.reduce_scatter_tensor(out, mine(n * 1000))
        check(out, every(n * 1000).sum(0).reshape(n, -1)[r], "reduce_scatter_tensor")

    def case_bitwise():
        """BAND, BOR, BXOR of CUDA integer and bool tensors: an allgather of host rows, folded
        on the device."""
        for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and),
                         (dist.ReduceOp.BOR, torch.bitwise_or),
                         (dist.ReduceOp.BXOR, torch.bitwise_xor)):
            t = mine(1000)
            dist.all_reduce(t, op=op)
            check(t, functools.reduce(fold, every(1000).unbind()), f"all_reduce {op}")
            flags = mine(100) > 0
            dist.all_reduce(flags, op=op)
            check(flags, functools.reduce(fold, (every(100) > 0).unbind()),
                  f"bool all_reduce {op}")

    def case_all_to_all():
        out = torch.empty(n * 6, dtype=torch.int64, device=device)
        dist.all_to_all_single(out, mine(n * 6))
        check(out, every(n * 6).reshape(n, n, 6)[:, r].reshape(-1), "all_to_all_single")

    def case_send_recv():
        if r == 0 and n > 1:
            dist.send(mine(4097), dst=1)
        elif r == 1:
            got = torch.empty(4097, dtype=torch.int64, device=device)
            dist.recv(got, src=0)
            check(got, ints(0, 4097), "send/recv")
        dist.barrier()

    def case_ddp():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(32, 1, 16, 16, generator=g),
                    torch.randint(0, 10, (32,), generator=g)) for _ in range(5)]
        torch.manual_seed(1)
        single, model = Net().to(device), Net().to(device)
        model.load_state_dict(single.state_dict())
        train(single, [(x.to(device), y.to(device)) for x, y in batches], False)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=0.01)
        train(ddp, [(x.chunk(n)[r].to(device), y.chunk(n)[r].to(device))
                    for x, y in batches], False)
        differ = []     # (asserted after every rank's comparisons: they stay in step)
        for (name, a), b in zip(model.named_parameters(), single.parameters()):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                differ.append(f"'{name}' differs from one process by "
                              f"{(a - b).abs().max().item():.3g}")
            if differs_across_ranks(a.detach()):
                differ.append(f"'{name}' differs across ranks")
        assert not differ, "DDP: " + "; ".join(differ)

    def case_horovod_moves():
        """The Horovod API's collectives that move data: results on the input's device."""
        rows = torch.full((r + 1, 3), r, dtype=torch.int64, device=device)
        got = hvd.allgather(rows)
        want = torch.cat([torch.full((k + 1, 3), k) for k in range(n)])
        assert got.device == device, f"allgather result on {got.device}"
        check(got, want, "hvd.allgather")
        got = hvd.broadcast(mine(333), root_rank=n - 1)
        assert got.device == device, f"broadcast result on {got.device}"
        check(got, ints(n - 1, 333), "hvd.broadcast")
        got, received = hvd.alltoall(mine(n * 4), splits=torch.full((n,), 4, dtype=torch.int32,
                                                                     device=device))
        assert got.device == device, f"alltoall result on {got.device}"
        assert received.device == device, f"received splits on {received.device} (Horovod: " \
                                          "the splits' device)"
        check(received, torch.full((n,), 4, dtype=torch.int32), "hvd.alltoall received splits")
        check(got, every(n * 4).reshape(n, n, 4)[:, r].reshape(-1), "hvd.alltoall")
        got = hvd.reducescatter(mine(n * 10).reshape(n * 5, 2), op=hvd.Sum)
        assert got.device == device, f"reducescatter result on {got.device}"
        check(got, every(n * 10).sum(0).reshape(n, 5, 2)[r], "hvd.reducescatter")

    def case_horovod_join():
        """The last rank runs out of data first (hvd.join()): the others' allreduces of CUDA
        tensors meet its zeros, made on its GPU; Average still divides by every rank."""
        problems = []   # (join() on every rank, whatever the allreduces found)
        if r < n - 1:
            try:
                for op, dtype, want in ((hvd.Sum, torch.int64, every(1000)[:n - 1].sum(0)),
                                        (hvd.Average, torch.float64,
                                         every(1000, torch.float64)[:n - 1].sum(0) / n)):
                    got = hvd.allreduce(mine(1000, dtype), op=op)
                    problem = (f"result on {got.device}" if got.device != device
                               else mismatch(got, want))
                    if problem:
                        problems.append(f"{op} with a rank joined: {problem}")
            except Exception as error:
                problems.append(f"{type(error).__name__}: {error}")
        last = hvd.join()
        assert not problems, "; ".join(problems)
        assert last == max(n - 2, 0), f"join() returned {last}"

    def case_sync_batch_norm():
        """hvd.SyncBatchNorm on each rank's part of a batch against BatchNorm on all of it:
        outputs, input gradients and running statistics."""
        x = torch.randn(4 * n, 3, 5, generator=torch.Generator().manual_seed(3))
        plain, synced = torch.nn.BatchNorm1d(3).to(device), hvd.SyncBatchNorm(3).to(device)
        whole = x.to(device, copy=True).requires_grad_()
        want = plain(whole)
        want.pow(2).sum().backward()
        part = x.chunk(n)[r].to(device, copy=True).requires_grad_()
        got = synced(part)
        got.pow(2).sum().backward()
        for what, a, b in (("output", got, want.chunk(n)[r]),
                           ("input gradient", part.grad, whole.grad.chunk(n)[r]),
                           ("running mean", synced.running_mean, plain.running_mean),
                           ("running var", synced.running_var, plain.running_var)):
            assert a.device == device and torch.allclose(a, b, rtol=1e-4, atol=1e-5), \
                f"SyncBatchNorm {what}: differs by {(a - b).abs().max().item():.3g}"

    for case in (case_horovod_moves, case_horovod_join, case_sync_batch_norm, case_allreduce,
                 case_async_future, case_broadcast, case_all_gather, case_reduce_scatter,
                 case_bitwise,
                 case_all_to_all, case_send_recv, case_ddp):
        try:
            case()
            print(f"rank {r}: dist {case.__name__[5:]} ok", flush=True)
        except Exception as error:      # (reported; the next case still runs)
            failed.append(case.__name__[5:])
            print(f"rank {r}: dist {case.__name__[5:]} FAILED: {type(error).__name__}: "
                  f"{error}", flush=True)
    dist.destroy_process_group()
    try:        # torch's device_id (an accelerator only), through our init_process_group
        rrd.init_process_group(device_id=device)
        t = mine(1000, torch.float32)
        dist.all_reduce(t)
        check(t, every(1000, torch.float32).sum(0), "all_reduce after device_id=")
        print(f"rank {r}: dist device_id ok", flush=True)
    except Exception as error:
        failed.append("device_id")
        print(f"rank {r}: dist device_id FAILED: {type(error).__name__}: {error}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return failed


def busbw(mib, device, repeats):
    """Allreduce bus bandwidth in GB/s: bytes * 2(n-1)/n per second, the best of `repeats`."""
    t = torch.ones(mib << 18, dtype=torch.float32, device=device)
    hvd.allreduce_(t, op=hvd.Sum)                      # warm-up: kernels, pinned memory
    best = float("inf")
    for _ in range(repeats):
        hvd.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        hvd.allreduce_(t, op=hvd.Sum)
        best = min(best, time.perf_counter() - start)
    n = hvd.size()
    return (mib << 20) * 2 * (n - 1) / n / best / 1e9


def pinned_round_trip(mib, device, repeats):
    """What the staging path's copies can carry, in GB/s: `mib` MiB down to pinned host memory
    and back up (in order on one stream, as staging queues them) per second, every rank at
    once, the best of `repeats`."""
    here = torch.ones(mib << 18, dtype=torch.float32, device=device)
    host = torch.empty(here.shape, dtype=here.dtype, pin_memory=True)
    best = float("inf")
    for _ in range(repeats + 1):                        # the first is a warm-up
        hvd.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(here, non_blocking=True)
        here.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return (mib << 20) / best / 1e9


def copy_bandwidth(device):
    """Device-to-device copy of 256 MiB: bytes copied per second, in GB/s."""
    src = torch.ones(256 << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * (256 << 20) / (start.elapsed_time(end) / 1e3) / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-bench", action="store_true", help="skip the bandwidth table")
    parser.add_argument("--paths", help="only these paths, comma-separated (ipc, staging, "
                                        "cuda-aware)")
    parser.add_argument("--json", help="write the bandwidth table here (rank 0), for "
                                       "scripts/docs_figures.py (docs/figures/gpu-2ranks.json)")
    args = parser.parse_args()
    hvd.init()
    assert hvd.size() <= 4, "run on 1 to 4 ranks: mpiexec -n 2 python3 scripts/gpu_check.py"
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    aware, how = cuda_aware.query_cuda_support(MPI, world)
    hvd.shutdown()
    # each path's init() settings: the GPU node way (CUDA IPC), staging, CUDA-aware MPI
    paths = ({"device (a set of one)": {"cuda_aware": False}} if world.size == 1 else
             {"ipc": {"cuda_aware": False, "gpu_node_way": "ipc"},
              "staging": {"cuda_aware": False, "gpu_node_way": "staging"},
              **({"cuda-aware": {"cuda_aware": True, "gpu_node_way": "staging"}}
                 if aware else {})})
    if args.paths:
        paths = {p: paths[p] for p in args.paths.split(",") if p in paths}
    if world.rank == 0:
        print(f"{MPI.Get_library_version().splitlines()[0]}; {torch.cuda.get_device_name()}; "
              f"CUDA-aware: {aware} ({how})", flush=True)
    table, staging_yardsticks, failed = {}, {}, []

    def repeats(mib):
        return 5 if mib < 256 else 3

    def stage(label, run, **settings):
        """One part of the check in its own init(): a failure is reported, and the next part
        still runs (a device session is short: every failure in one run)."""
        hvd.init(**settings)
        try:
            run()
        except Exception as error:
            failed.append(label)
            print(f"rank {world.rank}: {label} FAILED: {type(error).__name__}: {error}",
                  flush=True)
        finally:
            hvd.shutdown()

    for path, setting in paths.items():
        for env in ({}, {"small_message_bytes": 0, "segment_bytes": 64 << 10}):
            label = path + (" (two-shot, ring only)" if env else "")
            stage(f"{label} allreduce", lambda: check_allreduce(label, device),
                  **setting, **env)
        stage(f"{path} training", lambda: check_training(path, device), **setting)
        stage(f"{path} ordering", lambda: check_ordering(path, device), **setting)
        if not args.no_bench and world.size > 1:     # (one rank moves no bus bytes)
            def bench():
                table[path] = [busbw(mib, device, repeats(mib)) for mib in SIZES_MIB]
            stage(f"{path} busbw", bench, **setting)
    if not args.no_bench and world.size > 1:
        def yardsticks():
            host = torch.device("cpu")
            staging_yardsticks.update({
                "host allreduce": [busbw(mib, host, repeats(mib)) for mib in SIZES_MIB],
                "pinned down+up": [pinned_round_trip(mib, device, repeats(mib))
                                   for mib in SIZES_MIB]})
        stage("staging yardsticks", yardsticks)
    run = (metadata(world, gpu=torch.cuda.get_device_name(), torch_cuda=torch.version.cuda,
                    cuda_aware=f"{aware} ({how})") if args.json else None)   # (collective)
    if table and world.rank == 0:
        copy = copy_bandwidth(device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": run, "sizes_mib": SIZES_MIB, "busbw_GBps": table,
                           "staging_yardsticks_GBps": staging_yardsticks,
                           "device_copy_GBps": copy}, f, indent=2)
        columns = {f"{p} busbw": table[p] for p in table} | staging_yardsticks
        header = "".join(f"{name:>22}" for name in columns)
        print(f"\n{'size':>8}{header}{'device copy':>16}   (GB/s, {world.size} ranks, "
              f"{torch.cuda.device_count()} GPU(s) visible)")
        for i, mib in enumerate(SIZES_MIB):
            row = "".join(f"{column[i]:22.2f}" for column in columns.values())
            print(f"{str(mib) + ' MiB':>8}{row}{copy:16.1f}")
        if not aware:
            print(f"(no CUDA-aware row: {how} says the MPI cannot take device pointers)")
    failed += [f"dist {case}" for case in check_backend(device)]
    assert not failed, f"rank {world.rank}: {failed} failed"
    print(f"OK rank {world.rank}", flush=True)


if __name__ == "__main__":
    main()
