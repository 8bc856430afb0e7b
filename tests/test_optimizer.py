"""DistributedOptimizer, the state helpers and SyncBatchNorm at 1-4 ranks under a real mpiexec."""
import pytest

from conftest import RANK_COUNTS, shared_script



@shared_script("optimizer", "optimizer_check.py", timeout=lambda n: 300)
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_optimizer_and_sync_batch_norm_match_single_process_training(n, shared_run):
    """DistributedOptimizer's checks, then SyncBatchNorm's (a failure names its check and
    rank, and the checks after it still run)."""
    shared_run()
