"""A torch.distributed ProcessGroup on a ringreduce process set: how torch's collectives become
ours (ringreduce/distributed/__init__.py registers it as the backend "ringreduce").

Each collective becomes one of ringreduce's public collectives on the group's set, so it takes
the same transport, signature check (MismatchError on every rank), stall report and bitwise-
identical results as the Horovod-style API. torch's calls carry no names: each gets the set's
next automatic name ('dist.noname.7'), counted over calls of every kind, so members pair them
by their position in the group's sequence, the order torch requires of every rank; a rank whose
call at a position is of another kind (a barrier where the others all_reduce) then fails the
signature check on every rank (MismatchError), where a count per kind would leave both waiting
for calls never made. Gathers send one row per rank (the signature then holds the whole shape),
gather is an allgather whose root keeps the rows, reduce-scatters reduce one row per rank,
reduce is an allreduce whose root keeps the result, scatter an all-to-all in which only the
root sends, and a sparse all_reduce gathers every rank's entries (Horovod's sparse allreduce)
and writes their coalesced sum over the input, as gloo does; so do all_reduce and reduce
with BAND, BOR or BXOR (ops ours lack), folding the rows in rank order. Each call returns a
`CollectiveWork` (torch_work.py); a synchronous `all_reduce` runs as `allreduce_`. send/recv:
MPI point-to-point on a communicator of the group's own (point_to_point.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..api.collectives import Average, Sum
from ..api.compression import Compression
from ..api.movements import allgather_work, alltoall_work, barrier_work, broadcast_work
from ..api.reductions import (allreduce_work, bitwise_allreduce_work, grouped_allreduce_work,
                              reducescatter_work, sparse_allreduce_work)
from ..api.small_path import reduce_later, reduce_now, started
from ..api.work import first, submit
from ..core.errors import RingReduceError, UnsupportedError
from ..sets import world
from ..sets.active_set import ActiveSet, refusing
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active, close_group
from .arguments import (SUM, all_reducible, bitwise, copy_flat, dense, one, reducible, reduction,
                        restored, same_size, worked_on)
from .point_to_point import Channel
from .work import FINISHED, CollectiveWork

BACKEND = "ringreduce"
DEVICES = ("cpu", "cuda")   # the tensors a group takes (CUDA ones through the GPU path)
_BOOL = torch.bool
_SPARSE = torch.sparse_coo
_SEQUENCE = "dist"      # the automatic names' prefix, one count for every kind of call


# ---------------------------------------------------------------- the process group

class RingReduceGroup(dist.ProcessGroup):
    """A torch.distributed process group on a ringreduce process set: `process_set` holds
    the group's ranks in group-rank order, `channel` its point-to-point messages."""

    def __init__(self, rank: int, size: int, process_set: ProcessSet, channel: Channel,
                 label: str) -> None:
        super().__init__(rank, size)
        self._process_set, self._channel, self._label = process_set, channel, label
        self._closed = False

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

    def _get_backend(self, device: Any) -> "RingReduceGroup":
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
        name = ps.call_order_name(_SEQUENCE)
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

    # -------------------------------------------------- reductions

    def allreduce(self, tensors: list, opts: Any = None) -> CollectiveWork:
        """(DDP's every bucket, and small ones cost what this adds to our collective: the
        common case takes the fewest steps.)"""
        ps = self._active("allreduce")
        name = ps.call_order_name(_SEQUENCE)
        # (ReduceOp == RedOpType: the cheapest test torch's bindings offer)
        if len(tensors) == 1 and (opts is None or opts.reduceOp == SUM):
            tensor, op, pre = tensors[0], Sum, 1.0
            if opts is None or getattr(opts, "asyncOp", True):     # (torch >= 2.8 has it)
                handle = started(ps, tensor, name, Sum, 1.0)    # small: it checks the tensor
                if handle is not None:
                    return CollectiveWork(handle, tensors)
        else:
            with refusing(ps, name, "allreduce"):
                tensor = one(tensors, "allreduce")
                folding = None if opts is None else bitwise(opts.reduceOp)
                if folding is None:
                    op, pre = (Sum, 1.0) if opts is None else self._op(opts, "allreduce")
            if folding is not None:
                return self._bitwise(name, tensor, folding)
        if tensor.layout is _SPARSE:
            return self._sparse_allreduce(ps, name, tensor, op, pre)
        write_back = None
        if not tensor.is_contiguous():      # (the common case pays for this test alone)
            (tensor,), write_back = worked_on([tensor])
        if tensor.dtype is _BOOL or tensor.is_complex():   # (complex: a call on the group
            # itself; dist.all_reduce makes a complex tensor real first)
            with refusing(ps, name, "allreduce"):
                tensor, op = reducible(tensor, op, pre, f"allreduce on rank {self.rank()}")
        if opts is not None and not getattr(opts, "asyncOp", True):    # (torch >= 2.8 has it)
            # dist.all_reduce(t) waits at once: the synchronous call runs on this thread when
            # the set's engine is idle (the handle's queue costs as much as a small allreduce)
            reduce_now(ps, tensor, name, op, None, pre, 1.0, Compression.none, True,
                       self._process_set)
            if write_back is not None:
                with torch.no_grad():       # (as the asynchronous Work writes it)
                    write_back(None)
            return CollectiveWork(FINISHED, tensors)
        handle = reduce_later(ps, tensor, name, op, None, pre, 1.0, Compression.none, True,
                              self._process_set)
        return CollectiveWork(handle, tensors, write_back)

    def _sparse_allreduce(self, ps: ActiveSet, name: str, tensor: torch.Tensor, op: Any,
                          pre: float) -> CollectiveWork:
        """A sparse COO tensor (DDP's bucket for a sparse embedding's gradient) as gloo
        reduces one: every member's entries gathered (Horovod's sparse allreduce,
        collective_work.sparse_allreduce_work), their sum coalesced and written over the
        input. SUM, AVG and PREMUL_SUM; another op is a mistake refused to the others."""
        with refusing(ps, name, "sparse_allreduce"):
            if op not in (Sum, Average):
                raise UnsupportedError(f"ringreduce backend: allreduce of a sparse tensor on "
                                       f"rank {self.rank()} takes SUM, AVG or PREMUL_SUM, not "
                                       f"{op.name.upper()}")
        scaled = tensor if pre == 1.0 else tensor * pre
        handle = submit(sparse_allreduce_work(scaled, name, op, self._process_set))

        def finish(result: torch.Tensor) -> None:
            tensor.copy_(result.coalesce())

        return CollectiveWork(handle, [tensor], finish)

    def _bitwise(self, name: str, tensor: torch.Tensor, folding: tuple,
                 root: Optional[int] = None) -> CollectiveWork:
        """BAND, BOR or BXOR (`folding`: bitwise()) of an integer or bool tensor, as gloo has
        them (collective_work.bitwise_allreduce_work), its result written over the tensor;
        for reduce, on group rank `root` alone (checked by the caller)."""
        op_name, fold = folding
        handle = submit(bitwise_allreduce_work(
            tensor, name, op_name, fold, self._process_set,
            None if root is None else self._process_set.ranks[root]))

        def finish(result: torch.Tensor) -> None:
            if root is None or self.rank() == root:
                tensor.copy_(result)

        return CollectiveWork(handle, [tensor], finish)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> CollectiveWork:
        what = "allreduce_coalesced"
        ps, name, checks = self._call(what, tensors)
        targets, write_back = worked_on(tensors)
        with checks:
            op, pre = self._op(opts, what) if opts is not None else (Sum, 1.0)
            targets, op = all_reducible(targets, op, pre, f"{what} on rank {self.rank()}")
        handle = submit(grouped_allreduce_work(targets, name, op, None, pre, 1.0,
                                               Compression.none, True, "grouped_allreduce_",
                                               ps))
        return CollectiveWork(handle, tensors, write_back)

    def reduce(self, tensors: list, opts: Any) -> CollectiveWork:
        """An allreduce whose result only the root keeps."""
        ps, name, checks = self._call("reduce", tensors)
        with checks:
            tensor = one(tensors, "reduce")
            root = opts.rootRank
            root_rank = self._global(root, "reduce")
            folding = bitwise(opts.reduceOp)
            if folding is None:
                op, pre = self._op(opts, "reduce")
                tensor, op = reducible(tensor, op, pre, f"reduce on rank {self.rank()}")
        if folding is not None:
            return self._bitwise(name, tensor, folding, root)
        handle = submit(allreduce_work(tensor.contiguous(), None, name, op, pre, 1.0,
                                       Compression.none, False, ps, root_rank))

        def finish(result: torch.Tensor) -> None:
            if self.rank() == root:
                tensor.copy_(result)

        return CollectiveWork(handle, tensors, finish)

    def reduce_scatter(self, output_tensors: list, input_tensors: list,
                       opts: Any) -> CollectiveWork:
        kind = "reduce_scatter"
        _, name, checks = self._call(kind, output_tensors, input_tensors)
        with checks:
            output, inputs = one(output_tensors, kind), one(input_tensors, kind)
            self._one_per_rank(inputs, inputs[0], kind, "input")
            stacked = torch.stack([t.detach().reshape(-1) for t in inputs])
            return self._reduce_scatter(output, stacked, opts, kind, output_tensors, name)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any) -> CollectiveWork:
        kind = "reduce_scatter_tensor"
        _, name, checks = self._call(kind, output, input)
        with checks:
            return self._reduce_scatter(output, self._rows(input, kind), opts, kind, [output],
                                        name)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor, opts: Any, kind: str,
                        value: list, name: str) -> CollectiveWork:
        """Row r of `rows` reduced over the group lands in rank r's `output`."""
        op, pre = self._op(opts, kind)
        reduced, op = reducible(rows, op, pre, f"{kind} on rank {self.rank()}")
        handle = submit(first(reducescatter_work([reduced], name, op, pre, 1.0,
                                                 Compression.none, self._process_set)))

        def finish(mine: torch.Tensor) -> None:
            mine = restored(mine, rows)
            self._check_output(output, mine, kind)
            copy_flat(output, mine)

        return CollectiveWork(handle, value, finish)

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list,
                                        opts: Any) -> CollectiveWork:
        what = "reduce_scatter_tensor_coalesced"
        ps, name, checks = self._call(what, outputs, inputs)
        with checks:
            rows = [self._rows(i, what) for i in inputs]
            op, pre = self._op(opts, what)
            reduced, op = all_reducible(rows, op, pre, f"{what} on rank {self.rank()}")
            handle = submit(reducescatter_work(reduced, name, op, pre, 1.0, Compression.none,
                                               ps, "grouped_reducescatter"))
        return self._written(handle, outputs, what, rows)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -------------------------------------------------- gathers and broadcasts

    def broadcast(self, tensors: list, opts: Any) -> CollectiveWork:
        ps, name, checks = self._call("broadcast", tensors)
        with checks:
            tensor = one(tensors, "broadcast")
            root = self._global(opts.rootRank, "broadcast")
        (target,), write_back = worked_on([tensor])
        handle = submit(broadcast_work(target, root, name, True, "broadcast_", ps))
        return CollectiveWork(handle, tensors, write_back)

    def allgather(self, output_tensors: list, input_tensors: list,
                  opts: Any = None) -> CollectiveWork:
        ps, name, checks = self._call("allgather", output_tensors, input_tensors)
        with checks:
            outputs, tensor = one(output_tensors, "allgather"), one(input_tensors, "allgather")
        return self._gather_rows(ps, name, tensor, "allgather", outputs, outputs)

    def gather(self, output_tensors: list, input_tensors: list, opts: Any) -> CollectiveWork:
        """Every rank's tensor, kept by the root (an allgather)."""
        ps, name, checks = self._call("gather", output_tensors, input_tensors)
        with checks:
            tensor, root = one(input_tensors, "gather"), opts.rootRank
            root_rank = self._global(root, "gather")
            outputs = one(output_tensors, "gather") if self.rank() == root else None
        return self._gather_rows(ps, name, tensor, "gather", outputs or [], outputs,
                                 root_rank)

    def _gather_rows(self, ps: ProcessSet, name: str, tensor: torch.Tensor, kind: str,
                     value: list, outputs: Optional[list],
                     root_rank: Optional[int] = None) -> CollectiveWork:
        """Each rank's `tensor` as one row (the signature then holds its whole shape, so a
        rank with another shape is a MismatchError everywhere); row r goes to outputs[r]
        (None: kept nowhere). `root_rank`: a gather's, global."""
        handle = submit(first(allgather_work([tensor.detach().unsqueeze(0).contiguous()], name,
                                             ps, root=root_rank)))

        def finish(rows: torch.Tensor) -> None:
            if outputs is None:
                return
            if len(outputs) != len(rows):
                raise ValueError(f"ringreduce backend: {kind} on rank {self.rank()} takes "
                                 f"{len(rows)} output tensors (one per rank of "
                                 f"{self._label}), got {len(outputs)}")
            for out, row in zip(outputs, rows):
                self._check_output(out, row, kind)
            for out, row in zip(outputs, rows):
                copy_flat(out, row)

        return CollectiveWork(handle, value, finish)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> CollectiveWork:
        what = "all_gather_into_tensor"
        ps, name, _ = self._call(what, output, input)
        handle = submit(first(allgather_work([input.detach().unsqueeze(0).contiguous()], name,
                                             ps)))

        def finish(rows: torch.Tensor) -> None:
            self._check_output(output, rows, what)
            copy_flat(output, rows)

        # (the future's value: the output's chunk per rank, as gloo's)
        return CollectiveWork(handle, list(output.tensor_split(self.size())), finish)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list, inputs: list,
                                    opts: Any = None) -> CollectiveWork:
        what = "all_gather_into_tensor_coalesced"
        ps, name, _ = self._call(what, outputs, inputs)
        rows = [i.detach().unsqueeze(0).contiguous() for i in inputs]
        handle = submit(allgather_work(rows, name, ps, "grouped_allgather"))
        return self._written(handle, outputs, what)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list, inputs: list,
                            opts: Any = None) -> CollectiveWork:
        """Rank r's inputs[i] lands in output_lists[r][i]."""
        ps, name, checks = self._call("allgather_coalesced", output_lists, inputs)
        with checks:
            if len(output_lists) != self.size() or any(len(o) != len(inputs)
                                                       for o in output_lists):
                raise ValueError(f"ringreduce backend: allgather_coalesced on rank "
                                 f"{self.rank()} takes {self.size()} output lists of "
                                 f"{len(inputs)} tensors")
        rows = [i.detach().unsqueeze(0).contiguous() for i in inputs]
        handle = submit(allgather_work(rows, name, ps, "grouped_allgather"))

        def finish(gathered: list) -> None:
            for i, rows in enumerate(gathered):
                for r, row in enumerate(rows):
                    copy_flat(output_lists[r][i], row)

        return CollectiveWork(handle, output_lists, finish)

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any) -> CollectiveWork:
        """The root's inputs[r] lands in rank r's output: an all-to-all in which only the
        root sends (one row to each rank)."""
        ps, name, checks = self._call("scatter", output_tensors, input_tensors)
        with checks:
            output, root = one(output_tensors, "scatter"), opts.rootRank
            root_rank = self._global(root, "scatter")
            shape = tuple(output.shape)
            if self.rank() == root:
                inputs = one(input_tensors, "scatter")
                self._one_per_rank(inputs, output, "scatter", "input")
                rows = torch.stack([t.detach().reshape(shape) for t in inputs])
                splits = [1] * self.size()
            else:
                rows, splits = output.new_empty((0, *shape)), [0] * self.size()
            handle = submit(alltoall_work(rows, splits, name, ps, root_rank))
        return CollectiveWork(handle, output_tensors,
                              lambda result: copy_flat(output, result[0]))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list,
                          opts: Any = None) -> CollectiveWork:
        what = "all_to_all_single"
        n = self.size()
        ps, name, checks = self._call(what, output, input)
        with checks:
            if input_split_sizes:
                splits = list(input_split_sizes)
                if input.dim() == 0 or sum(splits) != input.shape[0]:   # (as gloo checks)
                    raise ValueError(f"ringreduce backend: {what} on rank {self.rank()}: "
                                     f"input_split_sizes {splits} do not sum to dimension 0 "
                                     f"of the input ({tuple(input.shape)})")
            elif input.dim() > 0 and input.shape[0] % n == 0:
                splits = [input.shape[0] // n] * n
            else:
                raise ValueError(f"ringreduce backend: {what} on rank {self.rank()}: dimension "
                                 f"0 of the input ({tuple(input.shape)}) does not divide by the "
                                 f"{n} ranks; pass input_split_sizes")
            handle = submit(alltoall_work(input.detach().contiguous(), splits, name, ps))
        wanted = list(output_split_sizes) if output_split_sizes else None

        def finish(result: tuple) -> None:
            out, received = result
            if wanted is not None and received.tolist() != wanted:
                raise ValueError(f"ringreduce backend: {what} on rank {self.rank()}: "
                                 f"output_split_sizes {wanted}, but the ranks sent "
                                 f"{received.tolist()} rows")
            if out.numel() != output.numel():
                raise ValueError(f"ringreduce backend: {what} on rank {self.rank()}: "
                                 f"{out.numel()} elements arrived for an output of "
                                 f"{output.numel()}")
            copy_flat(output, out)

        return CollectiveWork(handle, [output], finish)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list, input_tensors: list,
                 opts: Any = None) -> CollectiveWork:
        """inputs[r] goes to rank r; rank r's lands in outputs[r] (flattened on the way)."""
        n = self.size()
        ps, name, checks = self._call("all_to_all", output_tensors, input_tensors)
        with checks:
            if len(output_tensors) != n or len(input_tensors) != n:
                raise ValueError(f"ringreduce backend: all_to_all on rank {self.rank()} takes "
                                 f"{n} input and {n} output tensors")
            flat = torch.cat([t.detach().reshape(-1) for t in input_tensors])
            handle = submit(alltoall_work(flat, [t.numel() for t in input_tensors], name, ps))

        def finish(result: tuple) -> None:
            out, received = result
            counts = received.tolist()
            if counts != [t.numel() for t in output_tensors]:
                raise ValueError(f"ringreduce backend: all_to_all on rank {self.rank()}: the "
                                 f"ranks sent {counts} elements for outputs of "
                                 f"{[t.numel() for t in output_tensors]}")
            for target, part in zip(output_tensors, out.split(counts)):
                copy_flat(target, part)

        return CollectiveWork(handle, output_tensors, finish)

    def barrier(self, opts: Any = None) -> CollectiveWork:
        ps, name, _ = self._call("barrier")
        return CollectiveWork(submit(barrier_work(name, ps, "barrier")), [])

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
        self._closed = True
        if world.is_initialized():
            self._channel.free()
            if self._process_set is not global_process_set:
                close_group(self._process_set)
