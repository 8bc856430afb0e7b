"""What each public collective hands its set's engine: the arguments checked on the caller's
thread (a local mistake raises on the rank that made it, before any of its data moves, and
meets the other ranks' call as a refusal: `refusing`), the signature the members compare, and
the closure that asks the set's transport to move the data. A piece of `Work` is (the active
set, the collective's name, what runs); the API module (collectives.py) runs it inline or
queues it, the autograd functions (differentiable.py) run it in their forward. Results are
written to the caller's tensor only after the collective succeeded.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..core import timeline
from ..core.errors import (ArgumentTypeError, HorovodInternalError, NotContiguousError,
                           RingReduceError, UnsupportedError)
from ..gpu import cuda
from ..kernels.buffers import CODES, NAMES, SUPPORTED, as_array, dtype_name, fresh
from ..kernels.ops import ReduceOp
from ..sets.active_set import ActiveSet, refusing
from ..sets.handles import Handle
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active
from ..transport import adasum, ring
from ..transport.negotiation import AGREED
from ..transport.reduce_spec import ReduceSpec
from ..transport.signature import digest, with_device
from .compression import Compression, Compressor, custom

Work = tuple[ActiveSet, str, Callable[[], Any]]   # the set, the collective's name, what runs

# ---------------------------------------------------------------- argument checks

# A collective that only moves data (allgather, broadcast, alltoall) takes any dtype whose
# element has one of these sizes (bool, uint16 to uint64, float8, complex64 ...): the transport
# moves a view of the same shape with this storage, and the signature names the real dtype.
_MOVED_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor(tensor: Any, what: str, name: str, ps: ActiveSet,
            moves_only: bool = False) -> torch.Tensor:
    """The caller's tensor to work on (detached, never copied: a dense, contiguous CPU one; a
    CUDA one: cuda.device_tensor), or a clear error naming tensor and rank, of Horovod's type:
    a layout or dtype it does not take is ArgumentTypeError (Horovod's ValueError "Tensor type
    ... is not supported.", a TypeError as ours was), a non-contiguous tensor
    NotContiguousError (a ValueError, as Horovod's), checked in that order. `moves_only`: for
    a collective that only moves data (`_MOVED_AS`)."""
    if (tensor.__class__ is torch.Tensor and tensor.layout is torch.strided
            and tensor.dtype in CODES and tensor.device.type == "cpu"
            and tensor.is_contiguous()):
        return tensor.detach()      # the common case, checked cheaply
    where = f"ringreduce: {what} of tensor '{name}' on rank {ps.ranks[ps.rank]}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ArgumentTypeError(
            f"{where}: sparse tensors ({tensor.layout}) are not supported here; call "
            ".to_dense() first (sparse COO tensors are reduced by sparse_allreduce_async and "
            "the torch.distributed backend's all_reduce, and DistributedOptimizer takes sparse "
            "gradients)")
    if tensor.dtype not in CODES:
        storage = _MOVED_AS.get(tensor.element_size()) if moves_only else None
        if storage is None:
            names = ", ".join(NAMES[d] for d in SUPPORTED)
            raise ArgumentTypeError(
                f"{where}: dtype {tensor.dtype} is not supported (supported: {names}"
                + ("; and any dtype of 1, 2, 4 or 8 bytes an element" if moves_only else "")
                + ")" + ("; cast booleans to uint8" if tensor.dtype == torch.bool else ""))
        tensor = tensor.detach().view(storage)
    if not tensor.is_contiguous():
        raise NotContiguousError(
            f"{where}: the tensor is not contiguous (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}), and Horovod refuses one too ('Tensor is required to be "
            "contiguous.'); pass tensor.contiguous() (for an in-place call, copy the result "
            "back)")
    if tensor.device.type == "cuda":
        return cuda.device_tensor(tensor, what)
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; ringreduce reduces CPU and "
                         "CUDA tensors")
    return tensor.detach()


def _on_device(result: torch.Tensor, caller: torch.Tensor) -> torch.Tensor:
    """A result on the caller's tensor's device: a CUDA tensor's collective other than an
    allreduce works on a host copy (cuda.device_tensor)."""
    return result.to(caller.device) if caller.is_cuda else result


def _as(result: torch.Tensor, caller: torch.Tensor) -> torch.Tensor:
    """A moved result as the caller's tensor's dtype again (see `_MOVED_AS`), on its device."""
    return _on_device(result if result.dtype == caller.dtype else result.view(caller.dtype),
                      caller)


def reduce_op(op: Any, average: Optional[bool], what: str,
              adasum_ok: bool = False) -> ReduceOp:
    """The reduction op; Adasum only where `adasum_ok` (allreduces), as in Horovod."""
    if average is not None:
        warnings.warn("ringreduce: average= is deprecated; use op=ringreduce.Average or "
                      "op=ringreduce.Sum", DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError(f"ringreduce: {what}: pass op= or the deprecated average=, not both")
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    if op.__class__ is ReduceOp and (op != ReduceOp.Adasum or adasum_ok):
        return op
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"ringreduce: {what}: unknown op {op!r}; use ringreduce.Sum, Average, "
                         "Min, Max or Product") from None
    if op == ReduceOp.Adasum and not adasum_ok:
        raise UnsupportedError(f"ringreduce: {what}: Adasum only reduces allreduces; use Sum "
                               "or Average")
    return op


def _adasum_set(op: ReduceOp, process_set: ProcessSet, kind: str, name: str,
                ps: ActiveSet) -> None:
    """Horovod's allreduces refuse Adasum on any set but the global one, before they look at
    the tensor (NotImplementedError; every member of the set alike)."""
    if op == ReduceOp.Adasum and process_set is not global_process_set:
        raise UnsupportedError(f"ringreduce: {kind} of tensor '{name}' on rank "
                               f"{ps.ranks[ps.rank]}: Adasum does not support non-global "
                               "process sets yet (as in Horovod); reduce on the global set")


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


def meet_failure(ps: ActiveSet, name: str, kind: str, begun: int, error: BaseException) -> None:
    """A collective's work failed on this rank (an allocation, say). Where that came before the
    collective began here (`begun`: the set's count before the work), it still meets the other
    ranks' call of `name`, as `refusing` does, with a check that carries the error, so theirs
    fail with a MismatchError quoting it instead of waiting for ours. Once begun, a failure is
    the transport's to tell (StallWatch.failed)."""
    if not isinstance(error, Exception) or isinstance(error, AGREED) \
            or ps.transport.watch.begun != begun:
        return      # (an interrupt meets nothing: it ends the job, or the caller knows)
    signature = {"collective": kind, "name": name, "failed": f"{type(error).__name__}: {error}"}
    try:
        ps.transport.check(signature)
    except RingReduceError:
        pass    # the others' calls failed: `error` goes on


def run(work: Work) -> Any:
    """Run a collective synchronously, inline on this thread when the set's engine is idle."""
    ps, name, fn = work
    return ps.engine.run(name, fn)


# The torch.distributed backend's calls with a root, each made of a collective without one.
ROOTED = {"allreduce": "reduce", "allgather": "gather", "alltoall": "scatter"}


def _with_root(signature: dict, root: Optional[int]) -> dict:
    """The signature of a collective that the backend's reduce, gather or scatter (ROOTED) is
    made of, where `root` (a global rank) is given: that call's kind and root, which every rank
    must name alike. Otherwise a rank naming another root, or making the plain collective,
    would pair with the others' call and keep a result it was not meant to have."""
    if root is not None:
        signature["collective"] = ROOTED[signature["collective"]]
        signature["root_rank"] = root
    return signature


# ---------------------------------------------------------------- allreduce

def _allreduce_spec(t: torch.Tensor, op: ReduceOp, pre: float, post: float,
                    name: str, root: Optional[int]) -> ReduceSpec:
    dtype, shape = _describe(t)
    signature = with_device(_with_root({"collective": "allreduce", "name": name, "op": op.name,
                                        "prescale": pre, "postscale": post, "dtype": dtype,
                                        "shape": shape}, root), t.is_cuda)
    return ReduceSpec(t.dtype, op, pre, post, digest(signature), signature)


# adasum.check_supported's error for a dtype Adasum cannot reduce (Horovod's
# HorovodInternalError), a mistake in the arguments all the same: `refusing` shares it.
_ADASUM_DTYPE = (HorovodInternalError,)


def allreduce_work(tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Any,
                   pre: float, post: float, compression: type[Compressor], in_place: bool,
                   process_set: ProcessSet, root: Optional[int] = None) -> Work:
    """One tensor: straight from the input into the output (or in place), with none of the
    grouping machinery, since a small allreduce is dominated by Python overhead. `root`: see
    _with_root (uncompressed only)."""
    kind = "allreduce_" if in_place else "allreduce"
    if compression is not Compression.none:
        ps, name, grouped = grouped_allreduce_work([tensor], name, op, average, pre, post,
                                                   compression, in_place, kind, process_set)
        return ps, name, lambda: grouped()[0]
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name(kind) if name is None else name
    with refusing(ps, name, kind, also=_ADASUM_DTYPE):
        op = reduce_op(op, average, kind, adasum_ok=True)
        _adasum_set(op, process_set, kind, name, ps)
        t = _tensor(tensor, kind, name, ps)
        if op == ReduceOp.Adasum:
            adasum.check_supported(ps.size, t.dtype)
    spec = _allreduce_spec(t, op, pre, post, name, root)

    def work() -> torch.Tensor:
        begun = ps.transport.watch.begun
        try:
            out = (tensor if in_place and _same_memory(t, tensor)
                   else fresh(t.shape, t.dtype, t.device))
            ps.transport.allreduce(t, out, spec)
        except BaseException as error:
            meet_failure(ps, name, kind, begun, error)
            raise
        if not in_place:
            return out
        if out is not tensor:
            with torch.no_grad():   # parameters are leaves that require grad
                tensor.copy_(out)
        return tensor

    return ps, name, cuda.after_caller(work, t.device) if t.is_cuda else work


def grouped_allreduce_work(tensors: Sequence[torch.Tensor], name: Optional[str], op: Any,
                           average: Optional[bool], prescale: float, postscale: float,
                           compression: type[Compressor], in_place: bool, kind: str,
                           process_set: ProcessSet) -> Work:
    """Several tensors as one allreduce (compressed, each, on the wire): one fused buffer per
    dtype, or one tensor straight from its input into the output; its result is the list."""
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name(kind) if name is None else name
    with refusing(ps, name, kind, also=_ADASUM_DTYPE):
        op = reduce_op(op, average, kind, adasum_ok=True)
        _adasum_set(op, process_set, kind, name, ps)
        checked = [_tensor(t, kind, f"{name}[{i}]" if len(tensors) > 1 else name, ps)
                   for i, t in enumerate(tensors)]
        wires, contexts = zip(*(compression.compress(t) for t in checked)) if checked \
            else ((), ())
        if op == ReduceOp.Adasum:
            for wire in wires:
                adasum.check_supported(ps.size, wire.dtype)
    mine = custom(compression)      # the user's decompress is called whatever its context
    signature = {"collective": "allreduce", "name": name, "op": op.name,
                 "prescale": prescale, "postscale": postscale}
    if len(wires) == 1:
        signature["dtype"], signature["shape"] = _describe(wires[0])
    else:
        signature["tensors (dtype, shape)"] = tuple(_describe(t) for t in wires)
    with_device(signature, any(w.is_cuda for w in wires))
    signed = digest(signature)

    def work() -> list[torch.Tensor]:
        begun = ps.transport.watch.begun
        try:
            if len(wires) == 1 and contexts[0] is None:     # straight from input to output
                out = tensors[0] if in_place and _same_memory(wires[0], tensors[0]) \
                    else fresh(wires[0].shape, wires[0].dtype, wires[0].device)
                ps.transport.allreduce(wires[0], out, ReduceSpec(
                    wires[0].dtype, op, prescale, postscale, signed, signature))
                results = [out]
            else:
                results = _reduce_fused(ps, wires, op, prescale, postscale, signed, signature)
        except BaseException as error:
            meet_failure(ps, name, kind, begun, error)
            raise
        if len(wires) != 1 or contexts[0] is not None or mine:
            results = [compression.decompress(r, ctx).view_as(t)
                       for r, ctx, t in zip(results, contexts, checked)]
        if not in_place:
            return results
        with torch.no_grad():   # parameters are leaves that require grad
            for original, result in zip(tensors, results):
                if result is not original:
                    original.copy_(result)
        return list(tensors)

    cuda_tensor = next((t for t in checked if t.is_cuda), None)
    return ps, name, work if cuda_tensor is None else cuda.after_caller(work, cuda_tensor.device)


def _reduce_fused(ps: ActiveSet, tensors: Sequence[torch.Tensor], op: ReduceOp,
                  prescale: float, postscale: float, signed: int,
                  signature: dict) -> list[torch.Tensor]:
    """Several tensors: one fused buffer per dtype, reduced in place; returns views of it. The
    signature is checked with the first buffer. Every buffer is made before the first exchange,
    so that a failure to make one is met by the others' call (`meet_failure`)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    fused_by_dtype = {dtype: torch.cat([tensors[i].reshape(-1) for i in members])
                      for dtype, members in by_dtype.items()}
    results: list[Any] = [None] * len(tensors)
    for dtype, members in by_dtype.items():
        fused = fused_by_dtype[dtype]
        lengths = [tensors[i].numel() for i in members]
        ps.transport.allreduce(fused, fused, ReduceSpec(dtype, op, prescale, postscale, signed,
                                                        signature, lengths))
        signed = None
        for i, part in zip(members, fused.split(lengths)):
            results[i] = part.view_as(tensors[i])
    return results


# ---------------------------------------------------------------- allgather, broadcast, ...

def _group_name(ps: ActiveSet, name: Optional[str], kind: str, count: int) -> list[str]:
    """The names of a group's collectives: `name` alone for one tensor of a plain call,
    `name.i` for a grouped call's (however many: with the count in each signature, a rank
    passing another number of tensors meets the others' first one and gets MismatchError)."""
    base = ps.auto_name(kind) if name is None else name
    grouped = kind.startswith("grouped_")
    return [base] if count == 1 and not grouped else [f"{base}.{i}" for i in range(count)]


def allgather_work(tensors: Sequence[torch.Tensor], name: Optional[str],
                   process_set: ProcessSet, kind: str = "allgather",
                   root: Optional[int] = None) -> Work:
    """Concatenate every member's tensors along dimension 0, one allgather per tensor, all in
    one piece of work; its result is the list of outputs. `root`: see _with_root."""
    ps = active(process_set, f"{kind}()")
    names = _group_name(ps, name, kind, len(tensors))
    refusal, gathers = refusing(ps, names[0], kind), []
    for tensor, each in zip(tensors, names):
        with refusal:
            t = _tensor(tensor, kind, each, ps, moves_only=True)
        t = t.reshape(1) if t.dim() == 0 else t
        signature = _with_root({"collective": "allgather", "name": each,
                                "tensors": len(tensors), "dtype": dtype_name(tensor.dtype),
                                "trailing shape": tuple(t.shape[1:])}, root)
        gathers.append((functools.partial(ps.transport.allgather, t, signature), tensor))
    return ps, names[0], lambda: [_as(gather(), tensor) for gather, tensor in gathers]


def tupled(work: Work) -> Work:
    """A group's work yielding a tuple of results, as Horovod's grouped handles do."""
    ps, name, fn = work
    return ps, name, lambda: tuple(fn())


def first(work: Work) -> Work:
    """A one-tensor group's work, yielding that tensor's result instead of a list."""
    ps, name, fn = work
    return ps, name, lambda: fn()[0]


def broadcast_work(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                   in_place: bool, kind: str, process_set: ProcessSet) -> Work:
    """Global rank `root_rank`'s tensor on every member: into a new tensor, or in place."""
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name(kind) if name is None else name
    with refusing(ps, name, kind):
        t = _tensor(tensor, kind, name, ps, moves_only=True)
        root = ps.root(root_rank, kind, name)
    signature = {"collective": "broadcast", "name": name, "root_rank": int(root_rank),
                 "dtype": dtype_name(tensor.dtype), "shape": tuple(t.shape)}

    def work() -> torch.Tensor:
        # In place, straight into `t`, the caller's memory or our own copy of it: the signatures
        # agree, and a failure from here on shuts the set down (stall.py); a temporary would cost
        # broadcast_parameters the model's size again (kept by the engine thread's arena).
        begun = ps.transport.watch.begun
        try:
            out = t if ps.rank == root or in_place else torch.empty_like(t)
            ps.transport.broadcast(out, root, signature)
        except BaseException as error:
            meet_failure(ps, name, kind, begun, error)
            raise
        if in_place:
            if ps.rank != root and not _same_memory(out, tensor):   # (the root's is unchanged)
                with torch.no_grad():
                    tensor.copy_(_as(out, tensor))
            return tensor
        return _as(out.clone() if _same_memory(out, tensor) else out, tensor)

    return ps, name, work


def alltoall_work(tensor: torch.Tensor, splits: Any, name: Optional[str],
                  process_set: ProcessSet, root: Optional[int] = None) -> Work:
    """The result is (output, received splits), as Horovod's handle gives: the received splits
    int32, on the device of a `splits` tensor (as Horovod's `splits.new()`), else the CPU.
    Rows past the sum of the splits are not sent. `root`: see _with_root."""
    ps = active(process_set, "alltoall()")
    name = ps.auto_name("alltoall") if name is None else name
    with refusing(ps, name, "alltoall"):
        t = _tensor(tensor, "alltoall", name, ps, moves_only=True)
        send_splits = _send_splits(t, splits, ps, name)
    t = t.narrow(0, 0, int(send_splits.sum()))
    splits_device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
    signature = _with_root({"collective": "alltoall", "name": name,
                            "dtype": dtype_name(tensor.dtype),
                            "trailing shape": tuple(t.shape[1:])}, root)

    def work() -> tuple[torch.Tensor, torch.Tensor]:
        out, received = ps.transport.alltoall(t, send_splits, signature)
        return _as(out, tensor), torch.from_numpy(received).to(splits_device, torch.int32)

    return ps, name, work


def _send_splits(t: torch.Tensor, splits: Any, ps: ActiveSet, name: str) -> np.ndarray:
    """How many rows of `t` go to each member: `splits`, checked, or an even split."""
    where = f"ringreduce: alltoall of tensor '{name}' on rank {ps.ranks[ps.rank]}"
    if t.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension")
    if splits is None:
        if t.shape[0] % ps.size:
            raise ValueError(f"{where}: dimension 0 ({t.shape[0]}) does not divide by the "
                             f"{ps.size} ranks; pass splits=")
        return np.full(ps.size, t.shape[0] // ps.size, dtype=np.int64)
    given = np.asarray(splits.tolist() if isinstance(splits, torch.Tensor) else splits)
    if given.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{where}: splits must be integers, got {given.tolist()!r}")
    send_splits = given.astype(np.int64).reshape(-1)
    if send_splits.size != ps.size or (send_splits < 0).any() or \
            send_splits.sum() > t.shape[0]:     # (fewer rows: the rest are not sent, as Horovod)
        raise ValueError(f"{where}: splits {send_splits.tolist()} must be {ps.size} "
                         f"non-negative counts summing to at most dimension 0 ({t.shape[0]})")
    return send_splits


def reducescatter_work(tensors: Sequence[torch.Tensor], name: Optional[str], op: Any,
                       prescale_factor: float, postscale_factor: float,
                       compression: type[Compressor], process_set: ProcessSet,
                       kind: str = "reducescatter") -> Work:
    """Reduce each tensor over the set; set rank r keeps the r-th block of rows of each (lower
    ranks get the extra rows). The result is the list of this rank's blocks."""
    ps = active(process_set, f"{kind}()")
    names = _group_name(ps, name, kind, len(tensors))
    with refusing(ps, names[0], kind):
        op = reduce_op(op, None, kind)
        checked = [_tensor(tensor, kind, each, ps) for tensor, each in zip(tensors, names)]
        for t, each in zip(checked, names):
            if t.dim() == 0:
                raise ValueError(f"ringreduce: {kind} of tensor '{each}' on rank "
                                 f"{ps.ranks[ps.rank]}: needs a tensor with at least one "
                                 "dimension")
    scatters = []
    for tensor, t, each in zip(tensors, checked, names):
        wire, context = compression.compress(t)
        shares = wire.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        work_tensor = wire.clone() if shares else wire      # (reduced in place: not the input)
        scatters.append(_reducescatter_one(ps, work_tensor, context, compression, each, op,
                                           prescale_factor, postscale_factor, len(tensors),
                                           tensor))
    return ps, names[0], lambda: [scatter() for scatter in scatters]


def _reducescatter_one(ps: ActiveSet, work_tensor: torch.Tensor, context: Any,
                       compression: type[Compressor], name: str, op: ReduceOp, pre: float,
                       post: float, count: int,
                       caller: torch.Tensor) -> Callable[[], torch.Tensor]:
    dtype, shape = _describe(work_tensor)
    signature = {"collective": "reducescatter", "name": name, "tensors": count, "op": op.name,
                 "dtype": dtype, "shape": shape, "prescale": pre, "postscale": post}
    spec = ReduceSpec(work_tensor.dtype, op, pre, post, digest(signature), signature)
    rows = ring.balanced_counts(work_tensor.shape[0], ps.size)
    bounds = ring.chunk_bounds([r * math.prod(work_tensor.shape[1:]) for r in rows])
    start = sum(rows[:ps.rank])

    def scatter() -> torch.Tensor:
        ps.transport.reducescatter(as_array(work_tensor), bounds, spec)
        mine = work_tensor[start:start + rows[ps.rank]].clone()
        return _on_device(compression.decompress(mine, context), caller)

    return scatter


def barrier_work(name: Optional[str], process_set: ProcessSet, kind: str) -> Work:
    """Every member reaches it (after the collectives each submitted before it); `kind` is
    the caller's, for errors."""
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name("barrier") if name is None else name
    return ps, name, lambda: ps.transport.barrier({"collective": "barrier", "name": name})


def sparse_allreduce_work(tensor: torch.Tensor, name: Optional[str], op: Any,
                          process_set: ProcessSet) -> Work:
    """A sparse COO tensor reduced as Horovod does: every member's indices, then values,
    allgathered into one sparse result, values divided by the set's size for Average. Both
    signatures carry the collective's own name (settling pairs collectives by it: a rank
    whose collective of that name is another one then fails the check, MismatchError,
    instead of being put back in order without end), the part gathered and the dense shape."""
    ps = active(process_set, "sparse_allreduce_async()")
    name = ps.auto_name("sparse_allreduce") if name is None else name
    where = f"ringreduce: sparse_allreduce_async of tensor '{name}' on rank {ps.ranks[ps.rank]}"
    refusal = refusing(ps, name, "sparse_allreduce")
    with refusal:
        op = reduce_op(op, None, "sparse_allreduce_async")
        if op not in (ReduceOp.Sum, ReduceOp.Average):
            raise ValueError(f"{where}: op must be Sum or Average, not {op.name}")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            raise TypeError(f"{where}: expected a sparse COO tensor")
    dense_shape = tuple(tensor.shape)
    gathers = []
    for part, piece in (("indices", tensor._indices().t().contiguous()),
                        ("values", tensor._values())):
        with refusal:
            t = _tensor(piece, "sparse_allreduce_async", f"{name}.{part}", ps)
        signature = {"collective": "sparse_allreduce", "name": name, "part": part,
                     "dense shape": dense_shape, "dtype": NAMES[t.dtype],
                     "trailing shape": tuple(t.shape[1:]), "op": op.name}
        gathers.append(functools.partial(ps.transport.allgather, t, signature))

    def work() -> torch.Tensor:
        indices, values = [gather() for gather in gathers]
        if op == ReduceOp.Average:
            values = values / ps.size
        return _on_device(torch.sparse_coo_tensor(indices.t(), values, dense_shape,
                                                  check_invariants=False), tensor)

    return ps, name, work


def bitwise_allreduce_work(tensor: torch.Tensor, name: str, op_name: str,
                           fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           process_set: ProcessSet, root: Optional[int] = None) -> Work:
    """The torch.distributed backend's BAND, BOR and BXOR (`op_name`), which gloo has for
    integer and bool tensors: every member's tensor allgathered, one row each, then folded
    by `fold` in member order on each member, so that all get the same bits (exact: integer
    ops). Each member holds every member's tensor for the while, the cost of ops that flags
    and masks use. The signature carries the op: a rank naming another op fails the check
    (MismatchError) rather than keep a result of its own. `root`: the backend's reduce,
    whose root (a global rank) every rank must name alike. Yields the result, shaped as
    `tensor`."""
    kind = "allreduce" if root is None else "reduce"
    ps = active(process_set, f"{kind}()")
    with refusing(ps, name, kind):
        if tensor.is_floating_point() or tensor.is_complex():
            raise UnsupportedError(
                f"ringreduce backend: {kind} of tensor '{name}' on rank {ps.ranks[ps.rank]} "
                f"with ReduceOp.{op_name} takes integer or bool tensors, not {tensor.dtype}")
        # (an allgather's row: a CUDA tensor's goes by a host copy, as every gather's)
        row = _tensor(tensor.detach().reshape(1, -1), "allgather", name, ps, moves_only=True)
    signature = {"collective": kind, "name": name, "op": op_name,
                 "dtype": dtype_name(tensor.dtype), "shape": tuple(tensor.shape)}
    if root is not None:
        signature["root_rank"] = root

    def work() -> torch.Tensor:
        rows = _as(ps.transport.allgather(row, signature), tensor)
        return functools.reduce(fold, rows.unbind()).reshape(tensor.shape)

    return ps, name, work
