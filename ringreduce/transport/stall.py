"""Waiting for a process set's members, and why a wait fails: stalls and departures.

Each rank publishes how many collectives it has begun on a process set, and which one it waits
in (progress_board.py). A rank that has waited `stall_check_time` seconds in a collective
reads every member's count (one-sided, so the missing ranks need not cooperate) and logs
which ranks have not reached the collective and the last one they did reach, and where
they wait on the other sets this rank shares with them (`elsewhere`: each rank waiting for the
other on a different set is a mistake made on one rank, a group passed to one call on one rank
alone, say), again every interval for as long as the stall lasts; after `stall_shutdown_time` it
hands that message to its `on_shutdown` (which ends the job). A member that shuts down says
goodbye to the others (departures.py); a rank waiting in a collective that member never
began, or starting one, raises ShutDownError naming it. (One it began, it finished: that one
still completes here, though its last messages may arrive after the goodbye.)

A member whose collective fails in a way its peers cannot see (an allocation, a kernel, MPI, an
interrupt: anything but the errors every member raises alike) tells them so, the same way. Its
peers may be waiting on messages it will never send, and it may have left messages and receives
of its own behind that would pair with the next collective's: the set's traffic is out of step.
So the set is shut down on every member, each raising ShutDownError naming the rank that failed
and why, now if it waits in a collective, else at its next; shutdown() and init() start afresh
(or, for a process set, removing it and adding it again).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

from ..core.errors import RingReduceError, ShutDownError
from ..core.state import abandon
from ..core.waiting import DEPARTED_GRACE, LOOK_EVERY, YIELD_SECONDS, Backoff, Every, Once
from .departures import Departures
from .progress_board import ProgressBoard

log = logging.getLogger("ringreduce")
REMEMBERED = 4096       # the labels of this many recent collectives, for stall reports
_JOINED_COUNT = 1 << 62  # what a joined rank publishes on the progress board
_OPENING = -1            # what it publishes as waited in while it opens a group (`opening`)
_READ_SECONDS = 2.0      # how long a stall report waits for the members' counts (at most
                         # half the check interval, so that reports keep their interval)
_FAILURE_CHARACTERS = 400   # of the cause, in the message that tells the peers


class StallWatch:
    """Counts the collectives begun on one process set and waits for its members, reporting
    stalls and departures. `ranks` are the members' global ranks (for messages), `where` names
    the set."""

    def __init__(self, comm: Any, check_time: float, shutdown_time: float,
                 on_shutdown: Callable[[str], None], ranks: Sequence[int], where: str) -> None:
        self.comm = comm
        self.check_time = check_time
        self.shutdown_time = shutdown_time
        self.on_shutdown = on_shutdown
        self.ranks = list(ranks)
        self.where = where
        self.board = ProgressBoard(comm) if comm.size > 1 else None
        # this rank's words on the board, (begun, waiting in), written by `begin` (and by
        # the small way's copy of it) without a call
        self.published = self.board.mine if self.board is not None else None
        self.departures = Departures(comm)
        self.begun = 0
        self.quiet = False      # a joined rank waits for the others by design: no reports
        # (global ranks missing here, everywhere=False) -> where they wait on the other sets
        # this rank shares with them (everywhere: on this one too), their `waits()` there
        # (process_sets sets it)
        self.elsewhere: Optional[Callable[..., list[tuple[str, Optional[bool]]]]] = None
        # what collective #k was, at k % REMEMBERED: strings only, so that remembering
        # thousands of them keeps no per-call objects alive for the garbage collector to
        # promote (which then pauses the process for a full collection, ~80 ms with torch)
        self.recent_counts = [0] * REMEMBERED
        self.recent_labels = [""] * REMEMBERED

    def free(self) -> None:
        if self.board is not None:
            self.board.free()

    def wait_for_goodbyes(self) -> None:
        """After this member's goodbye, until every other member's: a report every check
        interval names those still working (no shutdown: a rank that finishes first waits,
        by design, for one that evaluates or saves at the end)."""
        def report(seconds: float, missing: list[int]) -> None:
            log.warning(f"ringreduce: rank {self.ranks[self.comm.rank]} has waited "
                        f"{seconds:.0f} s in shutdown(){self.where} for ranks "
                        f"{[self.ranks[r] for r in missing]} to shut down too (every rank "
                        "waits for the others there, or at the end of its script)")
        self.departures.wait_for_everyone(report, self.check_time)

    def set_joined(self, joined: bool) -> None:
        """While this rank has joined, it waits quietly, and its peers' reports do not count
        it as missing (its published count is above any collective's)."""
        self.quiet = joined
        if self.board is not None:
            self.board.publish(_JOINED_COUNT if joined else self.begun)

    def begin(self, label: str) -> None:
        """Count one more collective begun on this rank, and remember how a report names it
        (signature.label). ShutDownError when a member has left: the collective could never
        complete. (SmallWay.now_in_place writes this out.)"""
        begun = self.begun = self.begun + 1
        slot = begun % REMEMBERED
        self.recent_counts[slot], self.recent_labels[slot] = begun, label
        if self.published is not None:
            self.published[0] = begun      # the board's publish(), inline: the hot path
        if self.departures.gone or self.departures.failures:
            self.check_departed(begun)

    def check_departed(self, collective: int) -> None:
        """ShutDownError if collective #`collective` can never complete: a member left
        before it (or failed)."""
        if self.departures.ended(collective):
            raise self._ended()

    def failed(self, error: BaseException) -> None:
        """This member's collective #begun failed where the others may wait on it: tell them
        (see the module's docstring), and raise the RingReduceError that says so here, `error`
        as its cause. Returns (for the caller to raise `error` itself) where nobody was told,
        in a set of one or after the first failure, which shut the set down, and for an
        interrupt, which stays what it is."""
        if self.departures.failures or self.comm.size == 1:
            return
        cause = f"{type(error).__name__}: {error}"
        if len(cause) > _FAILURE_CHARACTERS:
            cause = cause[:_FAILURE_CHARACTERS] + " ..."
        what = f"collective #{self.begun} {self._name(self.begun)}".rstrip()
        self.departures.announce_failure(f"{what} ({cause})")
        if isinstance(error, Exception):
            raise RingReduceError(
                f"ringreduce: rank {self.ranks[self.comm.rank]}: {what}{self.where} failed here "
                f"({cause}), and the other members were told: {self._shut_down()}") from error

    def wait_request(self, request: Any) -> None:
        """Wait for one MPI request, as `wait` does (reports, departures, failures). One left
        pending by an error is kept, and with it its buffers, which MPI may still use."""
        try:
            self.wait(request.Test)
        except BaseException:
            abandon(request)
            raise

    def wait(self, done: Callable[[], bool]) -> None:
        """Wait until `done()` without hogging the core; report stalls every interval while
        waiting, end the job at the stall shutdown time, and raise ShutDownError when a member
        has left."""
        if done():
            return
        published = self.published
        if published is None:
            self._wait(done)
            return
        published[1] = self.begun       # (where peers' reports on other sets look: `waits`)
        try:
            self._wait(done)
        finally:
            published[1] = 0

    def _wait(self, done: Callable[[], bool]) -> None:
        backoff = Backoff()
        start = backoff.start
        reports = Every(0.0 if self.quiet else self.check_time, start)
        shutdown = Once(0.0 if self.quiet else self.shutdown_time, start)
        looks, grace = Every(LOOK_EVERY, start + YIELD_SECONDS - LOOK_EVERY), Once(None, start)
        while not done():
            now = backoff.pause()
            if now - start < YIELD_SECONDS:
                continue
            if looks.due(now):
                self.departures.look()
                if self.departures.ended(self.begun):
                    raise self._ended()
                if self.departures.gone:
                    # Those that left had begun this one, by their counts, so they did their
                    # part: it completes in a moment. (Counts can differ where a collective
                    # ran again after the members settled their order by name.)
                    grace.earlier(now + DEPARTED_GRACE)
                    if grace.passed(now):
                        raise self._ended(every=True)
            if shutdown.passed(now):
                self.on_shutdown(f"{self.describe(now - start)} Shutting the job down after "
                                 f"{self.shutdown_time:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME).")
            if reports.due(now):        # every interval from the start, however long
                log.warning(self.describe(now - start))     # the report itself took

    def _name(self, count: int) -> str:
        slot = count % REMEMBERED
        return self.recent_labels[slot] if self.recent_counts[slot] == count else ""

    def _ended(self, every: bool = False) -> ShutDownError:
        """The error of a collective that cannot complete (see _departed)."""
        return ShutDownError(self._departed(every), restartable=self.departures.restartable())

    def _departed(self, every: bool = False) -> str:
        """Why this collective cannot complete: a member failed, or these left: those that had
        not begun it, or `every` one."""
        me = self.comm.rank
        head = (f"ringreduce: rank {self.ranks[me]}: collective #{self.begun} "
                f"{self._name(self.begun)}{self.where} cannot complete: ")
        if self.departures.failures:
            failed, what = min(self.departures.failures.items())
            who = "this rank" if failed == me else f"rank {self.ranks[failed]}"
            return head + f"{who} failed in its {what}: {self._shut_down()}"
        names = sorted(self.ranks[r] for r, begun in self.departures.gone.items()
                       if every or begun < self.begun)
        who = f"rank {names[0]}" if len(names) == 1 else f"ranks {names}"
        how = ("left the set (remove_process_set(), ringreduce.shutdown(), or the end of its "
               "script)" if self.where else
               "shut down (ringreduce.shutdown(), or the end of its script)")
        return (head + f"{who} {how} without it. Every rank must run the same collectives: let "
                "the ranks finish together, or use join() for uneven data.")

    def _shut_down(self) -> str:
        again = ("Make the set afresh (remove_process_set() and add_process_set(), or a new "
                 "torch.distributed group), or call ringreduce.shutdown() and init()"
                 if self.where else "Call ringreduce.shutdown() and init()")
        return (f"the members' messages are out of step, so ringreduce"
                f"{self.where or ' in this job'} is shut down. {again} on every rank to go on.")

    def describe(self, waited: float) -> str:
        where = (f"ringreduce: stall: rank {self.ranks[self.comm.rank]} has waited {waited:.0f} s "
                 f"in collective #{self.begun} {self._name(self.begun)}{self.where}")
        counts = self.board.read_all(self.read_timeout()) if self.board is not None else None
        if counts is None:
            return (where + ", and some rank does not answer at all (stopped, stuck in native "
                    "code, or its process is gone).")
        late = [r for r, c in enumerate(counts[:, 0]) if c < self.begun]
        if not late:
            return where + "; every rank has begun it, so a rank is slow or stuck inside it."
        missing = [self.ranks[r] for r in late]
        behind = "; ".join(
            f"rank {self.ranks[r]} has shut down" if r in self.departures.gone
            else f"rank {self.ranks[r]} has begun none" if c == 0
            else f"rank {self.ranks[r]} last began #{c} {self._name(int(c))}".rstrip()
            for r, c in zip(late, counts[late, 0]))
        head = f"{where}, which ranks {missing} have not submitted ({behind})."
        here = [self.ranks[r] for r in late if r not in self.departures.gone]
        elsewhere = [(_opening(self.ranks[r]), None) for r in late if counts[r, 1] == _OPENING]
        if self.elsewhere is not None:
            elsewhere += self.elsewhere(here)
        also = f" Meanwhile {'; '.join(text for text, _ in elsewhere)}." if elsewhere else ""
        if any(for_us for _, for_us in elsewhere):
            return (f"{head}{also} Ranks that wait for each other on different sets call the "
                    "sets' collectives in different orders, or pass a set (a torch group) on "
                    "some ranks only: every rank must make the same calls, in the same order.")
        if any(for_us is None for _, for_us in elsewhere):     # (opening a group: said)
            return f"{head}{also}"
        return (f"{head}{also} Those ranks are stuck in their own code, or submit collectives "
                "in a different order or number than the others.")

    def meanwhile(self, ranks: list[int]) -> str:
        """For a report of a wait outside a collective (a message, a group's opening): where
        global `ranks` wait meanwhile in a collective of a set this rank shares with them, as
        '; meanwhile ...' clauses."""
        found = [] if self.elsewhere is None else self.elsewhere(ranks, everywhere=True)
        return "".join(f"; meanwhile {words}" for words, _ in found)

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """While this rank waits for the members of a group it opens (process_sets), other
        sets' reports say so (`waits`)."""
        if self.published is None:
            yield
            return
        self.published[1] = _OPENING
        try:
            yield
        finally:
            self.published[1] = 0

    def read_timeout(self) -> float:
        """How long a report waits for a board's answer (at most half the check interval, so
        that reports keep their interval)."""
        return min(_READ_SECONDS, self.check_time / 2) if self.check_time > 0 else _READ_SECONDS

    def waits(self, ranks: list[int], timeout: float) -> list[tuple[str, Optional[bool]]]:
        """For another set's stall report: where the members among global `ranks` wait in a
        collective of this set, in words, and whether they wait for this rank there (in one
        that it has not begun; None: to open a group, `opening`). Nothing where the board
        does not answer within `timeout`."""
        members = [(g, self.ranks.index(g)) for g in ranks if g in self.ranks]
        counts = self.board.read_all(timeout) if members and self.board is not None else None
        if counts is None:
            return []
        where = self.where or " on the global set"
        found = []
        for g, r in members:
            waiting = int(counts[r, 1])
            if waiting == 0:
                continue
            if waiting == _OPENING:
                found.append((_opening(g), None))
            elif waiting > self.begun:
                last = (f"its last there: #{self.begun} {self._name(self.begun)}".rstrip()
                        if self.begun else "it has begun none there")
                found.append((f"rank {g} waits in collective #{waiting}{where}, which rank "
                              f"{self.ranks[self.comm.rank]} has not begun ({last})", True))
            else:
                label = f"#{waiting} {self._name(waiting)}".rstrip()
                found.append((f"rank {g} waits in collective {label}{where}", False))
        return found


def _opening(rank: int) -> str:
    """A report's words for global `rank` waiting to open a group (StallWatch.opening)."""
    return (f"rank {rank} waits to open a group with other members (a torch new_group): every "
            "member must make the same groups, in the same order")
