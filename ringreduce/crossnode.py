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
only; see transport.py), so every receive has room for the largest, and the status tells what
came. Within a node, the node's shared memory gathers the headers (and reduces small data)
first.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _native
from .mpi import mpi
from .shm import NodeWindow
from .stall import StallWatch

TAG = 11                # the ring uses its own tag on the same communicator
HEADER = np.dtype((np.int64, 2))    # digest, per-rank word
SEND_SPECS = 64         # message specs kept, by round and data size


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
        MPI = self.MPI = mpi()
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
        room = self.room = cross.size // 2 * local.size * HEADER.itemsize
        self.outgoing = np.zeros(room + max(most_data, 64), dtype=np.uint8)
        self.incoming = np.zeros(room + max(most_data, 64), dtype=np.uint8)
        self.incoming_address = self.incoming.ctypes.data
        self.data = self.outgoing[room:]                 # what allreduce reduces
        self.data_address = self.data.ctypes.data
        self.receive_spec = [self.incoming, MPI.BYTE]
        self.statuses = [MPI.Status(), MPI.Status()]
        self.send_specs: dict[tuple[int, int], list] = {}    # (round, data bytes) -> spec
        self.rounds = []
        me, distance = cross.rank, 1
        while distance < cross.size:
            partner = me ^ distance
            ours, theirs = me & ~(distance - 1), partner & ~(distance - 1)
            size = distance * local.size * HEADER.itemsize
            arriving = self.incoming[:size].view(np.int64).reshape(distance, local.size, 2)
            self.rounds.append((partner, ours < theirs, size,
                                self.gathered[ours:ours + distance].view(np.uint8).reshape(-1),
                                self.outgoing[room - size:room], arriving,
                                self.gathered[theirs:theirs + distance]))
            distance *= 2

    def headers(self, digest: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Every member's digest and per-rank word, indexed by set rank."""
        if self.node is None:
            self._node_block(digest, per_rank)
        else:
            self._node_block(*self.node.exchange_headers(digest, per_rank))
        return self._by_set_rank(self.run(None))

    def allreduce(self, nbytes: int, count: int, dtype: int, op: int,
                  digest: int) -> Optional[np.ndarray]:
        """Reduce the first `nbytes` of `data` (`count` elements of dtype code `dtype`, not
        yet divided or scaled) across the set in place: on the node through its slots, then
        between nodes. None when every member's digest agrees (so every member sent its data
        and `data` holds the whole result); else every member's digest, by set rank."""
        reduced = True
        if self.node is None:
            self._node_block(digest, 0)
        else:
            reduced = self.node.small(self.data_address, self.data_address, nbytes, count,
                                      dtype, op, 1.0, 1.0, digest)
            self._node_block(*self.node.last_headers())
        gathered = self.run((nbytes, count, dtype, op) if reduced else None)
        every = gathered.ravel()[::2].tolist()     # the digests (each header's first word)
        if every.count(every[0]) == len(every):
            return None
        return self._by_set_rank(gathered)[0]

    def _node_block(self, digests: Any, per_rank: Any) -> None:
        """This node's headers (its local ranks' digests and per-rank words), where the
        exchange between nodes starts from."""
        mine = self.gathered[self.cross.rank]
        mine[:, 0], mine[:, 1] = digests, per_rank

    def _by_set_rank(self, gathered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        flat = gathered.reshape(-1, 2)
        if self.in_order:
            return flat[:, 0].copy(), flat[:, 1].copy()
        digests, values = np.empty_like(flat[:, 0]), np.empty_like(flat[:, 1])
        digests[self.order], values[self.order] = flat[:, 0], flat[:, 1]
        return digests, values

    def run(self, reduction: Optional[tuple[int, int, int, int]]) -> np.ndarray:
        """Recursive doubling from this node's headers (`_node_block`); `reduction`, if given,
        is (bytes, count, dtype code, op) of `data` to reduce in place (until a message comes
        without data: its sender's digest tells why). Returns the headers of every node
        (nodes x local size x 2, by cross rank)."""
        MPI, cross = self.MPI, self.cross
        complete = reduction is not None
        nbytes = reduction[0] if reduction is not None else 0
        for k, (partner, lower, size, ours, headers, arriving, theirs) in \
                enumerate(self.rounds):
            headers[:] = ours
            send = self.send_specs.get((k, nbytes))
            if send is None:
                if len(self.send_specs) >= SEND_SPECS:
                    self.send_specs.clear()
                send = self.send_specs[k, nbytes] = [
                    self.outgoing[self.room - size:self.room + nbytes], MPI.BYTE]
            requests = [cross.Irecv(self.receive_spec, partner, TAG),
                        cross.Isend(send, partner, TAG)]
            self.watch.wait(lambda: MPI.Request.Testall(requests, self.statuses))
            theirs[...] = arriving
            if reduction is not None:
                if self.statuses[0].Get_count(MPI.BYTE) - size != nbytes:
                    complete = False
                elif complete:
                    _, count, dtype, op = reduction
                    other = self.incoming_address + size
                    first, second = ((self.data_address, other) if lower
                                     else (other, self.data_address))
                    _native.combine(dtype, op, first, second, self.data_address, count, False,
                                    1.0, 1.0)
        return self.gathered
