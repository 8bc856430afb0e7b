"""How ringreduce waits: one backoff between the polls of every spin loop, and the deadlines a
wait keeps (a report every interval, a shutdown or a limit once), with their constants in one
place. As mpi4py's util/sync takes its backoff as an argument, every loop that polls takes a
`Backoff` of its own: a collective's wait polls flat out, then yields the core, then naps
(`Backoff.pause`); a loop that waits on a condition takes only the naps (`Backoff.nap`)."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

BUSY_SECONDS = 0.00005  # poll flat out this long (as MPI does): a peer is usually close
YIELD_SECONDS = 0.001   # then yield the core between polls (oversubscribed ranks), then nap
NAP_SECONDS = 0.0001    # a collective's nap between polls: a late peer costs it this much
SHORTEST_NAP = 0.00001  # where a wait's naps grow (messages, start-up, shutdown): from this
LONGEST_NAP = 0.001     # up to this
SETTLING_NAP = 0.0002  # between the rounds of settling the order of collectives by name that
LONGEST_SETTLING_NAP = 0.01   # agreed on nothing (each twice the last), unless one is submitted
LOOK_EVERY = 0.005      # seconds between looks for a departed member while waiting
DEPARTED_GRACE = 1.0    # how long a collective that a member began before it left may still
                        # take to complete here (what it sent is on its way)
# A process set's engine thread (sets/engine.py): after a submission it looks for more work
AWAKE_SECONDS = 0.005   # this long,
PICKUP_SECONDS = 0.0002  # this often, so that a submission in a burst need not wake it (which
LONGEST_PICKUP = 0.0032  # costs more than a small allreduce); but each look that finds a caller
                        # running the set's work (synchronize runs its own) doubles the pause,
                        # until the engine thread runs work again. Each look costs ~20 us of CPU:
                        # looking every 0.2 ms for a second after each submission took 11% of a
                        # core from training. After the burst, a submission wakes it (~30 us).
IDLE_POKE_SECONDS = 0.05  # idle, it drives MPI's progress this often
_NEVER = float("inf")


class Backoff:
    """The pauses of one wait, from its start: none for BUSY_SECONDS, then yielding the core
    until YIELD_SECONDS, then naps of `first` seconds, each doubling up to `longest`."""

    __slots__ = ("start", "_nap", "_longest")

    def __init__(self, first: float = NAP_SECONDS, longest: float = NAP_SECONDS) -> None:
        self.start = time.monotonic()
        self._nap, self._longest = first, longest

    def pause(self) -> float:
        """Pause before the next poll; returns the time after it."""
        now = time.monotonic()
        waited = now - self.start
        if waited < BUSY_SECONDS:
            return now
        if waited < YIELD_SECONDS:
            os.sched_yield()
        else:
            time.sleep(self.nap())
        return time.monotonic()

    def nap(self) -> float:
        """How long the next nap is (each one twice the last, up to `longest`)."""
        nap = self._nap
        self._nap = min(self._longest, 2 * nap)
        return nap

    def again(self) -> None:
        """Progress was made: the naps start short again."""
        self.start = time.monotonic()


class Every:
    """A deadline every `interval` seconds from `start` (never for an interval of 0 or less):
    `due(now)` says whether one has passed and moves on to the next one after `now`, so that
    reports keep their interval from the start however long each one took."""

    __slots__ = ("interval", "next")

    def __init__(self, interval: float, start: float) -> None:
        self.interval = interval
        self.next = start + interval if interval > 0 else _NEVER

    def due(self, now: float) -> bool:
        if now < self.next:
            return False
        self.next += self.interval * (1 + (now - self.next) // self.interval)
        return True


class Once:
    """A deadline `after` seconds from `start` (never for 0 or less, or `None`): `passed(now)`
    is true the first time it is asked after it, and never again; `earlier(at)` brings it
    forward."""

    __slots__ = ("at",)

    def __init__(self, after: Optional[float], start: float) -> None:
        self.at = start + after if after is not None and after > 0 else _NEVER

    def passed(self, now: float) -> bool:
        if now < self.at:
            return False
        self.at = _NEVER
        return True

    def earlier(self, at: float) -> None:
        self.at = min(self.at, at)


def wait_reporting(done: Callable[[], bool], every: float, report: Callable[[float], None],
                   give_up_after: float = 0.0,
                   give_up: Optional[Callable[[float], None]] = None) -> None:
    """Until `done()`, outside a collective's wait (init(), shutdown(), opening a group):
    `report(seconds waited)` every `every` seconds and `give_up(seconds)` once at
    `give_up_after` (0: never, either)."""
    backoff = Backoff(SHORTEST_NAP, LONGEST_NAP)
    reports, end = Every(every, backoff.start), Once(give_up_after, backoff.start)
    while not done():
        now = backoff.pause()
        if end.passed(now):
            give_up(now - backoff.start)
        if reports.due(now):
            report(now - backoff.start)
