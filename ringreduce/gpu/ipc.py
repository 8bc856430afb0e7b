"""CUDA IPC: device memory one process allocates and the other processes of its node open, so
that our kernels read every rank's block where it lies (the GPU node way,
transport/peer_node.py, orders the reads and writes).

A block is allocated with cudaMalloc itself: an IPC handle names a whole allocation, so a
block of CuPy's or torch's caching pools would open, in the peer, as the pool's whole segment
at another address. GPUs are named across processes by PCI bus id: each process numbers the
GPUs it sees (CUDA_VISIBLE_DEVICES) its own way.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .cuda import cupy_module, on_device

HANDLE_BYTES = 64           # a cudaIpcMemHandle_t
BUS_ID_BYTES = 32           # room for a PCI bus id ("0000:3b:00.0")
_LAZY_PEER_ACCESS = 1       # cudaIpcMemLazyEnablePeerAccess
_PEER_ACCESS_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_COPY_DEFAULT = 4           # cudaMemcpyDefault: unified addressing finds each side's device


def _runtime() -> Any:
    return cupy_module().cuda.runtime


class SharedBlock:
    """`nbytes` of device memory on `device`, that the node's other processes open by its
    handle (`handle()`). Freed by `free()`, once they have closed it."""

    def __init__(self, device: int, nbytes: int) -> None:
        self.device, self.nbytes = device, nbytes
        with on_device(device):
            self.address = _runtime().malloc(nbytes)

    def handle(self) -> bytes:
        with on_device(self.device):
            return bytes(_runtime().ipcGetMemHandle(self.address))

    def free(self) -> None:
        with on_device(self.device):
            _runtime().free(self.address)


def open_block(handle: bytes, device: int) -> int:
    """A peer's block, mapped into this process for our kernels on `device`: its address."""
    with on_device(device):
        return int(_runtime().ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS))


def close_block(address: int, device: int) -> None:
    with on_device(device):
        _runtime().ipcCloseMemHandle(address)


def bus_id(device: int) -> str:
    """The PCI bus id of this process's GPU `device`: the same GPU's in every process."""
    return str(_runtime().deviceGetPCIBusId(device)).lower()


def device_at(bus: str) -> Optional[int]:
    """This process's number for the GPU at PCI bus id `bus`; None where it does not see it."""
    runtime = _runtime()
    try:
        return int(runtime.deviceGetByPCIBusId(bus))
    except runtime.CUDARuntimeError:
        return None


def reach(device: int, peer: int) -> Optional[str]:
    """None where our kernels on `device` can read memory on GPU `peer` (enabling peer access);
    else why they cannot."""
    if device == peer:
        return None
    runtime = _runtime()
    if not runtime.deviceCanAccessPeer(device, peer):
        return f"GPU {device} cannot read GPU {peer}'s memory (cudaDeviceCanAccessPeer)"
    with on_device(device):
        try:
            runtime.deviceEnablePeerAccess(peer)
        except runtime.CUDARuntimeError as error:
            if getattr(error, "status", None) != _PEER_ACCESS_ENABLED:
                return f"GPU {device} cannot enable access to GPU {peer}: {error}"
    return None


def copy(target: int, source: int, nbytes: int, stream: Any) -> None:
    """`nbytes` from address `source` to `target` (either on any GPU, a peer's block too),
    queued on torch stream `stream`."""
    if nbytes:
        _runtime().memcpyAsync(target, source, nbytes, _COPY_DEFAULT, stream.cuda_stream)


def address_table(addresses: list[int], device: int) -> Any:
    """The blocks' addresses as a device array, for device_kernels.reduce_from_peers."""
    with on_device(device):
        return cupy_module().asarray(np.array(addresses, dtype=np.uint64))


def view(address: int, count: int, dtype: Any, device: int) -> Any:
    """A CuPy array of `count` elements of NumPy `dtype` at `address` on `device` (not owned:
    the block outlives it)."""
    cp = cupy_module()
    memory = cp.cuda.UnownedMemory(address, count * np.dtype(dtype).itemsize, None, device)
    return cp.ndarray((count,), dtype, cp.cuda.MemoryPointer(memory, 0))
