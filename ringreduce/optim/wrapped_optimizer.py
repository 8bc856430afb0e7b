"""What every `DistributedOptimizer` shares, whichever life cycle it has: Horovod's argument
checks and parameter names, stepping the wrapped optimizer, `skip_synchronize()`, `release()`,
and state shared with the plain optimizer an LR scheduler steps; and the simplest life cycle, a
rank outside the optimizer's process set or a job of one process (`LocalOptimizer`).

`DistributedOptimizer()` (optimizer.py) makes a subclass of the user's optimizer class with a
life cycle first in its bases, so the MRO is (life cycle, ..., `WrappedOptimizer`, the user's
class, ..., `torch.optim.Optimizer`) and `super()` in here reaches the wrapped class's own
methods.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..api.arguments import reduce_op
from ..api.compression import Compressor
from ..core.errors import UsageError
from ..kernels.ops import ReduceOp
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active
from ..sets.world import split_list

# Horovod's words, so that filters written for its warning match ours.
STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


@dataclasses.dataclass(frozen=True)
class Options:
    """`DistributedOptimizer()`'s arguments, as a life cycle's `_setup` takes them (`groups`
    already merged with Horovod's older `num_groups`)."""
    named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]
    compression: type[Compressor]
    backward_passes_per_step: int
    op: Any
    gradient_predivide_factor: float
    groups: Any
    sparse_as_dense: bool
    process_set: ProcessSet
    gradient_as_bucket_view: bool
    fusion_threshold: Optional[int]
    first_bucket_bytes: Optional[int]


class WrappedOptimizer:
    """The base of every life cycle; see the module's docstring. Set by `DistributedOptimizer()`
    before `_setup`: `_plain_step` (the step() an LR scheduler put on the plain optimizer, or
    None) and `_plain` (that optimizer, which shares this one's groups, see __setstate__)."""

    _plain_step: Optional[Callable[..., Any]]
    param_groups: list[dict]

    def _setup(self, options: Options) -> None:
        raise NotImplementedError

    def _check_arguments(self, options: Options, rank: int) -> ReduceOp:
        """The checks every rank makes, in or outside the process set, and the state every life
        cycle keeps: the parameters' names (`_named`, and Horovod's `_parameter_names`:
        parameter -> name), the passes per step. Returns the op."""
        self._process_set = options.process_set
        self._rank = rank
        self._named, self._parameter_names = named_parameters(self.param_groups,
                                                              options.named_parameters)
        self._names = {id(p): n for n, p in self._named}
        self._parameters_counted = len(self._named)     # (see Planning's added parameters)
        if options.gradient_as_bucket_view and options.compression is not Compressor:
            raise ValueError("ringreduce: gradient_as_bucket_view needs compression="
                             "Compression.none (compressed buckets hold another dtype)")
        self._passes = check_passes(options.backward_passes_per_step)
        op = reduce_op(options.op, None, "DistributedOptimizer", adasum_ok=True)
        if options.gradient_predivide_factor != 1.0 and (options.op is None
                                                         or op != ReduceOp.Average):
            raise ValueError("ringreduce: gradient_predivide_factor only applies to op=Average "
                             f"(got op={op.name}); drop the factor or use Average")
        self._skip_sync = False
        self._synchronized = False
        self._released = False
        self._hooks: list = []
        return op

    def _reset_step(self) -> None:
        """Forget the step begun: nothing is pending any more (moves no data)."""
        self._synchronized = False

    def gradients_sent(self) -> bool:
        """Whether every gradient of this step has gone to its reduction, none waited for yet
        (synchronize() would only wait): a front end may synchronize at the end of a backward
        pass then, where DDP's gradients are final. (Here: nothing is sent.)"""
        return False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize: call synchronize() yourself first
        (the AMP pattern: synchronize, unscale_, then step)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def _step_wrapped(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The wrapped optimizer's step: through the step() an LR scheduler made before
        wrapping put on the plain optimizer (so it sees the step), else the class's own."""
        arguments = () if closure is None else (closure,)
        if self._plain_step is not None:
            return self._plain_step(*arguments)
        return super().step(*arguments)     # type: ignore[misc]  (the wrapped class's)

    def step_locally(self) -> None:
        """The wrapped class's own step on this rank alone, reducing nothing: a step here would
        meet the other members' only if every member stepped (broadcast_optimizer_state's
        state initialization, as Horovod's)."""
        super().step()      # type: ignore[misc]  (the wrapped class's)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self._passes = check_passes(passes)

    def release(self) -> None:
        """Remove the gradient hooks: backward passes after this start no collectives (a
        training framework's teardown; the model may go on training with another optimizer).
        This optimizer cannot step again."""
        remove_hooks(self._hooks)
        self._hooks.clear()
        self._released = True

    def _check_usable(self) -> None:
        if self._released:
            raise UsageError(f"ringreduce: this DistributedOptimizer on rank {self._rank} was "
                             "released (its gradient hooks are removed); wrap a new one")

    def _patch_step_function(self) -> None:
        """torch's __setstate__ (load_state_dict) wraps `type(self).step` with the step hooks
        unless it is wrapped already: here that is our step, whose super() reaches the
        user's class's step, wrapped once by torch, and the hooks would run twice a step."""
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def __setstate__(self, state: dict) -> None:
        """load_state_dict() replaces `state` and `param_groups` with new objects: the plain
        optimizer, which an LR scheduler made before wrapping holds (and steps with, or sets
        the learning rates of), must keep sharing them: the same list where it shared the
        list, else the new group dicts in the old ones' places in its own."""
        old = self.__dict__.get("param_groups")
        super().__setstate__(state)     # type: ignore[misc]
        plain = self.__dict__.get("_plain")
        if plain is None:
            return
        if plain.param_groups is old:
            plain.state, plain.param_groups = self.state, self.param_groups
        else:
            new = {id(before): after for before, after in zip(old or (), self.param_groups)}
            plain.param_groups = [new.get(id(group), group) for group in plain.param_groups]


class LocalOptimizer(WrappedOptimizer):
    """On a rank outside the optimizer's process set, and in a job of one process, as
    Horovod's: no gradient hooks, nothing to reduce; synchronize() returns at once and step()
    steps with this rank's own gradients (the wrapped optimizer's step, given the closure)."""

    def _setup(self, options: Options) -> None:
        everyone = active(global_process_set, "DistributedOptimizer()")
        self._check_arguments(options, everyone.ranks[everyone.rank])

    def synchronize(self) -> None:
        self._synchronized = True

    def step(self, closure=None):
        self._check_usable()
        if not self._skip_sync:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE)
            self.synchronize()
        self._synchronized = False
        return self._step_wrapped(closure)


def abandon_step(optimizer: torch.optim.Optimizer) -> None:
    """Forget the step `optimizer` had begun, moving no data, if it is a DistributedOptimizer
    (elastic's reset, once every rank's queued collectives are done); a plain optimizer has
    nothing to forget."""
    if isinstance(optimizer, WrappedOptimizer):
        optimizer._reset_step()


def check_passes(passes: Any) -> int:
    """backward_passes_per_step as an int (Horovod counts down a float like 2.0 alike)."""
    if isinstance(passes, float) and passes.is_integer():
        passes = int(passes)
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError("ringreduce: backward_passes_per_step must be an integer >= 1, got "
                         f"{passes!r}")
    return int(passes)


def remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


def named_parameters(param_groups: Sequence[dict], named: Any
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


def explicit_groups(groups: Any, named: Sequence[tuple[str, torch.Tensor]]
                    ) -> Optional[Sequence[Sequence[torch.Tensor]]]:
    """The `groups` argument as lists of parameters that each travel as one bucket (an int:
    that many whose parameter counts differ by at most one, longer first, in `named`'s order),
    or None: buckets by size."""
    if groups is None:
        return None
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"ringreduce: groups must be >= 1, got {groups}")
        return [group for group in split_list([p for _, p in named], groups) if group]
    if not all(isinstance(g, (list, tuple)) for g in groups):
        raise ValueError("ringreduce: groups must be an int or a list of lists of parameters")
    seen: set[int] = set()
    for p in (p for g in groups for p in g):      # as Horovod checks them
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"ringreduce: groups must consist of parameters (torch.Tensor), "
                             f"got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError("ringreduce: a parameter can only appear once in groups")
        seen.add(id(p))
    return groups
