"""Automatic names (single process): each thread's place, the same for every run of a program
that starts the same threads in the same order however they are scheduled, and the names
counted per thread."""
import functools
import threading
import time

import pytest

from ringreduce.core import thread_places
from ringreduce.transport.auto_names import AutoNames, threads_named, unnamed
from ringreduce.core.thread_places import internal, place, fix_place


def fixing(home=0, delay=0.0, places=None):
    """A thread's work: after `delay`, its first collective call on set `home`; its place
    recorded in `places` under its own."""
    def work():
        time.sleep(delay)
        fix_place(home)
        me = threading.current_thread()
        places[me] = place(me)
    return work


def run_all(threads):
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_places_follow_the_start_order_whoever_calls_first():
    places = {}

    def worker(delay):
        fixing(0, delay, places)()

    def logger():
        time.sleep(0.3)     # alive while the workers fix their places, never calls a collective

    idle = threading.Thread(target=logger)      # another function: moves no worker
    late = threading.Thread(target=worker, args=(0.3,))     # started first, calls last
    early = threading.Thread(target=worker, args=(0.0,))
    run_all([idle, late, early])
    prefix = "test_places_follow_the_start_order_whoever_calls_first.worker"
    assert (places[late], places[early]) == (f"{prefix}#0", f"{prefix}#1")
    assert place(idle) is None and place(threading.main_thread()) == ""


def test_threads_that_call_no_collective_and_per_set_homes_count_apart():
    places = {}

    def worker(home):
        if home is not None:
            fixing(home, 0.0, places)()

    threads = [threading.Thread(target=worker, args=(home,)) for home in (1, None, 2, 1, 0)]
    run_all(threads)
    prefix = "test_threads_that_call_no_collective_and_per_set_homes_count_apart.worker"
    assert [places.get(t) for t in threads] == [f"{prefix}@1#0", None, f"{prefix}@2#0",
                                                f"{prefix}@1#1", f"{prefix}#0"]


def test_an_elder_sibling_that_never_calls_is_passed_over_and_marked(monkeypatch):
    monkeypatch.setattr(thread_places, "SIBLING_WAIT_SECONDS", 0.2)
    places, release = {}, threading.Event()

    def worker(calls):
        if calls:
            fixing(0, 0.0, places)()
        else:
            release.wait()

    idle, caller = (threading.Thread(target=worker, args=(c,)) for c in (False, True))
    idle.start()
    caller.start()
    caller.join()
    release.set()
    idle.join()
    assert places[caller].endswith("worker#0?")


def test_a_sibling_starting_while_an_elder_fixes_its_place_keeps_its_own(monkeypatch):
    """The younger thread is held where it has an ident but has not yet said it started
    (is_alive() False) while the elder fixes its place: it is still starting, not ended, so it
    keeps its place in the list and then fixes its own (it once raised ValueError there)."""
    hook = "_set_native_id"     # (CPython: between _set_ident and _started.set())
    if not hasattr(threading.Thread, hook):
        pytest.skip(f"threading.Thread has no {hook} here")
    places, in_window, elder_done = {}, threading.Event(), threading.Event()
    real = getattr(threading.Thread, hook)

    def held(self):
        if self is younger:
            in_window.set()
            assert elder_done.wait(10)
        real(self)

    def worker(first):
        if first:
            assert in_window.wait(10)
            fix_place(0)
            places["elder"] = place(threading.current_thread())
            elder_done.set()
        else:
            fix_place(0)
            places["younger"] = place(threading.current_thread())

    monkeypatch.setattr(threading.Thread, hook, held)
    elder, younger = (threading.Thread(target=worker, args=(f,)) for f in (True, False))
    run_all([elder, younger])
    prefix = "test_a_sibling_starting_while_an_elder_fixes_its_place_keeps_its_own.worker"
    assert places == {"elder": f"{prefix}#0", "younger": f"{prefix}#1"}


def test_below_another_thread_internal_threads_and_what_a_thread_runs():
    places = {}

    def inner():
        fixing(0, 0.0, places)()

    def outer():
        thread = threading.Thread(target=inner)
        thread.start()
        thread.join()
        places["inner"] = places.pop(thread)

    class Poller(threading.Thread):
        def run(self):
            fixing(0, 0.0, places)()

    first = threading.Thread(target=outer)
    run_all([first])
    start_path = first.__dict__["_ringreduce_started"][2]
    assert places["inner"] == start_path + "/" + \
        "test_below_another_thread_internal_threads_and_what_a_thread_runs.inner#0"
    poller = Poller()
    run_all([poller])
    assert "Poller#" in places[poller] and "<locals>" not in places[poller]
    assert thread_places.runs(threading.Thread(target=functools.partial(outer))).endswith(
        ".outer")
    ours = threading.Thread(target=fixing(0, 0.0, places))
    internal(ours)
    run_all([ours])
    assert places[ours] is None


def test_names_count_per_thread():
    names = AutoNames(0)
    assert [names.name("allreduce") for _ in range(2)] == ["allreduce.noname.0",
                                                           "allreduce.noname.1"]
    got = {}

    def worker():
        got["names"] = [names.name("allreduce"), names.name("barrier"), names.name("allreduce")]
        got["place"] = place(threading.current_thread())

    run_all([threading.Thread(target=worker)])
    where = got["place"]
    assert where.endswith("worker#0")
    assert got["names"] == [f"allreduce.noname.{where}.0", f"barrier.noname.{where}.0",
                            f"allreduce.noname.{where}.1"]
    assert names.name("allreduce") == "allreduce.noname.2"      # the main thread's own count
    assert names.in_call_order("dist") == "dist.noname.0"
    assert unnamed(got["names"][1]) == ("barrier", where)
    assert unnamed("allreduce.noname.3") == ("allreduce", "")
    assert unnamed("allreduce.noname.0.3") is None      # a parameter's generated name
    assert unnamed("allreduce.w") is None and unnamed(f"{got['names'][0]}.then.0") is None
    assert threads_named(["allreduce.noname.3", got["names"][0], got["names"][2]]) == [where]


def test_threads_without_a_place_share_one_count():
    names, got = AutoNames(0), []
    for _ in range(2):
        thread = threading.Thread(target=lambda: got.append(names.name("allreduce")))
        internal(thread)
        run_all([thread])
    assert got == ["allreduce.noname.unplaced.0", "allreduce.noname.unplaced.1"]


def test_realign_moves_every_count_to_the_highest():
    names, got = AutoNames(0), {}
    names.name("allreduce")

    def worker():
        names.name("allreduce")
        got["place"] = place(threading.current_thread())

    run_all([threading.Thread(target=worker)])
    theirs = {f"{got['place']}|allreduce": 5, "|barrier": 2}
    names.realign(lambda mine: [mine, theirs])
    assert names.name("allreduce") == "allreduce.noname.1"
    assert names.name("barrier") == "barrier.noname.2"
