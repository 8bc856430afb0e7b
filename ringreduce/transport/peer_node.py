"""The GPU node way: the CUDA tensors of one node's ranks reduced in the device memory they share
through CUDA IPC (gpu/ipc.py), by our kernels, so that within a node no byte leaves the GPUs;
between nodes, hierarchically.

Every rank has a block of device memory that its node's peers have opened (`DeviceBlocks`). An
allreduce copies this rank's input into its block (times the prescale), then:
- one-shot (up to the small message size, on one node): every rank reduces the whole buffer
  from every block into its output;
- two-shot: each rank reduces its slice from every block into its own block, then copies every
  rank's reduced slice into its output. Between nodes, each rank's slice is allreduced with the
  same slice of the other nodes before that (over the cross communicator: on device memory
  where MPI is CUDA-aware, else that slice alone through pinned host memory), so each rank
  moves only 1/local-size of the buffer between nodes.
Every element is reduced in rank order by one rank (or by every rank alike), then copied: the
ranks' results are bitwise identical, and equal to the CPU node way's.

Ordering, without a kernel that waits for a peer (ranks may share one GPU, where kernels of
different processes do not run at once, and one spinning on a flag would wait for ever): each
phase ends with our stream synchronized (only our stream; nothing synchronizes the device),
then a handshake over MPI among the node's ranks; the next phase starts after it. So a rank
reads a peer's block only once the peer's writes into it are done, and writes its own block
(the next allreduce's copy-in, after that allreduce's first handshake) only once every peer's
reads are done. IPC events would let the host hand over before the copy lands and save a
launch latency per phase; synchronizing the stream keeps the protocol to one rule, and a
phase of a large buffer is long beside it.

The blocks are registered at the set's first GPU allreduce, where every member also agrees
whether IPC works on every node (`RINGREDUCE_GPU_NODE_WAY=auto`: where it does not, every member
stages its GPU buffers through host memory from then on, each saying why once); again when a
larger block is needed or a rank's GPU changed; and freed by the set's transport.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from ..core.errors import RingReduceError
from ..core.mpi import mpi
from ..gpu import cuda, device_kernels, ipc
from ..kernels.buffers import STORAGE_DTYPES
from ..kernels.ops import ReduceOp
from .gpu_ways import reduce_in_device_memory, reduce_staged
from .reduce_spec import ReduceSpec
from .way import SetParts, Way

log = logging.getLogger("ringreduce")

SMALLEST_BLOCK = 1 << 20        # a block's least size; larger ones are powers of two
SLICE_ALIGNMENT = 256           # bytes: each rank's slice starts on a boundary (whole lines)
_REASON_BYTES = 480             # room for why IPC failed on a rank, in the agreement


class DeviceBlocks:
    """One set's blocks of device memory on this node: this rank's own (`own`, allocated here)
    and every peer's (opened from its handle), as addresses in local rank order (`addresses`,
    and `table`, the same in device memory for our kernels)."""

    def __init__(self, local: Any, wait: Any) -> None:
        self.local, self.wait = local, wait
        self.device: Optional[int] = None
        self.capacity = 0
        self.own: Optional[ipc.SharedBlock] = None
        self.addresses: list[int] = []
        self.table: Any = None
        self._opened: list[int] = []

    def stale(self, device: int, nbytes: int) -> bool:
        return device != self.device or nbytes > self.capacity

    def register(self, device: int, nbytes: int) -> Optional[str]:
        """(Collective on the node.) Blocks of at least `nbytes` on every rank, this one's on
        `device`. Returns None, or why some rank cannot open the others' (then none is held)."""
        self.free()
        capacity = max(SMALLEST_BLOCK, 1 << (nbytes - 1).bit_length())    # the same everywhere
        mine = np.zeros(ipc.HANDLE_BYTES + ipc.BUS_ID_BYTES, dtype=np.uint8)
        why = None
        try:
            self.own = ipc.SharedBlock(device, capacity)
            _put(mine, 0, self.own.handle())
            _put(mine, ipc.HANDLE_BYTES, ipc.bus_id(device).encode())
        except Exception as error:          # (out of memory, no IPC on this platform ...)
            why = f"cannot share a block of {capacity} bytes on GPU {device}: {error}"
        everyone = np.zeros((self.local.size, mine.size), dtype=np.uint8)
        self.wait(self.local.Iallgather(mine, everyone))
        me = self.local.rank
        addresses = [0] * self.local.size
        for r, record in enumerate(everyone):
            if why is not None:
                break
            if r == me:
                addresses[r] = self.own.address
                continue
            why = self._open(record, device, r, addresses)
        why = self._agree(why)
        if why is not None:
            self.free()
            return why
        self.device, self.capacity, self.addresses = device, capacity, addresses
        self.table = ipc.address_table(addresses, device)
        return None

    def _open(self, record: np.ndarray, device: int, r: int,
              addresses: list[int]) -> Optional[str]:
        """Local rank `r`'s block opened here (its address into `addresses`), or why not."""
        bus = bytes(record[ipc.HANDLE_BYTES:]).rstrip(b"\0").decode()
        if not bus:
            return None         # (that rank could not share one: it says why itself)
        peer = ipc.device_at(bus)
        if peer is None:
            return (f"local rank {r}'s GPU (PCI {bus}) is not visible to this process "
                    "(CUDA_VISIBLE_DEVICES)")
        why = ipc.reach(device, peer)
        if why is not None:
            return why
        try:
            addresses[r] = ipc.open_block(bytes(record[:ipc.HANDLE_BYTES]), device)
        except Exception as error:      # (another container, a driver without IPC ...)
            return f"cannot open local rank {r}'s block: {error}"
        self._opened.append(addresses[r])
        return None

    def _agree(self, why: Optional[str]) -> Optional[str]:
        """Every rank of the node learns whether each succeeded: the first one's reason."""
        mine = np.zeros(_REASON_BYTES, dtype=np.uint8)
        if why is not None:
            _put(mine, 0, f"node rank {self.local.rank}: {why}".encode()[:_REASON_BYTES - 1])
        everyone = np.zeros((self.local.size, _REASON_BYTES), dtype=np.uint8)
        self.wait(self.local.Iallgather(mine, everyone))
        reasons = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in everyone]
        return next((reason for reason in reasons if reason), None)

    def free(self) -> None:
        """Close the peers' blocks, then free this rank's. (A peer may free its own before
        this rank closes it: the driver keeps the memory until the last mapping closes.)"""
        for address in self._opened:
            ipc.close_block(address, self.device if self.device is not None else 0)
        self._opened = []
        if self.own is not None:
            self.own.free()
            self.own = None
        self.device, self.capacity, self.addresses, self.table = None, 0, [], None


def _put(target: np.ndarray, at: int, data: bytes) -> None:
    target[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)


class PeerMemory(Way):
    """A CUDA tensor on a node whose ranks share device memory (see the module's docstring).
    `fallback` (the staged or CUDA-aware way) runs the set's GPU allreduces where the members
    agreed at the first one that IPC does not work on every node."""

    def __init__(self, parts: SetParts, fallback: Way) -> None:
        super().__init__(parts)
        self.fallback = fallback
        self.blocks = DeviceBlocks(parts.local, parts.wait)
        self.works: Optional[bool] = None       # decided at the set's first GPU allreduce

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.is_cuda

    def free(self) -> None:
        self.blocks.free()

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        if self.works is False:
            self.fallback.run(src, dst, spec)
            return
        self.parts.check(spec)
        out = cuda.as_device_array(dst)
        if out.size == 0:
            return
        with cuda.on_our_stream(out) as stream:
            if not self._ready(src.device.index, src.nbytes):
                self.fallback.run(src, dst, spec.unchecked())
                return
            self._reduce(src, out, spec, stream)

    def broadcast(self, tensor: torch.Tensor, root: int) -> bool:
        """(On one node.) Member `root`'s `tensor` into every member's, through the root's
        block; False where IPC does not work for the set (the caller moves it)."""
        return self._moved(tensor, tensor, [tensor.nbytes] * self.parts.size, root)

    def allgather(self, tensor: torch.Tensor, out: torch.Tensor, counts: list[int]) -> bool:
        """(On one node.) Every member's `tensor` (`counts[r]` elements on member r) one after
        another into `out`, through their blocks; False as `broadcast`."""
        itemsize = tensor.element_size()
        return self._moved(tensor, out, [c * itemsize for c in counts], None)

    def _moved(self, tensor: torch.Tensor, out: torch.Tensor, sizes: list[int],
               root: Optional[int]) -> bool:
        """This rank's `tensor` into its block (the root's alone, for a broadcast), then from
        the blocks into `out`: the root's block, or each member's part in rank order."""
        if self.works is False:
            return False
        if not any(sizes):
            return True
        me, blocks = self.parts.local.rank, self.blocks
        with cuda.on_our_stream(cuda.as_device_array(out)) as stream:
            if not self._ready(tensor.device.index, max(sizes)):
                return False
            if root is None or me == root:
                ipc.copy(blocks.own.address, tensor.data_ptr(), sizes[me], stream)
            self._handshake(stream)
            if root is not None:
                if me != root:
                    ipc.copy(out.data_ptr(), blocks.addresses[root], sizes[root], stream)
            else:
                offsets = np.cumsum([0] + sizes)
                for r, size in enumerate(sizes):
                    ipc.copy(out.data_ptr() + int(offsets[r]), blocks.addresses[r], size,
                             stream)
            stream.synchronize()
        return True

    def _ready(self, device: int, nbytes: int) -> bool:
        """(Collective on the node: the handshake that starts every allreduce.) The blocks
        registered again where some rank needs it; False where the members agreed, at the
        first one, that IPC does not work."""
        parts, blocks = self.parts, self.blocks
        flag = np.array([int(blocks.stale(device, nbytes))], dtype=np.int64)
        anyone = np.zeros(1, dtype=np.int64)
        parts.wait(parts.local.Iallreduce(flag, anyone, op=mpi().MAX))
        if not anyone[0]:
            return True
        why = blocks.register(device, nbytes)
        if self.works is None:
            why = self._agree_everywhere(why)
        if why is None:
            self.works = True
            return True
        if self.works is None and parts.settings.gpu_node_way == "auto":
            self.works = False
            log.info("ringreduce: rank %d: GPU buffers are staged through host memory, "
                     "since the GPU node way cannot share device memory: %s (set "
                     "RINGREDUCE_GPU_NODE_WAY=staging not to try)", parts.comm.rank, why)
            return False
        raise RingReduceError(f"ringreduce: the GPU node way cannot share device memory: {why}"
                              " (RINGREDUCE_GPU_NODE_WAY=staging stages GPU buffers through "
                              "host memory instead)")

    def _agree_everywhere(self, why: Optional[str]) -> Optional[str]:
        """(Collective on the set, at its first GPU allreduce, where every node registers.)
        Whether every node could share its ranks' memory; a node that could not says why."""
        parts = self.parts
        ok = np.array([int(why is None)], dtype=np.int64)
        everywhere = np.zeros(1, dtype=np.int64)
        parts.wait(parts.comm.Iallreduce(ok, everywhere, op=mpi().MIN))
        if everywhere[0] or why is not None:
            return why
        return "it failed on another node"

    def _reduce(self, src: torch.Tensor, out: Any, spec: ReduceSpec,
                stream: torch.cuda.Stream) -> None:
        parts, blocks = self.parts, self.blocks
        count, itemsize = out.size, out.itemsize
        ipc.copy(blocks.own.address, src.data_ptr(), src.nbytes, stream)
        device_kernels.scale(self._own(0, count, spec.dtype), spec.dtype, spec.prescale)
        self._handshake(stream)
        ranks, one_node = parts.local.size, parts.cross.size == 1
        if one_node and src.nbytes <= parts.settings.small_message_bytes:    # one-shot
            device_kernels.reduce_from_peers(blocks.table, ranks, 0, out.data.ptr, count,
                                             spec.dtype, spec.op)
            device_kernels.finish(out, spec.dtype, spec.op, parts.size, spec.postscale)
            stream.synchronize()
            return
        bounds = slices(count, ranks, itemsize)
        lo, hi = bounds[parts.local.rank]
        device_kernels.reduce_from_peers(blocks.table, ranks, lo, blocks.own.address +
                                         lo * itemsize, hi - lo, spec.dtype, spec.op)
        mine = self._own(lo, hi - lo, spec.dtype)
        if not one_node:
            stream.synchronize()        # (MPI reads it, or it is copied down, next)
            self._across_nodes(mine, spec)
        device_kernels.finish(mine, spec.dtype, spec.op, parts.size, spec.postscale)
        self._handshake(stream)
        for r, (lo, hi) in enumerate(bounds):
            ipc.copy(out.data.ptr + lo * itemsize, blocks.addresses[r] + lo * itemsize,
                     (hi - lo) * itemsize, stream)
        stream.synchronize()

    def _own(self, start: int, count: int, dtype: torch.dtype) -> Any:
        """Elements start.. of this rank's block, as a CuPy array of `dtype`."""
        blocks = self.blocks
        numpy_dtype = STORAGE_DTYPES[dtype]
        return ipc.view(blocks.own.address + start * numpy_dtype.itemsize, count, numpy_dtype,
                        blocks.device)

    def _handshake(self, stream: torch.cuda.Stream) -> None:
        """Our writes done, then every rank of the node here (see the module's docstring)."""
        stream.synchronize()
        self.parts.wait(self.parts.local.Ibarrier())

    def _across_nodes(self, mine: Any, spec: ReduceSpec) -> None:
        """This rank's slice, reduced on its node, allreduced with the same slice of the
        other nodes (without the finish: Average divides by the whole set, after)."""
        parts = self.parts
        op = ReduceOp.Sum if spec.op == ReduceOp.Average else spec.op
        if parts.settings.cuda_aware:
            settings = parts.settings
            reduce_in_device_memory(mine, spec.dtype, op, 1.0, 1.0, parts.cross,
                                    settings.small_message_bytes, settings.segment_bytes,
                                    parts.device_scratch, parts.wait)
            return
        plain = ReduceSpec(spec.dtype, op)

        def host(piece: np.ndarray) -> None:
            parts.ring(parts.cross, "gpu node, between nodes", piece, plain)

        reduce_staged(mine, host, parts.device_scratch)


def slices(count: int, ranks: int, itemsize: int) -> list[tuple[int, int]]:
    """Each local rank's [start, stop) of `count` elements: as even as whole SLICE_ALIGNMENT
    lines allow, the same on every node (the cross-node step pairs them)."""
    line = max(1, SLICE_ALIGNMENT // itemsize)
    lines = -(-count // line)
    base, extra = divmod(lines, ranks)
    bounds, start = [], 0
    for r in range(ranks):
        stop = min(count, start + (base + (1 if r < extra else 0)) * line)
        bounds.append((start, stop))
        start = stop
    return bounds
