"""Allreduce among the ranks of one node through an MPI-3 shared-memory window.

Every rank owns one segment of the window that all ranks on the node map:
    [flag | header slots x2 | small slots x2 | block areas x2]
and every exchange is "write your part, raise your flag, wait for every flag":

- Small messages: each rank writes a header (signature digest, byte count, one per-rank value)
  and its data into a slot, then every rank reduces all slots in rank order. The signature
  check and the data travel in the same step, and all ranks compute the same bits.
- Large messages go block by block. Rank r copies into its area the chunks that its peers own,
  then reduces its own chunk straight out of every peer's area (and its own tensor), writes
  the result to the output and to its area, and finally copies every peer's finished chunk
  out of their areas. Blocks are small enough (1 MiB) for the areas to stay in the shared
  cache, so memory sees one read of the input and one write of the output, where a ring over
  MPI messages copies everything through MPI's own buffers. Between nodes (`cross`), each
  rank's chunk goes around our ring before the copy out.

For the sums and averages of the common dtypes both run in C (native/node.c, same protocol
and layout): from Python every step costs microseconds, and small calls are all overhead.

Every parity (header slot, small slot, block area) derives from the count of flags raised (a
rank's own flag holds it), which is the same on every rank, even after a mismatch. A slot
written before flag f is read between flags f and f+1, and is rewritten no sooner than before
flag f+2, once every peer has finished reading it; so each block needs two flags, not three.
Flags and data are ordered with full memory fences (`Win.Sync()` here, atomics in C).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from . import ring
from .errors import MismatchError
from .stall import StallWatch

try:
    from . import _native
except ImportError:     # not built: Python does it all
    _native = None

_LINE = 64              # bytes: flags and headers each get a cache line of their own
_PAGE = 4096
_HEADER_WORDS = 4       # digest, byte count, per-rank value, sequence number
_SPIN_SECONDS = 0.00005  # the C path polls flat out this long before the stall watch takes over
Combine = Callable[[Any, Any, Any], None]     # out = a op b
Finish = Optional[Callable[[np.ndarray], None]]


class NodeShm:
    def __init__(self, local: Any, cross: Any, watch: StallWatch, small_bytes: int,
                 block_bytes: int, scratch: Callable[[str, np.dtype, int], np.ndarray],
                 segment_bytes: int) -> None:
        from mpi4py import MPI

        self.local, self.cross, self.watch = local, cross, watch
        self.scratch, self.segment_bytes = scratch, segment_bytes
        self.small_bytes = small_bytes
        self.block_bytes = _round_up(max(block_bytes, 1), _PAGE)
        # Slots and areas have a page of room: the C path places data at the same offset in a
        # page as its input, since copies between addresses a little apart modulo 4 KiB run
        # several times slower (loads falsely wait on stores: "4K aliasing").
        self.slot_bytes = _round_up(small_bytes, _PAGE) + _PAGE
        self.area_bytes = self.block_bytes + _PAGE
        size = _LINE + 2 * _LINE + 2 * self.slot_bytes + 2 * self.area_bytes
        self.win = MPI.Win.Allocate_shared(size, disp_unit=1, comm=local)
        self.win.Lock_all(MPI.MODE_NOCHECK)   # one long epoch: Sync() is our fence
        self.segments = [np.frombuffer(self.win.Shared_query(r)[0], dtype=np.uint8)
                         for r in range(local.size)]
        self.flags = [seg[:8].view(np.int64) for seg in self.segments]
        self._headers = [[seg[_LINE + parity * _LINE:][:8 * _HEADER_WORDS].view(np.int64)
                          for seg in self.segments] for parity in (0, 1)]
        self._slots = [[seg[3 * _LINE + parity * self.slot_bytes:][:self.small_bytes]
                        for seg in self.segments] for parity in (0, 1)]
        self.flags[local.rank][0] = 0
        self.native = _native is not None     # the C paths (native/node.c) are built
        if self.native:
            _native.node_attach(local.rank, [seg.ctypes.data for seg in self.segments],
                                self.slot_bytes, self.block_bytes)
        self.win.Sync()
        local.Barrier()

    def free(self) -> None:
        if self.native:
            _native.node_detach()
        self.win.Unlock_all()
        self.win.Free()

    @property
    def raised(self) -> int:
        """Flags this rank has raised: the value of its own flag."""
        return int(self.flags[self.local.rank][0])

    # ------------------------------------------------------------------ pieces of a segment

    def _header(self, rank: int, flag: int) -> np.ndarray:
        return self._headers[flag % 2][rank]

    def _slot(self, rank: int, flag: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._slots[flag % 2][rank][:count * dtype.itemsize].view(dtype)

    def _area(self, rank: int, flag: int, dtype: np.dtype, count: int) -> np.ndarray:
        start = 3 * _LINE + 2 * self.slot_bytes + (flag // 2 % 2) * self.area_bytes
        return self.segments[rank][start:start + count * dtype.itemsize].view(dtype)

    def _raise_flag_and_wait(self) -> None:
        flag = self.raised + 1
        self.win.Sync()                       # our writes are visible before the flag
        self.flags[self.local.rank][0] = flag
        peers = self.flags
        self.watch.wait(lambda: all(f[0] >= flag for f in peers))
        self.win.Sync()                       # and theirs before we read

    def _publish_header(self, digest: int, nbytes: int, per_rank: int) -> None:
        self._header(self.local.rank, self.raised + 1)[:3] = (digest, nbytes, per_rank)

    def _check_headers(self, signatures: Callable[[], list]) -> np.ndarray:
        """After a flag: raise MismatchError on every local rank unless the digests agree;
        return every local rank's per-rank value."""
        headers = self._headers[self.raised % 2]
        digest = headers[0][0]
        if any(h[0] != digest for h in headers):
            from .negotiation import describe_mismatch

            raise MismatchError(describe_mismatch(signatures()))
        return np.array([h[2] for h in headers], dtype=np.int64)

    def exchange_headers(self, digest: int, per_rank: int,
                         signatures: Callable[[], list]) -> np.ndarray:
        """The signature check of a collective whose data goes another way (over MPI): on one
        node it must meet allreduces at the same flag, or a mismatch between an allreduce and
        another collective would leave each side waiting on a different mechanism."""
        self._publish_header(digest, 0, per_rank)
        self._raise_flag_and_wait()
        return self._check_headers(signatures)

    # ------------------------------------------------------------------ allreduce

    def fits_small(self, nbytes: int) -> bool:
        return nbytes <= self.small_bytes

    def small_allreduce(self, src: np.ndarray, dst: np.ndarray, combine: Combine, finish: Finish,
                        digest: int, label: Any, signatures: Callable[[], list],
                        last: Optional[Combine] = None) -> None:
        """Header and data in one step, then every rank reduces all slots in rank order."""
        me, flag = self.local.rank, self.raised + 1
        self.watch.begin(label)
        self._slot(me, flag, src.dtype, src.size)[...] = src
        self._publish_header(digest, src.nbytes, 0)
        self._raise_flag_and_wait()
        self._check_headers(signatures)
        slots = [self._slot(r, flag, src.dtype, src.size) for r in range(self.local.size)]
        _reduce_in_order(slots, dst, combine, last)
        self.ring_between_nodes(dst, combine, None if last is not None else finish)

    def native_small_allreduce(self, src: int, dst: int, nbytes: int, count: int, kind: int,
                               divisor: float, scale: float, digest: int, label: Any,
                               signatures: Callable[[], list]) -> None:
        """`small_allreduce` in C, between addresses: `kind` from `kernels.node_kind`, the
        result divided by `divisor` and multiplied by `scale`."""
        self.watch.begin(label)
        if not _native.small_begin(src, nbytes, digest, _SPIN_SECONDS):
            self.watch.wait(_native.node_ready)
        if _native.small_end(dst, count, kind, divisor, scale) < 0:
            from .negotiation import describe_mismatch

            raise MismatchError(describe_mismatch(signatures()))

    def native_large_allreduce(self, src: int, dst: int, count: int, kind: int,
                               divisor: float, scale: float, digest: int, label: Any,
                               signatures: Callable[[], list],
                               between_nodes: Optional[Callable[[int, int], None]] = None
                               ) -> None:
        """`large_allreduce` in C, between addresses (`kind`, `divisor`, `scale` as for
        `native_small_allreduce`). With ranks on several nodes, `between_nodes(first, count)`
        finishes each chunk this rank reduced (the ring between nodes) before peers copy it."""
        self.watch.begin(label)
        _native.large_begin(src, dst, count, kind, divisor, scale, digest,
                            between_nodes is not None)
        while True:
            status = _native.large_run(_SPIN_SECONDS)
            if status == 1:
                return
            if status == 2:
                between_nodes(*_native.large_chunk())
                continue
            if status < 0:
                from .negotiation import describe_mismatch

                raise MismatchError(describe_mismatch(signatures()))
            self.watch.wait(_native.node_ready)

    def large_allreduce(self, src: np.ndarray, dst: np.ndarray, combine: Combine, finish: Finish,
                        digest: int, label: Any, signatures: Callable[[], list],
                        span: Callable[[str], Any], last: Optional[Combine] = None) -> None:
        """Block by block: copy in what peers own, reduce our chunk from every area, copy out."""
        me, n = self.local.rank, self.local.size
        self.watch.begin(label)
        per_block = self.block_bytes // src.itemsize
        for start in range(0, src.size, per_block):
            stop = min(start + per_block, src.size)
            flag = self.raised + 1
            bounds = ring.chunk_bounds(ring.balanced_counts(stop - start, n))
            areas = [self._area(r, flag, src.dtype, stop - start) for r in range(n)]
            with span("copy in"):
                for c, (lo, hi) in enumerate(bounds):
                    if c != me:
                        areas[me][lo:hi] = src[start + lo:start + hi]
            if start == 0:
                self._publish_header(digest, src.nbytes, 0)
            self._raise_flag_and_wait()
            if start == 0:
                self._check_headers(signatures)
            lo, hi = bounds[me]
            out = dst[start + lo:start + hi]
            with span("reduce-scatter"):
                # our own input first: `out` may be that very memory (in place)
                inputs = [src[start + lo:start + hi]] + [areas[r][lo:hi] for r in range(n)
                                                         if r != me]
                _reduce_in_order(inputs, out, combine, last)
                self.ring_between_nodes(out, combine, None if last is not None else finish)
                areas[me][lo:hi] = out
            self._raise_flag_and_wait()
            with span("allgather"):
                for c, (clo, chi) in enumerate(bounds):
                    if c != me:
                        dst[start + clo:start + chi] = areas[c][clo:chi]

    def ring_between_nodes(self, part: np.ndarray, combine: Combine, finish: Finish) -> None:
        """Between nodes, this node's partial result goes around our ring (among the ranks of
        the same local rank), which applies `finish` to each finished chunk."""
        if self.cross.size > 1:
            def reduce(target: np.ndarray, source: np.ndarray) -> None:
                combine(target, source, target)

            segment = max(1, self.segment_bytes // part.itemsize)
            bounds = ring.chunk_bounds(ring.balanced_counts(part.size, self.cross.size))
            scratch = self.scratch("cross", part.dtype, ring.scratch_elements(bounds, segment))
            ring.ring_allreduce(self.cross, part, reduce, scratch, segment, finish)
        elif finish is not None:
            finish(part)


def _reduce_in_order(inputs: list, out: np.ndarray, combine: Combine,
                     last: Optional[Combine] = None) -> None:
    """out = inputs[0] op inputs[1] op ...; `out` may alias inputs[0] only. `last`, when given,
    does the final step (a kernel that also finishes the result)."""
    if len(inputs) == 1:
        if out is not inputs[0]:
            out[...] = inputs[0]
        return
    steps = [inputs[0]] + [out] * (len(inputs) - 2)
    for k, (a, b) in enumerate(zip(steps, inputs[1:])):
        (last if last is not None and k == len(inputs) - 2 else combine)(a, b, out)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
