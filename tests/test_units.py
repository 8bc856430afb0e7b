"""Single-process tests of the pure logic above the transport: settings, the optimizer's
groups, calls before init(), compression, failed futures, send/recv's header."""
import dataclasses
import pickle

import pytest
import torch

import ringreduce as hvd
from ringreduce.core import config
from ringreduce.distributed import failed_future, point_to_point
from ringreduce.optim import fusion, wrapped_optimizer


@pytest.mark.parametrize("count, groups, lengths", [(6, 4, [2, 2, 1, 1]), (7, 3, [3, 2, 2]),
                                                     (3, 5, [1, 1, 1]), (4, 1, [4])])
def test_integer_groups_are_cut_as_horovods_split_list(count, groups, lengths):
    """(Horovod's DistributedOptimizer cuts its parameters with split_list: lengths that differ
    by at most one, longer first; no empty group.)"""
    named = [(f"p{i}", torch.zeros(1)) for i in range(count)]
    cut = wrapped_optimizer.explicit_groups(groups, named)
    assert [len(g) for g in cut] == lengths
    assert [p for g in cut for p in g] == [p for _, p in named]


def test_settings_keyword_beats_environment(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_FUSION_THRESHOLD", "32M")
    assert config.Settings.load().fusion_threshold == 32 << 20
    assert config.Settings.load(fusion_threshold=1024).fusion_threshold == 1024
    for bad in ("lots", "inf", "nan"):      # (inf was an OverflowError naming nothing)
        monkeypatch.setenv("RINGREDUCE_FUSION_THRESHOLD", bad)
        with pytest.raises(ValueError, match="RINGREDUCE_FUSION_THRESHOLD: expected a byte "
                                             "count"):
            config.Settings.load()
    monkeypatch.delenv("RINGREDUCE_FUSION_THRESHOLD")
    assert config.Settings.load().fusion_threshold == config.Settings().fusion_threshold
    with pytest.raises(TypeError, match="fusion_treshold"):
        config.Settings.load(fusion_treshold=1)
    # a keyword given as the environment spells it reads as the environment does ("0" for
    # cuda_aware was true: bool("0"))
    assert [config.Settings.load(cuda_aware=v).cuda_aware for v in ("0", "1", "auto")] == \
        [False, True, "auto"]
    assert config.Settings.load(fusion_threshold="16M").fusion_threshold == 16 << 20
    with pytest.raises(ValueError, match="init\\(fusion_threshold=\\)"):
        config.Settings.load(fusion_threshold="lots")


_NUMERIC = [f.name for f in dataclasses.fields(config.Settings)
            if f.type in ("int", "float", int, float)]


@pytest.mark.parametrize("name", _NUMERIC)
def test_every_numeric_setting_is_range_checked(monkeypatch, name):
    """Below its range (and above, where it has a top), from the environment or init()'s
    keyword: ValueError naming the variable and the accepted range. A time setting takes 0
    (off), or 1 s or more: 1e-300 would report a stall thousands of times a second."""
    field = next(f for f in dataclasses.fields(config.Settings) if f.name == name)
    low, high = field.metadata["accepted"]
    variable = config.Settings.env_name(name)
    below = [low / 2, 1e-300] if field.metadata["off"] else [low - 1]
    for bad in below + ([high + 1] if high != float("inf") else []):
        text = repr(bad) if isinstance(bad, float) else str(int(bad))
        monkeypatch.setenv(variable, text)
        with pytest.raises(ValueError, match=f"{variable}={text} is out of range: expected"):
            config.Settings.load()
        monkeypatch.delenv(variable)
        with pytest.raises(ValueError, match=f"init\\({name}=.*{variable}.*expected"):
            config.Settings.load(**{name: bad})
    monkeypatch.setenv(variable, str(int(low)))
    assert getattr(config.Settings.load(), name) == low
    if field.metadata["off"]:
        monkeypatch.setenv(variable, "0")
        assert getattr(config.Settings.load(), name) == 0
        assert "0 (off), or a number >= 1" in str(pytest.raises(
            ValueError, config.Settings.load, **{name: 0.5}).value)


def test_a_blank_or_directory_path_is_refused(monkeypatch):
    for bad, why in [(" ", "a blank path"), ("\t", "a blank path"), ("runs/", "a directory")]:
        monkeypatch.setenv("RINGREDUCE_TIMELINE", bad)
        with pytest.raises(ValueError, match=f"RINGREDUCE_TIMELINE: {why}"):
            config.Settings.load()
        monkeypatch.delenv("RINGREDUCE_TIMELINE")
        with pytest.raises(ValueError, match=f"init\\(timeline=\\): {why}"):
            config.Settings.load(timeline=bad)
    monkeypatch.setenv("RINGREDUCE_TIMELINE", "")
    assert config.Settings.load().timeline == ""
    assert config.Settings.load(timeline="t.json").timeline == "t.json"


def test_collectives_before_init_raise_clearly():
    assert not hvd.is_initialized()
    for call in (lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.size(), hvd.barrier,
                 lambda: hvd.broadcast(torch.ones(1), 0)):
        with pytest.raises(hvd.NotInitializedError, match=r"before ringreduce.init\(\)"):
            call()
    assert issubclass(hvd.RingReduceError, RuntimeError)


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




def test_a_failed_future_raises_its_error_wherever_it_is_read():
    """Python's wait() and value() raise the error itself, a callback chained by torch's own
    then() fails with it, and the value C++ readers get (DDP's reducer pickles it for its
    tensors, or formats it casting a hook's result) raises it too."""
    error = hvd.MismatchError("ringreduce: ranks disagree on 'x'")
    future = torch.futures.Future()
    chained = future.then(lambda f: f.value())
    failed_future.fail(future, error)
    for read in (future.wait, future.value):
        with pytest.raises(hvd.MismatchError, match="ranks disagree on 'x'"):
            read()
    with pytest.raises(RuntimeError, match="MismatchError: ringreduce: ranks disagree"):
        chained.wait()
    failure = failed_future.Failure(error)
    for read in (pickle.dumps, str):
        with pytest.raises(hvd.MismatchError, match="ranks disagree on 'x'"):
            read(failure)
    assert "MismatchError" in repr(failure)


def test_a_send_header_names_every_torch_dtype_apart():
    """send/recv's header (point_to_point._HEADER) holds the dtype's name in 24 bytes: every
    dtype torch has reads back whole and distinct, with the count and the bytes beside it,
    and a header fits only a tensor of its count and dtype."""
    dtypes = {getattr(torch, name) for name in dir(torch)
              if isinstance(getattr(torch, name), torch.dtype)}
    assert len({point_to_point._name(d) for d in dtypes}) == len(dtypes)
    for dtype in dtypes:
        header = point_to_point._HEADER.unpack(
            point_to_point._HEADER.pack(3, 12, point_to_point._name(dtype)))
        name = str(dtype).removeprefix("torch.")
        assert point_to_point._described(header) == f"3 {name} elements (12 bytes)"
    tensor = torch.zeros(2, 3, dtype=torch.float8_e4m3fnuz)
    header = point_to_point._HEADER.unpack(point_to_point._header(tensor))
    assert point_to_point._described(header) == "6 float8_e4m3fnuz elements (6 bytes)"
    assert point_to_point._fits(header, torch.empty(3, 2, dtype=torch.float8_e4m3fnuz))
    assert not point_to_point._fits(header, torch.empty(6, dtype=torch.uint8))
    assert not point_to_point._fits(header, torch.empty(5, dtype=torch.float8_e4m3fnuz))


def test_a_large_gradient_is_reduced_alone_where_it_lies():
    """fusion.plan: a gradient of ALONE_BYTES or more has a bucket of its own, without a
    buffer, between fused buckets of small ones; not where it would not be reduced where it
    lies (compressed to another dtype, not contiguous, or no direct buckets wanted)."""
    large = fusion.ALONE_BYTES // 4
    params = [("a", torch.zeros(3)), ("big", torch.zeros(large)), ("b", torch.zeros(5)),
              ("c", torch.zeros(7)), ("wide", torch.zeros(2, large).t()), ("d", torch.zeros(2))]
    buckets = fusion.plan(params, threshold=16 << 20, first_bucket=1 << 10)
    assert [(b.names, b.direct) for b in buckets] == [
        (["d"], True), (["wide", "c", "b"], False), (["big"], True), (["a"], True)]
    assert buckets[2].buffer.numel() == 0 and buckets[2].views == []
    half = fusion.plan(params, 16 << 20, 1 << 10, wire_dtype=lambda dtype: torch.float16)
    assert ["big"] not in [b.names for b in half]
    buffered = fusion.plan(params, 16 << 20, 1 << 10, direct=False)
    assert ["big"] not in [b.names for b in buffered] and not any(b.direct for b in buffered)
