"""Property-based checks (hypothesis) of allreduce, allgather, broadcast and reducescatter over
random shapes, dtypes and ops, against a NumPy reference built from every rank's inputs.

Hypothesis runs derandomized, so every rank draws the same examples in the same order and the
collectives line up across ranks.
"""
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringreduce as hvd
from checks import horovod_scaled

hvd.init()
r, n = hvd.rank(), hvd.size()
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
OPS = {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod,
       hvd.Average: np.sum}
SETTINGS = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple) | \
    st.integers(0, 70_000).map(lambda k: (k,))


def rank_input(rank, shape, dtype, op, seed):
    rng = np.random.default_rng([seed, rank])
    lo, hi = (-2, 3) if op == hvd.Product else (-8, 9)
    values = rng.integers(0 if dtype == torch.uint8 else lo, hi, size=shape)
    return torch.from_numpy(values).to(dtype)


def to_numpy(t):
    return t.to(torch.float64).numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.numpy()


def reference(shape, dtype, op, seed):
    """The reduction of every rank's input, computed exactly in float64, in `dtype`."""
    stacked = np.stack([to_numpy(rank_input(k, shape, dtype, op, seed)).astype(np.float64)
                        for k in range(n)])
    out = torch.from_numpy(np.asarray(OPS[op](stacked, axis=0))).to(dtype)
    if op == hvd.Average:
        out = horovod_scaled(out, 1.0 / n)
    return out.reshape(shape)


@SETTINGS
@given(shape=shapes, dtype=st.sampled_from(DTYPES), op=st.sampled_from(list(OPS)),
       seed=st.integers(0, 2**31))
def allreduce_matches_numpy(shape, dtype, op, seed):
    got = hvd.allreduce(rank_input(r, shape, dtype, op, seed), op=op)
    assert got.shape == shape and torch.equal(got, reference(shape, dtype, op, seed)), \
        (shape, dtype, op)


@SETTINGS
@given(rows=st.lists(st.integers(0, 5), min_size=n, max_size=n),
       trailing=st.lists(st.integers(1, 4), max_size=2).map(tuple),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def allgather_matches_numpy(rows, trailing, dtype, seed):
    got = hvd.allgather(rank_input(r, (rows[r], *trailing), dtype, hvd.Sum, seed))
    want = torch.cat([rank_input(k, (rows[k], *trailing), dtype, hvd.Sum, seed)
                      for k in range(n)])
    assert torch.equal(got, want)


@SETTINGS
@given(shape=shapes, dtype=st.sampled_from(DTYPES), root=st.integers(0, n - 1),
       seed=st.integers(0, 2**31))
def broadcast_matches_root(shape, dtype, root, seed):
    got = hvd.broadcast(rank_input(r, shape, dtype, hvd.Sum, seed), root_rank=root)
    assert torch.equal(got, rank_input(root, shape, dtype, hvd.Sum, seed))


@SETTINGS
@given(rows=st.integers(0, 13), trailing=st.lists(st.integers(1, 3), max_size=2).map(tuple),
       dtype=st.sampled_from(DTYPES), op=st.sampled_from([hvd.Sum, hvd.Min, hvd.Max,
                                                          hvd.Average]),
       seed=st.integers(0, 2**31))
def reducescatter_matches_numpy(rows, trailing, dtype, op, seed):
    shape = (rows, *trailing)
    got = hvd.reducescatter(rank_input(r, shape, dtype, op, seed), op=op)
    full = reference(shape, dtype, op, seed)
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    assert torch.equal(got, full[start:start + counts[r]]), (shape, dtype, op)


for prop in (allreduce_matches_numpy, allgather_matches_numpy, broadcast_matches_root,
             reducescatter_matches_numpy):
    prop()
    hvd.barrier()
print(f"OK rank {r}", flush=True)
