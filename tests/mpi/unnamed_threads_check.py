"""Unnamed collectives from several threads (issue 58): each thread's pair with the same thread
on the other ranks, never with another thread's, however the threads interleave; where ranks
run them on different threads, an error on every rank, and the set goes on.

Every thread's contribution depends on the thread, the call and the rank, and every thread's
collectives have the same shapes, so a collective paired with another thread's would show in
its result; results are exact. Each case runs even when an earlier one failed.

Usage: unnamed_threads_check.py REPEATS [SETTINGS]   (REPEATS: how many times each threaded
case runs; SETTINGS: a JSON object {label: {RINGREDUCE_* variable: value}}, every case once
per setting)
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
REPEATS = int(sys.argv[1])
CALLS = 40          # unnamed collectives per thread and repeat
LENGTH = 6          # every thread's tensors have this length: only the values tell them apart


def value(t: int, i: int, rank: int) -> torch.Tensor:
    """What thread `t` contributes on `rank` to its i-th call: integers, so sums are exact."""
    return torch.arange(LENGTH, dtype=torch.float32) + (10_000 * t + 100 * i + rank)


def total(t: int, i: int) -> torch.Tensor:
    return sum(value(t, i, k) for k in range(n))


def one_call(t: int, i: int, kinds: str) -> None:
    """Thread t's i-th call: an allreduce, an allgather or a broadcast (`kinds` "allreduce":
    only allreduces, in turn synchronous, in place and asynchronous), checked exactly."""
    kind = ("allreduce", "allgather", "broadcast")[i % 3] if kinds == "mixed" else kinds
    what = f"thread {t}, call {i} ({kind})"
    if kind == "allreduce":
        mine = value(t, i, r)
        way = i % 3
        got = (hvd.allreduce(mine, op=hvd.Sum) if way == 0 else
               hvd.allreduce_(mine, op=hvd.Sum) if way == 1 else
               hvd.synchronize(hvd.allreduce_async(mine, op=hvd.Sum)))
        check_equal(got, total(t, i), what)
    elif kind == "allgather":
        got = hvd.allgather(value(t, i, r).reshape(1, -1))
        check_equal(got, torch.stack([value(t, i, k) for k in range(n)]), what)
    else:
        root = i % n
        check_equal(hvd.broadcast(value(t, i, r), root_rank=root), value(t, i, root), what)


def threads(count: int, kinds: str, one_after_the_other: bool, late: int = -1) -> None:
    """`count` threads, each running CALLS unnamed collectives; started together (each
    starts at once) or one after the other (each once the one before has had a result).
    Thread `late` waits a while before its first call."""
    failures: list[str] = []
    progressed = [threading.Event() for _ in range(count)]

    def worker(t: int) -> None:
        try:
            if t == late:
                time.sleep(0.2)
            for i in range(CALLS):
                one_call(t, i, kinds)
                progressed[t].set()
        except BaseException as e:      # (reported by the main thread, named)
            failures.append(f"thread {t}: {type(e).__name__}: {e}")
            progressed[t].set()

    started = []
    for t in range(count):
        started.append(threading.Thread(target=worker, args=(t,)))
        started[-1].start()
        if one_after_the_other:
            progressed[t].wait()
    for thread in started:
        thread.join()
    assert not failures, "; ".join(failures)


def repeated(count: int, kinds: str, one_after_the_other: bool):
    def case() -> None:
        for _ in range(REPEATS):
            threads(count, kinds, one_after_the_other)
    order = "one after the other" if one_after_the_other else "together"
    case.__name__ = f"{count} threads, {kinds}, started {order}"
    return case


def first_calls_in_opposite_orders() -> None:
    """The threads make their first calls in another order on each rank (each rank's thread
    r % 2 starts late): still each pairs with its own."""
    threads(2, "allreduce", one_after_the_other=False, late=r % 2)


def idle_thread_on_one_rank() -> None:
    """Rank 0 alone has started a thread that submits nothing (a logger), before the threads
    that do: no error, every result right."""
    stop = threading.Event()

    def logger() -> None:
        stop.wait()

    extra = threading.Thread(target=logger) if r == 0 else None
    if extra is not None:
        extra.start()
    try:
        threads(2, "mixed", one_after_the_other=False)
    finally:
        stop.set()
        if extra is not None:
            extra.join()


def main_and_worker_threads() -> None:
    """The main thread and a worker thread submit unnamed allreduces at once: each pairs with
    its own."""
    done: dict[str, BaseException] = {}

    def worker() -> None:
        try:
            for i in range(CALLS):
                one_call(1, i, "allreduce")
        except BaseException as e:
            done["worker"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    for i in range(CALLS):
        one_call(0, i, "allreduce")
    thread.join()
    assert not done, f"the worker thread: {done['worker']!r}"


def thread_on_some_ranks_only() -> None:
    """Rank 0 runs an unnamed allreduce on a thread of its own where the others run it on the
    main thread: nothing pairs them, and once nothing was pending on every rank for a stall
    check's time (2 s here), every rank fails it with a MismatchError naming the thread; then
    named and unnamed collectives go on (the main threads' counts realigned)."""
    hvd.shutdown()
    hvd.init(stall_check_time=2)
    def worker(results: list) -> None:
        try:
            hvd.allreduce(torch.ones(3), op=hvd.Sum)
        except hvd.MismatchError as e:
            results.append(e)

    fragments = ["cannot run", "'allreduce.noname.", "thread_on_some_ranks_only.worker#",
                 "pair thread with thread", "name them"]
    if r == 0:
        results: list = []
        thread = threading.Thread(target=worker, args=(results,))
        thread.start()
        thread.join()
        assert len(results) == 1, "rank 0's thread got no MismatchError"
        for fragment in fragments:
            assert fragment in str(results[0]), f"{fragment!r} not in {results[0]}"
    else:
        expect(hvd.MismatchError, fragments, hvd.allreduce, torch.ones(3), op=hvd.Sum)
    check_equal(hvd.allreduce(torch.ones(3), name="after", op=hvd.Sum),
                torch.full((3,), float(n)), "a named allreduce after it")
    for i in range(3):
        one_call(0, i, "mixed")
    hvd.shutdown()
    hvd.init()


def named_from_many_threads() -> None:
    """Four threads reduce with names of their own: unchanged, every result right."""
    results: dict = {}

    def named(t: int) -> None:
        results[t] = [hvd.allreduce(value(t, i, r), name=f"n{t}.{i}", op=hvd.Sum)
                      for i in range(CALLS)]

    in_threads(named, 4)
    for t in range(4):
        assert len(results.get(t, [])) == CALLS, f"thread {t} died"
        for i, got in enumerate(results[t]):
            check_equal(got, total(t, i), f"n{t}.{i}")


def optimizers_wrapped_in_opposite_orders() -> None:
    """Two threads each wrap a DistributedOptimizer of the same model (an ensemble), in one
    order on even ranks and the other on odd ones (one thread starts late): each thread's
    buckets pair with the same thread's, whose names carry its place. They were named by
    the order of wrapping, so model a on one rank was averaged with model b on another, with
    no error. Each model steps with the average of its own gradients: a's inputs are 1 on
    every rank, b's 100, so after one step of lr 1, w = w0 - 1 and w0 - 100, exactly."""
    results: dict = {}

    def train(t: int) -> None:
        if t == (r + 1) % 2:
            time.sleep(0.3)
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       model.named_parameters())
        model(torch.full((1, 2), 100.0 ** t)).sum().backward()
        opt.step()
        results[t] = model.weight.detach().clone()

    in_threads(train, 2)
    for t in range(2):
        check_equal(results.get(t), torch.full((1, 2), -(100.0 ** t)), f"model {t}")


CASES = [repeated(2, "allreduce", False), repeated(2, "allreduce", True),
         repeated(4, "mixed", False), repeated(4, "mixed", True),
         repeated(2, "allgather", False), repeated(2, "broadcast", False),
         first_calls_in_opposite_orders, idle_thread_on_one_rank, main_and_worker_threads, thread_on_some_ranks_only,
         named_from_many_threads, optimizers_wrapped_in_opposite_orders]

per_setting(sys.argv[2] if len(sys.argv) > 2 else None, hvd.init,
            lambda: run_cases(CASES, r), hvd.shutdown)
print(f"OK rank {r}", flush=True)
