"""The collectives of a ringreduce group that move data: broadcast, the gathers (one row per
rank; gather is an allgather whose root keeps the rows), scatter (an all-to-all in which only
the root sends), the all-to-alls and the barrier."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..api.movements import allgather_work, alltoall_work, barrier_work, broadcast_work
from ..api.work import first, submit
from ..sets.process_set import ProcessSet
from .arguments import copy_flat, one, worked_on
from .group_base import GroupBase
from .work import CollectiveWork


class Movements(GroupBase):
    """A group's collectives that move data (torch's names, as ProcessGroup declares them)."""

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
