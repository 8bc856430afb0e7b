"""The life cycle of a `DistributedOptimizer` step on a member of its process set: gradients are
reduced (averaged, by default) across the set's ranks while backward runs.

  wrapping: the first plan (planning.py), checked alike on every member.
  backward: the step's first gradient checks the plan (which parameters train, which have
      sparse gradients); a change re-plans the buckets, the same way on every rank. Each
      parameter's post-accumulate hook counts its passes; on the last pass its gradient is
      packed into its bucket; a full bucket is handed to the set's engine (submission.py, in
      bucket order, the same on every rank), which reduces it while backward goes on.
  synchronize(): buckets that never filled are packed with zeros where this rank has no
      gradient and submitted, so every rank reduces the same buckets (and, as in Horovod, a
      gradient no rank had is zeros); the step's agreement (step_agreement.py) tells whether
      the step is broken (on some rank, or a second step() on some ranks only) and how each
      parameter with sparse gradients is reduced: allgathered (Horovod's sparse allreduce) or,
      where it came dense, allreduced (sparse_gradients.py); then wait. Called again before
      the step, it reduces every gradient again, as Horovod's does.
  step(): synchronize() unless inside skip_synchronize(), then the wrapped optimizer's step.
"""
from __future__ import annotations

import time
import warnings
import weakref
from typing import Any, Callable, NoReturn, Optional

import torch
from torch.autograd import Variable

from ..api.compression import custom
from ..api.objects import check_consistency
from ..core import timeline
from ..core.compile_boundary import in_compiled_backward
from ..core.errors import MismatchError, UnsupportedError, UsageError
from ..kernels.ops import ReduceOp
from ..sets.active_set import refusing
from ..sets.handles import Handle
from ..sets.process_sets import active
from . import sparse_gradients
from .sparse_gradients import SparseGradients
from .planning import Planning
from .schedule import BucketSchedule
from .submission import Submission, hand_to_replaced
from .wrapped_optimizer import STEP_AFTER_SYNCHRONIZE, Options, WrappedOptimizer, remove_hooks


class GradientReduction(Planning, SparseGradients, Submission, WrappedOptimizer):
    """See the module's docstring; `AdasumOptimizer` changes what a final gradient does."""

    # A parameter alone in its bucket is reduced in place in its `.grad`, without a buffer.
    _direct_buckets = True

    def _setup(self, options: Options) -> None:
        ps = self._set = active(options.process_set, "DistributedOptimizer()")
        settings = ps.transport.settings
        self._prefix = ps.optimizer_prefix()
        # (a mistake in this rank's arguments meets the others' check of the plan instead)
        mistakes = refusing(ps, f"{self._prefix}plan", "DistributedOptimizer")
        with mistakes:
            op = self._check_arguments(options, ps.ranks[ps.rank])
            if isinstance(self, torch.optim.LBFGS):
                raise UnsupportedError(
                    f"ringreduce: DistributedOptimizer on rank {ps.ranks[ps.rank]} cannot wrap "
                    "torch.optim.LBFGS, whose step() evaluates its closure (a backward pass) "
                    "several times, as many as its line search takes on each rank; "
                    "DistributedOptimizer reduces the gradients of backward_passes_per_step "
                    "passes per step (Horovod's cannot wrap it either)")
        # Average with a predivide factor f: sum(g / f) * f / size. With `groups`, Horovod's
        # grouped allreduce leaves the factor out (its `_grouped_allreduce_grad_async`), for a
        # group whose every member is ready before step(); one that is not (a member without a
        # gradient, a step before backward_passes_per_step passes) is reduced member by
        # member there, with it: `_short_reduction`, for such a group's bucket.
        factor = options.gradient_predivide_factor
        plain = (op, 1.0, 1.0)
        predivided = plain if factor == 1.0 else (ReduceOp.Sum, 1.0 / factor, factor / ps.size)
        self._reduction = predivided if options.groups is None else plain
        self._short_reduction = None if options.groups is None or factor == 1.0 else predivided
        self._op = op                # sparse gradients: Horovod's op, without the predivision
        self._sparse_as_dense = options.sparse_as_dense
        self._consistency_every = settings.consistency_check_steps
        self._steps_taken = 0
        self._compression = options.compression
        self._custom = custom(options.compression)
        self._groups = options.groups
        self._threshold = settings.fusion_threshold if options.fusion_threshold is None \
            else options.fusion_threshold
        self._first_bucket = settings.first_bucket_bytes if options.first_bucket_bytes is None \
            else options.first_bucket_bytes
        self._views = options.gradient_as_bucket_view
        self._schedule = BucketSchedule(settings.bucket_schedule, ps.size, ps.rank == 0,
                                        any(p.is_cuda for _, p in self._named))
        self._broken: Optional[str] = None     # why this step cannot be completed
        self._in_backward = False    # a backward pass reached our hooks and has not finished
        self._stepped_on: Optional[tuple] = None    # see _steps_again
        self._sparse: set[int] = set()         # parameters whose gradients come sparse
        self._hooked: set[int] = set()
        self._ever_planned: set[int] = set()   # see _trainable
        weakref.finalize(self, remove_hooks, self._hooks)
        with mistakes:
            self._plan()
        self._agree_on_plan()
        self._ever_planned |= self._planned
        self._reset_step()

    # ------------------------------------------------------------ backward

    def _reset_step(self) -> None:
        self._fresh = True                   # nothing of this step seen yet
        self._zero_grad_refused = False      # see zero_grad()
        self._in_backward = False
        self._pass_count = dict.fromkeys(self._planned, 0)
        self._waiting = [len(b.params) for b in self._buckets]  # params not ready, per bucket
        self._next_bucket = 0                # buckets are submitted strictly in order
        self._handles: list[Handle] = []
        self._sent: list[tuple] = []           # (bucket, what it reduced): see _submit_...
        self._compressed: list[tuple] = []     # (params, handle, contexts): see _submit_custom
        self._found_sparse: set[int] = set()   # parameters with sparse gradients this step
        self._densified: set[int] = set()      # sparse gradients this step, sparse_as_dense
        self._agreement.clear()
        self._first_bucket_failed: Optional[MismatchError] = None    # see _submit_bucket
        self._synchronized = False
        self._first_gradient_at: dict[int, float] = {}  # bucket index -> time (timeline only)

    def _begin_step(self) -> None:
        """At the step's first gradient (or its synchronize, if none came): re-plan if needed.
        `_fresh` is cleared again after, since a re-plan resets the step."""
        if self._fresh:
            self._fresh = False
            self._replan_if_changed()
            self._fresh = False
            self._schedule.step_began()

    def _on_gradient(self, p: torch.Tensor) -> None:
        self._begin_step()
        if not self._in_backward and not in_compiled_backward():
            self._in_backward = True        # (compiled, no callback would clear it)
            Variable._execution_engine.queue_callback(self._backward_finished)
        key = id(p)
        if key not in self._pass_count:      # trainable only since this step began
            return
        count = self._pass_count[key] = self._pass_count[key] + 1
        if count > self._passes:
            self._break_step(
                f"ringreduce: gradient of '{self._names[key]}' was computed {count} times on "
                f"rank {self._rank} before step(); backward_passes_per_step is {self._passes}. "
                "Increase backward_passes_per_step to accumulate gradients locally, or call "
                "step()/synchronize() between backward passes.")
        if p.grad is not None and p.grad.requires_grad:
            p.grad = p.grad.detach()     # (the broken step's collectives still pack it)
            self._break_step(f"ringreduce: gradient of '{self._names[key]}' on rank {self._rank} "
                             "requires grad (backward(create_graph=True)): DistributedOptimizer "
                             "reduces plain gradients, as Horovod's, which asserts the same")
        if count < self._passes:
            return
        if (p.grad is not None and p.grad.layout != torch.strided
                and self._sparse_gradient_leaves(p)):
            return
        bucket = self._bucket_of.get(key)
        if bucket is None:      # reduced on its own (sparse before), dense this step
            return
        if timeline.running():      # "waiting for gradients" starts at the first
            self._first_gradient_at.setdefault(bucket.index, time.perf_counter())
        view = self._view_of.get(key)   # None: a direct bucket
        if (self._views and view is not None and p.grad is not None
                and p.grad.data_ptr() != view.data_ptr()):
            view.copy_(p.grad)   # the gradient was re-created (set_to_none): view it again
            p.grad = view
        self._gradient_ready(p)
        self._waiting[bucket.index] -= 1
        if self._waiting[bucket.index] == 0:
            timeline.record(bucket.name, "gradients ready")
        self._submit_ready_buckets()

    def _break_step(self, why: str) -> NoReturn:
        """This rank's step cannot be completed: meet the other ranks' collectives of the step
        now, telling them to skip it, then raise. Settled here rather than at the next
        zero_grad() or step(), so that what the script does after catching the error (a
        metric's allreduce, the end of training) finds nothing of this step still pending on
        the other ranks, and, where it is not caught, the others learn why before the job
        ends. A later pass of a step already settled only raises."""
        if self._broken is None:
            self._broken = why
        if not self._synchronized:
            try:
                self._complete_collectives()
            except UsageError:
                pass        # (the skip this rank caused; its own reason is raised below)
            except MismatchError as mismatch:   # (the others wait in other collectives, never
                raise UsageError(why) from mismatch     # meeting ours: our reason comes first)
        raise UsageError(why)

    def _backward_finished(self) -> None:
        """Run by autograd at the end of a backward pass that reached our hooks, and only if
        it finished: a pass that raises skips its queued callbacks."""
        self._in_backward = False

    def _break_if_backward_failed(self) -> None:
        """After a backward pass that raised on this rank before it finished (an out-of-memory
        error caught by the script, say), its gradients are incomplete, and the buckets it
        submitted wait for the other ranks' buckets: the step is broken, so that zero_grad() or
        step() meets the others' collectives and every rank skips the step. Without this, the
        next step's buckets would pair with the others' buckets of this one. (Not in a backward
        that compiled autograd runs, which calls no end-of-backward callback: there a pass that
        raised part-way leaves its missing gradients as a parameter without one does.)"""
        if self._in_backward:
            self._in_backward = False
            if self._broken is None:
                self._broken = (f"a backward pass on rank {self._rank} raised before it "
                                "finished, so its gradients are incomplete")

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """What a final gradient does before its bucket is packed (Adasum: the local step)."""

    def _complete_collectives(self, again: bool = False) -> None:
        """Submit whatever of this step's collectives are left, in the same order on every
        rank, and wait for all of them, also after one fails (so that the next step starts
        with nothing of this one pending, on every rank); then raise the first failure. After
        the buckets comes the step's agreement: where any rank's step is broken (an extra
        backward pass), or some ranks step again on the same gradients (or reduce them `again`:
        synchronize() twice) while others do not, every rank raises UsageError, so that no
        rank steps. The sparse gradients' allgathers follow it, once it has passed on every
        rank (it names them)."""
        self._break_if_backward_failed()
        again = again or self._steps_again()
        self._begin_step()                   # also when no gradient came this step
        if not self._synchronized:
            for p in sparse_gradients.short_of_passes(self._named, self._pass_count,
                                                      self._passes):
                self._sparse_gradient_leaves(p)
        self._submit_ready_buckets(force=True)
        found = self._found_sparse - self._planned_sparse
        new_sparse = [(n, p) for n, p in self._named if id(p) in found] if found else []
        agreement = (self._agreement.submit(
            self._broken is not None, again,
            sparse_gradients.layouts(self._sparse_params, self._pass_count), bool(new_sparse),
            self._schedule.vote()) if self._agrees else None)
        failures: list[BaseException] = []

        def wait(outcome: Callable[[], Any]) -> Any:
            try:
                return outcome()
            except Exception as exc:     # every handle is waited for; the first error wins
                failures.append(exc)

        try:
            for handle in self._handles:
                wait(handle.wait)
            agreed = True       # (a failed agreement failed on every rank: see its submit)
            if agreement is not None:
                failed_before = len(failures)
                wait(agreement.wait)
                if (agreed := len(failures) == failed_before):
                    self._schedule.agreed(self._agreement.schedule())
            if agreed and (self._sparse_params or new_sparse or self._agreement.new_sparse()):
                for p, handle in wait(lambda: self._sparse_collectives(new_sparse)) or ():
                    reduced = wait(handle)
                    if reduced is not None:
                        p.grad = reduced
        finally:
            self._handles, sent, self._sent = [], self._sent, []
            self._synchronized = True       # nothing of this step is pending any more
        if failures:
            self._compressed = []
            raise failures[0]
        hand_to_replaced(sent)
        self._ever_planned |= self._planned     # (every rank's first bucket carried the plan)
        if self._compressed:
            self._decompress()
        if self._densified:     # sparse_as_dense
            sparse_gradients.hand_back_sparse(self._named, self._densified)
            self._densified = set()
        if (self._agreement.broken() if agreement is not None else self._broken is not None):
            own = self._broken
            if own is None and again and self._agreement.steps_differ():
                own = (f"optimizer.step() on rank {self._rank} came again on the gradients of "
                       "its last step, with no backward pass or zero_grad() since (or "
                       "synchronize() reduced them again), while other ranks stepped on new "
                       "gradients")
            self._broken = self._agreement.why_skipped(own)
            self._check_unbroken()

    def _steps_again(self) -> bool:
        """Whether this step comes with no backward pass since the last step, on its gradients
        unchanged (no zero_grad(), no gradient set or changed in place: a tensor's version
        counts in-place changes)."""
        if not self._fresh or self._stepped_on is None:
            return False
        p, stepped_on, version = self._stepped_on
        return p.grad is not None and p.grad is stepped_on() and p.grad._version == version

    # ------------------------------------------------------------ public methods

    def gradients_sent(self) -> bool:
        return (not self._synchronized and not self._fresh
                and self._next_bucket == len(self._buckets))

    def synchronize(self) -> None:
        """Finish reducing every gradient of this step (zeros for gradients a rank lacks).
        UsageError on every rank when some rank's step is broken. Called again before the
        step, it reduces the gradients again (Horovod's does: with op=Sum they grow)."""
        self._check_usable()
        again = self._synchronized
        if again:       # (where only some ranks do, the step's agreement says so: see above)
            self._check_unbroken()
            self._reset_step()
        try:
            self._complete_collectives(again)
        finally:
            self._synchronized = True
        self._schedule.synchronized(time.perf_counter())

    def step(self, closure=None):
        """`closure` (re-evaluates the loss, with backward) runs first, so that its gradients
        are the ones reduced; the wrapped optimizer then steps without it. Returns what the
        wrapped step returns, or else the closure's loss (what torch's steps return)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._skip_sync:
            if self._synchronized and closure is None and self._broken is None:
                warnings.warn(STEP_AFTER_SYNCHRONIZE)
            self.synchronize()
        elif not self._synchronized and not self._fresh:
            self._break_step(       # (it meets the others' step, which they then skip)
                f"ringreduce: step() inside skip_synchronize() on rank {self._rank} before "
                "synchronize(), while this step's gradients are reduced; call "
                "optimizer.synchronize() first.")
        else:
            self._check_unbroken()
        result = self._step_wrapped()
        self._finish_step()
        return loss if result is None else result

    def _check_unbroken(self) -> None:
        if self._broken is not None:
            raise UsageError(f"{self._broken} This step's gradients are incomplete: call "
                             "optimizer.zero_grad() on every rank and run the step again.")

    def _finish_step(self) -> None:
        self._reset_step()
        self._steps_taken += 1
        p = next((p for _, p in self._named if p.grad is not None), None)    # see _steps_again
        self._stepped_on = None if p is None else (p, weakref.ref(p.grad), p.grad._version)
        if self._consistency_every and self._steps_taken % self._consistency_every == 0:
            check_consistency(self._named, name=f"check_consistency.step{self._steps_taken}",
                              process_set=self._process_set)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._break_if_backward_failed()
        if self._set.closed:    # shutdown() and init() since: the step's collectives are gone
            self._synchronized, self._handles, self._sent = True, [], []
        if not self._synchronized and not self._fresh:      # a gradient came this step
            if self._broken is None and self._zero_grad_refused:
                self._break_step(      # (the program went on without this step: end it)
                    f"ringreduce: optimizer.zero_grad() on rank {self._rank} came again "
                    "while a step was open (a backward pass, then no step()): the step is "
                    "skipped on every rank.")
            if self._broken is None:
                self._zero_grad_refused = True
                raise UsageError(
                    f"ringreduce: optimizer.zero_grad() on rank {self._rank} was called after "
                    "loss.backward() but before optimizer.step() or optimizer.synchronize(); "
                    "the gradients are being reduced (or counted towards "
                    "backward_passes_per_step). Call zero_grad() before backward. This "
                    "step stays open here, as on Horovod (the other ranks' step() waits for "
                    "this rank's): finish it with optimizer.step() or synchronize() first. "
                    "A second zero_grad() ends it, skipping it on every rank.")
            try:        # a broken step still meets the other ranks' collectives, and tells
                self._complete_collectives()        # them to skip the step
            except UsageError:
                pass
        self._broken = None
        if self._views:
            self._zero_bucket_views(set_to_none)
        else:
            super().zero_grad(set_to_none)      # type: ignore[misc]  (the wrapped class's)
        self._reset_step()

    def set_backward_passes_per_step(self, passes: int) -> None:
        super().set_backward_passes_per_step(passes)
        self._count_again()

    def load_state_dict(self, state_dict: dict) -> None:
        self._count_again()
        super().load_state_dict(state_dict)     # type: ignore[misc]  (the wrapped class's)

    def _count_again(self) -> None:
        """As Horovod's: the backward passes counted for this step start again, where none of
        its collectives is submitted yet (submitted ones are still waited for at the step)."""
        if not self._handles:
            self._reset_step()

