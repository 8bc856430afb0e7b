"""The step's agreement: a `DistributedOptimizer` step's collective after its buckets (and
before its sparse gradients' collectives, which start only once it has passed).

One small allreduce (Max) of bytes: for each parameter the plan reduces on its own (sparse
gradients), whether this rank's gradient is sparse and whether it is dense (its own, this
step); 1 where this rank found a sparse gradient the plan does not know; the bucket schedule's
choice where this rank makes it (schedule.py); 1 where this rank's step is broken (an extra
backward pass), 1 where it steps again on its last step's gradients, 1 where it does not. From
it every rank learns whether the step is broken, so that every rank skips it, not only the
one that broke it; how every rank reduces each sparse parameter this step (sparse_gradients.py:
a rank without a gradient joins the others' way); and the bucket schedule that every rank
takes from the next step. A step is broken where some rank's is, and where some ranks step
again while others do not: a second `step()` on one rank pairs its collectives with the
others' next step, and every later step with another step's (all ranks stepping twice is a
step like any other).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..api.objects import allgather_object
from ..api.work import submit
from ..kernels.ops import ReduceOp
from ..sets.active_set import ActiveSet
from ..sets.handles import Handle
from ..sets.process_set import ProcessSet
from ..transport.reduce_spec import ReduceSpec
from ..transport.signature import digest


class StepAgreement:
    """The agreement of one bucket plan over `parameter_names` (which its signature names, so
    that ranks with different plans are told which parameters differ), and over the plan's
    `sparse_names`, the parameters reduced on their own."""

    def __init__(self, members: ActiveSet, process_set: ProcessSet, prefix: str,
                 parameter_names: Sequence[str], sparse_names: Sequence[str] = ()) -> None:
        self._set, self._process_set, self._prefix = members, process_set, prefix
        self.name = f"{prefix}agreement"
        self._sparse_count = len(sparse_names)
        self._marks = torch.zeros(2 * self._sparse_count + 5, dtype=torch.uint8)
        self._mark_array = self._marks.numpy()      # element writes: NumPy's are cheap
        signature = {"collective": "allreduce", "name": self.name,
                     "parameters": tuple(parameter_names), "sparse": tuple(sparse_names),
                     "and": ("sparse here, dense here", "new sparse", "schedule", "broken",
                             "again", "not again")}
        self._spec = ReduceSpec(torch.uint8, ReduceOp.Max, digest=digest(signature),
                                signature=signature)

    def clear(self) -> None:
        """A new step: nothing broken."""
        self._marks.zero_()

    def submit(self, broken: bool, again: bool, layouts: Sequence[tuple[bool, bool]] = (),
               new_sparse: bool = False, schedule: int = 0) -> Handle:
        """Queue the allreduce: this rank's step broken or not, and stepping again on its last
        step's gradients or not; `layouts`, for each of the plan's sparse parameters, whether
        this rank's gradient is sparse and whether it is its own dense one; `new_sparse`, a
        sparse gradient the plan does not know; `schedule`, this rank's vote
        (BucketSchedule.vote)."""
        marks = self._mark_array
        for j, (sparse, dense) in enumerate(layouts):
            marks[2 * j], marks[2 * j + 1] = sparse, dense
        marks[-5], marks[-4], marks[-3], marks[-2], marks[-1] = (new_sparse, schedule, broken,
                                                                 again, not again)
        transport, marks, spec = self._set.transport, self._marks, self._spec
        return submit((self._set, self.name, lambda: transport.allreduce(marks, marks, spec)))

    def layouts(self) -> list[tuple[bool, bool]]:
        """Once the allreduce is done: for each of the plan's sparse parameters, whether some
        rank's gradient is sparse, and whether some rank's is dense."""
        marks = self._mark_array
        return [(bool(marks[2 * j]), bool(marks[2 * j + 1])) for j in range(self._sparse_count)]

    def new_sparse(self) -> bool:
        """Once the allreduce is done: whether some rank found a sparse gradient of a
        parameter the plan reduces in a bucket."""
        return bool(self._mark_array[-5])

    def schedule(self) -> int:
        """Once the allreduce is done: the schedule chosen (0: none this step)."""
        return int(self._mark_array[-4])

    def broken(self) -> bool:
        """Once the allreduce is done: whether some rank's step is broken, or the ranks'
        steps are not the same step."""
        return bool(self._mark_array[-3]) or self.steps_differ()

    def steps_differ(self) -> bool:
        """Once the allreduce is done: whether some ranks step again on their last step's
        gradients while others step on new ones."""
        return bool(self._mark_array[-2] and self._mark_array[-1])

    def why_skipped(self, own_reason: Optional[str]) -> str:
        """Why every rank skips the step, naming the ranks that broke it (collective: each
        rank tells its own reason, None where its step is whole)."""
        reasons = allgather_object(own_reason, name=f"{self._prefix}broken",
                                   process_set=self._process_set)
        ranks = [self._set.ranks[k] for k, why in enumerate(reasons) if why is not None]
        first = next(why for why in reasons if why is not None)
        return (f"ringreduce: the step is skipped on every rank because ranks {ranks} broke it "
                f"({first})")
