"""The collective names taken on one process set: a second submission of a taken name is
Horovod's ValueError, since it would pair with nothing.

A name is taken while its collective is in flight here (`in_flight`), or runs inline on a
caller's thread (`inline`), and after that until a caller has waited for its handle or a later
collective of the set is done here (`last_done`): by then every member has done it, as
Horovod's names stay taken until the collective is done on every member.

No lock of its own, since a small allreduce passes here twice (each `with` costs ~0.3 us):
`claim` runs under the engine's lock; `claim_inline`, `hold` and `release` only by the thread
that runs the set's work (one at a time); a waiter only marks its handle (`Handle.waited`).
The order of the reads and writes, each atomic, does the rest (see `claim`)."""
from __future__ import annotations

from typing import Any, Optional


class TakenNames:
    __slots__ = ("rank", "in_flight", "inline", "last_done")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.in_flight: set[str] = set()
        self.inline: Optional[str] = None
        self.last_done: Any = None      # the handle of the last collective done here

    def duplicate(self, name: str) -> ValueError:
        return ValueError(f"ringreduce: a collective named '{name}' is still in flight on rank "
                          f"{self.rank}; wait for it (synchronize) before reusing the name")

    def held(self, name: str) -> bool:
        done = self.last_done
        return done is not None and done.name == name and not done.waited

    def claim(self, name: str) -> None:
        """(Under the engine's lock.) The name goes in before `inline` and `last_done` are
        read: an inline claim sets `inline` before it reads the names, so of two threads
        taking one name at once, at least one sees the other; and a caller done inline holds
        its name (`hold`) before it lets go of `inline`, so a claim that finds `inline` let go
        finds the name held."""
        if name in self.in_flight:
            raise self.duplicate(name)
        self.in_flight.add(name)
        if name == self.inline or self.held(name):
            self.in_flight.discard(name)
            raise self.duplicate(name)

    def claim_inline(self, name: str) -> None:
        """For a synchronous call on the caller's thread; `inline = None` after it."""
        self.inline = name
        if name in self.in_flight or self.held(name):
            self.inline = None
            raise self.duplicate(name)

    def hold(self, handle: Any) -> None:
        """Its collective is done here: the name held before it is free (see the module's
        docstring), and this one is held (before it leaves `in_flight`) until waited for."""
        self.last_done = handle
        self.in_flight.discard(handle.name)

    def release(self, name: str) -> None:
        """A synchronous collective done, its result its caller's at once."""
        self.last_done = None
        self.in_flight.discard(name)
