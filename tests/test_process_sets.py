"""Process sets under a real mpiexec, and the node protocol in C against its Python oracle."""
import pytest

from conftest import PATHS, run_ok


@pytest.mark.parametrize("n", [2, 3, 4])
def test_process_sets(n):
    run_ok(n, "process_sets_check.py", timeout=240)


@pytest.mark.parametrize("path", ["shm-blocks", "mpi-ring"])
def test_process_sets_on_every_data_path(path):
    run_ok(4, "process_sets_check.py", env=PATHS[path], timeout=240)


@pytest.mark.parametrize("path", ["default", "shm-blocks"])
def test_process_sets_across_two_simulated_nodes(path):
    """Sets {0, 2}, {0, 1, 2} and {1, 2, 3} cross the nodes {0, 1} and {2, 3}."""
    run_ok(4, "process_sets_check.py", env={**PATHS[path], "RINGREDUCE_SIMULATED_NODES": "2"},
           timeout=240)


def test_a_stall_report_names_the_set_and_its_missing_rank():
    result = run_ok(3, "process_sets_check.py", "stall",
                    env={"RINGREDUCE_STALL_CHECK_TIME": "1"}, timeout=90)
    stall = [line for line in result.output.splitlines() if "ringreduce: stall" in line]
    assert any("rank 0 has waited" in line and "allreduce 'set_stall' on process set" in line
               and "(ranks [0, 1]), which ranks [1] have not submitted" in line
               for line in stall), result.output[-3000:]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_node_protocol_in_c_equals_the_python_oracle(n):
    run_ok(n, "node_protocol_check.py", timeout=180,
           env={"RINGREDUCE_SHARED_SMALL_BYTES": "4096", "RINGREDUCE_BLOCK_BYTES": "16384"})
