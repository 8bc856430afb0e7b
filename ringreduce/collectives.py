"""The public tensor collectives, with Horovod's names and semantics, on a process set.

Every collective validates its input on the caller's thread (so a local mistake raises on the
rank that made it, before any MPI traffic), then hands the set's engine a piece of work that
asks the set's transport to move the data (which first checks the signature across the set).
Results are written to the caller's tensor only after the collective succeeded.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from . import _native, adasum, cuda, ring, timeline
from .buffers import CODES, NAMES, SUPPORTED, as_array, fresh
from .compression import Compression, Compressor
from .engine import Handle, OutOfOrder
from .errors import ArgumentTypeError, UnsupportedError
from .kernels import ReduceOp
from .process_sets import ActiveSet, ProcessSet, active, global_process_set
from .signature import digest
from .transport import ReduceSpec

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)
Work = tuple[ActiveSet, str, Callable[[], Any]]   # the set, the collective's name, what runs
# _small_allreduce's tables: an op (or its number) -> (name, ReduceOp), as enum .name and
# ReduceOp(number) are slow; a dtype -> (code, name); and two attribute lookups saved.
_FAST_OPS = {op: (op.name, op) for op in ReduceOp if op != Adasum}
_FAST_DTYPES = {dtype: (code, NAMES[dtype]) for dtype, code in CODES.items()}
_Tensor, _STRIDED = torch.Tensor, torch.strided


# ---------------------------------------------------------------- argument checks

def _tensor(tensor: Any, what: str, name: str, ps: ActiveSet) -> torch.Tensor:
    """The dense, contiguous CPU tensor to work on, or a clear error naming tensor and rank."""
    if (tensor.__class__ is torch.Tensor and tensor.layout is torch.strided
            and tensor.dtype in CODES and tensor.device.type == "cpu"):
        return tensor.detach().contiguous()     # the common case, checked cheaply
    where = f"ringreduce: {what} of tensor '{name}' on rank {ps.ranks[ps.rank]}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{where}: sparse tensors ({tensor.layout}) are not supported; call "
                        ".to_dense() first, or use DistributedOptimizer(sparse_as_dense=True)")
    if tensor.dtype not in CODES:
        names = ", ".join(NAMES[d] for d in SUPPORTED)
        raise TypeError(f"{where}: dtype {tensor.dtype} is not supported (supported: {names})"
                        + ("; cast booleans to uint8" if tensor.dtype == torch.bool else ""))
    if tensor.device.type == "cuda":
        return cuda.device_tensor(tensor, what, where)
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; ringreduce reduces CPU and "
                         "CUDA tensors")
    return tensor.detach().contiguous()


def reduce_op(op: Any, average: Optional[bool], what: str,
              adasum_ok: bool = False) -> ReduceOp:
    """The reduction op; Adasum only where `adasum_ok` (allreduces), as in Horovod."""
    if average is not None:
        warnings.warn("ringreduce: average= is deprecated; use op=ringreduce.Average or "
                      "op=ringreduce.Sum", DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError(f"ringreduce: {what}: pass op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if op.__class__ is ReduceOp and (op != Adasum or adasum_ok):
        return op
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"ringreduce: {what}: unknown op {op!r}; use ringreduce.Sum, Average, "
                         "Min, Max or Product") from None
    if op == Adasum and not adasum_ok:
        raise UnsupportedError(f"ringreduce: {what}: Adasum only reduces allreduces; use Sum "
                               "or Average")
    return op


def _differentiable(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _describe(t: torch.Tensor) -> tuple:
    return (NAMES[t.dtype], tuple(t.shape))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.is_contiguous() and b.is_contiguous()


def submit(work: Work) -> Handle:
    """Queue a collective's work on its set's engine (and the timeline's "submitted" event);
    the optimizer submits its buckets and step agreement through here too."""
    ps, name, fn = work
    handle = ps.engine.submit(name, fn)
    timeline.record(name, "submitted")
    return handle


def _run(work: Work) -> Any:
    """Run a collective synchronously, inline on this thread when the set's engine is idle."""
    ps, name, fn = work
    return ps.engine.run(name, fn)


# ---------------------------------------------------------------- allreduce

def _allreduce_spec(t: torch.Tensor, op: ReduceOp, pre: float, post: float,
                    name: str) -> ReduceSpec:
    dtype, shape = _describe(t)
    signature = {"collective": "allreduce", "name": name, "op": op.name, "prescale": pre,
                 "postscale": post, "dtype": dtype, "shape": shape}
    return ReduceSpec(t.dtype, op, pre, post, digest(signature), signature)


def _fast_case(tensor: Any, op: Any, limit: int) -> Optional[tuple]:
    """The op's (name, ReduceOp) and the dtype's (code, name) when the call can take the small
    way: a plain contiguous CPU tensor of at most `limit` bytes (the transport's
    `fast_small_bytes`: the ways whose exchange carries the signature with the data) and an op
    other than Adasum; else None. One lookup per table: every line shows in a 4 KiB call."""
    op_named = _FAST_OPS.get(Average if op is None else op)
    if (op_named is None or tensor.__class__ is not _Tensor or not tensor.is_cpu
            or tensor.layout is not _STRIDED or not tensor.is_contiguous()
            or tensor.nbytes > limit):
        return None
    dtype_named = _FAST_DTYPES.get(tensor.dtype)
    return None if dtype_named is None else (op_named, dtype_named)


def _fast_work(ps: ActiveSet, tensor: torch.Tensor, name: str, case: tuple, postscale: float,
               in_place: bool) -> Callable[[], torch.Tensor]:
    """The small way's whole collective, straight to the transport: the same name counter,
    signature digest and bits as the general path, which a peer may take for the same
    collective. Its ReduceSpec is made only where one is needed (a mismatch, a join, a stall
    report), and keeps no reference to the tensor."""
    (op_name, op), (code, dtype) = case
    transport, torch_dtype, shape = ps.transport, tensor.dtype, tensor.shape
    digest = _native.allreduce_digest(name, op_name, dtype, shape, 1.0, float(postscale))

    def make_spec() -> ReduceSpec:
        return ReduceSpec(torch_dtype, op, 1.0, postscale, digest, {
            "collective": "allreduce", "name": name, "op": op_name, "prescale": 1.0,
            "postscale": postscale, "dtype": dtype, "shape": tuple(shape)})

    return lambda: transport.small_allreduce(tensor, in_place, code, op, postscale, digest,
                                             make_spec)


def _small_allreduce(tensor: Any, name: Optional[str], op: Any, postscale: float,
                     in_place: bool, process_set: ProcessSet) -> Optional[torch.Tensor]:
    """The most frequent latency-bound call, a small synchronous allreduce, run at once on
    this thread when the set's engine is idle; None when the call is not that case (or the
    engine is busy), and the general path takes it. If the members' next collectives differ,
    the engine settles their order and this call waits its turn."""
    ps = active(process_set, "allreduce_()" if in_place else "allreduce()")
    case = _fast_case(tensor, op, ps.transport.fast_small_bytes)
    if case is None or not ps.engine.claim_idle(name):
        return None
    try:
        if name is None:
            name = ps.auto_name("allreduce")
        work = _fast_work(ps, tensor, name, case, postscale, in_place)
        return work()
    except OutOfOrder:
        handle = ps.engine.reorder(name, work)
    finally:
        ps.engine.release_idle()
    return handle.wait()


def _allreduce_async_work(tensor: torch.Tensor, average: Optional[bool], name: Optional[str],
                          op: Any, pre: float, post: float, compression: type[Compressor],
                          in_place: bool, process_set: ProcessSet) -> Work:
    """An asynchronous allreduce's work: the small way's where the call qualifies (a handle
    costs enough already), else the general one."""
    if average is None and pre == 1.0 and compression is Compression.none:
        ps = active(process_set, "allreduce_async_()" if in_place else "allreduce_async()")
        case = _fast_case(tensor, op, ps.transport.fast_small_bytes)
        if case is not None:
            name = ps.auto_name("allreduce") if name is None else name
            return ps, name, _fast_work(ps, tensor, name, case, post, in_place)
    return _allreduce_work(tensor, average, name, op, pre, post, compression, in_place,
                           process_set)


def _allreduce_work(tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Any,
                    pre: float, post: float, compression: type[Compressor], in_place: bool,
                    process_set: ProcessSet) -> Work:
    """One tensor: straight from the input into the output (or in place), with none of the
    grouping machinery, since a small allreduce is dominated by Python overhead."""
    kind = "allreduce_" if in_place else "allreduce"
    if compression is not Compression.none:
        ps, name, grouped = _grouped_allreduce_work([tensor], name, op, average, pre, post,
                                                    compression, in_place, kind, process_set)
        return ps, name, lambda: grouped()[0]
    ps = active(process_set, f"{kind}()")
    op = reduce_op(op, average, kind, adasum_ok=True)
    name = ps.auto_name(kind) if name is None else name
    t = _tensor(tensor, kind, name, ps)
    if op == Adasum:
        adasum.check_supported(ps.size, t.dtype)
    spec = _allreduce_spec(t, op, pre, post, name)

    def work() -> torch.Tensor:
        out = tensor if in_place and _same_memory(t, tensor) else fresh(t.shape, t.dtype, t.device)
        ps.transport.allreduce(t, out, spec)
        if not in_place:
            return out
        if out is not tensor:
            with torch.no_grad():   # parameters are leaves that require grad
                tensor.copy_(out)
        return tensor

    return ps, name, work


def _grouped_allreduce_work(tensors: Sequence[torch.Tensor], name: Optional[str], op: Any,
                            average: Optional[bool], prescale: float, postscale: float,
                            compression: type[Compressor], in_place: bool, kind: str,
                            process_set: ProcessSet) -> Work:
    ps = active(process_set, f"{kind}()")
    op = reduce_op(op, average, kind, adasum_ok=True)
    name = ps.auto_name(kind) if name is None else name
    checked = [_tensor(t, kind, f"{name}[{i}]" if len(tensors) > 1 else name, ps)
               for i, t in enumerate(tensors)]
    wires, contexts = zip(*(compression.compress(t) for t in checked)) if checked else ((), ())
    if op == Adasum:
        for wire in wires:
            adasum.check_supported(ps.size, wire.dtype)
    signature = {"collective": "allreduce", "name": name, "op": op.name,
                 "prescale": prescale, "postscale": postscale}
    if len(wires) == 1:
        signature["dtype"], signature["shape"] = _describe(wires[0])
    else:
        signature["tensors (dtype, shape)"] = tuple(_describe(t) for t in wires)
    signed = digest(signature)

    def work() -> list[torch.Tensor]:
        if len(wires) == 1 and contexts[0] is None:     # straight from input to output
            out = tensors[0] if in_place and _same_memory(wires[0], tensors[0]) \
                else fresh(wires[0].shape, wires[0].dtype, wires[0].device)
            ps.transport.allreduce(wires[0], out, ReduceSpec(
                wires[0].dtype, op, prescale, postscale, signed, signature))
            results = [out]
        else:
            results = _reduce_fused(ps, wires, op, prescale, postscale, signed, signature)
            results = [compression.decompress(r, ctx).view_as(t)
                       for r, ctx, t in zip(results, contexts, checked)]
        if not in_place:
            return results
        with torch.no_grad():   # parameters are leaves that require grad
            for original, result in zip(tensors, results):
                if result is not original:
                    original.copy_(result)
        return list(tensors)

    return ps, name, work


def _reduce_fused(ps: ActiveSet, tensors: Sequence[torch.Tensor], op: ReduceOp,
                  prescale: float, postscale: float, signed: int,
                  signature: dict) -> list[torch.Tensor]:
    """Several tensors: one fused buffer per dtype, reduced in place; returns views of it. The
    signature is checked with the first buffer."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    results: list[Any] = [None] * len(tensors)
    for dtype, members in by_dtype.items():
        fused = torch.cat([tensors[i].reshape(-1) for i in members])
        lengths = [tensors[i].numel() for i in members]
        ps.transport.allreduce(fused, fused, ReduceSpec(dtype, op, prescale, postscale, signed,
                                                        signature, lengths))
        signed = None
        for i, part in zip(members, fused.split(lengths)):
            results[i] = part.view_as(tensors[i])
    return results


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                    compression: type[Compressor] = Compression.none) -> Handle:
    """Start an allreduce of `tensor`; `synchronize(handle)` returns a new reduced tensor."""
    return submit(_allreduce_async_work(tensor, average, name, op, prescale_factor,
                                         postscale_factor, compression, False, process_set))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce; `tensor` is overwritten when the handle completes."""
    return submit(_allreduce_async_work(tensor, average, name, op, prescale_factor,
                                         postscale_factor, Compression.none, True, process_set))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the set's ranks and return the result (differentiable)."""
    if _differentiable(tensor):
        return _AllreduceFunction.apply(tensor, average, name, compression, op,
                                        prescale_factor, postscale_factor, process_set)
    if average is None and compression is Compression.none and prescale_factor == 1.0:
        out = _small_allreduce(tensor, name, op, postscale_factor, False, process_set)
        if out is not None:
            return out
    return _run(_allreduce_work(tensor, average, name, op, prescale_factor, postscale_factor,
                                compression, False, process_set))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the set's ranks in place and return it."""
    if average is None and prescale_factor == 1.0:
        out = _small_allreduce(tensor, name, op, postscale_factor, True, process_set)
        if out is not None:
            return out
    return _run(_allreduce_work(tensor, average, name, op, prescale_factor, postscale_factor,
                                Compression.none, True, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            compression: type[Compressor] = Compression.none) -> Handle:
    """Start one fused allreduce of several tensors; the handle yields a list of results."""
    return submit(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                           postscale_factor, compression, False,
                                           "grouped_allreduce", process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    return submit(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                           postscale_factor, Compression.none, True,
                                           "grouped_allreduce_", process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors in one fused allreduce (differentiable)."""
    if any(_differentiable(t) for t in tensors):
        return list(_GroupedAllreduceFunction.apply(
            (average, name, compression, op, prescale_factor, postscale_factor, process_set),
            *tensors))
    return _run(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                        postscale_factor, compression, False,
                                        "grouped_allreduce", process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return _run(_grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                        postscale_factor, Compression.none, True,
                                        "grouped_allreduce_", process_set))


# ---------------------------------------------------------------- allgather, broadcast, ...

def _group_name(ps: ActiveSet, name: Optional[str], kind: str, count: int) -> list[str]:
    """The names of a group's collectives: `name` alone for one tensor, `name.i` for several."""
    base = ps.auto_name(kind) if name is None else name
    return [base] if count == 1 else [f"{base}.{i}" for i in range(count)]


def _allgather_work(tensors: Sequence[torch.Tensor], name: Optional[str],
                    process_set: ProcessSet, kind: str = "allgather") -> Work:
    """Concatenate every member's tensors along dimension 0, one allgather per tensor, all in
    one piece of work; its result is the list of outputs."""
    ps = active(process_set, f"{kind}()")
    names = _group_name(ps, name, kind, len(tensors))
    runs = []
    for tensor, each in zip(tensors, names):
        t = _tensor(tensor, kind, each, ps)
        t = t.reshape(1) if t.dim() == 0 else t
        signature = {"collective": "allgather", "name": each, "dtype": NAMES[t.dtype],
                     "trailing shape": tuple(t.shape[1:])}
        runs.append(functools.partial(ps.transport.allgather, t, signature))
    return ps, names[0], lambda: [run() for run in runs]


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every member's `tensor` along dimension 0 (sizes may differ
    there)."""
    return submit(_first(_allgather_work([tensor], name, process_set)))


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's `tensor` along dimension 0 (differentiable: the gradient is
    this rank's rows of the incoming gradients averaged over the set, as Horovod's)."""
    if _differentiable(tensor):
        return _AllgatherFunction.apply((name, process_set), tensor)[0]
    return _run(_first(_allgather_work([tensor], name, process_set)))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start allgathers of several tensors as one collective; the handle yields a list."""
    return submit(_allgather_work(list(tensors), name, process_set, "grouped_allgather"))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather several tensors as one collective (differentiable)."""
    if any(_differentiable(t) for t in tensors):
        return list(_AllgatherFunction.apply((name, process_set), *tensors))
    return _run(_allgather_work(list(tensors), name, process_set, "grouped_allgather"))


def _first(work: Work) -> Work:
    """A one-tensor group's work, yielding that tensor's result instead of a list."""
    ps, name, fn = work
    return ps, name, lambda: fn()[0]


def _broadcast_work(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                    in_place: bool, kind: str, process_set: ProcessSet) -> Work:
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name(kind) if name is None else name
    t = _tensor(tensor, kind, name, ps)
    root = ps.root(root_rank, kind, name)
    dtype, shape = _describe(t)
    signature = {"collective": "broadcast", "name": name, "root_rank": int(root_rank),
                 "dtype": dtype, "shape": shape}

    def work() -> torch.Tensor:
        # In place, straight into `t`, the caller's memory or our own copy of it: the signatures
        # agree, and an MPI failure from here on ends the job; a temporary would cost
        # broadcast_parameters the model's size again (kept by the engine thread's arena).
        out = t if ps.rank == root or in_place else torch.empty_like(t)
        ps.transport.broadcast(out, root, signature)
        if in_place:
            if not _same_memory(out, tensor):
                with torch.no_grad():
                    tensor.copy_(out)
            return tensor
        return out.clone() if _same_memory(out, tensor) else out

    return ps, name, work


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    return submit(_broadcast_work(tensor, root_rank, name, False, "broadcast", process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    return submit(_broadcast_work(tensor, root_rank, name, True, "broadcast_", process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return global rank `root_rank`'s `tensor` on every member (differentiable)."""
    if _differentiable(tensor):
        return _BroadcastFunction.apply(tensor, root_rank, name, process_set)
    return _run(_broadcast_work(tensor, root_rank, name, False, "broadcast", process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with global rank `root_rank`'s values, in place, and return it."""
    return _run(_broadcast_work(tensor, root_rank, name, True, "broadcast_", process_set))


def _alltoall_work(tensor: torch.Tensor, splits: Any, name: Optional[str],
                   process_set: ProcessSet, with_splits: bool) -> Work:
    """The result is the output, with the received splits too when `with_splits`."""
    ps = active(process_set, "alltoall()")
    name = ps.auto_name("alltoall") if name is None else name
    t = _tensor(tensor, "alltoall", name, ps)
    where = f"ringreduce: alltoall of tensor '{name}' on rank {ps.ranks[ps.rank]}"
    if t.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension")
    if splits is None:
        if t.shape[0] % ps.size:
            raise ValueError(f"{where}: dimension 0 ({t.shape[0]}) does not divide by the "
                             f"{ps.size} ranks; pass splits=")
        send_splits = np.full(ps.size, t.shape[0] // ps.size, dtype=np.int64)
    else:
        given = np.asarray(splits.tolist() if isinstance(splits, torch.Tensor) else splits)
        if given.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{where}: splits must be integers, got {given.tolist()!r}")
        send_splits = given.astype(np.int64).reshape(-1)
        if send_splits.size != ps.size or (send_splits < 0).any() or \
                send_splits.sum() != t.shape[0]:
            raise ValueError(f"{where}: splits {send_splits.tolist()} must be {ps.size} "
                             f"non-negative counts summing to dimension 0 ({t.shape[0]})")
    signature = {"collective": "alltoall", "name": name, "dtype": NAMES[t.dtype],
                 "trailing shape": tuple(t.shape[1:])}

    def work() -> Any:
        out, received = ps.transport.alltoall(t, send_splits, signature)
        return (out, torch.from_numpy(received).to(torch.int32)) if with_splits else out

    return ps, name, work


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-to-all: rows splits[i] go to member i; rows from every member come back in
    member order. Without splits, dimension 0 is divided equally."""
    return submit(_alltoall_work(tensor, splits, name, process_set, splits is not None))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """All-to-all; returns the output, and the received splits too when `splits` is given
    (differentiable: the gradient goes back by the all-to-all of the received splits)."""
    if _differentiable(tensor):
        out, received = _AlltoallFunction.apply(tensor, splits, name, process_set)
        return out if splits is None else (out, received)
    return _run(_alltoall_work(tensor, splits, name, process_set, splits is not None))


def _reducescatter_work(tensors: Sequence[torch.Tensor], name: Optional[str], op: Any,
                        prescale_factor: float, postscale_factor: float,
                        compression: type[Compressor], process_set: ProcessSet,
                        kind: str = "reducescatter") -> Work:
    """Reduce each tensor over the set; set rank r keeps the r-th block of rows of each (lower
    ranks get the extra rows). The result is the list of this rank's blocks."""
    ps = active(process_set, f"{kind}()")
    op = reduce_op(op, None, kind)
    names = _group_name(ps, name, kind, len(tensors))
    runs = []
    for tensor, each in zip(tensors, names):
        t = _tensor(tensor, kind, each, ps)
        if t.dim() == 0:
            raise ValueError(f"ringreduce: {kind} of tensor '{each}' on rank "
                             f"{ps.ranks[ps.rank]}: needs a tensor with at least one dimension")
        wire, context = compression.compress(t)
        runs.append(_reducescatter_one(ps, wire.clone(), context, compression, each, op,
                                       prescale_factor, postscale_factor))
    return ps, names[0], lambda: [run() for run in runs]


def _reducescatter_one(ps: ActiveSet, work_tensor: torch.Tensor, context: Any,
                       compression: type[Compressor], name: str, op: ReduceOp, pre: float,
                       post: float) -> Callable[[], torch.Tensor]:
    dtype, shape = _describe(work_tensor)
    signature = {"collective": "reducescatter", "name": name, "op": op.name, "dtype": dtype,
                 "shape": shape, "prescale": pre, "postscale": post}
    spec = ReduceSpec(work_tensor.dtype, op, pre, post, digest(signature), signature)
    rows = ring.balanced_counts(work_tensor.shape[0], ps.size)
    bounds = ring.chunk_bounds([r * math.prod(work_tensor.shape[1:]) for r in rows])
    start = sum(rows[:ps.rank])

    def run() -> torch.Tensor:
        ps.transport.reducescatter(as_array(work_tensor), bounds, spec)
        mine = work_tensor[start:start + rows[ps.rank]].clone()
        return compression.decompress(mine, context)

    return run


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reduce-scatter: reduce over the set's ranks, and set rank r keeps the r-th block
    of rows (dimension 0 divided as evenly as possible, lower ranks getting the extra rows)."""
    return submit(_first(_reducescatter_work([tensor], name, op, prescale_factor,
                                              postscale_factor, Compression.none, process_set)))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce-scatter (differentiable: the gradient is the allgather of the incoming ones,
    scaled as the forward scaled)."""
    args = (name, compression, op, process_set, prescale_factor, postscale_factor,
            "reducescatter")
    if _differentiable(tensor):
        return _ReducescatterFunction.apply(args, tensor)[0]
    return _run(_first(_reducescatter_work([tensor], name, op, prescale_factor,
                                           postscale_factor, compression, process_set)))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start reduce-scatters of several tensors as one collective; the handle yields a list."""
    return submit(_reducescatter_work(list(tensors), name, op, prescale_factor,
                                       postscale_factor, Compression.none, process_set,
                                       "grouped_reducescatter"))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter several tensors as one collective (differentiable)."""
    args = (name, compression, op, process_set, prescale_factor, postscale_factor,
            "grouped_reducescatter")
    if any(_differentiable(t) for t in tensors):
        return list(_ReducescatterFunction.apply(args, *tensors))
    return _run(_reducescatter_work(list(tensors), name, op, prescale_factor, postscale_factor,
                                    compression, process_set, "grouped_reducescatter"))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: ProcessSet = global_process_set) -> Callable[[], Any]:
    """Reduce a sparse COO tensor as Horovod does: allgather every member's indices
    ('<name>.indices') and values ('<name>.values'); the result holds them all (duplicate
    indices add up when coalesced), values divided by the set's size for Average.

    Returns, as Horovod's, a function: `handle()` waits and returns the sparse result (it also
    has `wait()` and `done()`, so `synchronize(handle)` and `poll(handle)` work). The members'
    dense shapes must agree (they are part of the signature): otherwise every member raises
    MismatchError naming the tensor and each rank's shape."""
    ps = active(process_set, "sparse_allreduce_async()")
    name = ps.auto_name("sparse_allreduce") if name is None else name
    op = reduce_op(op, None, "sparse_allreduce_async")
    if op not in (Sum, Average):
        raise ValueError(f"ringreduce: sparse_allreduce_async of tensor '{name}' on rank "
                         f"{ps.ranks[ps.rank]}: op must be Sum or Average, not {op.name}")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"ringreduce: sparse_allreduce_async of tensor '{name}' on rank "
                        f"{ps.ranks[ps.rank]}: expected a sparse COO tensor")
    dense_shape = tuple(tensor.shape)
    gathers = []
    for part, piece in (("indices", tensor._indices().t()), ("values", tensor._values())):
        each = f"{name}.{part}"
        t = _tensor(piece, "sparse_allreduce_async", each, ps)
        signature = {"collective": "sparse_allreduce", "name": each, "dense shape": dense_shape,
                     "dtype": NAMES[t.dtype], "trailing shape": tuple(t.shape[1:])}
        gathers.append(functools.partial(ps.transport.allgather, t, signature))

    def work() -> torch.Tensor:
        indices, values = [gather() for gather in gathers]
        if op == Average:
            values = values / ps.size
        return torch.sparse_coo_tensor(indices.t(), values, dense_shape, check_invariants=False)

    submitted = submit((ps, name, work))

    def handle() -> torch.Tensor:
        return submitted.wait()

    handle.wait, handle.done = submitted.wait, submitted.done
    return handle


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """This rank has run out of data: until every rank of the set has joined, it takes part in
    the others' allreduces with zeros (Average still divides by the set's size), so ranks with
    fewer batches need not stop the others; other collectives raise JoinedError meanwhile.
    Blocks until every rank has joined; returns the rank that joined last, on every rank.
    `device`: where to make the zeros for GPU allreduces (-1: the current CUDA device)."""
    ps = active(process_set, "join()")
    where = torch.device("cuda", device) if device >= 0 else None
    return ps.engine.run(ps.auto_name("join"), lambda: ps.join(where))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member reaches this point (after all collectives submitted before it)."""
    ps = active(process_set, "barrier()")
    name = ps.auto_name("barrier")
    ps.engine.run(name, lambda: ps.transport.barrier({"collective": "barrier", "name": name}))


def barrier_async(name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set) -> Handle:
    """Start a barrier; its handle completes once every member has reached it (after the
    collectives each submitted before it). For front ends whose barrier returns a handle, such
    as torch.distributed's `barrier(async_op=True)`."""
    ps = active(process_set, "barrier_async()")
    name = ps.auto_name("barrier") if name is None else name
    return submit((ps, name,
                    lambda: ps.transport.barrier({"collective": "barrier", "name": name})))


# ---------------------------------------------------------------- handles

def poll(handle: Handle) -> bool:
    """True when the collective behind `handle` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for the collective behind `handle`; return its result or raise its error."""
    return handle.wait()


# ---------------------------------------------------------------- autograd
# Each backward computes what Horovod's does (its allgather and broadcast average the
# incoming gradients over the set); the forward runs the non-differentiable path, since autograd
# is off inside it.

class _AllreduceFunction(torch.autograd.Function):
    """d(allreduce)/dx is the same allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, tensor, average, name, compression, op, pre, post, process_set):
        ctx.args = (average, compression, op, pre, post, process_set)
        return allreduce(tensor, average, name, compression, op, pre, post, process_set)

    @staticmethod
    def backward(ctx, grad):
        average, compression, op, pre, post, process_set = ctx.args
        return (allreduce(grad, average, None, compression, op, pre, post, process_set),
                None, None, None, None, None, None, None)


class _GroupedAllreduceFunction(torch.autograd.Function):
    """The same grouped allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, args, *tensors):
        average, name, compression, op, pre, post, process_set = args
        ctx.args = (average, compression, op, pre, post, process_set)
        return tuple(grouped_allreduce(tensors, average, name, compression, op, pre, post,
                                       process_set))

    @staticmethod
    def backward(ctx, *grads):
        average, compression, op, pre, post, process_set = ctx.args
        return (None, *grouped_allreduce(grads, average, None, compression, op, pre, post,
                                         process_set))


class _AllgatherFunction(torch.autograd.Function):
    """Each input's gradient is its rows of the incoming gradients averaged over the set."""

    @staticmethod
    def forward(ctx, args, *tensors):
        name, process_set = args
        ctx.process_set = process_set
        ctx.shapes = [t.shape for t in tensors]
        return tuple(grouped_allgather(tensors, name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        ps = active(ctx.process_set, "allgather backward")
        averaged = grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                     process_set=ctx.process_set)
        rows = [s[0] if len(s) else 1 for s in ctx.shapes]
        everyone = allgather(torch.tensor([rows], dtype=torch.int64),
                             process_set=ctx.process_set)
        starts = everyone[:ps.rank].sum(0).tolist()
        parts = [a.narrow(0, start, count).reshape(shape)
                 for a, start, count, shape in zip(averaged, starts, rows, ctx.shapes)]
        return (None, *parts)


class _BroadcastFunction(torch.autograd.Function):
    """Only the root's input reaches the outputs: it gets the incoming gradients averaged over
    the set, the others zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        ps = active(ctx.process_set, "broadcast backward")
        if ps.ranks[ps.rank] != ctx.root:
            averaged.zero_()
        return averaged, None, None, None


class _AlltoallFunction(torch.autograd.Function):
    """The incoming gradients go back where their rows came from: an all-to-all by the
    received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _run(_alltoall_work(tensor, splits, name, process_set, True))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received):
        back, _ = alltoall(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


class _ReducescatterFunction(torch.autograd.Function):
    """Horovod's gradient (HorovodReducescatter, HorovodGroupedReducescatter): the incoming
    gradients times the set's size for Sum (nothing for Average), then times the prescale and
    the postscale factor (each only when not 1), one multiplication at a time, then
    allgathered. With compression, as Horovod's (which compresses outside its autograd
    function), that happens in the wire dtype."""

    @staticmethod
    def forward(ctx, args, *tensors):
        name, compression, op, process_set, pre, post, kind = args
        ps = active(process_set, f"{kind}()")
        op = reduce_op(op, None, kind)
        ctx.process_set, ctx.size, ctx.compression = process_set, ps.size, compression
        ctx.sum, ctx.pre, ctx.post = op == Sum, pre, post
        return tuple(_run(_reducescatter_work(list(tensors), name, op, pre, post, compression,
                                              process_set, kind)))

    @staticmethod
    def backward(ctx, *grads):
        wire_dtype = ctx.compression.wire_dtype
        scaled, dtypes = [], []
        for g in grads:
            dtypes.append(g.dtype)
            if wire_dtype is not None and ctx.compression.applies_to(g.dtype):
                g = g.to(wire_dtype)
            if ctx.sum:
                g = g * ctx.size
            if ctx.pre != 1.0:
                g = g * ctx.pre
            if ctx.post != 1.0:
                g = g * ctx.post
            scaled.append(g.contiguous())
        gathered = grouped_allgather(scaled, process_set=ctx.process_set)
        return (None, *[g.to(dtype) for g, dtype in zip(gathered, dtypes)])
