"""Model and optimizer state across ranks: broadcast parameters, optimizer state, objects.

Objects travel pickled (mpi4py's lowercase calls), through the engine like every collective.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Union

import numpy as np
import torch

from .collectives import _name, _root, broadcast_async_, synchronize
from .errors import ConsistencyError
from .world import world

Params = Union[Mapping[str, torch.Tensor], Iterable[Any]]


def broadcast_parameters(params: Params, root_rank: int) -> None:
    """Overwrite every rank's tensors with root_rank's, in place: a state_dict, a dict of
    tensors, model.named_parameters(), or a list of tensors."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for index, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            continue
        handles.append(broadcast_async_(tensor, root_rank,
                                        name=f"broadcast_parameters.{name or index}"))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank root_rank's optimizer state and hyperparameters (works before the first
    step, when the state is empty, and for scalar entries such as Adam's step)."""
    state = broadcast_object(optimizer.state_dict() if world().comm.rank == root_rank else None,
                             root_rank, name="broadcast_optimizer_state")
    if world().comm.rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """root_rank's `obj` (any picklable object), on every rank."""
    name = _name(name, "broadcast_object")
    root = _root(root_rank, "broadcast_object", name)
    engine = world().engine

    def work() -> Any:
        engine.negotiator.check({"collective": "broadcast_object", "name": name,
                                        "root_rank": root})
        return engine.comm.bcast(obj if engine.comm.rank == root else None, root=root)

    return engine.run(name, work)


def allgather_object(obj: Any, name: str | None = None) -> list:
    """Every rank's `obj`, as a list indexed by rank."""
    name = _name(name, "allgather_object")
    engine = world("allgather_object()").engine

    def work() -> list:
        engine.negotiator.check({"collective": "allgather_object", "name": name})
        return engine.comm.allgather(obj)

    return engine.run(name, work)


def check_consistency(tensors: Union[torch.nn.Module, Params], name: str | None = None) -> None:
    """Raise `ConsistencyError` on every rank unless every tensor (a module's parameters and
    buffers, a state_dict, named tensors or a list) is bitwise identical on all ranks; the
    error names the first tensor that differs and which ranks hold which version."""
    if isinstance(tensors, torch.nn.Module):
        items = list(tensors.named_parameters()) + list(tensors.named_buffers())
    elif isinstance(tensors, Mapping):
        items = sorted(tensors.items())
    else:
        items = [t if isinstance(t, tuple) else (str(i), t) for i, t in enumerate(tensors)]
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    digests = np.array([_digest(t) for _, t in items], dtype=np.int64)
    name = _name(name, "check_consistency")
    engine = world("check_consistency()").engine
    signature = {"collective": "check_consistency", "name": name,
                 "tensors": tuple(n for n, _ in items)}

    def work() -> np.ndarray:
        engine.negotiator.check(signature)
        everyone = np.empty((engine.comm.size, len(digests)), dtype=np.int64)
        engine.comm.Allgather(digests, everyone)
        return everyone

    everyone = engine.run(name, work)
    for index, (tensor_name, _) in enumerate(items):
        column = everyone[:, index]
        if (column != column[0]).any():
            groups: dict[int, list[int]] = {}
            for rank, value in enumerate(column):
                groups.setdefault(int(value), []).append(rank)
            versions = "; ".join(f"ranks {ranks} hold version {v & 0xFFFFFFFF:08x}"
                                 for v, ranks in groups.items())
            raise ConsistencyError(
                f"ringreduce: tensor '{tensor_name}' differs across ranks ({versions}); the "
                "ranks have diverged: broadcast_parameters() from one rank, and look for "
                "updates made on some ranks only")


def _digest(tensor: torch.Tensor) -> int:
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
