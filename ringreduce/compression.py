"""Gradient compression applied around a reduction: `Compression.none`, `Compression.fp16`.

A compressor turns a tensor into the tensor that is sent plus a context, and back; only
floating tensors wider than the wire type are cast, everything else passes through.
"""
from __future__ import annotations

from typing import Any

import torch

from .kernels import cast


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
    """Sends float32/float64 as float16 (half the bytes), restored after the reduction."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Sends float32/float64 as bfloat16: float32's range, half the bytes."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors, by Horovod's names."""

    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
