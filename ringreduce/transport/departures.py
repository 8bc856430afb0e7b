"""The members of a process set that have left it, or failed inside one of its collectives: a
member that shuts down says goodbye to the others (a small message on the set's communicator,
with how many collectives it began), one whose collective failed where its peers cannot see it
tells them why, the same way; the others look whenever they wait and before each
collective (stall.py)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from ..core.mpi import mpi
from ..core.waiting import wait_reporting

GOODBYE_TAG = 31
FAILED_TAG = 32


class Departures:
    """Which members have shut down, and which have failed in a collective. A member leaving
    says goodbye to every other member, with how many collectives it had begun (it finished
    them all first), one failing says why; the others notice it whenever they look (while
    waiting, and before each collective)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.gone: dict[int, int] = {}       # set rank -> the collectives it had begun
        self.restarting: set[int] = set()    # of those, the ones that start afresh (restart)
        self.failures: dict[int, str] = {}   # set rank -> what failed there, and why
        self._received = np.zeros(3, dtype=np.int64)
        self._looking = threading.Lock()     # a probed message is received by its prober

    def announce(self, begun: int, restarting: bool = False) -> None:
        """Say goodbye: this member leaves, having begun `begun` collectives; `restarting`:
        to start afresh at once with every member (world.restart)."""
        token = np.array([self.comm.rank, begun, restarting], dtype=np.int64)
        requests = [self.comm.Isend(token, dest=r, tag=GOODBYE_TAG)
                    for r in range(self.comm.size) if r != self.comm.rank]
        mpi().Request.Waitall(requests)

    def announce_failure(self, what: str) -> None:
        """Record this member's own failure and tell every other member (a short text each)."""
        self.failures[self.comm.rank] = what
        requests = [self.comm.isend(what, dest=r, tag=FAILED_TAG)
                    for r in range(self.comm.size) if r != self.comm.rank]
        mpi().Request.Waitall(requests)

    def look(self) -> None:
        """Receive every goodbye and failure that has arrived (from any thread: the engine's,
        or one waiting for a point-to-point message)."""
        MPI = mpi()
        status = MPI.Status()
        with self._looking:
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=GOODBYE_TAG, status=status):
                self.comm.Recv(self._received, source=status.Get_source(), tag=GOODBYE_TAG)
                member, begun, restarting = self._received.tolist()
                self.gone[member] = begun
                if restarting:
                    self.restarting.add(member)
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=FAILED_TAG, status=status):
                source = status.Get_source()
                self.failures[source] = self.comm.recv(source=source, tag=FAILED_TAG)

    def restartable(self) -> bool:
        """Whether shutdown() and init() on every member bring the set back: a member failed
        inside a collective, or left to start afresh, and none left for good."""
        return bool(self.failures or self.gone) and self.restarting.issuperset(self.gone)

    def ended(self, collective: int) -> bool:
        """Whether collective #`collective` can no longer complete: some member failed, or
        left before beginning it. (One that left after, finished its part first: a collective
        that completes on some members sooner than on others still completes on all.)"""
        return bool(self.failures) or any(begun < collective for begun in self.gone.values())

    def wait_for_everyone(self, report: Callable[[float, list[int]], None],
                          every: float) -> None:
        """Until every other member has said goodbye too (at shut-down, before the frees that
        are collective); `report(seconds, members not gone)` every `every` seconds meanwhile
        (0: never)."""
        def everyone_gone() -> bool:
            self.look()
            return len(self.gone) == self.comm.size - 1

        wait_reporting(everyone_gone, every, lambda seconds: report(seconds, [
            r for r in range(self.comm.size) if r != self.comm.rank and r not in self.gone]))
