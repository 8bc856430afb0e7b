"""`DistributedOptimizer`: gradients are averaged across a process set's ranks while backward runs.

The returned object is an instance of a subclass of the wrapped optimizer's class, made as
Horovod makes its own: the class's __init__ over the wrapped optimizer's param_groups (the same
group dicts), so isinstance checks, LR schedulers and state_dict keep working, and it starts
with the defaults, attributes and state that __init__ makes from the groups alone.
Its life cycle comes first in the subclass's bases, so it overrides the wrapped class's step()
and zero_grad() and reaches them with `super()`:
- on a member of the process set, gradients are reduced while backward runs
  (`GradientReduction`, gradient_reduction.py);
- with op=Adasum, Horovod's Adasum optimizer: each rank steps its own optimizer, and the
  parameter deltas are combined (`AdasumOptimizer`, adasum_optimizer.py);
- on a rank outside the process set, and in a job of one process, as in Horovod, nothing is
  hooked or reduced and step() steps with the local gradients (`LocalOptimizer`,
  wrapped_optimizer.py).
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch

from ..api.arguments import reduce_op
from ..api.compression import Compression, Compressor, custom
from ..kernels.ops import ReduceOp
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active
from ..transport import adasum
from .adasum_optimizer import AdasumOptimizer
from .gradient_reduction import GradientReduction
from .wrapped_optimizer import LocalOptimizer, Options, WrappedOptimizer


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.Average,
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
    `groups`: an int (that many groups, cut as Horovod's `split_list` cuts the parameters) or
    lists of parameters, each group traveling as one bucket per dtype (each gradient reduced
    in its own, as Horovod's grouped allreduce); `num_groups` is Horovod's older spelling of
    an int `groups`. With `groups`, as in Horovod, `gradient_predivide_factor` is used only
    for a group short of gradients at step() (a member without one, fewer passes than
    backward_passes_per_step), which Horovod reduces member by member.
    `op=Adasum` combines parameter deltas instead of averaging gradients (Horovod's Adasum
    optimizer; a power-of-two number of ranks).
    """
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)     # (Horovod's words)
    if isinstance(optimizer, WrappedOptimizer):
        raise ValueError("ringreduce: this optimizer is a DistributedOptimizer already; wrap "
                         "the plain torch optimizer once")
    options = Options(named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor,
                      groups if groups is not None or not num_groups else num_groups,
                      sparse_as_dense, process_set, gradient_as_bucket_view, fusion_threshold,
                      first_bucket_bytes)
    return _wrap(optimizer, _life_cycle(optimizer, options), options)


def _life_cycle(optimizer: torch.optim.Optimizer, options: Options) -> type[WrappedOptimizer]:
    """Which life cycle the wrapped optimizer gets; Adasum's arguments checked here, as
    Horovod checks them before wrapping."""
    alone = active(global_process_set, "DistributedOptimizer()").size == 1
    adasum_op = (options.op is not None and reduce_op(options.op, None, "DistributedOptimizer",
                                                      adasum_ok=True) == ReduceOp.Adasum)
    if adasum_op and not alone and options.process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if alone or _outside(options.process_set):
        return LocalOptimizer
    ps = active(options.process_set, "DistributedOptimizer()")
    if not adasum_op:
        return GradientReduction
    if options.gradient_predivide_factor != 1.0:
        raise ValueError("ringreduce: gradient_predivide_factor is not supported with "
                         "op=Adasum (as in Horovod)")
    compression = options.compression
    wire = None if custom(compression) else compression.wire_dtype    # (a user's: its own)
    for group in optimizer.param_groups:
        for p in group["params"]:
            adasum.check_supported(ps.size, wire if wire and compression.applies_to(p.dtype)
                                   else p.dtype)
    return AdasumOptimizer


def _lost_state(plain: dict, made: dict) -> int:
    """How many parameters' state the plain optimizer holds that the one its class's __init__
    made does not (Adagrad's __init__ makes state too: the same where it was given the class's
    defaults)."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.dtype == b.dtype and torch.equal(a, b))
        return type(a) is type(b) and a == b

    return sum(1 for p, values in plain.items()
               if values.keys() != made.get(p, {}).keys()
               or not all(same(v, made[p][k]) for k, v in values.items()))


def _outside(process_set: ProcessSet) -> bool:
    """Whether this rank is outside `process_set`, a registered set (an unregistered one is
    left to `active()` to refuse)."""
    return (isinstance(process_set, ProcessSet) and process_set is not global_process_set
            and process_set.process_set_id is not None and process_set.included() is False)


def _wrap(optimizer: torch.optim.Optimizer, life_cycle: type[WrappedOptimizer],
          options: Options) -> torch.optim.Optimizer:
    """An instance of a subclass of the optimizer's class with `life_cycle` first in its bases,
    made as Horovod makes its own: the class's __init__ over the optimizer's param_groups alone
    (the same group dicts). So its defaults, its attributes and its state are those __init__
    makes from the groups, not those the optimizer was made with or holds (a warning says
    where state is dropped), and hooks registered on the optimizer stay there. A class that
    cannot be made from its groups alone (which Horovod cannot wrap) keeps the optimizer's
    attributes and defaults, with empty state."""
    plain_class = type(optimizer)
    cls = type(plain_class.__name__, (life_cycle, plain_class), {})
    wrapped = cls.__new__(cls)
    try:
        plain_class.__init__(wrapped, optimizer.param_groups)
    except Exception:
        wrapped.__dict__.clear()
        wrapped.__dict__.update(optimizer.__dict__)
        wrapped.state = defaultdict(dict)
        wrapped.defaults = dict(optimizer.defaults)
    lost = _lost_state(optimizer.state, wrapped.state)
    if lost:
        warnings.warn(f"ringreduce: DistributedOptimizer starts with the state its class makes, "
                      f"as Horovod's does: the state the wrapped optimizer holds for {lost} "
                      "parameter(s) is not carried over. Load a checkpoint into the "
                      "DistributedOptimizer (then broadcast_optimizer_state) instead.")
    # An LR scheduler made before wrapping replaced the plain optimizer's step() with its own
    # (an instance attribute), which steps the plain optimizer: the life cycle steps through
    # it (torch's, which tells the scheduler a step happened), so that the scheduler sees the
    # steps; both objects share the param_groups' dicts and (below) state, so it steps this
    # one's parameters alike. (Copied, as where the class cannot be made, such attributes
    # would hide the life cycle's own and step unreduced.)
    ours = {name for klass in life_cycle.__mro__ if klass is not object for name in vars(klass)}
    for name in ours:
        wrapped.__dict__.pop(name, None)
    wrapped._plain_step = optimizer.__dict__.get("step")
    # The plain optimizer shares this one's group dicts (__init__ took them), and keeps them
    # through load_state_dict (WrappedOptimizer.__setstate__): a ReduceLROnPlateau made on it
    # sets their learning rates. Where a scheduler patched its step, which the life cycle
    # steps through, it gets this one's state and list of groups too. (torch's patched step
    # holds its optimizer weakly: it is kept alive for it.) A group added to either optimizer
    # after wrapping is that one's alone, as on Horovod (where the plain one's step is not
    # the wrapper's).
    wrapped._plain = optimizer
    if wrapped._plain_step is not None:
        optimizer.state = wrapped.state
        optimizer.param_groups = wrapped.param_groups
    wrapped._setup(options)
    return wrapped
