"""A point-to-point message as torch sees it (`MessageWork`, torch's Work on MPI requests),
and what its wait keeps besides (`Overdue`): past the set's stall check time a report naming
the peer and the tag, every interval; at the stall shutdown time the end of the job, as a
collective's wait; ShutDownError for a peer that shut down without its side; and torch's
`wait(timeout)`."""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from ..core.errors import RingReduceError, ShutDownError
from ..core.mpi import mpi
from ..core.state import abandon
from ..core.waiting import (DEPARTED_GRACE, LONGEST_NAP, LOOK_EVERY, SHORTEST_NAP, YIELD_SECONDS,
                            Backoff, Every, Once)
from .failed_future import fail

_WORK_INIT = dist.Work.__init__
log = logging.getLogger("ringreduce")


class MessageWork(dist.Work):
    """One send or receive with group rank `peer` (None: any), on `channel`
    (point_to_point.Channel):
    torch's Work on MPI requests. `requests`: what it waits for (None: a receive whose bytes'
    receive `Channel.advance` has not posted yet), `buffers` what they read or write;
    `arrived`: a receive's, run once they have come (it raises if the sender's tensor differs,
    or copies them in). `wait()` returns True once the message has gone (or arrived, checked
    and copied in) or raises why not."""

    __slots__ = ("_channel", "_peer", "_what", "_tensor", "_requests", "_buffers", "_arrived",
                 "_source", "_lock", "_done", "_error", "_future")

    def __init__(self, channel: Any, what: str, peer: Optional[int],
                 tensor: torch.Tensor, requests: Optional[list] = None, buffers: tuple = (),
                 arrived: Optional[Callable[[], None]] = None) -> None:
        _WORK_INIT(self)    # (as work.py's: super() and a __dict__ cost a microsecond)
        self._channel, self._peer, self._what, self._tensor = channel, peer, what, tensor
        self._requests, self._buffers, self._arrived = requests, buffers, arrived
        self._source = peer                 # a receive's sender, once its header came
        self._lock = threading.Lock()      # MPI forbids two threads testing one request
        self._done = False
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None

    def _test(self) -> bool:
        """Whether the message is complete (then checked, copied in, and its future set)."""
        with self._lock:
            if self._done:
                return True
            try:
                if self._channel.waiting():     # (a send's too: the peer's may wait for it)
                    self._channel.advance()
                if self._requests is None:
                    return False
                if not mpi().Request.Testall(self._requests):
                    return False
                if self._arrived is not None:
                    self._arrived()
            except Exception as exc:        # our size and dtype check, or an MPI error
                self._error = exc if isinstance(exc, RingReduceError) else RingReduceError(
                    f"ringreduce: {self._what} failed: {type(exc).__name__}: {exc}")
                self._error.__cause__ = exc
                if self._requests is None:      # (its bytes are not to land in it later)
                    self._channel.abandon(self)
            self._done = True
            future = self._future
        if future is not None:
            self._settle(future)
        return True

    def _settle(self, future: Future) -> None:
        if self._error is not None:
            fail(future, self._error)
        else:
            future.set_result([self._tensor])

    def _fail(self, error: BaseException) -> None:
        """End the work with `error` though its requests are still pending (a peer that left):
        they, and with them the buffers MPI may still write, are kept (core/state.abandon)."""
        with self._lock:
            if self._done:
                return
            self._error, self._done = error, True
            if self._requests is None:
                self._channel.abandon(self)
            else:
                abandon(*self._requests, *self._buffers)
            future = self._future
        if future is not None:
            self._settle(future)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if not self._test():
            overdue, backoff = Overdue(self, timeout), Backoff(SHORTEST_NAP, LONGEST_NAP)
            while not self._test():
                now = backoff.pause()
                if now - backoff.start < YIELD_SECONDS:
                    continue
                try:
                    overdue.check(now)
                except ShutDownError as exc:
                    self._fail(exc)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._test()

    def is_success(self) -> bool:
        return self._test() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error if self._test() else None

    def result(self) -> list:
        self.wait()
        return [self._tensor]

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done:
                    self._settle(self._future)
                else:
                    self._channel.poller.watch(self)
            return self._future

    def source_rank(self) -> int:
        """The group rank a receive from any source got its message from (the channel's
        communicators rank the group's members as the group does)."""
        self.wait()
        return self._source

    _source_rank = source_rank


class Overdue:
    """A message's wait, past what it should take (the module docstring): `check(now)` logs
    the stall reports when due, ends the job at the stall shutdown time, and raises
    ShutDownError for a peer that has left without its side, RingReduceError past torch's
    `timeout`."""

    def __init__(self, work: MessageWork, timeout: Optional[datetime.timedelta]) -> None:
        self.work, self.timeout, watch = work, timeout, work._channel.watch
        start = self.start = time.monotonic()
        self.limit = Once(None if timeout is None else timeout.total_seconds(), start)
        self.reports = Every(watch.check_time, start)
        self.shutdown = Once(watch.shutdown_time, start)
        self.looks, self.gone = Every(LOOK_EVERY, start), Once(None, start)

    def check(self, now: float) -> None:
        work, watch = self.work, self.work._channel.watch
        me = work._channel.comm.rank
        if work._peer is not None and self.looks.due(now):
            watch.departures.look()
            if work._peer in watch.departures.gone:
                self.gone.earlier(now + DEPARTED_GRACE)
        if self.gone.passed(now) and not work._test():
            raise ShutDownError(
                f"ringreduce: {work._what}, rank {me}: rank {work._peer} shut down "
                "(ringreduce.shutdown(), or the end of its script) without its side of this "
                "message: every send needs its recv, on the peer, before it leaves")
        if self.limit.passed(now):
            raise RingReduceError(f"ringreduce: {work._what}, rank {me}: not complete after "
                                  f"wait()'s timeout of {self.timeout}")
        if self.reports.due(now):
            log.warning(self._stalled(now - self.start))
        if self.shutdown.passed(now):
            watch.on_shutdown(f"{self._stalled(now - self.start)} Shutting the job down after "
                              f"{watch.shutdown_time:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME).")

    def _stalled(self, waited: float) -> str:
        """The stall report, with where the peer waits in a collective of a set this rank
        shares with it (StallWatch.waits: one this rank has not begun, say, while it waits
        here)."""
        work = self.work
        peer = "any rank" if work._peer is None else f"rank {work._peer}"
        text = (f"ringreduce: stall: rank {work._channel.comm.rank} has waited {waited:.0f} s "
                f"in {work._what}: {peer} has not made the matching "
                f"{'send' if work._arrived is not None else 'recv'} (same tag, same group)")
        watch = work._channel.watch
        return text if work._peer is None else text + watch.meanwhile([watch.ranks[work._peer]])
