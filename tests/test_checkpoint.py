"""Checkpoints survive crashes: mid-write (SIGKILL, exception) and a killed training run that
resumes to the bitwise-same result as an uninterrupted one."""
import glob
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_mpi, worker_env
from ringreduce.checkpoint import write_atomically

DEMO = str(Path(__file__).parents[1] / "scripts" / "train_digits.py")


def test_sigkill_during_write_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck.pt")
    write_atomically(path, {"version": 1, "w": torch.arange(4)})
    writer = subprocess.Popen([sys.executable, "-c", (
        "import torch; from ringreduce.checkpoint import write_atomically; "
        f"write_atomically({path!r}, {{'version': 2, 'w': torch.ones(100_000_000)}})")])
    deadline = time.monotonic() + 60
    while not any(os.path.getsize(f) > 0 for f in glob.glob(path + ".tmp-*")):
        assert writer.poll() is None, "the writer finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    state = torch.load(path, weights_only=True)
    assert state["version"] == 1 and torch.equal(state["w"], torch.arange(4))
    write_atomically(path, {"version": 3})          # a later save clears the leftover
    assert not glob.glob(path + ".tmp-*")
    assert torch.load(path, weights_only=True)["version"] == 3


def test_failed_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    write_atomically(path, {"version": 1})

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, {"version": 2})
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["version"] == 1
    assert not glob.glob(path + ".tmp-*")


def final_digest(output):
    return re.search(r"parameters bitwise identical on all \d ranks: yes \(sha256 (\w+)\)",
                     output).group(1)


def test_killed_run_resumes_to_the_same_parameters(tmp_path):
    """Killed twice at different moments (a seeded random delay after a checkpoint, a random
    rank): once in its first run, then again once its resumed run has written a checkpoint of
    its own; resumed to the end, it has the parameters of the run never killed."""
    args = ["--epochs", "8", "--checkpoint-every", "3", "--no-reference"]
    clean = run_mpi(2, DEMO, *args, "--checkpoint-dir", str(tmp_path / "clean"), timeout=180)
    assert clean.returncode == 0, clean.output[-3000:]
    want = final_digest(clean.output)
    ckdir = tmp_path / "killed"
    assert "resumed from" not in kill_after_a_checkpoint(args, ckdir, seed=1)
    assert "resumed from" in kill_after_a_checkpoint(args, ckdir, seed=2)   # (rank 0 flushes)
    resumed = run_mpi(2, DEMO, *args, "--checkpoint-dir", str(ckdir), timeout=180)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.output
    assert final_digest(resumed.output) == want


def kill_after_a_checkpoint(args, ckdir, seed):
    """Start the run in `ckdir`, SIGKILL one of its ranks a random moment after it wrote a
    checkpoint (a new file over any checkpoint from before); returns its output."""
    checkpoint = ckdir / "checkpoint.pt"
    before = checkpoint.stat().st_ino if checkpoint.exists() else None
    env = worker_env()
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    job = subprocess.Popen([mpiexec, "-n", "2", sys.executable, DEMO, *args, "--checkpoint-dir",
                            str(ckdir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=env, start_new_session=True, text=True)
    try:
        deadline = time.monotonic() + 120
        while not checkpoint.exists() or checkpoint.stat().st_ino == before:
            assert job.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.01)
        time.sleep(random.Random(seed).uniform(0.0, 1.0))
        ranks = subprocess.run(["pgrep", "-f", f"train_digits.py .*{ckdir}"], capture_output=True,
                               text=True).stdout.split()
        ranks = [pid for pid in ranks if int(pid) != job.pid]
        assert ranks and job.poll() is None, "the run ended before it could be killed"
        os.kill(int(random.Random(seed).choice(ranks)), signal.SIGKILL)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode != 0, f"seed {seed}: the killed job exited 0"
    return output
