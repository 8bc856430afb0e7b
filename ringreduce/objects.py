"""Model and optimizer state across a process set: broadcast parameters, optimizer state and
objects; check that tensors are bitwise identical everywhere.

Objects travel pickled (mpi4py's lowercase calls), through the set's engine like every
collective.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from .collectives import broadcast_async_, synchronize
from .errors import ConsistencyError
from .process_sets import ProcessSet, active, global_process_set

Params = Union[Mapping[str, torch.Tensor], Iterable[Any]]


def broadcast_parameters(params: Params, root_rank: int, prefix: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every member's tensors with global rank root_rank's, in place: a state_dict, a
    dict of tensors, model.named_parameters(), or a list of tensors. `prefix` goes in front of
    the collectives' names (to tell two models' broadcasts apart)."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for index, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            continue
        label = f"{prefix or ''}{name if name is not None else index}"
        handles.append(broadcast_async_(tensor, root_rank, f"broadcast_parameters.{label}",
                                        process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every member root_rank's optimizer state and hyperparameters (works before the first
    step, when the state is empty, and for scalar entries such as Adam's step)."""
    ps = active(process_set, "broadcast_optimizer_state()")
    me = ps.ranks[ps.rank]
    state = broadcast_object(optimizer.state_dict() if me == root_rank else None, root_rank,
                             "broadcast_optimizer_state", process_set)
    if me != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Global rank root_rank's `obj` (any picklable object), on every member."""
    ps = active(process_set, "broadcast_object()")
    name = ps.auto_name("broadcast_object") if name is None else name
    root = ps.root(root_rank, "broadcast_object", name)
    signature = {"collective": "broadcast_object", "name": name, "root_rank": int(root_rank)}
    return ps.engine.run(name, lambda: ps.transport.broadcast_object(obj, root, signature))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every member's `obj`, as a list in set rank order."""
    ps = active(process_set, "allgather_object()")
    name = ps.auto_name("allgather_object") if name is None else name
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
    name = ps.auto_name("check_consistency") if name is None else name
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
