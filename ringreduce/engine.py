"""One process set's ordering: its collectives run in submission order, one at a time.

Asynchronous work goes to the set's background thread, so communication overlaps backward. A
synchronous call made while nothing is queued runs inline on the caller's thread instead:
waking a sleeping thread costs tens of microseconds, more than a small allreduce itself.
Either way exactly one thread runs the set's collectives at a time and the order is the
submission order, which is the same on every member because user code submits in the same
order. Each set has its own engine, so sets progress independently of each other.

Errors raised while running a collective are stored on its handle and re-raised by `wait()`
in the caller's thread, so the engine thread never dies of a user's mistake.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Optional

from .errors import RingReduceError

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
        """Run the work; the engine marks the handle done once it has let go of the name (a
        caller woken by `wait()` may reuse it at once)."""
        try:
            self._result = _call(self.name, self._work)
        except RingReduceError as exc:
            self._error = exc
        finally:
            self._work = None


def _call(name: str, work: Callable[[], Any]) -> Any:
    """Run a collective; failures other than ours reach the caller as RingReduceError with
    their cause chained."""
    try:
        return work()
    except RingReduceError:
        raise
    except Exception as exc:  # MPI failures and bugs
        raise RingReduceError(f"ringreduce: collective '{name}' failed: {exc}") from exc


class Engine:
    """`poke()` runs now and then while the engine idles: MPI progress for the set's
    communicator, so that other ranks' one-sided reads of this rank complete.

    `_running` is held by whichever thread runs one of the set's collectives: the engine
    thread for queued work, a caller for a synchronous one (taken only while nothing is
    queued). The engine thread takes it before it pops the next handle, so a caller never
    overtakes work queued before it. A non-blocking acquire is the fast path's whole claim."""

    def __init__(self, thread_name: str, rank: int, poke: Callable[[], Any]) -> None:
        self.rank = rank
        self._poke = poke
        self._running = threading.Lock()
        self._cv = threading.Condition()        # guards the queue, the names, _stopping
        self._queue: collections.deque[Handle] = collections.deque()
        self._in_flight: set[str] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, name: str, work: Callable[[], Any]) -> Handle:
        """Queue `work` to run after everything submitted before it; returns its handle."""
        with self._cv:
            return self._enqueue(name, work)

    def _enqueue(self, name: str, work: Callable[[], Any]) -> Handle:
        """Under the condition's lock: queue `work` and wake the engine thread."""
        handle = Handle(name, work)
        self._claim_name(name)
        self._queue.append(handle)
        self._cv.notify_all()
        return handle

    def run(self, name: str, work: Callable[[], Any]) -> Any:
        """Run `work` now and return its result: inline when the engine is idle, else queued."""
        with self._cv:
            if not self._queue and self._running.acquire(False):
                handle = None
                try:
                    self._claim_name(name)
                except BaseException:
                    self._running.release()
                    raise
            else:
                handle = self._enqueue(name, work)
        if handle is not None:
            return handle.wait()
        try:
            return _call(name, work)
        finally:
            self._finish(name)

    def claim_idle(self) -> bool:
        """Take the engine for one synchronous call on this thread if nothing is queued or
        running (then no name is in flight either); `release_idle()` after it."""
        if not self._running.acquire(False):
            return False
        if self._queue or self._stopping:
            self._running.release()
            return False
        return True

    def release_idle(self) -> None:
        """After a claim, which took no name. The engine thread, if it waits, waits for the
        lock itself."""
        self._running.release()

    def shutdown(self) -> None:
        """Run what is queued, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()

    def _claim_name(self, name: str) -> None:
        if self._stopping:
            raise RingReduceError("ringreduce: the engine is shut down; call init() again")
        if name in self._in_flight:
            raise ValueError(
                f"ringreduce: a collective named '{name}' is still in flight on rank "
                f"{self.rank}; wait for it (synchronize) before reusing the name")
        self._in_flight.add(name)

    def _finish(self, name: str) -> None:
        self._running.release()
        with self._cv:
            self._in_flight.discard(name)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    if not self._cv.wait(timeout=_IDLE_POKE_SECONDS):
                        self._poke_if_idle()
                if not self._queue:
                    return
            self._running.acquire()         # after a synchronous call in progress
            with self._cv:
                handle = self._queue.popleft()
            try:
                handle._run()
            finally:
                self._finish(handle.name)
                handle._done.set()

    def _poke_if_idle(self) -> None:
        if self._running.acquire(False):
            try:
                self._poke()
            finally:
                self._running.release()
