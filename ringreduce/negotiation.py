"""The cross-rank check that every member of a process set is running the same collective.

Each collective starts with one fixed-size `Iallgather` of a 64-bit digest of its signature plus
one per-rank integer the collective needs anyway (allgather's first dimension, say), so the check
costs no extra round trip there. With every member on one node the headers travel through the
node's shared memory instead, meeting allreduces at the same flag. When digests differ, a second
round gathers the full signatures so that every rank raises the same `MismatchError`, naming the
tensor, the field, and each rank's value.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .errors import MismatchError
from .shm import NodeWindow
from .signature import Signature, describe_mismatch, digest
from .stall import StallWatch


class Negotiator:
    def __init__(self, comm: Any, watch: StallWatch, ranks: Sequence[int],
                 node: Optional[NodeWindow]) -> None:
        """`node`: the set's window when all its members share one node, else None."""
        self.comm, self.watch, self.ranks, self.node = comm, watch, list(ranks), node
        self._header = np.zeros(2, dtype=np.int64)
        self._headers = np.zeros((comm.size, 2), dtype=np.int64)

    def mismatch(self, signature: Signature) -> str:
        """The message of a mismatch, from every member's signature (collective)."""
        return describe_mismatch(self.comm.allgather(dict(signature)), self.ranks)

    def check(self, signature: Signature, per_rank: int = 0,
              precomputed: Optional[int] = None) -> np.ndarray:
        """Raise `MismatchError` on every member unless all signatures agree; return every
        member's `per_rank` value, indexed by set rank. `precomputed` is the signature's digest
        when the caller made it once up front (the optimizer's buckets)."""
        value = digest(signature) if precomputed is None else precomputed
        if self.comm.size == 1:
            return np.array([per_rank], dtype=np.int64)
        if self.node is not None:
            per_rank_values = self.node.exchange_headers(value, per_rank)
        else:
            self._header[:] = (value, per_rank)
            self.watch.wait(self.comm.Iallgather(self._header, self._headers).Test)
            agreed = (self._headers[:, 0] == self._headers[0, 0]).all()
            per_rank_values = self._headers[:, 1].copy() if agreed else None
        if per_rank_values is None:
            raise MismatchError(self.mismatch(signature))
        return per_rank_values
