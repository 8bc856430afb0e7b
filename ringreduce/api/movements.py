"""The work of the collectives that move data without reducing it: allgather, broadcast,
all-to-all, and the barrier. They take any dtype whose element has 1, 2, 4 or 8 bytes (moved
as integers of that size, the signature naming the real dtype)."""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..core.errors import ArgumentTypeError
from ..gpu import cuda
from ..kernels.buffers import dtype_name
from ..sets.active_set import ActiveSet, refusing
from ..sets.process_set import ProcessSet
from ..sets.process_sets import active
from .arguments import as_callers, checked_tensor, same_memory
from .work import Work, group_names, meet_failure, no_tensors, with_root


def allgather_work(tensors: Sequence[torch.Tensor], name: Optional[str],
                   process_set: ProcessSet, kind: str = "allgather",
                   root: Optional[int] = None) -> Work:
    """Concatenate every member's tensors along dimension 0, one allgather per tensor, all in
    one piece of work; its result is the list of outputs. `root`: see _with_root."""
    ps = active(process_set, f"{kind}()")
    names = group_names(ps, name, kind, max(len(tensors), 1))
    refusal, gathers = refusing(ps, names[0], kind), []
    if not tensors:
        with refusal:
            raise ValueError(no_tensors(kind, ps))
    for tensor, each in zip(tensors, names):
        with refusal:
            t = checked_tensor(tensor, kind, each, ps, moves_only=True)
        t = t.reshape(1) if t.dim() == 0 else t
        signature = with_root({"collective": "allgather", "name": each,
                                "tensors": len(tensors), "dtype": dtype_name(tensor.dtype),
                                "trailing shape": tuple(t.shape[1:])}, root)
        gathers.append((functools.partial(ps.transport.allgather, t, signature), tensor))

    def work() -> list[torch.Tensor]:
        return [as_callers(gather(), tensor) for gather, tensor in gathers]

    return ps, names[0], _after_caller(work, [gather.args[0] for gather, _ in gathers])


def _after_caller(work: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """`work`, after the caller's stream, where it moves CUDA tensors in device memory (the
    GPU node way: cuda.device_tensor)."""
    on_gpu = next((t for t in tensors if t.is_cuda), None)
    return work if on_gpu is None else cuda.after_caller(work, on_gpu.device)


def broadcast_work(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                   in_place: bool, kind: str, process_set: ProcessSet) -> Work:
    """Global rank `root_rank`'s tensor on every member: into a new tensor, or in place."""
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name(kind) if name is None else name
    with refusing(ps, name, kind):
        t = checked_tensor(tensor, kind, name, ps, moves_only=True)
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
            if ps.rank != root and not same_memory(out, tensor):   # (the root's is unchanged)
                with torch.no_grad():
                    tensor.copy_(as_callers(out, tensor))
                cuda.landed((tensor,))
            return tensor
        return as_callers(out.clone() if same_memory(out, tensor) else out, tensor)

    return ps, name, _after_caller(work, [t])


def alltoall_work(tensor: torch.Tensor, splits: Any, name: Optional[str],
                  process_set: ProcessSet, root: Optional[int] = None) -> Work:
    """The result is (output, received splits), as Horovod's handle gives: the received splits
    int32, on the device of a `splits` tensor (as Horovod's `splits.new()`), else the CPU.
    Rows past the sum of the splits are not sent. `root`: see _with_root."""
    ps = active(process_set, "alltoall()")
    name = ps.auto_name("alltoall") if name is None else name
    with refusing(ps, name, "alltoall"):
        t = checked_tensor(tensor, "alltoall", name, ps, moves_only=True)
        send_splits = _send_splits(t, splits, ps, name)
    t = t.narrow(0, 0, int(send_splits.sum()))
    splits_device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
    signature = with_root({"collective": "alltoall", "name": name,
                            "dtype": dtype_name(tensor.dtype),
                            "trailing shape": tuple(t.shape[1:])}, root)

    def work() -> tuple[torch.Tensor, torch.Tensor]:
        out, received = ps.transport.alltoall(t, send_splits, signature)
        return as_callers(out, tensor), torch.from_numpy(received).to(splits_device, torch.int32)

    return ps, name, work


def _send_splits(t: torch.Tensor, splits: Any, ps: ActiveSet, name: str) -> np.ndarray:
    """How many rows of `t` go to each member: `splits`, checked, or an even split (no
    splits, or empty ones, as Horovod reads them)."""
    where = f"ringreduce: alltoall of tensor '{name}' on rank {ps.ranks[ps.rank]}"
    if t.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension")
    given = None if splits is None else np.asarray(
        splits.tolist() if isinstance(splits, torch.Tensor) else splits)
    if given is None or given.size == 0:
        if t.shape[0] % ps.size:
            raise ValueError(f"{where}: dimension 0 ({t.shape[0]}) does not divide by the "
                             f"{ps.size} ranks; pass splits=")
        return np.full(ps.size, t.shape[0] // ps.size, dtype=np.int64)
    if given.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{where}: splits must be integers, got {given.tolist()!r}")
    send_splits = given.astype(np.int64).reshape(-1)
    if send_splits.size != ps.size or (send_splits < 0).any() or \
            send_splits.sum() > t.shape[0]:     # (fewer rows: the rest are not sent, as Horovod)
        raise ValueError(f"{where}: splits {send_splits.tolist()} must be {ps.size} "
                         f"non-negative counts summing to at most dimension 0 ({t.shape[0]})")
    return send_splits


def barrier_work(name: Optional[str], process_set: ProcessSet, kind: str) -> Work:
    """Every member reaches it (after the collectives each submitted before it); `kind` is
    the caller's, for errors."""
    ps = active(process_set, f"{kind}()")
    name = ps.auto_name("barrier") if name is None else name
    return ps, name, lambda: ps.transport.barrier({"collective": "barrier", "name": name})
