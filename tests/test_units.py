"""Single-process tests of the pure logic: chunking, settings, messages, compression, kernels,
the engine's ordering."""
import ctypes
import dataclasses
import os
import pickle
import threading
import time
import warnings
import zlib

import numpy as np
import pytest
import torch

import ringreduce as hvd
from ringreduce import _native
from ringreduce.core import config
from ringreduce.distributed import failed_future, point_to_point
from ringreduce.kernels import ops as kernels
from ringreduce.optim import wrapped_optimizer
from ringreduce.sets import engine, lineage
from ringreduce.sets.handles import Finished
from ringreduce.transport import crossnode, negotiation, ring, signature
from ringreduce.transport.departures import Departures
from ringreduce.kernels.buffers import CODES, as_array
from ringreduce.core.mpi import mpi


@pytest.mark.parametrize("length,parts", [(0, 3), (1, 4), (3, 4), (10, 3), (1_000_003, 4)])
def test_balanced_counts_cover_the_buffer(length, parts):
    counts = ring.balanced_counts(length, parts)
    assert sum(counts) == length and len(counts) == parts
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    bounds = ring.chunk_bounds(counts)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("count, groups, lengths", [(6, 4, [2, 2, 1, 1]), (7, 3, [3, 2, 2]),
                                                     (3, 5, [1, 1, 1]), (4, 1, [4])])
def test_integer_groups_are_cut_as_horovods_split_list(count, groups, lengths):
    """(Horovod's DistributedOptimizer cuts its parameters with split_list: lengths that differ
    by at most one, longer first; no empty group.)"""
    named = [(f"p{i}", torch.zeros(1)) for i in range(count)]
    cut = wrapped_optimizer.explicit_groups(groups, named)
    assert [len(g) for g in cut] == lengths
    assert [p for g in cut for p in g] == [p for _, p in named]


def test_scratch_is_two_segments_or_one_chunk():
    assert ring.scratch_elements(ring.chunk_bounds([10, 10]), 4) == 8
    assert ring.scratch_elements(ring.chunk_bounds([3, 2]), 4) == 3
    assert ring.scratch_elements(ring.chunk_bounds([0, 0]), 4) == 0


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
    keyword: ValueError naming the variable and the accepted range."""
    low, high = dataclasses.fields(config.Settings)[
        [f.name for f in dataclasses.fields(config.Settings)].index(name)].metadata["accepted"]
    variable = config.Settings.env_name(name)
    for bad in [low - 1] + ([high + 1] if high != float("inf") else []):
        monkeypatch.setenv(variable, str(int(bad)))
        with pytest.raises(ValueError, match=f"{variable}={int(bad)} is out of range: expected"):
            config.Settings.load()
        monkeypatch.delenv(variable)
        with pytest.raises(ValueError, match=f"init\\({name}=.*{variable}.*expected"):
            config.Settings.load(**{name: bad})
    monkeypatch.setenv(variable, str(int(low)))
    assert getattr(config.Settings.load(), name) == low


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
    text = signature.describe_mismatch(sigs, [0, 2])
    assert "'w'" in text and "'shape'" in text and "rank 0: (3,)" in text and "rank 2: (4,)" in text
    assert signature.digest(sigs[0]) != signature.digest(sigs[1])
    assert signature.digest(sigs[0]) == signature.digest(dict(reversed(sigs[0].items())))


def test_allreduce_signature_digest_is_the_c_digest_of_every_field():
    """A one-tensor allreduce's signature (the one place its fields are listed) digests in C,
    the small way's digest, and each of its fields changes that digest; a CUDA tensor's and a
    rooted one's go by the general digest of their fields."""
    base = signature.AllreduceSignature("w", "Sum", "float32", torch.Size([3, 4]))
    fast = _native.allreduce_digest("w", "Sum", "float32", torch.Size([3, 4]), 1.0, 1.0)
    assert base.digest() == fast == signature.AllreduceSignature.c_digest(
        "w", "Sum", "float32", (3, 4), 1.0, 1.0)
    listed = base.fields()
    assert set(listed) == {"collective", "name", "op", "prescale", "postscale", "dtype", "shape"}
    variants = [("name", "w2"), ("name", ""), ("op", "Average"), ("prescale", 2.0),
                ("postscale", 0.5), ("dtype", "float64"), ("shape", (4, 3)), ("shape", (12,)),
                ("shape", (3, 4, 1)), ("shape", ())]
    assert {field for field, _ in variants} == set(listed) - {"collective"}
    arguments = ("name", "op", "dtype", "shape", "prescale", "postscale")

    def changed(field, value):
        values = {a: getattr(base, a) for a in arguments}
        return signature.AllreduceSignature(**{**values, field: value}).digest()

    digests = {changed(field, value) for field, value in variants}
    assert len(digests) == len(variants) and fast not in digests
    # the field boundary counts: name "ab" + op "c" differs from name "a" + op "bc"
    assert changed("name", "ab") != changed("name", "a")
    ab = signature.AllreduceSignature("ab", "c", "float32", (3,)).digest()
    assert ab != signature.AllreduceSignature("a", "bc", "float32", (3,)).digest()
    cuda = signature.AllreduceSignature("w", "Sum", "float32", (3, 4), cuda=True)
    assert cuda.fields()["device"] == "cuda" and cuda.digest() == signature.digest(cuda.fields())
    rooted = signature.AllreduceSignature("w", "Sum", "float32", (3, 4), root=1).fields()
    assert rooted["collective"] == "reduce" and rooted["root_rank"] == 1


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


def test_native_exchange_talks_to_mpi_and_reports_its_errors():
    """native/p2p.c, bound to the MPI that mpi4py loaded: a message to ourselves arrives
    whole, and an MPI failure (a rank the communicator lacks) is an error with MPI's text."""
    MPI = mpi()
    crossnode._bind_native_mpi(MPI)
    comm = MPI.COMM_SELF.Dup()
    state = np.zeros(_native.EXCHANGE_BYTES, dtype=np.uint8)
    sent, received = np.arange(40, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    try:
        got = _mpi_exchange(state.ctypes.data, MPI._handleof(comm), 0, 3,
                            sent.ctypes.data, 40, received.ctypes.data, 64, 0.01)
        assert got == 40 and (received[:40] == sent).all() and not received[40:].any()
        # a negative spin posts, tests once and returns pending even when done (crossnode's
        # out-of-place allreduce allocates its result meanwhile); polling then finds the
        # bytes, whether they had arrived already or not
        received[:] = 0
        assert _mpi_exchange(state.ctypes.data, MPI._handleof(comm), 0, 3,
                             sent.ctypes.data, 40, received.ctypes.data, 64,
                             -1.0) == _native.PENDING
        while (got := _native.mpi_test(state.ctypes.data)) == _native.PENDING:
            pass
        assert got == 40 and (received[:40] == sent).all()
        with pytest.raises(RuntimeError, match="MPI_Irecv failed .*[Ii]nvalid rank"):
            _mpi_exchange(state.ctypes.data, MPI._handleof(comm), 5, 3,
                          sent.ctypes.data, 40, received.ctypes.data, 64, 0.01)
    finally:
        comm.Free()


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


def _two_local_ranks(small_bytes=4096, block_bytes=4096):
    """Two ranks' node windows in this one process (plain memory for the shared segments):
    the node protocol, stepped by hand from one thread."""
    slot, block, segment = _native.node_layout(small_bytes, block_bytes)
    segments = [np.zeros(segment, dtype=np.uint8) for _ in range(2)]
    bases = [s.ctypes.data for s in segments]
    return segments, [_native.node_attach(me, bases, slot, block) for me in range(2)]


def test_the_node_protocol_refuses_what_it_cannot_reduce_before_publishing():
    """large_begin refuses an unknown dtype or op (or Adasum) before raising any flag, and
    large_run then refuses to run (no stale job runs unreduced); small_end refuses with dst
    untouched. The same two ranks then reduce correctly, and large_run's outcomes are the ones
    it names (LARGE_DONE, LARGE_WAITING, LARGE_BETWEEN_NODES, LARGE_MISMATCH), each its own."""
    segments, nodes = _two_local_ranks()
    flags = [s[:8].view(np.int64) for s in segments]
    x = [np.arange(3000, dtype=np.float32) * (r + 1) for r in range(2)]     # three blocks
    out = [np.zeros_like(v) for v in x]

    def begin(r, dtype=_native.F32, op=hvd.Sum, digest=5, between_nodes=False):
        _native.large_begin(nodes[r], x[r].ctypes.data, out[r].ctypes.data, x[r].size, dtype,
                            op, 1.0, 1.0, digest, between_nodes)

    def run_both(expect):
        results = [None, None]
        for _ in range(50):
            for r in range(2):
                if results[r] is None:
                    status = _native.large_run(nodes[r], -1.0)
                    assert status in (_native.LARGE_WAITING, expect), status
                    results[r] = None if status == _native.LARGE_WAITING else status
            if None not in results:
                return
        raise AssertionError(f"stuck: {results}")

    try:
        for me, bases in [(2, [1, 2]), (0, [1]), (1, [1, 0])]:
            with pytest.raises(ValueError, match="^ringreduce: node_attach: local rank"):
                _native.node_attach(me, bases, 4096, 4096)
        with pytest.raises(RuntimeError, match="^ringreduce: large_run: no large allreduce"):
            _native.large_run(nodes[0], -1.0)
        for dtype, op, what in [(42, hvd.Sum, "unknown dtype code 42"),
                                (_native.F32, 9, "unknown reduction op 9"),
                                (_native.F64, hvd.Adasum, r"reduction op 2 \(Adasum\)")]:
            with pytest.raises(ValueError, match=f"^ringreduce: large_begin: {what}"):
                begin(0, dtype, op)
            with pytest.raises(RuntimeError, match="^ringreduce: large_run: no large allreduce"):
                _native.large_run(nodes[0], -1.0)
        assert flags[0][0] == 0 and flags[1][0] == 0 and not out[0].any()
        assert len({_native.LARGE_DONE, _native.LARGE_WAITING, _native.LARGE_BETWEEN_NODES,
                    _native.LARGE_MISMATCH}) == 4
        begin(0), begin(1)
        run_both(_native.LARGE_DONE)
        assert all(np.array_equal(o, x[0] + x[1]) for o in out)
        begin(0, between_nodes=True), begin(1, between_nodes=True)
        run_both(_native.LARGE_BETWEEN_NODES)   # our chunk reduced: the ring between nodes next
        begin(0, digest=5), begin(1, digest=6)
        run_both(_native.LARGE_MISMATCH)

        small = [np.arange(100, dtype=np.int32) * (r + 1) for r in range(2)]
        dst = [np.full(100, 9, dtype=np.int32) for _ in range(2)]

        def exchange(digests=(7, 7)):
            assert not _native.small_begin(nodes[0], small[0].ctypes.data, 400, digests[0],
                                           -1.0)
            assert _native.small_begin(nodes[1], small[1].ctypes.data, 400, digests[1], -1.0)
            assert _native.node_wait(nodes[0], -1.0)

        exchange()
        for dtype, op, what in [(42, hvd.Sum, "unknown dtype code 42"),
                                (_native.I32, 9, "unknown reduction op 9"),
                                (_native.I32, hvd.Adasum, r"reduction op 2 \(Adasum\)")]:
            with pytest.raises(ValueError, match=f"^ringreduce: small_end: {what}"):
                _native.small_end(nodes[0], dst[0].ctypes.data, 100, dtype, op, 1.0, 1.0)
            assert (dst[0] == 9).all()
        for r in range(2):
            assert _native.small_end(nodes[r], dst[r].ctypes.data, 100, _native.I32, hvd.Sum,
                                     1.0, 1.0) == 0
            assert np.array_equal(dst[r], small[0] + small[1])
        exchange((7, 8))
        assert _native.small_end(nodes[0], dst[0].ctypes.data, 100, _native.I32, hvd.Sum,
                                 1.0, 1.0) == -1
    finally:
        for node in nodes:
            _native.node_detach(node)


def test_the_node_writes_its_staging_both_ways_and_the_results_stay_exact():
    """Each rank writes its slot or area with plain or non-temporal stores, whichever it
    measured cheaper, and tries each way early and the other one every 64 blocks. A large
    allreduce of 200 blocks of 128 KiB per rank (and two 128 KiB small ones) therefore writes
    both ways on both ranks; the sums are exact either way."""
    segments, nodes = _two_local_ranks(small_bytes=256 << 10, block_bytes=256 << 10)
    count = 200 * (256 << 10) // 4
    x = [np.arange(count, dtype=np.int32) * (r + 1) + r for r in range(2)]
    out = [np.zeros_like(v) for v in x]
    try:
        for r in range(2):
            _native.large_begin(nodes[r], x[r].ctypes.data, out[r].ctypes.data, count,
                                _native.I32, hvd.Sum, 1.0, 1.0, 5, False)
        done = [False, False]
        for _ in range(1000):
            for r in range(2):
                done[r] = done[r] or _native.large_run(nodes[r], -1.0) == _native.LARGE_DONE
            if all(done):
                break
        assert all(done)
        want = x[0] + x[1]
        assert all(np.array_equal(o, want) for o in out)
        for node in nodes:
            plain, streamed = _native.large_profile(node, False)[1]
            assert plain + streamed == 200 and plain > 0 and streamed > 0, (plain, streamed)

        small = [v[:32768] for v in x]          # 128 KiB each: measured, so counted
        dst = [np.zeros_like(v) for v in small]
        for _ in range(2):
            assert not _native.small_begin(nodes[0], small[0].ctypes.data, 128 << 10, 7, -1.0)
            assert _native.small_begin(nodes[1], small[1].ctypes.data, 128 << 10, 7, -1.0)
            assert _native.node_wait(nodes[0], -1.0)
            for r in range(2):
                assert _native.small_end(nodes[r], dst[r].ctypes.data, 32768, _native.I32,
                                         hvd.Sum, 1.0, 1.0) == 0
                assert np.array_equal(dst[r], small[0] + small[1])
        for node in nodes:
            assert sum(_native.large_profile(node, False)[1]) == 202
    finally:
        for node in nodes:
            _native.node_detach(node)


# native/p2p.c's exchange, reached as the extension's exported C function: crossnode.py uses it
# only through doubling() and mpi_test(), and its failures (a send refused after the receive was
# posted, a truncated message) cannot be provoked through doubling(); the extension itself has
# no Python binding for it, the test keeps its own.
_P2P = ctypes.CDLL(_native.__file__)
_P2P.rr_mpi_exchange.restype = ctypes.c_int
_P2P.rr_mpi_exchange.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_double]
_P2P.rr_error.restype = ctypes.c_char_p
_RR_OK, _RR_PENDING = 0, 2      # native/status.h


def _mpi_exchange(state, comm, partner, tag, send, send_bytes, recv, recv_bytes, spin_seconds):
    """rr_mpi_exchange: the bytes received, `_native.PENDING` while pending, or RuntimeError
    with the failure's text (as the extension reports its other failures)."""
    status = _P2P.rr_mpi_exchange(state, comm, partner, tag, send, send_bytes, recv, recv_bytes,
                                  spin_seconds)
    if status == _RR_OK:
        return _native.mpi_test(state)      # complete: the bytes received
    if status == _RR_PENDING:
        return _native.PENDING
    raise RuntimeError(f"ringreduce: mpi_exchange: {_P2P.rr_error().decode()}")


def _self_exchange(MPI):
    """native/p2p.c bound, a communicator of this process alone, an exchange state."""
    crossnode._bind_native_mpi(MPI)
    return MPI.COMM_SELF.Dup(), np.zeros(_native.EXCHANGE_BYTES, dtype=np.uint8)


def _probe(comm, tag, seconds=1.0):
    """Whether a message with `tag` is waiting for a receive (polled a while: a message to
    ourselves may take a moment to show)."""
    deadline = time.monotonic() + seconds
    while not comm.Iprobe(source=0, tag=tag):
        if time.monotonic() > deadline:
            return False
    return True


def test_doubling_refuses_an_unknown_dtype_or_op_before_sending():
    """Recursive doubling with ourselves as the partner (one round): refused before the data
    is copied in or a message posted; then a real round reduces the data with itself."""
    MPI = mpi()
    comm, state = _self_exchange(MPI)
    gathered = np.array([[11, 0], [0, 0]], dtype=np.int64)     # ours, theirs (digest, word)
    outgoing, incoming = np.zeros(16 + 64, dtype=np.uint8), np.zeros(16 + 64, dtype=np.uint8)
    rounds = np.array([[0, 1, 16, gathered[0].ctypes.data, outgoing.ctypes.data,
                        gathered[1].ctypes.data]], dtype=np.int64)
    src, dst = np.arange(10, dtype=np.float32), np.full(10, 5, dtype=np.float32)
    data = outgoing[16:56].view(np.float32)

    def doubling(nbytes, count, dtype, op):
        return _native.doubling(state.ctypes.data, MPI._handleof(comm), 4, rounds.ctypes.data,
                                1, False, nbytes, count, dtype, op, src.ctypes.data,
                                dst.ctypes.data, 1.0, 1.0, data.ctypes.data,
                                incoming.ctypes.data, incoming.size, gathered.ctypes.data, 2,
                                0.5)

    try:
        for dtype, op, what in [(42, hvd.Sum, "unknown dtype code 42"),
                                (_native.F32, 9, "unknown reduction op 9"),
                                (_native.F32, hvd.Adasum, r"reduction op 2 \(Adasum\)")]:
            with pytest.raises(ValueError, match=f"^ringreduce: doubling: {what}"):
                doubling(40, 10, dtype, op)
        with pytest.raises(ValueError, match="^ringreduce: doubling: 40 bytes of data are not "
                                             "20 elements"):
            doubling(40, 20, _native.F32, hvd.Sum)
        with pytest.raises(ValueError, match="larger than the 80 bytes a receive holds"):
            doubling(80, 20, _native.F32, hvd.Sum)
        assert not data.any() and (dst == 5).all() and not _probe(comm, 4, 0.05)
        assert doubling(40, 10, _native.F32, hvd.Sum) == 1
        assert np.array_equal(dst, src + src) and gathered[1, 0] == 11
        assert doubling(-1, 0, 0, 0) == 0       # headers only: no result, by convention
    finally:
        comm.Free()


def test_a_failed_exchange_leaves_no_receive_posted():
    """MPI_Isend failing after MPI_Irecv was posted (a negative count), and MPI_Testall failing
    (a truncated message): the error carries MPI's text, and a later message on the same
    communicator and tag is still there for its own receive, not taken by a stale one."""
    MPI = mpi()
    comm, state = _self_exchange(MPI)
    sent, received = np.arange(40, dtype=np.uint8), np.zeros(64, dtype=np.uint8)

    def exchange(send_bytes, recv_bytes):
        return _mpi_exchange(state.ctypes.data, MPI._handleof(comm), 0, 3,
                             sent.ctypes.data, send_bytes, received.ctypes.data,
                             recv_bytes, 0.5)

    try:
        for send_bytes, recv_bytes, failure in [(-1, 64, "MPI_Isend failed .*count"),
                                                (40, 16, "MPI_Testall failed")]:
            with pytest.raises(RuntimeError, match=f"^ringreduce: mpi_exchange: {failure}"):
                exchange(send_bytes, recv_bytes)
            received[:] = 0
            marker = np.full(8, 0xAB, dtype=np.uint8)
            request = comm.Isend(marker, dest=0, tag=3)
            assert _probe(comm, 3), "a receive left posted took the message"
            assert not received.any()
            got = np.zeros(8, dtype=np.uint8)
            comm.Recv(got, source=0, tag=3)
            request.Wait()
            assert (got == 0xAB).all()
            assert exchange(40, 64) == 40 and (received[:40] == sent).all()   # usable again
    finally:
        comm.Free()


def _no_settling():
    raise AssertionError("a one-rank engine never settles an order")


class _SlowToLetGo(engine.Engine):
    """An engine thread that dawdles between a collective's end and letting go of its name,
    which is when a woken caller may already reuse the name."""

    def _release_name(self, name: str) -> None:
        if threading.current_thread() is self._thread:
            time.sleep(0.05)
        super()._release_name(name)


def test_a_handle_is_done_only_once_its_name_is_free():
    e = _SlowToLetGo("test-engine", 0, lambda: None, _no_settling)
    try:
        for _ in range(3):
            e.submit("same", lambda: 1).wait()
            assert e.run("same", lambda: 2) == 2      # no "still in flight"
    finally:
        e.shutdown()


def test_an_engine_is_stuck_only_while_every_thread_that_submitted_waits_in_it():
    """Engine._stuck, what tells a deadlock of the program from a slow rank: every live
    thread that has submitted to the set waits for one of its collectives still pending."""
    gate, later = threading.Event(), threading.Event()
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)

    def stuck() -> bool:
        with e._cv:
            return e._stuck()

    def until(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.001)

    try:
        assert not stuck()      # nobody has submitted
        waiter = threading.Thread(target=lambda: e.submit("blocked", gate.wait).wait())
        waiter.start()
        until(lambda: e._submitters.waiting)
        assert stuck()          # its one submitter waits for a collective not done
        sleeper = threading.Thread(target=lambda: (e.submit("queued", lambda: 1),
                                                   later.wait()))
        sleeper.start()
        until(lambda: sleeper.ident in e._submitters)
        assert not stuck()      # a submitter that does not wait may submit more
        later.set()
        sleeper.join()
        assert stuck()          # (one that ended will not)
        gate.set()
        waiter.join()
        assert not stuck() and not e._submitters.waiting
    finally:
        gate.set()
        later.set()
        e.shutdown()


def test_a_synchronous_claim_never_overtakes_queued_work():
    """claim_idle() (the small allreduce's inline path) succeeds only when nothing runs and
    nothing is queued: work submitted before it has run by then."""
    order, gate = [], threading.Event()
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        first = e.submit("a", lambda: (gate.wait(), order.append("a")))
        second = e.submit("b", lambda: order.append("b"))
        assert not e.claim_idle()       # "a" runs, "b" waits
        gate.set()
        deadline = time.monotonic() + 30
        while not e.claim_idle():
            assert time.monotonic() < deadline, "the engine never became idle"
        order.append("inline")
        e.release_idle()
        first.wait(), second.wait()
        assert order == ["a", "b", "inline"]
    finally:
        gate.set()
        e.shutdown()


def _thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's /proc")
def test_an_idle_engine_leaves_the_cores_alone():
    """After a submission the engine thread looks for more work only briefly: it once looked
    every 0.2 ms for a second after each, which took ~11% of a core from training (each look
    costs ~20 us), and a training step submits every step. A later submission still runs on
    it."""
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        assert e.submit("first", lambda: 1).wait() == 1
        time.sleep(0.05)
        before = _thread_cpu_seconds(e._thread.native_id)
        time.sleep(1.0)
        used = _thread_cpu_seconds(e._thread.native_id) - before
        assert used < 0.04, f"the idle engine thread used {used * 1000:.0f} ms of CPU in 1 s"
        woken = threading.Event()
        handle = e.submit("later", woken.set)
        assert woken.wait(30), "a submission to a dozing engine did not run"
        handle.wait()
    finally:
        e.shutdown()


class _Parked(engine.Engine):
    """An engine thread that ends at once: queued work stays queued, with the engine free,
    until a waiter runs it (`Handle.wait`). With a live engine thread, whether a claim finds
    queued work or the thread already running it is up to the scheduler."""

    def _loop(self) -> None:
        return


def test_a_name_is_refused_while_a_claim_holds_it():
    """The small allreduce's inline claim takes its name: another thread's submission of the
    same name is refused (ValueError), and a claim of a name that is queued is refused."""
    e = _Parked("parked-engine", 0, lambda: None, _no_settling)
    try:
        assert not e.claim_idle("first")    # a thread's first call takes the general path,
        assert e.run("first", lambda: 2) == 2     # which fixes its place (thread_places)
        assert e.claim_idle("held")
        with pytest.raises(ValueError, match="'held' is still in flight"):
            e.submit("held", lambda: None)
        e.release_idle()
        assert e.run("held", lambda: 3) == 3        # free again after the release
        queued = e.submit("queued", lambda: 4)
        with pytest.raises(ValueError, match="'queued' is still in flight"):
            e.claim_idle("queued")
        assert not e.claim_idle("other")            # work is queued: no overtaking it
        assert queued.wait() == 4                   # the waiter runs the queue
        assert e.claim_idle("queued")               # and the name is free again
        e.release_idle()
    finally:
        e.shutdown()


def test_a_raising_callback_ends_its_collectives_children_for_the_others():
    """children_end marks, on the engine of the collective, the first child its callbacks
    did not start (the newest marks only); a member whose first pending name is such a
    child of another member's mark fails it, whatever the nesting, and nobody else does."""
    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        handle = e.submit("dist.noname.7", lambda: 1)
        handle.wait()
        with lineage.children_of(handle):
            assert lineage.child_name() == "dist.noname.7.then.0"
        lineage.children_end(handle, ValueError("bad"))
        lineage.children_end(handle, RuntimeError("then() of the chain after it"))
        assert e.ended == {"dist.noname.7": (1, "ValueError: bad")}
        for k in range(lineage.EndedMarks.KEPT + 1):
            lineage.children_end(Finished(f"x.{k}", None, None, e), KeyError(k))
        assert len(e.ended) == lineage.EndedMarks.KEPT and "dist.noname.7" not in e.ended
        lineage.children_end(Finished("no engine", None, None), ValueError())  # nothing
    finally:
        e.shutdown()
    marks = [("a", {}), ("b", {"dist.noname.7": (1, "ValueError: bad")}), ("c", {})]
    ended_by = negotiation._ended_by
    assert ended_by(0, "dist.noname.7.then.1", marks) == (1, "dist.noname.7", "ValueError: bad")
    assert ended_by(0, "dist.noname.7.then.5", marks) is not None
    assert ended_by(0, "dist.noname.7.then.0", marks) is None       # started before it raised
    assert ended_by(1, "dist.noname.7.then.1", marks) is None       # its own mark
    assert ended_by(2, "dist.noname.70.then.1", marks) is None
    assert ended_by(2, "dist.noname.7", marks) is None
    assert ended_by(2, None, marks) is None
    nested = [("a", {}), ("b", {"dist.noname.7.then.0": (0, "E: x")})]
    assert ended_by(0, "dist.noname.7.then.0.then.0", nested) == (1, "dist.noname.7.then.0",
                                                                  "E: x")


def test_settling_runs_the_agreed_names_first_and_requeues_the_rest():
    """A collective that meets OutOfOrder is run again only after the names the agreement
    returns (other threads' queued ones too), in its order; the rest keep submission order."""
    order, rounds = [], []

    def agreement():
        def agree(names, ended, stuck):
            rounds.append(list(names))
            return [] if len(rounds) == 1 else ["c", "b"]     # nothing common at first
        return agree

    gate, meets = threading.Event(), iter([True])
    e = engine.Engine("test-engine", 0, lambda: None, agreement)
    try:
        def first():
            if next(meets, False):
                raise engine.OutOfOrder()
            order.append("a")

        blocker = e.submit("blocker", gate.wait)
        handles = [e.submit(name, work) for name, work in
                   (("a", first), ("b", lambda: order.append("b")),
                    ("c", lambda: order.append("c")), ("d", lambda: order.append("d")))]
        gate.set()
        blocker.wait()
        for h in handles:
            h.wait()
        assert order == ["c", "b", "a", "d"], order
        assert rounds[0][0] == "a" and set(rounds[1]) == {"a", "b", "c", "d"}, rounds
    finally:
        gate.set()
        e.shutdown()


def test_done_callbacks_run_once_and_a_waiter_gets_the_result():
    """add_done_callback runs each callback once, after the result is set (at once when the
    handle is done already); wait() returns it whichever thread ran the work."""
    seen, gate, all_called = [], threading.Event(), threading.Event()

    def note(h):
        seen.append((h.name, h.wait()))
        if len(seen) == 5:
            all_called.set()

    e = engine.Engine("test-engine", 0, lambda: None, _no_settling)
    try:
        blocker = e.submit("blocker", gate.wait)
        handles = [e.submit(f"h{i}", lambda i=i: i * i) for i in range(5)]
        for h in handles:
            h.add_done_callback(note)
        gate.set()
        blocker.wait()
        assert [h.wait() for h in handles] == [0, 1, 4, 9, 16]
        # (a callback runs after its handle is done, when the engine thread lets go)
        assert all_called.wait(30), f"only {seen} were called back"
        handles[0].add_done_callback(lambda h: seen.append(("late", h.wait())))
        assert sorted(seen) == sorted([(f"h{i}", i * i) for i in range(5)] + [("late", 0)])
        assert all(h.done() for h in handles)
    finally:
        gate.set()
        e.shutdown()


def test_a_done_callback_may_start_work_and_block_until_it_is_done():
    """A torch future's then() callback runs after the engine thread finished a collective,
    and may start another and block until it is done without running the queue itself
    (torch's Future.wait(), as DDP's PowerSGD hook does): a new engine thread takes over the
    queue, and the old one ends after its callbacks. A callback that raises is reported, and
    the engine goes on."""
    gate, inner_done, got = threading.Event(), threading.Event(), []
    e = engine.Engine("callback-engine", 0, lambda: None, _no_settling)
    try:
        blocker = e.submit("blocker", gate.wait)    # "first" then runs on the engine thread

        def start_and_block(handle):
            inner = e.submit("inner", lambda: 2)
            inner.add_done_callback(lambda _: inner_done.set())
            if inner_done.wait(10):                 # blocks, as torch's Future.wait() does
                got.append((threading.current_thread().name, inner.wait()))

        first = e.submit("first", lambda: 1)
        first.add_done_callback(lambda handle: 1 / 0)
        first.add_done_callback(start_and_block)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gate.set()                  # (no wait() here: a waiter would run the queue)
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
        assert got == [("callback-engine", 2)], "the callback's collective never ran"
        assert blocker.wait() and first.wait() == 1
        assert any("'first' raised ZeroDivisionError" in str(w.message) for w in caught)
        assert e.submit("after", lambda: 3).wait() == 3
        deadline = time.monotonic() + 30
        while sum(t.name == "callback-engine" for t in threading.enumerate()) > 1:
            assert time.monotonic() < deadline, "the old engine thread did not end"
            time.sleep(0.01)
    finally:
        gate.set()
        e.shutdown()


def test_a_member_that_left_after_a_collective_does_not_fail_it():
    """A goodbye carries how many collectives the member had begun (it finished them all): the
    ones it took part in still complete on the others, whose last messages may arrive after it
    left; later ones cannot. A member's failure ends every one."""
    departures = Departures(mpi().COMM_SELF)
    assert not departures.ended(1)
    departures.gone[1] = 5
    assert not departures.ended(5)
    assert departures.ended(6)
    departures.gone.clear()
    departures.failures[2] = "collective #3 allreduce 'x' (MemoryError: ...)"
    assert departures.ended(1)


def test_a_set_is_restartable_after_a_failure_or_a_restart_and_not_after_a_member_left():
    """elastic's reset restarts the job (shutdown() and init() on every rank) only where no
    member has left for good: init() would wait for it."""
    departures = Departures(mpi().COMM_SELF)
    assert not departures.restartable()
    departures.failures[2] = "collective #3 allreduce 'x' (MemoryError: ...)"
    assert departures.restartable()
    departures.gone[1] = 4              # left to start afresh: its goodbye said so
    departures.restarting.add(1)
    assert departures.restartable()
    departures.gone[0] = 4              # left for good (the end of its script)
    assert not departures.restartable()
    departures.failures.clear()
    del departures.gone[0]
    assert departures.restartable()     # one restarting is enough: the failure comes later


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
