"""Elastic training with Horovod's API (`horovod.torch.elastic` 0.28): `run`, `TorchState`,
`ObjectState`, `State`, `ElasticSampler`, the state handlers and `HostsUpdatedInterrupt`.

Under plain `mpirun` there is no elastic driver (`horovodrun --elastic`, host discovery), so the
job has a fixed size: no rank ever joins, no host is ever reported added or removed, and a lost
rank still ends the job (MPI without fault tolerance). What elastic training keeps here: the
state is synchronised from rank 0 when training starts, commits are in-memory copies, and a
`HorovodInternalError` rolls every rank back to the last commit and runs the function again.

How a reset differs from Horovod's, and why:
- No `shutdown()` + `init()` as a rule. Horovod restarts to form a new world; ours is the
  same world afterwards, and a restart would end what the old one holds: process sets (until
  registered again) and a running timeline. Instead all ranks meet in one collective (the
  agreement), which runs after every collective each rank had queued; then each
  `DistributedOptimizer` in the state forgets the step it had begun. An error that reaches
  Python leaves ringreduce's communicators usable (a `MismatchError` is raised on every rank
  before any data moves); an MPI failure from a dead peer ends the job anyway.
- The exception: a failure inside a collective's exchange on some rank shuts the set down on
  every member (stall.py). Where that set is the job's, the agreement raises that
  `ShutDownError` on every rank; where it is another, its members say so in the agreement.
  Either way every rank then runs `world.restart()`: `shutdown()` and `init()` on init()'s
  communicator and settings, with the same process sets registered again, as Horovod's reset
  restarts. A `DistributedOptimizer` finds the new set at its next step. (A member that left,
  its process gone, still ends the job; one that left for good by `shutdown()` meanwhile
  makes the restart raise `ShutDownError` on every other rank, naming it.)
- A rank that failed alone still resets with the others: while its agreement is pending, each
  collective the others run fails with `MismatchError` naming it (negotiation.RESET), so they
  reset too, on each set they share with it (it meets them on every one of its sets). (If they
  have left the function already, it waits there, and the stall report says so.) Their
  unnamed collectives that failed so were never run on that rank, so every set's automatic
  names then count on from the highest among its members, where Horovod's restart counts
  from 0 on every rank: either way the ranks' next unnamed collectives pair.
- A bounded number of resets. Under plain mpirun a `HorovodInternalError` is a program error
  (a `MismatchError`, say) or one raised on purpose, so Horovod's unbounded loop would retry
  a deterministic error forever. More failures than
  `RINGREDUCE_ELASTIC_RESET_LIMIT` (default 5, 0 = never reset) in one call of the decorated
  function end it on every rank with a `RingReduceError` naming each rank's error.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, TypeVar

from ..api.objects import allgather_object, begin_allgather_object
from ..core.errors import (HorovodInternalError, HostsUpdatedInterrupt, NotInitializedError,
                           RingReduceError, ShutDownError, UnsupportedError, UsageError)
from ..sets import world
from ..sets.process_sets import failed_sets, other_sets, realign_names
from ..transport.negotiation import RESET_GIVEN, ResetPending
from .sampler import ElasticSampler
from .state import (ROOT_RANK, HostUpdateResult, LRSchedulerStateHandler, ModelStateHandler,
                    ObjectState, OptimizerStateHandler, SamplerStateHandler, State, StateHandler,
                    TorchState, abandon_pending_steps, get_handler_registry, set_handler_registry)

log = logging.getLogger("ringreduce")

RESET_SETS = f"{RESET_GIVEN}.sets"     # the reset's second meeting: which sets failed
RESET_LIMIT_VARIABLE = "RINGREDUCE_ELASTIC_RESET_LIMIT"
DEFAULT_RESET_LIMIT = 5

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorator: `func(state, *args, **kwargs)` with the state synchronised from rank 0 first,
    and run again after a reset. On `HorovodInternalError` every rank restores the last commit
    (not on the errors Horovod raises as other types: a misuse of the optimizer, `UsageError`,
    Horovod's AssertionError; `UnsupportedError`; `NotInitializedError`: these leave `func`);
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
            except (UsageError, UnsupportedError, NotInitializedError):
                raise       # Horovod's AssertionError, NotImplementedError, ValueError: no reset
            except HorovodInternalError as error:
                failures += 1
                state.restore()
                skip_sync = False
                reason: BaseException = error
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
                reason = interrupt
            _reset_together(reason, failures, limit, func.__qualname__)
            abandon_pending_steps(state)
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
    description, own = _describe(reason), not _caused_by_reset(reason)
    try:
        everyone = _agree(description, failures, own)
        restart = any(failed for *_, failed in everyone)    # a process set's, on its members
    except ShutDownError as shut:       # the job's set: every rank comes here
        if not shut.restartable:
            raise
        restart = True
    if restart:
        # A member failed inside a collective, which shut its set down (its messages are out
        # of step): every rank starts afresh, with every set made anew.
        if world.rank() == ROOT_RANK:
            log.warning("ringreduce: elastic reset: a failure inside a collective shut a set "
                        "down; shutdown() and init() on every rank")
        world.restart()
        everyone = _agree(description, failures, own)
    else:
        # Ranks whose collectives failed for the reset had named unnamed ones that the failed
        # rank never ran: their names would pair with its next ones (a restart's sets start
        # from 0 on every rank, as Horovod's reset does).
        realign_names("elastic_reset")
    most = max(count for _, count, *_ in everyone)
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


def _agree(description: str, failures: int, own: bool) -> list[tuple[str, int, bool, bool]]:
    """Every rank's (error, failure count, whether the error was its own, whether a failure
    inside a collective shut one of its sets down), once every rank has reached the reset. A
    rank that failed alone waits here while the others' collectives fail (negotiation.RESET:
    not their own errors), which sends them here too. It meets them on each of its other sets
    at the same time: a member that waits for it in a collective there meets the reset in that
    set, as the others do in the job's. Which sets failed is gathered after those meetings,
    which may find a set shut down."""
    failed_already = failed_sets()
    meetings = [begin_allgather_object(None, RESET_GIVEN, process_set)
                for process_set in other_sets("elastic reset")
                if process_set.process_set_id not in failed_already]
    everyone = allgather_object((description, failures, own), name=RESET_GIVEN)
    for wait in meetings:
        try:
            wait()
        except ShutDownError as shut:     # a member failed there: failed_sets() lists it now
            if not shut.restartable:
                raise
    failed = allgather_object(bool(failed_sets()), name=RESET_SETS)
    return [(*given, shut) for given, shut in zip(everyone, failed)]


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


def _summarize(everyone: list[tuple[str, int, bool, bool]]) -> str:
    """'ranks [0, 2]: X; rank 1: Y': each distinct error with the ranks that raised it, the
    ranks' own errors first, then those whose collectives were stopped for the reset."""
    def ranks_of(own: bool) -> dict[str, list[int]]:
        grouped: dict[str, list[int]] = {}
        for rank_number, (description, _, was_own, _) in enumerate(everyone):
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
