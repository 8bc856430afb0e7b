"""Every collective at 1-4 ranks under a real mpiexec, on every allreduce path and with
simulated nodes, and the error paths: in the launch shared at each rank count
(collectives_check.py names the path that failed), and every kind mixed in one sequence."""
import json

import pytest

from conftest import PATHS, RANK_COUNTS, shared_script

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


ON_EVERY_PATH = shared_script("collectives", "collectives_check.py",
                              args=lambda n: [json.dumps(SETTINGS[n])],
                              timeout=lambda n: 120 * len(SETTINGS[n]))
# (A stall check a second: names given to collectives of different kinds fail after it.)
QUICK_STALL_CHECK = {"RINGREDUCE_STALL_CHECK_TIME": "1"}
ERRORS = shared_script("errors", "errors_check.py", env=QUICK_STALL_CHECK)
# No shared memory anywhere: every exchange between the two nodes is the recursive doubling of
# crossnode.py (small allreduces carry their signature with the data; a joined rank's and a
# mismatched rank's headers-only messages meet them).
ERRORS_ACROSS_NODES = shared_script("errors, 2 nodes of 1", "errors_check.py",
                                    env={**NODES, **QUICK_STALL_CHECK})
JOIN_ACROSS_NODES = shared_script("join, 2 nodes of 1", "join_check.py", env=NODES)
# Every kind in one random sequence, with one rank's orders, threads, sets and mistakes.
MIXED = shared_script("mixed", "mixed_check.py", args=lambda n: ["100"])
MIXED_ACROSS_NODES = shared_script("mixed, 2 nodes of 2", "mixed_check.py",
                                   args=lambda n: ["100", "2"], env=NODES)


@ON_EVERY_PATH
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_match_reference_on_every_path(n, shared_run):
    shared_run()


@ERRORS
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_error_paths(n, shared_run):
    shared_run()


@ERRORS_ACROSS_NODES
@pytest.mark.parametrize("n", [2])
def test_error_paths_with_one_rank_per_simulated_node(n, shared_run):
    shared_run()


@JOIN_ACROSS_NODES
@pytest.mark.parametrize("n", [2])
def test_join_with_one_rank_per_simulated_node(n, shared_run):
    shared_run()


@MIXED
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_mixed_in_one_sequence(n, shared_run):
    shared_run()


@MIXED_ACROSS_NODES
@pytest.mark.parametrize("n", [4])
def test_collectives_mixed_in_one_sequence_across_simulated_nodes(n, shared_run):
    shared_run()
