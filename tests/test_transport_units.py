"""Single-process tests of the transport: chunking, the ring's scratch, signatures and their
digests, the node protocol stepped by hand, the exchanges between nodes, departures."""
import ctypes
import time

import numpy as np
import pytest
import torch

import ringreduce as hvd
from ringreduce import _native
from ringreduce.transport import crossnode, ring, signature
from ringreduce.transport.departures import Departures
from ringreduce.core.mpi import mpi


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


def _truncation_reported(MPI, comm) -> bool:
    """Whether this MPI reports a message to this process cut short by its receive: MPICH
    does; Open MPI 5's path to itself truncates it silently (between two processes it
    reports MPI_ERR_TRUNCATE, and our exchanges always go between two)."""
    received = np.zeros(16, dtype=np.uint8)
    requests = [comm.Irecv(received, source=0, tag=9),
                comm.Isend(np.zeros(40, dtype=np.uint8), dest=0, tag=9)]
    try:
        MPI.Request.Waitall(requests)
    except MPI.Exception:
        return True
    return False


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

    failing = [(-1, 64, "MPI_Isend failed .*count"), (40, 16, "MPI_Testall failed")]
    if not _truncation_reported(MPI, comm):     # (then the second cannot fail here)
        failing = failing[:1]
    try:
        for send_bytes, recv_bytes, failure in failing:
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
