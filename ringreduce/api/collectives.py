"""The public tensor collectives, with Horovod's names and semantics, on a process set.

Each function picks how its call runs: through autograd where an input needs a gradient
(differentiable.py), an allreduce by the one dispatch (small_path.py: the small way where a
small allreduce qualifies), else the collective's work (reductions.py, movements.py: arguments
checked on the caller's thread, then the set's transport moves the data), run at once or
queued on the set's engine.

A name the caller gives is qualified by the collective's kind, as Horovod's are
(`allreduce.w`, `allgather.w`): collectives of different kinds may share a name, and in-place
and differentiable variants of one kind pair with each other under it. Front ends with names of
their own (distributed/group.py) make the collectives' work directly.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..kernels.ops import ReduceOp
from ..sets.handles import Handle
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active, global_set
from ..transport.signature import qualified
from . import differentiable
from .compression import Compression, Compressor
from .movements import allgather_work, alltoall_work, barrier_work, broadcast_work
from .reductions import grouped_allreduce_work, reducescatter_work, sparse_allreduce_work
from .small_path import reduce_later, reduce_now
from .work import first, run, submit, tupled

# Horovod's names for the operations, as module constants
Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product


# ---------------------------------------------------------------- allreduce

def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                    compression: type[Compressor] = Compression.none) -> Handle:
    """Start an allreduce of `tensor`; `synchronize(handle)` returns a new reduced tensor."""
    return reduce_later(active(process_set, "allreduce_async()"), tensor,
                        qualified("allreduce", name), op, average, prescale_factor,
                        postscale_factor, compression, False, process_set)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce; `tensor` is overwritten when the handle completes."""
    return reduce_later(active(process_set, "allreduce_async_()"), tensor,
                        qualified("allreduce", name), op, average, prescale_factor,
                        postscale_factor, Compression.none, True, process_set)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the set's ranks and return the result (differentiable)."""
    name = qualified("allreduce", name)
    return differentiable.allreduce(tensor, average, name, compression, op, prescale_factor,
                                    postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the set's ranks in place and return it."""
    return reduce_now(active(process_set, "allreduce_()"), tensor, qualified("allreduce", name),
                      op, average, prescale_factor, postscale_factor, Compression.none, True,
                      process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            compression: type[Compressor] = Compression.none) -> Handle:
    """Start one fused allreduce of several tensors; the handle yields a tuple of results."""
    name = qualified("grouped_allreduce", name)
    return submit(tupled(grouped_allreduce_work(list(tensors), name, op, average,
                                                prescale_factor, postscale_factor, compression,
                                                False, "grouped_allreduce", process_set)))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """Start one fused in-place allreduce of several tensors; the handle yields them, a
    tuple."""
    name = qualified("grouped_allreduce", name)
    return submit(tupled(grouped_allreduce_work(list(tensors), name, op, average,
                                                prescale_factor, postscale_factor,
                                                Compression.none, True, "grouped_allreduce_",
                                                process_set)))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors in one fused allreduce (differentiable)."""
    name = qualified("grouped_allreduce", name)
    return differentiable.grouped_allreduce(tensors, average, name, compression, op,
                                            prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set
                       ) -> tuple[torch.Tensor, ...]:
    """Reduce several tensors in one fused allreduce, in place, and return them (a tuple, as
    Horovod's)."""
    name = qualified("grouped_allreduce", name)
    return tuple(run(grouped_allreduce_work(list(tensors), name, op, average, prescale_factor,
                                            postscale_factor, Compression.none, True,
                                            "grouped_allreduce_", process_set)))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: ProcessSet = global_process_set) -> Callable[[], Any]:
    """Reduce a sparse COO tensor as Horovod does: allgather every member's indices and
    values (both checked under `name`); the result holds them all (duplicate indices add up
    when coalesced), values divided by the set's size for Average.

    Returns, as Horovod's, a function: `handle()` waits and returns the sparse result (it also
    has `wait()` and `done()`, so `synchronize(handle)` and `poll(handle)` work). The members'
    dense shapes must agree (they are part of the signature): otherwise every member raises
    MismatchError naming the tensor and each rank's shape."""
    name = qualified("sparse_allreduce", name)
    submitted = submit(sparse_allreduce_work(tensor, name, op, process_set))

    def handle() -> torch.Tensor:
        return submitted.wait()

    handle.wait, handle.done = submitted.wait, submitted.done
    return handle


# ---------------------------------------------------------------- allgather

def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every member's `tensor` along dimension 0 (sizes may differ
    there)."""
    name = qualified("allgather", name)
    return submit(first(allgather_work([tensor], name, process_set)))


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's `tensor` along dimension 0 (differentiable: the gradient is
    this rank's rows of the incoming gradients averaged over the set, as Horovod's)."""
    name = qualified("allgather", name)
    return differentiable.allgather([tensor], name, process_set, "allgather")[0]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start allgathers of several tensors as one collective; the handle yields a tuple."""
    name = qualified("grouped_allgather", name)
    return submit(tupled(allgather_work(list(tensors), name, process_set, "grouped_allgather")))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set
                      ) -> tuple[torch.Tensor, ...]:
    """Allgather several tensors as one collective (differentiable; a tuple, as Horovod's)."""
    name = qualified("grouped_allgather", name)
    return tuple(differentiable.allgather(tensors, name, process_set, "grouped_allgather"))


# ---------------------------------------------------------------- broadcast

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start sending global rank `root_rank`'s `tensor` to every member, into a new tensor."""
    name = qualified("broadcast", name)
    return submit(broadcast_work(tensor, root_rank, name, False, "broadcast", process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start overwriting `tensor` with global rank `root_rank`'s values, in place."""
    name = qualified("broadcast", name)
    return submit(broadcast_work(tensor, root_rank, name, True, "broadcast_", process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return global rank `root_rank`'s `tensor` on every member (differentiable)."""
    name = qualified("broadcast", name)
    return differentiable.broadcast(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with global rank `root_rank`'s values, in place, and return it."""
    name = qualified("broadcast", name)
    return run(broadcast_work(tensor, root_rank, name, True, "broadcast_", process_set))


# ---------------------------------------------------------------- alltoall

def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an all-to-all: rows splits[i] go to member i (rows past their sum are not sent);
    rows from every member come back in member order. Without splits, dimension 0 is divided
    equally. `synchronize(handle)` returns (output, received_splits), with or without splits,
    as Horovod's does."""
    name = qualified("alltoall", name)
    return submit(alltoall_work(tensor, splits, name, process_set))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """All-to-all; returns the output, and the received splits too when `splits` is given, as
    Horovod's (differentiable: the gradient goes back by the all-to-all of the received
    splits; rows that were not sent get zeros)."""
    name = qualified("alltoall", name)
    out, received = differentiable.alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# ---------------------------------------------------------------- reducescatter

def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reduce-scatter: reduce over the set's ranks, and set rank r keeps the r-th block
    of rows (dimension 0 divided as evenly as possible, lower ranks getting the extra rows)."""
    name = qualified("reducescatter", name)
    return submit(first(reducescatter_work([tensor], name, op, prescale_factor,
                                           postscale_factor, Compression.none, process_set)))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce-scatter (differentiable: the gradient is the allgather of the incoming ones,
    scaled as the forward scaled)."""
    name = qualified("reducescatter", name)
    return differentiable.reducescatter([tensor], name, compression, op, process_set,
                                        prescale_factor, postscale_factor, "reducescatter")[0]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start reduce-scatters of several tensors as one collective; the handle yields a
    tuple."""
    name = qualified("grouped_reducescatter", name)
    return submit(tupled(reducescatter_work(list(tensors), name, op, prescale_factor,
                                            postscale_factor, Compression.none, process_set,
                                            "grouped_reducescatter")))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter several tensors as one collective (differentiable)."""
    name = qualified("grouped_reducescatter", name)
    return differentiable.reducescatter(tensors, name, compression, op, process_set,
                                        prescale_factor, postscale_factor,
                                        "grouped_reducescatter")


# ---------------------------------------------------------------- join, barrier, handles

def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """This rank has run out of data: until every rank of the set has joined, it takes part in
    the others' allreduces with zeros (Average still divides by the set's size), so ranks with
    fewer batches need not stop the others; other collectives raise JoinedError meanwhile.
    Blocks until every rank has joined; returns the rank that joined last, on every rank.
    `device`: where to make the zeros for GPU allreduces (-1: the current CUDA device)."""
    ps = active(process_set, "join()")
    where = zeros_device(device, global_set("join()").local.rank)
    return ps.engine.run(ps.auto_name("join"), lambda: ps.join(where))


def zeros_device(device: int, local_rank: int) -> Optional[torch.device]:
    """Where a joined rank makes its zeros for the others' GPU allreduces: GPU `device`; for -1,
    this thread's current one (the engine thread's may be another), or, where this process has
    not touched CUDA, the GPU of its local rank (as `set_device(local_rank())` picks it) rather
    than GPU 0, which on a shared node is another rank's; None without CUDA."""
    if device < 0 and torch.cuda.is_available():
        device = (torch.cuda.current_device() if torch.cuda.is_initialized()
                  else local_rank % torch.cuda.device_count())
    return torch.device("cuda", device) if device >= 0 else None


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member reaches this point (after all collectives submitted before it)."""
    run(barrier_work(None, process_set, "barrier"))


def barrier_async(name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set) -> Handle:
    """Start a barrier; its handle completes once every member has reached it (after the
    collectives each submitted before it). An extension: Horovod's barrier blocks."""
    name = qualified("barrier", name)
    return submit(barrier_work(name, process_set, "barrier_async"))


def poll(handle: Handle) -> bool:
    """True when the collective behind `handle` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Optional[Handle]) -> Any:
    """Wait for the collective behind `handle`; return its result or raise its error. None
    for None, as Horovod's gives (a script may keep None for a collective it skipped)."""
    return None if handle is None else handle.wait()
