"""The automatic names of a process set's unnamed collectives, numbered per thread: the main
thread's k-th unnamed allreduce on the set is 'allreduce.noname.<k>', another thread's
'allreduce.noname.<place>.<k>', under the thread's place (thread_places.py), which is the same
on every rank of a symmetric program. Members whose threads submit the same calls so agree,
and two threads that submit unnamed collectives at once pair with themselves on the other
ranks, never with each other (Horovod's one count per process pairs them by which came
first). Threads without a place (started before ringreduce was imported, or by C++) share one
count, 'allreduce.noname.unplaced.<k>', in the order they call. torch.distributed's calls are
counted in call order instead, one count for every thread, as torch requires of its backends
(`in_call_order`).

Where members ran different numbers of some kind (a join, or a deadlock that failed a
different collective on each), `realign` moves every count to the highest among the members,
and their names agree again once their programs go on alike."""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Iterable, Optional, Union

from ..core.thread_places import place, fix_place

_UNPLACED = "unplaced"
_EVERY_THREAD = "*"     # the key of `in_call_order`'s counts
_THREADS_KEPT = 64      # threads whose counts are kept before those that ended are forgotten

Counts = dict[str, itertools.count]     # per kind


class AutoNames:
    """The names of one set's unnamed collectives; `home`: the set's id (thread_places)."""

    def __init__(self, home: Union[int, str]) -> None:
        self.home = home
        self._mine = threading.local()          # this thread's (prefix, counts)
        self._lock = threading.Lock()           # (taken by a thread's first name, realign)
        self._counts: dict[str, Counts] = {}    # by place ('' the main thread's)
        self._threads: dict[str, threading.Thread] = {}   # the thread at each place
        self._in_order = self._counts[_EVERY_THREAD] = {}

    def name(self, kind: str) -> str:
        """The name of this thread's next unnamed collective of `kind` on the set."""
        try:
            prefix, counts = self._mine.entry
        except AttributeError:
            prefix, counts = self._mine.entry = self._enter()
        counter = counts.get(kind)
        if counter is None:
            counter = counts.setdefault(kind, itertools.count())
        return f"{kind}.noname.{prefix}{next(counter)}"

    def in_call_order(self, kind: str) -> str:
        """'<kind>.noname.<k>' for the set's k-th such call, counted across this rank's
        threads in the order they call (torch.distributed's contract)."""
        counter = self._in_order.get(kind)
        if counter is None:
            with self._lock:
                counter = self._in_order.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"

    def _enter(self) -> tuple[str, Counts]:
        """This thread's first unnamed collective on the set: its place's counts. Those of
        threads that ended are forgotten once many threads have come (one per request,
        say): no later thread has their places."""
        fix_place(self.home)       # (already, where the call came through process_sets.active)
        thread = threading.current_thread()
        where: Optional[str] = place(thread)
        key = _UNPLACED if where is None else where
        with self._lock:
            if len(self._threads) >= _THREADS_KEPT:
                for gone in [k for k, t in self._threads.items()
                             if k not in ("", _UNPLACED) and not t.is_alive()]:
                    del self._threads[gone]
                    self._counts.pop(gone, None)
            self._threads.setdefault(key, thread)
            counts = self._counts.setdefault(key, {})
        return ("" if key == "" else f"{key}."), counts

    def realign(self, gather: Callable[[dict[str, int]], list[dict[str, int]]]) -> None:
        """(Collective over the members, through `gather`, which returns every member's dict.)
        Every count from the highest among the members. Run where no thread names a collective
        of the set meanwhile (a join, every submitter stuck): counts are read by taking them."""
        with self._lock:
            mine = {f"{key}|{kind}": next(counter) for key, counts in self._counts.items()
                    for kind, counter in list(counts.items())}
        everyone = gather(mine)
        with self._lock:
            for entry in {entry for counts in everyone for entry in counts}:
                key, _, kind = entry.rpartition("|")
                self._counts.setdefault(key, {})[kind] = itertools.count(
                    max(c.get(entry, 0) for c in everyone))


def unnamed(name: str) -> Optional[tuple[str, str]]:
    """(kind, the place of the thread that submitted it: '' for the main thread) of an
    automatic name; None for other names."""
    kind, automatic, rest = name.partition(".noname.")
    where, _, k = rest.rpartition(".")
    if automatic and k.isdigit() and ".then." not in rest and (
            where in ("", _UNPLACED) or "#" in where):
        return kind, where
    return None


def threads_named(names: Iterable[str]) -> list[str]:
    """The places of the threads (other than the main one) whose unnamed collectives are
    among `names`, in order."""
    found = (unnamed(name) for name in names)
    return list(dict.fromkeys(where for kind, where in filter(None, found) if where))


def thread_advice(names: Iterable[str]) -> str:
    """A sentence for a report whose pending collectives include unnamed ones of threads other
    than the main one; '' where none is."""
    places = threads_named(names)
    if not places:
        return ""
    return (f" Unnamed collectives pair thread with thread: each is named after its thread's "
            f"place, which is the same on every rank of a program that starts the same threads "
            f"in the same order (here {', '.join(repr(p) for p in places)}; 'worker#1': the "
            "second thread running worker that the main thread started), so ranks that run "
            "such a collective on different threads, or a thread that submits it on some ranks "
            "only, pair nothing: name them (name=...), or give each thread a process set of "
            "its own.")
