"""`DistributedOptimizer`: gradients are averaged across a process set's ranks while backward runs.

Life cycle of one step:
  backward: the step's first gradient checks the plan (which parameters train, which have
      sparse gradients); a change re-plans the buckets, the same way on every rank. Each
      parameter's post-accumulate hook counts its passes; on the last pass its gradient is
      packed into its bucket; a full bucket is handed to the set's engine (in bucket order, the
      same on every rank), which reduces it on its thread while backward goes on.
  synchronize(): buckets that never filled are packed with zeros where this rank has no
      gradient and submitted, so every rank reduces the same buckets; sparse gradients are
      allgathered (Horovod's sparse allreduce); one small allreduce tells which parameters had
      a gradient on some rank, the others keep `.grad` None as in one process; then wait.
  step(): synchronize() unless inside skip_synchronize(), then the wrapped optimizer's step.

With op=Adasum the life cycle is Horovod's instead (`_AdasumOptimizer`): each rank steps its
own optimizer, and the parameter deltas are combined. On a rank outside the process set, as in
Horovod, nothing is hooked or reduced and step() steps with the local gradients
(`_OutsideOptimizer`).

The returned object is an instance of a subclass of the wrapped optimizer's class, sharing its
param_groups and state, so isinstance checks, LR schedulers and state_dict keep working.
"""
from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import adasum, cuda, fusion, timeline
from .collectives import (Adasum, Average, Max, Sum, reduce_op, sparse_allreduce_async,
                          submit)
from .compression import Compression, Compressor
from .engine import Handle
from .errors import UnsupportedError, UsageError
from .objects import allgather_object, check_consistency
from .process_sets import ProcessSet, active, global_process_set
from .signature import digest
from .transport import ReduceSpec

# Horovod's words, so that filters written for its warning match ours.
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods mixed into the dynamic subclass; see `DistributedOptimizer`."""

    _ringreduce_wrapped = True

    def _setup(self, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, gradient_as_bucket_view,
               fusion_threshold, first_bucket_bytes, process_set) -> None:
        ps = self._set = active(process_set, "DistributedOptimizer()")
        self._process_set = process_set
        self._rank = ps.ranks[ps.rank]
        settings = ps.transport.settings
        op = self._check_arguments(named_parameters, backward_passes_per_step, op,
                                   gradient_predivide_factor)
        if gradient_as_bucket_view and compression is not Compression.none:
            raise ValueError("ringreduce: gradient_as_bucket_view needs compression="
                             "Compression.none (compressed buckets hold another dtype)")
        # Average with a predivide factor f: sum(g / f) * f / size.
        predivided = gradient_predivide_factor != 1.0
        self._reduction = (Sum if predivided else op, 1.0 / gradient_predivide_factor,
                           gradient_predivide_factor / ps.size if predivided else 1.0)
        self._op = op                # sparse gradients: Horovod's op, without the predivision
        self._sparse_as_dense = sparse_as_dense
        self._passes = backward_passes_per_step
        self._consistency_every = settings.consistency_check_steps
        self._steps_taken = 0
        self._compression = compression
        self._groups = groups
        self._threshold = settings.fusion_threshold if fusion_threshold is None \
            else fusion_threshold
        self._first_bucket = settings.first_bucket_bytes if first_bucket_bytes is None \
            else first_bucket_bytes
        self._prefix = ps.optimizer_prefix()
        self._views = gradient_as_bucket_view
        self._skip_sync = False
        self._released = False                 # release() removed the hooks
        self._broken: Optional[str] = None     # why this step cannot be completed
        self._sparse: set[int] = set()         # parameters whose gradients come sparse
        self._hooked: set[int] = set()
        self._hooks: list = []
        weakref.finalize(self, _remove_hooks, self._hooks)
        self._plan()
        self._reset_step()

    def _check_arguments(self, named_parameters, backward_passes_per_step, op,
                         gradient_predivide_factor) -> Any:
        """The checks every rank makes, in or outside the process set; sets the parameter
        names (`_named`, and Horovod's `_parameter_names`: parameter -> name). Returns the
        op."""
        self._named, self._parameter_names = _named_parameters(self.param_groups,
                                                               named_parameters)
        self._names = {id(p): n for n, p in self._named}
        _check_passes(backward_passes_per_step)
        op = reduce_op(op, None, "DistributedOptimizer", adasum_ok=True)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("ringreduce: gradient_predivide_factor only applies to op=Average "
                             f"(got op={op.name}); drop the factor or use Average")
        return op

    # ------------------------------------------------------------ the plan

    def _trainable(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self._named if p.requires_grad]

    def _plan(self) -> None:
        """Buckets over the trainable parameters with dense gradients, their reductions, and a
        gradient hook on every trainable parameter."""
        trainable = self._trainable()
        dense = [(n, p) for n, p in trainable if id(p) not in self._sparse]
        wire = self._compression.wire_dtype

        def wire_dtype(dtype: torch.dtype) -> torch.dtype:
            return wire if wire is not None and self._compression.applies_to(dtype) else dtype

        self._buckets = fusion.plan(dense, self._threshold, self._first_bucket, wire_dtype,
                                    _explicit_groups(self._groups, dense), self._prefix,
                                    direct=not self._adasum)
        op, prescale, postscale = self._reduction
        self._specs = [ReduceSpec(b.buffer.dtype, op, prescale, postscale, digest(b.signature),
                                  b.signature, [p.numel() for p in b.params])
                       for b in self._buckets]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._view_of = {id(p): v for b in self._buckets for p, v in zip(b.params, b.views)}
        self._sparse_params = [(n, p) for n, p in trainable if id(p) in self._sparse]
        self._planned = frozenset(id(p) for _, p in trainable)
        self._planned_sparse = frozenset(self._sparse)
        self._position = {id(p): i for i, (_, p) in enumerate(dense)}
        # The step's agreement, one small allreduce (Max) at its end: a mark per parameter
        # this rank has a gradient for, and last whether this rank's step is broken.
        self._present = torch.zeros(len(dense) + 1, dtype=torch.uint8)
        self._present_marks = self._present.numpy()     # element writes: NumPy's are cheap
        self._counts_presence = not self._views and not self._adasum and len(dense) > 0
        self._agrees = self._set.size > 1
        presence = {"collective": "allreduce", "name": f"{self._prefix}presence",
                    "parameters": tuple(n for n, _ in dense), "and": "broken"}
        self._presence_spec = ReduceSpec(torch.uint8, Max, digest=digest(presence),
                                         signature=presence)
        for bucket in self._buckets:
            _describe(bucket)
        if self._views:
            self._point_grads_at_buckets()
        self._hook([p for _, p in trainable])

    def _hook(self, params: list[torch.Tensor]) -> None:
        # The hooks live in torch's C++ parameter objects, which the garbage collector cannot
        # see through: hold the optimizer weakly there.
        me = weakref.ref(self)

        def on_gradient(p: torch.Tensor) -> None:
            optimizer = me()
            if optimizer is not None:
                optimizer._on_gradient(p)

        for p in params:
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._hooks.append(p.register_post_accumulate_grad_hook(on_gradient))

    def _replan_if_changed(self) -> None:
        """Before anything of a step is submitted: a parameter frozen or unfrozen since the
        plan, or a gradient found sparse, re-plans the buckets. Every rank that makes the same
        change re-plans alike; a rank that does not fails the buckets' signature check
        (MismatchError naming the parameters)."""
        trainable = frozenset(id(p) for _, p in self._trainable())
        if trainable != self._planned or self._sparse != self._planned_sparse:
            self._plan()
            self._reset_step()

    def _point_grads_at_buckets(self) -> None:
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    # ------------------------------------------------------------ backward

    def _reset_step(self) -> None:
        self._fresh = True                   # nothing of this step seen yet
        self._pass_count = dict.fromkeys(self._planned, 0)
        self._waiting = [len(b.params) for b in self._buckets]  # params not ready, per bucket
        self._next_bucket = 0                # buckets are submitted strictly in order
        self._handles: list[Handle] = []
        self._found_sparse: set[int] = set()   # parameters with sparse gradients this step
        self._densified: set[int] = set()      # sparse gradients this step, sparse_as_dense
        self._present.zero_()
        self._synchronized = False
        self._first_gradient_at: dict[int, float] = {}  # bucket index -> time (timeline only)

    def _begin_step(self) -> None:
        """At the step's first gradient (or its synchronize, if none came): re-plan if needed.
        `_fresh` is cleared again after, since a re-plan resets the step."""
        if self._fresh:
            self._fresh = False
            self._replan_if_changed()
            self._fresh = False

    def _on_gradient(self, p: torch.Tensor) -> None:
        self._begin_step()
        key = id(p)
        if key not in self._pass_count:      # trainable only since this step began
            return
        count = self._pass_count[key] = self._pass_count[key] + 1
        if count > self._passes:
            self._broken = (
                f"ringreduce: gradient of '{self._names[key]}' was computed {count} times on "
                f"rank {self._rank} before step(); backward_passes_per_step is {self._passes}. "
                "Increase backward_passes_per_step to accumulate gradients locally, or call "
                "step()/synchronize() between backward passes.")
            raise UsageError(self._broken)
        if count < self._passes:
            return
        if p.grad is not None and p.grad.layout != torch.strided:
            if self._sparse_as_dense and (self._adasum or self._set.size > 1):
                # Horovod: reduced densely, handed back sparse (alone, it reduces nothing:
                # the gradient stays as backward made it, reduced on its own below)
                p.grad = p.grad.to_dense()
                if not self._adasum:
                    self._densified.add(key)
            elif self._adasum:
                raise UnsupportedError(
                    f"ringreduce: parameter '{self._names[key]}' on rank {self._rank} has a "
                    "sparse gradient, which Adasum cannot combine; pass sparse_as_dense=True")
            else:
                self._found_sparse.add(key)
                if key in self._planned_sparse:     # reduced on its own at synchronize()
                    return
        bucket = self._bucket_of[key]
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

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """What a final gradient does before its bucket is packed (Adasum: the local step)."""

    def _submit_ready_buckets(self, force: bool = False) -> None:
        while self._next_bucket < len(self._buckets) and (
                force or self._waiting[self._next_bucket] == 0):
            bucket = self._buckets[self._next_bucket]
            self._trace_waiting(bucket)
            if self._counts_presence:
                self._mark_present(bucket)
            ready = None   # GPU: an event on torch's stream, after which the bucket is packed
            gradient = None
            with timeline.span(bucket.name, "pack"):
                if bucket.direct:
                    gradient = self._direct_gradient(bucket)
                else:
                    ready = self._pack(bucket)
            self._handles.append(submit(
                (self._set, bucket.name, self._reduce_work(bucket, ready, gradient))))
            self._next_bucket += 1

    def _pack(self, bucket: fusion.Bucket) -> Any:
        """Gradients into the bucket's buffer; on a GPU, returns the event the reduction waits
        for."""
        if bucket.buffer.is_cuda:
            return cuda.pack(bucket)
        bucket.pack()
        return None

    def _direct_gradient(self, bucket: fusion.Bucket) -> torch.Tensor:
        """The tensor a direct bucket reduces in place: its parameter's gradient, or zeros
        standing in for a sparse one (which travels on its own)."""
        p = bucket.params[0]
        if p.grad is not None and p.grad.layout != torch.strided:
            return torch.zeros_like(p)
        return bucket.gradient()

    def _reduce_work(self, bucket: fusion.Bucket, ready: Any = None,
                     gradient: Optional[torch.Tensor] = None):
        """The engine's work for a bucket: reduce its buffer (or, for a direct bucket,
        `gradient` in place), then unpack."""
        transport, spec = self._set.transport, self._specs[bucket.index]

        def work() -> None:
            timeline.record(bucket.name, "reduce start")
            tensor = bucket.buffer if gradient is None else gradient
            with timeline.span(bucket.name, "allreduce"), cuda.after(ready):
                transport.allreduce(tensor, tensor, spec)
            if not bucket.direct and not self._adasum:
                with timeline.span(bucket.name, "unpack"):
                    if bucket.buffer.is_cuda:
                        cuda.unpack(bucket)   # and waits: complete before synchronize() returns
                    else:
                        bucket.unpack()
            timeline.record(bucket.name, "reduce done")

        return work

    def _trace_waiting(self, bucket: fusion.Bucket) -> None:
        """While a timeline runs: name the bucket's parameters for its events, and emit its
        "waiting for gradients" span, from its first gradient hook of the step until now (its
        submission), the part of backward that its communication can overlap."""
        if not timeline.running():
            return
        _describe(bucket)
        start = self._first_gradient_at.get(bucket.index)
        if start is not None:
            timeline.add_span(bucket.name, "waiting for gradients", start, time.perf_counter())

    def _complete_collectives(self) -> None:
        """Submit whatever of this step's collectives are left, in the same order on every
        rank, and wait for all of them, also after one fails (so that the next step starts
        with nothing of this one pending, on every rank); then raise the first failure. The
        last of them is the step's agreement: where any rank's step is broken (an extra
        backward pass), every rank raises UsageError, so that no rank steps."""
        self._begin_step()                   # also when no gradient came this step
        self._submit_ready_buckets(force=True)
        sparse = [(n, p) for n, p in self._named
                  if id(p) in self._planned_sparse or id(p) in self._found_sparse]
        self._sparse |= self._found_sparse    # the next step's plan reduces them on their own
        results = [(p, sparse_allreduce_async(_sparse_or_empty(p), f"{self._prefix}sparse.{n}",
                                              self._op, self._process_set))
                   for n, p in sparse]
        agreement = None
        if self._agrees:
            self._present_marks[-1] = self._broken is not None
            agreement = submit((self._set, f"{self._prefix}presence", lambda: (
                self._set.transport.allreduce(self._present, self._present,
                                              self._presence_spec))))
        failures: list[BaseException] = []

        def wait(outcome: Callable[[], Any]) -> Any:
            try:
                return outcome()
            except Exception as exc:     # every handle is waited for; the first error wins
                failures.append(exc)

        try:
            for handle in self._handles:
                wait(handle.wait)
            for p, handle in results:
                gathered = wait(handle)
                if gathered is not None:
                    p.grad = gathered
            if agreement is not None:
                wait(agreement.wait)
        finally:
            self._handles = []
            self._synchronized = True       # nothing of this step is pending any more
        if failures:
            raise failures[0]
        if self._counts_presence:
            self._forget_gradients_nobody_had()
        self._sparse_again()
        if (self._present_marks[-1] if agreement is not None else self._broken is not None):
            self._skip_broken_step()

    def _skip_broken_step(self) -> None:
        """Some rank's step is broken: every rank learns why and skips it (collective)."""
        reasons = allgather_object(self._broken, name=f"{self._prefix}broken",
                                   process_set=self._process_set)
        ranks = [self._set.ranks[k] for k, why in enumerate(reasons) if why is not None]
        first = next(why for why in reasons if why is not None)
        self._broken = (f"ringreduce: the step is skipped on every rank because ranks {ranks} "
                        f"broke it ({first})")
        self._check_unbroken()

    def _sparse_again(self) -> None:
        """sparse_as_dense, as Horovod: a gradient that came sparse on this rank was reduced
        densely, and goes back to the optimizer sparse (the reduced dense gradient's nonzero
        entries, coalesced), so that SparseAdam and the like step with it."""
        if self._densified:
            for _, p in self._named:
                if id(p) in self._densified and p.grad is not None \
                        and p.grad.layout == torch.strided:
                    p.grad = p.grad.to_sparse()
            self._densified = set()

    def _mark_present(self, bucket: fusion.Bucket) -> None:
        """As a bucket is packed (before its unpack fills in missing gradients): this rank has
        a gradient for each parameter whose `.grad` is set, from this step's backward passes (all
        of them, or fewer when a step comes early, as at the end of an epoch with gradient
        accumulation), or zeros kept by zero_grad(set_to_none=False)."""
        for p in bucket.params:
            if p.grad is not None:
                self._present_marks[self._position[id(p)]] = 1

    def _forget_gradients_nobody_had(self) -> None:
        """A parameter no rank had a gradient for keeps `.grad` None, as in one process (zeros
        stand in only for ranks that lack a gradient another rank has)."""
        present = self._present.tolist()
        for bucket in self._buckets:
            for p in bucket.params:
                if not present[self._position[id(p)]]:
                    p.grad = None

    # ------------------------------------------------------------ public methods

    def synchronize(self) -> None:
        """Finish reducing every gradient of this step (zeros for gradients a rank lacks).
        UsageError on every rank when some rank's step is broken."""
        self._check_usable()
        if self._synchronized:
            self._check_unbroken()
            return
        try:
            self._complete_collectives()
        finally:
            self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize: call synchronize() yourself first
        (the AMP pattern: synchronize, unscale_, then step)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        """`closure` (re-evaluates the loss, with backward) runs first, so that its gradients
        are the ones reduced; the wrapped optimizer then steps without it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._skip_sync:
            if self._synchronized and closure is None and self._broken is None:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE)
            self.synchronize()
        elif not self._synchronized:
            raise UsageError(
                f"ringreduce: step() inside skip_synchronize() on rank {self._rank} before "
                "synchronize(); call optimizer.synchronize() first")
        else:
            self._check_unbroken()
        self._step_wrapped()
        self._finish_step()
        return loss

    def _step_wrapped(self) -> None:
        """The wrapped optimizer's step: through the step() an LR scheduler made before
        wrapping put on the plain optimizer (so it sees the step), else the class's own."""
        if self._plain_step is not None:
            self._plain_step()
        else:
            self._plain_class.step(self)

    def release(self) -> None:
        """Remove the gradient hooks: backward passes after this start no collectives (a
        training framework's teardown; the model may go on training with another optimizer).
        This optimizer cannot step again."""
        _remove_hooks(self._hooks)
        self._hooks.clear()
        self._released = True

    def _check_usable(self) -> None:
        if self._released:
            raise UsageError(f"ringreduce: this DistributedOptimizer on rank {self._rank} was "
                             "released (its gradient hooks are removed); wrap a new one")

    def _check_unbroken(self) -> None:
        if self._broken is not None:
            raise UsageError(f"{self._broken} This step's gradients are incomplete: call "
                             "optimizer.zero_grad() on every rank and run the step again.")

    def _finish_step(self) -> None:
        self._reset_step()
        self._steps_taken += 1
        if self._consistency_every and self._steps_taken % self._consistency_every == 0:
            check_consistency(self._named, name=f"check_consistency.step{self._steps_taken}",
                              process_set=self._process_set)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._synchronized and (self._handles or (self._broken is not None
                                                         and not self._fresh)):
            if self._broken is None:
                raise UsageError(
                    f"ringreduce: optimizer.zero_grad() on rank {self._rank} was called after "
                    "loss.backward() but before optimizer.step() or optimizer.synchronize(); "
                    "the gradients are still being reduced. Call zero_grad() before backward.")
            try:        # a broken step still meets the other ranks' collectives, and tells
                self._complete_collectives()        # them to skip the step
            except UsageError:
                pass
        self._broken = None
        if self._views:     # keep the gradients as views of the buckets
            for bucket in self._buckets:
                bucket.buffer.zero_()
                p = bucket.params[0]
                if bucket.direct and p.grad is not None:    # no bucket: as torch does
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
            for _, p in self._sparse_params:
                p.grad = None
            for _, p in self._named:    # handed back sparse (sparse_as_dense): not a view
                if p.grad is not None and p.grad.layout != torch.strided:
                    p.grad = None
            self._point_grads_at_buckets()
        else:
            self._plain_class.zero_grad(self, set_to_none)
        self._reset_step()

    def set_backward_passes_per_step(self, passes: int) -> None:
        _check_passes(passes)
        self._passes = passes
        self._reset_step()

    def __setstate__(self, state: dict) -> None:
        """load_state_dict() replaces `state` and `param_groups` with new objects: the plain
        optimizer an LR scheduler made before wrapping holds (and steps with, and sets the
        learning rate of) must keep sharing them."""
        self._plain_class.__setstate__(self, state)
        plain = self.__dict__.get("_plain")
        if plain is not None:
            plain.__dict__.update(state)

    @property
    def _adasum(self) -> bool:
        return False


class _AdasumOptimizer:
    """op=Adasum, as Horovod's: once a parameter's gradient is final, the wrapped optimizer
    steps that parameter alone on this rank (its state, momentum or Adam's moments, stays this
    rank's own); the step's delta goes into the bucket, and the buckets are combined by Adasum
    across the set; step() adds the combined delta to where the parameter started, the same
    on every rank. synchronize() has nothing to do; skip_synchronize() is refused."""

    @property
    def _adasum(self) -> bool:
        return True

    def _gradient_ready(self, p: torch.Tensor) -> None:
        self._step_alone(p)

    def _pack(self, bucket: fusion.Bucket) -> Any:
        """The deltas are in the buffer already."""
        if bucket.buffer.is_cuda:
            return torch.cuda.current_stream(bucket.buffer.device).record_event()
        return None

    def _step_alone(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's step on `p` only; its delta into the bucket, `p` back to
        where it started until the combined delta arrives."""
        start = self._start[id(p)]
        start.copy_(p.detach())
        params = [group["params"] for group in self.param_groups]
        mine = self._group_of[id(p)]
        for k, group in enumerate(self.param_groups):
            group["params"] = [p] if k == mine else []
        try:
            self._step_wrapped()
        finally:
            for group, saved in zip(self.param_groups, params):
                group["params"] = saved
        self._view_of[id(p)].copy_(p.detach() - start)
        with torch.no_grad():
            p.copy_(start)
        self._stepped.add(id(p))

    def _plan(self) -> None:
        _DistributedOptimizer._plan(self)
        self._start = {id(p): torch.empty_like(p) for b in self._buckets for p in b.params}
        self._group_of = {id(p): k for k, group in enumerate(self.param_groups)
                          for p in group["params"]}

    def _reset_step(self) -> None:
        _DistributedOptimizer._reset_step(self)
        self._stepped: set[int] = set()      # parameters stepped alone this step

    def synchronize(self) -> None:
        """Nothing: Adasum combines parameter deltas at step(), as Horovod's does."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise UsageError("ringreduce: skipping synchronization is not supported with op=Adasum "
                         "(as in Horovod): the deltas are combined at step()")
        yield  # pragma: no cover

    def step(self, closure=None):
        self._check_usable()
        if self._synchronized:          # a step that failed, not yet zero_grad()'ed
            self._check_unbroken()
        loss = closure() if closure is not None else None
        self._begin_step()
        for bucket in self._buckets[self._next_bucket:]:
            for p in bucket.params:
                if id(p) not in self._stepped:
                    self._step_alone(p)
        self._complete_collectives()
        with torch.no_grad():
            for bucket in self._buckets:
                for p, delta in zip(bucket.params, bucket.views):
                    p.copy_(self._start[id(p)]).add_(delta)
        self._finish_step()
        return loss


class _OutsideOptimizer:
    """On a rank outside the optimizer's process set, as Horovod's: no gradient hooks, nothing
    to reduce; synchronize() returns at once and step() steps with this rank's own gradients
    (the wrapped optimizer's step, given the closure)."""

    def _setup(self, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, gradient_as_bucket_view,
               fusion_threshold, first_bucket_bytes, process_set) -> None:
        self._process_set = process_set
        self._rank = _global_rank()
        self._check_arguments(named_parameters, backward_passes_per_step, op,
                              gradient_predivide_factor)
        self._passes = backward_passes_per_step
        self._skip_sync = False
        self._synchronized = False
        self._released = False
        self._hooks: list = []
        self._handles: list = []

    @property
    def _adasum(self) -> bool:
        return False

    def _reset_step(self) -> None:
        self._synchronized = False

    def synchronize(self) -> None:
        self._synchronized = True

    def step(self, closure=None):
        self._check_usable()
        if not self._skip_sync:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE)
            self.synchronize()
        self._synchronized = False
        if self._plain_step is not None:
            return self._plain_step(closure)
        return self._plain_class.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._plain_class.zero_grad(self, set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        _check_passes(passes)
        self._passes = passes

    def _check_usable(self) -> None:
        if self._released:
            raise UsageError(f"ringreduce: this DistributedOptimizer on rank {self._rank} was "
                             "released; wrap a new one")


def _outside(process_set: ProcessSet) -> bool:
    """Whether this rank is outside `process_set`, a registered set (an unregistered one is
    left to `active()` to refuse)."""
    return (isinstance(process_set, ProcessSet) and process_set is not global_process_set
            and process_set.process_set_id is not None and process_set.included() is False)


def _global_rank() -> int:
    everyone = active(global_process_set, "DistributedOptimizer()")
    return everyone.ranks[everyone.rank]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         gradient_as_bucket_view: bool = False,
                         fusion_threshold: Optional[int] = None,
                         first_bucket_bytes: Optional[int] = None) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() uses gradients averaged over the process set's ranks
    (Horovod's signature, then ours).

    `gradient_as_bucket_view=True` makes each .grad a view into its bucket's buffer (as DDP's
    option of that name): no pack/unpack copies, and zero_grad() zeroes the buckets in place.
    A parameter alone in its bucket (a layer above the fusion threshold, say) is reduced in
    place in its .grad either way, with no buffer.
    `groups`: an int (that many buckets of about equal parameter count) or lists of parameters
    that each travel as one bucket; `num_groups` is Horovod's older spelling of an int `groups`.
    `op=Adasum` combines parameter deltas instead of averaging gradients (Horovod's Adasum
    optimizer; a power-of-two number of ranks).
    """
    if getattr(optimizer, "_ringreduce_wrapped", False):
        raise ValueError("ringreduce: this optimizer is a DistributedOptimizer already; wrap "
                         "the plain torch optimizer once")
    if _outside(process_set):
        return _wrap(optimizer, (_OutsideOptimizer, _DistributedOptimizer), named_parameters,
                     compression, backward_passes_per_step, op, gradient_predivide_factor,
                     num_groups, groups, sparse_as_dense, process_set, gradient_as_bucket_view,
                     fusion_threshold, first_bucket_bytes)
    ps = active(process_set, "DistributedOptimizer()")
    adasum_op = (op is not None
                 and reduce_op(op, None, "DistributedOptimizer", adasum_ok=True) == Adasum)
    if adasum_op and ps.size > 1:
        if gradient_predivide_factor != 1.0:
            raise ValueError("ringreduce: gradient_predivide_factor is not supported with "
                             "op=Adasum (as in Horovod)")
        for group in optimizer.param_groups:
            for p in group["params"]:
                adasum.check_supported(ps.size, compression.wire_dtype if
                                       compression.wire_dtype and
                                       compression.applies_to(p.dtype) else p.dtype)
    mixins = (_AdasumOptimizer, _DistributedOptimizer) if adasum_op and ps.size > 1 \
        else (_DistributedOptimizer,)
    return _wrap(optimizer, mixins, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                 gradient_as_bucket_view, fusion_threshold, first_bucket_bytes)


def _wrap(optimizer: torch.optim.Optimizer, mixins: tuple, named_parameters, compression,
          backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
          sparse_as_dense, process_set, gradient_as_bucket_view, fusion_threshold,
          first_bucket_bytes) -> torch.optim.Optimizer:
    """An instance of a subclass of the optimizer's class with the mixins' methods, sharing
    its param_groups and state."""
    methods = {}
    for mixin in reversed(mixins):
        methods.update({k: v for k, v in mixin.__dict__.items()
                        if k not in ("__dict__", "__weakref__", "__doc__")})
    # The wrapped class by name, not super(self.__class__): a framework may subclass this
    # object's class again (Lightning's LightningOptimizer does), which would loop.
    methods["_plain_class"] = optimizer.__class__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)   # share param_groups, state, defaults, hooks
    # An LR scheduler made before wrapping replaced the plain optimizer's step() with its own
    # (an instance attribute): copied, it would step the plain optimizer, unreduced.
    # That step() (torch's, which tells the scheduler a step happened) is kept, to step with:
    # both objects share param_groups and state, so it steps this one's parameters alike.
    shadowing = {name: wrapped.__dict__.pop(name) for name in methods if name in wrapped.__dict__}
    wrapped._plain_step = shadowing.get("step")
    # torch's patched step holds its optimizer weakly: keep the plain one alive for it.
    wrapped._plain = optimizer if wrapped._plain_step is not None else None
    wrapped._setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups if groups is not None or not num_groups
                   else num_groups, sparse_as_dense, gradient_as_bucket_view, fusion_threshold,
                   first_bucket_bytes, process_set)
    return wrapped


def _check_passes(passes: Any) -> None:
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError("ringreduce: backward_passes_per_step must be an integer >= 1, got "
                         f"{passes!r}")


def _sparse_or_empty(p: torch.Tensor) -> torch.Tensor:
    """p's sparse gradient as backward made it (not coalesced: Horovod gathers it as it is, and
    the optimizer's coalesce then adds up every rank's entries at once), or an empty one where
    this rank has none (the allgather is collective, so every rank takes part)."""
    if p.grad is not None and p.grad.layout == torch.sparse_coo:
        return p.grad
    empty_values = torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), empty_values,
                                   p.shape)


def _describe(bucket: fusion.Bucket) -> None:
    """Tell the timeline which parameters a bucket's events are about."""
    timeline.describe(bucket.name, parameters=bucket.names, bytes=bucket.nbytes,
                      in_place=bucket.direct)


def _remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


def _named_parameters(param_groups: Sequence[dict], named: Any
                      ) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """Names for every parameter of the optimizer, checked the way Horovod checks them, in
    param_groups order; and Horovod's `_parameter_names` (parameter -> name, sorted by name,
    over every entry of `named`). Without `named`, Horovod's generated names:
    'allreduce.noname.<group index>.<index in the group>'."""
    params = [p for group in param_groups for p in group["params"]]
    if named is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(param_groups)
                 for j, p in enumerate(group["params"])]
    named = list(named)
    if any(not isinstance(entry, tuple) or len(entry) != 2 for entry in named):
        raise ValueError("ringreduce: named_parameters must be a sequence of (name, parameter) "
                         "tuples, as model.named_parameters() gives")
    seen, duplicates = set(), set()
    for name, _ in named:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError(f"ringreduce: parameter names must be unique; duplicates: "
                         f"{sorted(duplicates)}")
    name_of = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in name_of]
    if unnamed:
        raise ValueError(f"ringreduce: named_parameters was given but {len(unnamed)} optimizer "
                         f"parameter(s) have no name (positions {unnamed[:10]} in param_groups); "
                         "pass model.named_parameters() of the model the optimizer trains")
    parameter_names = {p: n for n, p in sorted(named, key=lambda entry: entry[0])}
    return [(name_of[id(p)], p) for p in params], parameter_names


def _explicit_groups(groups: Any, named: list[tuple[str, torch.Tensor]]):
    if groups is None:
        return None
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"ringreduce: groups must be >= 1, got {groups}")
        params = [p for _, p in named]
        per = -(-len(params) // groups)
        return [params[i:i + per] for i in range(0, len(params), per)]
    if not all(isinstance(g, (list, tuple)) for g in groups):
        raise ValueError("ringreduce: groups must be an int or a list of lists of parameters")
    return groups
