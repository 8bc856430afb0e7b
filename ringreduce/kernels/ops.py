"""The reduction ops, and the CPU kernels that apply them to flat arrays: every (dtype, op) in C
(native/kernels.c, called without the GIL), the same kernels the node's shared-memory path runs.

Kernels work on flat NumPy arrays from `buffers.as_array`: `target = target op source` (or
`target = mine op source`), and the finishing step `x = x * (scale / divisor)`. Elementwise
kernels are deterministic, which the ring's bitwise-identical guarantee relies on. Beside them,
the compression casts and a streaming copy.
"""
from __future__ import annotations

import enum
import functools
from typing import Callable, Optional

import numpy as np
import torch

from .. import _native
from .buffers import CODES

Kernel = Callable[..., None]    # (target, source[, mine]), see reducer()


class ReduceOp(enum.IntEnum):
    """Reduction operations, numbered as Horovod's; `Average` is a sum times postscale / size,
    one multiply, as Horovod's (`finish`)."""

    Average = _native.OP_AVERAGE
    Sum = _native.OP_SUM
    Adasum = _native.OP_ADASUM
    Min = _native.OP_MIN
    Max = _native.OP_MAX
    Product = _native.OP_PRODUCT


address: Callable[[np.ndarray], int] = _native.address
"""address(array): where a contiguous array begins; a tenth of the time of `.ctypes.data`."""


@functools.lru_cache(maxsize=None)
def reducer(dtype: torch.dtype, op: ReduceOp) -> Kernel:
    """The kernel `target = target op source` for `dtype`, or `mine op source` into target
    (the ring out of place); called once per row of the small gather and per ring segment."""
    code, combine = CODES[dtype], _native.combine

    def kernel(target: np.ndarray, source: np.ndarray, mine: Optional[np.ndarray] = None
               ) -> None:
        at = address(target)
        combine(code, op, at if mine is None else address(mine), address(source), at,
                target.size, False, 1.0, 1.0)

    return kernel


def finish(array: np.ndarray, dtype: torch.dtype, divisor: float, scale: float) -> None:
    """array *= scale / divisor in place, as Horovod scales (Average's postscale / size): the
    factor in float64, then one multiply by it cast to float32 for float32 and the 16-bit
    floats, in float64 for float64 and integers (truncated toward zero); a factor of 1 is
    free."""
    if (divisor != 1.0 or scale != 1.0) and array.size:
        _native.finish(CODES[dtype], address(array), array.size, float(divisor), float(scale))


_CASTS = {(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float32, torch.float16), (torch.float16, torch.float32)}


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor.to(dtype), through our kernels for the compression casts."""
    if ((tensor.dtype, dtype) not in _CASTS or not tensor.is_contiguous()
            or tensor.device.type != "cpu"):
        return tensor.to(dtype)
    out = torch.empty(tensor.shape, dtype=dtype)
    _native.cast(CODES[tensor.dtype], CODES[dtype], tensor.data_ptr(), out.data_ptr(),
                 tensor.numel())
    return out


copy_stream: Callable[[int, int, int], None] = _native.copy_stream
"""copy_stream(dst_address, src_address, nbytes): memcpy with non-temporal stores from
`_native.STREAM_MIN` bytes on, the fastest one-thread copy of a large buffer to memory (and the
allreduce benchmark's yardstick); complete when it returns. The C function itself, so that a
call costs no Python frame."""
