"""Stall watch: a rank waiting for others to join a collective says who is missing, and why.

Each rank publishes how many collectives it has begun in a one-integer MPI window. A rank that
has waited `stall_check_time` seconds in a collective reads every rank's count (one-sided, so
the missing ranks need not cooperate), logs which ranks have not reached the collective and
the last one they did reach, and after `stall_shutdown_time` aborts the job with that message.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

log = logging.getLogger("ringreduce")
_BUSY_SECONDS = 0.00005  # poll flat out this long (as MPI does): a peer is usually close
_YIELD_SECONDS = 0.001   # then yield the core between polls (oversubscribed ranks), then sleep


class ProgressBoard:
    """Every rank's count of collectives begun, readable by all through one-sided MPI."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.win = MPI.Win.Allocate(8, disp_unit=8, comm=comm)
        self.mine = np.frombuffer(self.win.tomemory(), dtype=np.int64)
        self.mine[0] = 0
        comm.Barrier()

    def publish(self, count: int) -> None:
        self.mine[0] = count

    def read_all(self, timeout: float) -> Optional[np.ndarray]:
        """Every rank's count, or None if some rank did not answer within `timeout` seconds.

        A read completes only when its target makes MPI progress (the engine thread pokes MPI
        while idle), so it runs on a helper thread: a rank stuck in native code must not turn
        the stall report itself into a hang."""
        counts = np.zeros(self.comm.size, dtype=np.int64)

        def read() -> None:
            self.win.Lock_all()
            for r in range(self.comm.size):
                self.win.Get(counts[r:r + 1], r)
            self.win.Unlock_all()

        reader = threading.Thread(target=read, name="ringreduce-stall-read", daemon=True)
        reader.start()
        reader.join(timeout)
        return None if reader.is_alive() else counts

    def free(self) -> None:
        self.win.Free()


class StallWatch:
    def __init__(self, comm: Any, check_time: float, shutdown_time: float) -> None:
        self.comm = comm
        self.check_time = check_time
        self.shutdown_time = shutdown_time
        self.board = ProgressBoard(comm) if comm.size > 1 else None
        self.begun = 0
        self._names: collections.OrderedDict[int, Any] = collections.OrderedDict()

    def begin(self, description: Any) -> int:
        """Count one more collective begun on this rank, and remember what it was (a string, or
        a callable making one: formatted only if a stall is reported)."""
        self.begun += 1
        self._names[self.begun] = description
        if len(self._names) > 10_000:
            self._names.popitem(last=False)
        if self.board is not None:
            self.board.publish(self.begun)
        return self.begun

    def wait(self, done: Callable[[], bool]) -> None:
        """Wait until `done()` without hogging the core; report stalls while waiting."""
        if done():
            return
        start = time.monotonic()
        next_report = start + self.check_time if self.check_time > 0 else float("inf")
        while not done():
            now = time.monotonic()
            if now - start < _BUSY_SECONDS:
                continue
            if now - start < _YIELD_SECONDS:
                os.sched_yield()
                continue
            time.sleep(0.0001)
            if now >= next_report:
                message = self.describe(now - start)
                log.warning(message)
                next_report = now + self.check_time
                if self.shutdown_time > 0 and now - start >= self.shutdown_time:
                    from .world import abort

                    abort(message + f" Shutting the job down after {self.shutdown_time:g} s "
                          "(RINGREDUCE_STALL_SHUTDOWN_TIME).")

    def _name(self, count: int) -> str:
        description = self._names.get(count, "")
        return description() if callable(description) else description

    def describe(self, waited: float) -> str:
        where = (f"ringreduce: stall: rank {self.comm.rank} has waited {waited:.0f} s in "
                 f"collective #{self.begun} {self._name(self.begun)}")
        counts = self.board.read_all(timeout=2.0) if self.board is not None else None
        if counts is None:
            return (where + ", and some rank does not answer at all (stuck in native code, or "
                    "its process is gone).")
        missing = [r for r, c in enumerate(counts) if c < self.begun]
        if not missing:
            return where + "; every rank has begun it, so a rank is slow or stuck inside it."
        behind = "; ".join(f"rank {r} last began #{c} {self._name(int(c))}".rstrip()
                           for r, c in zip(missing, counts[missing]))
        return (f"{where}, which ranks {missing} have not submitted ({behind}). Those ranks are "
                "stuck in their own code, or submit collectives in a different order or number "
                "than the others.")
