"""One process set's MPI-3 shared-memory window on a node, and the node protocol that runs on it
(in C, native/node.c, for every op and dtype; tests/mpi/node_oracle.py restates it in Python).

Every member on the node maps every member's segment; an exchange is "write your part, raise
your flag, wait for every flag". Small allreduces put header and data in one slot each and every
rank reduces all slots in rank order; large ones go block by block through cache-sized staging
areas, each rank reducing its own chunk (see node.c). A wait that outlasts a short spin in C
comes back here and waits in the stall watch, which reports stalls and lets other threads run.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import numpy as np

from .. import _native
from ..core.mpi import mpi
from .stall import StallWatch

SPIN_SECONDS = 0.00005  # C polls flat out this long before the stall watch takes over
# An asynchronous small allreduce's publish polls this long for peers in step (then its rest
# waits in the queue): a few microseconds keep a caller that is ahead from being held back.
PUBLISH_SPIN_SECONDS = 0.00001
# The large allreduce's phases, in native/constants.h's RR_PHASE_* order.
PHASES = ("copy_in", "wait_in", "reduce", "publish", "wait_out", "copy_out")
_DONE, _MISMATCH = _native.LARGE_DONE, _native.LARGE_MISMATCH     # large_run's outcomes
_BETWEEN_NODES = _native.LARGE_BETWEEN_NODES
assert len(PHASES) == _native.PHASES


class NodeWindow:
    def __init__(self, local: Any, small_bytes: int, block_bytes: int,
                 watch: StallWatch) -> None:
        MPI = mpi()
        slot_bytes, block_bytes, segment_bytes = _native.node_layout(small_bytes, block_bytes)
        self.watch, self.small_bytes = watch, small_bytes
        self.win = MPI.Win.Allocate_shared(segment_bytes, disp_unit=1, comm=local)
        self.win.Lock_all(MPI.MODE_NOCHECK)   # one long epoch: C orders its accesses itself
        bases = [np.frombuffer(self.win.Shared_query(r)[0], dtype=np.uint8).ctypes.data
                 for r in range(local.size)]
        self.node = _native.node_attach(local.rank, bases, slot_bytes, block_bytes)
        self.win.Sync()
        local.Barrier()
        self._headers = np.zeros((2, local.size), dtype=np.int64)   # digests, per-rank words
        # `small` in place, begun without waiting (ways.Way.begin), in one call to C: an
        # asynchronous small allreduce takes it on the caller's thread, where every frame shows
        self.small_now = partial(_native.small_now, self.node, PUBLISH_SPIN_SECONDS)

    def free(self) -> None:
        _native.node_detach(self.node)
        self.win.Unlock_all()
        self.win.Free()

    def _wait(self) -> None:
        self.watch.wait(lambda: _native.node_ready(self.node))

    def exchange_headers(self, digest: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The signature exchange of a collective whose data goes another way (over MPI): on
        one node it must meet allreduces at the same flag, or a mismatch between an allreduce
        and another collective would leave each side waiting on a different mechanism. Returns
        every local rank's digest and `per_rank` value."""
        if not _native.headers_begin(self.node, digest, per_rank, SPIN_SECONDS):
            self._wait()
        return self.last_headers()

    def last_headers(self) -> tuple[np.ndarray, np.ndarray]:
        """Every local rank's digest and per-rank word of the last exchange (copies)."""
        digests, per_rank = self._headers
        _native.headers_read(self.node, digests.ctypes.data, per_rank.ctypes.data, 1)
        return digests.copy(), per_rank.copy()

    def headers_into(self, address: int) -> None:
        """Every local rank's (digest, per-rank word) of the last exchange, as int64 pairs at
        `address`."""
        _native.headers_read(self.node, address, address + 8, 2)

    def small(self, src: int, dst: int, nbytes: int, count: int, dtype: int, op: int,
              divisor: float, scale: float, digest: int,
              output: Optional[Callable[[], int]] = None) -> bool:
        """Allreduce `count` elements at address `src` into `dst` (may be `src`) through one
        slot per rank; the result times scale / divisor (kernels.finish). With
        `output`, `output()` makes `dst` (its address) once ours is published (off the path
        the peers wait on). False, with `dst` untouched, when the digests differ (on every
        local rank)."""
        if output is None:
            if not _native.small_begin(self.node, src, nbytes, digest, SPIN_SECONDS):
                self._wait()
            return _native.small_end(self.node, dst, count, dtype, op, divisor, scale) == 0
        # publish, make dst while the peers catch up, then wait
        ready = _native.small_begin(self.node, src, nbytes, digest, -1.0)
        return self.small_complete(ready, output(), count, dtype, op, divisor, scale)

    def small_publish(self, src: int, nbytes: int, digest: int) -> bool:
        """`small`'s first half, which hardly waits: our slot and flag up, the peers' flags
        polled a few microseconds. True when every peer's is up."""
        return _native.small_begin(self.node, src, nbytes, digest, PUBLISH_SPIN_SECONDS)

    def small_complete(self, ready: bool, dst: int, count: int, dtype: int, op: int,
                       divisor: float, scale: float) -> bool:
        """`small`'s second half, after `small_publish` (which said `ready`): wait for the
        peers' flags, then reduce every slot into `dst`; False when the digests differ."""
        if not ready and not _native.node_wait(self.node, SPIN_SECONDS):
            self._wait()
        return _native.small_end(self.node, dst, count, dtype, op, divisor, scale) == 0

    def profile(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent in each phase of this window's large allreduces (since the last
        reset), for benchmarks: where the time goes, against the bytes each phase moves."""
        phases, _ = _native.large_profile(self.node, reset)
        return dict(zip(PHASES, phases))

    def blocks_written(self) -> dict[str, int]:
        """How many slots and blocks (of 64 KiB or more) this rank has written with plain and
        with non-temporal ("streamed") stores: native/node.c measures both and chooses."""
        _, blocks = _native.large_profile(self.node, False)
        return dict(zip(("plain", "streamed"), blocks))

    def large(self, src: int, dst: int, count: int, dtype: int, op: int, divisor: float,
              scale: float, digest: int,
              between_nodes: Optional[Callable[[int, int], None]] = None) -> bool:
        """The same, block by block. With ranks on several nodes, `between_nodes(first, count)`
        finishes each chunk this rank reduced (the ring between nodes) before peers copy it."""
        _native.large_begin(self.node, src, dst, count, dtype, op, divisor, scale, digest,
                            between_nodes is not None)
        while True:
            status = _native.large_run(self.node, SPIN_SECONDS)
            if status == _DONE:
                return True
            if status == _MISMATCH:
                return False
            if status == _BETWEEN_NODES:
                between_nodes(*_native.large_chunk(self.node))
            else:       # (_native.LARGE_WAITING)
                self._wait()
