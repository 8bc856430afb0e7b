"""Every collective at 1-4 ranks under a real mpiexec, on every allreduce path and with
simulated nodes: one launch per rank count runs them all (collectives_check.py names the path
that failed)."""
import json

import pytest

from conftest import PATHS, RANK_COUNTS, run_ok

NODES = {"RINGREDUCE_SIMULATED_NODES": "2"}
SETTINGS = {
    1: {"default": {}},                 # one rank: every path is the same copy
    2: {**PATHS, "2 nodes of 1": NODES},
    3: PATHS,
    4: {**PATHS, "2 nodes of 2": NODES,
        "2 nodes of 2, shm-blocks": {**PATHS["shm-blocks"], **NODES},
        "2 nodes of 2, no shared memory": {**PATHS["mpi-gather"], **NODES},
        "4 nodes of 1 (two rounds)": {"RINGREDUCE_SIMULATED_NODES": "4"}},
}


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_match_reference_on_every_path(n):
    run_ok(n, "collectives_check.py", json.dumps(SETTINGS[n]), timeout=120 * len(SETTINGS[n]))


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_error_paths(n):
    run_ok(n, "errors_check.py", timeout=120)


@pytest.mark.parametrize("script", ["errors_check.py", "join_check.py"])
def test_one_rank_per_simulated_node(script):
    """No shared memory anywhere: every exchange between the two nodes is the recursive
    doubling of crossnode.py (small allreduces carry their signature with the data; a joined
    rank's and a mismatched rank's headers-only messages meet them)."""
    run_ok(2, script, env={"RINGREDUCE_SIMULATED_NODES": "2"}, timeout=120)
