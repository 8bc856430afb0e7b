"""Model state across a process set: broadcast parameters and objects; check that tensors are
bitwise identical everywhere. (The optimizer's state: optim/optimizer_state.py.)

Objects travel pickled by cloudpickle, as on Horovod, through the set's engine like every
collective.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import cloudpickle
import torch

from ..core.errors import ConsistencyError
from ..sets.active_set import ActiveSet, refusing
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active
from ..transport.set_transport import pickled
from ..transport.signature import qualified
from .collectives import broadcast_async_, synchronize

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
    agree_on_names(ps, "broadcast_parameters", prefix, [name for name, _ in named],
                   [tensor for _, tensor in named])
    handles = [broadcast_async_(tensor, root_rank, name, process_set) for name, tensor in named]
    for handle in handles:
        synchronize(handle)


def agree_on_names(ps: ActiveSet, helper: str, prefix: Optional[str],
                    names: list[str], tensors: Sequence[torch.Tensor] = ()) -> None:
    """One signature check of the names a helper is about to broadcast under, and of the
    `tensors` it broadcasts under the first of them: where some rank has other names (another
    model, a parameter with optimizer state on some ranks only, other param_groups), or a
    tensor of another shape or dtype, every rank gets a MismatchError naming them, before any
    broadcast: nothing is overwritten (a broadcast of a tensor that differs fails after those
    before it have landed, with those after it still under way), and no rank waits for
    broadcasts the others never submit (Horovod's stall)."""
    name = helper if prefix is None else f"{helper}[{prefix}]"
    ps.agree({"collective": helper, "name": name, "tensors": tuple(names),
              "shapes": tuple(f"{n}: {str(t.dtype)[6:]}{tuple(t.shape)}"
                              for n, t in zip(names, tensors))})


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Global rank root_rank's `obj` (any object cloudpickle takes, as on Horovod), on every
    member: the root's own object there, a copy on the others. The root pickles it before the
    collective and the others unpickle it after, as Horovod does, so their errors are their
    own, of pickle's types; one the root's pickling raises fails every member's call."""
    ps = active(process_set, "broadcast_object()")
    name = qualified("broadcast_object", name) or ps.auto_name("broadcast_object")
    with refusing(ps, name, "broadcast_object"):
        root = ps.root(root_rank, "broadcast_object", name)
    payload, refused = pickled(obj) if ps.rank == root else (memoryview(bytearray()), None)
    signature = {"collective": "broadcast_object", "name": name, "root_rank": int(root_rank)}
    buf = ps.engine.run(name, lambda: ps.transport.broadcast_pickled(payload, refused, root,
                                                                       signature))
    if refused is not None:     # (a set of one)
        raise refused
    return obj if ps.rank == root else cloudpickle.loads(buf)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every member's `obj`, as a list in set rank order (copies). Pickled before the
    collective and unpickled after it, as on Horovod: where every member's pickling fails
    alike, each raises its own error (pickle's type) and the set goes on; where some members'
    fails, every member gets a MismatchError quoting it."""
    ps, name, work, refused = _gathering(obj, name, process_set)
    return _unpickled(ps.engine.run(name, work), refused)


def begin_allgather_object(obj: Any, name: str,
                           process_set: ProcessSet = global_process_set) -> Callable[[], list]:
    """`allgather_object` queued on the set's engine, not waited for: for ringreduce's own
    meetings on several sets at once (an elastic reset's), each of which may be what another
    member's pending collective there has to meet. Returns the wait for its list."""
    ps, name, work, refused = _gathering(obj, name, process_set)
    handle = ps.engine.submit(name, work)
    return lambda: _unpickled(handle.wait(), refused)


def _gathering(obj: Any, name: Optional[str], process_set: ProcessSet
               ) -> tuple[ActiveSet, str, Callable[[], list], Optional[BaseException]]:
    """An object allgather's set, name and work, and this rank's pickling error (None)."""
    ps = active(process_set, "allgather_object()")
    name = qualified("allgather_object", name) or ps.auto_name("allgather_object")
    payload, refused = pickled(obj)
    signature = {"collective": "allgather_object", "name": name}
    return ps, name, lambda: ps.transport.allgather_pickled(payload, refused, signature), refused


def _unpickled(payloads: list, refused: Optional[BaseException]) -> list:
    """The members' objects; or this rank's own pickling error, raised after the collective
    (which then gathered no object)."""
    if refused is not None:
        raise refused
    return [cloudpickle.loads(one) for one in payloads]


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
    """The tensor's bytes, shape and dtype (the same bytes as a tensor of another shape or
    dtype are another tensor)."""
    hashed = hashlib.blake2b(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), digest_size=8)
    hashed.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return int.from_bytes(hashed.digest(), "little", signed=True)
