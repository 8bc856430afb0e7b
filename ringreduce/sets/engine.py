"""One process set's ordering: its collectives run one at a time, paired across ranks by name.

Asynchronous work goes to the set's background thread, so communication overlaps backward. A
synchronous call made while nothing is queued runs inline on the caller's thread instead:
waking a sleeping thread costs tens of microseconds, more than a small allreduce itself.
Either way exactly one thread runs the set's collectives at a time, in submission order.

Collectives are paired by name, as Horovod's coordinator pairs them. When every member
submits the same collective next (every optimizer step), running in submission order is the
whole story. When they do not, the collective's signature check says so on every member
(`OutOfOrder`, before any data is used), and the thread running it settles the order with the
other members: rounds of exchanging the names each member has pending (`agreement`), until
some are pending on every member; those run, in the same order everywhere, and the rest
return to the queue. A name may be pending only once per rank (names.py). Where none is
pending everywhere and none can come, since on every member each thread that has submitted to
the set waits for one of its pending collectives (`Engine._stuck`), the program has
deadlocked: every member fails its first (negotiation.py), where Horovod waits for ever.

Each collective's handle (handles.py) holds its result or error. Its done-callbacks (a torch
future's `then()` chain: user code) run after the thread that finished it has let go of the
set, since they may start another collective and wait for it (DDP's PowerSGD hook does). If
that thread is the engine thread, a new engine thread takes over the queue the moment such a
callback queues work, and the old one ends after its callbacks. The names of collectives
started there: lineage.py.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional, Union

from ..core.errors import RingReduceError
from ..core.thread_places import fix_place, internal
from ..core.waiting import (AWAKE_SECONDS, IDLE_POKE_SECONDS, LONGEST_PICKUP,
                             LONGEST_SETTLING_NAP, PICKUP_SECONDS, SETTLING_NAP, Backoff)
from ..transport.negotiation import OutOfOrder
from ..transport.settling import Agreement
from .handles import Finished, Handle, call_back, run_collective, settle_first
from .lineage import EndedMarks
from .names import TakenNames
from .submitters import Submitters, Waiting


class Engine:
    """`poke()` runs now and then while the engine idles: MPI progress for the set's
    communicator, so that other ranks' one-sided reads of this rank complete. `agreement()`
    starts one settling of the order across the set (see the module's docstring).

    `_running` is held by whichever thread runs the set's collectives: the engine thread for
    queued work, a caller for a synchronous one (taken only while nothing is queued). The
    engine thread takes it before it pops the next handle, so a caller never overtakes work
    queued before it. A non-blocking acquire is the fast path's whole claim; its name, if the
    caller gave one, is taken meanwhile (`names`), so that a duplicate is refused. Whoever lets go
    of it (`_let_go`) then calls the done-callbacks of what finished meanwhile (`_due`).
    `_driver` is the engine thread of the moment (see the module's docstring)."""

    def __init__(self, thread_name: str, rank: int, poke: Callable[[], Any],
                 agreement: Callable[[], Agreement], home: Union[int, str] = 0) -> None:
        self.rank, self.home = rank, home
        self._poke, self._agreement = poke, agreement
        self._running = threading.Lock()
        self._cv = threading.Condition()        # guards the queue, the names, _stopping
        self._queue: collections.deque[Handle] = collections.deque()
        self.names = TakenNames(rank)
        self._stopping = False
        self._dozing = True             # the engine thread sleeps long: a submission wakes it
        self._last_submission = self._last_poke = 0.0
        self._due: collections.deque[tuple[Handle, list]] = collections.deque()
        self._driver_in_callbacks = False
        self.ended = EndedMarks()           # children_end marks, for the settlings
        self._submitters = Submitters()     # who could still submit (`_stuck`)
        with self._cv:
            self._start_driver(thread_name)

    def _start_driver(self, thread_name: str) -> None:
        """Under the condition's lock: a new engine thread (the old one, if any, ends)."""
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        internal(self._thread)
        self._thread.start()
        self._driver = self._thread.ident
        self._driver_in_callbacks = False

    def submit(self, name: str, work: Callable[[], Any]) -> Handle:
        """Queue `work` to run after everything submitted before it; returns its handle."""
        if threading.get_ident() not in self._submitters:
            fix_place(self.home)
        with self._cv:
            return self._enqueue(name, work)

    def _enqueue(self, name: str, work: Callable[[], Any]) -> Handle:
        """Under the condition's lock: queue `work` and wake the engine thread."""
        handle = Handle(name, work, self)
        self._claim_name(name)
        self._submitters.add()
        self._queue.append(handle)
        self._queued()
        return handle

    def _queued(self) -> None:
        """Under the condition's lock, after work was queued: wake the engine thread; or, if
        this is the engine thread inside a done-callback (which may now wait for this very
        work), start a new one to run the queue."""
        self._last_submission = time.monotonic()
        if self._driver_in_callbacks and threading.get_ident() == self._driver:
            self._start_driver(self._thread.name)
        elif self._dozing:
            self._cv.notify_all()

    def run(self, name: str, work: Callable[[], Any]) -> Any:
        """Run `work` now and return its result: inline when the engine is idle, else queued."""
        if threading.get_ident() not in self._submitters:
            fix_place(self.home)
        with self._cv:
            if not self._queue and self._running.acquire(False):
                handle = None
                try:
                    self._claim_name(name)
                except BaseException:
                    self._running.release()
                    raise
                self._submitters.add()
            else:
                handle = self._enqueue(name, work)
        if handle is not None:
            return handle.wait()
        try:
            return run_collective(name, work)
        except OutOfOrder:
            handle = self.reorder(name, work)
        finally:
            if handle is None:
                self.names.release(name)
            self._let_go()
        return handle.wait()

    def claim_idle(self, name: Optional[str] = None) -> bool:
        """Take the engine for one synchronous call on this thread if nothing is queued or
        running; `release_idle()` after it. `name`: the call's name, if the caller chose it
        (ValueError if that name is in flight); an automatic one is unique anyway."""
        if not self._running.acquire(False):
            return False
        if name is not None:
            try:
                self.names.claim_inline(name)
            except ValueError:
                self.release_idle()
                raise
        if self._queue or self._stopping:
            self.release_idle()
            return False
        if threading.get_ident() not in self._submitters:     # a thread's first call here:
            self.release_idle()         # the general path settles its place (thread_places),
            return False                # which may wait, first
        return True

    def waiting_for(self, handle: Handle) -> "Waiting":
        """Around this thread's wait for `handle`, one of the set's collectives (`_stuck`)."""
        return Waiting(self._submitters.waiting, handle)

    def _stuck(self) -> bool:
        """(Under the condition's lock.) Whether nothing more can be submitted to the set on
        this rank: every thread that has submitted to it, and lives, waits for one of its
        collectives that is still pending, and no done-callback (which may submit) is due. A
        settling that finds every member so, and nothing pending on all of them, is a
        deadlock of the program (negotiation.py), not a slow rank. A thread that never
        submitted, or one that waits in another way (a C++ future, a sleep), is not counted
        as stuck: then the settling waits, with stall reports. An engine shutting down takes
        nothing more: stuck, whoever waits where."""
        if self._stopping:
            return True
        return not self._due and self._submitters.stuck()

    def release_idle(self) -> None:
        """After a claim. The engine thread, if it waits, waits for the lock itself. (As
        `_let_go`, written out: the small allreduce's every call comes here.)"""
        self.names.inline = None
        self._running.release()
        if self._due:
            self._run_due()

    def _let_go(self) -> None:
        """Let go of the set's work, then call the done-callbacks of what finished meanwhile
        (user code, which may start another collective and wait for it)."""
        self._running.release()
        if self._due:
            self._run_due()

    def _run_due(self) -> None:
        """(On the engine thread: marked as in callbacks, for `_queued`; a synchronous
        collective in a callback lets go of the set, and so runs this, again, inside.)"""
        me = threading.get_ident()
        driving = me == self._driver
        if driving:
            outer, self._driver_in_callbacks = self._driver_in_callbacks, True
        try:
            while True:
                try:
                    handle, callbacks = self._due.popleft()
                except IndexError:
                    return
                call_back(handle, callbacks)
        finally:
            if driving and me == self._driver:      # (not if a new engine thread took over)
                self._driver_in_callbacks = outer

    def begin_now(self, name: str, named: bool,
                  begin: Callable[..., tuple[bool, Any, Callable[[], Any]]], *args: Any
                  ) -> Optional[Handle]:
        """By the holder of an idle claim: start asynchronous collective `name` on this thread
        rather than hand it to the engine thread. `begin(*args)` posts this rank's part without
        waiting and returns (done, value, whole). Done: every member's part was there already,
        and `begin` completed the collective in place, as a synchronous call would; then None
        (the caller has the result: at a few microseconds a call a handle shows), or, where
        `named` (the caller chose the name, which stays taken until waited for, names.py), its
        handle. Otherwise `value` is `rest`, what completes it (None: the members' next
        collectives differ, and the order is settled first), which goes first in the queue
        (nothing else may run before it: our part is posted), for the engine thread or a
        waiter; `whole()` runs it from the start (after a reorder). The order is never settled
        on this caller: what the others wait for may be its next submission. Errors, `begin`'s
        too, reach the caller from `wait()`, as for queued work."""
        try:
            done, value, whole = begin(*args)
        except Exception as exc:    # (an interrupt of the caller's thread goes to the caller)
            return Finished(name, None, exc, self)
        if done:
            if not named:
                self.names.last_done = None     # (names.hold's first half: an automatic
                return None                     # name frees the one held before it)
            finished = Finished(name, value, None, self)
            self.names.hold(finished)           # (before the claim lets go of `inline`)
            return finished
        remaining = [settle_first if value is None else value]

        def work() -> Any:          # `rest` the first time, `whole` if it must run again
            return (remaining.pop() if remaining else whole)()

        handle = Handle(name, work, self)
        with self._cv:
            self.names.in_flight.add(name)   # (not a duplicate: the claim checked the name)
            self._queue.appendleft(handle)
            self._queued()
        return handle

    def reorder(self, name: str, work: Callable[[], Any]) -> Handle:
        """By the holder of the engine, whose inline collective `name` met OutOfOrder: settle
        the order with the other members. Returns the collective's handle: done, or first in
        the queue for the engine thread (wait for it after letting go of the engine)."""
        handle = Handle(name, work, self)
        with self._cv:
            self.names.in_flight.add(name)
        with self.waiting_for(handle):      # (this thread settles for it)
            settled = self._settled(handle)
        if not settled:
            with self._cv:
                self._queue.appendleft(handle)
                self._queued()
                self._cv.notify_all()
        return handle

    def shutdown(self) -> None:
        """Run what is queued, end the thread, then wait for the collective another thread may
        be running on its own (a synchronous call): the set's memory is freed after this.
        Nothing more is taken meanwhile, so that thread's next call raises."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        with self._running:
            pass

    def _claim_name(self, name: str) -> None:      # (under the condition's lock)
        if self._stopping:
            raise RingReduceError("ringreduce: the engine is shut down; call init() again")
        self.names.claim(name)

    def _execute(self, handle: Handle) -> bool:
        """Run `handle` (its caller holds `_running`). True when it finished (result or error:
        then its name is free and it is done); False when it is still pending because the
        members' next collectives differed and the others ran first."""
        try:
            handle.run_work()
        except OutOfOrder:
            return self._settled(handle)
        self._complete(handle)
        return True

    def _settled(self, handle: Handle) -> bool:
        """`handle` met OutOfOrder: settle the order (`_settle`); as `_execute` returns."""
        try:
            self._settle(handle)
        except BaseException as exc:    # the settling failed (a member left, MPI): so did it
            if not handle.done():
                handle.fail_with(exc)
                self._complete(handle)
            return True
        return handle.done()

    def _complete(self, handle: Handle) -> None:
        """Its name is held (names.py) until a caller has waited for it. Its callbacks wait
        until this thread lets go of the set (`_let_go`)."""
        self.names.hold(handle)
        callbacks = handle.set_done()
        if callbacks:
            self._due.append((handle, callbacks))

    def run_up_to(self, handle: Handle) -> None:
        """On a thread waiting for `handle`: while the engine is free, run the queue in order
        until `handle` is done, as the engine thread would."""
        while not handle.done() and self._running.acquire(False):
            try:
                if not self._run_next():
                    return
            finally:
                self._let_go()

    def _run_next(self) -> bool:
        """By the holder of `_running`: run the queue's first handle (back to the front if
        others ran first); False when the queue is empty (a settling on another thread, or a
        waiter, ran what was there)."""
        with self._cv:
            if not self._queue:
                return False
            first = self._queue.popleft()
        if not self._execute(first):
            with self._cv:
                self._queue.appendleft(first)
        return True

    def _settle(self, first: Handle) -> None:
        """`first` met OutOfOrder: rounds with the other members until some names are pending
        on all of them; run those, in the agreed order. Between rounds that agree on nothing,
        wait for a new submission here (or a short pause: the others' may come). A round may
        also end the settling with nothing run (a reset, negotiation.py)."""
        agree = self._agreement()
        naps = Backoff(SETTLING_NAP, LONGEST_SETTLING_NAP)
        while True:
            with self._cv:
                pending, ended = [first, *self._queue], self.ended.copy()
                stuck = self._stuck()
            agreed = agree([h.name for h in pending], ended, stuck)
            if agreed is None:
                return
            if agreed:
                break
            pause = naps.nap()
            with self._cv:
                if len(self._queue) == len(pending) - 1:
                    self._cv.wait(pause)
        by_name = {h.name: h for h in pending}
        for name in agreed:
            handle = by_name[name]
            if handle is not first:
                with self._cv:
                    if handle not in self._queue:     # run by a settling inside this one
                        continue
                    self._queue.remove(handle)
            if not self._execute(handle) and handle is not first:
                with self._cv:
                    self._queue.appendleft(handle)

    def _loop(self) -> None:
        pause = PICKUP_SECONDS
        me = threading.get_ident()
        while True:
            with self._cv:
                if self._driver != me:       # a new engine thread took over (_queued)
                    return
                while not self._queue and not self._stopping:
                    now = time.monotonic()
                    self._dozing = now - self._last_submission > AWAKE_SECONDS
                    if self._dozing or now - self._last_poke > IDLE_POKE_SECONDS:
                        self._last_poke = now
                        self._poke_if_idle()
                    if self._dozing:
                        self._cv.wait(IDLE_POKE_SECONDS)
                        pause = PICKUP_SECONDS
                    else:
                        self._cv.wait(pause)
                        if self._running.locked():      # a caller runs the set's work
                            pause = min(2 * pause, LONGEST_PICKUP)
                self._dozing = False
                if not self._queue:
                    return
            pause = PICKUP_SECONDS     # work came while looking: look often again
            self._running.acquire()         # after a synchronous call in progress
            try:
                self._run_next()
            finally:
                self._let_go()

    def _poke_if_idle(self) -> None:
        """(Under the condition's lock: it finishes no collective, so no callbacks are due.)"""
        if self._running.acquire(False):
            try:
                self._poke()
            finally:
                self._running.release()
