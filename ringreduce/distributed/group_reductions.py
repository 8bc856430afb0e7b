"""The reductions of a ringreduce group: all_reduce (sparse, and BAND/BOR/BXOR, as gloo),
its coalesced forms, reduce, and the reduce-scatters (one row per rank)."""
from __future__ import annotations

from sys import getrefcount
from weakref import getweakrefcount
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..api.collectives import Average, Sum
from ..api.compression import Compression
from ..api.reductions import (allreduce_work, bitwise_allreduce_work, grouped_allreduce_work,
                              reducescatter_work, sparse_allreduce_work)
from ..api.small_path import allreduce_now, reduce_later, reduce_now, started_in_place
from ..api.work import first, submit
from ..core.errors import UnsupportedError
from ..sets.active_set import ActiveSet, refusing
from .arguments import (SUM, all_reducible, bitwise, copy_flat, copy_into, one, reducible,
                        restored, worked_on)
from .group_base import SEQUENCE, GroupBase
from .work import UNHELD, CollectiveWork, FinishedWork

_BOOL = torch.bool
_SPARSE = torch.sparse_coo

# whether torch's options say if it waits for the Work at once (torch >= 2.8: asyncOp)
_SAYS_SYNC = hasattr(dist.AllreduceOptions(), "asyncOp")


class Reductions(GroupBase):
    """A group's reductions (torch's names, as ProcessGroup declares them)."""

    # the FinishedWork last returned, made again only where somebody still holds it (torch's
    # holder of a Work it returned holds ours), or a weak reference still points to it (a
    # finalizer, a WeakKeyDictionary): one made each call cost half a microsecond. It keeps
    # the tensors of that call until the next (as the set's names keep its last handle's)
    _finished: Optional[FinishedWork] = None

    def allreduce(self, tensors: list, opts: Any = None) -> Optional[dist.Work]:
        """(DDP's every bucket, and small ones cost what this adds to our collective: the
        common case takes the fewest steps.) A synchronous call (torch's options say it waits
        at once: dist.all_reduce(t)) runs to its end here and returns None, which torch takes
        for a backend that waited itself, as its every collective does; a Work costs as much
        as a tenth of a small allreduce."""
        if isinstance(tensors, torch.Tensor):   # (DDP's join hook hands one bare)
            tensors = [tensors]
        ps = self._running_on       # (_active's, without its frame)
        if ps is None or ps.closed:
            ps = self._active("allreduce")
        name = ps.call_order_name(SEQUENCE)
        # dist.all_reduce(t) waits at once: it runs on this thread when the set's engine is
        # idle (a handle's queue costs as much as a small allreduce)
        synchronous = opts is not None and _SAYS_SYNC and not opts.asyncOp
        # (ReduceOp == RedOpType: the cheapest test torch's bindings offer)
        if len(tensors) == 1 and (opts is None or opts.reduceOp == SUM):
            tensor, op, pre = tensors[0], Sum, 1.0
            # small (the small way's `case` checks the tensor); the name is an automatic one
            if synchronous:
                small = ps.transport.small      # (allreduce_now's dispatch, written out)
                if small is not None and small.begins:
                    if small.now_in_place(ps.engine, tensor, name, Sum, 1.0, None,
                                          None) is not None:    # (named: no auto_name)
                        return None
                elif allreduce_now(ps, tensor, name, Sum, 1.0, in_place=True,
                                   automatic=True) is not None:
                    return None
            else:
                begun = started_in_place(ps, tensor, name)
                if begun is True:       # (ended here: DDP's small buckets' common case)
                    work = self._finished
                    if (work is not None and getrefcount(work) == UNHELD
                            and not getweakrefcount(work)):
                        work.reuse(tensors, name, ps.engine)
                    else:
                        work = self._finished = FinishedWork(tensors, name, ps.engine)
                    return work
                if begun is not None:
                    return CollectiveWork(begun, tensors)
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
        if synchronous:
            reduce_now(ps, tensor, name, op, None, pre, 1.0, Compression.none, True,
                       self._process_set)
            if write_back is not None:
                with torch.no_grad():       # (as the asynchronous Work writes it)
                    write_back(None)
            return None
        handle = reduce_later(ps, tensor, name, op, None, pre, 1.0, Compression.none, True,
                              self._process_set)
        return CollectiveWork(handle, tensors, write_back)

    def _sparse_allreduce(self, ps: ActiveSet, name: str, tensor: torch.Tensor, op: Any,
                          pre: float) -> CollectiveWork:
        """A sparse COO tensor (DDP's bucket for a sparse embedding's gradient) as gloo
        reduces one: every member's entries gathered (Horovod's sparse allreduce,
        reductions.sparse_allreduce_work), their sum coalesced and written over the
        input. SUM, AVG and PREMUL_SUM; another op is a mistake refused to the others."""
        with refusing(ps, name, "sparse_allreduce"):
            if op not in (Sum, Average):
                raise UnsupportedError(f"ringreduce backend: allreduce of a sparse tensor on "
                                       f"rank {self.rank()} takes SUM, AVG or PREMUL_SUM, not "
                                       f"{op.name.upper()}")
        scaled = tensor if pre == 1.0 else tensor * pre
        handle = submit(sparse_allreduce_work(scaled, name, op, self._process_set))

        def finish(result: torch.Tensor) -> None:
            copy_into(tensor, result.coalesce())

        return CollectiveWork(handle, [tensor], finish)

    def _bitwise(self, name: str, tensor: torch.Tensor, folding: tuple,
                 root: Optional[int] = None) -> CollectiveWork:
        """BAND, BOR or BXOR (`folding`: bitwise()) of an integer or bool tensor, as gloo has
        them (reductions.bitwise_allreduce_work), its result written over the tensor (which,
        as on gloo, need not be contiguous: the work takes a contiguous copy); for reduce, on
        group rank `root` alone (checked by the caller)."""
        op_name, fold = folding
        handle = submit(bitwise_allreduce_work(
            tensor.contiguous(), name, op_name, fold, self._process_set,
            None if root is None else self._process_set.ranks[root]))

        def finish(result: torch.Tensor) -> None:
            if root is None or self.rank() == root:
                copy_into(tensor, result)

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
                copy_into(tensor, result)

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
