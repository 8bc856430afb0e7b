"""The state objects of elastic training (Horovod's `horovod.torch.elastic` 0.28): what `run`
commits, restores after a failure and synchronises from rank 0.

`State` is the protocol (save, restore, sync, and the host-update checks a commit makes);
`ObjectState` keeps plain attributes; `TorchState` adds models, optimizers, samplers and
schedulers, each through a `StateHandler` chosen from a registry by type.
"""
from __future__ import annotations

import copy
import enum
import queue
from typing import Any, Callable, Iterable, Optional

import torch

from ..api.objects import broadcast_object, broadcast_parameters
from ..core.errors import HostsUpdatedInterrupt
from ..optim import wrapped_optimizer
from ..optim.optimizer_state import broadcast_optimizer_state
from ..sets import world
from .sampler import ElasticSampler

ROOT_RANK = 0                                     # the rank whose state everyone takes


# ---------------------------------------------------------------------- host updates

class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's flags). Only Horovod's driver reports updates."""
    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


# ---------------------------------------------------------------------- states

class Restorable:
    """What a state and each of its handlers do: save in memory, go back to the last save,
    take rank 0's."""

    def save(self) -> None:
        """Save the state in memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Go back to the last saved state, undoing uncommitted changes."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Give every rank rank 0's state. Collective."""
        raise NotImplementedError()


class State(Restorable):
    """Tracks training state in memory across ranks: `commit()` saves it, `restore()` goes back
    to the last commit, `sync()` gives every rank rank 0's.

    `bcast_object(obj)` and `get_rank()` are Horovod's arguments, optional here: by default
    ringreduce's `broadcast_object` from rank 0 and `rank()`."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank if get_rank is not None else world.rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of `callbacks` after every reset, before the state is synchronised (to
        rescale the learning rate with `size()`, say)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset: drop pending host updates, `reset()`, then the callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float,
                         update_res: HostUpdateResult = HostUpdateResult.no_update) -> None:
        """A driver's notification (none exists under plain mpirun); acted on at the next
        `commit()` / `check_host_updates()`. Thread-safe."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state in memory (a copy), then `check_host_updates()`. Collective."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank if rank 0 has seen a newer host update.
        Collective (one small broadcast), so that all ranks raise at the same point."""
        previous = latest = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, result = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > latest:
                latest, update = timestamp, update | result
        previous, self._last_updated_timestamp, update = self._broadcast(
            (previous, latest, update), "check_host_updates")
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(skip_sync=update == HostUpdateResult.removed)

    def reset(self) -> None:
        """Hook for subclasses: runs after a reset, before the callbacks and the sync."""

    def _abandon_pending_steps(self) -> None:
        """Hook: during a reset, once every rank's queued collectives are done, forget steps
        the state's objects had begun."""

    def _broadcast(self, obj: Any, what: str) -> Any:
        if self._bcast_object is not None:
            return self._bcast_object(obj)
        return broadcast_object(obj, ROOT_RANK, f"elastic.{what}")


class ObjectState(State):
    """State made of plain Python attributes, given as keyword arguments.

    As in Horovod, a commit keeps references, not copies: rebinding an attribute
    (`state.epoch += 1`) is undone by `restore()`, mutating an object in place is not.
    `sync()` gives every rank rank 0's committed values."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if not self._saved_state:
            return
        received = self._broadcast(self._saved_state, "sync.objects")
        if self._rank() != ROOT_RANK:     # rank 0 keeps its own objects, not copies of them
            self._saved_state = received
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


# ---------------------------------------------------------------------- handlers

class StateHandler(Restorable):
    """How a `TorchState` saves, restores and synchronises one kind of object."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def set_value(self, value: Any) -> None:
        """The attribute was rebound (`state.model = other`): track and save the new object."""
        self.value = value
        self.save()

    def abandon_step(self) -> None:
        """During a reset, once every rank's queued collectives are done: forget a step the
        object had begun (nothing to forget, by default)."""


class _StateDictHandler(StateHandler):
    """An object with `state_dict()` / `load_state_dict()`. Saves are deep copies, so that an
    in-place update after a commit (an optimizer step) cannot reach the commit."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # A copy again: load_state_dict may keep the tensors it is given (an optimizer's state
        # does), and the next step would then write into the commit.
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        name = f"elastic.sync.{type(self.value).__name__}"
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), ROOT_RANK, name))


class ModelStateHandler(_StateDictHandler):
    """A `torch.nn.Module`: parameters and buffers."""

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)     # copies into the module's own tensors

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=ROOT_RANK)


class OptimizerStateHandler(_StateDictHandler):
    """A `torch.optim.Optimizer`, `DistributedOptimizer` included: state and hyperparameters."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=ROOT_RANK)

    def abandon_step(self) -> None:
        """A `DistributedOptimizer` interrupted between backward and step still counts the
        buckets it submitted (done by now), and its next `zero_grad()` would raise. Its public
        `synchronize()` would also submit the buckets not yet submitted: a rank that failed
        before its backward would then lend stale gradients to the others' step. So forget the
        step with the optimizer's internal reset, which moves no data."""
        wrapped_optimizer.abandon_step(self.value)


class SamplerStateHandler(_StateDictHandler):
    """An `ElasticSampler`: epoch and processed count, rank 0's on sync."""


class LRSchedulerStateHandler(_StateDictHandler):
    """A learning-rate scheduler, loaded in place. Horovod 0.28 has no such handler and
    broadcasts a scheduler as a plain object, which on other ranks replaces it with a copy tied
    to a copy of the optimizer; loading its state keeps the scheduler the script holds."""


_handler_registry: list[tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type]]:
    """The (type, handler class) pairs `TorchState` tries in order for each keyword argument."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type]]) -> None:
    """Replace the registry (to give custom types a handler); affects later `TorchState`s."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> Optional[StateHandler]:
    for handled_type, handler_class in _handler_registry:
        if isinstance(value, handled_type):
            return handler_class(value)
    return None


# ---------------------------------------------------------------------- TorchState

class TorchState(ObjectState):
    """The state of a PyTorch training run: `model` and `optimizer`, and any keyword arguments
    (more models or optimizers, an `ElasticSampler`, a scheduler, `epoch=0, batch=0` ...), all
    readable as attributes. Objects with a handler (see `get_handler_registry`) are saved as
    deep copies of their state and synchronised in place; the rest as in `ObjectState`."""

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {name: _handler_for(value) for name, value in kwargs.items()}
        self._handlers = {name: h for name, h in handlers.items() if h is not None}
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        plain = {name: value for name, value in kwargs.items() if name not in self._handlers}
        super().__init__(None, None, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def _abandon_pending_steps(self) -> None:
        for handler in self._handlers.values():
            handler.abandon_step()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def abandon_pending_steps(state: State) -> None:
    """During a reset, once every rank's queued collectives are done: the state's objects
    forget the steps they had begun (a `DistributedOptimizer` interrupted between backward and
    step)."""
    state._abandon_pending_steps()
