"""The automatic names of a process set's unnamed collectives: '<kind>.noname.<k>' for the
set's k-th unnamed collective of that kind, counted across this rank's threads, so that members
which submit the same calls agree. Where members ran different numbers of some kind (a join, or
a deadlock that failed a different collective on each), `realign` moves every count to the
highest among the members, and their names agree again once their programs go on alike."""
from __future__ import annotations

import itertools
from typing import Callable


class AutoNames:
    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}    # per kind

    def name(self, kind: str) -> str:
        counter = self._counters.get(kind)
        if counter is None:
            counter = self._counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"

    def realign(self, gather: Callable[[dict[str, int]], list[dict[str, int]]]) -> None:
        """(Collective over the members, through `gather`, which returns every member's dict.)
        Every count from the highest among the members. Run where no thread names a collective
        of the set meanwhile (a join, every submitter stuck): counts are read by taking them."""
        mine = {kind: next(counter) for kind, counter in list(self._counters.items())}
        everyone = gather(mine)
        for kind in {kind for counts in everyone for kind in counts}:
            self._counters[kind] = itertools.count(max(c.get(kind, 0) for c in everyone))
