"""Collectives paired by name (issue 20): out-of-order submissions, threads, duplicates and
failures, on several data paths, at 2 and 3 ranks; and the stall report when no name is
pending on every rank."""
import json
import re

import pytest

from conftest import PATHS, run_mpi, shared_script

SETTINGS = {
    2: {"default": {}, "mpi-gather": PATHS["mpi-gather"],
        "2 nodes of 1": {"RINGREDUCE_SIMULATED_NODES": "2"}},
    3: {"default": {}, "shm-blocks": PATHS["shm-blocks"], "mpi-ring": PATHS["mpi-ring"]},
}


@shared_script("by name", "by_name_check.py", args=lambda n: [json.dumps(SETTINGS[n])],
               timeout=lambda n: 60 * len(SETTINGS[n]))
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_pair_by_name(n, shared_run):
    shared_run()


def test_names_pending_on_some_ranks_only_are_reported_and_shut_down():
    result = run_mpi(3, "by_name_check.py", "stall", timeout=60,
                     env={"RINGREDUCE_STALL_CHECK_TIME": "1",
                          "RINGREDUCE_STALL_SHUTDOWN_TIME": "3"})
    assert result.returncode != 0, "a stall past the shutdown time must end the job"
    pending = re.escape("for the members to submit a collective they all have pending: "
                        "'allreduce.n0' is pending on ranks [0, 2] and not submitted by ranks "
                        "[1]; 'allreduce.n1' is pending on ranks [1, 2] and not submitted by "
                        "ranks [0]")
    for rank in range(3):   # (each rank counts from its own start: a late one may say 2 s)
        assert re.search(rf"rank {rank} has waited \d+ s {pending}", result.output), \
            result.output[-3000:]
    assert "Shutting the job down after 3 s" in result.output, result.output[-3000:]
