"""Model and optimizer state across a process set: broadcast parameters, optimizer state and
objects; check that tensors are bitwise identical everywhere.

Objects travel pickled (mpi4py's lowercase calls), through the set's engine like every
collective.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from .collectives import broadcast_async_, synchronize
from .errors import ConsistencyError
from .process_sets import ActiveSet, ProcessSet, active, global_process_set, refusing
from .signature import qualified
from .wrapped_optimizer import WrappedOptimizer

Params = Union[Mapping[str, torch.Tensor], Iterable[Any]]


def broadcast_parameters(params: Params, root_rank: int, prefix: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every member's tensors with global rank root_rank's, in place: a state_dict, a
    dict of tensors, model.named_parameters(), or a list of tensors. `prefix` goes in front of
    the collectives' names (to tell two models' broadcasts apart)."""
    ps = active(process_set, "broadcast_parameters()")
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    named = [(f"broadcast_parameters.{prefix or ''}{name if name is not None else index}",
              tensor) for index, (name, tensor) in enumerate(items)
             if isinstance(tensor, torch.Tensor)]
    _agree_on_names(ps, "broadcast_parameters", prefix, [name for name, _ in named])
    handles = [broadcast_async_(tensor, root_rank, name, process_set) for name, tensor in named]
    for handle in handles:
        synchronize(handle)


def _agree_on_names(ps: ActiveSet, helper: str, prefix: Optional[str],
                    names: list[str]) -> None:
    """One signature check of the names a helper is about to broadcast under: where some rank
    has others (another model, a parameter with optimizer state on some ranks only, other
    param_groups), every rank gets a MismatchError naming them, instead of each waiting for
    broadcasts the others never submit (Horovod's stall)."""
    name = helper if prefix is None else f"{helper}[{prefix}]"
    ps.agree({"collective": helper, "name": name, "tensors": tuple(names)})


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
    ps.root(root_rank, "broadcast_optimizer_state()", "optimizer state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        _make_state(optimizer, model)
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
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
    _agree_on_names(ps, "broadcast_optimizer_state", None,
                    [key for key, _ in tensors] + list(scalars))
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


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Global rank root_rank's `obj` (any picklable object), on every member."""
    ps = active(process_set, "broadcast_object()")
    name = qualified("broadcast_object", name) or ps.auto_name("broadcast_object")
    with refusing(ps, name, "broadcast_object"):
        root = ps.root(root_rank, "broadcast_object", name)
    signature = {"collective": "broadcast_object", "name": name, "root_rank": int(root_rank)}
    return ps.engine.run(name, lambda: ps.transport.broadcast_object(obj, root, signature))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every member's `obj`, as a list in set rank order."""
    ps = active(process_set, "allgather_object()")
    name = qualified("allgather_object", name) or ps.auto_name("allgather_object")
    signature = {"collective": "allgather_object", "name": name}
    return ps.engine.run(name, lambda: ps.transport.allgather_object(obj, signature))


def check_consistency(tensors: Union[torch.nn.Module, Params], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> None:
    """Raise `ConsistencyError` on every member unless every tensor (a module's parameters and
    buffers, a state_dict, named tensors or a list) is bitwise identical on all of them; the
    error names the first tensor that differs and which ranks hold which version."""
    ps = active(process_set, "check_consistency()")
    if isinstance(tensors, torch.nn.Module):
        items = list(tensors.named_parameters()) + list(tensors.named_buffers())
    elif isinstance(tensors, Mapping):
        items = sorted(tensors.items())
    else:
        items = [t if isinstance(t, tuple) else (str(i), t) for i, t in enumerate(tensors)]
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    digests = torch.tensor([[_digest(t) for _, t in items]], dtype=torch.int64)
    name = qualified("check_consistency", name) or ps.auto_name("check_consistency")
    signature = {"collective": "check_consistency", "name": name,
                 "tensors": tuple(n for n, _ in items)}
    everyone = ps.engine.run(name, lambda: ps.transport.allgather(digests, signature)).numpy()
    for index, (tensor_name, _) in enumerate(items):
        column = everyone[:, index]
        if (column != column[0]).any():
            groups: dict[int, list[int]] = {}
            for member, value in enumerate(column):
                groups.setdefault(int(value), []).append(ps.ranks[member])
            versions = "; ".join(f"ranks {ranks} hold version {v & 0xFFFFFFFF:08x}"
                                 for v, ranks in groups.items())
            raise ConsistencyError(
                f"ringreduce: tensor '{tensor_name}' differs across ranks ({versions}); the "
                "ranks have diverged: broadcast_parameters() from one rank, and look for "
                "updates made on some ranks only")


def _digest(tensor: torch.Tensor) -> int:
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
