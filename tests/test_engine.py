"""Single-process tests of a set's engine: handles and their names, claims and the queue, the
threads that could still submit, settling the order, done-callbacks and their children."""
import os
import threading
import time
import warnings

import pytest

from ringreduce.sets import engine, lineage
from ringreduce.sets.handles import Finished
from ringreduce.transport import settling


def _no_settling():
    raise AssertionError("a one-rank engine never settles an order")


class _SlowToLetGo(engine.Engine):
    """An engine thread that dawdles between a collective's end and letting go of its name,
    which is when a woken caller may already reuse the name."""

    def _release_name(self, name: str) -> None:
        if threading.current_thread() is self._thread:
            time.sleep(0.05)
        super()._release_name(name)


def test_a_handle_is_done_only_once_its_name_is_free():
    e = _SlowToLetGo("test-engine", 0, lambda: None, _no_settling)
    try:
        for _ in range(3):
            e.submit("same", lambda: 1).wait()
            assert e.run("same", lambda: 2) == 2      # no "still in flight"
    finally:
        e.shutdown()


def test_an_engine_is_stuck_only_while_every_thread_that_submitted_waits_in_it():
    """Engine._stuck, what tells a deadlock of the program from a slow rank: every live
    thread that has submitted to the set waits for one of its collectives still pending."""
    gate, later = threading.Event(), threading.Event()
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)

    def stuck() -> bool:
        with e._cv:
            return e._stuck()

    def until(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.001)

    try:
        assert not stuck()      # nobody has submitted
        waiter = threading.Thread(target=lambda: e.submit("blocked", gate.wait).wait())
        waiter.start()
        until(lambda: e._submitters.waiting)
        assert stuck()          # its one submitter waits for a collective not done
        sleeper = threading.Thread(target=lambda: (e.submit("queued", lambda: 1),
                                                   later.wait()))
        sleeper.start()
        until(lambda: sleeper.ident in e._submitters)
        assert not stuck()      # a submitter that does not wait may submit more
        later.set()
        sleeper.join()
        assert stuck()          # (one that ended will not)
        gate.set()
        waiter.join()
        assert not stuck() and not e._submitters.waiting
    finally:
        gate.set()
        later.set()
        e.shutdown()


def test_a_synchronous_claim_never_overtakes_queued_work():
    """claim_idle() (the small allreduce's inline path) succeeds only when nothing runs and
    nothing is queued: work submitted before it has run by then."""
    order, gate = [], threading.Event()
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        first = e.submit("a", lambda: (gate.wait(), order.append("a")))
        second = e.submit("b", lambda: order.append("b"))
        assert not e.claim_idle()       # "a" runs, "b" waits
        gate.set()
        deadline = time.monotonic() + 30
        while not e.claim_idle():
            assert time.monotonic() < deadline, "the engine never became idle"
        order.append("inline")
        e.release_idle()
        first.wait(), second.wait()
        assert order == ["a", "b", "inline"]
    finally:
        gate.set()
        e.shutdown()


def _thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's /proc")
def test_an_idle_engine_leaves_the_cores_alone():
    """After a submission the engine thread looks for more work only briefly: it once looked
    every 0.2 ms for a second after each, which took ~11% of a core from training (each look
    costs ~20 us), and a training step submits every step. A later submission still runs on
    it."""
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        assert e.submit("first", lambda: 1).wait() == 1
        time.sleep(0.05)
        before = _thread_cpu_seconds(e._thread.native_id)
        time.sleep(1.0)
        used = _thread_cpu_seconds(e._thread.native_id) - before
        assert used < 0.04, f"the idle engine thread used {used * 1000:.0f} ms of CPU in 1 s"
        woken = threading.Event()
        handle = e.submit("later", woken.set)
        assert woken.wait(30), "a submission to a dozing engine did not run"
        handle.wait()
    finally:
        e.shutdown()


class _Parked(engine.Engine):
    """An engine thread that ends at once: queued work stays queued, with the engine free,
    until a waiter runs it (`Handle.wait`). With a live engine thread, whether a claim finds
    queued work or the thread already running it is up to the scheduler."""

    def _loop(self) -> None:
        return


def test_a_name_is_refused_while_a_claim_holds_it():
    """The small allreduce's inline claim takes its name: another thread's submission of the
    same name is refused (ValueError), and a claim of a name that is queued is refused."""
    e = _Parked("parked-engine", 0, lambda: None, _no_settling)
    try:
        assert not e.claim_idle("first")    # a thread's first call takes the general path,
        assert e.run("first", lambda: 2) == 2     # which fixes its place (thread_places)
        assert e.claim_idle("held")
        with pytest.raises(ValueError, match="'held' is still in flight"):
            e.submit("held", lambda: None)
        e.release_idle()
        assert e.run("held", lambda: 3) == 3        # free again after the release
        queued = e.submit("queued", lambda: 4)
        with pytest.raises(ValueError, match="'queued' is still in flight"):
            e.claim_idle("queued")
        assert not e.claim_idle("other")            # work is queued: no overtaking it
        assert queued.wait() == 4                   # the waiter runs the queue
        assert e.claim_idle("queued")               # and the name is free again
        e.release_idle()
    finally:
        e.shutdown()


def test_a_raising_callback_ends_its_collectives_children_for_the_others():
    """children_end marks, on the engine of the collective, the first child its callbacks
    did not start (the newest marks only); a member whose first pending name is such a
    child of another member's mark fails it, whatever the nesting, and nobody else does."""
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        handle = e.submit("dist.noname.7", lambda: 1)
        handle.wait()
        with lineage.children_of(handle):
            assert lineage.child_name() == "dist.noname.7.then.0"
        lineage.children_end(handle, ValueError("bad"))
        lineage.children_end(handle, RuntimeError("then() of the chain after it"))
        assert e.ended == {"dist.noname.7": (1, "ValueError: bad")}
        for k in range(lineage.EndedMarks.KEPT + 1):
            lineage.children_end(Finished(f"x.{k}", None, None, e), KeyError(k))
        assert len(e.ended) == lineage.EndedMarks.KEPT and "dist.noname.7" not in e.ended
        lineage.children_end(Finished("no engine", None, None), ValueError())  # nothing
    finally:
        e.shutdown()
    marks = [("a", {}), ("b", {"dist.noname.7": (1, "ValueError: bad")}), ("c", {})]
    ended_by = settling._ended_by
    assert ended_by(0, "dist.noname.7.then.1", marks) == (1, "dist.noname.7", "ValueError: bad")
    assert ended_by(0, "dist.noname.7.then.5", marks) is not None
    assert ended_by(0, "dist.noname.7.then.0", marks) is None       # started before it raised
    assert ended_by(1, "dist.noname.7.then.1", marks) is None       # its own mark
    assert ended_by(2, "dist.noname.70.then.1", marks) is None
    assert ended_by(2, "dist.noname.7", marks) is None
    assert ended_by(2, None, marks) is None
    nested = [("a", {}), ("b", {"dist.noname.7.then.0": (0, "E: x")})]
    assert ended_by(0, "dist.noname.7.then.0.then.0", nested) == (1, "dist.noname.7.then.0",
                                                                  "E: x")


def test_settling_runs_the_agreed_names_first_and_requeues_the_rest():
    """A collective that meets OutOfOrder is run again only after the names the agreement
    returns (other threads' queued ones too), in its order; the rest keep submission order."""
    order, rounds = [], []

    def agreement():
        def agree(names, ended, stuck):
            rounds.append(list(names))
            return [] if len(rounds) == 1 else ["c", "b"]     # nothing common at first
        return agree

    gate, meets = threading.Event(), iter([True])
    e = engine.Engine("test-engine", 0, lambda: None, agreement)
    try:
        def first():
            if next(meets, False):
                raise engine.OutOfOrder()
            order.append("a")

        blocker = e.submit("blocker", gate.wait)
        handles = [e.submit(name, work) for name, work in
                   (("a", first), ("b", lambda: order.append("b")),
                    ("c", lambda: order.append("c")), ("d", lambda: order.append("d")))]
        gate.set()
        blocker.wait()
        for h in handles:
            h.wait()
        assert order == ["c", "b", "a", "d"], order
        assert rounds[0][0] == "a" and set(rounds[1]) == {"a", "b", "c", "d"}, rounds
    finally:
        gate.set()
        e.shutdown()


def test_done_callbacks_run_once_and_a_waiter_gets_the_result():
    """add_done_callback runs each callback once, after the result is set (at once when the
    handle is done already); wait() returns it whichever thread ran the work."""
    seen, gate, all_called = [], threading.Event(), threading.Event()

    def note(h):
        seen.append((h.name, h.wait()))
        if len(seen) == 5:
            all_called.set()

    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        blocker = e.submit("blocker", gate.wait)
        handles = [e.submit(f"h{i}", lambda i=i: i * i) for i in range(5)]
        for h in handles:
            h.add_done_callback(note)
        gate.set()
        blocker.wait()
        assert [h.wait() for h in handles] == [0, 1, 4, 9, 16]
        # (a callback runs after its handle is done, when the engine thread lets go)
        assert all_called.wait(30), f"only {seen} were called back"
        handles[0].add_done_callback(lambda h: seen.append(("late", h.wait())))
        assert sorted(seen) == sorted([(f"h{i}", i * i) for i in range(5)] + [("late", 0)])
        assert all(h.done() for h in handles)
    finally:
        gate.set()
        e.shutdown()


def test_a_done_callback_may_start_work_and_block_until_it_is_done():
    """A torch future's then() callback runs after the engine thread finished a collective,
    and may start another and block until it is done without running the queue itself
    (torch's Future.wait(), as DDP's PowerSGD hook does): a new engine thread takes over the
    queue, and the old one ends after its callbacks. A callback that raises is reported, and
    the engine goes on."""
    gate, inner_done, got = threading.Event(), threading.Event(), []
    e = engine.Engine("callback-engine", 0, lambda: None, _no_settling)
    try:
        blocker = e.submit("blocker", gate.wait)    # "first" then runs on the engine thread

        def start_and_block(handle):
            inner = e.submit("inner", lambda: 2)
            inner.add_done_callback(lambda _: inner_done.set())
            if inner_done.wait(10):                 # blocks, as torch's Future.wait() does
                got.append((threading.current_thread().name, inner.wait()))

        first = e.submit("first", lambda: 1)
        first.add_done_callback(lambda handle: 1 / 0)
        first.add_done_callback(start_and_block)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gate.set()                  # (no wait() here: a waiter would run the queue)
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
        assert got == [("callback-engine", 2)], "the callback's collective never ran"
        assert blocker.wait() and first.wait() == 1
        assert any("'first' raised ZeroDivisionError" in str(w.message) for w in caught)
        assert e.submit("after", lambda: 3).wait() == 3
        deadline = time.monotonic() + 30
        while sum(t.name == "callback-engine" for t in threading.enumerate()) > 1:
            assert time.monotonic() < deadline, "the old engine thread did not end"
            time.sleep(0.01)
    finally:
        gate.set()
        e.shutdown()
