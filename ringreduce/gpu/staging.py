"""The staging pipeline, for MPI that reads host memory only: a device buffer travels through
two pinned host slots piece by piece; each piece is reduced on the host while the next piece is
copied down and the previous one copied back."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .cuda import cupy_module

STAGING_PIECE_BYTES = 4 << 20   # one piece of the staging pipeline; the same on every rank


class DeviceCopies:
    """Asynchronous copies between a device array and two pinned host slots, in order on one
    stream; an event per slot says when the copy down into it has landed. In-order copies make
    two slots enough: the copy down into a slot is queued after the copy back out of it."""

    def __init__(self, array: Any, slots: np.ndarray, stream: torch.cuda.Stream,
                 landed: list) -> None:
        self.array, self.slots, self.stream, self.landed = array, slots, stream, landed
        self._runtime = cupy_module().cuda.runtime

    def slot(self, k: int) -> np.ndarray:
        return self.slots[k % 2]

    def down(self, k: int, lo: int, hi: int) -> None:
        self._copy(self.slot(k).ctypes.data, self._address(lo), hi - lo,
                   self._runtime.memcpyDeviceToHost)
        self.landed[k % 2].record(self.stream)

    def up(self, k: int, lo: int, hi: int) -> None:
        self._copy(self._address(lo), self.slot(k).ctypes.data, hi - lo,
                   self._runtime.memcpyHostToDevice)

    def wait(self, k: int) -> None:
        self.landed[k % 2].synchronize()

    def drain(self) -> None:
        self.stream.synchronize()

    def _address(self, index: int) -> int:
        return self.array.data.ptr + index * self.array.itemsize

    def _copy(self, target: int, source: int, count: int, kind: int) -> None:
        self._runtime.memcpyAsync(target, source, count * self.array.itemsize, kind,
                                  self.stream.cuda_stream)


def staged_allreduce(copies: Any, length: int, piece: int,
                     reduce_host: Callable[[np.ndarray], None]) -> None:
    """Reduce a device buffer of `length` elements piece by piece through host slots: the copy
    down of piece k+1 is queued before piece k's MPI work starts, and piece k's copy back right
    after it ends, so copies in both directions run while MPI works."""
    bounds = [(lo, min(lo + piece, length)) for lo in range(0, length, piece)]
    if bounds:
        copies.down(0, *bounds[0])
    for k, (lo, hi) in enumerate(bounds):
        if k + 1 < len(bounds):
            copies.down(k + 1, *bounds[k + 1])
        copies.wait(k)
        reduce_host(copies.slot(k)[:hi - lo])
        copies.up(k, lo, hi)
    copies.drain()
