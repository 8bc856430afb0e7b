"""How the bytes of one process set's collectives move: the one place that picks the way.

`Transport.allreduce` takes a typed description of the reduction (`ReduceSpec`: dtype, op, scale
factors, signature) and two tensors, and picks one way by where the buffer lives and where the
set's members live:

    op=Adasum                Horovod's Adasum over the set's ranks (adasum.py)
    a set of one rank        copy and scale
    CUDA tensor              CUDA-aware MPI: our ring on device memory (cuda.py)
                             otherwise: pieces staged through pinned host memory, each piece
                             reduced by the host ways below
    several nodes, small     the node's slots, then recursive doubling between the nodes,
                             the signature in the same messages (crossnode.py; a power-of-two
                             number of nodes with as many members each)
    members share nodes      the node's shared-memory window, in C (shm.py, native/node.c):
                             one slot per rank (small) or cache-sized blocks (large); across
                             several nodes our ring between nodes runs on each reduced chunk
    otherwise                MPI gather and reduce in rank order (small), our segmented ring
                             reduce-scatter + allgather (large) (ring.py)

The other collectives have one way each, over MPI, after the same signature check
(negotiation.py). Every collective begins in the set's stall watch, which names the collective
if the set stalls in it.

Join (Horovod's `join()`): a member that has run out of data sends the JOINED mark in every
signature exchange. When the others' exchange meets it, every member takes part in one join
round (an allgather of what each runs); an allreduce then runs again with the joined members
contributing zeros, other collectives raise `JoinedError` on the members that called them. The
joined members leave once every member has joined.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from . import _native, adasum, crossnode, cuda, kernels, ring
from .buffers import CODES, NAMES, as_array, as_tensor, fresh
from .config import Settings
from .errors import JoinedError, MismatchError, RingReduceError
from .kernels import ReduceOp
from .negotiation import JOINED, Negotiator, PeersJoined
from .shm import NodeWindow
from .signature import Signature, describe_mismatch, label
from .stall import StallWatch

_AVERAGE = ReduceOp.Average     # (an enum's class attribute costs a lookup each time)

DTYPES = {name: dtype for dtype, name in NAMES.items()}
# What a member runs, as a join round shares it: (collective, signature, reduction or None),
# the reduction being (dtype name, element count, op, prescale, postscale, on a GPU).
Description = tuple[str, Signature, Optional[tuple]]


class ReduceSpec:
    """What a reduction computes, and how the ranks recognise it as the same collective.

    `digest` is its signature's digest, or None when the signature was checked already (the
    later dtype groups of a grouped allreduce). `signature` is the signature, or a function
    that makes it: it is only needed for messages (mismatch, stall). `lengths`: the element
    counts of the tensors fused in the buffer, which Adasum weighs each on its own."""

    __slots__ = ("dtype", "code", "op", "prescale", "postscale", "digest", "signature",
                 "lengths")

    def __init__(self, dtype: torch.dtype, op: ReduceOp, prescale: float = 1.0,
                 postscale: float = 1.0, digest: Optional[int] = None,
                 signature: Union[Signature, Callable[[], Signature], None] = None,
                 lengths: Optional[Sequence[int]] = None) -> None:
        self.dtype, self.code, self.op = dtype, CODES[dtype], op
        self.prescale, self.postscale = float(prescale), float(postscale)
        self.digest, self.signature, self.lengths = digest, signature, lengths

    def describe(self) -> Signature:
        signature = self.signature
        return (signature() if callable(signature) else signature) or {"collective": "allreduce"}

    def __str__(self) -> str:
        """How a stall report names the collective."""
        return label(self.describe())

    def unchecked(self) -> "ReduceSpec":
        """The same reduction, for buffers whose signature was checked already."""
        return ReduceSpec(self.dtype, self.op, self.prescale, self.postscale, None,
                          self.signature, self.lengths)


class ScratchPool:
    """Reusable scratch memory, one growing block per purpose, so steady-state steps allocate
    nothing. Only the thread running one of the set's collectives uses it."""

    def __init__(self) -> None:
        self._blocks: dict[str, np.ndarray] = {}

    def get(self, purpose: str, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        block = self._blocks.get(purpose)
        if block is None or block.nbytes < nbytes:
            block = self._blocks[purpose] = np.empty(max(nbytes, 64), dtype=np.uint8)
        return block[:nbytes].view(dtype)


def _scale(tensor: torch.Tensor, spec: ReduceSpec, divisor: float, scale: float) -> None:
    """A contiguous CPU tensor divided by `divisor`, then multiplied by `scale`, in place."""
    if divisor != 1.0 or scale != 1.0:
        _native.finish(spec.code, tensor.data_ptr(), tensor.numel(), divisor, scale)


class Transport:
    """The ways of one process set: `comm` holds its members, `local` those on this rank's node,
    `cross` those with the same local rank; `ranks` are the members' global ranks."""

    def __init__(self, comm: Any, local: Any, cross: Any, settings: Settings,
                 watch: StallWatch, ranks: Sequence[int], homogeneous: bool) -> None:
        """`homogeneous`: every node holds as many members. Shared memory needs it, so that
        each local rank's chunk has the same size as its peers' on the other nodes."""
        self.comm, self.cross, self.settings, self.watch = comm, cross, settings, watch
        self.size, self.ranks = comm.size, list(ranks)
        self.node = (NodeWindow(local, settings.shared_small_bytes, settings.block_bytes, watch)
                     if settings.shared_memory and local.size > 1 and homogeneous else None)
        self.one_node = self.node is not None and cross.size == 1
        self.scratch = ScratchPool()
        self.device_scratch = cuda.DeviceScratch()    # the GPU side's, empty until a GPU is used
        # Recursive doubling between nodes starts from the node's headers and data: gathered
        # in its shared memory, or this rank's alone when it is the only one on its node.
        self.between = (crossnode.BetweenNodes(comm, local, cross, self.node, watch,
                                               settings.small_message_bytes)
                        if crossnode.applies(cross, homogeneous)
                        and (self.node is not None or local.size == 1) else None)
        self.negotiator = Negotiator(comm, watch, ranks, self.node if self.one_node else None,
                                     self.between)
        # Up to this size an allreduce goes the small way between nodes (the node's slots must
        # hold it too); -1: no such way.
        self.between_small_bytes = -1 if self.between is None else min(
            settings.small_message_bytes, self.node.small_bytes if self.node else 1 << 62)
        # Up to this size a small allreduce may skip the engine's queue (collectives.py): the
        # ways whose exchange carries the signature with the data.
        self.fast_small_bytes = (self.node.small_bytes if self.one_node
                                 else self.between_small_bytes)
        self.average_divisor = float(comm.size)     # (the small paths' division, precomputed)
        # The fast path's exchange: both take (src, dst, bytes, count, dtype code, op, divisor,
        # scale, digest, output) and say whether the digests agreed; and what tells why not.
        self._small, self._small_disagreement = (
            (self.node.small, self._disagreement) if self.one_node else
            (self.between.small, self._disagreement_between) if self.between is not None else
            (None, None))

    def free(self) -> None:
        self.device_scratch.free()
        if self.node is not None:
            self.node.free()
        self.watch.free()

    # ------------------------------------------------------------------ allreduce

    def allreduce(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """Allreduce `src` into `dst` (the same tensor, or a contiguous one of its size and
        dtype on its device); `dst` is written only once the signatures agree."""
        self.watch.begin(spec)
        try:
            self._way(src, dst, spec)
        except PeersJoined:
            self._after_joins(src, dst, spec)

    def small_allreduce(self, src: torch.Tensor, in_place: bool, code: int, op: ReduceOp,
                        postscale: float, digest: int, make_spec: Callable[[], ReduceSpec]
                        ) -> torch.Tensor:
        """collectives.py's fast path: a contiguous CPU tensor of at most `fast_small_bytes`
        (dtype code `code`), no prescale, its signature digested: straight into the node's
        slots, or crossnode's C rounds between nodes, the digest riding with the data. Returns
        `src`, or out of place a new tensor, allocated once our data is on its way (the
        allocation costs as much as a message, and every member would wait for it). The
        ReduceSpec is made only where one is needed (a mismatch, a join, a stall report): at a
        few microseconds a call, every step of Python shows."""
        self.watch.begin(make_spec)
        address = src.data_ptr()
        made: Optional[torch.Tensor] = None
        if in_place:
            output = None
        else:
            def output() -> int:
                nonlocal made
                made = torch.empty_like(src)
                return made.data_ptr()
        try:
            if not self._small(address, address, src.nbytes, src.numel(), code, op,
                               self.average_divisor if op is _AVERAGE else 1.0, postscale,
                               digest, output):
                self._small_disagreement(lambda: make_spec().describe())
        except PeersJoined:
            if not in_place and made is None:
                made = torch.empty_like(src)
            self._after_joins(src, src if in_place else made, make_spec())
        return src if in_place else made

    def _after_joins(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """Some members have joined: agree with the others on what runs, then run it without
        the signature check (the joined ones contribute zeros)."""
        reduction = (NAMES[spec.dtype], src.numel(), int(spec.op), spec.prescale,
                     spec.postscale, src.is_cuda)
        self._join_round(("allreduce", spec.describe(), reduction))
        self._way(src, dst, spec.unchecked())

    def _way(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        if spec.op == ReduceOp.Adasum:
            self._adasum(src, dst, spec)
        else:
            (self._device if src.is_cuda else self._host)(src, dst, spec)

    def _adasum(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """Horovod's Adasum over the set's communicator; GPU tensors go through host memory,
        as Horovod's do without NCCL."""
        self._check(spec)
        host = src.cpu() if src.is_cuda else self._prescaled(src, dst, spec, always_copy=True)
        if src.is_cuda:
            _scale(host, spec, 1.0, spec.prescale)
        adasum.adasum_allreduce(self.comm, as_array(host), spec.dtype, spec.lengths,
                                self.scratch.get)
        _scale(host, spec, 1.0, spec.postscale)
        if src.is_cuda:
            dst.copy_(host)

    def _host(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """Contiguous CPU tensors: the node ways take their addresses, the MPI ways NumPy
        views (which cost a microsecond each, as much as a small exchange on a node)."""
        if self.size == 1:
            self._alone(src, dst, spec)
        elif src.nbytes <= self.between_small_bytes:
            self._between_nodes_small(src, dst, spec)
        elif self.node is None:
            small = src.nbytes <= self.settings.small_message_bytes
            (self._mpi_gather if small else self._mpi_ring)(src, dst, spec)
        elif src.nbytes <= self.node.small_bytes:
            self._node_slots(src, dst, spec)
        else:
            self._node_blocks(src, dst, spec)

    def _device(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self._check(spec)
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        cuda.reduce_device(cuda.as_device_array(dst), spec.dtype, spec.op, spec.prescale,
                           spec.postscale, self.comm, bool(self.settings.cuda_aware),
                           self.settings.small_message_bytes, self.settings.segment_bytes,
                           self._host_pieces(spec), self.device_scratch)

    def _host_pieces(self, spec: ReduceSpec) -> Callable[[np.ndarray], None]:
        """How the staged GPU way reduces each piece in pinned host memory: by the host ways,
        the signature checked already."""
        pieces = spec.unchecked()

        def host(piece: np.ndarray) -> None:
            staged = as_tensor(piece, spec.dtype)
            self._host(staged, staged, pieces)

        return host

    def _alone(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self._prescaled(src, dst, spec, always_copy=True)
        _scale(dst, spec, 1.0, spec.postscale)

    def _mpi_gather(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self._check(spec)
        buf = as_array(self._prescaled(src, dst, spec, always_copy=True))
        if buf.size:
            gathered = self.scratch.get("gather", buf.dtype, self.size * buf.size)
            ring.gather_allreduce(self.comm, buf, kernels.reducer(spec.dtype, spec.op),
                                  gathered.reshape(self.size, -1), self._finisher(spec))

    def _mpi_ring(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        self._check(spec)
        if spec.prescale == 1.0 and dst.data_ptr() != src.data_ptr():    # out of place
            self._ring(self.comm, "ring", as_array(dst), spec, as_array(src))
        else:
            self._ring(self.comm, "ring", as_array(self._prescaled(src, dst, spec, True)), spec)

    def _node_slots(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        digest = self._digest_for_node(spec)
        src = self._prescaled(src, dst, spec)
        divisor, scale = self._node_finish(spec)
        if not self.node.small(src.data_ptr(), dst.data_ptr(), src.nbytes, src.numel(),
                               spec.code, spec.op, divisor, scale, digest):
            self._disagreement(spec.describe)
        if not self.one_node:
            self._ring(self.cross, "cross", as_array(dst), spec)

    def _between_nodes_small(self, src: torch.Tensor, dst: torch.Tensor,
                             spec: ReduceSpec) -> None:
        """Several nodes, a small buffer: reduced on the node (its slots), then between nodes
        in the messages that carry the signature (crossnode.py, in C from the copy in to the
        copy out); `dst` is written once every digest agrees."""
        between, count, nbytes, address = self.between, src.numel(), src.nbytes, src.data_ptr()
        out = address if dst is src else dst.data_ptr()
        if spec.prescale != 1.0:
            _native.copy_stream(between.data_address, address, nbytes)
            _native.finish(spec.code, between.data_address, count, 1.0, spec.prescale)
            address = 0         # in place already
        if not between.small(address, out, nbytes, count, spec.code, spec.op,
                             self._divisor(spec.op), spec.postscale, spec.digest or 0):
            self._disagreement_between(spec.describe)

    def _node_blocks(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        digest = self._digest_for_node(spec)
        src = self._prescaled(src, dst, spec)
        divisor, scale = self._node_finish(spec)
        flat = as_array(dst)

        def between_nodes(first: int, count: int) -> None:
            self._ring(self.cross, "cross", flat[first:first + count], spec)

        if not self.node.large(src.data_ptr(), dst.data_ptr(), src.numel(), spec.code, spec.op,
                               divisor, scale, digest, None if self.one_node else between_nodes):
            self._disagreement(spec.describe)

    # ------------------------------------------------------------------ pieces of the ways

    def _check(self, spec: ReduceSpec) -> None:
        """The signature exchange every way begins with, across the whole set. A spec checked
        already sends 0 (which every member sends alike): a member that has joined must still
        meet every exchange (on one node, the node's own exchange carries the digest)."""
        self.negotiator.check(spec.describe(), precomputed=spec.digest or 0)

    def _disagreement(self, describe: Callable[[], Signature]) -> None:
        """The node's exchange found different digests: PeersJoined or MismatchError."""
        self.negotiator.judge(self.node.last_headers()[0], describe)

    def _disagreement_between(self, describe: Callable[[], Signature]) -> None:
        """The exchange between nodes found different digests (or a message without data)."""
        self.negotiator.judge(self.between.last_digests(), describe)
        raise RingReduceError(f"ringreduce: {label(describe())}: a message between nodes came "
                              "without data while every digest agreed")

    def _digest_for_node(self, spec: ReduceSpec) -> int:
        """The digest the node exchange compares (0: none). It rides with the data on one node;
        across nodes, or when the input is scaled before the exchange (so a mismatch would find
        it changed), the set checks it first."""
        if self.one_node and spec.prescale == 1.0:
            return spec.digest or 0
        self._check(spec)
        return 0

    def _prescaled(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec,
                   always_copy: bool = False) -> torch.Tensor:
        """The input to reduce: `src`, or `dst` holding src * prescale (or a copy of src, with
        `always_copy`, for ways that reduce in place)."""
        if spec.prescale == 1.0 and not always_copy:
            return src
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        _scale(dst, spec, 1.0, spec.prescale)
        return dst

    def _divisor(self, op: ReduceOp) -> float:
        """What the sum is divided by: the set's size for Average."""
        return self.average_divisor if op is _AVERAGE else 1.0

    def _node_finish(self, spec: ReduceSpec) -> tuple[float, float]:
        """What the node's last reduction step divides and scales by: everything on one node;
        nothing across nodes, where the ring between nodes finishes each chunk."""
        return (self._divisor(spec.op), spec.postscale) if self.one_node else (1.0, 1.0)

    def _finisher(self, spec: ReduceSpec) -> Optional[Callable[[np.ndarray], None]]:
        """What happens to each finished chunk: Average's division, then the postscale."""
        divisor = self._divisor(spec.op)
        if divisor == 1.0 and spec.postscale == 1.0:
            return None
        return lambda part: kernels.finish(part, spec.dtype, divisor, spec.postscale)

    def _ring(self, comm: Any, purpose: str, buf: np.ndarray, spec: ReduceSpec,
              source: Optional[np.ndarray] = None) -> None:
        """Our ring over `comm` (the set, or the cross communicator between nodes), in place or
        from `source`."""
        finish = self._finisher(spec)
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
                            finish, source)

    # ------------------------------------------------------------------ join

    def join(self, device: Optional[torch.device]) -> int:
        """This member has run out of data: until every member has joined, take part in every
        allreduce the others run, with zeros (on `device`, or the one they use); returns the
        set rank that joined last (the highest of those that joined at the same point)."""
        point = self.watch.begun
        self.watch.set_joined(True)
        try:
            while True:
                digests, points = self.negotiator.exchange(JOINED, point)
                if (digests == JOINED).all():
                    self.watch.begun = int(points.max())    # every member counts alike again
                    return int(np.flatnonzero(points == points.max())[-1])
                description = self._join_round(None)
                if description is not None and description[2] is not None:
                    self._zeros(description[2], device)
        finally:
            self.watch.set_joined(False)

    def _join_round(self, mine: Optional[Description]) -> Optional[Description]:
        """After an exchange in which some members had joined, every member shares what it
        runs (None when joined). Returns the active members' common description; on an active
        member, MismatchError when they disagree among themselves."""
        everyone = self.comm.allgather(mine)
        active = [(r, d) for r, d in enumerate(everyone) if d is not None]
        if all(d[:2] == active[0][1][:2] for _, d in active):
            return active[0][1]
        if mine is not None:
            raise MismatchError(describe_mismatch([d[1] for _, d in active],
                                                  [self.ranks[r] for r, _ in active]))
        return None

    def _zeros(self, reduction: tuple, device: Optional[torch.device]) -> None:
        """A joined member's part in an allreduce: zeros of the others' dtype and length."""
        dtype_name, count, op, prescale, postscale, on_gpu = reduction
        where = (device or torch.device("cuda", torch.cuda.current_device())) if on_gpu \
            else torch.device("cpu")
        zeros = torch.zeros(count, dtype=DTYPES[dtype_name], device=where)
        self._way(zeros, zeros, ReduceSpec(zeros.dtype, ReduceOp(op), prescale, postscale))

    def _refuse_while_joined(self, signature: Signature, joined: PeersJoined) -> None:
        self._join_round((str(signature.get("collective")), signature, None))
        names = [self.ranks[r] for r in joined.ranks]
        raise JoinedError(
            f"ringreduce: {signature.get('collective')} '{signature.get('name')}' on rank "
            f"{self.ranks[self.comm.rank]}: ranks {names} of this process set have joined "
            "(join()); until every rank has joined only allreduces run, the joined ranks "
            "contributing zeros. Run it before join(), or after every rank has joined.")

    # ------------------------------------------------------------------ the other collectives

    def _begin(self, signature: Signature) -> None:
        self.watch.begin(functools.partial(label, signature))

    def check(self, signature: Signature, per_rank: int = 0,
              precomputed: Optional[int] = None) -> np.ndarray:
        """The signature check of a collective other than an allreduce; returns every
        member's `per_rank` value. JoinedError when some member has joined."""
        self._begin(signature)
        try:
            return self.negotiator.check(signature, per_rank, precomputed)
        except PeersJoined as joined:
            self._refuse_while_joined(signature, joined)

    def allgather(self, tensor: torch.Tensor, signature: Signature) -> torch.Tensor:
        """Every member's `tensor` concatenated along dimension 0 (which may differ)."""
        firsts = self.check(signature, per_rank=tensor.shape[0])
        out = fresh((int(firsts.sum()), *tensor.shape[1:]), tensor.dtype, tensor.device)
        row = math.prod(tensor.shape[1:])
        self.comm.Allgatherv(as_array(tensor), [as_array(out), (firsts * row).tolist()])
        return out

    def broadcast(self, tensor: torch.Tensor, root: int, signature: Signature) -> None:
        """Set member `root`'s `tensor` into every member's, in place."""
        self.check(signature)
        self.comm.Bcast(as_array(tensor), root=root)

    def alltoall(self, tensor: torch.Tensor, send_splits: np.ndarray,
                 signature: Signature) -> tuple[torch.Tensor, np.ndarray]:
        """Rows `send_splits[i]` of `tensor` to member i; returns what arrived, in member
        order, and how many rows came from each."""
        self.check(signature)
        recv_splits = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(send_splits, recv_splits)
        out = fresh((int(recv_splits.sum()), *tensor.shape[1:]), tensor.dtype, tensor.device)
        row = math.prod(tensor.shape[1:])
        self.comm.Alltoallv([as_array(tensor), (send_splits * row).tolist()],
                            [as_array(out), (recv_splits * row).tolist()])
        return out, recv_splits

    def reducescatter(self, array: np.ndarray, bounds: Sequence[tuple[int, int]],
                      spec: ReduceSpec) -> None:
        """Reduce `array` (ours to overwrite) so that this member's chunk `bounds[rank]` holds
        the finished result; the other chunks are left holding partial sums."""
        self.check(spec.describe(), precomputed=spec.digest)
        kernels.finish(array, spec.dtype, 1.0, spec.prescale)
        if self.size > 1:
            segment = max(1, self.settings.segment_bytes // array.itemsize)
            scratch = self.scratch.get("ring", array.dtype, ring.scratch_elements(bounds, segment))
            ring.reduce_scatter(self.comm, array, bounds, kernels.reducer(spec.dtype, spec.op),
                                scratch, segment)
        lo, hi = bounds[self.comm.rank]
        kernels.finish(array[lo:hi], spec.dtype, self._divisor(spec.op), spec.postscale)

    def barrier(self, signature: Signature) -> None:
        """Every member here; while some have joined, the join round itself is the barrier."""
        self._begin(signature)
        try:
            self.negotiator.check(signature)
        except PeersJoined:
            self._join_round(("barrier", signature, None))
            return
        self.comm.Barrier()

    def broadcast_object(self, obj: Any, root: int, signature: Signature) -> Any:
        self.check(signature)
        return self.comm.bcast(obj if self.comm.rank == root else None, root=root)

    def allgather_object(self, obj: Any, signature: Signature) -> list:
        self.check(signature)
        return self.comm.allgather(obj)
