"""The public tensor collectives, with Horovod's names and semantics, on top of the engine.

Every collective validates its input on the caller's thread (so a local mistake raises on the
rank that made it, before any MPI traffic), then hands the engine a piece of work that first
checks the signature across ranks (`Negotiator.check`) and then moves the data. Results are
written to the caller's tensor only after the collective succeeded.
"""
from __future__ import annotations

import functools
import itertools
import math
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from . import negotiation, ring
from .buffers import SUPPORTED, as_array, fresh
from .compression import Compression, Compressor
from .engine import Engine, Handle
from .kernels import (ReduceOp, combiner, divide, finishing_combiner, node_kind, reducer,
                      scale)
from .world import world

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)
_unnamed = itertools.count()
_SUPPORTED_SET = frozenset(SUPPORTED)
_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in SUPPORTED}
Work = tuple[str, Callable[[], Any]]  # a collective's name and the function the engine runs


# ---------------------------------------------------------------- argument checks

def _name(name: Optional[str], kind: str) -> str:
    """Auto names count per process; ranks that call in the same order agree on them."""
    return name if name is not None else f"{kind}.noname.{next(_unnamed)}"


def _tensor(tensor: Any, what: str, name: str) -> torch.Tensor:
    """The dense, contiguous CPU tensor to work on, or a clear error naming tensor and rank."""
    if (tensor.__class__ is torch.Tensor and tensor.layout is torch.strided
            and tensor.dtype in _SUPPORTED_SET and tensor.device.type == "cpu"):
        return tensor.detach().contiguous()     # the common case, checked cheaply
    rank = world(f"{what}()").comm.rank
    where = f"ringreduce: {what} of tensor '{name}' on rank {rank}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{where}: sparse tensors ({tensor.layout}) are not supported; call "
                        ".to_dense() first, or use DistributedOptimizer(sparse_as_dense=True)")
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED)
        raise TypeError(f"{where}: dtype {tensor.dtype} is not supported (supported: {names})"
                        + ("; cast booleans to uint8" if tensor.dtype == torch.bool else ""))
    if tensor.device.type == "cuda":
        from . import cuda   # GPU hook; imported here because cuda.py imports this module

        return cuda.device_tensor(tensor, what, where)
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; ringreduce reduces CPU and "
                         "CUDA tensors")
    return tensor.detach().contiguous()


def _op(op: Any, average: Optional[bool], what: str) -> ReduceOp:
    if average is not None:
        warnings.warn("ringreduce: average= is deprecated; use op=ringreduce.Average or "
                      "op=ringreduce.Sum", DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError(f"ringreduce: {what}: pass op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if op.__class__ is ReduceOp and op != Adasum:
        return op
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"ringreduce: {what}: unknown op {op!r}; use ringreduce.Sum, Average, "
                         "Min, Max or Product") from None
    if op == Adasum:
        raise ValueError(f"ringreduce: {what}: Adasum is not supported; use Sum or Average")
    return op


def _check_scaling(tensor: torch.Tensor, pre: float, post: float, what: str, name: str) -> None:
    if not tensor.dtype.is_floating_point and (pre != 1.0 or post != 1.0):
        raise TypeError(f"ringreduce: {what} of tensor '{name}' on rank {world().comm.rank}: "
                        f"prescale/postscale factors need a floating tensor, not {tensor.dtype}")


def _root(root_rank: int, what: str, name: str) -> int:
    comm = world(f"{what}()").comm
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < comm.size:
        raise ValueError(f"ringreduce: {what} of tensor '{name}' on rank {comm.rank}: root_rank "
                         f"{root_rank!r} is not a rank of this job (0..{comm.size - 1})")
    return int(root_rank)


def _differentiable(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _describe(t: torch.Tensor) -> tuple:
    return (_DTYPE_NAMES[t.dtype], tuple(t.shape))


# ---------------------------------------------------------------- allreduce

@functools.lru_cache(maxsize=None)
def _finisher(dtype: torch.dtype, op: ReduceOp, size: int,
              postscale: float) -> Optional[Callable[[np.ndarray], None]]:
    """What happens to each finished chunk: the division of Average, then the postscale."""
    if op != Average and postscale == 1.0:
        return None

    def finish(part: np.ndarray) -> None:
        if op == Average:
            divide(part, dtype, size)
        scale(part, dtype, postscale)

    return finish


def reduce_flat(engine: Engine, array: np.ndarray, dtype: torch.dtype, op: ReduceOp,
                prescale: float = 1.0, postscale: float = 1.0) -> None:
    """Allreduce one flat array in place over MPI (no signature check): the small-message path
    up to `small_message_bytes`, the segmented ring above it."""
    if hasattr(array, "__cuda_array_interface__"):   # GPU hook: a CuPy array
        from . import cuda

        return cuda.reduce_device(engine, array, dtype, op, prescale, postscale)
    comm = engine.comm
    scale(array, dtype, prescale)
    finish = _finisher(dtype, op, comm.size, postscale)
    if comm.size == 1 or array.size == 0:
        if finish is not None:
            finish(array)
        return
    kernel = reducer(dtype, op)
    if array.nbytes <= engine.settings["small_message_bytes"]:
        gathered = engine.scratch.get("gather", array.dtype, comm.size * array.size)
        ring.gather_allreduce(comm, array, kernel, gathered.reshape(comm.size, -1), finish)
        return
    segment = max(1, engine.settings["segment_bytes"] // array.itemsize)
    bounds = ring.chunk_bounds(ring.balanced_counts(array.size, comm.size))
    scratch = engine.scratch.get("ring", array.dtype, ring.scratch_elements(bounds, segment))
    ring.reduce_scatter(comm, array, bounds, kernel, scratch, segment)
    lo, hi = bounds[comm.rank]
    if finish is not None:
        finish(array[lo:hi])
    ring.allgather(comm, array, bounds)


def allreduce_flat(engine: Engine, src: np.ndarray, dst: np.ndarray, dtype: torch.dtype,
                   op: ReduceOp, prescale: float = 1.0, postscale: float = 1.0,
                   signature: Optional[dict] = None, digest: Optional[int] = None) -> None:
    """Check `signature` across ranks (None: checked already), then allreduce the flat array
    `src` into `dst` (which may be `src`). Ranks that share a node reduce through shared
    memory, the signature check riding on the first exchange (in C for the common dtypes and
    ops); otherwise the signature goes first and the ring over MPI runs in place in `dst`."""
    node = engine.node
    if signature is not None and digest is None:
        digest = negotiation.digest(signature)
    if node is None or not isinstance(dst, np.ndarray):
        if signature is not None:
            engine.negotiator.check(signature, precomputed=digest)
        if dst is not src:
            dst[...] = src
        reduce_flat(engine, dst, dtype, op, prescale, postscale)
        return
    if node.cross.size > 1 and signature is not None:   # node-local headers see one node only
        engine.negotiator.check(signature, precomputed=digest)
    if prescale != 1.0:
        if dst is not src:
            dst[...] = src
        scale(dst, dtype, prescale)
        src = dst
    finish = _finisher(dtype, op, engine.comm.size, postscale)
    combine = combiner(dtype, op)
    # One node: the owner's last step can also divide and scale, saving a pass over its chunk.
    last = finishing_combiner(dtype, op, engine.comm.size, postscale) \
        if finish is not None and node.cross.size == 1 else None
    sig = signature or {}

    def label() -> str:
        return negotiation.label(sig) if sig else "allreduce"

    def signatures() -> list:
        return engine.comm.allgather(dict(sig))

    kind = node_kind(dtype, op, postscale) if node.native else None
    one_node = node.cross.size == 1
    if kind is not None and node.fits_small(src.nbytes) and one_node:
        node.native_small_allreduce(src.ctypes.data, dst.ctypes.data, src.nbytes, src.size, kind,
                                    _divisor(op, engine), postscale, digest or 0, label,
                                    signatures)
    elif kind is not None and not node.fits_small(src.nbytes):
        def between_nodes(first: int, count: int) -> None:
            node.ring_between_nodes(dst[first:first + count], combine, finish)

        node.native_large_allreduce(
            src.ctypes.data, dst.ctypes.data, src.size, kind,
            _divisor(op, engine) if one_node else 1.0, postscale if one_node else 1.0,
            digest or 0, label, signatures, None if one_node else between_nodes)
    elif node.fits_small(src.nbytes):
        node.small_allreduce(src, dst, combine, finish, digest or 0, label, signatures, last)
    else:
        name = str(sig.get("name", "allreduce"))
        node.large_allreduce(src, dst, combine, finish, digest or 0, label, signatures,
                             lambda phase: engine.span(name, phase), last)


def _divisor(op: ReduceOp, engine: Engine) -> float:
    return float(engine.comm.size) if op == Average else 1.0


def _small_allreduce(tensor: Any, name: Optional[str], op: Any, postscale: float,
                     in_place: bool) -> Optional[torch.Tensor]:
    """The most frequent latency-bound call, a small synchronous allreduce of a plain CPU
    tensor with ranks on one node, in a few checks and one C exchange (native/node.c); None
    when the call is not that case (or the engine is busy), and the general path takes it.
    Same name counter, signature digest and bits as the general path, which a peer may take
    for the same collective."""
    kind = "allreduce_" if in_place else "allreduce"
    engine = world(f"{kind}()").engine
    node = engine.node
    op = Average if op is None else op
    if (node is None or not node.native or node.cross.size > 1
            or tensor.__class__ is not torch.Tensor
            or op.__class__ is not ReduceOp or tensor.layout is not torch.strided
            or not tensor.is_cpu or not tensor.is_contiguous()
            or tensor.nbytes > node.small_bytes):
        return None
    code = node_kind(tensor.dtype, op, postscale)
    if code is None or not engine.claim_idle():
        return None
    try:
        name = _name(name, kind)
        dtype, shape, op_name = _DTYPE_NAMES[tensor.dtype], tensor.shape, op.name
        digest = negotiation.allreduce_digest(name, op_name, dtype, shape, 1.0, postscale)
        out = tensor if in_place else torch.empty_like(tensor)

        def signature() -> dict:    # the general path's, built only for a report
            return {"collective": "allreduce", "name": name, "op": op_name, "prescale": 1.0,
                    "postscale": postscale, "dtype": dtype, "shape": tuple(shape)}

        node.native_small_allreduce(
            tensor.data_ptr(), out.data_ptr(), tensor.nbytes, tensor.numel(), code,
            _divisor(op, engine), postscale, digest,
            lambda: negotiation.label(signature()), lambda: engine.comm.allgather(signature()))
    finally:
        engine.release_idle()
    return out


def _reduce_fused(engine: Engine, tensors: Sequence[torch.Tensor], op: ReduceOp,
                  prescale: float, postscale: float, signature: dict) -> list[torch.Tensor]:
    """Several tensors: one fused buffer per dtype, reduced in place; returns views of it."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    results: list[Any] = [None] * len(tensors)
    for dtype, members in by_dtype.items():
        fused = torch.cat([tensors[i].reshape(-1) for i in members])
        array = as_array(fused)
        allreduce_flat(engine, array, array, dtype, op, prescale, postscale, signature)
        signature = None            # checked with the first group
        for i, part in zip(members, fused.split([tensors[i].numel() for i in members])):
            results[i] = part.view_as(tensors[i])
    return results


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.is_contiguous() and b.is_contiguous()


def _grouped_allreduce_work(tensors: Sequence[torch.Tensor], name: Optional[str], op: Any,
                             average: Optional[bool], prescale: float, postscale: float,
                             compression: type[Compressor], in_place: bool,
                             kind: str) -> Work:
    engine = world(f"{kind}()").engine
    op = _op(op, average, kind)
    name = _name(name, kind)
    checked = [_tensor(t, kind, f"{name}[{i}]" if len(tensors) > 1 else name)
               for i, t in enumerate(tensors)]
    for i, t in enumerate(checked):
        _check_scaling(t, prescale, postscale, kind, name)
    wires, contexts = zip(*(compression.compress(t) for t in checked)) if checked else ((), ())
    signature = {"collective": "allreduce", "name": name, "op": op.name,
                 "prescale": prescale, "postscale": postscale}
    if len(wires) == 1:
        signature["dtype"], signature["shape"] = _describe(wires[0])
    else:
        signature["tensors (dtype, shape)"] = tuple(_describe(t) for t in wires)

    def work() -> list[torch.Tensor]:
        if len(wires) == 1 and contexts[0] is None:     # straight from input to output
            out = tensors[0] if in_place and _same_memory(wires[0], tensors[0]) \
                else fresh(wires[0].shape, wires[0].dtype, wires[0].device)
            allreduce_flat(engine, as_array(wires[0]), as_array(out), wires[0].dtype, op,
                           prescale, postscale, signature)
            results = [out]
        else:
            results = _reduce_fused(engine, wires, op, prescale, postscale, signature)
            results = [compression.decompress(r, ctx).view_as(t)
                       for r, ctx, t in zip(results, contexts, checked)]
        if not in_place:
            return results
        with torch.no_grad():   # parameters are leaves that require grad
            for original, result in zip(tensors, results):
                if result is not original:
                    original.copy_(result)
        return list(tensors)

    return name, work


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    compression: type[Compressor] = Compression.none) -> Handle:
    """Start an allreduce of `tensor`; `synchronize(handle)` returns a new reduced tensor."""
    return _submit(_allreduce_work(tensor, average, name, op, prescale_factor, postscale_factor,
                                   compression, False))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> Handle:
    """Start an in-place allreduce; `tensor` is overwritten when the handle completes."""
    return _submit(_allreduce_work(tensor, average, name, op, prescale_factor, postscale_factor,
                                   Compression.none, True))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return the result (differentiable)."""
    if _differentiable(tensor):
        return _AllreduceFunction.apply(tensor, average, name, compression, op,
                                        prescale_factor, postscale_factor)
    if average is None and compression is Compression.none and prescale_factor == 1.0:
        out = _small_allreduce(tensor, name, op, postscale_factor, False)
        if out is not None:
            return out
    return _run(_allreduce_work(tensor, average, name, op, prescale_factor, postscale_factor,
                                compression, False))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over all ranks in place and return it."""
    if average is None and prescale_factor == 1.0:
        out = _small_allreduce(tensor, name, op, postscale_factor, True)
        if out is not None:
            return out
    return _run(_allreduce_work(tensor, average, name, op, prescale_factor, postscale_factor,
                                Compression.none, True))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            compression: type[Compressor] = Compression.none) -> Handle:
    """Start one fused allreduce of several tensors; the handle yields a list of results."""
    return _submit(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                           postscale_factor, compression, False,
                                           "grouped_allreduce"))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> Handle:
    return _submit(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                           postscale_factor, Compression.none, True,
                                           "grouped_allreduce_"))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return _run(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                        postscale_factor, compression, False,
                                        "grouped_allreduce"))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return _run(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                        postscale_factor, Compression.none, True,
                                        "grouped_allreduce_"))


# ---------------------------------------------------------------- allgather, broadcast, ...

def _allgather_work(tensor: torch.Tensor, name: Optional[str]) -> Work:
    name = _name(name, "allgather")
    t = _tensor(tensor, "allgather", name)
    t = t.reshape(1) if t.dim() == 0 else t
    engine = world().engine
    signature = {"collective": "allgather", "name": name, "dtype": _describe(t)[0],
                 "trailing shape": tuple(t.shape[1:])}

    def work() -> torch.Tensor:
        firsts = engine.negotiator.check(signature, per_rank=t.shape[0])
        out = fresh((int(firsts.sum()), *t.shape[1:]), t.dtype, t.device)
        row = math.prod(t.shape[1:])
        engine.comm.Allgatherv(as_array(t), [as_array(out), (firsts * row).tolist()])
        return out

    return name, work


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0 (sizes may differ there)."""
    return _submit(_allgather_work(tensor, name))


def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0 (differentiable)."""
    if _differentiable(tensor):
        return _AllgatherFunction.apply(tensor, name)
    return _run(_allgather_work(tensor, name))


def _broadcast_work(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                    in_place: bool, kind: str) -> Work:
    name = _name(name, kind)
    t = _tensor(tensor, kind, name)
    root = _root(root_rank, kind, name)
    engine = world().engine
    dtype, shape = _describe(t)
    signature = {"collective": "broadcast", "name": name, "root_rank": root, "dtype": dtype,
                 "shape": shape}

    def work() -> torch.Tensor:
        engine.negotiator.check(signature)
        # In place, straight into `t`, the caller's memory or our own copy of it: the signatures
        # agree, and an MPI failure from here on ends the job; a temporary would cost
        # broadcast_parameters the model's size again (kept by the engine thread's arena).
        out = t if engine.comm.rank == root or in_place else torch.empty_like(t)
        engine.comm.Bcast(as_array(out), root=root)
        if in_place:
            if not _same_memory(out, tensor):
                with torch.no_grad():
                    tensor.copy_(out)
            return tensor
        return out.clone() if _same_memory(out, tensor) else out

    return name, work


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    return _submit(_broadcast_work(tensor, root_rank, name, False, "broadcast"))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    return _submit(_broadcast_work(tensor, root_rank, name, True, "broadcast_"))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Return root_rank's `tensor` on every rank (differentiable)."""
    if _differentiable(tensor):
        return _BroadcastFunction.apply(tensor, root_rank, name)
    return _run(_broadcast_work(tensor, root_rank, name, False, "broadcast"))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's values, in place, and return it."""
    return _run(_broadcast_work(tensor, root_rank, name, True, "broadcast_"))


def _alltoall_work(tensor: torch.Tensor, splits: Any, name: Optional[str]) -> Work:
    name = _name(name, "alltoall")
    t = _tensor(tensor, "alltoall", name)
    comm = world().comm
    where = f"ringreduce: alltoall of tensor '{name}' on rank {comm.rank}"
    if t.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension")
    if splits is None:
        if t.shape[0] % comm.size:
            raise ValueError(f"{where}: dimension 0 ({t.shape[0]}) does not divide by the "
                             f"{comm.size} ranks; pass splits=")
        send_splits = np.full(comm.size, t.shape[0] // comm.size, dtype=np.int64)
    else:
        send_splits = np.asarray(splits.tolist() if isinstance(splits, torch.Tensor) else splits,
                                 dtype=np.int64).reshape(-1)
        if send_splits.size != comm.size or (send_splits < 0).any() or \
                send_splits.sum() != t.shape[0]:
            raise ValueError(f"{where}: splits {send_splits.tolist()} must be {comm.size} "
                             f"non-negative counts summing to dimension 0 ({t.shape[0]})")
    engine = world().engine
    signature = {"collective": "alltoall", "name": name, "dtype": _describe(t)[0],
                 "trailing shape": tuple(t.shape[1:])}

    def work() -> Any:
        engine.negotiator.check(signature)
        recv_splits = np.empty(comm.size, dtype=np.int64)
        engine.comm.Alltoall(send_splits, recv_splits)
        out = fresh((int(recv_splits.sum()), *t.shape[1:]), t.dtype, t.device)
        row = math.prod(t.shape[1:])
        engine.comm.Alltoallv([as_array(t), (send_splits * row).tolist()],
                              [as_array(out), (recv_splits * row).tolist()])
        return out if splits is None else (out, torch.from_numpy(recv_splits).to(torch.int32))

    return name, work


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> Handle:
    """Start an all-to-all: rows splits[i] go to rank i; rows from every rank come back in rank
    order. Without splits, dimension 0 is divided equally."""
    return _submit(_alltoall_work(tensor, splits, name))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> Any:
    """All-to-all; returns the output, and the received splits too when `splits` is given."""
    return _run(_alltoall_work(tensor, splits, name))


def _reducescatter_work(tensor: torch.Tensor, name: Optional[str], op: Any,
                        prescale_factor: float, postscale_factor: float) -> Work:
    name = _name(name, "reducescatter")
    t = _tensor(tensor, "reducescatter", name)
    op = _op(op, None, "reducescatter")
    _check_scaling(t, prescale_factor, postscale_factor, "reducescatter", name)
    engine = world().engine
    comm = engine.comm
    if t.dim() == 0:
        raise ValueError(f"ringreduce: reducescatter of tensor '{name}' on rank {comm.rank}: "
                         "needs a tensor with at least one dimension")
    work_tensor = t.clone()
    dtype, shape = _describe(t)
    signature = {"collective": "reducescatter", "name": name, "op": op.name, "dtype": dtype,
                 "shape": shape, "prescale": prescale_factor, "postscale": postscale_factor}

    def work() -> torch.Tensor:
        engine.negotiator.check(signature)
        rows = ring.balanced_counts(t.shape[0], comm.size)
        row = math.prod(t.shape[1:])
        bounds = ring.chunk_bounds([r * row for r in rows])
        array = as_array(work_tensor)
        scale(array, t.dtype, prescale_factor)
        if comm.size > 1:
            segment = max(1, engine.settings["segment_bytes"] // array.itemsize)
            scratch = engine.scratch.get("ring", array.dtype,
                                         ring.scratch_elements(bounds, segment))
            ring.reduce_scatter(comm, array, bounds, reducer(t.dtype, op), scratch, segment)
        lo, hi = bounds[comm.rank]
        if op == Average:
            divide(array[lo:hi], t.dtype, comm.size)
        scale(array[lo:hi], t.dtype, postscale_factor)
        start = sum(rows[:comm.rank])
        return work_tensor[start:start + rows[comm.rank]].clone()

    return name, work


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reduce-scatter: reduce over ranks, and rank r keeps the r-th block of rows
    (dimension 0 divided as evenly as possible, lower ranks getting the extra rows)."""
    return _submit(_reducescatter_work(tensor, name, op, prescale_factor, postscale_factor))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    return _run(_reducescatter_work(tensor, name, op, prescale_factor, postscale_factor))


def barrier() -> None:
    """Wait until every rank reaches this point (after all collectives submitted before it)."""
    engine = world("barrier()").engine
    name = _name(None, "barrier")

    def work() -> None:
        engine.negotiator.check({"collective": "barrier"})
        engine.comm.Barrier()

    engine.run(name, work)


# ---------------------------------------------------------------- handles

def poll(handle: Handle) -> bool:
    """True when the collective behind `handle` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for the collective behind `handle`; return its result or raise its error."""
    return handle.wait()


def _submit(work: Work) -> Handle:
    return world().engine.submit(*work)


def _run(work: Work) -> Any:
    """Run a collective synchronously, inline on this thread when the engine is idle."""
    return world().engine.run(*work)


def _allreduce_work(tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Any,
                    pre: float, post: float, compression: type[Compressor],
                    in_place: bool) -> Work:
    """One tensor: straight from the input into the output (or in place), with none of the
    grouping machinery, since a small allreduce is dominated by Python overhead."""
    kind = "allreduce_" if in_place else "allreduce"
    if compression is not Compression.none:
        name, grouped = _grouped_allreduce_work([tensor], name, op, average, pre, post,
                                                compression, in_place, kind)
        return name, lambda: grouped()[0]
    engine = world("allreduce_()" if in_place else "allreduce()").engine
    op = _op(op, average, kind)
    name = _name(name, kind)
    t = _tensor(tensor, kind, name)
    _check_scaling(t, pre, post, kind, name)
    dtype, shape = _describe(t)
    signature = {"collective": "allreduce", "name": name, "op": op.name, "prescale": pre,
                 "postscale": post, "dtype": dtype, "shape": shape}

    def work() -> torch.Tensor:
        out = tensor if in_place and _same_memory(t, tensor) else fresh(t.shape, t.dtype, t.device)
        allreduce_flat(engine, as_array(t), as_array(out), t.dtype, op, pre, post, signature)
        if not in_place:
            return out
        if out is not tensor:
            with torch.no_grad():   # parameters are leaves that require grad
                tensor.copy_(out)
        return tensor

    return name, work


# ---------------------------------------------------------------- autograd

class _AllreduceFunction(torch.autograd.Function):
    """d(allreduce)/dx is the same allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, tensor, average, name, compression, op, pre, post):
        ctx.args = (average, compression, op, pre, post)
        return allreduce(tensor, average, name, compression, op, pre, post)

    @staticmethod
    def backward(ctx, grad):
        average, compression, op, pre, post = ctx.args
        return (allreduce(grad, average, None, compression, op, pre, post),
                None, None, None, None, None, None)


class _AllgatherFunction(torch.autograd.Function):
    """The gradient of rank r's input is its rows of the sum of all ranks' output gradients."""

    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        return allgather(tensor, name)

    @staticmethod
    def backward(ctx, grad):
        summed = allreduce(grad, op=Sum)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64))
        start = int(rows[:world().comm.rank].sum())
        part = summed.narrow(0, start, ctx.rows)
        return part.reshape(()) if ctx.scalar else part, None


class _BroadcastFunction(torch.autograd.Function):
    """Only the root's input reaches the outputs, so it alone gets the summed gradient."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root = root_rank
        return broadcast(tensor, root_rank, name)

    @staticmethod
    def backward(ctx, grad):
        summed = allreduce(grad, op=Sum)
        if world().comm.rank != ctx.root:
            summed.zero_()
        return summed, None, None
