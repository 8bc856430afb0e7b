"""The ways an allreduce can go, as one ordered table: each way says whether it takes a request
(`applies`) and moves its bytes (`run`), and the transport runs the first that applies, as
Horovod's OperationManager runs the first enabled op and NCCL picks from its transport list. A
new data path is one more class here and one line in `allreduce_ways`.

A set's table holds only the ways its topology allows (built once), so `applies` looks at the
request alone. In order:

    Adasum          op=Adasum: Horovod's Adasum over the set's ranks (adasum.py)
    CUDA-aware      a CUDA tensor, MPI reading device memory (or a set of one): our ring on
                    device memory (cuda.py)
    staged GPU      a CUDA tensor otherwise: pieces through pinned host memory, each piece
                    reduced by the host ways below
    alone           a set of one rank: copy and scale
    between nodes   several nodes, small: the node's slots, then recursive doubling between the
                    nodes, the signature in the same messages (crossnode.py; a power-of-two
                    number of nodes with as many members each)
    node slots      members share nodes, small: one shared-memory slot per rank, in C (shm.py,
                    native/node.c); across nodes, then our ring between nodes
    node blocks     members share nodes: cache-sized shared-memory blocks; across nodes, our
                    ring between nodes on each reduced chunk
    MPI gather      no shared memory, small: MPI gather and reduce in rank order (ring.py)
    MPI ring        no shared memory: our segmented ring reduce-scatter + allgather (ring.py)

The GPU way comes before the host ways, so those see CPU tensors only. A way whose one exchange
carries the signature with the data (`carries_signature`) also serves the small way's fast path
(small_way.py): its `limit`, `exchange` and `explain`.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import numpy as np
import torch

from . import _native, adasum, cuda, kernels, ring
from .buffers import as_array
from .config import Settings
from .crossnode import BetweenNodes
from .errors import RingReduceError
from .kernels import ReduceOp
from .mpi import mpi
from .negotiation import Negotiator
from .reduce_spec import ReduceSpec
from .scratch import ScratchPool
from .shm import NodeWindow
from .signature import Signature, label

_AVERAGE = ReduceOp.Average     # (an enum's class attribute costs a lookup each time)
_BYTES = np.dtype(np.uint8)
Pieces = Callable[[ReduceSpec], Callable[[np.ndarray], None]]


def scale(tensor: torch.Tensor, spec: ReduceSpec, divisor: float, factor: float) -> None:
    """A contiguous CPU tensor times factor / divisor, in place (kernels.finish)."""
    if divisor != 1.0 or factor != 1.0:
        _native.finish(spec.code, tensor.data_ptr(), tensor.numel(), divisor, factor)


class SetParts:
    """What one process set's ways share: `comm` holds its members, `cross` those with this
    rank's local rank; its node window and exchanges between nodes (None where the topology has
    none), its negotiator (the signature check), settings and scratch (CPU and GPU)."""

    def __init__(self, comm: Any, cross: Any, node: Optional[NodeWindow],
                 between: Optional[BetweenNodes], negotiator: Negotiator, settings: Settings,
                 scratch: ScratchPool, device_scratch: cuda.DeviceScratch) -> None:
        self.comm, self.cross, self.node, self.between = comm, cross, node, between
        self.negotiator, self.settings = negotiator, settings
        self.scratch, self.device_scratch = scratch, device_scratch
        self.size = comm.size
        self.one_node = node is not None and cross.size == 1
        self.average_divisor = float(comm.size)     # (the small ways' division, precomputed)
        self.wait = negotiator.watch.wait_request   # every MPI wait: stalls, departures, failures

    def check(self, spec: ReduceSpec) -> None:
        """The signature exchange every way begins with, across the whole set. A spec checked
        already sends 0 (which every member sends alike): a member that has joined must still
        meet every exchange (on one node, the node's own exchange carries the digest)."""
        self.negotiator.check(spec.describe(), precomputed=spec.digest or 0)

    def divisor(self, op: ReduceOp) -> float:
        """What the sum is divided by: the set's size for Average."""
        return self.average_divisor if op is _AVERAGE else 1.0

    def prescaled(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec,
                  always_copy: bool = False) -> torch.Tensor:
        """The input to reduce: `src`, or `dst` holding src * prescale (or a copy of src, with
        `always_copy`, for ways that reduce in place)."""
        if spec.prescale == 1.0 and not always_copy:
            return src
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        scale(dst, spec, 1.0, spec.prescale)
        return dst

    def finisher(self, spec: ReduceSpec) -> Optional[Callable[[np.ndarray], None]]:
        """What happens to each finished chunk: times postscale / size for Average, times
        the postscale otherwise (Horovod's one factor)."""
        divisor = self.divisor(spec.op)
        if divisor == 1.0 and spec.postscale == 1.0:
            return None
        return lambda part: kernels.finish(part, spec.dtype, divisor, spec.postscale)

    def ring(self, comm: Any, purpose: str, buf: np.ndarray, spec: ReduceSpec,
             source: Optional[np.ndarray] = None) -> None:
        """Our ring over `comm` (the set, or the cross communicator between nodes), in place or
        from `source`."""
        finish = self.finisher(spec)
        if comm.size == 1 or buf.size == 0:
            if source is not None:
                buf[...] = source
            if finish is not None:
                finish(buf)
            return
        segment = max(1, self.settings.segment_bytes // buf.itemsize)
        bounds = ring.chunk_bounds(ring.balanced_counts(buf.size, comm.size))
        scratch = self.scratch.get(purpose, buf.dtype, ring.scratch_elements(bounds, segment))
        ring.ring_allreduce(comm, buf, kernels.reducer(spec.dtype, spec.op), scratch, segment,
                            self.wait, finish, source)


class Way:
    """One entry of the table: `applies` says whether it takes a request, `run` allreduces
    `src` into `dst` (the same tensor, or a contiguous one of its size and dtype on its device),
    writing `dst` only once the signatures agree."""

    carries_signature = False   # its one exchange carries the signature with the data
    # A way whose exchange can begin without waiting, in place (the small way begins
    # asynchronous calls with these): `begin(address, nbytes, count, dtype, op, divisor,
    # scale, digest)` posts ours and, where every peer's is there already, finishes: True
    # (done) or False (the digests differ, nothing written); None when the peers are still
    # to come, and `complete(address, count, dtype, op, divisor, scale)` then finishes it.
    begin: Optional[Callable[..., Optional[bool]]] = None
    complete: Optional[Callable[..., bool]] = None

    def __init__(self, parts: SetParts) -> None:
        self.parts = parts

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return True

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        raise NotImplementedError


class Adasum(Way):
    """Horovod's Adasum over the set's communicator; GPU tensors go through host memory, as
    Horovod's do without NCCL."""

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return spec.op == ReduceOp.Adasum

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts = self.parts
        parts.check(spec)
        host = src.cpu() if src.is_cuda else parts.prescaled(src, dst, spec, always_copy=True)
        if src.is_cuda:
            scale(host, spec, 1.0, spec.prescale)
        adasum.adasum_allreduce(parts.comm, as_array(host), spec.dtype, spec.lengths,
                                parts.scratch.get, parts.wait)
        scale(host, spec, 1.0, spec.postscale)
        if src.is_cuda:
            dst.copy_(host)


class CudaAware(Way):
    """A CUDA tensor where MPI reads device memory, or in a set of one: the ring (the gather,
    for small buffers) on device memory, reduced by our kernels (cuda.py)."""

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.is_cuda

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        parts, settings = self.parts, self.parts.settings
        parts.check(spec)
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        cuda.reduce_in_device_memory(cuda.as_device_array(dst), spec.dtype, spec.op,
                                     spec.prescale, spec.postscale, parts.comm,
                                     settings.small_message_bytes, settings.segment_bytes,
                                     parts.device_scratch, parts.wait)


class StagedGpu(Way):
    """A CUDA tensor where MPI reads host memory only: piece by piece through pinned host
    memory, each piece reduced by the host ways (`pieces(spec)`, the signature checked here
    once for the whole buffer)."""

    def __init__(self, parts: SetParts, pieces: Pieces) -> None:
        super().__init__(parts)
        self.pieces = pieces

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return src.is_cuda

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self.parts.check(spec)
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        cuda.reduce_staged(cuda.as_device_array(dst), self.pieces(spec),
                           self.parts.device_scratch)


class Alone(Way):
    """A set of one rank: copy and scale. With no member to meet, its exchange is the whole
    collective and is ready at once, so small calls take the small way's fast path (an
    asynchronous one too, on the caller's thread, rather than a hand-off to the engine thread
    that costs ten times the copy)."""

    carries_signature = True

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

    carries_signature = True

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
            kernels.copy_stream(between.data_address, address, nbytes)
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
    """Up to `limit` bytes: one slot per rank, every rank reducing every slot in rank order. On
    one node the exchange carries the signature with the data."""

    def __init__(self, parts: SetParts) -> None:
        super().__init__(parts)
        self.limit = parts.node.small_bytes
        self.exchange = parts.node.small
        self.carries_signature = parts.one_node
        if parts.one_node:
            self.begin = parts.node.small_now
            self.complete = partial(parts.node.small_complete, False)

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
            address = kernels.address(staged)
            kernels.copy_stream(address, src.data_ptr(), src.nbytes)
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
            first = kernels.address(rows)
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


def allreduce_ways(parts: SetParts, pieces: Pieces) -> list[Way]:
    """A set's table, in order, with the ways its topology allows. `pieces(spec)`: how the
    staged GPU way reduces each piece (by this table's host ways)."""
    ways: list[Way] = [Adasum(parts)]
    if parts.settings.cuda_aware or parts.size == 1:
        ways.append(CudaAware(parts))
    else:
        ways.append(StagedGpu(parts, pieces))
    if parts.size == 1:
        return ways + [Alone(parts)]
    if parts.between is not None:
        ways.append(BetweenNodesSmall(parts))
    if parts.node is not None:
        return ways + [NodeSlots(parts), NodeBlocks(parts)]
    return ways + [MpiGather(parts), MpiRing(parts)]
