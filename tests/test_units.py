"""Single-process tests of the pure logic: chunking, settings, messages, compression, kernels."""
import numpy as np
import pytest
import torch

import ringreduce as hvd
from ringreduce import config, kernels, negotiation, ring
from ringreduce.buffers import as_array, as_tensor


@pytest.mark.parametrize("length,parts", [(0, 3), (1, 4), (3, 4), (10, 3), (1_000_003, 4)])
def test_balanced_counts_cover_the_buffer(length, parts):
    counts = ring.balanced_counts(length, parts)
    assert sum(counts) == length and len(counts) == parts
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    bounds = ring.chunk_bounds(counts)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_scratch_is_two_segments_or_one_chunk():
    assert ring.scratch_elements(ring.chunk_bounds([10, 10]), 4) == 8
    assert ring.scratch_elements(ring.chunk_bounds([3, 2]), 4) == 3
    assert ring.scratch_elements(ring.chunk_bounds([0, 0]), 4) == 0


def test_settings_keyword_beats_environment(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_FUSION_THRESHOLD", "32M")
    assert config.get("fusion_threshold") == 32 << 20
    assert config.get("fusion_threshold", 1024) == 1024
    monkeypatch.setenv("RINGREDUCE_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="RINGREDUCE_FUSION_THRESHOLD"):
        config.get("fusion_threshold")
    monkeypatch.delenv("RINGREDUCE_FUSION_THRESHOLD")
    assert config.get("fusion_threshold") == config.SETTINGS["fusion_threshold"].default


def test_collectives_before_init_raise_clearly():
    assert not hvd.is_initialized()
    for call in (lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.size(), hvd.barrier,
                 lambda: hvd.broadcast(torch.ones(1), 0)):
        with pytest.raises(hvd.NotInitializedError, match=r"before ringreduce.init\(\)"):
            call()
    assert issubclass(hvd.RingReduceError, RuntimeError)


def test_mismatch_message_names_tensor_field_and_ranks():
    sigs = [{"collective": "allreduce", "name": "w", "shape": (3,)},
            {"collective": "allreduce", "name": "w", "shape": (4,)}]
    text = negotiation.describe_mismatch(sigs)
    assert "'w'" in text and "'shape'" in text and "rank 0: (3,)" in text and "rank 1: (4,)" in text
    assert negotiation.digest(sigs[0]) != negotiation.digest(sigs[1])
    assert negotiation.digest(sigs[0]) == negotiation.digest(dict(reversed(sigs[0].items())))


def test_allreduce_digest_tells_every_field_apart():
    """The C digest of one-tensor allreduces (fast path) is what digest() gives the general
    path for the same signature, and changes with every field."""
    base = {"collective": "allreduce", "name": "w", "op": "Sum", "prescale": 1.0,
            "postscale": 1.0, "dtype": "float32", "shape": (3, 4)}
    if negotiation.allreduce_digest is None:
        pytest.skip("ringreduce._native is not built")
    fast = negotiation.allreduce_digest("w", "Sum", "float32", torch.Size([3, 4]), 1.0, 1.0)
    assert fast == negotiation.digest(base) == negotiation.digest(dict(reversed(base.items())))
    variants = [("name", "w2"), ("name", ""), ("op", "Average"), ("prescale", 2.0),
                ("postscale", 0.5), ("dtype", "float64"), ("shape", (4, 3)), ("shape", (12,)),
                ("shape", (3, 4, 1)), ("shape", ())]
    digests = {negotiation.digest({**base, field: value}) for field, value in variants}
    assert len(digests) == len(variants) and fast not in digests
    # the field boundary counts: name "ab" + op "c" differs from name "a" + op "bc"
    assert negotiation.digest({**base, "name": "ab", "op": "c"}) != \
        negotiation.digest({**base, "name": "a", "op": "bc"})


@pytest.mark.parametrize("compressor,wire", [(hvd.Compression.fp16, torch.float16),
                                             (hvd.Compression.bf16, torch.bfloat16)])
def test_compression_round_trip(compressor, wire):
    x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    sent, ctx = compressor.compress(x)
    assert sent.dtype == wire
    assert torch.equal(compressor.decompress(sent, ctx), x)
    ints = torch.arange(3)
    assert compressor.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(x)[0] is x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int16])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product])
def test_kernels_match_torch(dtype, op):
    a = torch.tensor([1, -2, 3, 4], dtype=dtype)
    b = torch.tensor([2, 2, -1, 0], dtype=dtype)
    want = {hvd.Sum: a + b, hvd.Min: torch.minimum(a, b), hvd.Max: torch.maximum(a, b),
            hvd.Product: a * b}[op]
    target = as_array(a.clone())
    kernels.reducer(dtype, op)(target, as_array(b))
    assert torch.equal(as_tensor(target, dtype), want)


def test_views_share_memory():
    t = torch.zeros(4, dtype=torch.bfloat16)
    view = as_array(t)
    view[0] = 0x3F80  # 1.0 in bfloat16
    assert t[0].item() == 1.0
    assert np.shares_memory(as_array(t), view)


def test_native_extension_is_built_and_loaded():
    assert kernels.NATIVE is not None, "ringreduce._native was not built by pip install"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_sums_equal_torch(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(10_007, generator=g).to(dtype) for _ in range(2))
    out = torch.empty_like(a)
    kernels.combiner(dtype, hvd.Sum)(as_array(a), as_array(b), as_array(out))
    assert torch.equal(out, a + b)
    kernels.combiner(dtype, hvd.Sum)(as_array(a), as_array(b), as_array(a))   # out aliases a
    assert torch.equal(a, out)


def test_fused_last_step_equals_separate_passes_in_float32():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10_007, generator=g), torch.randn(10_007, generator=g)
    out = torch.empty_like(a)
    kernels.finishing_combiner(torch.float32, hvd.Average, 3, 0.5)(
        as_array(a), as_array(b), as_array(out))
    assert torch.equal(out, (a + b) / 3 * 0.5)
    assert kernels.finishing_combiner(torch.int32, hvd.Average, 3, 1.0) is None
    assert kernels.finishing_combiner(torch.float32, hvd.Max, 3, 1.0) is None


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_native_casts_equal_torch(wire):
    x = torch.randn(10_007) * 1000
    assert torch.equal(kernels.cast(x, wire), x.to(wire))
    assert torch.equal(kernels.cast(x.to(wire), torch.float32), x.to(wire).float())
