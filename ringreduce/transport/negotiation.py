"""The cross-rank check that every member of a process set is running the same collective.

Each collective starts with one fixed-size `Iallgather` of a 64-bit digest of its signature plus
one per-rank integer the collective needs anyway (allgather's first dimension, say), so the check
costs no extra round trip there. With every member on one node the headers travel through the
node's shared memory instead, meeting allreduces at the same flag; across a power-of-two number
of nodes, through the node's memory and then by recursive doubling between the nodes
(crossnode.py), meeting small allreduces in the same messages. When digests differ, a second
round gathers the full signatures: where the names differ, the members are running different
collectives (`OutOfOrder`: the engine settles the order, through settling.py's rounds, and runs
them by name, the name each was submitted under, which its first check must therefore carry:
one that checked under another would be put back in order without end); where the names
agree, every rank raises the same `MismatchError`, naming the tensor, the field, and each
rank's value. Some digests may be `JOINED`, the mark a rank that has joined (`join()`) sends
in every exchange: that raises `PeersJoined` instead.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from ..core.errors import JoinedError, MismatchError, ShutDownError
from .auto_names import AutoNames
from .crossnode import BetweenNodes
from .shm import NodeWindow
from .signature import Signature, describe_mismatch, digest
from .stall import StallWatch

JOINED = 0x4A4F494E45442121   # "JOINED!!": the digest a joined rank sends, not a signature's
# A collective of this name preempts: while some members have it pending, a member whose
# collective is another one fails that one (MismatchError), so that an error raised on some
# ranks only still brings every rank to the elastic reset (elastic.py).
# (The reset's allgather_object is given the name RESET_GIVEN, qualified by its kind as every
# given name is: signature.qualified.)
RESET_GIVEN = "ringreduce.elastic.reset"
RESET = f"allgather_object.{RESET_GIVEN}"


class OutOfOrder(Exception):
    """Raised by a collective's work when the members' next collectives have different names.
    Nothing of the exchange was used; the set's engine settles the order (settling.py) and
    runs the work again."""


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
        # Names a deadlock failed on other members that this one has yet to submit (they fail
        # here at once when they come, settling.py): the name -> those members' ranks.
        self.owed: dict[str, list[int]] = {}
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
