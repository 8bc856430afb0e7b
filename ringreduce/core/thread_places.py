"""Which thread this is, in terms that every rank of a symmetric program shares: its place.

Ranks that run the same program start the same threads in the same order, whatever the
scheduler does, so a thread is told apart by where it stands in the tree of threads started
with `threading`: its parent, what it runs, and how many threads running that its parent
started before it. `Thread.start` is wrapped once, at import (as tracing and error-reporting
libraries do), to note that.

A thread's place is fixed when it first calls a collective (`fix_place`, on its home set: the
set of that first call): 'worker#1' is the second thread running `worker` among those the main
thread started that call collectives first on the global set, 'worker@3#0' the first of those
whose home is set 3, and
'worker#1/poll#0' a thread running `poll` that 'worker#1' started ('/' follows the start
order above the last step). Counting per home set keeps a thread per process set right where
ranks belong to different sets; counting only threads that call collectives keeps a thread
started on some ranks only that calls none (a logger) from moving any other. To count so, a
thread's first call waits until each thread started before it by its parent, running the same
function, has made its own first call or ended. One still doing neither after
`SIBLING_WAIT_SECONDS` is passed over, and the place is marked '?' ('worker#0?'): ranks that
passed over different threads then give different names, which never pair.

The unnamed collectives of the Horovod-style API are numbered per thread under its place
(auto_names.py). The main thread's place is ''; a thread started before ringreduce was
imported, by C++ (autograd's device threads), or by ringreduce itself (`internal`) has none
(None)."""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Optional, Union

SIBLING_WAIT_SECONDS = 5.0
_POLL_SECONDS = 0.01        # (a sibling's end wakes no one: its waiters look this often)
_STARTED = "_ringreduce_started"    # set by the start: (its _Family, what it runs, the path
_CHILDREN = "_ringreduce_children"  # of its start order); a parent's _Family per function
_PLACE = "_ringreduce_place"        # set when fixed: its place ...
_HOME = "_ringreduce_home"          # ... and its home set
_LAUNCHED = "_ringreduce_launched"  # set once its start() returned (see _pending)
_FIXING = threading.Condition()
_fixed = threading.local()          # .done on a thread whose place is fixed
log = logging.getLogger("ringreduce")


def runs(thread: threading.Thread) -> str:
    """What a thread runs, as its place names it: its target's qualified name (a function
    defined inside another loses the '<locals>.'), or its class's where the class has its own
    run()."""
    target = thread.__dict__.get("_target")
    if type(thread).run is not threading.Thread.run or target is None:
        what: Any = type(thread)
    else:
        what = getattr(target, "func", target)      # (a functools.partial: what it calls)
    name = getattr(what, "__qualname__", None) or type(what).__qualname__
    return name.replace("<locals>.", "")


def _path(thread: threading.Thread) -> Optional[str]:
    """Where `thread` stands in the start order: '' for the main thread, 'worker#1/poll#0'."""
    if thread is threading.main_thread():
        return ""
    started = thread.__dict__.get(_STARTED)
    return None if started is None else started[2]


def internal(thread: threading.Thread) -> None:
    """Before starting one of ringreduce's own threads: it takes no place and waits for none."""
    thread.__dict__[_STARTED] = None


class _Family:
    """The threads a parent started that run one function, in start order. Those at the front
    that have fixed their place or ended are only counted, per home, so that a program
    starting a thread per task keeps a short list."""

    __slots__ = ("started", "counted", "rest")

    def __init__(self) -> None:
        self.started = 0
        self.counted: dict[Union[int, str], int] = {}
        self.rest: list[threading.Thread] = []

    def elder(self, thread: threading.Thread) -> list[threading.Thread]:
        return self.rest[:self.rest.index(thread)]

    def index(self, elder: list[threading.Thread], home: Union[int, str]) -> int:
        """How many elder threads have `home` as their home."""
        return self.counted.get(home, 0) + sum(1 for t in elder if t.__dict__.get(_HOME) == home)

    def collapse(self) -> None:
        while self.rest and not _pending(self.rest[0]):
            home = self.rest.pop(0).__dict__.get(_HOME)
            if home is not None:
                self.counted[home] = self.counted.get(home, 0) + 1


def _pending(thread: threading.Thread) -> bool:
    """Place not fixed yet, and not ended. Until its start() returns a thread is pending:
    is_alive() is False there too, from before the thread runs until it says it started (its
    ident already set), and such a thread taken for ended left the list early."""
    if _HOME in thread.__dict__:
        return False
    return not thread.__dict__.get(_LAUNCHED) or thread.is_alive()


def _placed(start: Any) -> Any:
    @functools.wraps(start)
    def placing_start(self: threading.Thread) -> None:
        if _STARTED in self.__dict__:
            return start(self)
        parent = threading.current_thread()
        what = runs(self)
        with _FIXING:
            family = parent.__dict__.setdefault(_CHILDREN, {}).setdefault(what, _Family())
            family.rest.append(self)
            k, family.started = family.started, family.started + 1
        above = _path(parent)
        path = None if above is None else (f"{above}/" if above else "") + f"{what}#{k}"
        self.__dict__[_STARTED] = (family, what, path)
        try:
            start(self)
        except BaseException:
            with _FIXING:
                family.rest.remove(self)
                _FIXING.notify_all()
            raise
        self.__dict__[_LAUNCHED] = True

    placing_start.ringreduce_places = True      # (wrapped once, whatever imports it again)
    return placing_start


if not getattr(threading.Thread.start, "ringreduce_places", False):
    threading.Thread.start = _placed(threading.Thread.start)


def place(thread: threading.Thread) -> Optional[str]:
    """`thread`'s fixed place: '' for the main thread, None where it has none or has not
    fixed it yet."""
    if thread is threading.main_thread():
        return ""
    return thread.__dict__.get(_PLACE)


def takes_part() -> bool:
    """Whether the calling thread has called a collective or is one of ringreduce's own
    (`internal`): other ranks may be waiting for it."""
    return (getattr(_fixed, "done", False)
            or threading.current_thread().__dict__.get(_STARTED, ()) is None)


def fix_place(home: Union[int, str]) -> None:
    """On the calling thread, at its first collective call on each set (engine.py; a thread
    whose place is fixed returns at once): the first one fixes its place, `home` being the
    set's id (see the module). It may wait for the thread's elder siblings
    (`SIBLING_WAIT_SECONDS` at most)."""
    try:
        _fixed.done
        return
    except AttributeError:
        _fixed.done = True
    me = threading.current_thread()
    started = me.__dict__.get(_STARTED)
    if started is None:     # the main thread, or one without a place
        return
    family, what, path = started
    with _FIXING:
        elder = family.elder(me)
        deadline = time.monotonic() + SIBLING_WAIT_SECONDS
        passed_over = [t for t in elder if _pending(t)]
        while passed_over and time.monotonic() < deadline:
            _FIXING.wait(_POLL_SECONDS)
            elder = family.elder(me)
            passed_over = [t for t in elder if _pending(t)]
        index = family.index(elder, home)
        above = path.rpartition("/")[0] if path else None
        mine = (f"{above}/" if above else "") + what + ("" if home == 0 else f"@{home}") + \
            f"#{index}" + ("?" if passed_over else "")
        if path is not None:
            me.__dict__[_PLACE] = mine
        me.__dict__[_HOME] = home
        family.collapse()
        _FIXING.notify_all()
    if passed_over:
        log.warning("ringreduce: thread %r called its first collective after waiting %g s "
                    "for threads started before it running the same function to call theirs "
                    "or end, which %s did not: its place is %r (its unnamed collectives are "
                    "named after it), which pairs only with a thread that passed over the "
                    "same threads on every rank; name its collectives where that differs",
                    mine, SIBLING_WAIT_SECONDS, [_path(s) for s in passed_over], mine)


