"""What this process knows of the running job: its global communicator, its settings and every
registered process set (process-wide state, one `Job` from init() to shutdown(), else
none)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from ..core.config import Settings
from ..core.errors import NotInitializedError
from ..transport.stall import StallWatch


@dataclass
class Job:
    """What this process knows of the running job: its global communicator and the sets."""
    comm: Any
    rank: int
    size: int
    settings: Settings
    abort: Callable[[str], None]
    node_of: Optional[Callable[[int], int]]
    sets: dict[Union[int, str], Any]    # every registered ProcessSet, by id (the same on every
    active: dict[Union[int, str], Any]  # rank; open_group's on members); our ActiveSets
    groups_comm: Any = None             # where open_group makes sets by their members alone
    next_id: int = 1


_current: Optional[Job] = None


def waits_elsewhere(set_id: Union[int, str], watch: StallWatch, ranks: list[int],
                     everywhere: bool = False) -> list[tuple[str, Optional[bool]]]:
    """For a stall report on set `set_id` (`watch`'s): where global `ranks`, missing there,
    wait in a collective of the other sets this rank is a member of, or `everywhere`, of
    this one too (StallWatch.waits), the reads given the report's read timeout all together
    (a report keeps its interval however many sets there are)."""
    deadline = time.monotonic() + watch.read_timeout()
    others = [] if _current is None else [s for i, s in list(_current.active.items())
                                      if (everywhere or i != set_id) and not s.closed]
    found: list[tuple[str, Optional[bool]]] = []
    for other in others:
        found += other.transport.watch.waits(ranks, max(0.0, deadline - time.monotonic()))
    return found


def state(what: str) -> Job:
    if _current is None:
        raise NotInitializedError(
            f"ringreduce: {what} was called before ringreduce.init(); call init() first, once "
            "per process, after importing ringreduce")
    return _current


def current() -> Optional[Job]:
    """The running job, or None (before init(), after shutdown())."""
    return _current


def begin(job: Job) -> None:
    global _current
    _current = job


def end() -> Optional[Job]:
    """Forget the running job; returns it."""
    global _current
    job, _current = _current, None
    return job


def is_running() -> bool:
    return _current is not None
