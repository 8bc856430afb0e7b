"""Horovod's `broadcast_optimizer_state`: every member gets the root's optimizer state and
options, by Horovod's procedure (its state made first where it is empty)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from ..api.collectives import broadcast_async_, synchronize
from ..api.objects import agree_on_names, broadcast_object
from ..sets.active_set import refusing
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active
from .wrapped_optimizer import WrappedOptimizer

AGREEMENT = "broadcast_optimizer_state"     # the name of its first collective, a signature check


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every member root_rank's optimizer state and options, by Horovod's procedure.

    An optimizer whose state is empty (before its first step) first gets its state made: every
    parameter that requires grad gets a zero gradient (sparse for SparseAdam, and for SGD on
    the parameters of `model`'s sparse `nn.Embedding` modules), and the optimizer steps once
    on this rank alone (a DistributedOptimizer with its wrapped class's step, reducing
    nothing). As in Horovod, that step moves parameters where the step does so with a zero
    gradient (weight decay), and the zero gradients stay. If the state is still empty (a
    stateless optimizer), that is all. Otherwise every state tensor is broadcast from the root
    in place (named '<key>.<occurrence>', as Horovod names them), and the options of every
    param_group (lr, momentum ...) and the state entries that are not tensors travel as one
    object from the root and are assigned back. LBFGS is refused (ValueError), as in Horovod.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("ringreduce: cannot broadcast torch.optim.LBFGS state (as in Horovod: "
                         "its state is deeply nested); broadcast_object(optimizer.state_dict()) "
                         "and load_state_dict() it instead")
    ps = active(process_set, "broadcast_optimizer_state()")   # clear errors before any change
    with refusing(ps, AGREEMENT, AGREEMENT):    # (one rank's mistake fails the others' call)
        ps.root(root_rank, "broadcast_optimizer_state()", "optimizer state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        _make_state(optimizer, model)
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        # (the agreement still runs: it is what a refusal above on another rank meets)
        agree_on_names(ps, AGREEMENT, None, [])
        return
    # state_dict()'s per-parameter dicts are the optimizer's own: writing into them (and into
    # the tensors they hold, in place) changes the optimizer's state.
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    assign: dict[str, Callable[[Any], None]] = {}
    occurrences: dict[str, int] = {}
    for index, group in enumerate(state_dict["param_groups"]):
        for option, value in group.items():
            if option != "params":
                key = f"{option}.{index}"
                scalars[key] = value
                assign[key] = functools.partial(_set_item, optimizer.param_groups[index], option)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue            # no state: never stepped (frozen, or no gradient yet)
            param_state = state_dict["state"][pid]
            for entry, value in param_state.items():
                occurrences[entry] = occurrences.get(entry, 0) + 1
                key = f"{entry}.{occurrences[entry]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    assign[key] = functools.partial(_set_item, param_state, entry)
    agree_on_names(ps, AGREEMENT, None, [key for key, _ in tensors] + list(scalars),
                   [t for _, t in tensors])
    handles = [broadcast_async_(tensor, root_rank, key, process_set) for key, tensor in tensors]
    for handle in handles:
        synchronize(handle)
    roots = broadcast_object(scalars, root_rank, "broadcast_optimizer_state.scalars",
                             process_set)
    for key, value in roots.items():
        assign[key](value)


def _make_state(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> None:
    """Horovod's state initialization: zero gradients, then one step on this rank alone."""
    sparse_params = set()
    if model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.sparse:
                sparse_params.update(id(p) for p in module.parameters())
    sparse_adam = isinstance(optimizer, torch.optim.SparseAdam)
    sgd = isinstance(optimizer, torch.optim.SGD)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = p.data.new_zeros(p.size())
                if sparse_adam or (sgd and id(p) in sparse_params):
                    p.grad = p.grad.to_sparse()
    if isinstance(optimizer, WrappedOptimizer):
        optimizer.step_locally()
    else:
        optimizer.step()


def _set_item(container: dict, key: Any, value: Any) -> None:
    container[key] = value
