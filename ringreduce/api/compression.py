"""Gradient compression applied around a reduction: `Compression.none`, `Compression.fp16`.

A compressor turns a tensor into the tensor that is sent plus a context, and back, as
Horovod's do: fp16 casts every floating tensor (bfloat16 too) to float16; bf16 (ours) casts
the floating tensors wider than bfloat16; everything else passes through. The built-in ones
say so with `wire_dtype`, which lets the optimizer plan its buckets in the wire dtype. A
compressor of the user's own (Horovod's interface: `compress(tensor) -> (tensor, ctx)` and
`decompress(tensor, ctx) -> tensor`, static or class methods) is `custom`: its methods are
called on each tensor, as Horovod calls them.
"""
from __future__ import annotations

from typing import Any

import torch

from ..kernels.ops import cast


class Compressor:
    """Sends tensors unchanged."""

    wire_dtype: Any = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if cls.wire_dtype is None or not cls.applies_to(tensor.dtype):
            return tensor, None
        return cast(tensor, cls.wire_dtype), tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else cast(tensor, ctx)

    @classmethod
    def applies_to(cls, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point and dtype.itemsize > cls.wire_dtype.itemsize


class FP16Compressor(Compressor):
    """Sends every floating tensor as float16 (float32: half the bytes), restored to its dtype
    after the reduction, as Horovod's FP16Compressor (which casts bfloat16 too)."""

    wire_dtype = torch.float16

    @classmethod
    def applies_to(cls, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point and dtype != torch.float16


class BF16Compressor(Compressor):
    """Sends float32/float64 as bfloat16: float32's range, half the bytes."""

    wire_dtype = torch.bfloat16


NoneCompressor = Compressor     # (Horovod's name for it)


class Compression:
    """The compressors, by Horovod's names."""

    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def custom(compression: Any) -> bool:
    """Whether `compression` is not one of ours (or overrides compress or decompress): its
    methods must then be called on each tensor."""
    return not (isinstance(compression, type) and issubclass(compression, Compressor)
                and getattr(compression.compress, "__func__", None) is _COMPRESS
                and getattr(compression.decompress, "__func__", None) is _DECOMPRESS)


_COMPRESS, _DECOMPRESS = Compressor.compress.__func__, Compressor.decompress.__func__
