"""Allreduce on one flat buffer, over MPI point-to-point, written once for any array module.

The ring (bandwidth-optimal, for large buffers) is two loops over chunk indices:
reduce-scatter leaves rank r holding the fully reduced chunk r, allgather passes each finished
chunk once around the ring. Each result is computed by exactly one rank and then copied, so
every rank ends bitwise identical. Segmentation sits on top of one reduce-scatter step: the
receive of segment k+1 is posted before segment k is reduced.

The small-message path (latency-optimal) gathers every rank's buffer in one MPI call and
reduces the rows in rank order, identically on every rank.

Buffers are NumPy or CuPy arrays; mpi4py takes either, and the `reduce` kernel decides where
the arithmetic runs. `scratch` is caller-owned, so nothing is allocated here per call. `wait`
waits for one MPI request: the caller's stall watch, so that a peer that stalls, leaves or
fails inside the ring is reported, not waited for in silence.

Out of place (`source` given), the ring reads our input where it first needs it: the first
send, and the local operand of each chunk's one local reduction (the reduce-scatter reduces
every chunk but one exactly once on each rank, and the allgather fills that one), so the
input is never copied into the output first, which costs as much as a step of the ring.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ..core.state import abandon

Kernel = Callable[..., None]    # (target, arrived[, mine]): target = (mine or target) op arrived
Wait = Callable[[Any], None]    # (request): returns once it is complete
Bounds = Sequence[tuple[int, int]]
TAG = 7


def chunk_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of consecutive chunks with the given element counts."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def balanced_counts(length: int, parts: int) -> list[int]:
    """`parts` counts summing to `length`, differing by at most one, larger ones first."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def scratch_elements(bounds: Bounds, segment: int) -> int:
    """Scratch the reduce-scatter needs: two segments, or one whole chunk if that is smaller."""
    largest = max((stop - start for start, stop in bounds), default=0)
    return min(largest, 2 * segment)


def reduce_scatter(comm: Any, buf: Any, bounds: Bounds, reduce: Kernel, scratch: Any,
                   segment: int, wait: Wait, source: Any = None) -> None:
    """Ring reduce-scatter: afterwards buf[bounds[r]] on rank r holds the reduction over ranks
    (of `source`'s values when given, else of buf's own).

    Step s: send chunk r-s-1 to the right, receive chunk r-s-2 from the left and reduce it
    into ours. The other chunks of buf are left holding partial sums (out of place: chunk r-1
    is left untouched).
    """
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_lo, send_hi = bounds[(r - s - 1) % n]
        recv_lo, recv_hi = bounds[(r - s - 2) % n]
        sent = source if source is not None and s == 0 else buf
        _exchange_and_reduce(comm, sent[send_lo:send_hi], buf[recv_lo:recv_hi], reduce, scratch,
                             segment, left, right, wait,
                             None if source is None else source[recv_lo:recv_hi])


def allgather(comm: Any, buf: Any, bounds: Bounds, wait: Wait) -> None:
    """Ring allgather: rank r holds finished chunk r; afterwards every rank holds all chunks."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_lo, send_hi = bounds[(r - s) % n]
        recv_lo, recv_hi = bounds[(r - s - 1) % n]
        recv = comm.Irecv(buf[recv_lo:recv_hi], source=left, tag=TAG)
        send = comm.Isend(buf[send_lo:send_hi], dest=right, tag=TAG)
        try:
            wait(send)
            wait(recv)
        except BaseException:
            abandon(send, recv)
            raise


def ring_allreduce(comm: Any, buf: Any, reduce: Kernel, scratch: Any, segment: int, wait: Wait,
                   finish: Optional[Callable[[Any], None]] = None, source: Any = None) -> None:
    """Allreduce of flat `buf`, in place, or of `source` into `buf` (same length, not
    overlapping; `reduce` then takes the third operand). `finish(chunk)` runs on each rank's
    finished chunk before the allgather, so scaling costs 1/n of the buffer and stays bitwise
    identical."""
    bounds = chunk_bounds(balanced_counts(len(buf), comm.size))
    if comm.size == 1 and source is not None:
        buf[...] = source
    reduce_scatter(comm, buf, bounds, reduce, scratch, segment, wait, source)
    if finish is not None:
        lo, hi = bounds[comm.rank]
        finish(buf[lo:hi])
    allgather(comm, buf, bounds, wait)


def gather_allreduce(comm: Any, buf: Any, reduce: Kernel, gathered: Any, wait: Wait,
                     finish: Optional[Callable[[Any], None]] = None) -> None:
    """Small-message allreduce: one MPI Allgather into `gathered` (ranks x len), then every rank
    reduces the rows in rank order, so all ranks compute the same bits."""
    wait(comm.Iallgather(buf, gathered))
    buf[...] = gathered[0]
    for row in range(1, comm.size):
        reduce(buf, gathered[row])
    if finish is not None:
        finish(buf)


def _exchange_and_reduce(comm: Any, send: Any, target: Any, reduce: Kernel, scratch: Any,
                         segment: int, left: int, right: int, wait: Wait,
                         mine: Any = None) -> None:
    """Send `send` right and reduce what arrives from the left into `target` (with `mine` as
    our operand when given, else target's own values), segment by segment, with the receive of
    the next segment in flight while the current one is reduced. Both sides cut a chunk into
    the same segments, so every message matches one receive."""
    sends = [comm.Isend(send[off:off + segment], dest=right, tag=TAG)
             for off in range(0, len(send), segment)]
    offsets = range(0, len(target), segment)
    slots = (scratch[:segment], scratch[segment:2 * segment])

    def post(k: int) -> Any:
        off = offsets[k]
        return comm.Irecv(slots[k % 2][:min(segment, len(target) - off)], source=left, tag=TAG)

    pending = post(0) if len(offsets) else None
    try:
        for k, off in enumerate(offsets):
            wait(pending)
            arrived = slots[k % 2][:min(segment, len(target) - off)]
            if k + 1 < len(offsets):
                pending = post(k + 1)
            if mine is None:
                reduce(target[off:off + len(arrived)], arrived)
            else:
                reduce(target[off:off + len(arrived)], arrived, mine[off:off + len(arrived)])
        for request in sends:
            wait(request)
    except BaseException:
        abandon(*sends, *([pending] if pending is not None else []))
        raise
