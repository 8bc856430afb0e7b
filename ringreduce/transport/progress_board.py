"""Each member's progress on one process set, readable by every other member without its help:
how many collectives it has begun, and which one it waits in, in a two-integer MPI window of
the set (one-sided reads, so that a stall report can say where the missing ranks are)."""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from ..core.mpi import mpi
from ..core.thread_places import internal


class ProgressBoard:
    """Every member's count of collectives begun, and the one it waits in (0: none), readable
    by all through one-sided MPI."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.win = mpi().Win.Allocate(16, disp_unit=8, comm=comm)
        self.mine = np.frombuffer(self.win.tomemory(), dtype=np.int64)  # (begun, waiting in)
        self.mine[:] = 0
        self._counts = np.zeros((comm.size, 2), dtype=np.int64)
        self._reader: Optional[threading.Thread] = None
        self._starting = threading.Lock()   # reports of two sets may read one board at once
        comm.Barrier()

    def publish(self, count: int) -> None:
        self.mine[0] = count

    def read_all(self, timeout: float) -> Optional[np.ndarray]:
        """Every member's (count, collective it waits in), one row each, or None if some
        member did not answer within `timeout` s.

        A read completes only when its targets make MPI progress (idle engine threads poke
        MPI), so it runs on a helper thread: a member stuck in native code, or stopped, must
        not turn the report itself into a hang. There is never more than one reader: a read
        still waiting is waited for, not overlapped (a second lock of the window is an error)."""
        with self._starting:
            if self._reader is None or not self._reader.is_alive():
                self._reader = threading.Thread(target=self._read,
                                                name="ringreduce-stall-read", daemon=True)
                internal(self._reader)
                self._reader.start()
            reader = self._reader
        reader.join(timeout)
        return None if reader.is_alive() else self._counts.copy()

    def _read(self) -> None:
        self.win.Lock_all()
        for r in range(self.comm.size):
            self.win.Get(self._counts[r:r + 1], r)
        self.win.Unlock_all()

    def free(self) -> None:
        """Free the window (collective: every member is shutting down, so a read still waiting
        for one of them completes first)."""
        if self._reader is not None:
            self._reader.join()
        self.win.Free()
