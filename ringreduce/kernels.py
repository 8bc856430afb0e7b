"""Which reduction kernel runs for a (dtype, op): NumPy ufuncs; our C kernels from native/
(`ringreduce._native`) for bfloat16 and float16 sums, for a last reduction step fused with
Average's division and the postscale, and for the compression casts; torch's CPU kernels for
the other half-precision ops, and everywhere when the extension is not built.

Kernels work on flat arrays from `buffers.as_array`: `out = a op b`, or in place
`target = target op source`.
Elementwise kernels are deterministic, which the ring's bitwise-identical guarantee relies on.
"""
from __future__ import annotations

import ctypes
import enum
import functools
from typing import Callable, Optional

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


def _load_native() -> Optional[ctypes.CDLL]:
    try:
        from . import _native
    except ImportError:
        return None
    lib = ctypes.CDLL(_native.__file__)
    p, n, f = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_float
    names = ["rr_sum_f32", "rr_sum_bf16"] + (["rr_sum_f16"] if lib.rr_has_f16c() else [])
    for name in names:
        getattr(lib, name).argtypes = [p, p, p, n, f, f]
    casts = ["rr_f32_to_bf16", "rr_bf16_to_f32"] + (
        ["rr_f32_to_f16", "rr_f16_to_f32"] if lib.rr_has_f16c() else [])
    for name in casts:
        getattr(lib, name).argtypes = [p, p, n]
    lib.has_f16c = bool(lib.rr_has_f16c())
    return lib


NATIVE = _load_native()
_NATIVE_SUM = {torch.float32: "rr_sum_f32", torch.bfloat16: "rr_sum_bf16",
               torch.float16: "rr_sum_f16"}
_NATIVE_CAST = {(torch.float32, torch.bfloat16): "rr_f32_to_bf16",
                (torch.bfloat16, torch.float32): "rr_bf16_to_f32",
                (torch.float32, torch.float16): "rr_f32_to_f16",
                (torch.float16, torch.float32): "rr_f16_to_f32"}


def _native(name: str) -> Optional[Callable]:
    return getattr(NATIVE, name, None) if NATIVE is not None and (
        "f16" not in name or NATIVE.has_f16c) else None


def _native_sum(dtype: torch.dtype, divisor: float = 1.0, scale: float = 1.0) -> Optional[Combine]:
    fn = _native(_NATIVE_SUM.get(dtype, ""))
    if fn is None:
        return None

    def native_kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        fn(a.ctypes.data, b.ctypes.data, out.ctypes.data, out.size, divisor, scale)

    return native_kernel


@functools.lru_cache(maxsize=None)
def finishing_combiner(dtype: torch.dtype, op: ReduceOp, ranks: int,
                       postscale: float) -> Optional[Combine]:
    """`out = (a + b) / ranks * postscale` (Average) or `* postscale` (Sum) in one pass, for
    the last step of a reduction; None where no such kernel exists (then combine and finish
    run separately). For float32 the bits equal those of the separate passes."""
    if op not in (ReduceOp.Sum, ReduceOp.Average) or not dtype.is_floating_point:
        return None
    return _native_sum(dtype, float(ranks) if op == ReduceOp.Average else 1.0, postscale)


_SUMS = (ReduceOp.Sum, ReduceOp.Average)
_NODE_KINDS = {**{(dtype, op): kind for op in _SUMS for dtype, kind in (
                   (torch.float32, 0), (torch.float64, 1), (torch.bfloat16, 4), (torch.float16, 5))
                  if kind != 5 or (NATIVE is not None and NATIVE.has_f16c)},
               (torch.int32, ReduceOp.Sum): 2, (torch.int64, ReduceOp.Sum): 3}


def node_kind(dtype: torch.dtype, op: ReduceOp, postscale: float) -> Optional[int]:
    """The C reduction (native/node.h's RR_KIND_*) of the shared-memory allreduce for
    (dtype, op), computing the same bits as the Python kernels; None where there is none."""
    if not dtype.is_floating_point and postscale != 1.0:
        return None     # integers are only summed, never scaled
    return _NODE_KINDS.get((dtype, op))


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor.to(dtype), through our kernels for the compression casts."""
    fn = _native(_NATIVE_CAST.get((tensor.dtype, dtype), ""))
    if fn is None or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return tensor.to(dtype)
    out = torch.empty(tensor.shape, dtype=dtype)
    fn(tensor.data_ptr(), out.data_ptr(), tensor.numel())
    return out


@functools.lru_cache(maxsize=None)
def combiner(dtype: torch.dtype, op: ReduceOp) -> Combine:
    """The kernel `out = a op b` for `dtype` (out may be a or b)."""
    if dtype in _HALF and op in (ReduceOp.Sum, ReduceOp.Average):
        native = _native_sum(dtype)
        if native is not None:
            return native
    if dtype in _HALF:
        fn = _TORCH_UFUNC[op]

        def torch_kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
            fn(as_tensor(a, dtype), as_tensor(b, dtype), out=as_tensor(out, dtype))

        return torch_kernel
    ufunc = _NUMPY_UFUNC[op]

    def numpy_kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        ufunc(a, b, out=out)

    return numpy_kernel


@functools.lru_cache(maxsize=None)
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
