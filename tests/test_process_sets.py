"""Process sets under a real mpiexec, and the node protocol in C against its Python oracle."""
import json

import pytest

from conftest import PATHS, shared_script


NODES = {"RINGREDUCE_SIMULATED_NODES": "2"}
# At 4 ranks, one launch also covers the other data paths and two simulated nodes, where the
# sets {0, 2}, {0, 1, 2} and {1, 2, 3} cross the nodes {0, 1} and {2, 3}.
SETTINGS = {2: {"default": {}}, 3: {"default": {}},
            4: {"default": {}, "shm-blocks": PATHS["shm-blocks"], "mpi-ring": PATHS["mpi-ring"],
                "2 nodes of 2": NODES,
                "2 nodes of 2, shm-blocks": {**PATHS["shm-blocks"], **NODES}}}


@shared_script("process sets", "process_sets_check.py", args=lambda n: [json.dumps(SETTINGS[n])],
               timeout=lambda n: 120 * len(SETTINGS[n]))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_process_sets(n, shared_run):
    shared_run()


@shared_script("process sets, stall", "process_sets_check.py", args=lambda n: ["stall"],
               env={"RINGREDUCE_STALL_CHECK_TIME": "1"}, timeout=lambda n: 90)
@pytest.mark.parametrize("n", [3])
def test_a_stall_report_names_the_set_and_its_missing_rank(n, shared_run):
    result = shared_run()
    stall = [line for line in result.output.splitlines() if "ringreduce: stall" in line]
    assert any("rank 0 has waited" in line
               and "allreduce 'allreduce.set_stall' on process set" in line
               and "(ranks [0, 1]), which ranks [1] have not submitted" in line
               for line in stall), result.output[-3000:]


@shared_script("node protocol", "node_protocol_check.py", timeout=lambda n: 180,
               env={"RINGREDUCE_SHARED_SMALL_BYTES": "4096", "RINGREDUCE_BLOCK_BYTES": "16384"})
@pytest.mark.parametrize("n", [2, 3, 4])
def test_node_protocol_in_c_equals_the_python_oracle(n, shared_run):
    shared_run()
