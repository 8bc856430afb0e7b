"""`DistributedOptimizer`: gradients are averaged across ranks while backward runs.

Life cycle of one step:
  backward: each parameter's post-accumulate hook counts its passes; on the last pass its
      gradient is packed into its bucket; a full bucket is handed to the engine (in bucket
      order, the same on every rank), which reduces it on its thread while backward goes on.
  synchronize(): buckets that never filled (parameters with no gradient on this rank) are
      packed with zeros and submitted, so every rank reduces the same buckets; then wait.
  step(): synchronize() unless inside skip_synchronize(), then the wrapped optimizer's step.

The returned object is an instance of a subclass of the wrapped optimizer's class, sharing its
param_groups and state, so isinstance checks, LR schedulers and state_dict keep working.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from . import cuda, fusion, timeline
from .collectives import Average, Sum, _op
from .compression import Compression, Compressor
from .engine import Handle
from .errors import RingReduceError
from .objects import check_consistency
from .process_sets import ProcessSet, active, global_process_set
from .signature import digest
from .transport import ReduceSpec


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods mixed into the dynamic subclass; see `DistributedOptimizer`."""

    def _setup(self, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, gradient_as_bucket_view,
               fusion_threshold, first_bucket_bytes, process_set) -> None:
        ps = self._set = active(process_set, "DistributedOptimizer()")
        self._process_set = process_set
        self._rank = ps.ranks[ps.rank]
        settings = ps.transport.settings
        named = _named_parameters(self.param_groups, named_parameters)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("ringreduce: backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        op = _op(op, None, "DistributedOptimizer")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("ringreduce: gradient_predivide_factor only applies to op=Average "
                             f"(got op={op.name}); drop the factor or use Average")
        if gradient_as_bucket_view and compression is not Compression.none:
            raise ValueError("ringreduce: gradient_as_bucket_view needs compression="
                             "Compression.none (compressed buckets hold another dtype)")
        # Average with a predivide factor f: sum(g / f) * f / size.
        predivided = gradient_predivide_factor != 1.0
        reduce_op = Sum if predivided else op
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor / ps.size if predivided else 1.0
        self._sparse_as_dense = sparse_as_dense
        self._passes = backward_passes_per_step
        self._names = {id(p): n for n, p in named}
        self._named = named
        self._consistency_every = settings.consistency_check_steps
        self._steps_taken = 0
        wire = compression.wire_dtype

        def wire_dtype(dtype: torch.dtype) -> torch.dtype:
            return wire if wire is not None and compression.applies_to(dtype) else dtype

        threshold = settings.fusion_threshold if fusion_threshold is None else fusion_threshold
        first = settings.first_bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
        self._buckets = fusion.plan(named, threshold, first, wire_dtype,
                                    _explicit_groups(groups, named))
        self._specs = [ReduceSpec(b.buffer.dtype, reduce_op, prescale, postscale,
                                  digest(b.signature), b.signature) for b in self._buckets]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        for bucket in self._buckets:
            _describe(bucket)
        self._views = gradient_as_bucket_view
        self._view_of = {id(p): v for b in self._buckets for p, v in zip(b.params, b.views)}
        if self._views:
            self._point_grads_at_buckets()
        self._skip_sync = False
        # The hooks live in torch's C++ parameter objects, which the garbage collector cannot
        # see through: hold the optimizer weakly there, and drop the hooks with it.
        me = weakref.ref(self)

        def on_gradient(p: torch.Tensor) -> None:
            optimizer = me()
            if optimizer is not None:
                optimizer._on_gradient(p)

        hooks = [p.register_post_accumulate_grad_hook(on_gradient)
                 for b in self._buckets for p in b.params]
        weakref.finalize(self, _remove_hooks, hooks)
        self._reset_step()

    # ------------------------------------------------------------ backward

    def _reset_step(self) -> None:
        self._pass_count = {id(p): 0 for b in self._buckets for p in b.params}
        self._waiting = [len(b.params) for b in self._buckets]  # params not ready, per bucket
        self._next_bucket = 0               # buckets are submitted strictly in order
        self._handles: list[Handle] = []
        self._synchronized = False
        self._first_gradient_at: dict[int, float] = {}  # bucket index -> time (timeline only)

    def _point_grads_at_buckets(self) -> None:
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    def _on_gradient(self, p: torch.Tensor) -> None:
        key = id(p)
        if timeline.running():      # "waiting for gradients" starts at the first
            self._first_gradient_at.setdefault(self._bucket_of[key].index, time.perf_counter())
        self._pass_count[key] += 1
        count = self._pass_count[key]
        if count > self._passes:
            raise RingReduceError(
                f"ringreduce: gradient of '{self._names[key]}' was computed {count} times on "
                f"rank {self._rank} before step(); backward_passes_per_step is {self._passes}. "
                "Increase backward_passes_per_step to accumulate gradients locally, or call "
                "step()/synchronize() between backward passes.")
        if count < self._passes:
            return
        if p.grad is not None and p.grad.layout != torch.strided:
            if not self._sparse_as_dense:
                raise TypeError(
                    f"ringreduce: parameter '{self._names[key]}' on rank {self._rank} has a "
                    f"{p.grad.layout} gradient; pass sparse_as_dense=True to DistributedOptimizer")
            p.grad = p.grad.to_dense()
        bucket = self._bucket_of[key]
        view = self._view_of.get(key)   # None: a direct bucket
        if (self._views and view is not None and p.grad is not None
                and p.grad.data_ptr() != view.data_ptr()):
            view.copy_(p.grad)   # the gradient was re-created (set_to_none): view it again
            p.grad = view
        self._waiting[bucket.index] -= 1
        if self._waiting[bucket.index] == 0:
            timeline.record(bucket.name, "gradients ready")
        self._submit_ready_buckets()

    def _submit_ready_buckets(self, force: bool = False) -> None:
        while self._next_bucket < len(self._buckets) and (
                force or self._waiting[self._next_bucket] == 0):
            bucket = self._buckets[self._next_bucket]
            self._trace_waiting(bucket)
            ready = None   # GPU: an event on torch's stream, after which the bucket is packed
            gradient = None
            with timeline.span(bucket.name, "pack"):
                if bucket.direct:
                    gradient = bucket.gradient()
                elif bucket.buffer.is_cuda:
                    ready = cuda.pack(bucket)
                else:
                    bucket.pack()
            self._handles.append(self._set.engine.submit(
                bucket.name, self._reduce_work(bucket, ready, gradient)))
            timeline.record(bucket.name, "submitted")
            self._next_bucket += 1

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
            if not bucket.direct:
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
        _describe(bucket)   # again: another optimizer's buckets may have the same names
        start = self._first_gradient_at.get(bucket.index)
        if start is not None:
            timeline.add_span(bucket.name, "waiting for gradients", start, time.perf_counter())

    # ------------------------------------------------------------ public methods

    def synchronize(self) -> None:
        """Finish reducing every gradient of this step (zeros for gradients never produced)."""
        if self._synchronized:
            return
        self._submit_ready_buckets(force=True)
        try:
            for handle in self._handles:
                handle.wait()
        finally:
            self._handles = []
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
        if not self._skip_sync:
            self.synchronize()
        elif not self._synchronized:
            raise RingReduceError(
                f"ringreduce: step() inside skip_synchronize() on rank {self._rank} before "
                "synchronize(); call optimizer.synchronize() first")
        result = super(self.__class__, self).step(closure)
        self._reset_step()
        self._steps_taken += 1
        if self._consistency_every and self._steps_taken % self._consistency_every == 0:
            check_consistency(self._named, name=f"check_consistency.step{self._steps_taken}",
                              process_set=self._process_set)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise RingReduceError(
                f"ringreduce: optimizer.zero_grad() on rank {self._rank} was called after "
                "loss.backward() but before optimizer.step() or optimizer.synchronize(); the "
                "gradients are still being reduced. Call zero_grad() before backward.")
        if self._views:     # keep the gradients as views of the buckets
            for bucket in self._buckets:
                bucket.buffer.zero_()
                p = bucket.params[0]
                if bucket.direct and p.grad is not None:    # no bucket: as torch does
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
            self._point_grads_at_buckets()
            self._reset_step()
            return
        super(self.__class__, self).zero_grad(set_to_none)
        self._reset_step()

    def set_backward_passes_per_step(self, passes: int) -> None:
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"ringreduce: backward_passes_per_step must be >= 1, got {passes!r}")
        self._passes = passes
        self._reset_step()


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
    """
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items()
                if k not in ("__dict__", "__weakref__")})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)   # share param_groups, state, defaults, hooks
    wrapped._setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups if groups is not None or not num_groups
                   else num_groups, sparse_as_dense, gradient_as_bucket_view, fusion_threshold,
                   first_bucket_bytes, process_set)
    return wrapped


def _describe(bucket: fusion.Bucket) -> None:
    """Tell the timeline which parameters a bucket's events are about."""
    timeline.describe(bucket.name, parameters=bucket.names, bytes=bucket.nbytes,
                      in_place=bucket.direct)


def _remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


def _named_parameters(param_groups: Sequence[dict], named: Any) -> list[tuple[str, torch.Tensor]]:
    """Names for every parameter of the optimizer, checked the way Horovod checks them."""
    params = [p for group in param_groups for p in group["params"]]
    if named is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
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
    return [(name_of[id(p)], p) for p in params]


def _explicit_groups(groups: Any, named: list[tuple[str, torch.Tensor]]):
    if groups is None:
        return None
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"ringreduce: groups must be >= 1, got {groups}")
        params = [p for _, p in named if p.requires_grad]
        per = -(-len(params) // groups)
        return [params[i:i + per] for i in range(0, len(params), per)]
    if not all(isinstance(g, (list, tuple)) for g in groups):
        raise ValueError("ringreduce: groups must be an int or a list of lists of parameters")
    return groups
