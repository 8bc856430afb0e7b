"""Horovod 0.28's behaviours that change numbers (broadcast_optimizer_state's procedure, a
DistributedOptimizer outside its process set, reducescatter's gradient, sparse gradients and
sparse_allreduce_async, alltoall's float splits, parameter names), at 2 and 3 ranks, each case
against a reference that applies Horovod's procedure in one process."""
import pytest

from conftest import shared_script


@shared_script("horovod parity", "horovod_parity_check.py", timeout=lambda n: 90)
@pytest.mark.parametrize("n", (2, 3))
def test_numbers_match_horovods_procedures(n, shared_run):
    shared_run()
