"""Process sets, with Horovod's API: the unit that collectives run on.

A `ProcessSet` names some of the job's ranks (a list of global ranks, or an mpi4py communicator
that holds them). Registering sets is collective over every rank of the job (`init(process_sets=
...)`, `add_process_set`, `remove_process_set`), so every rank knows every set under the same id.
Each member of a registered set holds an `ActiveSet`: the set's own communicator and node split,
its transport (shared-memory window, signature check, stall watch) and its engine (ordering and
thread), so sets progress independently of each other. `global_process_set` holds every rank.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from ..core.config import Settings
from ..core.errors import MismatchError, NotInitializedError, RingReduceError, ShutDownError
from ..core.mpi import mpi
from ..core.waiting import wait_reporting
from ..transport.auto_names import AutoNames
from ..transport.ring import ABANDONED
from ..transport.set_transport import Transport
from ..transport.signature import digest
from ..transport.stall import StallWatch
from .engine import PARENT, Engine, child_name

_MEETING_TAG = 41   # open_group's meeting of the members, on groups_comm (no other messages)
log = logging.getLogger("ringreduce")


def _is_comm(value: Any) -> bool:
    return type(value).__module__ == "mpi4py.MPI" and hasattr(value, "Get_group")


class ProcessSet:
    """A set of ranks that runs collectives together. Pass it to `init(process_sets=[...])` or
    `add_process_set`, then as `process_set=` to collectives. Roots stay global ranks."""

    process_set_id: Optional[int] = None
    ranks: Optional[list[int]] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        if _is_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ringreduce: ProcessSet takes a list of process ranks or an mpi4py "
                             f"communicator, not {type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in ranks):
            raise ValueError(f"ringreduce: ProcessSet ranks must be integers, got {ranks!r}")
        self.ranks = sorted(int(r) for r in ranks)

    def size(self) -> Optional[int]:
        """How many ranks the set holds; None until it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (its index in `ranks`); None until registered.
        (Collectives still take global root ranks.)"""
        if self.process_set_id is None:
            return None
        me = _state("ProcessSet.rank()").rank
        if me not in self.ranks:
            raise ValueError(f"ringreduce: rank {me} is not part of process set "
                             f"{self.process_set_id} (ranks {self.ranks})")
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set; None while its ranks are unknown."""
        if self.ranks is None:
            return None
        return _state("ProcessSet.included()").rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class ActiveSet:
    """A registered set as one of its members holds it: its communicator, topology, transport
    and engine, and the counter of its automatic collective names."""

    def __init__(self, set_id: Union[int, str], ranks: Sequence[int], comm: Any,
                 settings: Settings,
                 abort: Callable[[str], None], node_of: Optional[Callable[[int], int]]) -> None:
        self.id, self.ranks, self.comm = set_id, list(ranks), comm
        self.rank, self.size = comm.rank, comm.size
        if node_of is not None:    # simulated nodes, by global rank
            self.local = comm.Split(color=node_of(self.ranks[comm.rank]), key=comm.rank)
        else:
            self.local = comm.Split_type(mpi().COMM_TYPE_SHARED, key=comm.rank)
        self.cross = comm.Split(color=self.local.rank, key=comm.rank)
        self.homogeneous = len(set(comm.allgather(self.local.size))) == 1
        where = ("" if set_id == 0 else f" on {set_id} (ranks {self.ranks})"
                 if isinstance(set_id, str) else f" on process set {set_id} (ranks {self.ranks})")
        watch = StallWatch(comm, settings.stall_check_time, settings.stall_shutdown_time, abort,
                           self.ranks, where)
        watch.elsewhere = functools.partial(_waits_elsewhere, set_id, watch)
        self.names = AutoNames(set_id)     # see auto_name
        self.transport = Transport(comm, self.local, self.cross, settings, watch, self.ranks,
                                   self.homogeneous, self.names)
        self.engine = Engine(f"ringreduce-set{set_id}", self.ranks[comm.rank], comm.Iprobe,
                             self.transport.negotiator.agreement, set_id)
        self._optimizers = itertools.count()
        self.closed = False     # shut down: what holds it must find the set's new one (active)

    def optimizer_prefix(self) -> str:
        """What the bucket names of the set's next DistributedOptimizer start with: nothing
        for the first, 'opt<k>.' for the k-th after it, so two optimizers' buckets never share
        a name (members that create them in the same order agree)."""
        k = next(self._optimizers)
        return "" if k == 0 else f"opt{k}."

    def auto_name(self, kind: str) -> str:
        """A collective's name when the caller gives none: '<kind>.noname.<k>' for the k-th
        unnamed collective of that kind that this thread submits to the set, with the thread's
        place before k for threads other than the main one (auto_names.py), so members that
        submit the same calls agree whatever other threads or sets they run, and threads pair
        with themselves across ranks (in-place variants count with their kind, as Horovod
        names `allreduce_` 'allreduce.noname.N' too). In a callback of a collective's future,
        the name comes from that collective instead (engine.children_of)."""
        if PARENT.handle is not None:
            return child_name()
        return self.names.name(kind.rstrip("_"))

    def call_order_name(self, kind: str) -> str:
        """As `auto_name`, but counted across this rank's threads in call order: a
        torch.distributed group's calls, which torch requires every rank to make in the same
        order."""
        if PARENT.handle is not None:
            return child_name()
        return self.names.in_call_order(kind)

    def agree(self, signature: dict) -> None:
        """One signature check of the members, under the name signature["name"], in order with
        the set's collectives: MismatchError on every member where theirs differ."""
        self.engine.run(signature["name"], lambda: self.transport.check(signature))

    def duplicate_comm(self, name: str) -> Any:
        """A duplicate of the set's communicator, for the caller to own and free: a channel
        whose messages never match the set's own (torch.distributed's send/recv). Collective
        over the members: it runs on the set's engine, in order with the set's collectives,
        after a signature check named `name`."""
        def work() -> Any:
            self.transport.check({"collective": "duplicate_comm", "name": name})
            return self.comm.Dup()

        return self.engine.run(name, work)

    def join(self, device: Optional[Any]) -> int:
        """Horovod's join on this set (collective; see Transport.join): returns the global rank
        that joined last. Members that joined early ran fewer unnamed collectives, so every
        counter of automatic names restarts from the highest among the members afterwards, and
        members agree again."""
        last = self.transport.join(device)
        self.names.realign(lambda mine: self.transport.allgather_object(
            mine, {"collective": "join", "name": "join.names"}))
        return self.ranks[last]

    def root(self, root_rank: Any, what: str, name: str) -> int:
        """The set rank of global rank `root_rank`, or a clear error."""
        if isinstance(root_rank, (int, np.integer)) and not isinstance(root_rank, bool):
            if int(root_rank) in self.ranks:
                return self.ranks.index(int(root_rank))
        scope = (f"this job (0..{self.size - 1})" if self.id == 0
                 else f"process set {self.id} (ranks {self.ranks})")
        raise ValueError(f"ringreduce: {what} of tensor '{name}' on rank "
                         f"{self.ranks[self.rank]}: root_rank {root_rank!r} is not a rank of "
                         f"{scope}")

    def close(self, restarting: bool = False) -> list[int]:
        """Run what is queued, say goodbye to the other members (so that one still waiting in
        a collective with this rank raises instead of hanging), and once every member has left
        too, free the set's window, board and communicators (collective). `restarting`: every
        member starts afresh at once (world.restart). Returns the members (global ranks) that
        did not leave to start afresh: every member knows them alike, all goodbyes in."""
        self.closed = True
        self.engine.shutdown()
        departures = self.transport.watch.departures
        departures.announce(self.transport.watch.begun, restarting)
        self.transport.watch.wait_for_goodbyes()
        self.transport.free()
        for comm in (self.cross, self.local, self.comm):
            comm.Free()
        return sorted(self.ranks[member] for member in departures.gone
                      if member not in departures.restarting)


_MISTAKES = (TypeError, ValueError, NotImplementedError)   # what `refusing` makes the others see


class refusing:
    """Around a call's argument checks: a mistake found there (TypeError, ValueError, or
    NotImplementedError for what is not supported), which the other ranks cannot see, still
    meets their call of `name` on the set, through a signature check that carries the error,
    so theirs fails at once with a MismatchError quoting it (instead of waiting for a call
    never made) and the automatic names stay in step. The meeting is over before the error
    leaves the block (the name is free again). Once per error: a front end whose checks wrap
    these calls refuses only what is new. `also`: more error types that are mistakes here
    (Adasum's HorovodInternalError for a dtype it cannot reduce, say)."""

    __slots__ = ("ps", "name", "kind", "mistakes")

    def __init__(self, ps: ActiveSet, name: str, kind: str, also: tuple = ()) -> None:
        self.ps, self.name, self.kind = ps, name, kind
        self.mistakes = _MISTAKES + also if also else _MISTAKES

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: Any, error: Any, _traceback: Any) -> bool:
        if isinstance(error, self.mistakes) and not getattr(error, "refused", False):
            error.refused = True
            try:
                self.ps.agree({"collective": self.kind, "name": self.name,
                               "refused": str(error)})
            except (RingReduceError, ValueError):
                pass    # the others' calls failed (or the name is taken): `error` goes on
        return False


@dataclass
class _Job:
    """What this process knows of the running job: its global communicator and the sets."""
    comm: Any
    rank: int
    size: int
    settings: Settings
    abort: Callable[[str], None]
    node_of: Optional[Callable[[int], int]]
    sets: dict[Union[int, str], ProcessSet]     # every registered set, by id (the same on every
    active: dict[Union[int, str], ActiveSet]    # rank; open_group's on members); ours
    groups_comm: Any = None             # where open_group makes sets by their members alone
    next_id: int = 1


_job: Optional[_Job] = None


def _waits_elsewhere(set_id: Union[int, str], watch: StallWatch, ranks: list[int],
                     everywhere: bool = False) -> list[tuple[str, Optional[bool]]]:
    """For a stall report on set `set_id` (`watch`'s): where global `ranks`, missing there,
    wait in a collective of the other sets this rank is a member of, or `everywhere`, of
    this one too (StallWatch.waits), the reads given the report's read timeout all together
    (a report keeps its interval however many sets there are)."""
    deadline = time.monotonic() + watch.read_timeout()
    others = [] if _job is None else [s for i, s in list(_job.active.items())
                                      if (everywhere or i != set_id) and not s.closed]
    found: list[tuple[str, Optional[bool]]] = []
    for other in others:
        found += other.transport.watch.waits(ranks, max(0.0, deadline - time.monotonic()))
    return found


def _state(what: str) -> _Job:
    if _job is None:
        raise NotInitializedError(
            f"ringreduce: {what} was called before ringreduce.init(); call init() first, once "
            "per process, after importing ringreduce")
    return _job


def start(comm: Any, settings: Settings, abort: Callable[[str], None],
          node_of: Optional[Callable[[int], int]]) -> ActiveSet:
    """Open the global set on `comm` (ours to keep); returns it."""
    global _job
    ranks = list(range(comm.size))
    job = _Job(comm, comm.rank, comm.size, settings, abort, node_of, {0: global_process_set}, {},
               comm.Dup())
    job.active[0] = ActiveSet(0, ranks, comm, settings, abort, node_of)
    global_process_set.ranks = ranks
    _job = job
    return job.active[0]


def stop(restarting: bool = False) -> list[int]:
    """Close every set this rank belongs to (the global one last) and forget them all;
    `restarting`: to start afresh at once with every rank (world.restart). Returns the ranks
    that left the job without restarting (every rank's list is the same)."""
    global _job
    job, _job = _job, None
    if job is None:
        return []
    groups = [k for k in job.active if isinstance(k, str)]    # open_group's, newest last
    for set_id in groups[::-1] + sorted((k for k in job.active if isinstance(k, int)),
                                        reverse=True):
        left = job.active[set_id].close(restarting)     # the global set's last
    job.groups_comm.Free()
    for set_id, process_set in job.sets.items():
        if set_id != 0:
            process_set._invalidate()
    return left


def active(process_set: ProcessSet, what: str) -> ActiveSet:
    """The set a collective runs on, or a clear error (before any traffic) when this rank is not
    a member or the set is not registered."""
    job = _job
    if job is None:
        _state(what)
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

def _checked_ranks(ranks: Sequence[int], job: _Job, what: str) -> tuple[int, ...]:
    bad = [r for r in ranks if not 0 <= r < job.size]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"ringreduce: {what}: invalid rank list {list(ranks)}: give distinct "
                         f"ranks of this job (0..{job.size - 1})")
    return tuple(ranks)


def _existing(job: _Job, ranks: Sequence[int]) -> Optional[int]:
    for set_id, process_set in job.sets.items():   # (open_group's are the members' own)
        if isinstance(set_id, int) and list(process_set.ranks) == list(ranks):
            return set_id
    return None


def _comm_ranks(comm: Any, job: _Job) -> tuple[int, ...]:
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


def _create(job: _Job, ranks: Sequence[int]) -> ProcessSet:
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


def _register(job: _Job, wanted: Sequence[ProcessSet], what: str) -> None:
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
    job = _state("add_process_set()")
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
    job = _state("remove_process_set()")
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
    job = _state("init()")
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
    job = _state("registered_sets()")
    return [job.sets[k] for k in sorted(k for k in job.sets if isinstance(k, int) and k != 0)]


def open_group(ranks: Sequence[int], label: str) -> ProcessSet:
    """A process set of global `ranks` made by those ranks alone (collective over them only,
    in the same order on each), for front ends whose groups are made that way
    (torch.distributed's new_group calls its backend on the members only); they meet first
    (`_meet_members`), so that one that does not come is reported rather than waited for
    inside MPI. Its id is `label` (unique, the same on every member), which also names it in
    messages; collectives take it as `process_set=` like any set. Held until `close_group()`,
    or closed at shutdown."""
    job = _state(label)
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


def _meet_members(job: _Job, ranks: Sequence[int], label: str) -> None:
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
                ABANDONED.extend([*sends, *receives.values(), mine, theirs])
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
    job = _job
    label = process_set.process_set_id
    if job is not None and isinstance(label, str) and label in job.active:
        job.active.pop(label).close()
        job.sets.pop(label)._invalidate()


def failed_sets() -> list[Union[int, str]]:
    """The ids of this rank's sets that a member's failure inside a collective shut down
    (every later collective there raises ShutDownError until the set is made afresh), where
    no member left for good (Departures.restartable)."""
    job = _state("failed_sets()")
    return [k for k, held in job.active.items()
            if held.transport.watch.departures.failures
            and held.transport.watch.departures.restartable()]


def global_set(what: str) -> ActiveSet:
    """The global set (every rank), or NotInitializedError naming `what`."""
    return _state(what).active[0]


def is_running() -> bool:
    return _job is not None
