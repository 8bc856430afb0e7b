"""The cross-rank check that every member of a process set is running the same collective.

Each collective starts with one fixed-size `Iallgather` of a 64-bit digest of its signature plus
one per-rank integer the collective needs anyway (allgather's first dimension, say), so the check
costs no extra round trip there. With every member on one node the headers travel through the
node's shared memory instead, meeting allreduces at the same flag; across a power-of-two number
of nodes, through the node's memory and then by recursive doubling between the nodes
(crossnode.py), meeting small allreduces in the same messages. When digests differ, a second
round gathers the full signatures: where the names differ, the members are running different
collectives (`OutOfOrder`: the engine settles the order, through `agreement()` below, and runs
them by name, the name each was submitted under, which its first check must therefore carry:
one that checked under another would be put back in order without end); where the names
agree, every rank raises the same `MismatchError`, naming the tensor, the field, and each
rank's value. Some digests may be `JOINED`, the mark a rank that has joined (`join()`) sends
in every exchange: that raises `PeersJoined` instead.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
import time
from typing import Any, Callable, NoReturn, Optional, Sequence, Union

import numpy as np

from ..core.errors import JoinedError, MismatchError, ShutDownError
from ..core.waiting import Every, Once
from .auto_names import AutoNames, thread_advice, unnamed
from .crossnode import BetweenNodes
from .shm import NodeWindow
from .signature import Signature, describe_mismatch, digest, given_name
from .stall import StallWatch

JOINED = 0x4A4F494E45442121   # "JOINED!!": the digest a joined rank sends, not a signature's
# A collective of this name preempts: while some members have it pending, a member whose
# collective is another one fails that one (MismatchError), so that an error raised on some
# ranks only still brings every rank to the elastic reset (elastic.py).
# (The reset's allgather_object is given the name RESET_GIVEN, qualified by its kind as every
# given name is: signature.qualified.)
RESET_GIVEN = "ringreduce.elastic.reset"
RESET = f"allgather_object.{RESET_GIVEN}"
log = logging.getLogger("ringreduce")


# One settling of the order: takes this rank's pending names, oldest first, its
# `children_end` marks (collective name -> (the first child that will not come, the error)),
# and whether nothing more can be submitted here (the engine's `_stuck`, sets/engine.py);
# returns the names to run now, in the order every member runs them (empty: none is pending
# everywhere yet; None: leave the settling with nothing run, on every member alike). It may
# raise, on every member whose first name then fails with that error.
Agreement = Callable[[list[str], dict[str, tuple[int, str]], bool], Optional[list[str]]]


class OutOfOrder(Exception):
    """Raised by a collective's work when the members' next collectives have different names.
    Nothing of the exchange was used; the set's engine settles the order (`Negotiator.agreement`)
    and runs the work again."""


class ResetPending(MismatchError):
    """A collective failed because other members wait in the elastic reset (RESET): not this
    rank's own error, which the reset's report tells apart."""


class PeersJoined(Exception):
    """Some members have joined (their digest is JOINED); `ranks` are their set ranks. The
    transport handles it: every member then takes part in one join round (transport.py)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"set ranks {ranks} have joined")
        self.ranks = ranks


# What a collective raises on every member alike (or hands on as control flow), so that no
# member is left waiting: every other failure inside a collective is told to the members
# (StallWatch.failed).
AGREED = (MismatchError, JoinedError, ShutDownError, PeersJoined, OutOfOrder)


def tell_members(watch: StallWatch, error: BaseException) -> None:
    """Where a collective fails on this member in a way its peers cannot see (anything but
    AGREED), they are told (StallWatch.failed), before the error goes on: they may be waiting
    on this member, and the set's traffic is out of step. (It raises the RingReduceError that
    says so, `error` chained, or returns for the caller to raise `error`.)"""
    if not isinstance(error, AGREED):
        watch.failed(error)


class Negotiator:
    def __init__(self, comm: Any, watch: StallWatch, ranks: Sequence[int],
                 node: Optional[NodeWindow], between: Optional[BetweenNodes] = None,
                 names: Optional[AutoNames] = None) -> None:
        """`node`: the set's window when all its members share one node, else None;
        `between`: the exchanges between nodes, where the set spans several that way;
        `names`: the set's automatic names (realigned after a deadlock, `_Settling`)."""
        self.comm, self.watch, self.ranks, self.node = comm, watch, list(ranks), node
        self.between, self.names = between, names
        self._header = np.zeros(2, dtype=np.int64)
        self._headers = np.zeros((comm.size, 2), dtype=np.int64)

    def exchange(self, value: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Every member's digest and per-rank value, indexed by set rank."""
        if self.comm.size == 1:
            return np.array([value], dtype=np.int64), np.array([per_rank], dtype=np.int64)
        if self.node is not None:
            return self.node.exchange_headers(value, per_rank)
        if self.between is not None:
            return self.between.headers(value, per_rank)
        self._gather_headers(value, per_rank)
        return self._headers[:, 0].copy(), self._headers[:, 1].copy()

    def _gather_headers(self, value: int, per_rank: int) -> None:
        """The exchange by MPI alone (no node window, no recursive doubling), into _headers."""
        self._header[0], self._header[1] = value, per_rank
        self.watch.wait(self.comm.Iallgather(self._header, self._headers).Test)

    def gather(self, mine: Any) -> list:
        """Every member's object (`comm.allgather`), waited on as a collective is: a member
        that stops or leaves meanwhile gets the stall report or ShutDownError, not a silent
        wait. For the rounds after an exchange that every member has passed (a mismatch's
        signatures, a join round, a stall's pending names)."""
        data = np.frombuffer(pickle.dumps(mine), dtype=np.uint8)
        sizes = np.empty(self.comm.size, dtype=np.int64)
        self.watch.wait(self.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes).Test)
        everyone = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.watch.wait(self.comm.Iallgatherv(data, [everyone, sizes]).Test)
        return [pickle.loads(part.tobytes()) for part in np.split(everyone, np.cumsum(sizes)[:-1])]

    def digests_agree(self, value: int) -> bool:
        """`exchange(value, 0)` by MPI alone, for a way whose data follows in an exchange of
        its own (ways.MpiGather), at the cost of a small allreduce: whether every member's
        digest is the same; `last_digests()` then tells them."""
        self._gather_headers(value, 0)
        digests = self._headers[:, 0].tolist()
        return digests.count(digests[0]) == len(digests)

    def last_digests(self) -> np.ndarray:
        """Every member's digest in the last `digests_agree`."""
        return self._headers[:, 0].copy()

    def check(self, signature: Signature, per_rank: int = 0,
              precomputed: Optional[int] = None) -> np.ndarray:
        """Raise `MismatchError` on every member unless all signatures agree (`PeersJoined`
        when some members have joined); return every member's `per_rank` value, indexed by set
        rank. `precomputed` is the signature's digest when the caller made it once up front
        (the optimizer's buckets)."""
        digests, values = self.exchange(digest(signature) if precomputed is None else precomputed,
                                        per_rank)
        self.judge(digests, signature)
        return values

    def judge(self, digests: np.ndarray,
              signature: Union[Signature, Callable[[], Signature]]) -> None:
        """Nothing when every digest agrees; else PeersJoined, OutOfOrder (the names differ)
        or MismatchError, the same on every member. `signature` may be a function making it,
        called only when the digests differ."""
        if (digests == digests[0]).all():
            return
        joined = [int(r) for r in np.flatnonzero(digests == JOINED)]
        if joined:
            raise PeersJoined(joined)
        signatures = self.gather(dict(signature() if callable(signature) else signature))
        if any(s.get("name") != signatures[0].get("name") for s in signatures):
            raise OutOfOrder()
        raise MismatchError(describe_mismatch(signatures, self.ranks))

    def agreement(self) -> Agreement:
        """Start settling the order of the set's collectives by name (engine.py)."""
        return _Settling(self).round


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little",
                          signed=True)


_RESET_HASH = _name_hash(RESET)
# In a settling round's header, beside the stall flags (1: report, 2: shut down): this member
# has `children_end` marks; this member has been stuck (engine.Engine._stuck) this long.
_ENDED_FLAG, _STUCK_FLAG = 4, 8
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
        n._header[:] = (len(names), due | (_ENDED_FLAG if ended else 0)
                        | (_STUCK_FLAG if long_stuck else 0))
        watch.wait(n.comm.Iallgather(n._header, n._headers).Test)
        counts, flags = n._headers[:, 0].tolist(), n._headers[:, 1]
        dues = flags & ~(_ENDED_FLAG | _STUCK_FLAG)
        everyone = np.empty(sum(counts), dtype=np.int64)
        watch.wait(n.comm.Iallgatherv(hashes, [everyone, counts]).Test)
        lists = np.split(everyone, np.cumsum(counts)[:-1])
        resetting = [member for member, listed in enumerate(lists) if _RESET_HASH in listed]
        if resetting:       # whoever has something else first fails it; the reset waits
            if hashes[0] == _RESET_HASH:
                return None
            ranks = watch.ranks
            raise ResetPending(
                f"ringreduce: rank {ranks[n.comm.rank]}: collective '{names[0]}' fails: ranks "
                f"{[ranks[m] for m in resetting]} wait in '{RESET}' after an error; every rank "
                "fails what it runs before the reset, until it comes to the reset too.")
        common = set(lists[0].tolist()).intersection(*(set(x.tolist()) for x in lists[1:]))
        if common:
            mine = dict(zip(hashes.tolist(), names))
            return [mine[h] for h in lists[0].tolist() if h in common]
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
        programs go on alike (as after a join)."""
        me, ranks = self.negotiator.comm.rank, self.watch.ranks
        if self.negotiator.names is not None:
            self.negotiator.names.realign(self.negotiator.gather)
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
