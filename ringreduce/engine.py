"""The one place that runs collectives: in submission order, one at a time.

Asynchronous work goes to a background thread, so communication overlaps backward. A
synchronous call made while nothing is queued runs inline on the caller's thread instead:
waking a sleeping thread costs tens of microseconds, more than a small allreduce itself.
Either way exactly one thread runs MPI at a time and the order is the submission order, which
is the same on every rank because user code submits in the same order.

Errors raised while running a collective are stored on its handle and re-raised by `wait()`
in the caller's thread, so the engine thread never dies of a user's mistake.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .errors import RingReduceError
from .negotiation import Negotiator
from .stall import StallWatch

_IDLE_POKE_SECONDS = 0.05


class Handle:
    """A future for one collective: `done()` polls, `wait()` returns its result or raises."""

    def __init__(self, name: str, work: Callable[[], Any]) -> None:
        self.name = name
        self._work = work
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self) -> None:
        try:
            self._result = _call(self.name, self._work)
        except RingReduceError as exc:
            self._error = exc
        finally:
            self._work = None
            self._done.set()


def _call(name: str, work: Callable[[], Any]) -> Any:
    """Run a collective; failures other than ours reach the caller as RingReduceError with
    their cause chained."""
    try:
        return work()
    except RingReduceError:
        raise
    except Exception as exc:  # MPI failures and bugs
        raise RingReduceError(f"ringreduce: collective '{name}' failed: {exc}") from exc


class ScratchPool:
    """Reusable scratch memory, one growing block per purpose, so steady-state steps allocate
    nothing. Only the thread running a collective uses it."""

    def __init__(self) -> None:
        self._blocks: dict[str, np.ndarray] = {}

    def get(self, purpose: str, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        block = self._blocks.get(purpose)
        if block is None or block.nbytes < nbytes:
            block = self._blocks[purpose] = np.empty(max(nbytes, 64), dtype=np.uint8)
        return block[:nbytes].view(dtype)


class Engine:
    def __init__(self, comm: Any, settings: Optional[dict] = None) -> None:
        self.comm = comm
        self.settings = dict(settings or {})
        self.negotiator = Negotiator(comm, StallWatch(
            comm, self.settings.get("stall_check_time", 0), self.settings.get("stall_shutdown_time", 0)))
        self.scratch = ScratchPool()
        self.events: Optional[list[tuple[float, str, str]]] = None  # set to a list to record
        self.timeline: Any = None   # a timeline.Timeline while one is being written
        self.node: Any = None       # a shm.NodeShm when ranks share this node
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[Handle] = collections.deque()
        self._in_flight: dict[str, Handle] = {}
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ringreduce-engine", daemon=True)
        self._thread.start()

    def record(self, name: str, phase: str) -> None:
        """Note an instant in a collective's life (for tests and the timeline); free when
        nobody listens."""
        if self.events is not None:
            self.events.append((time.perf_counter(), name, phase))
        timeline = self.timeline    # read once: another thread may stop the timeline
        if timeline is not None:
            timeline.instant(name, phase)

    @contextlib.contextmanager
    def span(self, name: str, phase: str) -> Iterator[None]:
        """Time a phase of a collective (pack, negotiate, reduce-scatter, allgather, unpack)."""
        timeline = self.timeline
        if timeline is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            timeline.span(name, phase, start, time.perf_counter())

    def submit(self, name: str, work: Callable[[], Any]) -> Handle:
        """Queue `work` to run after everything submitted before it; returns its handle."""
        handle = Handle(name, work)
        with self._cv:
            self._claim_name(name, handle)
            self._queue.append(handle)
            self._cv.notify_all()
        self.record(name, "submitted")
        return handle

    def run(self, name: str, work: Callable[[], Any]) -> Any:
        """Run `work` now and return its result: inline when the engine is idle, else queued."""
        with self._cv:
            if not self._queue and not self._busy:
                self._claim_name(name, None)
                self._busy = True
                handle = None
            else:
                handle = Handle(name, work)
                self._claim_name(name, handle)
                self._queue.append(handle)
                self._cv.notify_all()
        if handle is not None:
            return handle.wait()
        try:
            return _call(name, work)
        finally:
            self._finish(name)

    def claim_idle(self) -> bool:
        """Take the engine for one synchronous call on this thread if nothing is queued or
        running (then no name is in flight either); `release_idle()` after it."""
        with self._cv:
            if self._queue or self._busy or self._stopping:
                return False
            self._busy = True
            return True

    def release_idle(self) -> None:
        self._finish("")

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        if self.node is not None:
            self.node.free()
        if self.negotiator.watch.board is not None:
            self.negotiator.watch.board.free()

    def _claim_name(self, name: str, handle: Optional[Handle]) -> None:
        if self._stopping:
            raise RingReduceError("ringreduce: the engine is shut down; call init() again")
        if name in self._in_flight:
            raise ValueError(
                f"ringreduce: a collective named '{name}' is still in flight on rank "
                f"{self.comm.rank}; wait for it (synchronize) before reusing the name")
        self._in_flight[name] = handle

    def _finish(self, name: str) -> None:
        with self._cv:
            self._busy = False
            self._in_flight.pop(name, None)
            if self._queue:     # wake the engine thread only when there is work for it
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (self._busy or not self._queue):
                    if not self._cv.wait(timeout=_IDLE_POKE_SECONDS) and not self._busy:
                        self.comm.Iprobe()  # MPI progress, so other ranks' reads of us complete
                if not self._queue:
                    return
                handle = self._queue.popleft()
                self._busy = True
            try:
                handle._run()
            finally:
                self._finish(handle.name)
