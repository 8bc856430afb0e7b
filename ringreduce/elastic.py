"""Elastic training with Horovod's API (`horovod.torch.elastic` 0.28): `run`, `TorchState`,
`ObjectState`, `State`, `ElasticSampler`, the state handlers and `HostsUpdatedInterrupt`.

Under plain `mpirun` there is no elastic driver (`horovodrun --elastic`, host discovery), so the
job has a fixed size: no rank ever joins, no host is ever reported added or removed, and a lost
rank still ends the job (MPI without fault tolerance). What elastic training keeps here: the
state is synchronised from rank 0 when training starts, commits are in-memory copies, and a
`HorovodInternalError` rolls every rank back to the last commit and runs the function again.

How a reset differs from Horovod's, and why:
- No `shutdown()` + `init()`. Horovod restarts to form a new world; ours is the same world
  afterwards, and a restart would break what holds the old one: a `DistributedOptimizer` keeps
  its set's engine, process sets and a running timeline end, and `init()`'s communicator and
  settings would be lost. Instead all ranks meet in one collective (the agreement), which runs
  after every collective each rank had queued; then each `DistributedOptimizer` in the state
  forgets the step it had begun. An error that reaches Python leaves ringreduce's
  communicators usable (a `MismatchError` is raised on every rank before any data moves); an
  MPI failure from a dead peer ends the job anyway.
- A rank that failed alone still resets with the others: while its agreement is pending, each
  collective the others run fails with `MismatchError` naming it (negotiation.RESET), so they
  reset too. (If they have left the function already, it waits there, and the stall report
  says so.)
- A bounded number of resets. Under plain mpirun a `HorovodInternalError` is a program error
  (a `MismatchError`, a misuse of the optimizer) or one raised on purpose, so Horovod's unbounded
  loop would retry a deterministic error forever. More failures than
  `RINGREDUCE_ELASTIC_RESET_LIMIT` (default 5, 0 = never reset) in one call of the decorated
  function end it on every rank with a `RingReduceError` naming each rank's error.
"""
from __future__ import annotations

import copy
import enum
import functools
import logging
import os
import queue
import random
from typing import Any, Callable, Iterable, Iterator, Optional, Sized, TypeVar

import torch
from torch.utils.data import Sampler

from . import world
from .errors import HorovodInternalError, RingReduceError
from .negotiation import RESET, ResetPending
from .objects import (allgather_object, broadcast_object, broadcast_optimizer_state,
                      broadcast_parameters)

log = logging.getLogger("ringreduce")

RESET_LIMIT_VARIABLE = "RINGREDUCE_ELASTIC_RESET_LIMIT"
DEFAULT_RESET_LIMIT = 5
ROOT_RANK = 0                                     # the rank whose state everyone takes

T = TypeVar("T")


# ---------------------------------------------------------------------- host updates

class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's flags). Only Horovod's driver reports updates."""
    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank by `commit()` / `check_host_updates()` after a host update; `run`
    then resets without restoring the commit. `skip_sync`: hosts were only removed, so the
    remaining ranks are in sync already. Not a `HorovodInternalError`, as in Horovod."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were added or removed; resetting")
        self.skip_sync = skip_sync


# ---------------------------------------------------------------------- states

class State:
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

    def save(self) -> None:
        """Save the state in memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Go back to the last saved state, undoing uncommitted changes."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Give every rank rank 0's state. Collective."""
        raise NotImplementedError()

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


# ---------------------------------------------------------------------- sampler

class ElasticSampler(Sampler):
    """Splits a dataset across ranks like `DistributedSampler`, and skips the samples already
    processed this epoch when it is restored or synchronised (held by a `TorchState`).

    Horovod's definition: the order is `range(len(dataset))`, shuffled with
    `random.Random(seed + epoch)` when `shuffle`; the first `processed_num` indices of it are
    dropped; the rest is padded by repeating it from its start to a multiple of `size()`, and
    rank r takes every `size()`-th index from position r. Use: `record_batch()` after each batch,
    `set_epoch()` at the end of each epoch (it forgets the processed samples)."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set = set()   # Horovod still defines it; 0.28 never fills it
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (its own shuffle) with nothing processed. Call it at the end of an
        epoch, so that a reset in the middle of one does not process samples twice."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of `batch_size` as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-read the job's size and this rank, and recompute the indices not yet processed."""
        self.num_replicas = world.size()
        self.rank = world.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = _repeat_to_length(self.remaining_indices, self.total_size)
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _repeat_to_length(items: list[int], length: int) -> list[int]:
    """`items` extended by repeating it from its start (Horovod's padding, which also works
    when fewer items remain than there are ranks)."""
    padded = list(items)
    while len(padded) < length:
        padded.extend(items[:length - len(padded)])
    return padded


# ---------------------------------------------------------------------- handlers

class StateHandler:
    """How a `TorchState` saves, restores and synchronises one kind of object."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

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
        step with its internal reset, which moves no data."""
        forget_step = getattr(self.value, "_reset_step", None)
        if callable(forget_step):
            forget_step()


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


# ---------------------------------------------------------------------- run

def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorator: `func(state, *args, **kwargs)` with the state synchronised from rank 0 first,
    and run again after a reset. On `HorovodInternalError` every rank restores the last commit;
    on `HostsUpdatedInterrupt` it keeps its state. Then the ranks reset together (see the
    module's docstring), the reset callbacks run, and the state is synchronised again (unless
    hosts were only removed)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        limit = reset_limit()
        failures = 0
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as error:
                failures += 1
                state.restore()
                skip_sync = False
                reason: BaseException = error
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
                reason = interrupt
            _reset_together(reason, failures, limit, func.__qualname__)
            state._abandon_pending_steps()
            state.on_reset()

    return wrapper


def reset_limit() -> int:
    """How many failures one call of a `run` function recovers from:
    `RINGREDUCE_ELASTIC_RESET_LIMIT`, default 5; 0 re-raises the first."""
    raw = os.environ.get(RESET_LIMIT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_RESET_LIMIT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"ringreduce: bad value {raw!r} for {RESET_LIMIT_VARIABLE}: expected "
                         "an integer >= 0")
    return value


def _reset_together(reason: BaseException, failures: int, limit: int, what_runs: str) -> None:
    """Meet every rank, then go on, or give up on every rank when some rank has failed more
    than `limit` times."""
    everyone = _agree(_describe(reason), failures, not _caused_by_reset(reason))
    most = max(count for _, count, _ in everyone)
    report = _summarize(everyone)
    if most > limit:
        raise RingReduceError(
            f"ringreduce: elastic run of {what_runs} gave up after {most} failure(s); "
            f"{RESET_LIMIT_VARIABLE}={limit} allows {limit} reset(s). Without an elastic "
            f"driver the job's size is fixed and a repeated error is most likely a program "
            f"error (a MismatchError: ranks ran different collectives). Last errors: {report}"
        ) from reason
    if world.rank() != ROOT_RANK:
        return
    if isinstance(reason, HorovodInternalError):
        log.warning("ringreduce: elastic reset %d of at most %d after %s; every rank went back "
                    "to its last commit; running %s again", most, limit, report, what_runs)
    else:
        log.warning("ringreduce: elastic reset after a host update; running %s again", what_runs)


def _agree(description: str, failures: int, own: bool) -> list[tuple[str, int, bool]]:
    """Every rank's (error, failure count, whether the error was its own), once every rank has
    reached the reset. A rank that failed alone waits here while the others' collectives fail
    (negotiation.RESET: not their own errors), which sends them here too."""
    return allgather_object((description, failures, own), name=RESET)


def _caused_by_reset(error: BaseException) -> bool:
    """Whether `error`, or an error it came from, is a collective stopped for the reset."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ResetPending):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _describe(reason: BaseException) -> str:
    text = str(reason).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(reason).__name__}: {first[:300]}"


def _summarize(everyone: list[tuple[str, int, bool]]) -> str:
    """'ranks [0, 2]: X; rank 1: Y': each distinct error with the ranks that raised it, the
    ranks' own errors first, then those whose collectives were stopped for the reset."""
    def ranks_of(own: bool) -> dict[str, list[int]]:
        grouped: dict[str, list[int]] = {}
        for rank_number, (description, _, was_own) in enumerate(everyone):
            if was_own == own:
                grouped.setdefault(description, []).append(rank_number)
        return grouped

    def listed(grouped: dict[str, list[int]]) -> str:
        return "; ".join(f"rank {ranks[0]}: {text}" if len(ranks) == 1
                         else f"ranks {ranks}: {text}" for text, ranks in grouped.items())

    stopped = ranks_of(False)
    return listed(ranks_of(True)) + (f"; then, stopped for the reset, {listed(stopped)}"
                                     if stopped else "")


__all__ = [
    "run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt",
    "HostUpdateResult", "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
    "SamplerStateHandler", "LRSchedulerStateHandler", "get_handler_registry",
    "set_handler_registry", "reset_limit", "RESET_LIMIT_VARIABLE", "DEFAULT_RESET_LIMIT",
]
