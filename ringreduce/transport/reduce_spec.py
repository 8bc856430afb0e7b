"""What one reduction computes (`ReduceSpec`), as every way of the transport, the join rounds and
the optimizer's buckets describe it: its own module, so that each of them can take it without
taking the transport.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ..kernels.buffers import CODES
from ..kernels.ops import ReduceOp
from .signature import Signature, label


class ReduceSpec:
    """What a reduction computes, and how the ranks recognise it as the same collective.

    `digest` is its signature's digest, or None when the signature was checked already (the
    later dtype groups of a grouped allreduce). `signature` is the signature, or a function
    that makes it: it is only needed for messages (mismatch, stall). `lengths`: the element
    counts of the tensors fused in the buffer, which Adasum weighs each on its own."""

    __slots__ = ("dtype", "code", "op", "prescale", "postscale", "digest", "signature",
                 "lengths", "_label")

    def __init__(self, dtype: torch.dtype, op: ReduceOp, prescale: float = 1.0,
                 postscale: float = 1.0, digest: Optional[int] = None,
                 signature: Union[Signature, Callable[[], Signature], None] = None,
                 lengths: Optional[Sequence[int]] = None) -> None:
        self.dtype, self.code, self.op = dtype, CODES[dtype], op
        self.prescale, self.postscale = float(prescale), float(postscale)
        self.digest, self.signature, self.lengths = digest, signature, lengths
        self._label: Optional[str] = None

    def describe(self) -> Signature:
        signature = self.signature
        return (signature() if callable(signature) else signature) or {"collective": "allreduce"}

    def __str__(self) -> str:
        """How a stall report names the collective (made once: a bucket's spec is reused)."""
        if self._label is None:
            self._label = label(self.describe())
        return self._label

    def unchecked(self) -> "ReduceSpec":
        """The same reduction, for buffers whose signature was checked already."""
        return ReduceSpec(self.dtype, self.op, self.prescale, self.postscale, None,
                          self.signature, self.lengths)
