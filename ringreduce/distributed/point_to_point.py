"""torch.distributed's send and recv on a ringreduce group: MPI's non-blocking `Isend`/`Irecv`
on communicators of the group's own (duplicates of its set's, made when the group is), so that
no message of theirs can match one of the set's collectives; torch's tags are MPI tags.

Unlike the collectives, these run on the caller's thread (MPI_THREAD_MULTIPLE): a receive must
not wait in the set's engine, which would hold back every collective behind it. A send is two
messages: a header (the tensor's element count, bytes and dtype) on the channel's header
communicator, then the bytes on its data communicator. A receive takes the header first and
only then posts the receive of the bytes (`Channel.advance`), into the caller's tensor where
the sender's count and dtype are the receiver's, else into a scratch buffer that is dropped:
a tensor of another size or dtype is an error on the receiving rank naming both, the
caller's tensor is left untouched, and the channel stays usable. (Sending a small tensor's
bytes inside its header saved nothing measurable on one node: Python's part of a message
outweighs MPI's.)

`wait()` polls the requests (flat out, then yielding the core, then sleeping a little longer
each time: the peer may need the core), and never waits silently: past the set's stall check
time it logs a report naming the peer and the tag, every interval, and at the stall shutdown
time it ends the job, as a collective's wait does; a peer that shuts down without the message
raises ShutDownError; and torch's `wait(timeout)` raises past its timeout (messages.py). A
thread shared by every channel (poller.py), asleep while there is nothing to do, posts the
receives of bytes whose header came while no caller waits for them, and completes
`get_future()`'s futures, reporting and failing the messages it waits for in the same way.
"""
from __future__ import annotations

import struct
import threading
from typing import Any, Optional

import numpy as np
import torch

from ..core.errors import RingReduceError
from ..core.mpi import mpi
from ..core.state import abandon
from ..kernels.buffers import dtype_name
from ..transport.stall import StallWatch
from .arguments import copy_into
from .messages import MessageWork
from .poller import POLLER

_STRIDED = torch.strided
_NAME_BYTES = 24            # a header's room for the dtype's name ('float8_e4m3fnuz')
_HEADER = struct.Struct(f"=qq{_NAME_BYTES}s")   # element count, byte count, dtype name
_NAMES: dict[torch.dtype, bytes] = {}    # a dtype -> its name, as a header holds it


def _name(dtype: torch.dtype) -> bytes:
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = dtype_name(dtype).encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
    return name


def _header(tensor: torch.Tensor) -> bytes:
    """What a send tells the receiver first: the tensor's element count, byte count and dtype
    name. (struct, not NumPy: at a few microseconds a message, NumPy's calls show.)"""
    return _HEADER.pack(tensor.numel(), tensor.nbytes, _name(tensor.dtype))


def _fits(header: tuple, tensor: torch.Tensor) -> bool:
    """Whether a header's count and dtype (`_HEADER.unpack`ed) are `tensor`'s."""
    return header[0] == tensor.numel() and header[2] == _name(tensor.dtype)


def _memory(tensor: torch.Tensor) -> list:
    """An MPI message of a contiguous CPU tensor's bytes (the caller keeps the tensor)."""
    MPI = mpi()
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), MPI.BYTE]


def _described(header: tuple) -> str:
    """A header's count, dtype and bytes, in words."""
    count, nbytes, name = header
    return f"{count} {name.rstrip(bytes(1)).decode()} elements ({nbytes} bytes)"


class _Incoming:
    """A receive waiting for its header (`request`, into `message`) or for its turn to post
    the receive of its bytes (`Channel.advance`): `source` and `tag` as asked (MPI's
    ANY_SOURCE for any rank); once the header came, `sender` and `header` (unpacked);
    `landing` where the bytes go if they fit (`fits`: whether the header's count and dtype
    are its own)."""

    __slots__ = ("work", "message", "header", "request", "status", "source", "tag", "sender",
                 "landing", "fits")

    def __init__(self, work: MessageWork, message: bytearray, source: int, tag: int,
                 landing: torch.Tensor) -> None:
        self.work, self.message, self.source, self.tag = work, message, source, tag
        self.header: tuple = ()
        self.landing, self.status = landing, mpi().Status()
        self.request: Any = None
        self.sender: Optional[int] = None
        self.fits = False


class Channel:
    """Point-to-point messages between the members of one group: headers on `comm`, bytes on
    `data_comm` (both ours to free: duplicates of the group's set's communicator, so their
    ranks are the group's ranks); `watch` is the set's (its stall settings, and the members
    that have shut down)."""

    def __init__(self, comm: Any, data_comm: Any, label: str, watch: StallWatch) -> None:
        self.comm, self.data_comm, self.label, self.watch = comm, data_comm, label, watch
        self.tag_limit, self.size = comm.Get_attr(mpi().TAG_UB), comm.size
        self._order = threading.Lock()          # over _incoming and its header requests
        self._incoming: list[_Incoming] = []    # in the order the receives were made
        self.poller = POLLER

    def _check(self, what: str, tensor: torch.Tensor, peer: Optional[int], tag: int) -> None:
        """(Each test written for the common case's speed: a message costs microseconds.)"""
        def where() -> str:
            return f"ringreduce: {what}, rank {self.comm.rank}"

        if not isinstance(tensor, torch.Tensor) or tensor.layout is not _STRIDED:
            raise TypeError(f"{where()}: expected a dense torch.Tensor")
        if not (tensor.is_cpu or tensor.is_cuda):
            raise ValueError(f"{where()}: send and recv take CPU and CUDA tensors, not "
                             f"{tensor.device}")
        if peer is not None and not 0 <= peer < self.size:
            raise ValueError(f"{where()}: peer rank {peer} is not in this group of "
                             f"{self.size}")
        if not 0 <= tag <= self.tag_limit:
            raise ValueError(f"{where()}: tag {tag} is outside MPI's tags 0..{self.tag_limit}")

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> MessageWork:
        """Start sending `tensor` to group rank `peer`: its header, then its bytes."""
        what = f"send to rank {peer} (tag {tag}) on {self.label}"
        self._check(what, tensor, peer, tag)
        data = (tensor if tensor.is_cpu and tensor.is_contiguous()     # (only its bytes read)
                else tensor.detach().contiguous().cpu())     # (a CUDA tensor: a host copy)
        header = _header(data)
        requests = [self.comm.Isend(header, dest=peer, tag=tag),
                    self.data_comm.Isend(_memory(data), dest=peer, tag=tag)]
        return MessageWork(self, what, peer, tensor, requests, (header, data))

    def recv(self, tensor: torch.Tensor, peer: Optional[int], tag: int) -> MessageWork:
        """Start receiving into `tensor` from group rank `peer` (None: any): its header's
        receive is posted now, its bytes' once the header has come (`advance`)."""
        what = (f"recv from {'any rank' if peer is None else f'rank {peer}'} (tag {tag}) on "
                f"{self.label}")
        self._check(what, tensor, peer, tag)
        direct = tensor.is_contiguous() and not tensor.is_cuda     # (else: lands on the host)
        landing = (tensor if direct     # (only its memory written: no autograd record)
                   else torch.empty(tensor.shape, dtype=tensor.dtype))
        source = mpi().ANY_SOURCE if peer is None else peer
        header = bytearray(_HEADER.size)

        def arrived() -> None:
            if not incoming.fits:
                raise RingReduceError(
                    f"ringreduce: {what}, rank {self.comm.rank}: rank {incoming.sender} sent "
                    f"{_described(incoming.header)} for a tensor of {landing.numel()} "
                    f"{dtype_name(landing.dtype)} elements ({tuple(tensor.shape)}, "
                    f"{landing.nbytes} bytes), which is left as it was; send and recv "
                    "tensors of the same dtype and element count")
            if not direct:
                with torch.no_grad():
                    copy_into(tensor, landing)

        work = MessageWork(self, what, peer, tensor, arrived=arrived)
        incoming = _Incoming(work, header, source, tag, landing)
        with self._order:
            incoming.request = self.comm.Irecv(header, source=source, tag=tag)
            self._incoming.append(incoming)
        self.poller.advance(self)       # (after the append: see poller.Poller._loop)
        return work

    def waiting(self) -> int:
        """How many receives wait for their header, or for their turn (`advance`)."""
        return len(self._incoming)

    def advance(self) -> int:
        """Post the receive of the bytes of each receive whose header has come, from its
        sender with its tag, in the order the receives were made among those that a message
        could match (same tag; the same sender, or any): MPI keeps one sender's messages of a
        tag in order and matches them to receives in the order these were posted, so the
        bytes then reach the receive that got their header. They go into the receive's
        landing tensor where the header's count and dtype are its own, else into a scratch
        buffer that is dropped (the receive fails; the channel stays in step). Returns how
        many it posted."""
        MPI = mpi()
        if MPI.Is_finalized():      # (a receive left pending at the end of the script)
            return 0
        with self._order:
            held: list[tuple[int, int]] = []    # (source, tag) of the receives left waiting
            waiting = []
            for incoming in self._incoming:
                if incoming.sender is None and incoming.request.Test(incoming.status):
                    incoming.sender = incoming.status.Get_source()
                    incoming.header = _HEADER.unpack(incoming.message)
                sender, tag = incoming.sender, incoming.tag
                if sender is None or any(t == tag and s in (sender, MPI.ANY_SOURCE)
                                         for s, t in held):
                    held.append((incoming.source if sender is None else sender, tag))
                    waiting.append(incoming)
                    continue
                landing, work = incoming.landing, incoming.work
                incoming.fits = _fits(incoming.header, landing)
                if incoming.fits:
                    into, message = landing, _memory(landing)
                else:
                    into = np.empty(incoming.header[1], dtype=np.uint8)
                    message = [into, MPI.BYTE]
                work._source, work._buffers = sender, (into,)
                work._requests = [self.data_comm.Irecv(message, source=sender, tag=tag)]
            posted = len(self._incoming) - len(waiting)
            self._incoming = waiting
        return posted

    def abandon(self, work: MessageWork) -> None:
        """Forget a receive whose bytes' receive was never posted (its peer left): its header
        request and buffers are kept (core/state.abandon)."""
        with self._order:
            for incoming in self._incoming:
                if incoming.work is work:
                    abandon(incoming.request, incoming.message, incoming.landing)
            self._incoming = [i for i in self._incoming if i.work is not work]

    def free(self) -> None:
        """(destroy_process_group.) A receive still waiting for its header fails, its request
        and buffers kept (core/state.abandon)."""
        self.poller.forget(self)
        with self._order:
            dropped = [incoming.work for incoming in self._incoming]
        for work in dropped:
            work._fail(RingReduceError(f"ringreduce: {work._what}, rank {self.comm.rank}: "
                                       "the group was destroyed before the message came"))
        MPI = mpi()
        if not MPI.Is_finalized():
            for comm in (self.comm, self.data_comm):
                if comm != MPI.COMM_NULL:
                    comm.Free()
