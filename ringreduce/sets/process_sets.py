"""Process sets, with Horovod's API: the unit that collectives run on.

A `ProcessSet` names some of the job's ranks (a list of global ranks, or an mpi4py communicator
that holds them). Registering sets is collective over every rank of the job (`init(process_sets=
...)`, `add_process_set`, `remove_process_set`), so every rank knows every set under the same id.
Each member of a registered set holds an `ActiveSet` (active_set.py). This module opens and
closes them with the job, registers and removes sets, and finds the set a collective runs on
(`active`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from ..core.config import Settings
from ..core.errors import MismatchError, ShutDownError
from ..core.mpi import mpi
from ..core.state import abandon
from ..core.waiting import wait_reporting
from ..transport.signature import digest
from .active_set import ActiveSet, refusing
from .job import Job, begin, current, end, state
from .process_set import ProcessSet, global_process_set

_MEETING_TAG = 41   # open_group's meeting of the members, on groups_comm (no other messages)
log = logging.getLogger("ringreduce")


def start(comm: Any, settings: Settings, abort: Callable[[str], None],
          node_of: Optional[Callable[[int], int]]) -> ActiveSet:
    """Open the global set on `comm` (ours to keep); returns it."""
    ranks = list(range(comm.size))
    job = Job(comm, comm.rank, comm.size, settings, abort, node_of, {0: global_process_set}, {},
              comm.Dup())
    job.active[0] = ActiveSet(0, ranks, comm, settings, abort, node_of)
    global_process_set.ranks = ranks
    begin(job)
    return job.active[0]


def stop(restarting: bool = False) -> list[int]:
    """Close every set this rank belongs to (the global one last) and forget them all;
    `restarting`: to start afresh at once with every rank (world.restart). Returns the ranks
    that left the job without restarting (every rank's list is the same)."""
    job = end()
    if job is None:
        return []
    groups = [k for k in job.active if isinstance(k, str)]    # open_group's, newest last
    order = groups[::-1] + sorted((k for k in job.active if isinstance(k, int)), reverse=True)
    # Goodbye on every set before waiting for any member's: a member that waits for this rank
    # in a collective of one set (the global one, say) learns it leaves only from that set's
    # goodbye, and says its own goodbye on the others only then.
    for set_id in order:
        job.active[set_id].leave(restarting)
    for set_id in order:
        left = job.active[set_id].free()     # the global set's last
    job.groups_comm.Free()
    for set_id, process_set in job.sets.items():
        if set_id != 0:
            process_set._invalidate()
    return left


def active(process_set: ProcessSet, what: str) -> ActiveSet:
    """The set a collective runs on, or a clear error (before any traffic) when this rank is not
    a member or the set is not registered."""
    job = current()
    if job is None:
        state(what)
    if process_set is global_process_set:
        return job.active[0]
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"ringreduce: {what} on rank {job.rank}: process_set must be a "
                         f"ringreduce.ProcessSet, not {type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id is None or set_id not in job.sets:
        raise ValueError(f"ringreduce: {what} on rank {job.rank}: {process_set} is not "
                         "registered; pass it to init(process_sets=[...]) or add_process_set() "
                         "first")
    if set_id not in job.active:
        raise ValueError(f"ringreduce: {what} on rank {job.rank}: this rank is not in process "
                         f"set {set_id} (ranks {job.sets[set_id].ranks})")
    return job.active[set_id]


# ---------------------------------------------------------------------- registering sets

def _checked_ranks(ranks: Sequence[int], job: Job, what: str) -> tuple[int, ...]:
    bad = [r for r in ranks if not 0 <= r < job.size]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"ringreduce: {what}: invalid rank list {list(ranks)}: give distinct "
                         f"ranks of this job (0..{job.size - 1})")
    return tuple(ranks)


def _existing(job: Job, ranks: Sequence[int]) -> Optional[int]:
    for set_id, process_set in job.sets.items():   # (open_group's are the members' own)
        if isinstance(set_id, int) and list(process_set.ranks) == list(ranks):
            return set_id
    return None


def _comm_ranks(comm: Any, job: Job) -> tuple[int, ...]:
    """The global ranks of an mpi4py communicator's processes."""
    group, everyone = comm.Get_group(), job.comm.Get_group()
    try:
        ranks = mpi().Group.Translate_ranks(group, list(range(comm.size)), everyone)
    finally:
        group.Free()
        everyone.Free()
    if any(r < 0 for r in ranks):
        raise ValueError("ringreduce: a ProcessSet's communicator holds processes outside the "
                         "communicator ringreduce was initialised on")
    return tuple(sorted(ranks))


def _create(job: Job, ranks: Sequence[int]) -> ProcessSet:
    """Register one set (collective over every rank of the job, all in the same order)."""
    MPI = mpi()
    everyone = job.comm.Get_group()
    members = everyone.Incl(list(ranks))
    comm = job.comm.Create(members)
    members.Free()
    everyone.Free()
    set_id, job.next_id = job.next_id, job.next_id + 1
    process_set = ProcessSet(ranks)
    process_set.process_set_id = set_id
    job.sets[set_id] = process_set
    if comm != MPI.COMM_NULL:
        job.active[set_id] = ActiveSet(set_id, ranks, comm, job.settings, job.abort,
                                       job.node_of)
    return process_set


def _register(job: Job, wanted: Sequence[ProcessSet], what: str) -> None:
    """Register `wanted` (collective: every rank passes the same rank lists, and communicators
    whose rank lists may differ per rank) and give each its id. Sets from communicators come
    first, every distinct one that some rank holds, then the rank lists in order, as Horovod's.
    An entry whose ranks were registered before, or given twice, is a duplicate: ValueError.
    A mistake in this rank's arguments meets the others' call (`refusing`)."""
    glob = job.active[0]
    with refusing(glob, what, what):
        from_comm = [ps for ps in wanted if ps.ranks is None]
        lists = [_checked_ranks(ps.ranks, job, what) for ps in wanted if ps.ranks is not None]
        mine = {id(ps): _comm_ranks(ps.mpi_comm, job) for ps in from_comm}
    before = set(job.sets)

    def work() -> None:
        glob.transport.check({"collective": what, "name": what, "rank lists": tuple(lists),
                              "communicators": len(from_comm)})
        held = glob.transport.allgather_object(tuple(mine.values()),
                                               {"collective": what, "name": "communicators"})
        for ranks in sorted({r for per_rank in held for r in per_rank}) + lists:
            if _existing(job, ranks) is None:
                _create(job, ranks)

    glob.engine.run(what, work)
    duplicates, seen = [], set()
    for index, ps in enumerate(wanted):
        ranks = list(ps.ranks if ps.ranks is not None else mine[id(ps)])
        set_id = _existing(job, ranks)
        if set_id in before or set_id in seen:
            duplicates.append(f"entry {index}: ranks {ranks}")
            continue
        seen.add(set_id)
        ps.ranks, ps.process_set_id = ranks, set_id
        job.sets[set_id] = ps       # the caller's object: shutdown() invalidates it (stop)
    if duplicates:
        raise ValueError(f"ringreduce: {what}: duplicate process sets ({'; '.join(duplicates)});"
                         " a set with the same ranks is registered already")


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a set, collectively on every rank of the job (each passing the same ranks, or
    its own communicator of a split), and return it ready for collectives."""
    job = state("add_process_set()")
    with refusing(job.active[0], "add_process_set", "add_process_set"):
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.process_set_id is not None:
            raise ValueError(f"ringreduce: add_process_set(): {ps} is registered already")
        if ps.ranks is not None:
            existing = _existing(job, _checked_ranks(ps.ranks, job, "add_process_set()"))
            if existing is not None:
                raise ValueError(f"ringreduce: attempted to add a duplicate process set: {ps} "
                                 f"has the ranks of process set {existing}")
    _register(job, [ps], "add_process_set")
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set, collectively on every rank of the job; its members first finish what
    they queued on it. False (and nothing happens) for the global set or an unknown one."""
    job = state("remove_process_set()")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or set_id not in job.sets:
        return False
    glob = job.active[0]

    def work() -> None:
        glob.transport.check({"collective": "remove_process_set", "name": "remove_process_set",
                              "process set": set_id})
        held = job.active.pop(set_id, None)
        if held is not None:
            held.close()
        job.sets.pop(set_id)._invalidate()

    glob.engine.run(f"remove_process_set.{set_id}", work)
    process_set._invalidate()
    return True


def register_at_init(process_sets: Union[None, str, Iterable[ProcessSet]]) -> None:
    """`init(process_sets=...)`: a list of sets, or "dynamic" (sets may be added later; here
    they always may). Every rank's sets are compared first, with none too, in one exchange
    outside the set's collectives (so its first collective is still its #1): a rank given
    other sets than the others, or none where they have some, or a mistake in them, is a
    MismatchError on every rank (a rank whose argument is wrong raises its ValueError), where
    they would wait for a registration it never joins."""
    job = state("init()")
    dynamic = process_sets is None or (isinstance(process_sets, str)
                                       and process_sets.lower() == "dynamic")
    wanted = ([] if dynamic else list(process_sets) if isinstance(process_sets, Iterable)
              else None)      # (refused below, after the exchange, as any mistake)
    try:
        if wanted is None or any(not isinstance(ps, ProcessSet) for ps in wanted):
            raise ValueError("ringreduce: init(process_sets=...) takes a list of ProcessSet "
                             "objects or 'dynamic'")
        mine: Any = tuple("a communicator's part" if ps.ranks is None
                          else _checked_ranks(ps.ranks, job, "init()") for ps in wanted)
    except ValueError as error:
        mine = error
    everyone = job.groups_comm.allgather(str(mine))     # (only meetings use it, by message)
    if isinstance(mine, ValueError):
        raise mine
    if any(theirs != everyone[0] for theirs in everyone):
        held: dict[str, list[int]] = {}
        for r, theirs in enumerate(everyone):
            held.setdefault(theirs, []).append(r)
        each = "; ".join(f"{theirs} on ranks {ranks}" for theirs, ranks in held.items())
        raise MismatchError(f"ringreduce: init(process_sets=...) differs between ranks "
                            f"({each}): every rank must pass the same sets in the same order "
                            "(from a communicator split, each rank its own part)")
    if wanted:
        _register(job, wanted, "init")


def registered_sets() -> list[ProcessSet]:
    """The process sets registered with add_process_set() or init(), other than the global
    one, in the order they were (the same on every rank)."""
    job = state("registered_sets()")
    return [job.sets[k] for k in sorted(k for k in job.sets if isinstance(k, int) and k != 0)]


def open_group(ranks: Sequence[int], label: str) -> ProcessSet:
    """A process set of global `ranks` made by those ranks alone (collective over them only,
    in the same order on each), for front ends whose groups are made that way
    (torch.distributed's new_group calls its backend on the members only); they meet first
    (`_meet_members`), so that one that does not come is reported rather than waited for
    inside MPI. Its id is `label` (unique, the same on every member), which also names it in
    messages; collectives take it as `process_set=` like any set. Held until `close_group()`,
    or closed at shutdown."""
    job = state(label)
    ranks = _checked_ranks(sorted(ranks), job, label)
    if job.rank not in ranks or label in job.sets:
        raise ValueError(f"ringreduce: {label}: rank {job.rank} cannot open it for ranks "
                         f"{list(ranks)} (not one of them, or the label is taken)")
    _meet_members(job, ranks, label)
    everyone = job.groups_comm.Get_group()
    members = everyone.Incl(list(ranks))
    try:
        comm = job.groups_comm.Create_group(members)
    finally:
        members.Free()
        everyone.Free()
    process_set = ProcessSet(ranks)
    process_set.process_set_id = label
    job.sets[label] = process_set
    job.active[label] = ActiveSet(label, ranks, comm, job.settings, job.abort, job.node_of)
    return process_set


def _meet_members(job: Job, ranks: Sequence[int], label: str) -> None:
    """Before MPI makes a group's communicator, which blocks inside MPI until every member
    calls it (no report, no end): each member tells the others which group it opens and waits
    for theirs. Meanwhile the members still missing are named every stall check interval (at
    the stall shutdown time the job ends), a member that has shut down is a ShutDownError, and
    a member opening another group here (members open theirs in the same order), or this one
    for other ranks, a ValueError on both (MPI would wait for ever inside, or pair them)."""
    others = [m for m in ranks if m != job.rank]
    if not others:
        return
    MPI, comm, watch = mpi(), job.groups_comm, job.active[0].transport.watch
    mine = np.array([digest({"collective": "open_group", "name": label,
                             "ranks": tuple(ranks)})], dtype=np.int64)
    theirs = np.zeros(len(others), dtype=np.int64)
    sends = [comm.Isend(mine, dest=m, tag=_MEETING_TAG) for m in others]
    receives = {m: comm.Irecv(theirs[i:i + 1], source=m, tag=_MEETING_TAG)
                for i, m in enumerate(others)}

    def missing() -> list[int]:
        return [m for m, request in receives.items() if not request.Test()]

    def everyone_here() -> bool:
        late = missing()
        if late:
            watch.departures.look()
            gone = [m for m in late if m in watch.departures.gone]
            if gone:
                abandon(*sends, *receives.values(), mine, theirs)
                raise ShutDownError(f"ringreduce: rank {job.rank}: opening {label} for ranks "
                                    f"{list(ranks)}: ranks {gone} shut down without opening it")
        return not late

    def stalled(seconds: float) -> str:
        late = missing()
        return (f"ringreduce: stall: rank {job.rank} has waited {seconds:.0f} s to open "
                f"{label} for ranks {list(ranks)}: ranks {late} have not come to open it "
                f"(every member must make the group, in the same order){watch.meanwhile(late)}")

    with watch.opening():
        wait_reporting(everyone_here, watch.check_time, lambda s: log.warning(stalled(s)),
                       watch.shutdown_time, lambda s: watch.on_shutdown(
                           f"{stalled(s)}. Shutting the job down after "
                           f"{watch.shutdown_time:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME)."))
    MPI.Request.Waitall(sends)
    other = [m for m, value in zip(others, theirs.tolist()) if value != mine[0]]
    if other:
        raise ValueError(f"ringreduce: rank {job.rank}: opening {label} for ranks "
                         f"{list(ranks)}, ranks {other} open another group at this point, or "
                         "this one for other ranks: every member must make its groups in the "
                         "same order, each with the same ranks")


def close_group(process_set: ProcessSet) -> None:
    """Close a set from `open_group` (collective over its members)."""
    job = current()
    label = process_set.process_set_id
    if job is not None and isinstance(label, str) and label in job.active:
        job.active.pop(label).close()
        job.sets.pop(label)._invalidate()


def failed_sets() -> list[Union[int, str]]:
    """The ids of this rank's sets that a member's failure inside a collective shut down
    (every later collective there raises ShutDownError until the set is made afresh), where
    no member left for good (Departures.restartable)."""
    job = state("failed_sets()")
    return [k for k, held in job.active.items()
            if held.transport.watch.departures.failures
            and held.transport.watch.departures.restartable()]


def realign_names(after: str) -> None:
    """(Collective over every rank.) Each set's automatic names agree again on its members
    (ActiveSet.realign_names), the sets taken in one order on every rank: the numbered ones by
    id, then open_group's as made."""
    job = state(after)
    numbered = sorted(k for k in job.active if isinstance(k, int))
    for set_id in numbered + [k for k in job.active if isinstance(k, str)]:
        job.active[set_id].realign_names(after)


def other_sets(what: str) -> list[ProcessSet]:
    """Every set this rank belongs to but the global one: registered ones and open_group's."""
    job = state(what)
    return [job.sets[k] for k in job.active if k != 0]


def global_set(what: str) -> ActiveSet:
    """The global set (every rank), or NotInitializedError naming `what`."""
    return state(what).active[0]

