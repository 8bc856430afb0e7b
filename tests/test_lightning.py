"""The Lightning strategy (ringreduce/lightning.py) under a real mpiexec at 2 ranks; the
cases are in tests/mpi/lightning_check.py, one launch."""
import subprocess
import sys

import pytest

from conftest import run_ok

pytest.importorskip("lightning", reason="the lightning extra is not installed "
                    "(pip install -e '.[lightning]')")

CASES = ("case_collectives", "case_fit_matches_one_process", "case_checkpoint_resume",
         "case_manual_optimization", "case_bf16_mixed")


def test_strategy_at_two_ranks(tmp_path):
    output = run_ok(2, "lightning_check.py", str(tmp_path), timeout=240).output
    for case in CASES:
        for rank in (0, 1):
            assert f"CASE {case} ok rank {rank}" in output, f"{case} on rank {rank}:\n" \
                + output[-3000:]


def test_core_package_leaves_lightning_alone_until_asked():
    probe = ("import sys, ringreduce\n"
             "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
             "for m in sys.modules), 'import ringreduce imported lightning'\n"
             "import ringreduce.lightning\n"
             "from lightning.pytorch.strategies import StrategyRegistry\n"
             "assert 'ringreduce' in StrategyRegistry.available_strategies()\n"
             "print('registered')\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "registered" in result.stdout, result.stderr[-2000:]
