"""Progress for point-to-point messages that no caller waits on: one thread for every channel
of the process (`POLLER`), asleep while there is nothing to do."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from ..core.errors import ShutDownError
from ..core.thread_places import internal
from ..core.waiting import LONGEST_NAP, SHORTEST_NAP, Backoff
from .messages import MessageWork, Overdue

_LINGER = 0.1               # seconds the poller keeps advancing a channel with no receive
log = logging.getLogger("ringreduce")


class Poller:
    """Progress for messages that no caller waits on, by one thread for every channel, asleep
    while there is none: it posts the bytes' receives of receives whose headers have come
    (`Channel.advance`, every millisecond while a channel has receives, and for a while
    after; a peer's large send waits for that receive, while the receiving caller may be
    waiting for something else, a collective with that peer, say), and completes the futures
    of pending messages, reporting their stalls and failing those whose peer left, as `wait()`
    does."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._pending: dict[MessageWork, Overdue] = {}
        self._channels: dict[Any, float] = {}   # a Channel -> when it last had receives waiting
        self._thread: Optional[threading.Thread] = None

    def watch(self, work: MessageWork) -> None:
        with self._wake:
            self._pending[work] = Overdue(work, None)
            self._rouse()

    def advance(self, channel: Any) -> None:
        """Advance `channel` while it has receives waiting (call after adding one)."""
        if channel in self._channels:   # (polled already; _loop looks again after dropping one)
            return
        with self._wake:
            if channel not in self._channels:
                self._channels[channel] = time.monotonic()
                self._rouse()

    def forget(self, channel: Any) -> None:
        with self._wake:
            self._channels.pop(channel, None)

    def _rouse(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ringreduce-p2p",
                                            daemon=True)
            internal(self._thread)
            self._thread.start()
        self._wake.notify()

    def _loop(self) -> None:
        naps = Backoff(SHORTEST_NAP, LONGEST_NAP)
        while True:
            with self._wake:
                while not self._pending and not self._channels:
                    self._wake.wait()
                    naps = Backoff(SHORTEST_NAP, LONGEST_NAP)
                pending, channels = list(self._pending.items()), list(self._channels)
            for channel in channels:
                if channel.waiting():
                    try:
                        channel.advance()
                    except Exception:       # (MPI's: the waiting callers meet it too)
                        log.exception("ringreduce: the point-to-point thread could not "
                                      "advance the receives of %s", channel.label)
                        self.forget(channel)
            finished = []
            for work, overdue in pending:
                if not work._test():
                    try:
                        overdue.check(time.monotonic())
                        continue
                    except ShutDownError as exc:
                        work._fail(exc)
                finished.append(work)
            now = time.monotonic()
            with self._wake:
                for work in finished:
                    del self._pending[work]
                for channel in channels:
                    if channel in self._channels:
                        if channel.waiting():
                            self._channels[channel] = now
                        elif now - self._channels[channel] > _LINGER:
                            del self._channels[channel]
                            if channel.waiting():   # (a receive added as it went: `advance`
                                self._channels[channel] = now   # saw it still polled)
                busy = bool(self._pending)
            if finished or not busy:    # (progress, or only channels to advance: short naps)
                naps = Backoff(SHORTEST_NAP, LONGEST_NAP)
            time.sleep(naps.nap() if busy else LONGEST_NAP)


POLLER = Poller()       # (process-wide: every channel's messages)
