"""The Lightning strategy (ringreduce/lightning.py) under a real mpiexec at 2 ranks, with
lightning.pytorch and the standalone pytorch_lightning; the cases are in
tests/mpi/lightning_check.py, in the launch shared at 2 ranks."""
import importlib.util
import subprocess
import sys

import pytest

from conftest import shared_script

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
