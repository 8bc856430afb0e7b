"""DistributedOptimizer and the state helpers at 1-4 ranks under a real mpiexec."""
import pytest

from conftest import RANK_COUNTS, run_ok


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_optimizer_matches_single_process_training(n):
    run_ok(n, "optimizer_check.py", timeout=240)


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(n):
    run_ok(n, "sync_bn_check.py", timeout=120)
