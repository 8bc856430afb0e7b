"""Reusable host scratch memory, owned by each process set's transport (the GPU side's twin is
cuda.DeviceScratch), so that steady-state steps allocate nothing.
"""
from __future__ import annotations

import numpy as np


class ScratchPool:
    """One growing block per purpose ("ring", "gather", "cross" ...). Only the thread running
    one of the set's collectives uses it."""

    def __init__(self) -> None:
        self._blocks: dict[str, np.ndarray] = {}

    def get(self, purpose: str, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` elements of `dtype` for `purpose`, valid until the next call for it."""
        nbytes = count * dtype.itemsize
        block = self._blocks.get(purpose)
        if block is None or block.nbytes < nbytes:
            block = self._blocks[purpose] = np.empty(max(nbytes, 64), dtype=np.uint8)
        return block[:nbytes].view(dtype)
