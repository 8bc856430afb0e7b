"""CUDA tensors as the GPU side works on them: CuPy views of their memory, the device a
collective works on, our streams and the events that order them after the caller's, and each
process set's device memory (`DeviceScratch`). Our kernels: device_kernels.py; the staging
pipeline: staging.py; the GPU ways that use them: transport/gpu_ways.py. Whether MPI reads
device memory: cuda_aware.py.

CuPy is imported only when a CUDA tensor shows up, so `import ringreduce` works without it.
Our work runs on our own stream, which first waits for an event on torch's stream, and a
reduction returns only once its result is in device memory, so any stream may read it. The
device scratch, pinned slots and events a reduction uses belong to its process set
(`DeviceScratch`, one per transport), so sets that reduce at once on one device share none.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from ..core.errors import RingReduceError

REDUCTIONS = ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_")
MOVED_IN_NODE = ("allgather", "grouped_allgather", "broadcast", "broadcast_")


# ---------------------------------------------------------------- CuPy and views

def cupy_module() -> Any:
    """CuPy, or an error saying how to install it."""
    try:
        import cupy
    except ImportError as exc:
        raise RingReduceError(
            "ringreduce: CUDA tensors need CuPy; install ringreduce with the extra matching "
            "your torch's CUDA: pip install 'ringreduce[cuda12]' or 'ringreduce[cuda13]'"
        ) from exc
    return cupy


def as_device_array(tensor: torch.Tensor) -> Any:
    """A flat CuPy view of a contiguous CUDA tensor's memory (no copy); bfloat16, which CuPy
    lacks, as uint16 storage, as on the CPU side. Made with the tensor's device current:
    CuPy views only memory of the current device, and copies any other's to it."""
    cp = cupy_module()
    flat = tensor.detach().reshape(-1)
    with on_device(tensor.device.index):
        if tensor.dtype == torch.bfloat16:
            return cp.asarray(flat.view(torch.int16)).view(cp.uint16)
        return cp.asarray(flat)


def on_device(index: int) -> torch.cuda.device:
    """Device `index` current on this thread for a block. torch's guard rather than CuPy's
    Device: leaving, it goes back to the previous device only where that one has a CUDA
    context already. CuPy's would make one there: on a thread that never chose a device (the
    engine's), device 0, some hundred MiB of another rank's GPU."""
    return torch.cuda.device(index)


def device_tensor(tensor: torch.Tensor, what: str, in_node: bool = False) -> torch.Tensor:
    """The tensor collective `what` works on for a CUDA `tensor`.

    Reductions run in the tensor's own device memory, whichever device is current (as
    Horovod's and NCCL's: `model.to(local_rank)` without `set_device` works): every view,
    stream, event and scratch block is taken on `tensor.device`. So do allgather and broadcast
    where the set's members share one node's device memory (`in_node`: the GPU node way). The
    other collectives (and those two elsewhere) work on a host copy made here, on the caller's
    thread after what its stream has queued; api/arguments moves their results back to the
    tensor's device, as Horovod returns them.
    """
    if what not in REDUCTIONS and not (in_node and what in MOVED_IN_NODE):
        return tensor.detach().cpu()
    cupy_module()
    return tensor.detach()      # (contiguous: api/arguments checked it)


# ---------------------------------------------------------------- streams and events

_ready = threading.local()


def after_caller(work: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """`work`, a collective of tensors on `device` that may run on another thread (the
    engine's), made to start after what torch's current stream of this, the calling, thread
    has queued so far: the caller's tensors may come from a side stream (torch.cuda.stream),
    where the other thread's current stream would not wait for them. As Horovod records a
    ready event when a collective is enqueued. And it ends once what it queued on that
    thread's stream is done (an in-place copy back, a decompression): the caller's stream
    would not wait for those either."""
    event = torch.cuda.current_stream(device).record_event()

    def ordered() -> Any:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        result = work()
        stream.synchronize()
        return result

    return ordered


@contextlib.contextmanager
def after(event: Optional[Any]) -> Iterator[None]:
    """Inside this block, reductions on this thread wait for `event` (recorded where the data
    was produced) instead of for torch's current stream of this thread. None: no change."""
    previous = getattr(_ready, "event", None)
    _ready.event = event if event is not None else previous
    try:
        yield
    finally:
        _ready.event = previous


@functools.lru_cache(maxsize=None)
def our_stream(device: int) -> torch.cuda.Stream:
    """Our stream on `device`, made once: our copies and kernels never queue behind training."""
    return torch.cuda.Stream(device=device)


def cupy_stream(stream: torch.cuda.Stream) -> Any:
    """CuPy's handle on a torch stream, so CuPy's kernels queue on it (CuPy 14 spells it
    Stream.from_external, earlier versions ExternalStream)."""
    cp = cupy_module()
    if hasattr(cp.cuda.Stream, "from_external"):
        try:
            return cp.cuda.Stream.from_external(stream)
        except TypeError:       # a torch stream without __cuda_stream__ (older torch)
            pass
    return cp.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def _ready_stream(device: int) -> torch.cuda.Stream:
    """Our stream on `device`, made to wait for the event set by `after`, or else for torch's
    current stream of this thread."""
    stream = our_stream(device)
    ready = getattr(_ready, "event", None)
    stream.wait_event(ready if ready is not None
                      else torch.cuda.current_stream(device).record_event())
    return stream


@contextlib.contextmanager
def on_our_stream(array: Any) -> Iterator[torch.cuda.Stream]:
    """Our stream on the array's device, CuPy queuing on it, started after the event set by
    `after`, or else after torch's current stream of this thread."""
    device = array.device.id
    stream = _ready_stream(device)
    with on_device(device), cupy_stream(stream):
        yield stream


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a CUDA tensor, for a way that reduces on the host (Adasum), taken on our
    stream after the event set by `after` (else after torch's current stream of this thread):
    the engine thread's own current stream would not wait for the caller's."""
    with torch.cuda.stream(_ready_stream(tensor.device.index)):
        return tensor.cpu()


def from_host(target: torch.Tensor, host: torch.Tensor) -> None:
    """`host` into the CUDA tensor `target`, landed when this returns (any stream may read it)."""
    stream = our_stream(target.device.index)
    with torch.cuda.stream(stream):
        target.copy_(host)
    stream.synchronize()


def landed(tensors: Any) -> None:
    """Wait for what this thread queued on torch's current stream of each CUDA tensor's device
    among `tensors` (a list, maybe of lists): a copy into a collective's result is in device
    memory before the result is handed over, whichever stream then reads it."""
    devices = set()
    for item in tensors:
        for t in (item if isinstance(item, (list, tuple)) else (item,)):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                devices.add(t.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


# ---------------------------------------------------------------- device memory we keep

def _device_block(device: int, nbytes: int) -> Any:
    with on_device(device):
        return cupy_module().empty(nbytes, dtype=np.uint8)


def _pinned_block(nbytes: int) -> np.ndarray:
    import cupyx

    return cupyx.empty_pinned((nbytes,), dtype=np.uint8)


def _event_pair() -> list:
    return [torch.cuda.Event(), torch.cuda.Event()]


class DeviceScratch:
    """One process set's GPU memory, owned by its transport as the CPU side's ScratchPool is:
    device scratch (one growing block per device and purpose: the ring's segments, the small
    path's gather), pinned host memory for staging (one growing block per device) and the
    staging slots' events (a pair per device). Made empty, with no CUDA or CuPy touched: each
    block is allocated when an allreduce on that device first needs it, so steady-state steps
    allocate none. `free()` drops them all when the set closes (CuPy's pools take the memory
    back). Only the thread running one of the set's collectives uses it; another set reducing
    on the same device at the same time has its own.

    The allocators default to CuPy's (device, pinned) and torch's (events); tests hand in
    others."""

    def __init__(self, device_block: Callable[[int, int], Any] = _device_block,
                 pinned_block: Callable[[int], np.ndarray] = _pinned_block,
                 event_pair: Callable[[], list] = _event_pair) -> None:
        self._device_block, self._pinned_block = device_block, pinned_block
        self._event_pair = event_pair
        self._blocks: dict[tuple[int, str], Any] = {}
        self._pinned: dict[int, np.ndarray] = {}
        self._events: dict[int, list] = {}

    def device(self, device: int, purpose: str, dtype: Any, count: int) -> Any:
        """`count` elements of `dtype` of device scratch on `device` for `purpose`."""
        nbytes = count * np.dtype(dtype).itemsize
        block = self._blocks.get((device, purpose))
        if block is None or block.nbytes < nbytes:
            block = self._blocks[(device, purpose)] = self._device_block(device, max(nbytes, 64))
        return block[:nbytes].view(dtype)

    def pinned(self, device: int, nbytes: int) -> np.ndarray:
        """`nbytes` of pinned host memory for staging `device`'s buffers."""
        block = self._pinned.get(device)
        if block is None or block.nbytes < nbytes:
            block = self._pinned[device] = self._pinned_block(nbytes)
        return block[:nbytes]

    def events(self, device: int) -> list:
        """The two staging slots' events for `device`."""
        pair = self._events.get(device)
        if pair is None:
            pair = self._events[device] = self._event_pair()
        return pair

    def held_bytes(self) -> int:
        """Bytes of device and pinned memory held now."""
        return sum(b.nbytes for b in self._blocks.values()) + \
            sum(b.nbytes for b in self._pinned.values())

    def free(self) -> None:
        """Drop every block and event (the set is closing; no reduction of its is running)."""
        self._blocks.clear()
        self._pinned.clear()
        self._events.clear()
