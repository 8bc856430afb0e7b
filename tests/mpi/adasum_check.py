"""Adasum (ringreduce/transport/adasum.py) against a NumPy reference of Horovod's tree, and its errors.

On a power-of-two number of ranks: several tensors fused in one buffer (empty ones, a single
element, lengths that split unevenly, a buffer shorter than the rank count) in float16, float32
and float64 against the reference; the closed forms (parallel equal vectors give the vector,
small ones too, parallel multiples their mean, orthogonal ones their exact sum, zero vectors
and those under Horovod's threshold, sqrt(DBL_MIN), add);
every result bitwise identical across ranks; scratch bounded; halves of the world as
sub-communicators, and at 4 ranks a sub-communicator of 3, refused with NotImplementedError
before any traffic. (The refusal through hvd.allreduce at 3 ranks: errors_check.py.) Every
rank knows every rank's input (seeded by rank), so each builds the reference itself.
"""
import numpy as np
import torch

from ringreduce.transport import adasum
from ringreduce.kernels.buffers import STORAGE_DTYPES
from ringreduce.core.errors import HorovodInternalError
from ringreduce.core.mpi import mpi
from ringreduce.kernels.scratch import ScratchPool

world = mpi().COMM_WORLD
r, n = world.rank, world.size
FLOATS = (torch.float16, torch.float32, torch.float64)
EPS64 = np.finfo(np.float64).eps
TINY_SQ = np.sqrt(np.finfo(np.float64).tiny)    # Horovod's sqrt(DBL_MIN), adasum.h


# ---------------------------------------------------------------------- the reference

def reference_pair(a, b):
    """Horovod's pairwise Adasum in float64, as its C++ (adasum.h) computes it."""
    dot, a_sq, b_sq = float(a @ b), float(a @ a), float(b @ b)
    a_coeff = 1.0 - dot / (2.0 * a_sq) if a_sq >= TINY_SQ else 1.0
    b_coeff = 1.0 - dot / (2.0 * b_sq) if b_sq >= TINY_SQ else 1.0
    return a_coeff * a + b_coeff * b


def reference_tree(vectors, storage):
    """Neighbouring ranks combined pairwise, level by level, the lower ranks' vector as `a`;
    each level's result stored in the buffer's dtype, as the buffer holds it."""
    level = [v.astype(storage).astype(np.float64) for v in vectors]
    while len(level) > 1:
        level = [reference_pair(level[i], level[i + 1]).astype(storage).astype(np.float64)
                 for i in range(0, len(level), 2)]
    return level[0]


def reference(inputs, lengths, storage):
    """The reference of each tensor of a fused buffer, on its own."""
    out, start = [], 0
    for length in lengths:
        out.append(reference_tree([x[start:start + length] for x in inputs], storage))
        start += length
    return np.concatenate(out) if out else np.zeros(0)


# ---------------------------------------------------------------------- helpers

def run(inputs, lengths, dtype, comm=world, scratch=None):
    """Adasum of this rank's row of `inputs` (float64 values) over `comm`, as float64."""
    storage = STORAGE_DTYPES[dtype]
    buf = inputs[comm.rank].astype(storage)
    adasum.adasum_allreduce(comm, buf, dtype, lengths, scratch)
    same_on_every_rank(buf, comm)
    return buf.astype(np.float64)


def same_on_every_rank(buf, comm):
    everyone = comm.allgather(buf.tobytes())
    assert all(b == everyone[0] for b in everyone), "results differ across ranks"


def close(got, want, storage, inputs, lengths, what):
    """Within one step of the dtype, plus float64 rounding in the weights relative to each
    tensor's largest input: the reference rounds to the dtype at the same points."""
    scale = np.zeros_like(want)
    start = 0
    for length in lengths or [len(want)]:
        scale[start:start + length] = max(np.abs(x[start:start + length]).max(initial=0.0)
                                          for x in inputs)
        start += length
    allowed = np.spacing(np.abs(want).astype(storage)).astype(np.float64) + 16 * EPS64 * scale
    bad = np.abs(got - want) > allowed
    assert not bad.any(), (f"{what}: {bad.sum()} elements off, first at "
                           f"{np.flatnonzero(bad)[:5]}: got {got[bad][:5]} want {want[bad][:5]}")


def seeded(rank, length, salt):
    return np.random.default_rng(1_000 * rank + salt).standard_normal(length)


# ---------------------------------------------------------------------- the checks

def check_fused_buffers_against_the_reference():
    """Per-tensor weights: each tensor of the fused buffer equals its own reference, whatever
    the halvings cut through. The inputs share a direction, so dot products are not zero."""
    layouts = [[12_289], [0, 1, 7, 1000, 3, 12_289, 0, 5], [1], [2, 1], [0], [n + 1, n - 1]]
    for salt, lengths in enumerate(layouts):
        total = sum(lengths)
        common = seeded(99, total, salt)
        scales = np.repeat(np.geomspace(0.01, 100, max(len(lengths), 1)), lengths)
        inputs = [scales * (common + 0.7 * seeded(k, total, salt)) for k in range(n)]
        for dtype in FLOATS:
            storage = STORAGE_DTYPES[dtype]
            got = run(inputs, lengths, dtype)
            want = reference(inputs, lengths, storage)
            close(got, want, storage, inputs, lengths, f"fused {lengths} {dtype}")


def check_closed_forms():
    length = 4099
    v = seeded(7, length, 0)
    for dtype in FLOATS:
        storage = STORAGE_DTYPES[dtype]
        stored = v.astype(storage).astype(np.float64)
        # parallel and equal: the vector itself
        got = run([v] * n, None, dtype)
        close(got, stored, storage, [np.zeros(length)], None, f"parallel equal {dtype}")
        # parallel multiples: their mean (up to the rounding of each level)
        multiples = [0.5 + k / max(n - 1, 1) for k in range(n)]
        got = run([c * stored for c in multiples], None, dtype)
        want = np.mean(multiples) * stored
        tolerance = {torch.float16: 4e-3, torch.float32: 1e-6, torch.float64: 1e-13}[dtype]
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), \
            f"parallel multiples {dtype}: off by {np.abs(got - want).max()}"
        # orthogonal (disjoint supports): exactly the sum
        disjoint = [np.where(np.arange(length) % n == k, stored, 0.0) for k in range(n)]
        got = run(disjoint, None, dtype)
        assert np.array_equal(got, stored), f"orthogonal {dtype}: not the sum"
        # zero vectors: all zero stays zero; zero beside v gives v
        assert np.array_equal(run([np.zeros(length)] * n, None, dtype), np.zeros(length))
        if n == 2:
            assert np.array_equal(run([np.zeros(length), v], None, dtype), stored)
        # small vectors (a squared norm of 1e-11) still weigh: parallel equal ones give the
        # vector (Horovod's threshold is sqrt(DBL_MIN), not a small-gradient cut-off)
        small = np.full(10, 1e-6).astype(storage).astype(np.float64)
        got = run([small] * n, None, dtype)
        assert np.array_equal(got, small), f"small {dtype}: {got[:3]}"
    # below sqrt(DBL_MIN) (only float64 holds such vectors) a vector keeps weight 1: they add
    tiny = np.full(10, 1e-80)
    got = run([tiny] * n, None, torch.float64)
    assert np.array_equal(got, n * tiny), f"tiny float64: {got[:3]}"


def check_tiny_beside_large_and_mixed_cases_fused():
    """One fused buffer mixing tensors that are zero on some ranks, tiny on others, parallel
    and orthogonal, each against the reference."""
    lengths = [500, 500, 500, 500]
    parts = []
    for k in range(n):
        zero_on_even = np.zeros(500) if k % 2 == 0 else seeded(k, 500, 1)
        tiny_on_even = seeded(k, 500, 2) * (1e-7 if k % 2 == 0 else 1.0)
        parallel = seeded(50, 500, 3) * (k + 1)
        orthogonal = np.where(np.arange(500) % n == k, seeded(51, 500, 4), 0.0)
        parts.append(np.concatenate([zero_on_even, tiny_on_even, parallel, orthogonal]))
    for dtype in FLOATS:
        storage = STORAGE_DTYPES[dtype]
        got = run(parts, lengths, dtype)
        close(got, reference(parts, lengths, storage), storage, parts, lengths,
              f"mixed {dtype}")


def check_scratch_stays_small():
    """Through a ScratchPool, a call asks for at most half the buffer plus small pieces."""
    pool, asked = ScratchPool(), []

    def scratch(purpose, dtype, count):
        asked.append(count * dtype.itemsize)
        return pool.get(purpose, dtype, count)

    lengths = [70_001, 3, 20_000]
    inputs = [seeded(k, sum(lengths), 5) for k in range(n)]
    for _ in range(2):
        got = run(inputs, lengths, torch.float32, scratch=scratch)
    close(got, reference(inputs, lengths, np.float32), np.float32, inputs, lengths,
          "through a ScratchPool")
    if n > 1:
        limit = 2 * (-(-sum(lengths) // 2) * 4 + 2 * adasum.BLOCK * 8 + 6 * len(lengths) * 8)
        assert sum(asked) <= limit, f"scratch asked {asked}"


def check_halves_as_sub_communicators():
    """Two process-set-like halves of the world reduce independently, each its own tree."""
    if n < 4:
        return
    half = world.Split(r // (n // 2), r)
    members = [k for k in range(n) if k // (n // 2) == r // (n // 2)]
    inputs = [seeded(k, 3001, 6) for k in members]
    got = run(inputs, None, torch.float64, comm=half)
    close(got, reference(inputs, [3001], np.float64), np.float64, inputs, None,
          "half of the world")
    three = world.Split(0 if r < 3 else 1, r)
    if r < 3:
        refuse_rank_count(three)
    half.Free()
    three.Free()


def check_dtype_and_argument_errors():
    """Every rank refuses alike, before any traffic."""
    for dtype in (torch.bfloat16, torch.int32, torch.int64, torch.uint8):
        assert "float16, float32 and float64" in adasum.why_unsupported(n, dtype)
        buf = np.zeros(8, STORAGE_DTYPES[dtype])
        try:
            adasum.adasum_allreduce(world, buf, dtype)
        except HorovodInternalError as e:
            assert str(dtype).removeprefix("torch.") in str(e), e
        else:
            raise AssertionError(f"{dtype} was accepted")
    for buf, dtype, lengths in [(np.zeros(8, np.float32), torch.float32, [4, 3]),
                                (np.zeros(8, np.float64), torch.float32, None),
                                (np.zeros((2, 4), np.float32), torch.float32, None),
                                (np.zeros(8, np.float32), torch.float32, [9, -1])]:
        try:
            adasum.adasum_allreduce(world, buf, dtype, lengths)
        except ValueError as e:
            assert "ringreduce: Adasum" in str(e), e
        else:
            raise AssertionError(f"{buf.dtype}{buf.shape} {dtype} {lengths} was accepted")


def refuse_rank_count(comm):
    size = comm.size
    assert adasum.why_unsupported(size, torch.float32) is not None
    try:
        adasum.adasum_allreduce(comm, np.ones(10, np.float32), torch.float32)
    except NotImplementedError as e:
        assert "power-of-two" in str(e) and f"has {size}" in str(e), e
    else:
        raise AssertionError(f"Adasum ran on {size} ranks")


assert n & (n - 1) == 0, f"run on a power-of-two number of ranks, not {n}"
assert adasum.why_unsupported(n, torch.float32) is None
check_fused_buffers_against_the_reference()
check_closed_forms()
check_tiny_beside_large_and_mixed_cases_fused()
check_scratch_stays_small()
check_halves_as_sub_communicators()
check_dtype_and_argument_errors()
print(f"OK rank {r}", flush=True)
