"""An interrupt stays an interrupt (issue 56): a real SIGINT to rank 0 while it waits on an
asynchronous collective (Horovod's synchronize, torch's Work.wait, a large allreduce), and a
KeyboardInterrupt raised in a compressor's decompress on the engine thread, reach the caller as
KeyboardInterrupt, which `except KeyboardInterrupt` catches. The other ranks either complete
the collective (where the interrupt came while rank 0 only waited) or get a ShutDownError
naming it (where it came inside rank 0's exchange); either way every rank goes on after
shutdown() and init(), and the compressor's case leaves the set as it was.

Usage: interrupt_check.py
"""
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import ringreduce as hvd
import ringreduce.distributed
from checks import run_cases

world = MPI.COMM_WORLD
r, n = world.rank, world.size
LATE = 1.0          # the other ranks come this late to the collective rank 0 waits in
INTERRUPT_AFTER = 0.3


def interrupted(wait) -> str:
    """Rank 0 runs `wait()` with a SIGINT sent to itself after INTERRUPT_AFTER s; what it got."""
    timer = threading.Timer(INTERRUPT_AFTER, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        wait()
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except BaseException as e:      # (what the issue saw: a RingReduceError wrapping it)
        return f"{type(e).__name__}: {e}"
    finally:
        timer.cancel()
    return "no interrupt"


def joined_late(start) -> str:
    """The other ranks' side: they come late; the collective completes, or the set was shut
    down by rank 0's interrupt inside it."""
    time.sleep(LATE)
    try:
        start()()
        return "done"
    except hvd.ShutDownError as e:
        assert "KeyboardInterrupt" in str(e) and "rank 0" in str(e), e
        return "shut down"


def then_afresh() -> None:
    """Every rank: the job goes on after shutdown() and init()."""
    world.Barrier()
    hvd.shutdown()
    hvd.init()
    got = hvd.allreduce(torch.full((3,), float(r)), name="afresh", op=hvd.Sum)
    assert torch.equal(got, torch.full((3,), float(sum(range(n))))), got


def case(label, start, setup=lambda: None, cleanup=lambda: None):
    """`start()` begins the asynchronous collective and returns what waits for it; `setup()`
    runs on every rank before, `cleanup()` after the wait, whatever came of it."""
    def check() -> None:
        setup()
        world.Barrier()
        try:
            if r == 0:
                outcome = interrupted(start())
                assert outcome == "KeyboardInterrupt", f"{label}: rank 0 got {outcome}"
            else:
                joined_late(start)
        finally:
            cleanup()
            then_afresh()
    check.__name__ = label
    return check


def horovod_small():
    handle = hvd.allreduce_async(torch.ones(16), name="small", op=hvd.Sum)
    return lambda: hvd.synchronize(handle)


def horovod_large():
    handle = hvd.allreduce_async(torch.ones(16_000_000), name="large", op=hvd.Sum)
    return lambda: hvd.synchronize(handle)


def torch_async():
    return dist.all_reduce(torch.ones(16), async_op=True).wait


class InterruptingDecompress(hvd.Compression.none):
    """A compressor of the user's own whose decompress is interrupted, on rank 0 alone."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, context):
        if r == 0:
            raise KeyboardInterrupt("in decompress")
        return tensor


def decompress_on_the_engine_thread() -> None:
    """Its KeyboardInterrupt reaches the waiter as one; the collective itself completed on
    every rank, so the set goes on as it was."""
    handle = hvd.allreduce_async(torch.ones(8), name="decompressed", op=hvd.Sum,
                                 compression=InterruptingDecompress)
    try:
        got = hvd.synchronize(handle)
        assert r != 0, "rank 0's decompress did not raise"
        assert torch.equal(got, torch.full((8,), float(n))), got
    except KeyboardInterrupt as e:
        assert r == 0 and "in decompress" in str(e), e
    got = hvd.allreduce(torch.ones(2), name="after decompress", op=hvd.Sum)
    assert torch.equal(got, torch.full((2,), float(n))), got


hvd.init()
run_cases([case("synchronize of a small allreduce_async", horovod_small),
           case("synchronize of a 16M-element allreduce_async", horovod_large),
           case("torch's Work.wait of an asynchronous all_reduce", torch_async,
                ringreduce.distributed.init_process_group, dist.destroy_process_group),
           decompress_on_the_engine_thread], r)
hvd.shutdown()
print(f"OK rank {r}", flush=True)
