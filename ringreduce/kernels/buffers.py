"""Zero-copy views between CPU torch tensors and the NumPy arrays MPI and our kernels work on,
and the dtype table: which torch dtypes we reduce, their storage and their native code.

NumPy has no bfloat16, so a bfloat16 tensor is viewed as uint16 storage; the kernels know from
the native dtype code how to reduce it. Views never copy: results are written straight into the
tensor's memory. (CUDA tensors are viewed as CuPy arrays by `cuda.py`.)
"""
from __future__ import annotations

import ctypes
import sys
from typing import Sequence

import numpy as np
import torch

from .. import _native

# torch dtype -> the NumPy dtype of the storage we hand to MPI, and the code of native/constants.h
STORAGE_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(np.uint16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
CODES: dict[torch.dtype, int] = {
    torch.uint8: _native.U8, torch.int8: _native.I8, torch.int16: _native.I16,
    torch.int32: _native.I32, torch.int64: _native.I64, torch.float16: _native.F16,
    torch.bfloat16: _native.BF16, torch.float32: _native.F32, torch.float64: _native.F64,
}
SUPPORTED = tuple(STORAGE_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as messages and signatures name it: 'float32', not 'torch.float32'."""
    return str(dtype).removeprefix("torch.")


NAMES = {d: dtype_name(d) for d in SUPPORTED}


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    if tensor.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of a flat NumPy array holding `dtype` values (no copy)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14     # Linux


def _madvise() -> object:
    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


_MADVISE = _madvise()


def fresh(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a result we are about to write; in CPU memory, on transparent
    huge pages when it is large: fresh memory otherwise takes a page fault every 4 KiB on first
    write, which costs three times the copy itself at 64 MiB. (A hint: where the kernel
    declines it, nothing changes.)"""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _MADVISE is not None and out.device.type == "cpu" and out.nbytes >= 4 * _HUGE_PAGE:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        stop = (out.data_ptr() + out.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        _MADVISE(start, stop - start, _MADV_HUGEPAGE)
    return out
