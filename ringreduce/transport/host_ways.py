"""The host ways: Adasum, a set of one, the node's shared memory (slots for small buffers,
blocks for any size; across nodes, our ring between nodes finishes what each node reduced),
recursive doubling between nodes for small buffers, and MPI's gather and our ring where no
memory is shared. Each is an entry of the set's table (ways.py) on the interface of way.py."""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import numpy as np
import torch

from .. import _native
from ..core.errors import RingReduceError
from ..core.mpi import mpi
from ..gpu import cuda
from ..kernels import ops
from ..kernels.buffers import as_array
from ..kernels.ops import ReduceOp
from . import adasum
from .reduce_spec import ReduceSpec
from .signature import Signature, label
from .way import SetParts, Way, scale

_BYTES = np.dtype(np.uint8)


class Adasum(Way):
    """Horovod's Adasum over the set's communicator; GPU tensors go through host memory, as
    Horovod's do without NCCL."""

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return spec.op == ReduceOp.Adasum

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts = self.parts
        parts.check(spec)
        if src.is_cuda:     # (after the caller's stream, or the bucket's ready event)
            host = cuda.to_host(src)
            scale(host, spec, 1.0, spec.prescale)
        else:
            host = parts.prescaled(src, dst, spec, always_copy=True)
        adasum.adasum_allreduce(parts.comm, as_array(host), spec.dtype, spec.lengths,
                                parts.scratch.get, parts.wait)
        scale(host, spec, 1.0, spec.postscale)
        if src.is_cuda:
            cuda.from_host(dst, host)


class Alone(Way):
    """A set of one rank: copy and scale. With no member to meet, its exchange is the whole
    collective and is ready at once, so small calls take the small way's fast path (an
    asynchronous one too, on the caller's thread, rather than a hand-off to the engine thread
    that costs ten times the copy)."""

    carries_signature = begins = True

    def __init__(self, parts: SetParts) -> None:
        super().__init__(parts)
        self.limit = parts.settings.small_message_bytes

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self.parts.prescaled(src, dst, spec, always_copy=True)
        scale(dst, spec, 1.0, spec.postscale)

    def exchange(self, src: int, dst: int, nbytes: int, count: int, code: int, op: ReduceOp,
                 divisor: float, factor: float, digest: int,
                 output: Optional[Callable[[], int]] = None) -> bool:
        """`src` into `dst` (or into what `output()` makes), times factor / divisor."""
        if output is not None:
            dst = output()
        if dst != src:
            _native.copy_stream(dst, src, nbytes)
        return self.begin(dst, nbytes, count, code, op, divisor, factor, digest)

    def begin(self, address: int, nbytes: int, count: int, code: int, op: ReduceOp,
              divisor: float, factor: float, digest: int) -> bool:
        """Done at once: every member's part is here, this one's."""
        if divisor != 1.0 or factor != 1.0:
            _native.finish(code, address, count, divisor, factor)
        return True

    def explain(self, describe: Callable[[], Signature]) -> None:
        raise RingReduceError(f"ringreduce: {label(describe())}: a set of one rank disagreed "
                              "with itself")


class BetweenNodesSmall(Way):
    """Several nodes, a small buffer: reduced on the node (its slots), then between nodes in the
    messages that carry the signature (crossnode.py, in C from the copy in to the copy out);
    `dst` is written once every digest agrees. Up to `limit` bytes: the smaller of the small
    message size and the node's slots. It begins without waiting (`publish`), so an
    asynchronous call posts its first message on the caller's thread."""

    carries_signature = begins = True

    def __init__(self, parts: SetParts) -> None:
        super().__init__(parts)
        between, node = parts.between, parts.node
        self.limit = min(parts.settings.small_message_bytes,
                         node.small_bytes if node is not None else 1 << 62)
        self.exchange = between.small
        self.complete = partial(between.small_complete, False)

    def begin(self, address: int, nbytes: int, count: int, code: int, op: ReduceOp,
              divisor: float, factor: float, digest: int) -> Optional[bool]:
        between = self.parts.between
        if not between.small_publish(address, nbytes, count, code, op, divisor, factor, digest):
            return None
        return between.small_complete(True, address, count, code, op, divisor, factor)

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.nbytes <= self.limit

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts, between = self.parts, self.parts.between
        count, nbytes, address = src.numel(), src.nbytes, src.data_ptr()
        out = address if dst is src else dst.data_ptr()
        if spec.prescale != 1.0:
            ops.copy_stream(between.data_address, address, nbytes)
            _native.finish(spec.code, between.data_address, count, 1.0, spec.prescale)
            address = 0         # in place already
        if not self.exchange(address, out, nbytes, count, spec.code, spec.op,
                             parts.divisor(spec.op), spec.postscale, spec.digest or 0):
            self.explain(spec.describe)

    def explain(self, describe: Callable[[], Signature]) -> None:
        """The exchange found different digests (or a message without data): PeersJoined,
        OutOfOrder or MismatchError, the same on every member."""
        self.parts.negotiator.judge(self.parts.between.last_digests(), describe)
        raise RingReduceError(f"ringreduce: {label(describe())}: a message between nodes came "
                              "without data while every digest agreed")


class _OnNode(Way):
    """The node's shared-memory window (shm.py, native/node.c); across nodes, our ring between
    nodes (over the cross communicator) finishes what the node reduced."""

    def explain(self, describe: Callable[[], Signature]) -> None:
        """The node's exchange found different digests: PeersJoined, OutOfOrder or
        MismatchError, the same on every member."""
        self.parts.negotiator.judge(self.parts.node.last_headers()[0], describe)

    def digest(self, spec: ReduceSpec) -> int:
        """The digest the node exchange compares (0: none). It rides with the data on one node;
        across nodes, or when the input is scaled before the exchange (so a mismatch would find
        it changed), the set checks it first."""
        if self.parts.one_node and spec.prescale == 1.0:
            return spec.digest or 0
        self.parts.check(spec)
        return 0

    def finish(self, spec: ReduceSpec) -> tuple[float, float]:
        """What the node's last reduction step divides and scales by: everything on one node;
        nothing across nodes, where the ring between nodes finishes each chunk."""
        parts = self.parts
        return (parts.divisor(spec.op), spec.postscale) if parts.one_node else (1.0, 1.0)


class NodeSlots(_OnNode):
    """Up to `limit` bytes: one slot per rank, every rank reducing every slot in rank order;
    across nodes, then our ring between nodes."""

    def __init__(self, parts: SetParts) -> None:
        super().__init__(parts)
        self.limit = parts.node.small_bytes
        self.exchange = parts.node.small

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.nbytes <= self.limit

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts = self.parts
        digest = self.digest(spec)
        src = parts.prescaled(src, dst, spec)
        divisor, factor = self.finish(spec)
        if not self.exchange(src.data_ptr(), dst.data_ptr(), src.nbytes, src.numel(), spec.code,
                             spec.op, divisor, factor, digest):
            self.explain(spec.describe)
        if not parts.one_node:
            parts.ring(parts.cross, "cross", as_array(dst), spec)


class NodeSlotsOnOneNode(NodeSlots):
    """Every member on one node: the slots' exchange carries the signature with the data, and
    begins without waiting, in C (the small way's fast path)."""

    carries_signature = begins = True

    def __init__(self, parts: SetParts) -> None:
        super().__init__(parts)
        self.begin = parts.node.small_now
        self.complete = partial(parts.node.small_complete, False)


class NodeBlocks(_OnNode):
    """Any size: block by block through cache-sized staging areas, each rank reducing its own
    chunk."""

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts = self.parts
        digest = self.digest(spec)
        src = parts.prescaled(src, dst, spec)
        divisor, factor = self.finish(spec)
        flat = as_array(dst)

        def between_nodes(first: int, count: int) -> None:
            parts.ring(parts.cross, "cross", flat[first:first + count], spec)

        if not parts.node.large(src.data_ptr(), dst.data_ptr(), src.numel(), spec.code, spec.op,
                                divisor, factor, digest,
                                None if parts.one_node else between_nodes):
            self.explain(spec.describe)


class MpiGather(Way):
    """Up to the small message size: the members' digests gathered by MPI, then, where they
    agree, every member's buffer, and the rows reduced in rank order on every member. Its
    exchange checks the signature before it writes the output, so the small way takes it whole
    (small_way.py), from the public call: where no shared memory serves (one rank per node on a
    number of nodes recursive doubling does not take, a set whose nodes hold different numbers
    of its members, RINGREDUCE_SHARED_MEMORY=0)."""

    carries_signature = True

    def __init__(self, parts: SetParts) -> None:
        super().__init__(parts)
        self.limit = parts.settings.small_message_bytes
        self._memory = mpi().buffer.fromaddress

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.nbytes <= self.limit

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts, address, count = self.parts, src.data_ptr(), src.numel()
        if spec.prescale != 1.0:        # (not into dst: it is written once the digests agree)
            staged = parts.scratch.get("prescaled", _BYTES, src.nbytes)
            address = ops.address(staged)
            ops.copy_stream(address, src.data_ptr(), src.nbytes)
            _native.finish(spec.code, address, count, 1.0, spec.prescale)
        if not self.exchange(address, dst.data_ptr(), src.nbytes, count, spec.code, spec.op,
                             parts.divisor(spec.op), spec.postscale, spec.digest or 0):
            self.explain(spec.describe)

    def exchange(self, src: int, dst: int, nbytes: int, count: int, code: int, op: ReduceOp,
                 divisor: float, scale: float, digest: int,
                 output: Optional[Callable[[], int]] = None) -> bool:
        """Allreduce `nbytes` at address `src` into `dst` (or into what `output()` makes, once
        our data is on its way); False, with nothing written, where the digests differ."""
        parts, memory, size = self.parts, self._memory, self.parts.size
        if not parts.negotiator.digests_agree(digest):
            return False
        rows = parts.scratch.get("gather", _BYTES, size * nbytes)
        request = parts.comm.Iallgather(memory(src, nbytes), rows) if nbytes else None
        if output is not None:
            dst = output()
        if request is not None:
            parts.wait(request)
            first = ops.address(rows)
            _native.combine(code, op, first, first + nbytes, dst, count, False, 1.0, 1.0)
            for row in range(2, size):
                _native.combine(code, op, dst, first + row * nbytes, dst, count, False, 1.0,
                                1.0)
            if divisor != 1.0 or scale != 1.0:
                _native.finish(code, dst, count, divisor, scale)
        return True

    def explain(self, describe: Callable[[], Signature]) -> None:
        """The digests differed: PeersJoined, OutOfOrder or MismatchError, the same on every
        member."""
        self.parts.negotiator.judge(self.parts.negotiator.last_digests(), describe)
        raise RingReduceError(f"ringreduce: {label(describe())}: the digests differed, then "
                              "agreed")


class MpiRing(Way):
    """Any size: our segmented ring, reduce-scatter then allgather, over MPI."""

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts = self.parts
        parts.check(spec)
        if spec.prescale == 1.0 and dst.data_ptr() != src.data_ptr():    # out of place
            parts.ring(parts.comm, "ring", as_array(dst), spec, as_array(src))
        else:
            parts.ring(parts.comm, "ring",
                       as_array(parts.prescaled(src, dst, spec, always_copy=True)), spec)
