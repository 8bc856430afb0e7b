"""The README's main job, shortened: it learns, and every rank ends with the same parameters."""
import json
import re
from pathlib import Path

import pytest

from conftest import run_mpi

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_digits.py"


@pytest.mark.parametrize("n", [2, 3])
def test_digits_demo_trains_and_stays_identical(n, tmp_path):
    """...with ringreduce's own warnings as errors (every one of its messages starts with
    'ringreduce'): the demo follows the README's order, and none is raised."""
    result = run_mpi(n, str(SCRIPT), "--epochs", "4", "--batch-size", "48", timeout=180,
                     env={"PYTHONWARNINGS": "error:ringreduce"})
    assert result.returncode == 0, result.output[-4000:]
    assert not re.search(r"Warning: ringreduce", result.output), result.output[-4000:]
    assert f"parameters bitwise identical on all {n} ranks: yes" in result.output
    dist = float(re.search(r"distributed \(\d ranks\): held-out accuracy ([\d.]+)",
                           result.output).group(1))
    single = float(re.search(r"single process \(reference\): held-out accuracy ([\d.]+)",
                             result.output).group(1))
    assert dist > 0.85 and abs(dist - single) < 0.02, (dist, single)


def test_allreduce_benchmark_reports_its_yardsticks_and_profile(tmp_path):
    """A tiny bench_allreduce.py run: every method and copy row, ratios against the copy
    yardstick consistent with the bandwidths, and the per-phase profile of the node path."""
    out = tmp_path / "bench.json"
    script = Path(__file__).parents[1] / "scripts" / "bench_allreduce.py"
    result = run_mpi(2, str(script), "--sizes", "4K,1M", "--dtypes", "float32", "--iters",
                     "3", "--no-gloo", "--profile", "--json", str(out), timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    data = json.loads(out.read_text())
    kinds = {(c["copy"], c["where"]) for c in data["copies"]}
    assert kinds == {("memcpy", "rank 0"), ("memcpy", "every rank"), ("stream", "rank 0"),
                     ("stream", "every rank"), ("copy_", "rank 0")}
    for r in data["results"]:
        if r["busbw_GBps"] is None:
            continue
        copies = [c for c in data["copies"] if c["size_bytes"] == r["size_bytes"]
                  and c["copy"] != "copy_" and c["where"] == "every rank"]
        best = max(c["bw_GBps"] for c in copies)
        assert abs(r["busbw_over_copy"] - r["busbw_GBps"] / best) < 1e-9
    (profile,) = data["profiles"]
    assert profile["size_bytes"] == 1 << 20
    assert set(profile["phases"]) == {"copy_in", "wait_in", "reduce", "publish", "wait_out",
                                      "copy_out"}
    spent = sum(p["time_s"] for p in profile["phases"].values())
    assert 0 < spent <= profile["time_s"] * 1.01, (spent, profile["time_s"])
    assert all(p["time_s"] > 0 for k, p in profile["phases"].items() if not k.startswith("wait"))
    written = profile["blocks_written"]
    assert set(written) == {"plain", "streamed"} and sum(written.values()) == 3, written


def test_latency_profile_times_every_layer():
    """A tiny profile_latency.py run: a line per layer, each with both timings (a layer whose
    call no longer fits the backend's contract fails it, as the synchronous call once did)."""
    script = Path(__file__).parents[1] / "scripts" / "profile_latency.py"
    result = run_mpi(2, str(script), "--calls", "5", timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    timed = re.findall(r"^(.+?)\s+([\d.]+)\s+([\d.]+)$", result.output, re.M)
    assert len(timed) == 16 and timed[-1][0] == "torch's floor: synchronous, no backend", \
        result.output[-4000:]


def test_training_benchmark_reports_every_method_in_sync_with_its_memory_pass(tmp_path):
    """A tiny bench_train.py run: each method's repetitions, its memory pass, its ratios, and
    parameters in sync across the ranks for every method that communicates."""
    out = tmp_path / "train.json"
    script = Path(__file__).parents[1] / "scripts" / "bench_train.py"
    result = run_mpi(2, str(script), "--models", "mlp10m", "--methods",
                     "none,ringreduce,ddp_rr_view,ddp_rr,ddp", "--steps", "1", "--reps", "3",
                     "--warmup", "1", "--batch", "4", "--json", str(out), timeout=180)
    assert result.returncode == 0, result.output[-4000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["none", "ringreduce", "ddp_rr_view", "ddp_rr", "ddp"]
    assert rows["ringreduce"]["schedule"].endswith("(still choosing)")   # (4 steps: too few)
    for method, r in rows.items():
        assert len(r["rep_times_s"]) == 3 and r["time_s"] in r["rep_times_s"], r
        assert r["params_in_sync"] is (None if method == "none" else True), r
        assert len(r["peak_rss_increase_mib_per_rank"]) == 2, r
        assert r["vs_ringreduce"] == r["samples_per_s"] / rows["ringreduce"]["samples_per_s"]
