"""Between nodes: the signature exchange and small allreduces by recursive doubling.

For a process set on several nodes (a power-of-two number of them, each with as many of the
set's ranks), every rank talks to the ranks with its local rank on the other nodes (the cross
communicator). Round k pairs node j with node j xor 2^k; each side sends one message: the
headers (digest, per-rank word) of every rank on the nodes its half has heard from so far, and,
in an allreduce, its half's partial result. Each side then combines the two halves, the lower
half's value first, so both compute the same bits. After log2(nodes) rounds every rank holds
every header and the whole result: the signature travels with the data, one message per round,
where a separate signature exchange and data exchange took two collectives.

Messages differ in length (a rank that has joined, or one in another collective, sends headers
only; see joining.py), so every receive has room for the largest, and the status tells what
came. Within a node, the node's shared memory gathers the headers (and reduces small data)
first. Each round's receive and send are posted and polled in C (native/p2p.c, calling the MPI
that mpi4py loaded) for a short spin; a longer wait goes to the stall watch.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .. import _native
from ..core.mpi import mpi
from .shm import PUBLISH_SPIN_SECONDS, SPIN_SECONDS, NodeWindow
from .stall import StallWatch

TAG = 11                # the ring uses its own tag on the same communicator
HEADER = np.dtype((np.int64, 2))    # digest, per-rank word
_bound = False          # whether native/p2p.c knows the MPI functions yet
_HEADERS_ONLY = (-1, 0, 0, 0, 0, 0, 1.0, 1.0)     # doubling()'s reduction arguments: none
_MOST_BYTES = (1 << 31) - 1                        # MPI counts are C ints
_doubling, _PENDING = _native.doubling, _native.PENDING


def _bind_native_mpi(MPI: Any) -> None:
    global _bound
    if not _bound:
        _native.mpi_bind(MPI.__file__, MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status),
                         MPI._handleof(MPI.BYTE))
        _bound = True


def applies(cross: Any, homogeneous: bool) -> bool:
    """Recursive doubling needs a power-of-two number of nodes, each with as many members."""
    return homogeneous and cross.size > 1 and cross.size & (cross.size - 1) == 0


class BetweenNodes:
    """The exchanges of one process set between its nodes. `node` is the set's shared-memory
    window on this node (None with one member per node)."""

    def __init__(self, comm: Any, local: Any, cross: Any, node: Optional[NodeWindow],
                 watch: StallWatch, most_data: int) -> None:
        """`most_data`: the largest buffer `allreduce` is given, in bytes (every receive
        has room for it: a member that sends headers only cannot know what others send)."""
        MPI = mpi()
        _bind_native_mpi(MPI)
        self.cross, self.node, self.watch = cross, node, watch
        # Which set rank each (cross rank, local rank) is, as this rank's cross communicator
        # orders the nodes: every member tells its node (its node's first set rank), its local
        # rank and its cross rank.
        first = min(local.allgather(comm.rank))
        places = comm.allgather((first, local.rank, cross.rank))
        node_at = {c: n for n, l, c in places if l == local.rank}
        member = {(n, l): r for r, (n, l, _) in enumerate(places)}
        self.order = np.array([[member[node_at[c], l] for l in range(local.size)]
                               for c in range(cross.size)]).reshape(-1)
        self.in_order = bool((self.order == np.arange(comm.size)).all())
        # Buffers. The data sits after room for the most headers a message carries, and each
        # round's headers are written just before it, so a message is one contiguous piece
        # and the data is reduced where it is sent from.
        self.gathered = np.zeros((cross.size, local.size, 2), dtype=np.int64)
        room = cross.size // 2 * local.size * HEADER.itemsize
        if room + most_data > _MOST_BYTES:
            raise ValueError(f"ringreduce: RINGREDUCE_SMALL_MESSAGE_BYTES={most_data} is too "
                             f"large for one MPI message between nodes (at most "
                             f"{_MOST_BYTES - room} bytes with {comm.size} ranks)")
        self.outgoing = np.zeros(room + max(most_data, 64), dtype=np.uint8)
        self.incoming = np.zeros(room + max(most_data, 64), dtype=np.uint8)
        self.incoming_address = self.incoming.ctypes.data
        self.data_address = self.outgoing.ctypes.data + room     # what allreduce reduces
        self.exchange = np.zeros(_native.EXCHANGE_BYTES, dtype=np.uint8)   # C's request state
        exchange = self.exchange.ctypes.data
        self.exchanged = lambda: _native.mpi_test(exchange) != _native.PENDING
        # The rounds, as native/p2p.h's rr_round: partner, whether our half is the lower,
        # header bytes, and the addresses of our half's headers, where they are sent from,
        # and where theirs are kept (they arrive at the start of `incoming`).
        rounds = []
        me, distance = cross.rank, 1
        while distance < cross.size:
            partner = me ^ distance
            ours, theirs = me & ~(distance - 1), partner & ~(distance - 1)
            size = distance * local.size * HEADER.itemsize
            rounds.append([partner, ours < theirs, size, self.gathered[ours].ctypes.data,
                           self.outgoing.ctypes.data + room - size,
                           self.gathered[theirs].ctypes.data])
            distance *= 2
        self.rounds = np.array(rounds, dtype=np.int64).reshape(-1, 6)
        # doubling()'s arguments before the reduction's (and the resume flag), and after
        self._head = (exchange, MPI._handleof(cross), TAG, self.rounds.ctypes.data,
                      len(self.rounds))
        self._tail = (self.data_address, self.incoming_address, self.incoming.nbytes,
                      self.gathered.ctypes.data, self.gathered.size // 2, SPIN_SECONDS)
        self._post_only = self._tail[:-1] + (-1.0,)     # post the first round and return
        self._glance = self._tail[:-1] + (PUBLISH_SPIN_SECONDS,)   # poll a few microseconds
        self._begun: Optional[tuple] = None     # small_publish's reduction, for small_complete
        self._status = _PENDING                 # where small_publish left it
        self._mine_address = self.gathered[cross.rank].ctypes.data
        self._own = self.gathered[cross.rank].reshape(-1) if node is None else None

    def headers(self, digest: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Every member's digest and per-rank word, indexed by set rank."""
        if self.node is not None:
            self.node.exchange_headers(digest, per_rank)
        self._node_headers(digest, per_rank)
        self.run(_HEADERS_ONLY)
        return self._by_set_rank(self.gathered)

    def small(self, src: int, dst: int, nbytes: int, count: int, dtype: int, op: int,
              divisor: float, scale: float, digest: int,
              output: Optional[Callable[[], int]] = None) -> bool:
        """Reduce `nbytes` at address `src` (`count` elements of dtype code `dtype`) across the
        set: on the node through its slots, then between nodes; the result times
        scale / divisor (kernels.finish), into `dst` (may be `src`). With `output`, `dst` is
        made by `output()` (its address) once the first message is on its way: an
        out-of-place allreduce allocates its result while the message travels, not before
        every member can start. False, with `dst` untouched, when the members' digests differ
        (`last_digests()` tells them). NodeWindow's `small`, for the whole set; the hot path
        of a small allreduce, so one frame."""
        reduced, node = True, self.node
        if node is None:
            own = self._own
            own[0], own[1] = digest, 0
        else:
            reduced = node.small(src or self.data_address, self.data_address, nbytes, count,
                                 dtype, op, 1.0, 1.0, digest)
            node.headers_into(self._mine_address)
            src = 0
        if not reduced:
            return self.run(_HEADERS_ONLY)
        if output is None:
            status = _doubling(*self._head, False, nbytes, count, dtype, op, src, dst, divisor,
                               scale, *self._tail)
        else:
            status = _doubling(*self._head, False, nbytes, count, dtype, op, src, 0, divisor,
                               scale, *self._post_only)
            dst = output()
            if status == _PENDING:
                status = _doubling(*self._head, True, nbytes, count, dtype, op, src, dst,
                                   divisor, scale, *self._tail)
        while status == _PENDING:       # _resumed()'s loop, inline
            self.watch.wait(self.exchanged)
            status = _doubling(*self._head, True, nbytes, count, dtype, op, src, dst, divisor,
                               scale, *self._tail)
        return status == 1

    def small_publish(self, address: int, nbytes: int, count: int, dtype: int, op: int,
                      divisor: float, scale: float, digest: int) -> bool:
        """`small` in place on `address`, begun without waiting (an asynchronous call on the
        caller's thread): the node's slot published and, once every rank of the node is
        there, our first message between nodes posted and polled a few microseconds. True
        when the whole exchange is done already; `small_complete` finishes it either way."""
        node = self.node
        self._begun = (nbytes, count, dtype, op, address, address, divisor, scale)
        if node is None:
            own = self._own
            own[0], own[1] = digest, 0
        elif not node.small_publish(address, nbytes, digest):
            self._status = None         # the node's part comes first
            return False
        else:
            self._between_nodes(node.small_complete(True, self.data_address, count, dtype, op,
                                                    1.0, 1.0))
        self._status = status = _doubling(*self._head, False, *self._begun, *self._post_only)
        if status == _PENDING:
            self._status = status = _doubling(*self._head, True, *self._begun, *self._glance)
        return status != _PENDING

    def small_complete(self, ready: bool, address: int, count: int, dtype: int, op: int,
                       divisor: float, scale: float) -> bool:
        """`small_publish`'s collective, finished: True with the result at `address`, False
        (nothing written) when the digests differ, as `small`."""
        node, status = self.node, self._status
        if status is None:
            self._between_nodes(node.small_complete(False, self.data_address, count, dtype, op,
                                                    1.0, 1.0))
            return self.run(self._begun)
        return self._resumed(status, self._begun)

    def _between_nodes(self, reduced: bool) -> None:
        """After the node's part of `small_publish`: the node's headers, and its reduced data
        (where the node's digests agreed; else headers only) for the exchange between nodes."""
        self.node.headers_into(self._mine_address)
        self._begun = self._begun[:4] + (0,) + self._begun[5:] if reduced else _HEADERS_ONLY

    def last_digests(self) -> np.ndarray:
        """Every member's digest in the last exchange, by set rank."""
        return self._by_set_rank(self.gathered)[0]

    def _node_headers(self, digest: int, per_rank: int) -> None:
        """This node's headers, where the exchange between nodes starts from: the node's last
        exchange in its shared memory, or this rank's own when it is alone on its node."""
        if self.node is None:
            self._own[0], self._own[1] = digest, per_rank
        else:
            self.node.headers_into(self._mine_address)

    def _by_set_rank(self, gathered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        flat = gathered.reshape(-1, 2)
        if self.in_order:
            return flat[:, 0].copy(), flat[:, 1].copy()
        digests, values = np.empty_like(flat[:, 0]), np.empty_like(flat[:, 1])
        digests[self.order], values[self.order] = flat[:, 0], flat[:, 1]
        return digests, values

    def run(self, reduction: tuple) -> bool:
        """Recursive doubling from this node's headers (`_node_headers`) into `gathered` (nodes
        x local size x 2, by cross rank). `reduction`: allreduce's (bytes, count, dtype code,
        op, src, dst, divisor, scale) for `data`, reduced in place until a message comes
        without data (its sender's digest tells why), or _HEADERS_ONLY. True when every
        message carried data and every digest agrees (then `dst` is written)."""
        return self._resumed(_doubling(*self._head, False, *reduction, *self._tail), reduction)

    def _resumed(self, status: int, reduction: tuple) -> bool:
        """The doubling that returned `status` for `reduction`, resumed until it ends (waits
        past the spin go to the stall watch); True as `run`'s. (`small` keeps this loop inline:
        its hot path is one frame.)"""
        while status == _PENDING:
            self.watch.wait(self.exchanged)
            status = _doubling(*self._head, True, *reduction, *self._tail)
        return status == 1
