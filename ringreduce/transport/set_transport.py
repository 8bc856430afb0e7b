"""How the bytes of one process set's collectives move: the one place that picks the way.

`Transport.allreduce` takes a typed description of the reduction (`ReduceSpec`: dtype, op, scale
factors, signature) and two tensors, and runs the first way of the set's table that applies
(ways.py: Adasum, the GPU ways, the node's shared memory, between nodes, MPI gather and ring).
The first way in it whose exchange carries the signature with the data also serves the small
way's fast path (`Transport.small`, small_way.py).

The other collectives have one way each, over MPI, after the same signature check
(negotiation.py). Every collective begins in the set's stall watch, which names the collective
if the set stalls in it, and waits for MPI there (nonblocking calls), so that a member that
leaves or fails meanwhile is noticed. A failure of this member's own inside a collective, other
than the errors every member raises alike, is told to the members first (`_telling`). Where
some members have joined (`join()`), an allreduce meets them in a join round and runs with
their zeros, the others raise JoinedError (joining.py).
"""
from __future__ import annotations

import functools
import io
import math
import pickle
from typing import Any, Callable, Optional, Sequence, TypeVar, cast

import cloudpickle
import numpy as np
import torch

from ..core.config import Settings
from ..core.errors import MismatchError, RingReduceError
from ..gpu import cuda
from ..kernels import ops
from ..kernels.buffers import as_array, as_tensor, fresh
from ..kernels.scratch import ScratchPool
from . import crossnode, ring
from .auto_names import AutoNames
from .joining import JoinRounds
from .negotiation import Negotiator, PeersJoined, tell_members
from .peer_node import PeerMemory
from .reduce_spec import ReduceSpec
from .shm import NodeWindow
from .signature import Signature, label
from .small_way import SmallWay
from .stall import StallWatch
from .way import SetParts, Way
from .ways import allreduce_ways

Method = TypeVar("Method", bound=Callable[..., Any])


def _telling(method: Method) -> Method:
    """A collective of the set; a failure of this member's own (anything but negotiation's
    AGREED) is told to the members before it is raised (StallWatch.failed): they may be waiting
    on this member, and the set's traffic is out of step."""
    @functools.wraps(method)
    def told(self: "Transport", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException as error:
            tell_members(self.watch, error)
            raise
    return cast(Method, told)


class Transport:
    """The ways of one process set: `comm` holds its members, `local` those on this rank's node,
    `cross` those with the same local rank; `ranks` are the members' global ranks."""

    def __init__(self, comm: Any, local: Any, cross: Any, settings: Settings,
                 watch: StallWatch, ranks: Sequence[int], homogeneous: bool,
                 names: Optional[AutoNames] = None) -> None:
        """`homogeneous`: every node holds as many members. Shared memory needs it, so that
        each local rank's chunk has the same size as its peers' on the other nodes. `names`:
        the set's automatic names, realigned when a deadlock fails collectives (negotiation)."""
        self.comm, self.settings, self.watch, self.size = comm, settings, watch, comm.size
        self.node = (NodeWindow(local, settings.shared_small_bytes, settings.block_bytes, watch)
                     if settings.shared_memory and local.size > 1 and homogeneous else None)
        self.one_node = self.node is not None and cross.size == 1
        self.scratch = ScratchPool()
        self.device_scratch = cuda.DeviceScratch()    # the GPU side's, empty until a GPU is used
        # Recursive doubling between nodes starts from the node's headers and data: gathered
        # in its shared memory, or this rank's alone when it is the only one on its node.
        between = (crossnode.BetweenNodes(comm, local, cross, self.node, watch,
                                          settings.small_message_bytes)
                   if crossnode.applies(cross, homogeneous)
                   and (self.node is not None or local.size == 1) else None)
        self.negotiator = Negotiator(comm, watch, ranks, self.node if self.one_node else None,
                                     between, names)
        self.parts = SetParts(comm, local, cross, homogeneous, self.node, between,
                              self.negotiator, settings, self.scratch, self.device_scratch)
        self.ways: list[Way] = allreduce_ways(self.parts, self.host_pieces)
        self.joins = JoinRounds(comm, ranks, watch, self.negotiator, self._way)
        # the GPU node way, where the table holds it; on one node it moves data too
        self.peer = next((way for way in self.ways if isinstance(way, PeerMemory)), None)
        self.moves_on_device = self.peer is not None and cross.size == 1
        signed = next((way for way in self.ways if way.carries_signature), None)
        self.small: Optional[SmallWay] = (None if signed is None else SmallWay(
            signed, watch, comm.size, self.joins.allreduce))

    def free(self) -> None:
        """Free what the transport made: its ways' memory, its device scratch and the node's
        window. (The stall watch is its set's, which frees it.)"""
        for way in self.ways:
            way.free()
        self.device_scratch.free()
        if self.node is not None:
            self.node.free()

    # ------------------------------------------------------------------ allreduce

    @_telling
    def allreduce(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """Allreduce `src` into `dst` (the same tensor, or a contiguous one of its size and
        dtype on its device); `dst` is written only once the signatures agree."""
        self.watch.begin(str(spec))
        try:
            self._way(src, dst, spec)
        except PeersJoined:
            self.joins.allreduce(src, dst, spec)

    def _way(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """The first way of the table that applies runs the allreduce."""
        for way in self.ways:
            if way.applies(src, spec):
                way.run(src, dst, spec)
                return
        raise RingReduceError(f"ringreduce: no way takes {label(spec.describe())} "
                              f"({src.device}, {src.nbytes} bytes)")

    def host_pieces(self, spec: ReduceSpec) -> Callable[[np.ndarray], None]:
        """How the staged GPU way reduces each piece in pinned host memory: by the host ways,
        the signature checked already."""
        pieces = spec.unchecked()

        def host(piece: np.ndarray) -> None:
            staged = as_tensor(piece, spec.dtype)
            self._way(staged, staged, pieces)

        return host

    # ------------------------------------------------------------------ join

    @_telling
    def join(self, device: Optional[torch.device]) -> int:
        """This member has run out of data (joining.py); returns the set rank that joined
        last."""
        return self.joins.join(device)

    # ------------------------------------------------------------------ the other collectives

    def _begin(self, signature: Signature) -> None:
        self.watch.begin(label(signature))

    @_telling
    def check(self, signature: Signature, per_rank: int = 0,
              precomputed: Optional[int] = None) -> np.ndarray:
        """The signature check of a collective other than an allreduce; returns every
        member's `per_rank` value. JoinedError when some member has joined."""
        self._begin(signature)
        try:
            return self.negotiator.check(signature, per_rank, precomputed)
        except PeersJoined as joined:
            self.joins.refuse(signature, joined)    # (returns for an elastic reset's meeting)
        return self.negotiator.check(signature, per_rank, precomputed)

    @_telling
    def allgather(self, tensor: torch.Tensor, signature: Signature) -> torch.Tensor:
        """Every member's `tensor` concatenated along dimension 0 (which may differ)."""
        firsts = self.check(signature, per_rank=tensor.shape[0])
        out = fresh((int(firsts.sum()), *tensor.shape[1:]), tensor.dtype, tensor.device)
        row = math.prod(tensor.shape[1:])
        if tensor.is_cuda and self.peer and self.peer.allgather(tensor, out,
                                                                (firsts * row).tolist()):
            return out
        host, gathered = _on_host(tensor), _on_host(out)
        self.watch.wait_request(self.comm.Iallgatherv(
            as_array(host), [as_array(gathered), (firsts * row).tolist()]))
        if gathered is not out:
            cuda.from_host(out, gathered)
        return out

    @_telling
    def broadcast(self, tensor: torch.Tensor, root: int, signature: Signature) -> None:
        """Set member `root`'s `tensor` into every member's, in place."""
        self.check(signature)
        if tensor.is_cuda and self.peer and self.peer.broadcast(tensor, root):
            return
        host = _on_host(tensor)
        self.watch.wait_request(self.comm.Ibcast(as_array(host), root=root))
        if host is not tensor:
            cuda.from_host(tensor, host)

    @_telling
    def alltoall(self, tensor: torch.Tensor, send_splits: np.ndarray,
                 signature: Signature) -> tuple[torch.Tensor, np.ndarray]:
        """Rows `send_splits[i]` of `tensor` to member i; returns what arrived, in member
        order, and how many rows came from each."""
        self.check(signature)
        recv_splits = np.empty(self.size, dtype=np.int64)
        self.watch.wait_request(self.comm.Ialltoall(send_splits, recv_splits))
        out = fresh((int(recv_splits.sum()), *tensor.shape[1:]), tensor.dtype, tensor.device)
        row = math.prod(tensor.shape[1:])
        self.watch.wait_request(self.comm.Ialltoallv(
            [as_array(tensor), (send_splits * row).tolist()],
            [as_array(out), (recv_splits * row).tolist()]))
        return out, recv_splits

    @_telling
    def reducescatter(self, array: np.ndarray, bounds: Sequence[tuple[int, int]],
                      spec: ReduceSpec) -> None:
        """Reduce `array` (ours to overwrite) so that this member's chunk `bounds[rank]` holds
        the finished result; the other chunks are left holding partial sums."""
        self.check(spec.describe(), precomputed=spec.digest)
        ops.finish(array, spec.dtype, 1.0, spec.prescale)
        if self.size > 1:
            segment = max(1, self.settings.segment_bytes // array.itemsize)
            scratch = self.scratch.get("ring", array.dtype, ring.scratch_elements(bounds, segment))
            ring.reduce_scatter(self.comm, array, bounds, ops.reducer(spec.dtype, spec.op),
                                scratch, segment, self.watch.wait_request)
        lo, hi = bounds[self.comm.rank]
        ops.finish(array[lo:hi], spec.dtype, self.parts.divisor(spec.op), spec.postscale)

    @_telling
    def barrier(self, signature: Signature) -> None:
        """Every member here; while some have joined, the join round itself is the barrier."""
        self._begin(signature)
        try:
            self.negotiator.check(signature)
        except PeersJoined:
            self.joins.round(("barrier", signature, None))
            return
        self.watch.wait_request(self.comm.Ibarrier())

    def broadcast_pickled(self, payload: memoryview, refused: Optional[Exception], root: int,
                          signature: Signature) -> Optional[Any]:
        """Member `root`'s `payload` (its object, `pickled`) on every member: the root's own
        buffer there, a copy on the others; None where the root's pickling `refused` in a set of
        one. A root that refused says so in its signature: every member then raises the same
        MismatchError, quoting it."""
        return self._broadcast(payload, refused, root, _quoting(signature, refused))

    def allgather_pickled(self, payload: memoryview, refused: Optional[Exception],
                          signature: Signature) -> Optional[list[bytes]]:
        """Every member's `payload` (its object, `pickled`), in set rank order. A member whose
        pickling `refused` says so as `broadcast_pickled`'s root does; None where every member
        refused alike: each raises its own error, and nothing is out of step."""
        return self._allgather(payload, refused, _quoting(signature, refused))

    def allgather_object(self, obj: Any, signature: Signature) -> list:
        """Every member's `obj`, unpickled, in set rank order (the set's own bookkeeping)."""
        payload, refused = pickled(obj)
        payloads = self.allgather_pickled(payload, refused, signature)
        if payloads is None:
            raise RingReduceError(f"ringreduce: {label(signature)}: no member could pickle "
                                  f"its object") from refused
        return [pickle.loads(one) for one in payloads]

    # A refusal that every member agreed on leaves the collective as a result, not an error:
    # the collective's telling (`_telling`) would shut the set down.

    @_telling
    def _broadcast(self, payload: memoryview, refused: Optional[Exception], root: int,
                   signature: Signature) -> Optional[Any]:
        lengths = self._check_refusable(signature, len(payload), refused)
        if refused is not None:
            return None
        buf = payload if self.comm.rank == root else bytearray(int(lengths[root]))
        if self.size > 1 and len(buf):
            self.watch.wait_request(self.comm.Ibcast(buf, root=root))
        return buf

    @_telling
    def _allgather(self, payload: memoryview, refused: Optional[Exception],
                   signature: Signature) -> Optional[list[bytes]]:
        lengths = self._check_refusable(signature, len(payload), refused)
        if refused is not None:
            return None
        everyone = np.empty(int(lengths.sum()), dtype=np.uint8)
        self.watch.wait_request(self.comm.Iallgatherv(
            np.frombuffer(payload, dtype=np.uint8), [everyone, lengths.tolist()]))
        bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
        return [everyone[lo:hi].tobytes() for lo, hi in zip(bounds, bounds[1:])]

    def _check_refusable(self, signature: Signature, per_rank: int,
                         refused: Optional[Exception]) -> np.ndarray:
        """The check of a collective this member may refuse (its signature then says why, and
        the MismatchError raised on every member carries this member's error as its cause).
        Where it passes with `refused`, every member refused alike (or the set has one)."""
        try:
            return self.check(signature, per_rank=per_rank)
        except MismatchError as mismatch:
            if refused is None:
                raise
            raise mismatch from refused


def pickled(obj: Any) -> tuple[memoryview, Optional[Exception]]:
    """`obj` pickled by value where pickle goes by name (cloudpickle, as Horovod: a lambda, a
    class of __main__), in writable memory (MPI's broadcast takes no read-only buffer; this
    saves copying it); or nothing, and the error (a lock, a socket: unpicklable)."""
    buffer = io.BytesIO()
    try:
        cloudpickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        return _NOTHING, error
    return buffer.getbuffer(), None


def _quoting(signature: Signature, refused: Optional[Exception]) -> Signature:
    """A collective's signature, quoting this member's refusal where it refused."""
    if refused is None:
        return signature
    return {**signature, "refused": f"{type(refused).__name__}: {refused}"}


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor that the GPU node way could not move (IPC failed after the call kept it
    on its device) goes through the host; a CPU one is itself."""
    return cuda.to_host(tensor) if tensor.is_cuda else tensor


_NOTHING = memoryview(bytearray())
