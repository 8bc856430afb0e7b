"""torch.distributed's arguments as ringreduce's: its ReduceOp as our op (and prescale), its
lists of one tensor per call, contiguous copies of the tensors gloo takes and ringreduce's
collectives refuse, and the size checks and copies of the backend's outputs, each error naming
the call (group.py's calls use these)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..api.collectives import Average, Max, Min, Product, Sum
from ..core.errors import ArgumentTypeError, UnsupportedError
from ..kernels.ops import ReduceOp

_RedOpType = dist.ReduceOp.RedOpType
SUM = _RedOpType.SUM
_OPS = {_RedOpType.SUM: Sum, _RedOpType.AVG: Average, _RedOpType.PRODUCT: Product,
        _RedOpType.MIN: Min, _RedOpType.MAX: Max}
_BITWISE = {_RedOpType.BAND: ("BAND", torch.bitwise_and), _RedOpType.BOR: ("BOR", torch.bitwise_or),
            _RedOpType.BXOR: ("BXOR", torch.bitwise_xor)}


def reduction(op: Any, what: str) -> tuple[ReduceOp, float]:
    """Our op and prescale factor for torch's ReduceOp (PREMUL_SUM: Sum, prescaled)."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    ours = _OPS.get(kind)
    if ours is not None:
        return ours, 1.0
    if kind == _RedOpType.PREMUL_SUM:
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise UnsupportedError(f"ringreduce backend: {what}: PREMUL_SUM takes one "
                                       "factor, not a tensor of several")
            factor = factor.item()
        return Sum, float(factor)
    name = getattr(kind, "name", str(kind))
    raise UnsupportedError(f"ringreduce backend: {what} with ReduceOp.{name} is not supported "
                           "(supported: SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM; BAND, BOR and "
                           "BXOR by all_reduce and reduce, of integer and bool tensors)")


def bitwise(op: Any) -> Optional[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]:
    """torch's BAND, BOR or BXOR as its name and the torch function that folds two tensors
    by it; None for another op."""
    return _BITWISE.get(op.op if isinstance(op, dist.ReduceOp) else op)


def logical(tensor: torch.Tensor, op: ReduceOp, pre: float,
            what: str) -> tuple[torch.Tensor, ReduceOp]:
    """A bool tensor reduced as gloo reduces one: SUM and MAX as "any", PRODUCT and MIN as
    "all", on its bytes (each 0 or 1) in place. Another op is the caller's mistake
    (ArgumentTypeError: the others' call is refused, active_set.refusing)."""
    if pre == 1.0 and op in (Sum, Max):
        return tensor.view(torch.uint8), Max
    if pre == 1.0 and op in (Product, Min):
        return tensor.view(torch.uint8), Min
    refused = "PREMUL_SUM" if pre != 1.0 else "AVG"     # (what reduction() leaves)
    raise ArgumentTypeError(f"ringreduce backend: {what} of a bool tensor takes SUM, MAX "
                            f"(any), PRODUCT or MIN (all), not {refused}")


def reducible(tensor: torch.Tensor, op: ReduceOp, pre: float,
              what: str) -> tuple[torch.Tensor, ReduceOp]:
    """`tensor` as ringreduce reduces it, and the op to reduce it by, as gloo reduces it: a
    bool one by `logical`; a complex one as its real and imaginary parts (torch's all_reduce
    does that before it calls the backend, its reduce and reduce_scatter do not), by SUM, AVG
    or PREMUL_SUM. `restored` views a result as the tensor's dtype again."""
    if tensor.dtype is torch.bool:
        return logical(tensor, op, pre, what)
    if tensor.is_complex():
        if op not in (Sum, Average):
            raise ArgumentTypeError(f"ringreduce backend: {what} of a complex tensor takes "
                                    f"SUM, AVG or PREMUL_SUM, not {op.name.upper()}")
        return torch.view_as_real(tensor), op
    return tensor, op


def all_reducible(tensors: Sequence[torch.Tensor], op: ReduceOp, pre: float,
                  what: str) -> tuple[list[torch.Tensor], ReduceOp]:
    """`reducible` for the tensors of one coalesced call, which reduce by one op: bool tensors
    mixed with others are refused."""
    reduced = [reducible(t, op, pre, what) for t in tensors]
    ops = {reduced_op for _, reduced_op in reduced}
    if len(ops) > 1:
        raise ArgumentTypeError(f"ringreduce backend: {what} mixes bool tensors with others: "
                                "pass one dtype")
    return [t for t, _ in reduced], ops.pop() if ops else op


def restored(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A result reduced as `reducible` made `like` reducible, viewed as `like`'s dtype."""
    if like.dtype is torch.bool:
        return result.view(torch.bool)
    if like.is_complex():
        return torch.view_as_complex(result.reshape(-1, 2))
    return result


def dense(tensors: Any, what: str) -> None:
    """ArgumentTypeError unless every tensor in `tensors` (nested lists) is dense: the calls
    other than all_reduce take no sparse tensors (nor does gloo)."""
    if isinstance(tensors, torch.Tensor):
        if tensors.layout is not torch.strided:
            raise ArgumentTypeError(f"ringreduce backend: {what} takes dense tensors, not "
                                    f"{tensors.layout} ones (all_reduce alone takes sparse "
                                    "COO tensors, as gloo)")
    elif isinstance(tensors, (list, tuple)):
        for t in tensors:
            dense(t, what)


def one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedError(f"ringreduce backend: {what} takes one tensor per call, got "
                               f"{len(tensors)} (one process per device)")
    return tensors[0]


def same_size(got: torch.Tensor, want: torch.Tensor, what: str, which: str) -> None:
    if got.numel() != want.numel() or got.dtype != want.dtype:
        raise ValueError(f"ringreduce backend: {what}: {which} is {got.dtype} "
                         f"{tuple(got.shape)}, but the input is {want.dtype} "
                         f"{tuple(want.shape)}; they must have the same dtype and size")


def worked_on(tensors: Sequence[torch.Tensor]
              ) -> tuple[list[torch.Tensor], Optional[Callable[[Any], None]]]:
    """The tensors an in-place call works on, and what writes them back when it is done (None:
    nothing to): gloo reduces and broadcasts tensors that are not contiguous, which
    ringreduce's collectives refuse (as Horovod's), so each such tensor gets a contiguous copy,
    copied back into it."""
    targets = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    copied = [(t, c) for t, c in zip(tensors, targets) if c is not t]
    if not copied:
        return targets, None

    def write_back(_result: Any) -> None:
        for tensor, copy in copied:
            copy_into(tensor, copy)

    return targets, write_back


def copy_flat(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target` (any layout) takes `source`'s elements in order."""
    if target.is_contiguous():
        copy_into(target.view(-1), source.reshape(-1))
    else:
        copy_into(target, source.reshape(target.shape))


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target.copy_(source)`, also where `target` is an inference tensor (made under
    torch.inference_mode and handed to a collective after it), which gloo writes too."""
    if target.is_inference():
        with torch.inference_mode():
            target.copy_(source)
    else:
        target.copy_(source)
