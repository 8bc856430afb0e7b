"""torch.distributed's send and recv on a ringreduce group: MPI's non-blocking `Isend`/`Irecv`
on a communicator of the group's own (a duplicate of its set's, made when the group is), so
that no message of theirs can match one of the set's collectives; torch's tags are MPI tags.

Unlike the collectives, these run on the caller's thread (MPI_THREAD_MULTIPLE): a receive must
not wait in the set's engine, which would hold back every collective behind it. The message is
the tensor's bytes; a receive checks how many arrived, so a sender's tensor of another size is
an error on the receiving rank (a larger one is MPI's truncation error), never a partly written
tensor. `wait()` polls the request, sleeping a little longer each time (the peer may need the
core); `get_future()` is completed by a polling thread shared by every channel, running only
while some future is pending.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from .buffers import as_array
from .errors import RingReduceError
from .mpi import mpi

_LONGEST_NAP = 0.001        # between polls of a request that is still pending


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's memory."""
    return tensor.reshape(-1).view(torch.uint8)


class MessageWork(dist.Work):
    """One send or receive: torch's Work on an MPI request. `wait()` returns True once the
    message has gone (or arrived, checked and copied in) or raises why not."""

    def __init__(self, request: Any, what: str, arrived: Optional[Callable[[Any], None]] = None,
                 tensor: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self._request, self._what, self._arrived, self._tensor = request, what, arrived, tensor
        self._status = mpi().Status()
        self._lock = threading.Lock()      # MPI forbids two threads testing one request
        self._done = False
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None

    def _test(self) -> bool:
        """Whether the message is complete (then checked, copied in, and its future set)."""
        with self._lock:
            if self._done:
                return True
            try:
                if not self._request.Test(self._status):
                    return False
                if self._arrived is not None:
                    self._arrived(self._status)
            except Exception as exc:        # MPI's truncation error, or our size check
                self._error = exc if isinstance(exc, RingReduceError) else RingReduceError(
                    f"ringreduce: {self._what} failed: {type(exc).__name__}: {exc}")
                self._error.__cause__ = exc
            self._done = True
            future = self._future
        if future is not None:
            self._settle(future)
        return True

    def _settle(self, future: Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result([self._tensor] if self._tensor is not None else [])

    def wait(self, timeout: Any = None) -> bool:
        nap = 0.0
        while not self._test():
            time.sleep(nap)
            nap = min(_LONGEST_NAP, 2 * nap + 1e-5)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._test()

    def is_success(self) -> bool:
        return self._test() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error if self._test() else None

    def result(self) -> list:
        self.wait()
        return [self._tensor] if self._tensor is not None else []

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done:
                    self._settle(self._future)
                else:
                    _POLLER.watch(self)
            return self._future

    def source_rank(self) -> int:
        """The group rank a receive from any source got its message from (the channel's
        communicator ranks the group's members as the group does)."""
        self.wait()
        return self._status.Get_source()

    _source_rank = source_rank


class _Poller:
    """Completes the futures of pending messages: one thread for every channel, polling while
    any is pending and ending when none is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[MessageWork] = []
        self._running = False

    def watch(self, work: MessageWork) -> None:
        with self._lock:
            self._pending.append(work)
            if not self._running:
                self._running = True
                threading.Thread(target=self._loop, name="ringreduce-p2p", daemon=True).start()

    def _loop(self) -> None:
        nap = 0.0
        while True:
            with self._lock:
                pending = list(self._pending)
            finished = [work for work in pending if work._test()]
            with self._lock:
                for work in finished:
                    self._pending.remove(work)
                if not self._pending:
                    self._running = False
                    return
            nap = 0.0 if finished else min(_LONGEST_NAP, 2 * nap + 1e-5)
            time.sleep(nap)


_POLLER = _Poller()


class Channel:
    """Point-to-point messages between the members of one group, on `comm` (ours to free: a
    duplicate of the group's set's communicator, so its ranks are the group's ranks)."""

    def __init__(self, comm: Any, label: str) -> None:
        self.comm, self.label = comm, label
        self.tag_limit = comm.Get_attr(mpi().TAG_UB)

    def _check(self, what: str, tensor: torch.Tensor, peer: Optional[int], tag: int) -> None:
        where = f"ringreduce: {what} on {self.label}, rank {self.comm.rank}"
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{where}: expected a dense torch.Tensor")
        if tensor.device.type != "cpu":
            raise ValueError(f"{where}: send and recv take CPU tensors, not {tensor.device}; "
                             "pass tensor.cpu() and copy the result back")
        if peer is not None and not 0 <= peer < self.comm.size:
            raise ValueError(f"{where}: peer rank {peer} is not in this group of "
                             f"{self.comm.size}")
        if not 0 <= tag <= self.tag_limit:
            raise ValueError(f"{where}: tag {tag} is outside MPI's tags 0..{self.tag_limit}")

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> MessageWork:
        """Start sending `tensor` to group rank `peer`."""
        what = f"send to rank {peer} (tag {tag})"
        self._check(what, tensor, peer, tag)
        data = _bytes(tensor.detach().contiguous())
        request = self.comm.Isend([as_array(data), mpi().BYTE], dest=peer, tag=tag)
        return MessageWork(request, f"{what} on {self.label}", tensor=tensor)

    def recv(self, tensor: torch.Tensor, peer: Optional[int], tag: int) -> MessageWork:
        """Start receiving into `tensor` from group rank `peer` (None: any)."""
        what = f"recv from {'any rank' if peer is None else f'rank {peer}'} (tag {tag})"
        self._check(what, tensor, peer, tag)
        direct = tensor.is_contiguous()
        landing = (tensor.detach() if direct
                   else torch.empty_like(tensor, memory_format=torch.contiguous_format))
        data = _bytes(landing)
        expected = data.numel()
        source = mpi().ANY_SOURCE if peer is None else peer

        def arrived(status: Any) -> None:
            count = status.Get_count(mpi().BYTE)
            if count != expected:
                raise RingReduceError(
                    f"ringreduce: {what} on {self.label}, rank {self.comm.rank}: "
                    f"{count} bytes arrived from rank {status.Get_source()} for a tensor of "
                    f"{expected} bytes ({tensor.dtype}, {tuple(tensor.shape)}); send and recv "
                    "tensors of the same size")
            if not direct:
                with torch.no_grad():
                    tensor.copy_(landing)

        request = self.comm.Irecv([as_array(data), mpi().BYTE], source=source, tag=tag)
        return MessageWork(request, f"{what} on {self.label}", arrived, tensor)

    def free(self) -> None:
        MPI = mpi()
        if not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()
