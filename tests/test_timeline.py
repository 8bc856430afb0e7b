"""The timeline: per-rank Chrome-trace files from a real mpiexec run, and the report script."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_ok
from ringreduce.core import timeline

RANKS = 2
STEPS = 4
REPORT = Path(__file__).parents[1] / "scripts" / "timeline_report.py"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """One 2-rank run: 4 steps under RINGREDUCE_TIMELINE, then runtime start/stop."""
    out = tmp_path_factory.mktemp("timeline")
    run_ok(RANKS, "timeline_check.py", str(out), timeout=180,
           env={"RINGREDUCE_TIMELINE": str(out / "trace.json")})
    return out


def spans(events, cat, name):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["ph"] == "X" and e.get("cat") == cat and e["name"] == name)


def test_every_rank_writes_a_valid_file_with_every_bucket_phase_in_order(traces):
    for r in range(RANKS):
        events = json.loads((traces / f"trace.rank{r}.json").read_text())["traceEvents"]
        assert all(e["pid"] == r for e in events)
        assert any(e["name"] == "process_name" and e["args"]["name"] == f"rank {r}"
                   for e in events)
        buckets = {e["cat"] for e in events if e.get("cat", "").startswith("bucket.")}
        assert len(buckets) >= 3, buckets
        for b in buckets:
            details = [e["args"] for e in events if e.get("cat") == b]
            assert all(d["parameters"] and d["bytes"] > 0 for d in details), (b, details[:1])
            pack, reduce, unpack = (spans(events, b, p) for p in ("pack", "allreduce", "unpack"))
            assert len(pack) == len(reduce) == STEPS, (b, pack, reduce)
            if details[0]["in_place"]:  # one parameter, reduced in its .grad: nothing to unpack
                assert not unpack and len(details[0]["parameters"]) == 1, (b, details[0])
                unpack = [(a[1], a[1]) for a in reduce]
            assert len(unpack) == STEPS, (b, unpack)
            for p, a, u in zip(pack, reduce, unpack):
                assert p[0] <= p[1] <= a[0] <= a[1] <= u[0] <= u[1], (b, p, a, u)
            assert len(spans(events, b, "waiting for gradients")) == STEPS
            ready = [e for e in events if e.get("cat") == b and e["name"] == "gradients ready"]
            assert len(ready) == STEPS


def test_runtime_timeline_and_the_one_left_open_at_exit(traces):
    for r in range(RANKS):
        assert (traces / f"runtime_{r}.json").exists()          # {rank} in the path
        events = json.loads((traces / f"at_exit.rank{r}.json").read_text())["traceEvents"]
        assert spans(events, "bucket.0", "allreduce"), "the last step's events were not flushed"


def test_report_prints_overlap_and_draws(traces, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    result = subprocess.run([sys.executable, str(REPORT), str(traces / "trace.rank*.json"),
                             "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for r in range(RANKS):
        assert f"rank {r} step {STEPS - 1}: backward" in result.stdout, result.stdout
        assert f"rank {r} all steps: " in result.stdout and "% of " in result.stdout
    assert png.stat().st_size > 10_000


def test_horovods_dynamic_timeline_writes_no_file_at_init(tmp_path):
    """HOROVOD_TIMELINE=DYNAMIC is Horovod's switch for start_timeline() later, not a path."""
    run_ok(1, "topology_check.py", timeout=60, env={"HOROVOD_TIMELINE": "DYNAMIC"},
           cwd=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_rank_paths_never_collide():
    assert timeline.rank_path("out/t.json", 0) == "out/t.rank0.json"
    assert timeline.rank_path("out/t", 3) == "out/t.rank3"
    assert timeline.rank_path("out/{rank}/t.json", 2) == "out/2/t.json"


def test_a_killed_process_leaves_valid_json(tmp_path):
    """Every flush rewrites the closing bracket, so SIGKILL right after one loses nothing."""
    path = tmp_path / "killed.json"
    code = (f"import os, signal, time\nfrom ringreduce.core import timeline\n"
            f"timeline.FLUSH_SECONDS = 0\nt = timeline.Timeline({str(path)!r}, 0)\n"
            "t.instant('x', 'submitted')\nt.span('x', 'allreduce', time.perf_counter(), "
            "time.perf_counter())\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    events = json.loads(path.read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] != "M"] == ["submitted", "allreduce"]
