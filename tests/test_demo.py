"""The README's main job, shortened: it learns, and every rank ends with the same parameters."""
import re
from pathlib import Path

import pytest

from conftest import run_mpi

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_digits.py"


@pytest.mark.parametrize("n", [2, 3])
def test_digits_demo_trains_and_stays_identical(n, tmp_path):
    result = run_mpi(n, str(SCRIPT), "--epochs", "4", "--batch-size", "48", timeout=180)
    assert result.returncode == 0, result.output[-4000:]
    assert f"parameters bitwise identical on all {n} ranks: yes" in result.output
    dist = float(re.search(r"distributed \(\d ranks\): held-out accuracy ([\d.]+)",
                           result.output).group(1))
    single = float(re.search(r"single process \(reference\): held-out accuracy ([\d.]+)",
                             result.output).group(1))
    assert dist > 0.85 and abs(dist - single) < 0.02, (dist, single)
