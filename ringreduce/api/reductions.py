"""The work of the reductions: allreduce (one tensor straight from its input into its output,
or several fused by dtype, compressed each), reduce-scatter, the sparse allreduce (Horovod's:
every member's entries gathered) and the backend's bitwise ones. Results are written to the
caller's tensor only after the collective succeeded."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import torch

from ..core.errors import HorovodInternalError, UnsupportedError
from ..gpu import cuda
from ..kernels.buffers import NAMES, as_array, dtype_name, fresh
from ..kernels.ops import ReduceOp
from ..sets.active_set import ActiveSet, refusing
from ..sets.process_set import ProcessSet
from ..sets.process_sets import active
from ..transport import adasum, ring
from ..transport.reduce_spec import ReduceSpec
from ..transport.signature import (GROUPED_TENSORS, AllreduceSignature, digest,
                                   with_device)
from .arguments import (as_callers, checked_tensor, described, on_callers_device, reduce_op,
                        refuse_adasum_off_global, same_memory)
from .compression import Compression, Compressor, custom
from .work import Work, group_names, meet_failure, no_tensors


def _allreduce_spec(t: torch.Tensor, op: ReduceOp, pre: float, post: float,
                    name: str, root: Optional[int]) -> ReduceSpec:
    signature = AllreduceSignature(name, op.name, NAMES[t.dtype], t.shape, pre, post,
                                   t.is_cuda, root)
    return ReduceSpec(t.dtype, op, pre, post, signature.digest(), signature.fields)


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
        refuse_adasum_off_global(op, process_set, kind, name, ps)
        t = checked_tensor(tensor, kind, name, ps)
        if op == ReduceOp.Adasum:
            adasum.check_supported(ps.size, t.dtype)
    spec = _allreduce_spec(t, op, pre, post, name, root)

    def work() -> torch.Tensor:
        begun = ps.transport.watch.begun
        try:
            out = (tensor if in_place and same_memory(t, tensor)
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
        refuse_adasum_off_global(op, process_set, kind, name, ps)
        checked = [checked_tensor(t, kind, f"{name}[{i}]" if len(tensors) > 1 else name, ps)
                   for i, t in enumerate(tensors)]
        wires, contexts = zip(*(compression.compress(t) for t in checked)) if checked \
            else ((), ())
        if op == ReduceOp.Adasum:
            for wire in wires:
                adasum.check_supported(ps.size, wire.dtype)
    mine = custom(compression)      # the user's decompress is called whatever its context
    if len(wires) == 1:     # (as a plain allreduce: a no-op compressor pairs with none)
        one = AllreduceSignature(name, op.name, NAMES[wires[0].dtype], wires[0].shape,
                                 prescale, postscale, wires[0].is_cuda)
        signed, signature = one.digest(), one.fields()
    else:
        signature = with_device({"collective": "allreduce", "name": name, "op": op.name,
                                 "prescale": prescale, "postscale": postscale,
                                 GROUPED_TENSORS: tuple(described(t) for t in wires)},
                                any(w.is_cuda for w in wires))
        signed = digest(signature)

    def work() -> list[torch.Tensor]:
        begun = ps.transport.watch.begun
        try:
            if len(wires) == 1 and contexts[0] is None:     # straight from input to output
                out = tensors[0] if in_place and same_memory(wires[0], tensors[0]) \
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


def reducescatter_work(tensors: Sequence[torch.Tensor], name: Optional[str], op: Any,
                       prescale_factor: float, postscale_factor: float,
                       compression: type[Compressor], process_set: ProcessSet,
                       kind: str = "reducescatter") -> Work:
    """Reduce each tensor over the set; set rank r keeps the r-th block of rows of each (lower
    ranks get the extra rows). The result is the list of this rank's blocks."""
    ps = active(process_set, f"{kind}()")
    names = group_names(ps, name, kind, max(len(tensors), 1))
    with refusing(ps, names[0], kind):
        if not tensors:
            raise ValueError(no_tensors(kind, ps))
        op = reduce_op(op, None, kind)
        checked = [checked_tensor(tensor, kind, each, ps) for tensor, each in zip(tensors, names)]
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
    dtype, shape = described(work_tensor)
    signature = {"collective": "reducescatter", "name": name, "tensors": count, "op": op.name,
                 "dtype": dtype, "shape": shape, "prescale": pre, "postscale": post}
    spec = ReduceSpec(work_tensor.dtype, op, pre, post, digest(signature), signature)
    rows = ring.balanced_counts(work_tensor.shape[0], ps.size)
    bounds = ring.chunk_bounds([r * math.prod(work_tensor.shape[1:]) for r in rows])
    start = sum(rows[:ps.rank])

    def scatter() -> torch.Tensor:
        ps.transport.reducescatter(as_array(work_tensor), bounds, spec)
        mine = work_tensor[start:start + rows[ps.rank]].clone()
        return on_callers_device(compression.decompress(mine, context), caller)

    return scatter


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
            t = checked_tensor(piece, "sparse_allreduce_async", f"{name}.{part}", ps)
        signature = {"collective": "sparse_allreduce", "name": name, "part": part,
                     "dense shape": dense_shape, "dtype": NAMES[t.dtype],
                     "trailing shape": tuple(t.shape[1:]), "op": op.name}
        gathers.append(functools.partial(ps.transport.allgather, t, signature))

    def work() -> torch.Tensor:
        indices, values = [gather() for gather in gathers]
        if op == ReduceOp.Average:
            values = values / ps.size
        return on_callers_device(torch.sparse_coo_tensor(indices.t(), values, dense_shape,
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
        row = checked_tensor(tensor.detach().reshape(1, -1), "allgather", name, ps, moves_only=True)
    signature = {"collective": kind, "name": name, "op": op_name,
                 "dtype": dtype_name(tensor.dtype), "shape": tuple(tensor.shape)}
    if root is not None:
        signature["root_rank"] = root

    def work() -> torch.Tensor:
        rows = as_callers(ps.transport.allgather(row, signature), tensor)
        return functools.reduce(fold, rows.unbind()).reshape(tensor.shape)

    return ps, name, work
