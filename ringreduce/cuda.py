"""The GPU side of the transport: CuPy views of CUDA tensors, streams, the pinned staging
pipeline, the set's device scratch, and our kernels from the package's cuda_kernels/*.cu
(compiled at run time by CuPy, cached). Whether MPI reads device memory: cuda_aware.py.

CuPy is imported only when a CUDA tensor shows up, so `import ringreduce` works without it.

The transport's table (ways.py) holds one of two GPU ways, by `RINGREDUCE_CUDA_AWARE` (detected
at init() by default):
- CUDA-aware MPI: ring.py runs on the CuPy arrays themselves; MPI reads device memory and the
  reductions run on the GPU.
- Otherwise: the buffer travels through two pinned host slots piece by piece; each piece is
  reduced by the host way the transport hands in (shared memory within a node, the ring over
  MPI between nodes) while the next piece is copied down and the previous one copied back.
Either way our work runs on our own stream, which first waits for an event on torch's stream,
and a reduction returns only once its result is in device memory, so any stream may read it.
The device scratch, pinned slots and events a reduction uses belong to its process set
(`DeviceScratch`, one per transport), so sets that reduce at once on one device share none.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from importlib import resources
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from . import ring
from .errors import RingReduceError
from .kernels import ReduceOp

# The CUDA sources the GPU path compiles: cuda_kernels/<name>.cu inside the package (package
# data, so a wheel ships them), each loaded by kernel_source() only.
KERNEL_DIR = "cuda_kernels"
KERNEL_MODULES = ("half", "batched_copy")
STAGING_PIECE_BYTES = 4 << 20   # one piece of the staging pipeline; the same on every rank
THREADS = 256
MAX_BLOCKS = 4096
MAX_ROWS = 65535                # CUDA's limit on gridDim.y: tensors per batched copy
REDUCTIONS = ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_")
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_UFUNC = {ReduceOp.Sum: "add", ReduceOp.Average: "add", ReduceOp.Min: "minimum",
          ReduceOp.Max: "maximum", ReduceOp.Product: "multiply"}


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


def device_tensor(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor collective `what` works on for a CUDA `tensor`.

    Reductions run in the tensor's own device memory, whichever device is current (as
    Horovod's and NCCL's: `model.to(local_rank)` without `set_device` works): every view,
    stream, event and scratch block is taken on `tensor.device`. The other collectives
    (allgather, broadcast, alltoall, reducescatter) work on a host copy made here, on the
    caller's thread after what its stream has queued; collective_work moves their results
    back to the tensor's device, as Horovod returns them.
    """
    if what not in REDUCTIONS:
        return tensor.detach().cpu()
    cupy_module()
    return tensor.detach()      # (contiguous: collective_work checked it)


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
def _stream(device: int) -> torch.cuda.Stream:
    """Our stream on `device`, made once: our copies and kernels never queue behind training."""
    return torch.cuda.Stream(device=device)


def _cupy_stream(stream: torch.cuda.Stream) -> Any:
    """CuPy's handle on a torch stream, so CuPy's kernels queue on it (CuPy 14 spells it
    Stream.from_external, earlier versions ExternalStream)."""
    cp = cupy_module()
    if hasattr(cp.cuda.Stream, "from_external"):
        try:
            return cp.cuda.Stream.from_external(stream)
        except TypeError:       # a torch stream without __cuda_stream__ (older torch)
            pass
    return cp.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def pack(bucket: Any) -> torch.cuda.Event:
    """Copy a bucket's gradients into its buffer in one launch on torch's current stream (where
    backward produced them) and return the event the reduction waits for."""
    stream = torch.cuda.current_stream(bucket.buffer.device)
    moves = _moves(bucket, to_buffer=True)
    if moves is None or not _batched_copy(moves, stream):
        bucket.pack()
    return stream.record_event()


def unpack(bucket: Any) -> None:
    """Copy the reduced buffer back into the gradients, in one launch where it can, and wait
    for it: the gradients are complete when the optimizer's synchronize() returns."""
    device = bucket.buffer.device
    moves = _moves(bucket, to_buffer=False)
    if moves is not None and _batched_copy(moves, _stream(device.index)):
        _stream(device.index).synchronize()
    else:   # missing gradients are allocated, so on torch's stream like any tensor of theirs
        bucket.unpack()
        torch.cuda.current_stream(device).synchronize()


def _moves(bucket: Any, to_buffer: bool) -> Optional[list[tuple[Any, Any]]]:
    """The (source, target) pairs between a bucket's gradients and their views in its buffer,
    but for gradients that are the views already; None where a gradient is sparse (the bucket
    holds zeros for it, as Bucket.pack and unpack do)."""
    pairs = []
    for p, view in zip(bucket.params, bucket.views):
        grad = p.grad
        if grad is not None and grad.layout != torch.strided:
            return None
        if grad is None or grad.data_ptr() != view.data_ptr():
            pairs.append((grad, view) if to_buffer else (view, grad))
    return pairs


def _batched_copy(moves: Sequence[tuple[Any, Any]], stream: torch.cuda.Stream) -> bool:
    """Copy every (source, target) tensor pair in one launch on `stream`; False, copying
    nothing, when some pair does not qualify (a missing tensor, a cast, a strided source)."""
    if not moves:
        return True
    if len(moves) > MAX_ROWS or any(
            s is None or t is None or s.dtype != t.dtype or not s.is_contiguous()
            or not t.is_contiguous() for s, t in moves):
        return False
    cp = cupy_module()
    table = np.array([[s.data_ptr() for s, _ in moves], [t.data_ptr() for _, t in moves],
                      [s.numel() for s, _ in moves]], dtype=np.int64)
    with on_device(stream.device.index), _cupy_stream(stream):
        # (the module loads on the current device: this one, not the thread's)
        kernel = _kernel("batched_copy", f"batched_copy_{moves[0][0].element_size()}")
        rows = cp.asarray(table)
        _launch(kernel, max(s.numel() for s, _ in moves), (rows[0], rows[1], rows[2]),
                rows=len(moves))
    return True


# ---------------------------------------------------------------- kernels

def kernel_source(name: str) -> str:
    """The text of the CUDA source cuda_kernels/<name>.cu, read from the installed package (for
    an editable install, the source tree's ringreduce/); the one place that loads kernel text."""
    if name not in KERNEL_MODULES:
        raise ValueError(f"ringreduce: {name!r} is not one of ringreduce's CUDA kernel modules "
                         f"{KERNEL_MODULES}")
    source = resources.files(__package__).joinpath(KERNEL_DIR).joinpath(f"{name}.cu")
    if not source.is_file():
        raise RingReduceError(
            f"ringreduce: the GPU kernel source {KERNEL_DIR}/{name}.cu is missing from the "
            f"installed package ({source}): this installation of ringreduce is incomplete or "
            f"broken (the wheel or sdist it came from lacks the package data ringreduce/"
            f"{KERNEL_DIR}/*.cu). Reinstall it from the same source: pip install "
            "--force-reinstall --no-deps <the wheel, sdist or clone>")
    return source.read_text(encoding="utf-8")


def kernel_options() -> tuple[str, ...]:
    """NVRTC's options for every kernel: the op codes of native/constants.h as -D definitions,
    taken from ReduceOp (the values the C extension was built with), so no header ships."""
    return tuple(f"-DRR_OP_{op.name.upper()}={int(op)}" for op in ReduceOp)


@functools.lru_cache(maxsize=None)
def _module(name: str) -> Any:
    """cuda_kernels/<name>.cu as a CuPy module; CuPy compiles it on first use and caches the
    binary on disk, so later runs load it without compiling."""
    return cupy_module().RawModule(code=kernel_source(name), options=kernel_options())


def _kernel(module: str, function: str) -> Any:
    return _module(module).get_function(function)


def _launch(kernel: Any, elements: int, args: tuple, rows: int = 1) -> None:
    """Launch a grid-stride kernel over `elements` on CuPy's current stream."""
    blocks = min(max(1, -(-elements // THREADS)), MAX_BLOCKS)
    kernel((blocks, rows), (THREADS,), args)


def _scale(array: Any, dtype: torch.dtype, factor: float) -> None:
    """array *= factor in place, as Horovod scales and our CPU kernels do (kernels.finish):
    float32 and float64 times the factor cast to their dtype, the 16-bit floats in float32
    times float32(factor), rounded once; integers in float64, truncated toward zero (factor 1
    is free)."""
    if factor == 1.0 or array.size == 0:
        return
    if dtype in _HALF:
        _launch(_kernel("half", f"{_HALF[dtype]}_scale"), array.size,
                (array, np.int64(array.size), np.float32(factor)))
    elif dtype.is_floating_point:
        cupy_module().multiply(array, array.dtype.type(factor), out=array)
    else:
        array[...] = (array.astype(np.float64) * factor).astype(np.int64)


def _finish(part: Any, dtype: torch.dtype, op: ReduceOp, ranks: int, postscale: float) -> None:
    """The owner's last touch on a reduced chunk: Average and postscale fused into one
    multiply by postscale/ranks (in float64, as Horovod computes the factor)."""
    _scale(part, dtype, postscale / ranks if op == ReduceOp.Average else postscale)


def _device_reducer(dtype: torch.dtype, op: ReduceOp,
                    stream: torch.cuda.Stream) -> Callable[[Any, Any], None]:
    """`target = target op source` on the GPU, finished before it returns: ring.py reuses the
    source slot and sends the target right after."""
    if dtype in _HALF:
        kernel = _kernel("half", f"{_HALF[dtype]}_reduce")

        def launch(target: Any, source: Any) -> None:
            _launch(kernel, target.size, (target, source, np.int64(target.size), np.int32(op)))
    else:
        ufunc = getattr(cupy_module(), _UFUNC[op])

        def launch(target: Any, source: Any) -> None:
            ufunc(target, source, out=target)

    def reduce(target: Any, source: Any) -> None:
        launch(target, source)
        stream.synchronize()

    return reduce


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


# ---------------------------------------------------------------- the staging pipeline

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


# ---------------------------------------------------------------- allreduce on the device
# The transport's two GPU ways (ways.py): each allreduces a flat CuPy array in place over
# `comm`, with scratch, pinned slots and events from `scratch`, the set's own.

@contextlib.contextmanager
def _on_our_stream(array: Any) -> Iterator[torch.cuda.Stream]:
    """Our stream on the array's device, CuPy queuing on it, started after the event set by
    `after`, or else after torch's current stream of this thread."""
    device = array.device.id
    stream = _stream(device)
    ready = getattr(_ready, "event", None)
    stream.wait_event(ready if ready is not None
                      else torch.cuda.current_stream(device).record_event())
    with on_device(device), _cupy_stream(stream):
        yield stream


def reduce_in_device_memory(array: Any, dtype: torch.dtype, op: ReduceOp, prescale: float,
                            postscale: float, comm: Any, small_bytes: int, segment_bytes: int,
                            scratch: DeviceScratch, wait: ring.Wait) -> None:
    """CUDA-aware MPI (or a set of one): the same ring as on the CPU (the gather up to
    `small_bytes`), on device memory, reducing on the GPU; returns with the result there.
    `wait` waits for one MPI request (the stall watch's)."""
    with _on_our_stream(array) as stream:
        _scale(array, dtype, prescale)

        def finish(part: Any) -> None:
            _finish(part, dtype, op, comm.size, postscale)
            stream.synchronize()   # the allgather sends it next

        stream.synchronize()       # MPI reads device memory: our queued work must be done
        if comm.size == 1 or array.size == 0:
            finish(array)
            return
        reduce = _device_reducer(dtype, op, stream)
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
                  scratch: DeviceScratch) -> None:
    """MPI without CUDA support: piece by piece through pinned host memory, each piece reduced
    by `host` (which prescales, divides and postscales itself); returns with the result back
    in device memory."""
    with _on_our_stream(array) as stream:
        device = array.device.id
        piece = max(1, STAGING_PIECE_BYTES // array.itemsize)
        slots = scratch.pinned(device, 2 * piece * array.itemsize).view(array.dtype)
        staged_allreduce(DeviceCopies(array, slots.reshape(2, piece), stream,
                                      scratch.events(device)), array.size, piece, host)
