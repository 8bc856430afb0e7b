"""Hypothesis-driven collectives against NumPy at 1-4 ranks (derandomized: all ranks agree)."""
import pytest

from conftest import RANK_COUNTS, run_ok


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_properties(n):
    run_ok(n, "property_check.py", timeout=240)
