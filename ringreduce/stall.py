"""Stall watch: a rank waiting for others to join a collective says who is missing, and why.

Each rank publishes how many collectives it has begun on a process set in a one-integer MPI
window of that set. A rank that has waited `stall_check_time` seconds in a collective reads every
member's count (one-sided, so the missing ranks need not cooperate), logs which ranks have not
reached the collective and the last one they did reach, and after `stall_shutdown_time` hands
that message to its `on_shutdown` (which ends the job).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .mpi import mpi

log = logging.getLogger("ringreduce")
_BUSY_SECONDS = 0.00005  # poll flat out this long (as MPI does): a peer is usually close
_YIELD_SECONDS = 0.001   # then yield the core between polls (oversubscribed ranks), then sleep
_REMEMBERED = 4096       # the descriptions of this many recent collectives, for stall reports
_JOINED_COUNT = 1 << 62  # what a joined rank publishes on the progress board


class ProgressBoard:
    """Every rank's count of collectives begun, readable by all through one-sided MPI."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.win = mpi().Win.Allocate(8, disp_unit=8, comm=comm)
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
    """Counts the collectives begun on one process set and waits for its members, reporting
    stalls. `ranks` are the members' global ranks (for messages), `where` names the set."""

    def __init__(self, comm: Any, check_time: float, shutdown_time: float,
                 on_shutdown: Callable[[str], None], ranks: Sequence[int], where: str) -> None:
        self.comm = comm
        self.check_time = check_time
        self.shutdown_time = shutdown_time
        self.on_shutdown = on_shutdown
        self.ranks = list(ranks)
        self.where = where
        self.board = ProgressBoard(comm) if comm.size > 1 else None
        self.begun = 0
        self.quiet = False      # a joined rank waits for the others by design: no reports
        self._recent: list[tuple[int, Any]] = [(0, "")] * _REMEMBERED   # (count, description)

    def free(self) -> None:
        if self.board is not None:
            self.board.free()

    def set_joined(self, joined: bool) -> None:
        """While this rank has joined, it waits quietly, and its peers' reports do not count
        it as missing (its published count is above any collective's)."""
        self.quiet = joined
        if self.board is not None:
            self.board.publish(_JOINED_COUNT if joined else self.begun)

    def begin(self, description: Any) -> int:
        """Count one more collective begun on this rank, and remember what it was (a callable
        making its name, or an object whose str() is: formatted only if a stall is reported)."""
        self.begun += 1
        self._recent[self.begun % _REMEMBERED] = (self.begun, description)
        if self.board is not None:
            self.board.publish(self.begun)
        return self.begun

    def wait(self, done: Callable[[], bool]) -> None:
        """Wait until `done()` without hogging the core; report stalls while waiting."""
        if done():
            return
        start = time.monotonic()
        next_report = start + self.check_time if self.check_time > 0 and not self.quiet \
            else float("inf")
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
                    self.on_shutdown(f"{message} Shutting the job down after "
                                     f"{self.shutdown_time:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME).")

    def _name(self, count: int) -> str:
        remembered, description = self._recent[count % _REMEMBERED]
        if remembered != count:
            return ""
        return description() if callable(description) else str(description)

    def describe(self, waited: float) -> str:
        where = (f"ringreduce: stall: rank {self.ranks[self.comm.rank]} has waited {waited:.0f} s "
                 f"in collective #{self.begun} {self._name(self.begun)}{self.where}")
        counts = self.board.read_all(timeout=2.0) if self.board is not None else None
        if counts is None:
            return (where + ", and some rank does not answer at all (stuck in native code, or "
                    "its process is gone).")
        late = [r for r, c in enumerate(counts) if c < self.begun]
        if not late:
            return where + "; every rank has begun it, so a rank is slow or stuck inside it."
        missing = [self.ranks[r] for r in late]
        behind = "; ".join(f"rank {self.ranks[r]} last began #{c} {self._name(int(c))}".rstrip()
                           for r, c in zip(late, counts[late]))
        return (f"{where}, which ranks {missing} have not submitted ({behind}). Those ranks are "
                "stuck in their own code, or submit collectives in a different order or number "
                "than the others.")
