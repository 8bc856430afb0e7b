"""Who could still submit to one process set on this rank: the threads that have submitted to
it, and the collective each of them waits for, while it waits. A settling of the order that
finds every member unable to submit more, and nothing pending on all of them, is a deadlock of
the program (negotiation.py), not a slow rank."""
from __future__ import annotations

import threading
from typing import Any

from .handles import Handle

_KEPT = 64      # threads known to have submitted, before those that ended are forgotten


class Submitters(dict):
    """The set's submitters, thread ident -> thread (a dict, so that the hot path's look is one
    `in`); `waiting`: ident -> the handle that thread waits for."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: dict[int, Handle] = {}

    def add(self) -> None:
        """Count this thread among them; forget those that ended once there are many (a
        program may start a thread per request)."""
        me = threading.get_ident()
        if me not in self:
            if len(self) >= _KEPT:
                for ident, thread in list(self.items()):
                    if not thread.is_alive():
                        self.pop(ident, None)
            self[me] = threading.current_thread()

    def stuck(self) -> bool:
        """Whether every live submitter waits for one of the set's collectives still pending.
        A thread that never submitted, or one that waits in another way (a C++ future, a
        sleep), may yet submit: not stuck."""
        for ident, thread in list(self.items()):
            if not thread.is_alive():
                self.pop(ident, None)
                continue
            handle = self.waiting.get(ident)
            if handle is None or handle.done():
                return False
        return bool(self)


class Waiting:
    """While a thread waits for `handle`: marked so in its set's `Submitters.waiting` (a wait inside
    another's done-callback restores the outer one after)."""

    __slots__ = ("waiting", "handle", "me", "outer")

    def __init__(self, waiting: dict[int, Handle], handle: Handle) -> None:
        self.waiting, self.handle = waiting, handle

    def __enter__(self) -> None:
        self.me = me = threading.get_ident()
        self.outer = self.waiting.get(me)
        self.waiting[me] = self.handle

    def __exit__(self, *exc: Any) -> None:
        if self.outer is None:
            del self.waiting[self.me]
        else:
            self.waiting[self.me] = self.outer
