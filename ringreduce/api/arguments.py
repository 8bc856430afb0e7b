"""A collective's arguments as the transport takes them, checked on the caller's thread: a
local mistake raises on the rank that made it, naming the tensor and the rank, before any of
its data moves (and meets the other ranks' call as a refusal: active_set.refusing). And the
results, back as the caller's dtype on the caller's device."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ..core.errors import ArgumentTypeError, NotContiguousError, UnsupportedError
from ..gpu import cuda
from ..kernels.buffers import CODES, NAMES, SUPPORTED
from ..kernels.ops import ReduceOp
from ..sets.active_set import ActiveSet
from ..sets.process_set import ProcessSet, global_process_set

# A collective that only moves data (allgather, broadcast, alltoall) takes any dtype whose
# element has one of these sizes (bool, uint16 to uint64, float8, complex64 ...): the transport
# moves a view of the same shape with this storage, and the signature names the real dtype.
_MOVED_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checked_tensor(tensor: Any, what: str, name: str, ps: ActiveSet,
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
        return cuda.device_tensor(tensor, what, ps.transport.moves_on_device)
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: tensor is on {tensor.device}; ringreduce reduces CPU and "
                         "CUDA tensors")
    return tensor.detach()


def on_callers_device(result: torch.Tensor, caller: torch.Tensor) -> torch.Tensor:
    """A result on the caller's tensor's device: a CUDA tensor's collective other than an
    allreduce works on a host copy (cuda.device_tensor)."""
    if not caller.is_cuda:
        return result
    moved = result.to(caller.device)
    cuda.landed((moved,))       # (this thread may be the engine's, its stream not the caller's)
    return moved


def as_callers(result: torch.Tensor, caller: torch.Tensor) -> torch.Tensor:
    """A moved result as the caller's tensor's dtype again (see `_MOVED_AS`), on its device."""
    return on_callers_device(result if result.dtype == caller.dtype else result.view(caller.dtype),
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


def refuse_adasum_off_global(op: ReduceOp, process_set: ProcessSet, kind: str, name: str,
                ps: ActiveSet) -> None:
    """Horovod's allreduces refuse Adasum on any set but the global one, before they look at
    the tensor (NotImplementedError; every member of the set alike)."""
    if op == ReduceOp.Adasum and process_set is not global_process_set:
        raise UnsupportedError(f"ringreduce: {kind} of tensor '{name}' on rank "
                               f"{ps.ranks[ps.rank]}: Adasum does not support non-global "
                               "process sets yet (as in Horovod); reduce on the global set")


def described(t: torch.Tensor) -> tuple:
    return (NAMES[t.dtype], tuple(t.shape))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.is_contiguous() and b.is_contiguous()
