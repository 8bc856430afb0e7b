"""A registered process set as one of its members holds it (`ActiveSet`): the set's
communicator and node split, its transport (shared-memory window, signature check, stall
watch), its engine (ordering and thread) and its automatic names, so sets progress
independently of each other; and `refusing`, which makes a mistake in one rank's arguments
meet the other members' call."""
from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from ..core.config import Settings
from ..core.errors import RingReduceError
from ..core.mpi import mpi
from ..core.thread_places import fix_place, place
from ..transport.auto_names import AutoNames
from ..transport.set_transport import Transport
from ..transport.settling import agreement
from ..transport.stall import StallWatch
from .engine import Engine
from .job import waits_elsewhere
from .lineage import PARENT, child_name


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
        watch = self.watch = StallWatch(comm, settings.stall_check_time,
                                        settings.stall_shutdown_time, abort, self.ranks, where)
        watch.elsewhere = functools.partial(waits_elsewhere, set_id, watch)   # (ours to free)
        self.names = AutoNames(set_id)     # see auto_name
        self.transport = Transport(comm, self.local, self.cross, settings, watch, self.ranks,
                                   self.homogeneous, self.names)
        self.engine = Engine(f"ringreduce-set{set_id}", self.ranks[comm.rank], comm.Iprobe,
                             functools.partial(agreement, self.transport.negotiator), set_id)
        self._optimizers: dict[str, Any] = {}     # a thread's place -> its count
        self.closed = False     # shut down: what holds it must find the set's new one (active)

    def optimizer_prefix(self) -> str:
        """What the bucket names of the next DistributedOptimizer this thread wraps on the set
        start with: nothing for the first, 'opt<k>.' for the k-th after it, so two optimizers'
        buckets never share a name, and members that wrap them in the same order agree; on a
        thread other than the main one, its place first ('train#1.', 'train#1.opt1.'), as
        unnamed collectives have it (auto_names.py): each thread's optimizers pair with the
        same thread's on the other members, whichever thread wraps first there."""
        fix_place(self.id)
        where = place(threading.current_thread()) or ""
        k = next(self._optimizers.setdefault(where, itertools.count()))
        return (f"{where}." if where else "") + ("" if k == 0 else f"opt{k}.")

    def auto_name(self, kind: str) -> str:
        """A collective's name when the caller gives none: '<kind>.noname.<k>' for the k-th
        unnamed collective of that kind that this thread submits to the set, with the thread's
        place before k for threads other than the main one (auto_names.py), so members that
        submit the same calls agree whatever other threads or sets they run, and threads pair
        with themselves across ranks (in-place variants count with their kind, as Horovod
        names `allreduce_` 'allreduce.noname.N' too). In a callback of a collective's future,
        the name comes from that collective instead (lineage.children_of)."""
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
        self.realign_names("join")
        return self.ranks[last]

    def realign_names(self, after: str) -> None:
        """(Collective over the members.) Every count of automatic names from the highest among
        the members, after a `join` or an elastic reset, where some members ran unnamed
        collectives that others did not."""
        self.names.realign(lambda mine: self.transport.allgather_object(
            mine, {"collective": after, "name": f"{after}.names"}))

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
        """`leave`, then `free`: for a set closed alone (open_group's)."""
        self.leave(restarting)
        return self.free()

    def leave(self, restarting: bool = False) -> None:
        """Run what is queued and say goodbye to the other members, so that one still waiting
        in a collective with this rank raises instead of hanging. `restarting`: every member
        starts afresh at once (world.restart)."""
        self.closed = True
        self.engine.shutdown()
        self.transport.watch.departures.announce(self.transport.watch.begun, restarting)

    def free(self) -> list[int]:
        """After `leave`: once every member has left too, free the set's window, board and
        communicators (collective). Returns the members (global ranks) that did not leave to
        start afresh: every member knows them alike, all goodbyes in."""
        departures = self.transport.watch.departures
        self.transport.watch.wait_for_goodbyes()
        self.transport.free()
        self.watch.free()
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
