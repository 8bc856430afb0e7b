"""Which reduction kernel runs for a (dtype, op): NumPy ufuncs, or torch's CPU kernels for the
half types NumPy lacks (bfloat16) or runs slowly (float16).

Kernels work on flat arrays from `buffers.as_array`: `out = a op b`, or in place
`target = target op source`.
Elementwise kernels are deterministic, which the ring's bitwise-identical guarantee relies on.
"""
from __future__ import annotations

import enum
from typing import Callable

import numpy as np
import torch

from .buffers import as_tensor

Kernel = Callable[[np.ndarray, np.ndarray], None]
Combine = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


class ReduceOp(enum.IntEnum):
    """Reduction operations; `Average` reduces with a sum and divides by the rank count."""

    Average = 0
    Sum = 1
    Adasum = 2  # Horovod's value; refused, listed so the numbering matches
    Min = 3
    Max = 4
    Product = 5


_HALF = (torch.float16, torch.bfloat16)
_NUMPY_UFUNC = {ReduceOp.Sum: np.add, ReduceOp.Average: np.add, ReduceOp.Min: np.minimum,
                ReduceOp.Max: np.maximum, ReduceOp.Product: np.multiply}
_TORCH_UFUNC = {ReduceOp.Sum: torch.add, ReduceOp.Average: torch.add, ReduceOp.Min: torch.minimum,
                ReduceOp.Max: torch.maximum, ReduceOp.Product: torch.mul}


def combiner(dtype: torch.dtype, op: ReduceOp) -> Combine:
    """The kernel `out = a op b` for `dtype` (out may be a or b)."""
    if dtype in _HALF:
        fn = _TORCH_UFUNC[op]

        def torch_kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
            fn(as_tensor(a, dtype), as_tensor(b, dtype), out=as_tensor(out, dtype))

        return torch_kernel
    ufunc = _NUMPY_UFUNC[op]

    def numpy_kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        ufunc(a, b, out=out)

    return numpy_kernel


def reducer(dtype: torch.dtype, op: ReduceOp) -> Kernel:
    """The in-place kernel `target = target op source` for `dtype`."""
    combine = combiner(dtype, op)

    def kernel(target: np.ndarray, source: np.ndarray) -> None:
        combine(target, source, target)

    return kernel


def scale(array: np.ndarray, dtype: torch.dtype, factor: float) -> None:
    """array *= factor in place (floating dtypes only; factor 1 is free)."""
    if factor != 1.0:
        as_tensor(array, dtype).mul_(factor)


def divide(array: np.ndarray, dtype: torch.dtype, divisor: int) -> None:
    """array /= divisor in place: true division for floats, floor division for integers."""
    if divisor != 1:
        t = as_tensor(array, dtype)
        if dtype.is_floating_point:
            t.div_(divisor)
        else:
            t.div_(divisor, rounding_mode="floor")
