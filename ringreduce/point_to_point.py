"""torch.distributed's send and recv on a ringreduce group: MPI's non-blocking `Isend`/`Irecv`
on a communicator of the group's own (a duplicate of its set's, made when the group is), so
that no message of theirs can match one of the set's collectives; torch's tags are MPI tags.

Unlike the collectives, these run on the caller's thread (MPI_THREAD_MULTIPLE): a receive must
not wait in the set's engine, which would hold back every collective behind it. The message is
the tensor's bytes; a receive checks how many arrived, so a sender's tensor of another size is
an error on the receiving rank (a larger one is MPI's truncation error), never a partly written
tensor. `wait()` polls the request, sleeping a little longer each time (the peer may need the
core), and never waits silently: past the set's stall check time it logs a report naming the
peer and the tag, every interval, and at the stall shutdown time it ends the job, as a
collective's wait does; a peer that shuts down without the message raises ShutDownError; and
torch's `wait(timeout)` raises past its timeout (`_Overdue`). `get_future()` is completed by a
polling thread shared by every channel, running only while some future is pending, which
reports and fails the messages it waits for in the same way.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from .buffers import as_array
from .errors import RingReduceError, ShutDownError
from .failed_future import fail
from .mpi import mpi
from .ring import ABANDONED
from .stall import DEPARTED_GRACE, StallWatch

_LONGEST_NAP = 0.001        # between polls of a request that is still pending
_LOOK_EVERY = 0.05          # seconds between looks for a peer's goodbye while waiting
log = logging.getLogger("ringreduce")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's memory."""
    return tensor.reshape(-1).view(torch.uint8)


class MessageWork(dist.Work):
    """One send or receive with group rank `peer` (None: any), on the channel `channel`:
    torch's Work on an MPI request. `wait()` returns True once the message has gone (or
    arrived, checked and copied in) or raises why not."""

    def __init__(self, channel: "Channel", request: Any, what: str, peer: Optional[int],
                 arrived: Optional[Callable[[Any], None]] = None,
                 tensor: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self._channel, self._peer = channel, peer
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
            fail(future, self._error)
        else:
            future.set_result([self._tensor] if self._tensor is not None else [])

    def _fail(self, error: BaseException) -> None:
        """End the work with `error` though its request is still pending (a peer that left):
        the request, and with it the buffer MPI may still write, is kept (ring.ABANDONED)."""
        with self._lock:
            if self._done:
                return
            self._error, self._done = error, True
            ABANDONED.append(self._request)
            future = self._future
        if future is not None:
            self._settle(future)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if not self._test():
            overdue, nap = _Overdue(self, timeout), 0.0
            while not self._test():
                time.sleep(nap)
                nap = min(_LONGEST_NAP, 2 * nap + 1e-5)
                try:
                    overdue.check(time.monotonic())
                except ShutDownError as exc:
                    self._fail(exc)
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


class _Overdue:
    """A message's wait, past what it should take (the module docstring): `check(now)` logs
    the stall reports when due, ends the job at the stall shutdown time, and raises
    ShutDownError for a peer that has left without its side, RingReduceError past torch's
    `timeout`."""

    def __init__(self, work: MessageWork, timeout: Optional[datetime.timedelta]) -> None:
        self.work, self.timeout, watch = work, timeout, work._channel.watch
        start = self.start = time.monotonic()
        never = float("inf")
        self.limit = (start + timeout.total_seconds()
                      if timeout is not None and timeout.total_seconds() > 0 else never)
        self.report_at = start + watch.check_time if watch.check_time > 0 else never
        self.shutdown_at = start + watch.shutdown_time if watch.shutdown_time > 0 else never
        self.look_at, self.gone_at = start + _LOOK_EVERY, never

    def check(self, now: float) -> None:
        work, watch = self.work, self.work._channel.watch
        me = work._channel.comm.rank
        if now >= self.look_at and work._peer is not None:
            self.look_at = now + _LOOK_EVERY
            watch.departures.look()
            if work._peer in watch.departures.gone:
                self.gone_at = min(self.gone_at, now + DEPARTED_GRACE)
        if now >= self.gone_at and not work._test():
            raise ShutDownError(
                f"ringreduce: {work._what}, rank {me}: rank {work._peer} shut down "
                "(ringreduce.shutdown(), or the end of its script) without its side of this "
                "message: every send needs its recv, on the peer, before it leaves")
        if now >= self.limit:
            raise RingReduceError(f"ringreduce: {work._what}, rank {me}: not complete after "
                                  f"wait()'s timeout of {self.timeout}")
        if now >= self.report_at:
            log.warning(self._stalled(now - self.start))
            self.report_at += watch.check_time
        if now >= self.shutdown_at:
            watch.on_shutdown(f"{self._stalled(now - self.start)} Shutting the job down after "
                              f"{watch.shutdown_time:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME).")
            self.shutdown_at = float("inf")

    def _stalled(self, waited: float) -> str:
        work = self.work
        peer = "any rank" if work._peer is None else f"rank {work._peer}"
        return (f"ringreduce: stall: rank {work._channel.comm.rank} has waited {waited:.0f} s "
                f"in {work._what}: {peer} has not made the matching "
                f"{'send' if work._arrived is not None else 'recv'} (same tag, same group)")


class _Poller:
    """Completes the futures of pending messages: one thread for every channel, polling while
    any is pending and ending when none is; it reports their stalls and fails those whose
    peer left, as `wait()` does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[MessageWork, _Overdue] = {}
        self._running = False

    def watch(self, work: MessageWork) -> None:
        with self._lock:
            self._pending[work] = _Overdue(work, None)
            if not self._running:
                self._running = True
                threading.Thread(target=self._loop, name="ringreduce-p2p", daemon=True).start()

    def _loop(self) -> None:
        nap = 0.0
        while True:
            with self._lock:
                pending = list(self._pending.items())
            finished = []
            for work, overdue in pending:
                if not work._test():
                    try:
                        overdue.check(time.monotonic())
                        continue
                    except ShutDownError as exc:
                        work._fail(exc)
                finished.append(work)
            with self._lock:
                for work in finished:
                    del self._pending[work]
                if not self._pending:
                    self._running = False
                    return
            nap = 0.0 if finished else min(_LONGEST_NAP, 2 * nap + 1e-5)
            time.sleep(nap)


_POLLER = _Poller()


class Channel:
    """Point-to-point messages between the members of one group, on `comm` (ours to free: a
    duplicate of the group's set's communicator, so its ranks are the group's ranks); `watch`
    is the set's (its stall settings, and the members that have shut down)."""

    def __init__(self, comm: Any, label: str, watch: StallWatch) -> None:
        self.comm, self.label, self.watch = comm, label, watch
        self.tag_limit = comm.Get_attr(mpi().TAG_UB)

    def _check(self, what: str, tensor: torch.Tensor, peer: Optional[int], tag: int) -> None:
        where = f"ringreduce: {what} on {self.label}, rank {self.comm.rank}"
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{where}: expected a dense torch.Tensor")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where}: send and recv take CPU and CUDA tensors, not "
                             f"{tensor.device}")
        if peer is not None and not 0 <= peer < self.comm.size:
            raise ValueError(f"{where}: peer rank {peer} is not in this group of "
                             f"{self.comm.size}")
        if not 0 <= tag <= self.tag_limit:
            raise ValueError(f"{where}: tag {tag} is outside MPI's tags 0..{self.tag_limit}")

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> MessageWork:
        """Start sending `tensor` to group rank `peer`."""
        what = f"send to rank {peer} (tag {tag})"
        self._check(what, tensor, peer, tag)
        data = _bytes(tensor.detach().contiguous().cpu())     # (a CUDA tensor: a host copy)
        request = self.comm.Isend([as_array(data), mpi().BYTE], dest=peer, tag=tag)
        return MessageWork(self, request, f"{what} on {self.label}", peer, tensor=tensor)

    def recv(self, tensor: torch.Tensor, peer: Optional[int], tag: int) -> MessageWork:
        """Start receiving into `tensor` from group rank `peer` (None: any)."""
        what = f"recv from {'any rank' if peer is None else f'rank {peer}'} (tag {tag})"
        self._check(what, tensor, peer, tag)
        direct = tensor.is_contiguous() and not tensor.is_cuda     # (else: lands on the host)
        landing = (tensor.detach() if direct
                   else torch.empty(tensor.shape, dtype=tensor.dtype))
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
        return MessageWork(self, request, f"{what} on {self.label}", peer, arrived, tensor)

    def free(self) -> None:
        MPI = mpi()
        if not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()
