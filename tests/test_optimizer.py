"""DistributedOptimizer, the state helpers and SyncBatchNorm at 1-4 ranks under a real mpiexec."""
import pytest

from conftest import RANK_COUNTS, run_ok


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_optimizer_and_sync_batch_norm_match_single_process_training(n):
    """One launch: DistributedOptimizer's checks, then SyncBatchNorm's (a failure names its
    check and rank, and the checks after it still run)."""
    run_ok(n, "optimizer_check.py", timeout=300)
