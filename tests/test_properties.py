"""Hypothesis-driven collectives against NumPy at 1-4 ranks (derandomized: all ranks agree)."""
import pytest

from conftest import RANK_COUNTS, shared_script


@shared_script("properties", "property_check.py", timeout=lambda n: 240)
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_properties(n, shared_run):
    shared_run()
