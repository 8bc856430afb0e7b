"""Every collective, op and dtype against a reference built from every rank's inputs.

Inputs are small integers (or halves of them), so every reduction is exact in every dtype and
results are compared for exact equality; results of each allreduce are also compared bitwise
across ranks. Run under mpiexec at any rank count. The optional argument, a JSON object of
{label: {RINGREDUCE_* variable: value}}, runs every check once per setting (init, checks,
shutdown), so one launch covers every data path; a failure names its label.
"""
import functools
import hashlib
import sys
import time

import torch
from mpi4py import MPI

import ringreduce as hvd
from checks import check_equal, expect, horovod_scaled, per_setting

world = MPI.COMM_WORLD
r, n = world.rank, world.size

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
LENGTHS = sorted({0, 1, max(n - 1, 0), 17, 40_001, 300_007})


def inputs(rank, length, dtype, op, salt=0):
    return _inputs(rank, length, dtype, op, salt).clone()


@functools.lru_cache(maxsize=None)      # the same inputs and references in every setting
def _inputs(rank, length, dtype, op, salt):
    g = torch.Generator().manual_seed(7919 * rank + 31 * length + salt)
    lo, hi = (-2, 3) if op == hvd.Product else (-8, 9)
    if dtype == torch.uint8:
        lo = 0
    return torch.randint(lo, hi, (length,), generator=g, dtype=torch.int64).to(dtype)


def reference(length, dtype, op, pre=1.0, post=1.0, salt=0):
    return _reference(length, dtype, op, pre, post, salt).clone()


@functools.lru_cache(maxsize=None)
def _reference(length, dtype, op, pre, post, salt):
    xs = torch.stack([inputs(k, length, dtype, op, salt).double() * pre for k in range(n)])
    if op in (hvd.Sum, hvd.Average):
        out = xs.sum(0)
    elif op == hvd.Min:
        out = xs.min(0).values
    elif op == hvd.Max:
        out = xs.max(0).values
    else:
        out = xs.prod(0)
    out = out.to(dtype)  # exact: every partial result is a small integer
    return horovod_scaled(out, post / n if op == hvd.Average else post)


def same_on_every_rank(t, what):
    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    everyone = world.allgather(hashlib.sha256(raw).digest())
    assert all(b == everyone[0] for b in everyone), f"{what}: results differ across ranks"


def check_allreduce():
    for length in LENGTHS:
        for dtype in DTYPES:
            for op in OPS:
                what = f"allreduce len={length} {dtype} {op.name}"
                x = inputs(r, length, dtype, op)
                before = x.clone()
                got = hvd.allreduce(x, op=op, name=what)
                check_equal(got, reference(length, dtype, op), what)
                assert torch.equal(x, before), f"{what}: input was modified"
                same_on_every_rank(got, what)
    # scale factors (powers of two keep everything exact), in place, async, deprecated average=
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = inputs(r, 1001, dtype, hvd.Sum)
        got = hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0)
        check_equal(got, reference(1001, dtype, hvd.Average, 0.5, 4.0), f"scaled {dtype}")
    # integers scale as Horovod's do: each factor in float64, truncated toward zero
    for dtype in (torch.uint8, torch.int32, torch.int64):
        for op, pre, post in ((hvd.Sum, 0.5, 3.0), (hvd.Average, 3.0, 0.25)):
            what = f"scaled {dtype} {op.name}"
            got = hvd.allreduce(inputs(r, 1001, dtype, op).abs(), op=op, prescale_factor=pre,
                                postscale_factor=post, name=what)
            summed = sum((inputs(k, 1001, dtype, op).abs().double() * pre).to(torch.int64)
                         for k in range(n))
            factor = post / n if op == hvd.Average else post
            check_equal(got, (summed.double() * factor).to(torch.int64).to(dtype), what)
    x = inputs(r, 5000, torch.float32, hvd.Sum)
    same = hvd.allreduce_(x, op=hvd.Sum)
    assert same is x
    check_equal(x, reference(5000, torch.float32, hvd.Sum), "allreduce_")
    handles = [hvd.allreduce_async(inputs(r, 70_000, torch.int32, hvd.Max, salt=i), op=hvd.Max,
                                   name=f"async.{i}") for i in range(5)]
    for i, h in enumerate(handles):
        check_equal(hvd.synchronize(h), reference(70_000, torch.int32, hvd.Max, salt=i), "async")
        assert hvd.poll(h)
    assert hvd.synchronize(None) is None, "synchronize(None): None, as Horovod's"
    y = inputs(r, 300, torch.float64, hvd.Sum)
    h = hvd.allreduce_async_(y, op=hvd.Sum)
    assert hvd.synchronize(h) is y
    check_equal(y, reference(300, torch.float64, hvd.Sum), "allreduce_async_")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = hvd.allreduce(inputs(r, 10, torch.float32, hvd.Sum), average=False)
    check_equal(got, reference(10, torch.float32, hvd.Sum), "average=False")
    # shapes are kept (inputs that are not contiguous are refused, as Horovod's: see
    # errors_check.py); 0-d tensors work
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)
    got = hvd.allreduce(m, op=hvd.Sum)
    check_equal(got, torch.arange(12, dtype=torch.float32).reshape(3, 4) * (n * (n + 1) // 2),
                "shape kept")
    got = hvd.allreduce(torch.tensor(float(r)), op=hvd.Sum)
    check_equal(got, torch.tensor(float(n * (n - 1) // 2)), "0-d")


def same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
        f"{what}: got {got.reshape(-1)[:8].tolist()} want {want.reshape(-1)[:8].tolist()}"


def check_average_scales_as_horovod():
    """Average is Horovod's: the sum times postscale / size, that factor computed in float64
    and cast to float32 for float32 and the 16-bit floats, one multiply (not a division and
    then a multiply: with sums 5, 7 and 10 over 3 ranks the last bits differ). A 16-bit sum
    is rounded to its dtype before it is scaled (2048 + 1 is 2048 in float16, 256 + 1 is 256
    in bfloat16), as Horovod's sum is. On every path: allreduce (small, in place, async,
    grouped), reducescatter. The inputs repeat over 403 elements, so vector loops run too."""
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        big = {torch.float16: 2048.0, torch.bfloat16: 256.0}.get(dtype, 5.0)
        mine = {0: [5.0, 7.0, 10.0, big], 1: [0.0, 0.0, 0.0, 1.0]}.get(r, [0.0] * 4)
        x = torch.tensor(mine * 100 + mine[:3], dtype=dtype)
        total = [5.0, 7.0, 10.0, big + (n > 1)]
        exact = torch.tensor(total * 100 + total[:3], dtype=torch.float64)
        summed = exact.to(dtype)
        for post in (1.0, 0.7):
            what = f"Average {dtype} postscale={post}"
            want = horovod_scaled(summed, post / n)
            if n == 3 and dtype in (torch.float32, torch.float64):
                assert not torch.equal(want, summed / n * post), "the sums must tell"
            same_bits(hvd.allreduce(x, postscale_factor=post, name=what), want, what)
            y = x.clone()
            hvd.synchronize(hvd.allreduce_async_(y, postscale_factor=post, name=what + " _"))
            same_bits(y, want, what + " async in place")
            got = hvd.grouped_allreduce([x, x.double()], postscale_factor=post,
                                        name=what + " grouped")
            same_bits(got[0], want, what + " grouped")
            same_bits(got[1], horovod_scaled(exact, post / n), what + " grouped float64")
            rows = x.repeat(n, 1)       # every row alike: rank r keeps row r
            same_bits(hvd.reducescatter(rows, postscale_factor=post, name=what + " rs"),
                      want.unsqueeze(0), what + " reducescatter")


def check_inline_and_queued_small_allreduce_agree():
    """A small synchronous allreduce runs inline (in C, on one node) on a rank whose engine is
    idle, and through the engine's queue on a rank with work in flight: both ways must agree on
    the signature and on the bits. Each round another rank is the busy one. An unnamed
    in-place one takes its automatic name inline on the idle ranks (SmallWay.now_in_place, after
    the engine's claim) and on the general path on the busy one: the names agree, and so do
    those of the unnamed call after it, made with every engine idle."""
    from ringreduce.sets.process_sets import global_set
    from ringreduce.api.small_path import allreduce_now

    held = global_set("test")
    if held.transport.one_node and 16 <= held.transport.node.small_bytes:
        # the engine thread may still hold the set for a moment after the last collective
        # (longer where ranks outnumber cores): retry until the call finds it idle
        deadline = time.monotonic() + 30
        while allreduce_now(held, torch.ones(4), "inline.probe", hvd.Sum, 1.0, False) is None:
            assert time.monotonic() < deadline, "the engine was never idle for the inline call"
            time.sleep(0.001)
    for i, (dtype, op, post) in enumerate([(torch.float32, hvd.Average, 1.0),
                                           (torch.float64, hvd.Sum, 0.5),
                                           (torch.int64, hvd.Sum, 1.0),
                                           (torch.float32, hvd.Sum, 2.0)]):
        for call in ("allreduce", "allreduce_async_", "allreduce_"):
            # (the asynchronous one: begun on the idle ranks' threads)
            big = hvd.allreduce_async(torch.ones(1 << 18), op=hvd.Sum,
                                      name=f"mixed.big.{i}.{call}")
            if i % n != r:
                hvd.synchronize(big)
            what = f"mixed.{i} {dtype} {op.name} {call}"
            x = inputs(r, 33, dtype, op, salt=i)
            if call == "allreduce":
                got = hvd.allreduce(x, op=op, name=what, postscale_factor=post)
            elif call == "allreduce_":
                got = hvd.allreduce_(x, op=op, postscale_factor=post)    # (unnamed)
            else:
                got = hvd.synchronize(hvd.allreduce_async_(x, op=op, name=what,
                                                           postscale_factor=post))
            check_equal(got, reference(33, dtype, op, post=post, salt=i), what)
            same_on_every_rank(got, what)
            assert torch.equal(hvd.synchronize(big), torch.full((1 << 18,), float(n)))
            if call == "allreduce_":
                after = torch.full((3,), float(r + 1))
                check_equal(hvd.allreduce_(after, op=hvd.Sum),
                            torch.full((3,), float(n * (n + 1) // 2)), what + ", the next")


def check_small_async_mistake_on_one_rank():
    """A small allreduce_async_ (begun on the caller's thread where the engine is idle: a node
    slot, or a first message between nodes) whose shape is wrong on the last rank alone: every
    rank's synchronize raises MismatchError, no tensor changes, and the next one is right. With
    every rank in step, and with rank 0 late (the others' begun parts wait, and the rest runs
    later: on the engine thread, or in synchronize)."""
    for late in (False, True):
        what = f"async_mistake.{late}"
        mine = torch.full((9 + (r == n - 1) if n > 1 else 10,), float(r + 1))
        if late and r == 0:
            time.sleep(0.05)
        handle = hvd.allreduce_async_(mine, op=hvd.Sum, name=what)
        if n > 1:
            expect(hvd.MismatchError, [f"'allreduce.{what}'", "shape"], hvd.synchronize,
                   handle)
            check_equal(mine, torch.full(mine.shape, float(r + 1)), f"{what}: tensor changed")
        if late and r == 0:
            time.sleep(0.05)
        good = torch.full((9,), float(r + 1))
        hvd.synchronize(hvd.allreduce_async_(good, op=hvd.Average, name=what + ".after"))
        check_equal(good, torch.full((9,), (n + 1) / 2), what + ".after")


def check_grouped():
    tensors = [inputs(r, 33, torch.float32, hvd.Sum), inputs(r, 5, torch.int64, hvd.Sum),
               inputs(r, 70_000, torch.float32, hvd.Sum, salt=1), torch.ones(2, 3) * r]
    got = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    check_equal(got[0], reference(33, torch.float32, hvd.Sum), "grouped[0]")
    check_equal(got[1], reference(5, torch.int64, hvd.Sum), "grouped[1]")
    check_equal(got[2], reference(70_000, torch.float32, hvd.Sum, salt=1), "grouped[2]")
    check_equal(got[3], torch.full((2, 3), float(n * (n - 1) // 2)), "grouped[3]")
    hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    check_equal(tensors[1], reference(5, torch.int64, hvd.Sum), "grouped_ in place")


def check_allgather():
    for dtype in DTYPES:
        x = torch.full((r % 3, 2, 3), r, dtype=torch.int64).to(dtype)  # some ranks send no rows
        got = hvd.allgather(x)
        want = torch.cat([torch.full((k % 3, 2, 3), k, dtype=torch.int64).to(dtype)
                          for k in range(n)])
        check_equal(got, want, f"allgather {dtype}")
    big = inputs(r, 200_003, torch.float32, hvd.Sum)
    check_equal(hvd.allgather(big), torch.cat([inputs(k, 200_003, torch.float32, hvd.Sum)
                                               for k in range(n)]), "allgather big")
    check_equal(hvd.allgather(torch.tensor(r)), torch.arange(n), "allgather 0-d")


def check_broadcast():
    for root in range(n):
        for dtype in DTYPES:
            x = inputs(r, 1003, dtype, hvd.Sum)
            got = hvd.broadcast(x, root_rank=root)
            check_equal(got, inputs(root, 1003, dtype, hvd.Sum), f"broadcast root={root}")
            check_equal(x, inputs(r, 1003, dtype, hvd.Sum), "broadcast leaves input alone")
            assert got.data_ptr() != x.data_ptr(), "broadcast returned the input's memory"
            assert hvd.broadcast_(x, root) is x
            check_equal(x, inputs(root, 1003, dtype, hvd.Sum), f"broadcast_ root={root}")
    # The gradient on the other ranks is the averaged one times 0, as Horovod's
    # (`grad_reduced *= 0`): NaN where it is infinite or NaN, zero elsewhere
    x = torch.ones(3, requires_grad=True)
    hvd.broadcast(x, root_rank=0).backward(torch.tensor([float("inf"), float("nan"), 2.0]))
    want = torch.tensor([float("inf"), float("nan"), 2.0]) * (1.0 if r == 0 else 0.0)
    assert torch.equal(x.grad.isnan(), want.isnan()) and \
        torch.equal(x.grad[~want.isnan()], want[~want.isnan()]), f"broadcast gradient {x.grad}"


def check_alltoall():
    x = torch.arange(2 * n * 3).reshape(2 * n, 3) + 1000 * r
    got = hvd.alltoall(x)
    want = torch.cat([(torch.arange(2 * n * 3).reshape(2 * n, 3) + 1000 * k)[2 * r:2 * r + 2]
                      for k in range(n)])
    check_equal(got, want, "alltoall equal splits")
    # rank k sends (k + j) % 3 rows to rank j
    def splits_of(k):
        return [(k + j) % 3 for j in range(n)]

    def rows_of(k):
        return torch.arange(sum(splits_of(k)) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * k

    out, received = hvd.alltoall(rows_of(r), splits=torch.tensor(splits_of(r)))
    pieces = []
    for k in range(n):
        start = sum(splits_of(k)[:r])
        pieces.append(rows_of(k)[start:start + splits_of(k)[r]])
    check_equal(out, torch.cat(pieces), "alltoall splits")
    assert received.tolist() == [splits_of(k)[r] for k in range(n)], received
    # As Horovod's: the handle of alltoall_async gives (output, received splits), with or
    # without splits (alltoall itself gives the output alone without them)
    result = hvd.synchronize(hvd.alltoall_async(x))
    assert isinstance(result, tuple) and len(result) == 2, type(result)
    check_equal(result[0], want, "alltoall_async without splits")
    check_equal(result[1], torch.full((n,), 2, dtype=torch.int32), "its received splits")
    out, received = hvd.synchronize(hvd.alltoall_async(rows_of(r), splits=splits_of(r)))
    check_equal(out, torch.cat(pieces), "alltoall_async with splits")
    # Empty splits, a list or a tensor, are an even split, as Horovod reads them (and as
    # splits were given, the received splits come too)
    for empty in ([], torch.tensor([], dtype=torch.int32)):
        out, received = hvd.alltoall(x, splits=empty)
        check_equal(out, want, f"alltoall splits={empty!r}")
        check_equal(received, torch.full((n,), 2, dtype=torch.int32),
                    f"alltoall splits={empty!r}: received splits")
    # Splits summing to less than dimension 0, as Horovod allows: the rows past them are not
    # sent, and their gradient is zero
    x = (torch.arange((n + 2) * 2, dtype=torch.float32).reshape(n + 2, 2) + 100 * r)
    x.requires_grad_()
    out, received = hvd.alltoall(x, splits=[1] * n)
    check_equal(out.detach(), torch.stack([torch.tensor([2.0 * r, 2.0 * r + 1]) + 100 * k
                                           for k in range(n)]), "alltoall leaving rows")
    check_equal(received, torch.ones(n, dtype=torch.int32), "alltoall leaving rows: splits")
    out.sum().backward()
    check_equal(x.grad, torch.cat([torch.ones(n, 2), torch.zeros(2, 2)]),
                "alltoall leaving rows: gradient")


def check_reducescatter():
    for rows in (0, 1, n - 1, 2 * n + 1, 40_001):
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            for dtype in (torch.int32, torch.float32, torch.bfloat16):
                full = inputs(r, rows * 3, dtype, op).reshape(rows, 3)
                got = hvd.reducescatter(full, op=op)
                want_full = reference(rows * 3, dtype, op).reshape(rows, 3)
                base, extra = divmod(rows, n)
                counts = [base + (1 if k < extra else 0) for k in range(n)]
                start = sum(counts[:r])
                check_equal(got, want_full[start:start + counts[r]],
                            f"reducescatter rows={rows} {op.name} {dtype}")
                check_equal(full, inputs(r, rows * 3, dtype, op).reshape(rows, 3),
                            f"reducescatter rows={rows} {op.name} {dtype}: the input")
    x = torch.arange(4.0 * n).reshape(2 * n, 2)     # reduced in a copy, compressed or not
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        hvd.reducescatter(x, op=hvd.Sum, compression=compression)
        check_equal(x, torch.arange(4.0 * n).reshape(2 * n, 2),
                    f"reducescatter {compression.__name__}: the input")


def check_all():
    for check in (check_allreduce, check_average_scales_as_horovod,
                  check_inline_and_queued_small_allreduce_agree,
                  check_small_async_mistake_on_one_rank, check_grouped,
                  check_allgather, check_broadcast, check_alltoall, check_reducescatter):
        check()
        hvd.barrier()


per_setting(sys.argv[1] if len(sys.argv) > 1 else None, hvd.init, check_all, hvd.shutdown)
print(f"OK rank {r}", flush=True)
