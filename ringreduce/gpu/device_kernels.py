"""Our CUDA kernels: the sources in cuda_kernels/*.cu (package data, compiled at run time by
CuPy's NVRTC and cached on disk, so installing needs no CUDA toolkit), scaling and reducing
device arrays as the CPU kernels do (a ring's step; every rank's block on the node at once,
`reduce_from_peers`), and the one-launch copies between a bucket's gradients and its buffer
(`pack`, `unpack`)."""
from __future__ import annotations

import functools
from importlib import resources
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..core.errors import RingReduceError
from ..kernels.ops import ReduceOp
from .cuda import cupy_module, cupy_stream, on_device, our_stream

# The CUDA sources the GPU path compiles: cuda_kernels/<name>.cu inside the package (package
# data, so a wheel ships them), each loaded by kernel_source() only.
KERNEL_DIR = "cuda_kernels"
KERNEL_MODULES = ("reduce", "batched_copy")
THREADS = 256
MAX_BLOCKS = 4096
MAX_ROWS = 65535                # CUDA's limit on gridDim.y: tensors per batched copy
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_PEER = {torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
         torch.int64: "i64", torch.float32: "f32", torch.float64: "f64", **_HALF}
_UFUNC = {ReduceOp.Sum: "add", ReduceOp.Average: "add", ReduceOp.Min: "minimum",
          ReduceOp.Max: "maximum", ReduceOp.Product: "multiply"}


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


def kernel(module: str, function: str) -> Any:
    return _module(module).get_function(function)


def launch(function: Any, elements: int, args: tuple, rows: int = 1) -> None:
    """Launch a grid-stride kernel over `elements` on CuPy's current stream."""
    blocks = min(max(1, -(-elements // THREADS)), MAX_BLOCKS)
    function((blocks, rows), (THREADS,), args)


def scale(array: Any, dtype: torch.dtype, factor: float) -> None:
    """array *= factor in place, as Horovod scales and our CPU kernels do (kernels/ops.finish):
    float32 and float64 times the factor cast to their dtype, the 16-bit floats in float32
    times float32(factor), rounded once; integers in float64, truncated toward zero (factor 1
    is free)."""
    if factor == 1.0 or array.size == 0:
        return
    if dtype in _HALF:
        launch(kernel("reduce", f"{_HALF[dtype]}_scale"), array.size,
               (array, np.int64(array.size), np.float32(factor)))
    elif dtype.is_floating_point:
        cupy_module().multiply(array, array.dtype.type(factor), out=array)
    else:
        array[...] = (array.astype(np.float64) * factor).astype(np.int64)


def finish(part: Any, dtype: torch.dtype, op: ReduceOp, ranks: int, postscale: float) -> None:
    """The owner's last touch on a reduced chunk: Average and postscale fused into one
    multiply by postscale/ranks (in float64, as Horovod computes the factor)."""
    scale(part, dtype, postscale / ranks if op == ReduceOp.Average else postscale)


def device_reducer(dtype: torch.dtype, op: ReduceOp,
                   stream: torch.cuda.Stream) -> Callable[[Any, Any], None]:
    """`target = target op source` on the GPU, finished before it returns: ring.py reuses the
    source slot and sends the target right after."""
    if dtype in _HALF:
        function = kernel("reduce", f"{_HALF[dtype]}_reduce")

        def combine(target: Any, source: Any) -> None:
            launch(function, target.size, (target, source, np.int64(target.size), np.int32(op)))
    else:
        ufunc = getattr(cupy_module(), _UFUNC[op])

        def combine(target: Any, source: Any) -> None:
            ufunc(target, source, out=target)

    def reduce(target: Any, source: Any) -> None:
        combine(target, source)
        stream.synchronize()

    return reduce


def reduce_from_peers(table: Any, ranks: int, offset: int, out: int, count: int,
                      dtype: torch.dtype, op: ReduceOp) -> None:
    """On CuPy's current stream: `count` elements at address `out` = elements `offset` on of
    each rank's block reduced in rank order (`table`: a device array of the blocks' addresses,
    uint64), each step rounded as the CPU's node way rounds it."""
    if count:
        launch(kernel("reduce", f"peer_reduce_{_PEER[dtype]}"), count,
               (table, np.int32(ranks), np.int64(offset), np.uint64(out), np.int64(count),
                np.int32(op)))


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
    if moves is not None and _batched_copy(moves, our_stream(device.index)):
        our_stream(device.index).synchronize()
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
    with on_device(stream.device.index), cupy_stream(stream):
        # (the module loads on the current device: this one, not the thread's)
        function = kernel("batched_copy", f"batched_copy_{moves[0][0].element_size()}")
        rows = cp.asarray(table)
        launch(function, max(s.numel() for s, _ in moves), (rows[0], rows[1], rows[2]),
                rows=len(moves))
    return True
