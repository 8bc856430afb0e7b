"""Every collective at 1-4 ranks under a real mpiexec, on both allreduce paths."""
import pytest

from conftest import PATHS, RANK_COUNTS, run_ok


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_match_reference(n, path):
    run_ok(n, "collectives_check.py", env=PATHS[path], timeout=240)


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_error_paths(n):
    run_ok(n, "errors_check.py", timeout=120)


@pytest.mark.parametrize("path", ["default", "shm-blocks"])
def test_two_simulated_nodes_use_shared_memory_and_the_ring_between_them(path):
    run_ok(4, "collectives_check.py", env={**PATHS[path], "RINGREDUCE_SIMULATED_NODES": "2"},
           timeout=240)
