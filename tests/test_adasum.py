"""Adasum (ringreduce/transport/adasum.py): the support check here; under a real mpiexec, the reduction
against a NumPy reference of Horovod's tree, and the refusal of other rank counts (a
sub-communicator of 3 at 4 ranks; through hvd.allreduce at 3 ranks in errors_check.py)."""
import pytest
import torch

from conftest import shared_script
from ringreduce.transport import adasum
from ringreduce.core.errors import HorovodInternalError


@shared_script("adasum", "adasum_check.py")
@pytest.mark.parametrize("n", [1, 2, 4])
def test_adasum_matches_horovods_tree_and_is_identical_on_every_rank(n, shared_run):
    shared_run()


@pytest.mark.parametrize("size", [1, 2, 4, 8, 1024])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_powers_of_two_and_floats_are_supported(size, dtype):
    assert adasum.why_unsupported(size, dtype) is None
    adasum.check_supported(size, dtype)


@pytest.mark.parametrize("size", [0, 3, 5, 6, 12])
def test_other_rank_counts_raise_horovods_not_implemented_error(size):
    assert f"has {size}" in adasum.why_unsupported(size, torch.float32)
    with pytest.raises(NotImplementedError, match=f"power-of-two number of ranks.* has {size}$"):
        adasum.check_supported(size, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.int8, torch.int32,
                                   torch.int64])
def test_other_dtypes_raise_horovods_internal_error(dtype):
    name = str(dtype).removeprefix("torch.")
    assert adasum.why_unsupported(2, dtype).endswith(f"not {name}")
    with pytest.raises(HorovodInternalError, match=f"float16, float32 and float64 .*not {name}"):
        adasum.check_supported(4, dtype)


def test_rank_count_is_checked_before_dtype_as_horovod_does():
    with pytest.raises(NotImplementedError):
        adasum.check_supported(3, torch.int32)


def test_weights_follow_horovods_formula_and_threshold():
    assert adasum.weight(0.0, 5.0) == 1.0                  # orthogonal: a plain sum
    assert adasum.weight(4.0, 4.0) == 0.5                  # parallel and equal: an average
    assert adasum.weight(3.0, 0.0) == 1.0                  # zero vector: weight 1
    assert adasum.weight(1e-160, 1e-155) == 1.0     # squared norm under sqrt(DBL_MIN): weight 1
    assert adasum.weight(2e-154, 2e-154) == 0.5     # just over sqrt(DBL_MIN) (1.49e-154)
    assert adasum.weight(1e-11, 1e-11) == 0.5       # small gradients still weigh
