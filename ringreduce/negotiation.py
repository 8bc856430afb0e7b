"""Cross-rank check that every rank is running the same collective.

Each collective starts with one fixed-size `Allgather` of a 64-bit digest of its signature
(kind, name, dtype, shape, op, scale factors, root) plus one per-rank integer the collective
needs anyway (allgather's first dimension, say), so the check costs no extra round trip there.
When digests differ, a second round gathers the full signatures so that every rank raises the
same `MismatchError`, naming the tensor, the field, and each rank's value.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Optional

import numpy as np

from .errors import MismatchError

Signature = Mapping[str, Any]


def digest(signature: Signature) -> int:
    text = repr(sorted(signature.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def check(comm: Any, signature: Signature, per_rank: int = 0,
          precomputed: Optional[int] = None) -> np.ndarray:
    """Raise `MismatchError` on every rank unless all signatures agree; return every rank's
    `per_rank` value, indexed by rank. `precomputed` is the signature's digest when the caller
    made it once up front (the optimizer's buckets)."""
    value = digest(signature) if precomputed is None else precomputed
    header = np.array([value, per_rank], dtype=np.int64)
    if comm.size == 1:
        return header[1:]
    headers = np.empty((comm.size, 2), dtype=np.int64)
    comm.Allgather(header, headers)
    if (headers[:, 0] != headers[0, 0]).any():
        raise MismatchError(describe_mismatch(comm.allgather(dict(signature))))
    return headers[:, 1]


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
