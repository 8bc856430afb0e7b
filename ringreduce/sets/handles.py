"""A collective's handle (Horovod's: `poll`, `synchronize`), a future that its set's engine
completes: its result or error, and its done-callbacks (a torch future's `then()` chain),
which run on the thread that finished it once that thread has let go of the set.

Any exception raised while running a collective (ours, MPI's, a bug, an interrupt) is stored on
its handle and re-raised by `wait()` in the caller's thread, so the engine thread never dies and
later collectives still run: ours and interrupts as they are, anything else as a
RingReduceError with the cause chained."""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Optional

from ..core.errors import RingReduceError
from ..transport.negotiation import OutOfOrder

_CALLBACKS = threading.Lock()     # a handle's callbacks are added and taken under it


class Handle:
    """A future for one collective: `done()` polls, `wait()` returns its result or raises,
    `add_done_callback(fn)` calls `fn(handle)` once it is done (on the thread that finished
    it, once that thread has let go of the set; or at once if it is done already)."""

    __slots__ = ("name", "_work", "_engine", "_finished", "_pending", "_result", "_error",
                 "_callbacks", "_children", "waited")   # (one or two per collective: slots)

    def __init__(self, name: str, work: Callable[[], Any],
                 engine: Optional[Any] = None) -> None:
        self.name = name
        self._work: Optional[Callable[[], Any]] = work
        self._engine = engine
        self._finished = False
        self._pending = threading.Lock()     # held until done: cheaper than an Event
        self._pending.acquire()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: list[Callable[["Handle"], Any]] = []
        self._children = 0      # how many collectives its callbacks started (child_name)
        self.waited = False     # whether a caller has had its result (names.py)

    def done(self) -> bool:
        return self._finished

    def next_child(self) -> int:
        """How many collectives its future's callbacks have started, counting one more
        (lineage.child_name)."""
        with _CALLBACKS:    # (callbacks added to a done future run on the adding threads)
            k = self._children
            self._children = k + 1
        return k

    def children(self) -> int:
        """How many collectives its future's callbacks have started."""
        with _CALLBACKS:
            return self._children

    def wait(self) -> Any:
        """The result. A caller that finds the engine idle runs the queue up to this handle
        itself instead of waiting for the engine thread to wake (tens of microseconds)."""
        if not self._finished:
            engine = self._engine
            if engine is None:
                with self._pending:     # until done
                    pass
            else:
                with engine.waiting_for(self):
                    engine.run_up_to(self)
                    with self._pending:
                        pass
        self.waited = True          # its name is free (names.py)
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, callback: Callable[["Handle"], Any]) -> None:
        with _CALLBACKS:
            if not self._finished:
                self._callbacks.append(callback)
                return
        call_back(self, [callback])

    def set_done(self) -> list[Callable[["Handle"], Any]]:
        """(The engine's.) Done; returns the callbacks to call (Engine._run_due calls them)."""
        with _CALLBACKS:
            self._finished = True
            self._pending.release()
            callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def run_work(self) -> None:
        """(The engine's.) Run the work and keep its result or error; OutOfOrder passes (the
        work runs again once the order is settled)."""
        try:
            self._result = run_collective(self.name, self._work)
        except OutOfOrder:
            raise
        except BaseException as exc:    # any failure fails this collective, never the engine
            self._error = _ours(self.name, exc)
        self._work = None

    def fail_with(self, exc: BaseException) -> None:
        """(The engine's.) Done with `exc`, its work never to run."""
        self._error = _ours(self.name, exc)
        self._work = None


class Finished(Handle):
    """The handle of a collective that ended on the caller's thread (Engine.begin_now): done
    from the start, so it needs no lock to wait on."""

    __slots__ = ()

    def __init__(self, name: str, result: Any, error: Optional[BaseException],
                 engine: Optional[Any] = None) -> None:
        self.name, self._work, self._engine = name, None, engine
        self._finished, self._callbacks, self._children, self.waited = True, [], 0, False
        self._result = result
        self._error = None if error is None else _ours(name, error)


def call_back(handle: Handle, callbacks: list[Callable[[Handle], Any]]) -> None:
    """Call `handle`'s done-callbacks; one that raises is reported, and the others still run
    (the engine thread must not die of it)."""
    for callback in callbacks:
        try:
            callback(handle)
        except Exception as exc:
            warnings.warn(f"ringreduce: a done-callback of collective '{handle.name}' raised "
                          f"{type(exc).__name__}: {exc}")


def settle_first() -> None:
    """The first run of a begun collective whose exchange showed the members' next ones
    differ: the engine settles the order, then runs it whole."""
    raise OutOfOrder


def run_collective(name: str, work: Callable[[], Any]) -> Any:
    """Run a collective; failures other than ours reach the caller as RingReduceError with
    their cause chained."""
    try:
        return work()
    except (RingReduceError, OutOfOrder):
        raise
    except Exception as exc:  # MPI failures and bugs
        raise _ours(name, exc) from exc


def _ours(name: str, exc: BaseException) -> BaseException:
    """`exc` as the error a caller of the collective gets: ours as it is, an interrupt (any
    BaseException that is not an Exception: KeyboardInterrupt, SystemExit) as it is too, so
    that `except KeyboardInterrupt` catches it wherever the collective ran; anything else
    (MPI, a bug, MemoryError) wrapped with its cause chained."""
    if isinstance(exc, RingReduceError) or not isinstance(exc, Exception):
        return exc
    error = RingReduceError(f"ringreduce: collective '{name}' failed: "
                            f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
