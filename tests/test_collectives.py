"""Every collective at 1-4 ranks under a real mpiexec, on both allreduce paths."""
import pytest

from conftest import RANK_COUNTS, run_ok

# Each data path on its own: shared memory with 16 KiB blocks (many blocks, every parity case),
# and with it switched off the MPI paths: the gather path for small buffers, and the ring with
# 4 KiB segments for everything (length < ranks, empty chunks, ~100 segments per chunk).
PATHS = {
    "default": {},
    "shm-blocks": {"RINGREDUCE_SHARED_SMALL_BYTES": "0", "RINGREDUCE_BLOCK_BYTES": "16384"},
    "mpi-gather": {"RINGREDUCE_SHARED_MEMORY": "0"},
    "mpi-ring": {"RINGREDUCE_SHARED_MEMORY": "0", "RINGREDUCE_SMALL_MESSAGE_BYTES": "0",
                 "RINGREDUCE_SEGMENT_BYTES": "4096"},
}


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
