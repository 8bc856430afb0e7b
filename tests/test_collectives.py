"""Every collective at 1-4 ranks under a real mpiexec, on both allreduce paths."""
import pytest

from conftest import RANK_COUNTS, run_ok

# "ring": the small-message path switched off and 4 KiB segments, so even tiny buffers go
# around the ring (length < ranks, empty chunks) and large ones are cut into ~100 segments.
PATHS = {"default": {}, "ring": {"RINGREDUCE_SMALL_MESSAGE_BYTES": "0",
                                 "RINGREDUCE_SEGMENT_BYTES": "4096"}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_match_reference(n, path):
    run_ok(n, "collectives_check.py", env=PATHS[path], timeout=240)


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_error_paths(n):
    run_ok(n, "errors_check.py", timeout=120)
