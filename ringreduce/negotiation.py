"""Cross-rank check that every rank is running the same collective.

Each collective starts with one fixed-size `Allgather` of a 64-bit digest of its signature
(kind, name, dtype, shape, op, scale factors, root) plus one per-rank integer the collective
needs anyway (allgather's first dimension, say), so the check costs no extra round trip there.
When digests differ, a second round gathers the full signatures so that every rank raises the
same `MismatchError`, naming the tensor, the field, and each rank's value.
"""
from __future__ import annotations

import zlib
from typing import Any, Mapping, Optional

import numpy as np

from .errors import MismatchError
from .stall import StallWatch

Signature = Mapping[str, Any]


try:
    from ._native import allreduce_digest
except ImportError:     # not built: every signature takes the general way
    allreduce_digest = None
ALLREDUCE_FIELDS = frozenset(("collective", "name", "op", "prescale", "postscale", "dtype",
                              "shape"))


def digest(signature: Signature) -> int:
    """64 bits that equal across ranks exactly when the signatures do (two CRCs: cheap, and a
    real mismatch slips through only if both collide). Fields in sorted order. A one-tensor
    allreduce, the most frequent and the most latency-bound, is hashed in C field by field
    (`allreduce_digest`), so its fast path need not build the dictionary."""
    if (allreduce_digest is not None and signature.keys() == ALLREDUCE_FIELDS
            and signature["collective"] == "allreduce" and isinstance(signature["name"], str)):
        return allreduce_digest(signature["name"], signature["op"], signature["dtype"],
                                tuple(signature["shape"]), float(signature["prescale"]),
                                float(signature["postscale"]))
    text = repr(sorted(signature.items())).encode()
    value = (zlib.crc32(text) << 32) | zlib.adler32(text)
    return value - (1 << 64) if value >= 1 << 63 else value


class Negotiator:
    """Runs the signature check of each collective, with the stall watch around the wait."""

    def __init__(self, comm: Any, watch: StallWatch) -> None:
        self.comm = comm
        self.watch = watch
        self.node: Any = None   # the engine's shm.NodeShm, when ranks share this node
        self._header = np.zeros(2, dtype=np.int64)
        self._headers = np.zeros((comm.size, 2), dtype=np.int64)

    def check(self, signature: Signature, per_rank: int = 0,
              precomputed: Optional[int] = None) -> np.ndarray:
        """Raise `MismatchError` on every rank unless all signatures agree; return every rank's
        `per_rank` value, indexed by rank. `precomputed` is the signature's digest when the
        caller made it once up front (the optimizer's buckets)."""
        self.watch.begin(lambda: label(signature))
        self._header[0] = digest(signature) if precomputed is None else precomputed
        self._header[1] = per_rank
        if self.comm.size == 1:
            return self._header[1:].copy()
        if self.node is not None and self.node.cross.size == 1:     # one node: shared memory
            return self.node.exchange_headers(int(self._header[0]), per_rank,
                                              lambda: self.comm.allgather(dict(signature)))
        self.watch.wait(self.comm.Iallgather(self._header, self._headers).Test)
        if (self._headers[:, 0] != self._headers[0, 0]).any():
            raise MismatchError(describe_mismatch(self.comm.allgather(dict(signature))))
        return self._headers[:, 1].copy()


def label(signature: Signature) -> str:
    """How the stall watch names a collective: kind, name, and a bucket's parameters."""
    text = f"{signature.get('collective')} '{signature.get('name')}'"
    params = signature.get("parameters")
    if params:
        shown = ", ".join(params[:8]) + (f", ... ({len(params)} in all)" if len(params) > 8 else "")
        text += f" (parameters: {shown})"
    return text


def describe_mismatch(signatures: list[Signature]) -> str:
    """Name the tensor, the first differing field, and what each rank submitted."""
    fields = list(signatures[0])
    fields += [k for s in signatures[1:] for k in s if k not in fields]
    for field in fields:
        values = [s.get(field) for s in signatures]
        if any(v != values[0] for v in values):
            break
    names = sorted({str(s.get("name")) for s in signatures})
    kinds = sorted({str(s.get("collective")) for s in signatures})
    by_rank = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
    return (f"ringreduce: ranks disagree on {'/'.join(kinds)} of tensor "
            f"{' / '.join(repr(n) for n in names)}: '{field}' differs ({by_rank}). Every rank "
            "must submit the same collectives, in the same order, with the same shapes, dtypes, "
            "ops and root rank.")
