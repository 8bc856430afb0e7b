"""The collective names taken on one process set: a second submission of a taken name is
Horovod's ValueError, since it would pair with nothing.

A name is taken while its collective is in flight here (`in_flight`), and after that until a
caller has waited for its handle or a later collective of the set is done here (`held`): by
then every member has done it, as Horovod's names stay taken until the collective is done on
every member. A synchronous call's name (`inline`) is taken while it runs. The engine guards
all three with its condition's lock (engine.py)."""
from __future__ import annotations

from typing import Any, Optional


class TakenNames:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.in_flight: set[str] = set()
        self.held: dict[str, Any] = {}          # name -> its handle, done here
        self.inline: Optional[str] = None

    def duplicate(self, name: str) -> ValueError:
        return ValueError(f"ringreduce: a collective named '{name}' is still in flight on rank "
                          f"{self.rank}; wait for it (synchronize) before reusing the name")

    def taken(self, name: str) -> bool:
        return name in self.in_flight or name in self.held

    def claim(self, name: str) -> None:
        """The name goes in before `inline` is read, and an inline claim sets `inline` before
        it reads the names (`claim_inline`), so of two threads submitting one name at once, at
        least one sees the other."""
        if self.taken(name):
            raise self.duplicate(name)
        self.in_flight.add(name)
        if name == self.inline:
            self.in_flight.discard(name)
            raise self.duplicate(name)

    def claim_inline(self, name: str) -> None:
        """For a synchronous call on the caller's thread; `inline = None` after it."""
        self.inline = name
        if self.taken(name):
            self.inline = None
            raise self.duplicate(name)

    def hold(self, name: str, handle: Any) -> None:
        """Its collective is done here: every name held before it is free (see the module's
        docstring), and it is held until waited for."""
        self.in_flight.discard(name)
        self.held.clear()
        self.held[name] = handle

    def release(self, name: str) -> None:
        """A synchronous collective done, its result its caller's at once."""
        self.in_flight.discard(name)
        self.held.clear()

    def waited(self, handle: Any) -> None:
        if self.held.get(handle.name) is handle:
            del self.held[handle.name]
