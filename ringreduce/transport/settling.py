"""Settling the order of a process set's collectives by name, where the members' next ones
differ (`OutOfOrder`, negotiation.py): rounds with the other members until some names are
pending on all of them, which the engine then runs in one agreed order (sets/engine.py); and
what a round does where none can come (a deadlock of the program, a name given to collectives
of different kinds, unnamed collectives on different threads, the elastic reset).

A deadlock fails every member's first pending collective. A member whose first was not pending
on another member then owes that member's (`Negotiator.owed`): it is this member's own call of
that collective, still to come (a rank that ran an extra collective has the others' next one
ahead of it). When it comes, it fails at once, as it did on the others, rather than meet their
next one in another deadlock, and the one after that, without end. Automatic names are realigned
instead (auto_names.py), so that unnamed collectives pair again once the ranks' programs go on
alike.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, NoReturn, Optional

import numpy as np

from ..core.errors import MismatchError
from ..core.waiting import Every, Once
from .auto_names import thread_advice, unnamed
from .negotiation import RESET, Negotiator, ResetPending
from .signature import given_name

log = logging.getLogger("ringreduce")

# One settling of the order: takes this rank's pending names, oldest first, its
# `children_end` marks (collective name -> (the first child that will not come, the error)),
# and whether nothing more can be submitted here (the engine's `_stuck`, sets/engine.py);
# returns the names to run now, in the order every member runs them (empty: none is pending
# everywhere yet; None: leave the settling with nothing run, on every member alike). It may
# raise, on every member whose first name then fails with that error.
Agreement = Callable[[list[str], dict[str, tuple[int, str]], bool], Optional[list[str]]]


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little",
                          signed=True)


_RESET_HASH = _name_hash(RESET)
# In a settling round's header, beside the stall flags (1: report, 2: shut down): this member
# has `children_end` marks; this member has been stuck (engine.Engine._stuck) this long.
_ENDED_FLAG, _STUCK_FLAG = 4, 8
_OWED_FLAG = 16         # this member's first name is one it owes (Negotiator.owed)
_FLAGS = _ENDED_FLAG | _STUCK_FLAG | _OWED_FLAG
_STUCK_SECONDS = 1.0    # (a thread that never submitted to the set may yet: a grace period)


def _ended_by(member: int, first: Optional[str], everyone: list
              ) -> Optional[tuple[int, str, str]]:
    """Whether `first`, `member`'s first pending name, is a child 'X.then.j' that another
    member's `children_end` mark on X says will not come: (that member, X, its error)."""
    origin, _, k = (first or "").rpartition(".then.")
    if not origin or not k.isdigit():
        return None
    for other, (_, ended) in enumerate(everyone):
        mark = ended.get(origin) if other != member else None
        if mark is not None and mark[0] <= int(k):
            return other, origin, mark[1]
    return None


class _Settling:
    """The rounds of one settling. Each gathers every member's pending names (as 64-bit hashes,
    a count first) and returns those pending on all, in the first member's order. While none
    is, each member says whether its stall check time (from the settling's start) or its stall
    shutdown time has passed; when one has, every member gathers the names themselves and
    reports which are pending where, and at the shutdown time the job ends with that report,
    as a wait inside a collective would. Where some members have the RESET pending, the round
    ends the settling everywhere: a member whose first name is the RESET keeps it pending, the
    others fail their first. Where some members carry `children_end` marks (engine.py) and a
    member's first is a child collective that another's mark says will not come, the round
    ends it too: that member fails its first, the others keep theirs (`_children_ended`).
    Where every member has been stuck for a while (nothing more can be submitted there:
    engine.Engine._stuck) and nothing is pending on all, no collective can ever pair: every
    member fails its first with the names each has pending (`_deadlocked`), at once rather
    than after stall reports."""

    def __init__(self, negotiator: Negotiator) -> None:
        self.negotiator, self.watch = negotiator, negotiator.watch
        self.started = time.monotonic()
        self.reports = Every(self.watch.check_time, self.started)
        self.shutdown = Once(self.watch.shutdown_time, self.started)
        self.stuck_since: Optional[float] = None

    def round(self, names: list[str], ended: dict[str, tuple[int, str]], stuck: bool
              ) -> Optional[list[str]]:
        n, watch = self.negotiator, self.watch
        now = time.monotonic()
        due = 2 if self.shutdown.passed(now) else 1 if self.reports.due(now) else 0
        if not stuck:
            self.stuck_since = None
        elif self.stuck_since is None:
            self.stuck_since = now
        long_stuck = stuck and now - self.stuck_since >= _STUCK_SECONDS
        hashes = np.array([_name_hash(name) for name in names], dtype=np.int64)
        owing = bool(names) and names[0] in n.owed
        n._header[:] = (len(names), due | (_ENDED_FLAG if ended else 0)
                        | (_STUCK_FLAG if long_stuck else 0) | (_OWED_FLAG if owing else 0))
        watch.wait(n.comm.Iallgather(n._header, n._headers).Test)
        counts, flags = n._headers[:, 0].tolist(), n._headers[:, 1]
        dues = flags & ~_FLAGS
        everyone = np.empty(sum(counts), dtype=np.int64)
        watch.wait(n.comm.Iallgatherv(hashes, [everyone, counts]).Test)
        lists = np.split(everyone, np.cumsum(counts)[:-1])
        resetting = [member for member, listed in enumerate(lists) if _RESET_HASH in listed]
        if resetting:       # whoever has something else first fails it; the reset waits
            if hashes[0] == _RESET_HASH:
                return None
            ranks = watch.ranks
            raise ResetPending(
                f"ringreduce: rank {ranks[n.comm.rank]}: collective '{names[0]}'{watch.where} "
                f"fails: ranks {[ranks[m] for m in resetting]} wait in '{RESET}' after an "
                "error; every rank fails what it runs before the reset, until it comes to the "
                "reset too.")
        common = set(lists[0].tolist()).intersection(*(set(x.tolist()) for x in lists[1:]))
        if common:
            mine = dict(zip(hashes.tolist(), names))
            agreed = [mine[h] for h in lists[0].tolist() if h in common]
            for name in agreed:     # (met with the others after all: not owed any more)
                n.owed.pop(name, None)
            return agreed
        if (flags & _OWED_FLAG).any():      # whoever owes its first fails it; every member
            if owing:                       # leaves the settling, to meet at the next ones
                self._owed(names[0])
            return None
        if (flags & _ENDED_FLAG).any() and self._children_ended(names, ended):
            return None
        deadlocked = bool((flags & _STUCK_FLAG).all())
        if dues.max() > 0 or deadlocked:
            pending = n.gather(names)
            if (self._kinds_apart(pending, now - self.started)
                    or self._threads_apart(pending, now - self.started)):
                return None
            if deadlocked:
                self._deadlocked(pending, now - self.started)
            message = self._describe(pending, now - self.started)
            if dues.max() == 2:
                watch.on_shutdown(f"{message} Shutting the job down after "
                                  f"{watch.shutdown_time:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME).")
            else:
                log.warning(message)
        return []

    def _children_ended(self, names: list[str], ended: dict[str, tuple[int, str]]) -> bool:
        """(Collective: some member has `children_end` marks, engine.py.) Every member's first
        name and marks gathered: where a member's first is 'X.then.j' and another member's
        callback of X raised before starting its j-th child, that member fails it with the
        other's error (raises here) and the others leave the settling (True), so that the
        members meet again at their next collectives. False: no member's first is such a
        child (the settling goes on)."""
        everyone = self.negotiator.gather((names[0] if names else None, ended))
        ranks, me = self.watch.ranks, self.negotiator.comm.rank
        verdicts = [_ended_by(member, first, everyone) for member, (first, _) in
                    enumerate(everyone)]
        if not any(verdicts):
            return False
        if verdicts[me] is not None:
            other, origin, error = verdicts[me]
            raise MismatchError(
                f"ringreduce: rank {ranks[me]}: collective '{names[0]}' cannot run: on rank "
                f"{ranks[other]} a callback of collective '{origin}' (its future's then() or "
                f"add_done_callback(), a DDP communication hook, say) raised {error} before "
                f"starting it, so rank {ranks[other]} will not submit it; it went on to its "
                "next collective")
        return True

    def _deadlocked(self, pending: list[list[str]], waited: float) -> NoReturn:
        """(Collective: every member's `pending`, as gathered, where every member is stuck.)
        Every member fails its first collective with MismatchError, saying what each has.
        Each failed a collective of another kind, so their counts of automatic names differ
        now: realigned, so that the members' unnamed collectives pair again once their
        programs go on alike (as after a join). Another member's first that this member does
        not have pending is one it owes (the module's docstring)."""
        me, ranks = self.negotiator.comm.rank, self.watch.ranks
        if self.negotiator.names is not None:
            self.negotiator.names.realign(self.negotiator.gather)
        for member, names in enumerate(pending):
            if member != me and names and names[0] not in pending[me]:
                self.negotiator.owed.setdefault(names[0], []).append(ranks[member])
        where = "; ".join(f"rank {ranks[m]}: {', '.join(repr(x) for x in names)}"
                          for m, names in enumerate(pending))
        raise MismatchError(
            f"ringreduce: rank {ranks[me]}: collective '{pending[me][0]}' cannot run: no "
            f"collective is pending on every rank{self.watch.where}, and none can come, since "
            "on every rank each thread that submits collectives waits for one of those it "
            f"has pending ({where}; after {waited:.1f} s). The ranks' programs call "
            "different collectives here: a barrier where others allreduce, a name that "
            "differs between ranks, a collective some ranks skip. Every rank fails the first "
            f"collective it has pending.{thread_advice(x for names in pending for x in names)}")

    def _owed(self, name: str) -> NoReturn:
        """This member's first is a name a deadlock failed on other members (`_deadlocked`):
        it fails here too, at once, so that the members' next collectives pair again."""
        ranks = self.negotiator.owed.pop(name)
        raise MismatchError(
            f"ringreduce: rank {self.watch.ranks[self.negotiator.comm.rank]}: collective "
            f"'{name}' cannot run: it failed on ranks {ranks} already, where nothing was "
            f"pending on every rank{self.watch.where} and none could come (a deadlock of the "
            "program: the error there lists what each rank had pending). This rank came to "
            "it later; it fails here too, and later collectives run as usual.")

    def _kinds_apart(self, pending: list[list[str]], waited: float) -> bool:
        """(Collective: every member's `pending`, as gathered.) A name the callers gave to
        collectives of different kinds on different members ('allreduce.w' pending on some
        and not 'allgather.w', 'allgather.w' on others and not 'allreduce.w'), with nothing
        pending everywhere for a stall check's time (or every member stuck), is one program's
        mistake, not a slow rank (members that have both, or neither, are not told apart by
        it): a member whose first collective is such a one fails it with MismatchError (raised
        here), and the others leave the settling (True), so that every member goes on to its
        next collective. False: no such name."""
        held: dict[str, list[set[str]]] = {}     # a given name -> each member's kinds of it
        for member, names in enumerate(pending):
            for kind, given in filter(None, map(given_name, names)):
                held.setdefault(given, [set() for _ in pending])[member].add(kind)
        apart = {given for given, sets in held.items()
                 if any(a - b and b - a for a in sets for b in sets)}
        if not apart:
            return False
        me, ranks = self.negotiator.comm.rank, self.watch.ranks
        first = given_name(pending[me][0]) if pending[me] else None
        if first is not None and first[1] in apart:
            sets = held[first[1]]
            kinds = dict.fromkeys(kind for mine in sets for kind in sorted(mine))
            where = " and to ".join(
                f"{kind} on ranks {[ranks[m] for m, mine in enumerate(sets) if kind in mine]}"
                for kind in kinds)
            raise MismatchError(
                f"ringreduce: rank {ranks[me]}: collective '{pending[me][0]}' cannot run: the "
                f"name '{first[1]}' was given to {where}, and no collective was pending on "
                f"every rank for {waited:.0f} s (RINGREDUCE_STALL_CHECK_TIME). Names are "
                "qualified by the kind of collective, as Horovod's: collectives of different "
                "kinds never pair. Every rank waiting in one of them fails it; later "
                "collectives run as usual.")
        return True

    def _threads_apart(self, pending: list[list[str]], waited: float) -> bool:
        """(Collective: every member's `pending`, as gathered.) Unnamed collectives of one
        kind pending on some members from one thread and on others from another (the ranks
        run them on different threads: auto_names.py), each thread's missing where the other's
        is, with nothing pending everywhere for a stall check's time (or every member stuck),
        can never pair: a member whose first collective is such a one fails it with
        MismatchError (raised here), the others leave the settling (True), and the counts of
        automatic names are realigned first, so that every member goes on to its next
        collective and its unnamed ones pair again. False: none is."""
        held: dict[str, list[set[str]]] = {}     # a kind -> each member's threads with one
        for member, names in enumerate(pending):
            for kind, where in filter(None, map(unnamed, names)):
                held.setdefault(kind, [set() for _ in pending])[member].add(where)
        apart = {(kind, where) for kind, sets in held.items() for a in sets for b in sets
                 if a - b and b - a for where in a - b}
        if not apart:
            return False
        if self.negotiator.names is not None:
            self.negotiator.names.realign(self.negotiator.gather)
        me, ranks = self.negotiator.comm.rank, self.watch.ranks
        first = unnamed(pending[me][0]) if pending[me] else None
        if first in apart:
            kind = first[0]
            where = "; ".join(
                f"ranks {[ranks[m] for m, mine in enumerate(held[kind]) if place in mine]} on "
                f"{'thread ' + repr(place) if place else 'the main thread'}"
                for place in dict.fromkeys(p for mine in held[kind] for p in sorted(mine)))
            raise MismatchError(
                f"ringreduce: rank {ranks[me]}: collective '{pending[me][0]}' cannot run: "
                f"unnamed {kind} collectives are pending on different threads of different "
                f"ranks ({where}), and no collective was pending on every rank for "
                f"{waited:.0f} s (RINGREDUCE_STALL_CHECK_TIME)."
                f"{thread_advice(x for names in pending for x in names)} "
                "Every rank waiting in one of them fails it; later collectives run as usual.")
        return True

    def _describe(self, pending: list[list[str]], waited: float) -> str:
        """Which names are pending on which members (collective: every member's `pending`)."""
        ranks = self.watch.ranks
        holders: dict[str, list[int]] = {}
        for member, names in enumerate(pending):
            for name in names:
                holders.setdefault(name, []).append(ranks[member])
        where = "; ".join(f"'{name}' is pending on ranks {held} and not submitted by ranks "
                          f"{[r for r in ranks if r not in held]}"
                          for name, held in holders.items())
        return (f"ringreduce: stall: rank {ranks[self.negotiator.comm.rank]} has waited "
                f"{waited:.0f} s for the members{self.watch.where} to submit a collective "
                f"they all have pending: {where}. Collectives run by name once every member "
                "has submitted them: the ranks missing one are stuck in their own code, or "
                "submit it under another name, or not at all."
                f"{thread_advice(holders)}")


def agreement(negotiator: Negotiator) -> Agreement:
    """Start settling the order of the set's collectives by name (engine.py)."""
    return _Settling(negotiator).round
