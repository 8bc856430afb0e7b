"""A DistributedOptimizer's bucket plan over its parameters, as its life cycle keeps it
(gradient_reduction.py): which parameters are reduced (those trainable now, or in a plan every
rank agreed on: as in Horovod, a parameter trainable when wrapped stays in the plan when
frozen, its gradient reduced as zeros; one made trainable since joins it, where Horovod would
leave it unreduced and the ranks' parameters would drift apart), the buckets (fusion.py) and
their specs, the plan checked alike on every member as the optimizer is wrapped, made again
when a parameter is frozen or unfrozen or added (a param group added after wrapping), a
gradient comes sparse or the set is made anew, a hook on every reduced parameter, and, with
gradient_as_bucket_view, the gradients as views of the buckets (zero_grad() zeroes those)."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..sets.process_sets import active
from ..transport.reduce_spec import ReduceSpec
from ..transport.signature import digest
from . import fusion
from .step_agreement import StepAgreement
from .submission import describe
from .wrapped_optimizer import explicit_groups


# The DistributedOptimizer that last hooked a parameter (by id): a gradient that two live
# ones would reduce is refused (see _hook).
_REDUCED_BY: dict[int, weakref.ref] = {}


class Planning:
    """(A part of GradientReduction: the attributes it reads are set in its `_setup`.)"""

    def _trainable(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters reduced: those trainable now or in an earlier plan that every rank
        agreed on (Horovod keeps reducing a parameter frozen after wrapping). A plan that
        failed its check (a parameter unfrozen on some ranks only) leaves no trace: frozen
        again, the parameter is out of the plan, and the ranks agree again."""
        return [(n, p) for n, p in self._named if p.requires_grad or id(p) in self._ever_planned]

    def _plan(self) -> None:
        """Buckets over the trainable parameters with dense gradients, their reductions, the
        step's agreement, and a gradient hook on every trainable parameter."""
        trainable = self._trainable()
        dense = [(n, p) for n, p in trainable if id(p) not in self._sparse]
        wire = None if self._custom else self._compression.wire_dtype

        def wire_dtype(dtype: torch.dtype) -> torch.dtype:
            return wire if wire is not None and self._compression.applies_to(dtype) else dtype

        self._buckets = fusion.plan(dense, 0 if self._custom else self._threshold,
                                    self._first_bucket, wire_dtype,
                                    explicit_groups(self._groups, dense), self._prefix,
                                    direct=self._direct_buckets)
        op, prescale, postscale = self._reduction
        for b in self._buckets:     # (a rank given another op or factor: MismatchError)
            b.signature.update(op=op.name, prescale=prescale, postscale=postscale)
        # The first bucket (a plan has one, maybe empty) carries the plan: see _submit_bucket.
        self._plan_signed = self._plan_fields()
        self._buckets[0].signature.update(self._plan_signed)
        short = self._short_reduction is not None       # (say which, where it can differ)
        self._specs = [_spec(b, self._reduction, _ALL_THERE if short else None)
                       for b in self._buckets]
        self._short_specs = None if not short else [
            _spec(b, self._short_reduction, _SHORT) for b in self._buckets]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._view_of = {id(p): v for b in self._buckets for p, v in zip(b.params, b.views)}
        self._sparse_params = [(n, p) for n, p in trainable if id(p) in self._sparse]
        self._planned = frozenset(id(p) for _, p in trainable)
        self._planned_sparse = frozenset(self._sparse)
        self._agreement = StepAgreement(self._set, self._process_set, self._prefix,
                                        [n for n, _ in dense],
                                        [n for n, _ in self._sparse_params])
        self._agrees = self._set.size > 1
        for bucket in self._buckets:
            describe(bucket)
        if self._views:
            self._point_grads_at_buckets()
        self._hook([p for _, p in trainable])

    def _agree_on_plan(self) -> None:
        """One signature check of the first plan, as every member wraps its optimizer: the
        parameters in bucket order, how many go in each bucket, the reduction and the passes
        per step. A rank wrapped otherwise (num_groups, groups, a fusion threshold, another
        model, op ...) makes a MismatchError on every rank here, rather than at the first
        step, where a rank with more buckets than the others then waited for ever for theirs.
        (The plans made again later, at a step, change alike on every rank: a parameter
        frozen or unfrozen on some ranks only meets the others' first bucket at that step,
        which carries the plan, see _submit_bucket.)"""
        if self._set.size == 1:
            return
        op, prescale, postscale = self._reduction
        short = self._short_reduction
        signature = {"collective": "DistributedOptimizer", "name": f"{self._prefix}plan",
                     **self._plan_signed,
                     "reduction": (op.name, prescale, postscale),
                     "reduction of a group short of gradients": None if short is None else (
                         short[0].name, *short[1:]),
                     "backward_passes_per_step": self._passes,
                     "sparse_as_dense": self._sparse_as_dense}
        self._set.agree(signature)

    def _plan_fields(self) -> dict:
        """What makes two ranks' plans the same: the parameters in bucket order and their
        shapes (names given by position where named_parameters are not, so a rank that lists
        its parameters in another order differs there), the large ones reduced alone in place
        (fusion.ALONE_BYTES: one laid out otherwise on one rank is fused there, and the
        mismatch names it), and how many go in each bucket."""
        return {"plan": tuple(n for b in self._buckets for n in b.names),
                "shapes": tuple(f"{n}: {tuple(p.shape)}" for b in self._buckets
                                for n, p in zip(b.names, b.params)),
                "large, reduced alone": tuple(b.names[0] for b in self._buckets
                                              if b.direct and b.nbytes >= fusion.ALONE_BYTES),
                "bucket sizes": tuple(len(b.params) for b in self._buckets)}

    def _hook(self, params: list[torch.Tensor]) -> None:
        # The hooks live in torch's C++ parameter objects, which the garbage collector cannot
        # see through: hold the optimizer weakly there.
        me = weakref.ref(self)

        def on_gradient(p: torch.Tensor) -> None:
            optimizer = me()
            if optimizer is None:
                return
            latest = _REDUCED_BY.get(id(p))
            other = latest() if latest is not None and latest is not me else None
            if other is not None and not other._released:     # (both hooks fire)
                optimizer._break_step(
                    f"ringreduce: parameter '{optimizer._names[id(p)]}' on rank "
                    f"{optimizer._rank} is reduced by two DistributedOptimizers, which would "
                    "average its gradient twice, racing each other: give each parameter to "
                    "one DistributedOptimizer (param groups of one optimizer), or release() "
                    "the one no longer used")
            optimizer._on_gradient(p)

        for p in params:
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._hooks.append(p.register_post_accumulate_grad_hook(on_gradient))
                _REDUCED_BY[id(p)] = me

    def _replan_if_changed(self) -> None:
        """Before anything of a step is submitted: a parameter frozen or unfrozen since the
        plan, a gradient found sparse, or the set made anew by init(), re-plans the buckets.
        Every rank that makes the same change re-plans alike; a rank that does not fails the
        buckets' signature check (MismatchError naming the parameters)."""
        self._take_added_parameters()
        trainable = frozenset(id(p) for _, p in self._trainable())
        if (self._found_new_set() or trainable != self._planned
                or self._sparse != self._planned_sparse):
            self._plan()
            self._reset_step()

    def _take_added_parameters(self) -> None:
        """The parameters of a param group added since wrapping (add_param_group, on this
        optimizer or on the one it wraps, whose param_groups it shares) join those reduced,
        named as the given named_parameters name them, else as Horovod names a parameter
        without a name. (Horovod hooks only the parameters it was wrapped with: an added group
        trained apart on each rank.)"""
        count = sum(len(group["params"]) for group in self.param_groups)
        if count == self._parameters_counted:
            return
        self._parameters_counted = count
        given = {id(p): name for p, name in self._parameter_names.items()}
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in self._names:
                    name = given.get(id(p), f"allreduce.noname.{i}.{j}")
                    if name in self._names.values():
                        raise ValueError(f"ringreduce: a parameter added to the optimizer "
                                         f"takes the name '{name}', which another has")
                    self._named.append((name, p))
                    self._names[id(p)] = name

    def _found_new_set(self) -> bool:
        """After shutdown() and init() (Horovod's way on after an error, which its optimizers
        survive), the set this optimizer reduced on is closed: take the set's new one (a
        process set other than the global one must be registered again first, as in
        Horovod), and a new prefix of bucket names there, as every rank does at the same
        step. True where it did."""
        if not self._set.closed:
            return False
        self._set = active(self._process_set, "DistributedOptimizer's step")
        self._prefix = self._set.optimizer_prefix()
        return True

    def _zero_bucket_views(self, set_to_none: bool) -> None:
        """gradient_as_bucket_view's zero_grad(): the buckets zeroed in place, and the
        gradients kept as views of them."""
        for bucket in self._buckets:
            bucket.buffer.zero_()
            if not bucket.params:       # (a plan's first bucket, where no dense gradient is)
                continue
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

    def _point_grads_at_buckets(self) -> None:
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view


def _spec(bucket: fusion.Bucket, reduction: tuple, gradients: Optional[str]) -> ReduceSpec:
    """A bucket's ReduceSpec under `reduction` (op, prescale, postscale), which its signature
    states (the plan's own reduction is in it already), first saying whether its `gradients`
    were all there at step() where that decides the reduction (a group with a predivide
    factor): a rank short of one where the others are not then reads so in the MismatchError."""
    op, prescale, postscale = reduction
    said = {} if gradients is None else {_GRADIENTS: gradients}
    signature = {**said, **bucket.signature, "op": op.name, "prescale": prescale,
                 "postscale": postscale}
    return ReduceSpec(bucket.buffer.dtype, op, prescale, postscale, digest(signature),
                      signature, [p.numel() for p in bucket.params])


_GRADIENTS = "gradients at step()"
_ALL_THERE = "all there: one grouped allreduce, without the predivide factor (as Horovod)"
_SHORT = ("a member's missing, or fewer passes than backward_passes_per_step: reduced with "
          "the predivide factor (as Horovod reduces such a group member by member)")
