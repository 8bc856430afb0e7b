"""The cross-rank check that every member of a process set is running the same collective.

Each collective starts with one fixed-size `Iallgather` of a 64-bit digest of its signature plus
one per-rank integer the collective needs anyway (allgather's first dimension, say), so the check
costs no extra round trip there. With every member on one node the headers travel through the
node's shared memory instead, meeting allreduces at the same flag; across a power-of-two number
of nodes, through the node's memory and then by recursive doubling between the nodes
(crossnode.py), meeting small allreduces in the same messages. When digests differ, a second
round gathers the full signatures so that every rank raises the same `MismatchError`, naming the
tensor, the field, and each rank's value; unless some digests are `JOINED`, the mark a rank
that has joined (`join()`) sends in every exchange, which raises `PeersJoined` instead.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .crossnode import BetweenNodes
from .errors import MismatchError
from .shm import NodeWindow
from .signature import Signature, describe_mismatch, digest
from .stall import StallWatch

JOINED = 0x4A4F494E45442121   # "JOINED!!": the digest a joined rank sends, not a signature's


class PeersJoined(Exception):
    """Some members have joined (their digest is JOINED); `ranks` are their set ranks. The
    transport handles it: every member then takes part in one join round (transport.py)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"set ranks {ranks} have joined")
        self.ranks = ranks


class Negotiator:
    def __init__(self, comm: Any, watch: StallWatch, ranks: Sequence[int],
                 node: Optional[NodeWindow], between: Optional[BetweenNodes] = None) -> None:
        """`node`: the set's window when all its members share one node, else None;
        `between`: the exchanges between nodes, where the set spans several that way."""
        self.comm, self.watch, self.ranks, self.node = comm, watch, list(ranks), node
        self.between = between
        self._header = np.zeros(2, dtype=np.int64)
        self._headers = np.zeros((comm.size, 2), dtype=np.int64)

    def mismatch(self, signature: Signature) -> str:
        """The message of a mismatch, from every member's signature (collective)."""
        return describe_mismatch(self.comm.allgather(dict(signature)), self.ranks)

    def exchange(self, value: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Every member's digest and per-rank value, indexed by set rank."""
        if self.comm.size == 1:
            return np.array([value], dtype=np.int64), np.array([per_rank], dtype=np.int64)
        if self.node is not None:
            return self.node.exchange_headers(value, per_rank)
        if self.between is not None:
            return self.between.headers(value, per_rank)
        self._header[:] = (value, per_rank)
        self.watch.wait(self.comm.Iallgather(self._header, self._headers).Test)
        return self._headers[:, 0].copy(), self._headers[:, 1].copy()

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
        """Nothing when every digest agrees; else PeersJoined or MismatchError. `signature`
        may be a function making it, called only for the message."""
        if (digests == digests[0]).all():
            return
        joined = [int(r) for r in np.flatnonzero(digests == JOINED)]
        if joined:
            raise PeersJoined(joined)
        raise MismatchError(self.mismatch(signature() if callable(signature) else signature))
