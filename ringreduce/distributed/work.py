"""torch.distributed's Work for ringreduce's collectives (the backend's groups return these).

A `CollectiveWork` wraps a collective's `Handle`: `wait()` waits for it (running the set's
queue on the caller's thread when the engine is idle, as `synchronize()` does), then copies
the result into torch's output tensors where the collective does not write them in place;
`get_future()` is completed from the handle's done-callback (`Future.set_result`, or
with our error: failed_future.fail), so DDP's reducer and FSDP chain on it; Python callbacks
chained on it run as the collective's (`CollectiveFuture`). (A synchronous all_reduce
returns no Work: it ran to its end on the caller's thread, group_reductions.py; an
asynchronous small one that ended there too returns a `FinishedWork`, which needs no handle.)
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from ..gpu import cuda
from ..sets.handles import Finished, Handle
from ..sets.lineage import children_end, children_of
from .failed_future import fail

_FUTURES = threading.Lock()     # a work's future is made once
# sys.getrefcount of a Work that only its keeper holds (the keeper's attribute, its local name
# and the call's argument): nobody else can reach it, to wait, to ask for its future or value.
# Exact on CPython to 3.13 under the GIL; elsewhere -1, never reused (a free-threaded build's
# counts are not exact, and from 3.14 a local name may hold no count of its own).
UNHELD = (3 if sys.implementation.name == "cpython" and sys.version_info < (3, 14)
          and getattr(sys, "_is_gil_enabled", lambda: True)() else -1)
_WORK_INIT = dist.Work.__init__
# torch's registry of in-flight collectives' Works by output tensor, for wait_tensor (under
# allow_inflight_collective_as_graph_input_ctx: a collective begun in eager, waited in a
# compiled region): torch's C++ collectives register themselves; a group in Python, whose
# calls do not pass there, registers its own (absent before torch 2.6: nothing to do)
_C10D = torch._C._distributed_c10d
_REGISTERING = getattr(_C10D, "_allow_inflight_collective_as_graph_input", lambda: False)
# Works in torch's registry, kept alive until waited: the registry holds the C++ side alone,
# and wait_tensor through it reaches our wait() only while the Python object lives
_REGISTERED: dict[int, "CollectiveWork"] = {}


class CollectiveFuture(Future):
    """The future of a collective's Work (`get_future()`). Callbacks given to `then()` or
    `add_done_callback()`, and to the futures `then()` returns, run as the collective's
    (lineage.children_of), at once or later, on whichever thread completes it: the collectives
    they start get names that agree across ranks (DDP's PowerSGD hook starts two a bucket).
    A callback's error completes the future `then()` returned, as torch's message has it, and
    ends the collective's children on this rank (lineage.children_end): the other ranks fail
    the ones they wait for, rather than stall."""

    def __init__(self, origin: Handle) -> None:
        super().__init__()
        self._origin = origin

    def then(self, callback: Callable[[Future], Any]) -> "CollectiveFuture":
        chained = CollectiveFuture(self._origin)

        def run(future: Future) -> None:     # (as the collective's: add_done_callback)
            try:
                value = callback(future)
            except Exception as exc:
                children_end(self._origin, exc)
                error = RuntimeError("Got the following error when running the callback: "
                                     f"{type(exc).__name__}: {exc}")
                error.__cause__ = exc
                fail(chained, error)
            else:
                chained.set_result(value)

        self.add_done_callback(run)
        return chained

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        origin = self._origin

        def run(future: Future) -> None:
            with children_of(origin):
                try:
                    callback(future)
                except Exception as exc:
                    children_end(origin, exc)
                    raise

        super().add_done_callback(run)


class CollectiveWork(dist.Work):
    """torch's Work for one of our collectives: `handle` is its ringreduce Handle, `value`
    what its future yields (torch's output tensors), `finish` what turns the handle's result
    into them (copies; None when the collective writes them itself). `finish` runs once, on
    whichever thread first sees the handle done, before `wait()` returns or the future
    completes."""

    __slots__ = ("_handle", "_value", "_finish", "_finishing", "_error", "_future",
                 "_registered")

    def __init__(self, handle: Handle, value: list,
                 finish: Optional[Callable[[Any], None]] = None) -> None:
        # dist.Work's __init__ called straight, and slots: one Work a call was a tenth of a
        # small all_reduce's time
        _WORK_INIT(self)
        self._handle, self._value, self._finish = handle, value, finish
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None
        self._finishing = None if finish is None else threading.Lock()
        self._registered: Optional[list] = None
        if _REGISTERING():
            self._register()

    def _register(self) -> None:
        """In torch's registry under each output tensor, as torch's own collectives are."""
        self._registered = _tensors(self._value)
        for tensor in self._registered:
            _C10D._register_work(tensor, self)
        _REGISTERED[id(self)] = self

    def _unregister(self) -> None:
        """Out of torch's registry once waited (wait_tensor takes it out, and waits again: done
        by then), and no longer kept alive."""
        registered, self._registered = self._registered, None
        for tensor in registered:
            torch.ops._c10d_functional.wait_tensor(tensor)
        _REGISTERED.pop(id(self), None)

    def _settle(self) -> None:
        """Wait for the handle and, where torch's outputs are to be written, write them once:
        a thread that comes while another writes them waits for it. Raises the collective's
        error, or the writing's (every time it is asked)."""
        result = self._handle.wait()
        if self._finishing is None:
            return
        with self._finishing:
            if self._finish is not None:
                try:
                    with torch.no_grad():
                        self._finish(result)
                    cuda.landed(self._value)    # (the copies: on this thread's stream)
                except BaseException as exc:
                    self._error = exc
                self._finish = None
        if self._error is not None:
            raise self._error

    def wait(self, timeout: Any = None) -> bool:
        """Block until the collective is done and the outputs are written; raises its error
        (MismatchError, ShutDownError ...). torch's timeout is not used: a stalled peer gets
        ringreduce's stall report (RINGREDUCE_STALL_CHECK_TIME) instead."""
        if self._finishing is None:     # (nothing to write: one frame less, for small calls)
            self._handle.wait()
        else:
            self._settle()
        if self._registered is not None:
            self._unregister()
        return True

    def get_future(self) -> Future:
        with _FUTURES:
            if self._future is not None:
                return self._future
            self._future = future = CollectiveFuture(self._handle)
        self._handle.add_done_callback(self._complete)
        return future

    def _complete(self, handle: Handle) -> None:
        try:
            self._settle()
        except BaseException as exc:
            fail(self._future, exc)
            return
        self._future.set_result(self._value)

    def is_completed(self) -> bool:
        """Done, and torch's outputs written: where the handle is done and they are not yet,
        they are written here, so that a caller polling it (as gloo's may) needs no wait()."""
        if not self._handle.done():
            return False
        if self._finish is not None:
            try:
                self._settle()
            except BaseException:
                pass        # (completed with an error: wait() and exception() raise or give it)
        return True

    def is_success(self) -> bool:
        if not self._handle.done():
            return False
        try:
            self._settle()
        except BaseException:
            return False
        return True

    def exception(self) -> Optional[BaseException]:
        """The error, once done (None before: it does not wait)."""
        if not self._handle.done():
            return None
        try:
            self._settle()
        except BaseException as exc:
            return exc
        return None

    def result(self) -> list:
        self._settle()
        return self._value


class FinishedWork(dist.Work):
    """The Work of a collective that ended on the caller's thread with its result in torch's
    tensors (`value`): a small all_reduce whose members were all there, DDP's small buckets'
    common case. Nothing to wait for; the handle its future's callbacks run as (see
    CollectiveFuture) is made only where a future is asked for (at a few microseconds a call,
    each object shows)."""

    __slots__ = ("_value", "_name", "_engine", "_future")

    def __init__(self, value: list, name: str, engine: Any) -> None:
        _WORK_INIT(self)
        self._value, self._name, self._engine, self._future = value, name, engine, None

    def reuse(self, value: list, name: str, engine: Any) -> None:
        """Made anew for the next call (its keeper's, where nobody else holds it: UNHELD)."""
        self._value, self._name, self._engine, self._future = value, name, engine, None

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> Future:
        with _FUTURES:
            if self._future is None:
                self._future = CollectiveFuture(Finished(self._name, self._value, None,
                                                         self._engine))
                self._future.set_result(self._value)
            return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> list:
        return self._value


def _tensors(value: Any) -> list:
    """The tensors in torch's outputs (a list, or a list of lists: all_gather's)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)]
