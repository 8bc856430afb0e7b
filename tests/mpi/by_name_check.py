"""Collectives pair across ranks by name, as Horovod's coordinator pairs them: ranks may submit
the same named collectives in different orders and from different threads.

Every collective's value depends on its name and the rank, so a collective paired with another
name's data would show in the result; results are exact. Each case runs even when an earlier
one failed, and the failures are reported together, each named by its case and setting.

Usage: by_name_check.py [SETTINGS | stall]   (SETTINGS: a JSON object {label: {RINGREDUCE_*
variable: value}}, every case once per setting; "stall": rank 0 and rank 1 wait in
collectives of different names)
"""
import sys
import threading
import time

import torch
from mpi4py import MPI

import ringreduce as hvd
from checks import check_equal, expect, in_threads, per_setting, run_cases

world = MPI.COMM_WORLD
r, n = world.rank, world.size
assert n >= 2, "run with 2 or more ranks"
SIZES = {"small": 5, "blocks": 70_001}     # a small allreduce, and one block by block


def value(name, rank, length, dtype=torch.float32):
    """What `rank` contributes to the collective `name`: integers, so sums are exact."""
    return torch.arange(length, dtype=torch.float64).add(1000 * (sum(map(ord, name)) % 97)
                                                         + rank).to(dtype)


def total(name, length, dtype=torch.float32, ranks=None):
    ranks = range(n) if ranks is None else ranks
    return sum(value(name, k, length, torch.float64) for k in ranks).to(dtype)


def permuted(items):
    """A different order on each rank: reversed on odd ranks, rotated by the rank on even."""
    items = list(items)
    return items[::-1] if r % 2 else items[r % len(items):] + items[:r % len(items)]


def barrier_against_async():
    """Issue 20's first program: rank 0 submits 'x' then waits in a barrier; the others wait
    in the barrier first and submit 'x' after. In place too: a small one begins on the
    caller's thread (its part posted before the barrier's)."""
    for size, length in SIZES.items():
        for in_place in (False, True):
            name = f"x.{size}.{in_place}"
            mine = value(name, r, length)
            start = hvd.allreduce_async_ if in_place else hvd.allreduce_async
            if r == 0:
                handle = start(mine, name=name, op=hvd.Sum)
                hvd.barrier()
            else:
                hvd.barrier()
                handle = start(mine, name=name, op=hvd.Sum)
            check_equal(hvd.synchronize(handle), total(name, length), name)
            if not in_place:
                check_equal(mine, value(name, r, length), f"{name}: input changed")


def async_in_any_order():
    """Allreduces (both sizes, in place too), allgathers and broadcasts submitted in a
    different order on every rank."""
    calls = {}
    for size, length in SIZES.items():
        calls[f"sum.{size}"] = lambda name, length=length: hvd.allreduce_async(
            value(name, r, length), name=name, op=hvd.Sum)
        calls[f"inplace.{size}"] = lambda name, length=length: hvd.allreduce_async_(
            value(name, r, length), name=name, op=hvd.Sum)
    calls["gather"] = lambda name: hvd.allgather_async(value(name, r, 3 + r).reshape(-1, 1),
                                                       name=name)
    calls["bcast"] = lambda name: hvd.broadcast_async(value(name, r, 7), root_rank=n - 1,
                                                      name=name)
    handles = {name: calls[name](name) for name in permuted(calls)}
    for size, length in SIZES.items():
        for kind in ("sum", "inplace"):
            name = f"{kind}.{size}"
            check_equal(hvd.synchronize(handles[name]), total(name, length), name)
    check_equal(hvd.synchronize(handles["gather"]),
                torch.cat([value("gather", k, 3 + k) for k in range(n)]).reshape(-1, 1),
                "gather")
    check_equal(hvd.synchronize(handles["bcast"]), value("bcast", n - 1, 7), "bcast")



def kinds_share_a_name():
    """One name given to collectives of different kinds, all in flight at once and submitted
    in a different order on every rank: each pairs with its own kind (Horovod qualifies names
    by kind: 'allreduce.w', 'allgather.w'). And the variants of one kind pair with each other
    under a name: an in-place synchronous call on rank 0, an out-of-place differentiable one
    on the others."""
    for size, length in SIZES.items():
        name = f"w.{size}"
        calls = {
            "allreduce": lambda: hvd.allreduce_async(value(name, r, length), name=name,
                                                     op=hvd.Sum),
            "allgather": lambda: hvd.allgather_async(value(name, r, 3 + r), name=name),
            "broadcast": lambda: hvd.broadcast_async(value(name, r, length), root_rank=0,
                                                     name=name),
            "alltoall": lambda: hvd.alltoall_async(value(name, r, 2 * n), name=name),
            "grouped_allreduce": lambda: hvd.grouped_allreduce_async(
                [value(name, r, length)], name=name, op=hvd.Sum),
        }
        handles = {kind: calls[kind]() for kind in permuted(calls)}
        got = {kind: hvd.synchronize(handle) for kind, handle in handles.items()}
        check_equal(got["allreduce"], total(name, length), f"{name}: allreduce")
        check_equal(got["allgather"], torch.cat([value(name, k, 3 + k) for k in range(n)]),
                    f"{name}: allgather")
        check_equal(got["broadcast"], value(name, 0, length), f"{name}: broadcast")
        check_equal(got["alltoall"][0],
                    torch.cat([value(name, k, 2 * n)[2 * r:2 * r + 2] for k in range(n)]),
                    f"{name}: alltoall")
        check_equal(got["grouped_allreduce"][0], total(name, length),
                    f"{name}: grouped_allreduce")
        mine = value(name, r, length)
        reduced = (hvd.allreduce_(mine, name=name, op=hvd.Sum) if r == 0
                   else hvd.allreduce(mine.requires_grad_(), name=name, op=hvd.Sum).detach())
        check_equal(reduced, total(name, length), f"{name}: allreduce_ against allreduce")

def synchronous_after_async():
    """Rank 0 queues 'p' and then reduces 'q' synchronously; the others reduce 'q' first
    (the small, inline way) and queue 'p' after: 'q' runs first everywhere."""
    for size, length in SIZES.items():
        for start in (hvd.allreduce_async, hvd.allreduce_async_):
            p, q = f"p.{size}.{start.__name__}", f"q.{size}.{start.__name__}"
            if r == 0:
                handle = start(value(p, r, length), name=p, op=hvd.Sum)
                got_q = hvd.allreduce(value(q, r, 4), name=q, op=hvd.Sum)
            else:
                got_q = hvd.allreduce(value(q, r, 4), name=q, op=hvd.Sum)
                handle = start(value(p, r, length), name=p, op=hvd.Sum)
            check_equal(got_q, total(q, 4), q)
            check_equal(hvd.synchronize(handle), total(p, length), p)


def unrelated_thread_on_one_rank():
    """Issue 20's second program: rank 0 has started another thread before; each rank's worker
    thread reduces with automatic names, in a fixed order."""
    idle = threading.Event()
    extra = threading.Thread(target=idle.wait) if r == 0 else None
    if extra:
        extra.start()
    got = []

    def worker():
        for i in range(6):
            length = SIZES["blocks"] if i % 3 == 2 else 4
            got.append(hvd.allreduce(value(f"w{i}", r, length), op=hvd.Sum))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    idle.set()
    if extra:
        extra.join()
    assert len(got) == 6, "the worker died"
    for i, result in enumerate(got):
        length = SIZES["blocks"] if i % 3 == 2 else 4
        check_equal(result, total(f"w{i}", length), f"worker's allreduce #{i}")


def thread_per_set():
    """One thread per process set on each rank, where ranks belong to different numbers of
    sets: automatic names count per set."""
    sets = [hvd.add_process_set(list(range(n - 1))), hvd.add_process_set(list(range(1, n)))]
    results = {}

    def worker(k, ps):
        results[k] = [hvd.allreduce(value(f"set{k}.{i}", r, 4), op=hvd.Sum, process_set=ps)
                      for i in range(5)]

    threads = [threading.Thread(target=worker, args=(k, ps)) for k, ps in enumerate(sets)
               if ps.included()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for k, ps in enumerate(sets):
            if ps.included():
                assert len(results.get(k, [])) == 5, f"set {k}'s thread died"
                for i, got in enumerate(results[k]):
                    check_equal(got, total(f"set{k}.{i}", 4, ranks=ps.ranks), f"set {k} #{i}")
    finally:
        for ps in sets:
            hvd.remove_process_set(ps)


def racing_threads_with_names():
    """Two threads per rank reduce in a loop with names of their own: however the threads
    interleave on each rank, every result is right."""
    results = {}

    def worker(t):
        results[t] = [(i, hvd.allreduce(value(f"t{t}.{i}", r, 3 + t), name=f"t{t}.{i}",
                                        op=hvd.Sum)) for i in range(30)]

    in_threads(worker, 2)
    for t in range(2):
        assert len(results.get(t, [])) == 30, f"thread {t} died"
        for i, got in results[t]:
            check_equal(got, total(f"t{t}.{i}", 3 + t), f"t{t}.{i}")


def same_name_from_two_threads():
    """A name submitted by a second thread of a rank while the first's is pending is
    refused there (ValueError), never paired. Each rank in turn: while it tries, the others
    have not submitted the name yet, so it is certainly pending."""
    for k in range(n):
        for mode in ("queued", "inline"):
            name = f"dup.{k}.{mode}"
            if r == k:
                outcomes = {}

                def first():
                    if mode == "queued":
                        outcomes["first"] = hvd.allreduce_async(value(name, r, 4), name=name,
                                                                op=hvd.Sum)
                    else:   # waits inside a synchronous small allreduce, holding the engine
                        try:
                            outcomes["first"] = hvd.allreduce(value(name, r, 4), name=name,
                                                              op=hvd.Sum)
                        except ValueError as e:
                            outcomes["first"] = e

                holder = threading.Thread(target=first)
                holder.start()
                if mode == "queued":
                    holder.join()
                else:
                    time.sleep(0.2)     # let it take the engine (either order is checked)
                try:
                    outcomes["second"] = hvd.allreduce_async(value(name, r, 4), name=name,
                                                             op=hvd.Sum)
                except ValueError as e:
                    outcomes["second"] = e
                world.Barrier()         # now the others submit the name once
                if mode == "inline":
                    holder.join()
                refused = [w for w, o in outcomes.items() if isinstance(o, ValueError)]
                assert len(refused) == 1, f"{name}: refused {refused} ({outcomes})"
                assert "still in flight" in str(outcomes[refused[0]]), outcomes[refused[0]]
                kept = outcomes["second" if refused == ["first"] else "first"]
                got = kept if isinstance(kept, torch.Tensor) else hvd.synchronize(kept)
            else:
                world.Barrier()
                got = hvd.allreduce(value(name, r, 4), name=name, op=hvd.Sum)
            check_equal(got, total(name, 4), name)


def after_failures():
    """After a collective fails (a mismatch, a duplicate name, a user exception between
    submissions) later collectives, named and unnamed, still pair on every rank."""

    def pairs_still(label):
        handles = [(f"{label}.{i}", hvd.allreduce_async(value(f"{label}.{i}", r, 4),
                                                        name=f"{label}.{i}", op=hvd.Sum))
                   for i in permuted(range(3))]
        for name, handle in handles:
            check_equal(hvd.synchronize(handle), total(name, 4), f"after {label}: {name}")
        for i in range(3):      # unnamed: their names count alike on every rank
            check_equal(hvd.allreduce(value(f"auto{i}", r, 6), op=hvd.Sum),
                        total(f"auto{i}", 6), f"after {label}: unnamed #{i}")

    expect(hvd.MismatchError, ["'allreduce.shape_mm'", "'shape'"], hvd.allreduce,
           torch.ones(3 + r), name="shape_mm")
    pairs_still("mismatch")
    if r == 0:      # a duplicate on one rank only ('held' cannot complete before the others')
        held = hvd.allreduce_async(value("held", r, 4), name="held", op=hvd.Sum)
        expect(ValueError, ["'allreduce.held'", "still in flight"], hvd.allreduce_async,
               torch.ones(2),
               name="held")
        world.Barrier()
    else:
        world.Barrier()
        held = hvd.allreduce_async(value("held", r, 4), name="held", op=hvd.Sum)
    check_equal(hvd.synchronize(held), total("held", 4), "held")
    pairs_still("duplicate")
    handles = {}
    try:        # a user's exception after two submissions, in another order on each rank
        for i in permuted(range(3)):
            handles[f"u{i}"] = hvd.allreduce_async(value(f"u{i}", r, 4), name=f"u{i}",
                                                   op=hvd.Sum)
            if len(handles) == 2:
                raise KeyError("a user's mistake")
    except KeyError:
        pass
    for i in range(3):      # the program goes on: what it had not submitted, it submits now
        if f"u{i}" not in handles:
            handles[f"u{i}"] = hvd.allreduce_async(value(f"u{i}", r, 4), name=f"u{i}",
                                                   op=hvd.Sum)
    for name, handle in handles.items():
        check_equal(hvd.synchronize(handle), total(name, 4), name)
    pairs_still("user exception")


CASES = [barrier_against_async, async_in_any_order, kinds_share_a_name,
         synchronous_after_async, unrelated_thread_on_one_rank, thread_per_set,
         racing_threads_with_names, same_name_from_two_threads, after_failures]


def stall():
    """Rank 0 waits in 'n0', rank 1 in 'n1', the others in both: no name is pending
    everywhere. The stall report names each name and where it is pending. (Each rank also has
    a thread that has submitted a collective and sleeps, which may yet submit one: so this is
    a stall, not a deadlock, which errors_check.py shows.)"""
    hvd.init()
    submitted = threading.Event()

    def sleeper() -> None:
        hvd.allreduce(torch.ones(1), name="awake")
        submitted.set()
        time.sleep(60)

    threading.Thread(target=sleeper, daemon=True).start()
    submitted.wait()
    names = ["n0"] if r == 0 else ["n1"] if r == 1 else ["n0", "n1"]
    handles = [hvd.allreduce_async(torch.ones(2), name=name) for name in names]
    for handle in handles:
        hvd.synchronize(handle)


if sys.argv[1:] == ["stall"]:
    stall()
else:
    per_setting(sys.argv[1] if len(sys.argv) > 1 else None, hvd.init,
                lambda: run_cases(CASES, r), hvd.shutdown)
print(f"OK rank {r}", flush=True)
