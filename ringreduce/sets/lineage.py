"""The names of collectives started in the callbacks of another's future: an unnamed
collective started by a callback of collective X's future is named 'X.then.k' (`children_of`).
Such callbacks run on whichever thread finished X, while other threads go on submitting, so a
count in call order would differ between ranks; this does not. A callback that raises on some
ranks only ends X's children there (`children_end`): the members waiting in one of them fail
it when the order is settled, instead of stalling."""
from __future__ import annotations

import collections
import threading
from typing import Any, Optional

from .handles import Handle


class _Parent(threading.local):
    handle: Optional[Handle] = None     # the collective whose future's callback runs here


PARENT = _Parent()


class children_of:
    """Around a callback of collective `handle`'s future: the unnamed collectives it starts
    are named after it, 'X.then.k' for the k-th (`child_name`), the same on every rank."""

    __slots__ = ("handle", "outer")

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    def __enter__(self) -> None:
        self.outer, PARENT.handle = PARENT.handle, self.handle

    def __exit__(self, *_: Any) -> bool:
        PARENT.handle = self.outer
        return False


def child_name() -> str:
    """Inside `children_of(X)`: the automatic name of the next collective started there."""
    handle = PARENT.handle
    return f"{handle.name}.then.{handle.next_child()}"


def children_end(handle: Handle, error: BaseException) -> None:
    """A callback of collective `handle`'s future raised here: the collectives it had yet to
    start ('X.then.k' from the count started so far) will not come from this rank. The set's
    engine keeps that mark for its settlings, so that members waiting in such a collective
    fail it with this error instead of stalling (negotiation.py), while this rank goes on."""
    engine = handle._engine
    if engine is not None:      # (a synchronous collective's shared handle: no set to tell)
        engine.ended.mark(handle.name, handle.children(), f"{type(error).__name__}: {error}")


class EndedMarks(collections.OrderedDict):
    """One set's `children_end` marks, for its settlings: collective name -> (the first child
    that will not come, the error), the newest KEPT only, the first error of each collective
    (chained callbacks then fail with it)."""

    KEPT = 16

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def mark(self, name: str, started: int, error: str) -> None:
        with self._lock:
            if name not in self:
                self[name] = (started, error)
                while len(self) > self.KEPT:
                    self.popitem(last=False)

    def copy(self) -> dict[str, tuple[int, str]]:
        with self._lock:
            return dict(self)
