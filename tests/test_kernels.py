"""Single-process tests of the kernels layer: zero-copy views, the C extension, every op and
dtype bit for bit against torch, Horovod's scaling, the casts and the streaming copy."""
import zlib

import numpy as np
import pytest
import torch

import ringreduce as hvd
from ringreduce import _native
from ringreduce.kernels import ops as kernels
from ringreduce.kernels.buffers import CODES, as_array


def test_views_share_memory():
    t = torch.zeros(4, dtype=torch.bfloat16)
    view = as_array(t)
    view[0] = 0x3F80  # 1.0 in bfloat16
    assert t[0].item() == 1.0
    assert np.shares_memory(as_array(t), view)


def test_native_extension_is_built_and_loaded():
    assert _native.OP_SUM == hvd.Sum and _native.F32 == 7, "constants.h and ReduceOp disagree"


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]


def assert_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit, or for floats the same NaN positions and equal values elsewhere (NaN
    payloads may differ)."""
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) or \
        (dtype.is_floating_point and torch.equal(got.isnan(), want.isnan())
         and torch.equal(got[~got.isnan()], want[~want.isnan()]))


def horovod_scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x times `factor` as Horovod's ScaleBufferCPUImpl computes it: float64 and integers in
    float64 (integers truncated toward zero), float32 and the 16-bit floats times the factor
    cast to float32, rounded once."""
    if not x.dtype.is_floating_point:
        return (x.double() * factor).to(torch.int64).to(x.dtype)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(compute) * torch.tensor(factor, dtype=torch.float64).to(compute)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product])
def test_every_kernel_equals_torch_bit_for_bit(dtype, op):
    """Random values (NaN and infinities among the floats), 10,007 elements: the vector loops
    and their scalar tails; out aliasing a."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {op}".encode()) % 1000)
    if dtype.is_floating_point:
        a, b = (torch.randn(10_007, generator=g) * 100 for _ in range(2))
        a[::97], b[::89], a[::101] = float("nan"), float("inf"), -float("inf")
        a, b = a.to(dtype), b.to(dtype)
    else:
        info = torch.iinfo(dtype)
        a, b = (torch.randint(info.min, info.max, (10_007,), generator=g, dtype=dtype)
                for _ in range(2))
    fn = {hvd.Sum: torch.add, hvd.Min: torch.minimum, hvd.Max: torch.maximum,
          hvd.Product: torch.mul}[op]
    want = fn(a, b)
    out = torch.empty_like(a)
    kernels.reducer(dtype, op)(as_array(out), as_array(b), as_array(a))    # out = a op b
    assert_same(out, want, dtype)
    kernels.reducer(dtype, op)(as_array(a), as_array(b))                 # a = a op b
    assert_same(a, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finish_scales_by_one_factor_as_horovod(dtype):
    """Average's postscale / size in float64, one multiply (not a division, then a multiply):
    5 / 3 and 5 * float32(1 / 3) differ in the last bit."""
    x = torch.arange(-50, 50).to(dtype)
    post = 0.7 if dtype.is_floating_point else 1.0
    got = x.clone()
    kernels.finish(as_array(got), dtype, 3.0, post)
    assert torch.equal(got, horovod_scaled(x, post / 3))
    if dtype in (torch.float32, torch.float64):
        assert not torch.equal(got, x / 3 * post)      # (the division, then the multiply)
    ints = torch.tensor([-7, -1, 0, 5, 7], dtype=torch.int32)
    kernels.finish(as_array(ints), torch.int32, 1.0, 0.5)   # scaled in float64, truncated
    assert ints.tolist() == [-3, 0, 0, 2, 3]
    big = torch.tensor([2 ** 62 + 1], dtype=torch.int64)
    kernels.finish(as_array(big), torch.int64, 3.0, 3.0)    # factor 1: untouched, as Horovod
    assert big.item() == 2 ** 62 + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_last_step_equals_sum_then_horovods_scaling(dtype):
    """The fused kernels round the sum to the dtype, then scale it as finish does (the 16-bit
    floats round twice, as Horovod's sum and then its scaling pass)."""
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(10_007, generator=g) * 100).to(dtype)
    b = (torch.randn(10_007, generator=g) * 100).to(dtype)
    out = torch.empty_like(a)
    _native.combine(CODES[dtype], hvd.Average, a.data_ptr(), b.data_ptr(), out.data_ptr(),
                    a.numel(), True, 3.0, 0.5)
    assert_same(out, horovod_scaled(a + b, 0.5 / 3), dtype)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_native_casts_equal_torch(wire):
    edges = torch.tensor([0.0, 1e-7, 65519.0, 65520.0, 1e6, float("inf"), 6.1e-5, 5.96e-8,
                          2.98e-8, 3e-8, 1e-40])     # overflow, subnormals, ties, underflow
    x = torch.cat([torch.randn(10_007) * 1000, edges, -edges])
    assert torch.equal(kernels.cast(x, wire), x.to(wire))
    assert torch.equal(kernels.cast(x.to(wire), torch.float32), x.to(wire).float())


@pytest.mark.parametrize("nbytes", [0, 31, _native.STREAM_MIN - 1, _native.STREAM_MIN,
                                    _native.STREAM_MIN + 129, 3 << 20])
@pytest.mark.parametrize("offset", [0, 1, 17, 32])
def test_streaming_copy_equals_memcpy(nbytes, offset):
    """Below, at and above the streaming threshold, from every destination alignment: the
    bytes land exactly, and nothing outside the range is touched."""
    source = np.random.default_rng(nbytes + offset).integers(0, 256, nbytes + 64, np.uint8)
    target = np.full(nbytes + 128, 7, np.uint8)
    kernels.copy_stream(target.ctypes.data + offset, source.ctypes.data + 3, nbytes)
    assert np.array_equal(target[offset:offset + nbytes], source[3:3 + nbytes])
    assert (target[:offset] == 7).all() and (target[offset + nbytes:] == 7).all()


def test_kernels_refuse_an_unknown_dtype_or_op_and_leave_the_output_alone():
    """combine, finish and cast (kernels.py's reducer and finish) name what they
    cannot reduce; Adasum is no elementwise op."""
    a, b = np.arange(8, dtype=np.float32), np.ones(8, dtype=np.float32)
    out = np.full(8, 7, dtype=np.float32)
    for dtype, op, what in [(42, hvd.Sum, "unknown dtype code 42"),
                            (_native.F32, 9, "unknown reduction op 9"),
                            (_native.F16, -1, "unknown reduction op -1"),
                            (_native.I32, hvd.Adasum, r"reduction op 2 \(Adasum\) has no el")]:
        with pytest.raises(ValueError, match=f"^ringreduce: combine: {what}"):
            _native.combine(dtype, op, a.ctypes.data, b.ctypes.data, out.ctypes.data, 8, True,
                            2.0, 1.0)
    assert (out == 7).all()
    with pytest.raises(ValueError, match="^ringreduce: combine: unknown reduction op 9"):
        kernels.reducer(torch.float32, 9)(out, b, a)
    with pytest.raises(ValueError, match="^ringreduce: combine: unknown reduction op 9"):
        kernels.reducer(torch.float32, 9)(out, b)
    assert (out == 7).all()
    for divisor in (1.0, 2.0):      # the no-op finish checks the dtype too
        with pytest.raises(ValueError, match="^ringreduce: finish: unknown dtype code 42"):
            _native.finish(42, out.ctypes.data, 8, divisor, 1.0)
    with pytest.raises(ValueError, match="^ringreduce: cast: no cast from dtype code 7 to 3"):
        _native.cast(_native.F32, _native.I32, a.ctypes.data, out.ctypes.data, 8)
    assert (out == 7).all()
