"""A name stays taken until the collective is done on every member (issue 56): Horovod's
duplicate-name test for every asynchronous collective, repeated at 2 and 3 ranks."""
import pytest

from conftest import shared_script


@shared_script("duplicate names", "duplicate_names_check.py", args=lambda n: ["30"],
               timeout=lambda n: 90)
@pytest.mark.parametrize("n", [2, 3])
def test_a_duplicate_name_is_refused_until_the_first_is_done_everywhere(n, shared_run):
    shared_run()
