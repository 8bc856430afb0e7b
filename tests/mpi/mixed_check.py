"""Collectives of every kind mixed in one random sequence, as a training job mixes them, against
a reference built from every rank's inputs (exact: integer-valued inputs).

Usage: mixed_check.py [steps] [seed]

The property checks take one collective at a time; here the kinds follow each other on one
set, and what only some ranks do differently is part of the sequence: asynchronous allreduces
synchronized in an order of each rank's own, two threads per rank starting in an order of
each rank's own, subsets that other ranks skip, torch.distributed's calls (synchronous and
not) between Horovod-style ones, and one rank's mistake (a shape or dtype the others do not
have, in a synchronous call, one of a batch of asynchronous ones, or dist.all_reduce): an error
naming that rank on every rank, the batch's other allreduces correct, and every step after it
correct too. Every rank draws the same sequence (one seeded generator), so the steps line up;
each step is a case of its own in the report.
"""
import random
import sys
import threading

import numpy as np
import torch
import torch.distributed as dist

import ringreduce as hvd
import ringreduce.distributed as rrd
from checks import horovod_scaled, run_cases

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 80
SEED = int(sys.argv[2]) if len(sys.argv) > 2 else 1
rrd.init_process_group()
r, n = hvd.rank(), hvd.size()
plan = random.Random(SEED)                  # the same on every rank
own = random.Random(SEED * 1000 + r)        # this rank's orders
DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
# 0 elements to several of the shared-memory blocks, crossing the small way's limit
SIZES = [0, 1, 7, 1000, 16383, 70000, 300000, 1_100_000, 3_000_000]
REDUCE = {hvd.Sum: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod,
          hvd.Average: np.sum}
TORCH_OP = {hvd.Sum: dist.ReduceOp.SUM, hvd.Min: dist.ReduceOp.MIN,
            hvd.Max: dist.ReduceOp.MAX, hvd.Product: dist.ReduceOp.PRODUCT}
SETS = ([hvd.add_process_set([n - 1])] if n > 1 else []) + \
       ([hvd.add_process_set([0, n - 1]), hvd.add_process_set(list(range(1, n)))]
        if n > 2 else [])


def rank_input(rank, shape, dtype, op, seed):
    """Small integers: every sum, product and average is exact in every dtype."""
    rng = np.random.default_rng([seed, rank])
    lo, hi = (-2, 3) if op == hvd.Product else (-8, 9)
    if dtype == torch.uint8:
        lo, hi = 0, 3 if op == hvd.Product else 9
    return torch.from_numpy(rng.integers(lo, hi, size=shape)).to(dtype)


def reference(shape, dtype, op, seed, pre=1.0, post=1.0, members=None):
    """What Horovod gives: each input prescaled, reduced in float64, then scaled (Average's
    factor post / size) as Horovod scales."""
    members = range(n) if members is None else members
    inputs = [horovod_scaled(rank_input(k, shape, dtype, op, seed), pre).to(torch.float64)
              for k in members]
    out = torch.from_numpy(np.asarray(REDUCE[op](np.stack([x.numpy() for x in inputs]),
                                                 axis=0))).to(dtype)
    factor = post / len(members) if op == hvd.Average else post
    return horovod_scaled(out, factor).reshape(shape)


def expect(what, got, want):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, not {tuple(want.shape)}"
    wrong = (got != want).nonzero()
    assert len(wrong) == 0, f"{what}: {len(wrong)} elements differ, the first at {wrong[:3]}"


def draw(ops=tuple(REDUCE)):
    """dtype, size, op, prescale, postscale, seed: the next allreduce of the plan."""
    dtype, size, op = plan.choice(DTYPES), plan.choice(SIZES), plan.choice(ops)
    if dtype == torch.uint8 and op == hvd.Product:
        op = hvd.Sum
    pre = post = 1.0
    if dtype.is_floating_point and op in (hvd.Sum, hvd.Average) and plan.random() < 0.4:
        pre, post = plan.choice([(1.0, 4.0), (0.5, 1.0), (2.0, 0.25)])
    return dtype, size, op, pre, post, plan.randrange(2**31)


def allreduce(i, in_place):
    dtype, size, op, pre, post, seed = draw()
    call = hvd.allreduce_ if in_place else hvd.allreduce
    got = call(rank_input(r, (size,), dtype, op, seed), op=op, prescale_factor=pre,
               postscale_factor=post)
    expect(f"{dtype} x {size}, {op.name}, scaled {pre}, {post}", got,
           reference((size,), dtype, op, seed, pre, post))


def batch(i, mistaken=False):
    """Asynchronous allreduces synchronized in this rank's own order; `mistaken`: one of them
    has one rank's tensor an element longer."""
    specs = [draw() for _ in range(plan.randint(2, 5))]
    bad, bad_one = plan.randrange(n), plan.randrange(len(specs)) if mistaken else -1
    handles = []
    for j, (dtype, size, op, pre, post, seed) in enumerate(specs):
        shape = (size + 1,) if r == bad and j == bad_one else (size,)
        handles.append(hvd.allreduce_async(rank_input(r, shape, dtype, op, seed), op=op,
                                           name=f"mixed.{i}.{j}", prescale_factor=pre,
                                           postscale_factor=post))
    order = list(range(len(specs)))
    own.shuffle(order)
    for j in order:
        dtype, size, op, pre, post, seed = specs[j]
        if j == bad_one:
            try:
                hvd.synchronize(handles[j])
            except hvd.RingReduceError as e:
                assert f"rank {bad}" in str(e), f"the error does not name rank {bad}: {e}"
            else:
                raise AssertionError(f"no error for rank {bad}'s longer tensor")
        else:
            expect(f"batch {j}: {dtype} x {size}, {op.name}, scaled {pre}, {post}",
                   hvd.synchronize(handles[j]), reference((size,), dtype, op, seed, pre, post))


def grouped(i):
    dtype, _, op, pre, post, seed = draw()
    sizes = [plan.choice(SIZES) for _ in range(plan.randint(1, 5))]
    got = hvd.grouped_allreduce([rank_input(r, (s,), dtype, op, seed + j)
                                 for j, s in enumerate(sizes)], op=op, prescale_factor=pre,
                                postscale_factor=post)
    for j, (tensor, size) in enumerate(zip(got, sizes)):
        expect(f"group {j}: {dtype} x {size}, {op.name}, scaled {pre}, {post}", tensor,
               reference((size,), dtype, op, seed + j, pre, post))


def allgather(i):
    dtype, size, _, _, _, seed = draw()
    rows = [plan.choice([0, 1, 3, 1000, size // 3]) for _ in range(n)]
    expect(f"{dtype}, rows {rows}", hvd.allgather(rank_input(r, (rows[r], 3), dtype, hvd.Sum,
                                                             seed)),
           torch.cat([rank_input(k, (rows[k], 3), dtype, hvd.Sum, seed) for k in range(n)]))


def broadcast(i):
    dtype, size, _, _, _, seed = draw()
    root = plan.randrange(n)
    expect(f"{dtype} x {size} from {root}",
           hvd.broadcast_(rank_input(r, (size,), dtype, hvd.Sum, seed), root_rank=root),
           rank_input(root, (size,), dtype, hvd.Sum, seed))


def reducescatter(i):
    dtype, _, op, _, _, seed = draw((hvd.Sum, hvd.Min, hvd.Max, hvd.Average))
    rows = plan.choice([0, 1, 5, 13, 1000, 40000])
    got = hvd.reducescatter(rank_input(r, (rows, 3), dtype, op, seed), op=op)
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    first = sum(counts[:r])
    expect(f"{dtype}, {rows} rows, {op.name}", got,
           reference((rows, 3), dtype, op, seed)[first:first + counts[r]])


def torch_all_reduce(i, async_op):
    dtype, size, op, _, _, seed = draw((hvd.Sum, hvd.Min, hvd.Max, hvd.Product))
    tensor = rank_input(r, (size,), dtype, op, seed)
    work = dist.all_reduce(tensor, op=TORCH_OP[op], async_op=async_op)
    if async_op:
        work.wait()
    expect(f"{dtype} x {size}, {op.name}", tensor, reference((size,), dtype, op, seed))


def threads(i):
    """Two threads of named allreduces, started in this rank's own order."""
    specs = [[draw() for _ in range(3)] for _ in range(2)]
    results, errors = {}, []

    def worker(t):
        try:
            for j, (dtype, size, op, pre, post, seed) in enumerate(specs[t]):
                results[t, j] = hvd.allreduce(rank_input(r, (size,), dtype, op, seed), op=op,
                                              name=f"mixed.{i}.thread{t}.{j}",
                                              prescale_factor=pre, postscale_factor=post)
        except Exception as e:
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in own.sample(range(2), 2):
        workers[t].start()
    for worker_thread in workers:
        worker_thread.join()
    assert not errors, errors
    for t in range(2):
        for j, (dtype, size, op, pre, post, seed) in enumerate(specs[t]):
            expect(f"thread {t}, {j}: {dtype} x {size}, {op.name}, scaled {pre}, {post}",
                   results[t, j], reference((size,), dtype, op, seed, pre, post))


def subset(i):
    """On one of the sets, which the other ranks skip."""
    process_set = plan.choice(SETS)
    dtype, size, op, _, _, seed = draw()
    if r in process_set.ranks:
        handle = hvd.allreduce_async(rank_input(r, (size,), dtype, op, seed), op=op,
                                     name=f"mixed.{i}", process_set=process_set)
        expect(f"ranks {process_set.ranks}: {dtype} x {size}, {op.name}",
               hvd.synchronize(handle),
               reference((size,), dtype, op, seed, members=process_set.ranks))


def mistake(i, through_torch):
    """One rank's tensor has another shape or dtype: an error naming it, on every rank."""
    dtype, size, _, _, _, seed = draw()
    bad, how = plan.randrange(n), plan.choice(["shape", "dtype"])
    size = max(size, 2)
    shape = (size - 1,) if r == bad and how == "shape" else (size,)
    if r == bad and how == "dtype":
        dtype = torch.float64 if dtype == torch.float32 else torch.float32
    tensor = rank_input(r, shape, dtype, hvd.Sum, seed)
    try:
        if through_torch:
            dist.all_reduce(tensor)
        else:
            hvd.allreduce(tensor, name=f"mixed.{i}", op=hvd.Sum)
    except hvd.RingReduceError as e:
        assert f"rank {bad}" in str(e) or f"ranks [{bad}]" in str(e), \
            f"the error does not name rank {bad}'s {how}: {e}"
    else:
        raise AssertionError(f"no error for rank {bad}'s {how}")


KINDS = {
    "allreduce": lambda i: allreduce(i, False), "allreduce_": lambda i: allreduce(i, True),
    "asynchronous batch": batch, "grouped_allreduce": grouped, "allgather": allgather,
    "broadcast_": broadcast, "reducescatter": reducescatter,
    "dist.all_reduce": lambda i: torch_all_reduce(i, False),
    "dist.all_reduce(async_op=True)": lambda i: torch_all_reduce(i, True),
    "threads": threads,
}
if n > 1:
    KINDS.update({"subset": subset,
                  "one rank's mistake": lambda i: mistake(i, False),
                  "one rank's mistake in a batch": lambda i: batch(i, mistaken=True),
                  "one rank's mistake, dist.all_reduce": lambda i: mistake(i, True)})


def step(i, kind):
    def case():
        KINDS[kind](i)
    case.__name__ = f"step {i} ({kind})"
    return case


# the kinds drawn first, then each step's arguments as it runs: a step's check failing
# leaves the draws of the steps after it as on the other ranks
run_cases([step(i, kind) for i, kind in
           enumerate(plan.choice(sorted(KINDS)) for _ in range(STEPS))], r)
dist.destroy_process_group()
print(f"OK rank {r}", flush=True)
