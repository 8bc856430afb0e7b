"""The GPU ways: a CUDA tensor's allreduce, by what the MPI library reads.

- CUDA-aware MPI (or a set of one): ring.py runs on the CuPy arrays themselves; MPI reads
  device memory and the reductions run on the GPU (gpu/device_kernels.py).
- Otherwise: the buffer travels through two pinned host slots piece by piece
  (gpu/staging.py); each piece is reduced by the host ways the transport hands in (shared
  memory within a node, the ring over MPI between nodes) while the next piece is copied down
  and the previous one copied back.

Either way the work runs on our own stream after the caller's (gpu/cuda.py), and returns with
the result in device memory."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..gpu import cuda, device_kernels, staging
from ..kernels.ops import ReduceOp
from . import ring
from .reduce_spec import ReduceSpec
from .way import Pieces, SetParts, Way


class CudaAware(Way):
    """A CUDA tensor where MPI reads device memory, or in a set of one: the ring (the gather,
    for small buffers) on device memory, reduced by our kernels (cuda.py)."""

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.is_cuda

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts, settings = self.parts, self.parts.settings
        parts.check(spec)
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        reduce_in_device_memory(cuda.as_device_array(dst), spec.dtype, spec.op,
                                     spec.prescale, spec.postscale, parts.comm,
                                     settings.small_message_bytes, settings.segment_bytes,
                                     parts.device_scratch, parts.wait)


class StagedGpu(Way):
    """A CUDA tensor where MPI reads host memory only: piece by piece through pinned host
    memory, each piece reduced by the host ways (`pieces(spec)`, the signature checked here
    once for the whole buffer)."""

    def __init__(self, parts: SetParts, pieces: Pieces) -> None:
        super().__init__(parts)
        self.pieces = pieces

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.is_cuda

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self.parts.check(spec)
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        reduce_staged(cuda.as_device_array(dst), self.pieces(spec),
                           self.parts.device_scratch)


def reduce_in_device_memory(array: Any, dtype: torch.dtype, op: ReduceOp, prescale: float,
                            postscale: float, comm: Any, small_bytes: int, segment_bytes: int,
                            scratch: cuda.DeviceScratch, wait: ring.Wait) -> None:
    """CUDA-aware MPI (or a set of one): the same ring as on the CPU (the gather up to
    `small_bytes`), on device memory, reducing on the GPU; returns with the result there.
    `wait` waits for one MPI request (the stall watch's)."""
    with cuda.on_our_stream(array) as stream:
        device_kernels.scale(array, dtype, prescale)

        def finish(part: Any) -> None:
            device_kernels.finish(part, dtype, op, comm.size, postscale)
            stream.synchronize()   # the allgather sends it next

        stream.synchronize()       # MPI reads device memory: our queued work must be done
        if comm.size == 1 or array.size == 0:
            finish(array)
            return
        reduce = device_kernels.device_reducer(dtype, op, stream)
        if array.nbytes <= small_bytes:
            gathered = scratch.device(array.device.id, "gather", array.dtype,
                                      comm.size * array.size)
            ring.gather_allreduce(comm, array, reduce, gathered.reshape(comm.size, -1), wait,
                                  finish)
            return
        segment = max(1, segment_bytes // array.itemsize)
        bounds = ring.chunk_bounds(ring.balanced_counts(array.size, comm.size))
        segments = scratch.device(array.device.id, "ring", array.dtype,
                                  ring.scratch_elements(bounds, segment))
        ring.ring_allreduce(comm, array, reduce, segments, segment, wait, finish)


def reduce_staged(array: Any, host: Callable[[np.ndarray], None],
                  scratch: cuda.DeviceScratch) -> None:
    """MPI without CUDA support: piece by piece through pinned host memory, each piece reduced
    by `host` (which prescales, divides and postscales itself); returns with the result back
    in device memory."""
    with cuda.on_our_stream(array) as stream:
        device = array.device.id
        piece = max(1, staging.STAGING_PIECE_BYTES // array.itemsize)
        slots = scratch.pinned(device, 2 * piece * array.itemsize).view(array.dtype)
        staging.staged_allreduce(staging.DeviceCopies(array, slots.reshape(2, piece), stream,
                                      scratch.events(device)), array.size, piece, host)
