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


@pytest.mark.parametrize("script", ["collectives_check.py", "errors_check.py", "join_check.py"])
def test_one_rank_per_simulated_node(script):
    """No shared memory anywhere: every exchange between the two nodes is the recursive
    doubling of crossnode.py (small allreduces carry their signature with the data; a joined
    rank's and a mismatched rank's headers-only messages meet them)."""
    args = ("2",) if script == "join_check.py" else ()
    run_ok(2, script, *args, env={"RINGREDUCE_SIMULATED_NODES": "2"}, timeout=120)


def test_four_simulated_nodes_take_two_rounds():
    run_ok(4, "collectives_check.py", env={"RINGREDUCE_SIMULATED_NODES": "4"}, timeout=180)
