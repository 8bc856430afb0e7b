"""Unnamed collectives from several threads pair thread with thread (issue 58): the worker
runs each threaded case many times at 2 and 3 ranks, on several data paths."""
import json

import pytest

from conftest import PATHS, shared_script

REPEATS = 10
SETTINGS = {
    2: {"default": {}, "mpi-gather": PATHS["mpi-gather"],
        "2 nodes of 1": {"RINGREDUCE_SIMULATED_NODES": "2"}},
    3: {"default": {}, "mpi-ring": PATHS["mpi-ring"]},
}


@shared_script("unnamed threads", "unnamed_threads_check.py",
               args=lambda n: [str(REPEATS), json.dumps(SETTINGS[n])],
               timeout=lambda n: 60 * len(SETTINGS[n]))
@pytest.mark.parametrize("n", [2, 3])
def test_unnamed_collectives_pair_thread_with_thread(n, shared_run):
    shared_run()
