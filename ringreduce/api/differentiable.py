"""The collectives that autograd sees through: a `torch.autograd.Function` per collective, and
for each a function that applies it where an input needs a gradient, else runs the plain
collective. The public API (collectives.py) calls these when an input requires grad; each
backward calls them again, so a backward run with `create_graph=True` is differentiable too.

Each backward computes what Horovod's does (its allgather and broadcast average the incoming
gradients over the set); a forward runs the plain collective's work, autograd being off inside
it. Incoming gradients are made contiguous first: autograd hands over expanded or transposed
ones (`y.sum().backward()`), which the collectives refuse as Horovod's do.

Compression, as in Horovod, wraps the differentiated collective: ours (a cast) is applied
inside, and the backward casts alike; a compressor of the user's own (compression.custom) is
applied outside (`_around`), so autograd differentiates the user's compress and decompress.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..kernels.ops import ReduceOp
from ..sets.process_set import ProcessSet
from ..sets.process_sets import active
from .arguments import reduce_op
from .compression import Compression, Compressor, custom
from .movements import allgather_work, alltoall_work, broadcast_work
from .reductions import grouped_allreduce_work, reducescatter_work
from .small_path import reduce_now
from .work import run


def requires_grad(tensor: Any) -> bool:
    """Whether autograd must see through a collective of `tensor`."""
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def allreduce(tensor: torch.Tensor, average: Optional[bool], name: Optional[str],
              compression: type[Compressor], op: Any, prescale: float, postscale: float,
              process_set: ProcessSet) -> torch.Tensor:
    """(The public allreduce: a small one goes the small way, inside autograd's forward and
    backward too.)"""
    if requires_grad(tensor):
        if custom(compression):
            return _around(compression, [tensor], lambda wires: [allreduce(
                wires[0], average, name, Compression.none, op, prescale, postscale,
                process_set)])[0]
        return _AllreduceFunction.apply(tensor, average, name, compression, op, prescale,
                                        postscale, process_set)
    return reduce_now(active(process_set, "allreduce()"), tensor, name, op, average, prescale,
                      postscale, compression, False, process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool],
                      name: Optional[str], compression: type[Compressor], op: Any,
                      prescale: float, postscale: float,
                      process_set: ProcessSet) -> list[torch.Tensor]:
    if any(requires_grad(t) for t in tensors):
        if custom(compression):
            return _around(compression, tensors, lambda wires: grouped_allreduce(
                wires, average, name, Compression.none, op, prescale, postscale, process_set))
        return list(_GroupedAllreduceFunction.apply(
            (average, name, compression, op, prescale, postscale, process_set), *tensors))
    return run(grouped_allreduce_work(list(tensors), name, op, average, prescale, postscale,
                                      compression, False, "grouped_allreduce", process_set))


def allgather(tensors: Sequence[torch.Tensor], name: Optional[str], process_set: ProcessSet,
              kind: str) -> list[torch.Tensor]:
    """Allgathers of several tensors as one collective; `kind` names it, with or without
    autograd, so a rank whose tensor needs a gradient pairs with one whose does not."""
    if any(requires_grad(t) for t in tensors):
        return list(_AllgatherFunction.apply((name, process_set, kind), *tensors))
    return run(allgather_work(list(tensors), name, process_set, kind))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str],
              process_set: ProcessSet) -> torch.Tensor:
    if requires_grad(tensor):
        return _BroadcastFunction.apply(tensor, root_rank, name, process_set)
    return run(broadcast_work(tensor, root_rank, name, False, "broadcast", process_set))


def alltoall(tensor: torch.Tensor, splits: Any, name: Optional[str],
             process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the received splits."""
    if requires_grad(tensor):
        return _AlltoallFunction.apply(tensor, splits, name, process_set)
    return run(alltoall_work(tensor, splits, name, process_set))


def reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str],
                  compression: type[Compressor], op: Any, process_set: ProcessSet,
                  prescale: float, postscale: float, kind: str) -> list[torch.Tensor]:
    """Reduce-scatters of several tensors as one collective; `kind` names it."""
    if any(requires_grad(t) for t in tensors):
        if custom(compression):
            return _around(compression, tensors, lambda wires: reducescatter(
                wires, name, Compression.none, op, process_set, prescale, postscale, kind))
        return list(_ReducescatterFunction.apply(
            (name, compression, op, process_set, prescale, postscale, kind), *tensors))
    return run(reducescatter_work(list(tensors), name, op, prescale, postscale, compression,
                                  process_set, kind))


def _around(compression: Any, tensors: Sequence[torch.Tensor], collective: Any
            ) -> list[torch.Tensor]:
    """Horovod's order for a compressor of the user's own: compress each tensor, run the
    collective on what it gives, decompress each result; autograd sees all three."""
    pairs = [compression.compress(t) for t in tensors]
    results = collective([wire for wire, _ in pairs])
    return [compression.decompress(r, context) for r, (_, context) in zip(results, pairs)]


class _AllreduceFunction(torch.autograd.Function):
    """d(allreduce)/dx is the same allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, tensor, average, name, compression, op, pre, post, process_set):
        ctx.args = (average, compression, op, pre, post, process_set)
        return allreduce(tensor, average, name, compression, op, pre, post, process_set)

    @staticmethod
    def backward(ctx, grad):
        average, compression, op, pre, post, process_set = ctx.args
        return (allreduce(grad.contiguous(), average, None, compression, op, pre, post,
                          process_set),
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
        return (None, *grouped_allreduce([g.contiguous() for g in grads], average, None,
                                         compression, op, pre, post, process_set))


class _AllgatherFunction(torch.autograd.Function):
    """Each input's gradient is its rows of the incoming gradients averaged over the set."""

    @staticmethod
    def forward(ctx, args, *tensors):
        name, process_set, kind = args
        ctx.process_set = process_set
        ctx.shapes = [t.shape for t in tensors]
        return tuple(allgather(tensors, name, process_set, kind))

    @staticmethod
    def backward(ctx, *grads):
        ps = active(ctx.process_set, "allgather backward")
        averaged = grouped_allreduce([g.contiguous() for g in grads], None, None,
                                     Compression.none, ReduceOp.Average, 1.0, 1.0,
                                     ctx.process_set)
        rows = [s[0] if len(s) else 1 for s in ctx.shapes]
        everyone = run(allgather_work([torch.tensor([rows], dtype=torch.int64)], None,
                                      ctx.process_set))[0]
        starts = everyone[:ps.rank].sum(0).tolist()
        parts = [a.narrow(0, start, count).reshape(shape)
                 for a, start, count, shape in zip(averaged, starts, rows, ctx.shapes)]
        return (None, *parts)


class _BroadcastFunction(torch.autograd.Function):
    """Only the root's input reaches the outputs: it gets the incoming gradients averaged over
    the set, the others that average times 0, as Horovod's (`grad_reduced *= 0`: zeros, and
    NaN where the average is infinite or NaN)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        averaged = allreduce(grad.contiguous(), None, None, Compression.none, ReduceOp.Average,
                             1.0, 1.0, ctx.process_set)
        ps = active(ctx.process_set, "broadcast backward")
        if ps.ranks[ps.rank] != ctx.root:
            averaged.mul_(0)
        return averaged, None, None, None


class _AlltoallFunction(torch.autograd.Function):
    """The incoming gradients go back where their rows came from: an all-to-all by the
    received splits; rows that were not sent (past the sum of the splits) get zeros."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = alltoall(tensor, splits, name, process_set)
        ctx.received, ctx.process_set, ctx.rows = received, process_set, tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received):
        back, _ = alltoall(grad.contiguous(), ctx.received, None, ctx.process_set)
        unsent = ctx.rows - back.shape[0]
        if unsent:
            back = torch.cat([back, back.new_zeros((unsent, *back.shape[1:]))])
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
        ctx.sum, ctx.pre, ctx.post = op == ReduceOp.Sum, pre, post
        return tuple(reducescatter(tensors, name, compression, op, process_set, pre, post, kind))

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
        gathered = allgather(scaled, None, ctx.process_set, "grouped_allgather")
        return (None, *gathered)
