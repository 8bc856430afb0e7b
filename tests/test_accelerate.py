"""Hugging Face Accelerate's default Accelerator() trains on ringreduce's default group at 2
and 3 ranks (issue 56), where each rank trained alone."""
import pytest

from conftest import shared_script

pytest.importorskip("accelerate", reason="accelerate is not installed (the test extra has it)")


@shared_script("accelerate", "accelerate_check.py", timeout=lambda n: 120)
@pytest.mark.parametrize("n", [2, 3])
def test_a_default_accelerator_trains_on_the_group(n, shared_run):
    shared_run()
