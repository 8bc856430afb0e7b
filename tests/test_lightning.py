"""The Lightning strategy (ringreduce/lightning.py) under a real mpiexec at 2 ranks, with
lightning.pytorch and the standalone pytorch_lightning; the cases are in
tests/mpi/lightning_check.py, in the launch shared at 2 ranks."""
import importlib.util
import subprocess
import sys

import pytest

from conftest import WORKERS, find_mpiexec, shared_script, worker_env

pytest.importorskip("lightning", reason="the lightning extra is not installed "
                    "(pip install -e '.[lightning]')")

CASES = ("case_collectives", "case_fit_matches_one_process", "case_checkpoint_resume",
         "case_manual_optimization", "case_bf16_mixed")
# The standalone package, where it is installed (the test extra installs it).
STANDALONE = importlib.util.find_spec("pytorch_lightning") is not None


@shared_script("lightning strategy", "lightning_check.py", args=lambda n: ["{tmp}"],
               timeout=lambda n: 240)
@pytest.mark.parametrize("n", [2])
def test_strategy_at_two_ranks(n, shared_run):
    output = shared_run().output
    for case in CASES + (("case_pytorch_lightning",) if STANDALONE else ()):
        for rank in (0, 1):
            assert f"CASE {case} ok rank {rank}" in output, f"{case} on rank {rank}:\n" \
                + output[-3000:]


def test_core_package_leaves_lightning_alone_until_asked():
    """Importing ringreduce imports no Lightning; importing ringreduce.lightning registers
    strategy="ringreduce" with each installed package, on that package's base class."""
    pairs = "(one, ringreduce.lightning)" + (", (two, ringreduce.lightning.pl)" if STANDALONE
                                             else "")
    probe = ("import sys, ringreduce\n"
             "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
             "for m in sys.modules), 'import ringreduce imported lightning'\n"
             "import ringreduce.lightning\n"
             "import lightning.pytorch.strategies as one\n"
             + ("import pytorch_lightning.strategies as two\n" if STANDALONE else "")
             + f"for package, classes in ({pairs},):\n"
             "    entry = package.StrategyRegistry['ringreduce']\n"
             "    assert entry['strategy'] is classes.RingReduceStrategy, entry\n"
             "    assert issubclass(classes.RingReduceStrategy, package.ParallelStrategy)\n"
             "print('registered')\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "registered" in result.stdout, result.stderr[-2000:]


LAUNCH = WORKERS / "lightning_launch_check.py"


@pytest.mark.timeout(240)
def test_started_without_mpiexec_it_runs_itself_on_the_devices_asked_for():
    """`python train.py` with Trainer(devices=2): the script runs again on 2 ranks under
    mpiexec, as Lightning's ddp starts its processes, where it trained one process alone."""
    result = subprocess.run([sys.executable, str(LAUNCH), "2", "1"], capture_output=True,
                            text=True, timeout=200, env=worker_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in (0, 1):
        assert f"TRAINED rank {rank} of 2, parameters as rank 0's: True" in output, output
    assert "of 1" not in output and "running this script on 2 ranks" in output


@pytest.mark.timeout(120)
def test_what_it_cannot_start_is_refused_saying_how():
    """Other nodes it cannot start; a launcher that started fewer than asked is an error."""
    for cmd, why in [([sys.executable, str(LAUNCH), "2", "2"],
                      "Trainer(num_nodes=2) was started without an MPI launcher"),
                     ([find_mpiexec(), "-n", "1", sys.executable, str(LAUNCH), "2", "1"],
                      "asks for 2 processes (devices=2, num_nodes=1), but the MPI launcher "
                      "started 1")]:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=100,
                                env=worker_env())
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "LaunchError: ringreduce: " in output \
            and why in output, output[-3000:]
        assert "TRAINED" not in output
