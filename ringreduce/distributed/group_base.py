"""The base of a torch.distributed group on a ringreduce process set (group.py): what every
call stands on, point-to-point messages and the group's end."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core.errors import RingReduceError, UnsupportedError
from ..sets import world
from ..sets.active_set import ActiveSet, refusing
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active, close_group
from .arguments import copy_flat, dense, one, reduction, restored, same_size
from .point_to_point import Channel
from .work import CollectiveWork

BACKEND = "ringreduce"
DEVICES = ("cpu", "cuda")   # the tensors a group takes (CUDA ones through the GPU path)
SEQUENCE = "dist"       # the automatic names' prefix, one count for every kind of call


class GroupBase(dist.ProcessGroup):
    """What every call of a ringreduce group stands on: the process set it runs on (`process_set`
    holds the group's ranks in group-rank order), its names and devices, the checks and the
    Work its calls share, point-to-point messages (`channel`), and its end."""

    def __init__(self, rank: int, size: int, process_set: ProcessSet, channel: Channel,
                 label: str) -> None:
        super().__init__(rank, size)
        self._process_set, self._channel, self._label = process_set, channel, label
        self._closed = False
        self._running_on: Optional[ActiveSet] = None    # see _active

    # -------------------------------------------------- identity

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"RingReduceGroup({self._label}, rank {self.rank()} of {self.size()})"

    # torch keeps a group's name and description in its backends; a Python group keeps them
    # itself (C++ callers reach these through the trampoline, Python ones the properties).
    _group_name = _group_desc = ""

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    # torch's Python code asks a group which devices it serves and for each device's backend
    # (FSDP2's broadcast_from_rank0 loading, checkpoint's async_save, dist.breakpoint): a
    # group made in Python registers no C++ backend, so it answers itself, being its own
    # backend for each, one that cannot split (what split_group and init_process_group's
    # device_id read from a backend).
    supports_splitting = False

    @property
    def _device_types(self) -> list:
        return [torch.device(device) for device in DEVICES]

    def _get_backend(self, device: Any) -> "GroupBase":
        if torch.device(device).type not in DEVICES:
            raise RuntimeError(f"ringreduce backend: {self._label} has no backend for device "
                               f"{device} (it serves {', '.join(DEVICES)})")
        return self

    def _call(self, kind: str, *tensors: Any) -> tuple[ProcessSet, str, refusing]:
        """A call's set to run on, its automatic name ('dist.noname.<k>', the group's k-th
        call), taken before any check so that the rank keeps its place in the group's
        sequence, and what goes around its own argument checks (active_set.refusing: a
        mistake there makes the other ranks' call fail at once with a MismatchError quoting
        it). `tensors` (tensors, or lists of them, nested): the call's, which must be dense
        (all_reduce alone takes sparse ones, as gloo)."""
        ps = self._active(kind)
        name = ps.call_order_name(SEQUENCE)
        checks = refusing(ps, name, kind)
        with checks:
            dense(tensors, f"{kind} on rank {self.rank()}")
        return self._process_set, name, checks

    @property
    def process_set(self) -> ProcessSet:
        """The ringreduce process set this group runs on (the global one for the default
        group), for code that takes either (the Lightning strategy's collectives)."""
        return self._process_set

    def _active(self, kind: str) -> ActiveSet:
        """The set a call runs on: the one found last, while it is open (at a few
        microseconds a call, finding it again shows), else found again, or the error of a
        group destroyed or of a set closed since."""
        ps = self._running_on
        if ps is None or ps.closed:
            ps = self._running_on = self._find_active(kind)
        return ps

    def _find_active(self, kind: str) -> ActiveSet:
        if self._closed:
            raise RingReduceError(f"ringreduce backend: {kind} on {self._label}, which was "
                                  "destroyed (destroy_process_group)")
        try:
            return active(self._process_set, kind)
        except ValueError as exc:   # (torch made this group on its members: not one's mistake)
            if self._process_set is global_process_set:
                raise
            raise RingReduceError(
                f"ringreduce backend: {kind} on {self._label} on rank {world.rank()}: its "
                "process set closed when ringreduce shut down (shutdown(), or an elastic "
                "restart), and a group from dist.new_group() does not outlive it: make the "
                "group again with dist.new_group() after init()") from exc

    def _global(self, group_rank: int, what: str) -> int:
        ranks = self._process_set.ranks
        if not 0 <= group_rank < len(ranks):
            raise ValueError(f"ringreduce backend: {what} on rank {self.rank()}: root rank "
                             f"{group_rank} is not a rank of {self._label} "
                             f"(0..{len(ranks) - 1})")
        return ranks[group_rank]

    def _op(self, opts: Any, kind: str) -> tuple[Any, float]:
        """Our op and prescale factor for the call's torch ReduceOp (UnsupportedError naming
        the call and this rank where we have none)."""
        return reduction(opts.reduceOp, f"{kind} on rank {self.rank()}")

    def _one_per_rank(self, tensors: list, like: torch.Tensor, kind: str, side: str) -> None:
        """A call's list of `side` tensors ("input", "output") holds one per rank of the
        group, each the size of `like`."""
        if len(tensors) != self.size():
            raise ValueError(f"ringreduce backend: {kind} on rank {self.rank()} takes "
                             f"{self.size()} {side} tensors (one per rank of {self._label}), "
                             f"got {len(tensors)}")
        for i, t in enumerate(tensors):
            same_size(t, like, kind, f"{side} {i}")

    def _rows(self, input: torch.Tensor, kind: str) -> torch.Tensor:
        """A reduce-scatter's input as one row per rank (the signature then holds its shape,
        so a rank with another size is a MismatchError everywhere)."""
        if input.numel() % self.size():
            raise ValueError(f"ringreduce backend: {kind} on rank {self.rank()}: an input "
                             f"must hold a multiple of {self.size()} elements (a row per "
                             f"rank), got {input.numel()}")
        return input.detach().reshape(self.size(), -1).contiguous()

    def _check_output(self, output: torch.Tensor, arrived: torch.Tensor, kind: str) -> None:
        """Checks of torch's output tensors run when the collective is done, before they are
        written: a mistake made on one rank fails that rank's wait() alone, and the others'
        collective completes instead of waiting for a call that was never made."""
        if output.numel() != arrived.numel() or output.dtype != arrived.dtype:
            raise ValueError(f"ringreduce backend: {kind} on rank {self.rank()}: the output "
                             f"is {output.dtype} {tuple(output.shape)}, but {arrived.numel()} "
                             f"{arrived.dtype} elements arrived for it")

    def _written(self, handle: Any, outputs: list, kind: str,
                 sources: Optional[list] = None) -> CollectiveWork:
        """The Work of a coalesced call whose results (one per output) go into torch's
        output tensors, each checked first (`sources`: the tensors `reducible` made the
        results from, to view each as its source's dtype again)."""
        def finish(results: list) -> None:
            if sources is not None:
                results = [restored(r, source) for r, source in zip(results, sources)]
            for output, result in zip(outputs, results):
                self._check_output(output, result, kind)
            for output, result in zip(outputs, results):
                copy_flat(output, result)

        return CollectiveWork(handle, list(outputs), finish)

    # -------------------------------------------------- point to point

    def send(self, tensors: list, dst: int, tag: int) -> Any:
        return self._channel.send(one(tensors, "send"), dst, tag)

    def recv(self, tensors: list, src: int, tag: int) -> Any:
        return self._channel.recv(one(tensors, "recv"), src, tag)

    def recv_anysource(self, tensors: list, tag: int) -> Any:
        return self._channel.recv(one(tensors, "recv"), None, tag)

    # -------------------------------------------------- what is not supported

    def _start_coalescing(self, *args: Any) -> None:
        """A coalescing manager given a device (torch's older form) is refused. torch has
        opened the group's list of coalesced calls already: close it, or every later call on
        the group would join that list and never run."""
        dist.distributed_c10d._world.pg_coalesce_state.pop(self, None)
        raise UnsupportedError("ringreduce backend: a coalescing manager given a device is not "
                               "supported; leave out device= (its all_reduce, "
                               "all_gather_into_tensor or reduce_scatter_tensor calls are then "
                               "coalesced), or issue the calls one by one")

    _end_coalescing = _start_coalescing

    # -------------------------------------------------- the end

    def shutdown(self) -> None:
        """destroy_process_group: free the point-to-point communicator and close a subgroup's
        set (collective over its members). The default group's set, ringreduce's global one,
        stays for the Horovod-style API; ringreduce.shutdown() (or the interpreter's exit)
        ends it."""
        if self._closed:
            return
        self._closed, self._running_on = True, None
        if world.is_initialized():
            self._channel.free()
            if self._process_set is not global_process_set:
                close_group(self._process_set)
