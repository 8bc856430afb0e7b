"""A per-rank timeline of every collective's phases, as a Chrome-trace / Perfetto JSON file, and
the one place where collectives report their phases (`record`, `span`).

`RINGREDUCE_TIMELINE=path.json` (or `init(timeline=...)`, or `start_timeline(path)` at runtime)
makes each rank write its own file: `{rank}` in the path is replaced by the rank, else rank r
writes `path` with `.rank<r>` before the extension, so ranks never share a file. Open one in
https://ui.perfetto.dev (or chrome://tracing); `scripts/timeline_report.py` merges them.

The file is `{"traceEvents": [...]}`: "X" (complete) events for spans, "i" events for instants,
pid = rank, one lane (tid) per collective name (unnamed collectives share one lane per kind),
"M" events naming the process "rank N" and each lane. Timestamps are microseconds of wall-clock
time (perf_counter anchored once to time.time()), so files of different ranks line up.

Recording only appends a tuple to a list under a lock: it is cheap and safe from the engine
thread and the training thread at once. The thread that records flushes the list to disk every
`FLUSH_EVENTS` events or `FLUSH_SECONDS` seconds, and every flush leaves a complete JSON file
(the events are written over the previous closing `]}`, which is written again after them).
A killed process therefore loses at most its last unflushed second of events; if it dies in the
middle of a flush the file ends in a truncated event, which Perfetto still loads (its JSON
importer reads events one by one and ignores an incomplete tail) and which the report script
skips. `stop_timeline()`, `shutdown()` and exit flush everything.

Besides the file, `events` can be set to a list that collects every instant (tests read it).
"""
from __future__ import annotations

import json
import os
import re
import contextlib
import threading
import time
from typing import Any, ContextManager, Iterator, Optional

FLUSH_EVENTS = 1000
FLUSH_SECONDS = 1.0
_CLOSER = b"\n]}\n"
_UNNAMED = re.compile(r"^(.*)\.noname\.(.*\.)?\d+$")

# What the timeline shows with a collective's events, by name: a bucket's parameter names and
# size. A module-level table (not per Timeline) so it survives timelines started and stopped at
# runtime; DistributedOptimizer fills it in when it submits a bucket while a timeline runs.
_details: dict[str, dict] = {}


def describe(name: str, **details: Any) -> None:
    """Attach `details` (JSON-able: e.g. parameters=[...], bytes=N) to the events of `name`."""
    _details[name] = details


# Horovod's HOROVOD_TIMELINE=DYNAMIC: no file at init(), only start_timeline() later.
DYNAMIC = "DYNAMIC"


def rank_path(path: str, rank: int) -> str:
    """`{rank}` in `path` replaced by the rank, else `.rank<r>` inserted before the extension."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class Timeline:
    """Writes one rank's events to `path`."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._offset = time.time() - time.perf_counter()   # perf_counter -> wall clock
        self._lock = threading.Lock()
        self._lanes: dict[str, int] = {}
        self._pending: list[tuple] = []
        self._last_flush = time.perf_counter()
        self._file: Any = open(path, "wb")
        header = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        self._file.write(b'{"traceEvents": [\n' + ",\n".join(map(json.dumps, header)).encode())
        self._end = self._file.tell()        # where the next events go, over the closer
        self._file.write(_CLOSER)
        self._file.flush()

    def instant(self, name: str, phase: str) -> None:
        now = time.perf_counter()
        self._add(("i", name, phase, now, now, _details.get(name)), now)

    def span(self, name: str, phase: str, start: float, end: float) -> None:
        self._add(("X", name, phase, start, end, _details.get(name)), end)

    def close(self) -> None:
        """Flush and close; later events are dropped (a thread may still hold this object)."""
        with self._lock:
            if self._file is None:
                return
            self._flush()
            self._file.close()
            self._file = None

    def _add(self, event: tuple, now: float) -> None:
        with self._lock:
            if self._file is None:
                return
            self._pending.append(event)
            if len(self._pending) >= FLUSH_EVENTS or now - self._last_flush >= FLUSH_SECONDS:
                self._flush()

    def _flush(self) -> None:
        """Write the pending events over the closing bracket, then the bracket again (lock held)."""
        self._last_flush = time.perf_counter()
        if not self._pending:
            return
        lines = [json.dumps(e) for event in self._pending for e in self._chrome(*event)]
        self._pending.clear()
        data = (",\n" + ",\n".join(lines)).encode()
        self._file.seek(self._end)
        self._file.write(data + _CLOSER)     # one write: the closer follows the events at once
        self._file.flush()
        self._end += len(data)

    def _chrome(self, ph: str, name: str, phase: str, start: float, end: float,
                details: Optional[dict]) -> list[dict]:
        """One Chrome trace event (after an "M" event naming its lane, the first time)."""
        out = []
        lane_name = _UNNAMED.sub(r"\1 (unnamed)", name)
        tid = self._lanes.get(lane_name)
        if tid is None:
            tid = self._lanes[lane_name] = len(self._lanes) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"name": lane_name}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"sort_index": tid}})
        event = {"name": phase, "cat": name, "ph": ph,
                 "ts": round((start + self._offset) * 1e6, 3)}
        if ph == "X":
            event["dur"] = round(max(0.0, end - start) * 1e6, 3)
        else:
            event["s"] = "t"
        event.update(pid=self.rank, tid=tid, args={"collective": name, **(details or {})})
        out.append(event)
        return out


_current: Optional[Timeline] = None
events: Optional[list[tuple[float, str, str]]] = None   # set to a list to collect instants


def record(name: str, phase: str) -> None:
    """Note an instant in a collective's life; free when nobody listens."""
    if events is not None:
        events.append((time.perf_counter(), name, phase))
    timeline = _current    # read once: another thread may stop the timeline
    if timeline is not None:
        timeline.instant(name, phase)


_NOTHING = contextlib.nullcontext()


def span(name: str, phase: str) -> ContextManager[None]:
    """Time a phase of a collective (pack, allreduce, unpack ...) while a timeline runs; with
    none running, a shared do-nothing context (this is on every bucket's path)."""
    timeline = _current
    return _NOTHING if timeline is None else _timed(timeline, name, phase)


@contextlib.contextmanager
def _timed(timeline: Any, name: str, phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timeline.span(name, phase, start, time.perf_counter())


def add_span(name: str, phase: str, start: float, end: float) -> None:
    """A span measured by the caller (from `start` to `end`, perf_counter seconds)."""
    timeline = _current
    if timeline is not None:
        timeline.span(name, phase, start, end)


def running() -> bool:
    return _current is not None


def start(path: str, rank: int) -> None:
    """Write this rank's timeline to `rank_path(path, rank)` from now on (a running one is
    stopped first)."""
    global _current
    stop()
    _current = Timeline(rank_path(path, rank), rank)


def stop() -> None:
    """Stop and close the running timeline, if any."""
    global _current
    timeline, _current = _current, None
    if timeline is not None:
        timeline.close()
