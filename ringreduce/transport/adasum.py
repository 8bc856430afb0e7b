"""Adasum, Horovod's adaptive summation, on one flat buffer over MPI point-to-point.

Adasum combines two vectors a and b (gradients, or parameter deltas) as

    a + b - (a·b / 2|a|²) a - (a·b / 2|b|²) b

which is their sum when they are orthogonal and their average when they are parallel. As in
Horovod, a side whose squared norm is below sqrt(DBL_MIN) (about 1.5e-154: zero, or nearly)
keeps the weight 1, so zero vectors simply add.
Each tensor fused in the buffer gets its own dot product and norms.

Horovod applies it along a binary tree over a power-of-two number of ranks: rank 2i with rank
2i+1, then the results of neighbouring pairs, and so on, the lower ranks' vector always as `a`.
Like Horovod's CPU path, we run that tree as a reduce-scatter by vector halving and distance
doubling: at distance d = 1, 2, 4 ... rank r and rank r^d swap halves of the part they hold (the
lower rank keeps the first half, the smaller one when the length is odd) and each combines its
half. The dot product and norms need the whole tensors, which the 2d ranks of the subtree now
hold in pieces: each rank sums over its piece in float64, and the subtree adds those partial
sums by recursive doubling, the lower rank's value first, so every member uses the same bits.
An allgather that retraces the halvings then brings every piece to every rank. Each element is
computed by exactly one rank and copied, so all ranks end bitwise identical.

`scratch(purpose, dtype, count)` is caller-owned reusable memory (scratch.ScratchPool.get);
a call then allocates nothing beyond a few small Python objects.
"""
from __future__ import annotations

import bisect
import math
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..core.errors import HorovodInternalError, UnsupportedError
from ..core.state import abandon
from ..kernels.buffers import NAMES, STORAGE_DTYPES
from .ring import Wait

Scratch = Callable[[str, np.dtype, int], np.ndarray]
Span = tuple[int, int, int]          # (tensor index, first, stop) within one rank's part

DTYPES = (torch.float16, torch.float32, torch.float64)
TINY_NORM_SQ = math.sqrt(sys.float_info.min)   # Horovod's sqrt(DBL_MIN): below it, weight 1
BLOCK = 32768                        # elements widened to float64 at a time
DATA_TAG, SUMS_TAG = 21, 22
F64 = np.dtype(np.float64)
DOT, LOWER_SQ, UPPER_SQ = 0, 1, 2    # columns of the per-tensor sums


def why_unsupported(size: int, dtype: torch.dtype) -> Optional[str]:
    """Why Adasum cannot run over `size` ranks on `dtype`, or None when it can: the reason
    `check_supported` raises with, without raising."""
    problem = _problem(size, dtype)
    return None if problem is None else problem[1]


def check_supported(size: int, dtype: torch.dtype) -> None:
    """Raise what Horovod raises: NotImplementedError (our UnsupportedError) when `size` is not
    a power of two (its Python front end refuses before any traffic), HorovodInternalError for a
    dtype other than float16/32/64 (its Adasum op fails with 'Unsupported data type.')."""
    problem = _problem(size, dtype)
    if problem is not None:
        error, message = problem
        raise error(message)


def adasum_allreduce(comm: Any, buf: np.ndarray, dtype: torch.dtype,
                     lengths: Optional[Sequence[int]] = None,
                     scratch: Optional[Scratch] = None, wait: Optional[Wait] = None) -> None:
    """Replace `buf` on every rank of `comm` by the Adasum of all ranks' `buf`.

    `buf` is a flat, contiguous array of `dtype` values (its NumPy storage dtype). `lengths`
    are the element counts of the tensors fused in it, each combined with its own weights
    (default: one tensor). Raises as `check_supported`, and ValueError when `buf` and
    `lengths` do not fit `dtype` and each other. `wait` waits for one MPI request (the set's
    stall watch; by default MPI's blocking wait).
    """
    check_supported(comm.size, dtype)
    bounds = _tensor_bounds(buf, dtype, lengths)
    if comm.size == 1 or buf.size == 0:
        return
    take = scratch or _allocate
    received = take("adasum-received", buf.dtype, (buf.size + 1) // 2)
    wide = take("adasum-wide", F64, 2 * min(BLOCK, buf.size)).reshape(2, -1)
    sums = take("adasum-sums", F64, 2 * 3 * (len(bounds) - 1)).reshape(2, -1, 3)
    wait = wait or _blocking
    with np.errstate(over="ignore", invalid="ignore"):    # inf and NaN pass through silently
        halvings = _reduce_scatter(comm, buf, bounds, received, wide, sums, wait)
    _allgather(comm, buf, halvings, wait)


def weight(dot: float, norm_sq: float) -> float:
    """The weight of a vector with squared norm `norm_sq` whose dot product with the other
    vector is `dot`: 1 - dot / 2|v|², or 1 when the norm is (nearly) zero."""
    return 1.0 - dot / norm_sq * 0.5 if norm_sq >= TINY_NORM_SQ else 1.0


# ---------------------------------------------------------------------- the two phases

def _reduce_scatter(comm: Any, buf: np.ndarray, bounds: list[int], received: np.ndarray,
                    wide: np.ndarray, sums: np.ndarray, wait: Wait) -> list[tuple[int, int, int]]:
    """Vector halving: afterwards this rank's part of `buf` holds its piece of the Adasum of
    all ranks. Returns each level's (start, middle, stop) for the allgather to retrace."""
    rank, start, stop = comm.rank, 0, len(buf)
    halvings = []
    distance = 1
    while distance < comm.size:
        middle = start + (stop - start) // 2
        lower = (rank & distance) == 0
        kept, given = ((start, middle), (middle, stop)) if lower else ((middle, stop),
                                                                        (start, middle))
        own = buf[kept[0]:kept[1]]
        theirs = received[:len(own)]
        _swap(comm, buf[given[0]:given[1]], theirs, rank ^ distance, DATA_TAG, wait)
        _combine(comm, own, theirs, lower, 2 * distance, _spans(bounds, *kept), wide, sums,
                 wait)
        halvings.append((start, middle, stop))
        start, stop = kept
        distance *= 2
    return halvings


def _allgather(comm: Any, buf: np.ndarray, halvings: list[tuple[int, int, int]],
               wait: Wait) -> None:
    """Distance halving: the halvings in reverse, each rank sending the part it finished to the
    partner it got it from and receiving the partner's, until every rank holds all of `buf`."""
    rank, distance = comm.rank, comm.size
    for start, middle, stop in reversed(halvings):
        distance //= 2
        first, second = buf[start:middle], buf[middle:stop]
        mine, partners = (first, second) if (rank & distance) == 0 else (second, first)
        _swap(comm, mine, partners, rank ^ distance, DATA_TAG, wait)


# ---------------------------------------------------------------------- one level

def _combine(comm: Any, own: np.ndarray, theirs: np.ndarray, own_is_lower: bool,
             subtree: int, spans: list[Span], wide: np.ndarray, sums: np.ndarray,
             wait: Wait) -> None:
    """own = Adasum(lower, upper) on this rank's half, tensor by tensor: partial dot products
    and norms over the half, summed over the `subtree` ranks that hold the two vectors, then
    the weighted sum."""
    mine, partners = sums
    mine.fill(0.0)
    own_col, their_col = (LOWER_SQ, UPPER_SQ) if own_is_lower else (UPPER_SQ, LOWER_SQ)
    for tensor, first, stop in spans:
        row = mine[tensor]
        row[DOT], row[own_col], row[their_col] = _dot_and_norms(own[first:stop],
                                                                theirs[first:stop], wide)
    _sum_over_subtree(comm, mine, partners, subtree, wait)
    for tensor, first, stop in spans:
        dot, lower_sq, upper_sq = (float(x) for x in mine[tensor])
        lower_weight, upper_weight = weight(dot, lower_sq), weight(dot, upper_sq)
        own_weight, their_weight = ((lower_weight, upper_weight) if own_is_lower
                                    else (upper_weight, lower_weight))
        _weighted_sum(own[first:stop], own_weight, theirs[first:stop], their_weight, wide)


def _sum_over_subtree(comm: Any, mine: np.ndarray, partners: np.ndarray, members: int,
                      wait: Wait) -> None:
    """Add `mine` over the aligned block of `members` ranks around this one, by recursive
    doubling. Both partners of a step add the lower rank's value first, so every member ends
    with the same bits."""
    rank, step = comm.rank, 1
    while step < members:
        partner = rank ^ step
        _swap(comm, mine, partners, partner, SUMS_TAG, wait)
        if rank < partner:
            np.add(mine, partners, out=mine)
        else:
            np.add(partners, mine, out=mine)
        step *= 2


def _dot_and_norms(a: np.ndarray, b: np.ndarray, wide: np.ndarray) -> tuple[float, float, float]:
    """(a·b, |a|², |b|²) accumulated in float64, a block at a time (float16 and float32
    products are exact in float64)."""
    dot = a_sq = b_sq = 0.0
    for first in range(0, len(a), BLOCK):
        wa = _widened(a[first:first + BLOCK], wide[0])
        wb = _widened(b[first:first + BLOCK], wide[1])
        dot += float(np.dot(wa, wb))
        a_sq += float(np.dot(wa, wa))
        b_sq += float(np.dot(wb, wb))
    return dot, a_sq, b_sq


def _weighted_sum(a: np.ndarray, a_weight: float, b: np.ndarray, b_weight: float,
                  wide: np.ndarray) -> None:
    """a = a_weight * a + b_weight * b, in float64 and rounded once to a's dtype. `b` is
    received scratch and may be overwritten."""
    for first in range(0, len(a), BLOCK):
        part = a[first:first + BLOCK]
        wa = _widened(part, wide[0])
        wb = _widened(b[first:first + BLOCK], wide[1])
        np.multiply(wa, a_weight, out=wa)
        np.multiply(wb, b_weight, out=wb)
        np.add(wa, wb, out=wa)
        if wa is not part:
            np.copyto(part, wa, casting="same_kind")


# ---------------------------------------------------------------------- small pieces

def _problem(size: int, dtype: torch.dtype) -> Optional[tuple[type, str]]:
    if size < 1 or size & (size - 1):
        return UnsupportedError, (f"ringreduce: Adasum needs a power-of-two number of "
                                     f"ranks, and this process set has {size}")
    if dtype not in DTYPES:
        return HorovodInternalError, (f"ringreduce: Adasum reduces float16, float32 and "
                                      f"float64 tensors, not {NAMES.get(dtype, dtype)}")
    return None


def _tensor_bounds(buf: np.ndarray, dtype: torch.dtype,
                   lengths: Optional[Sequence[int]]) -> list[int]:
    """Where each fused tensor starts in `buf`, and where the last one ends."""
    if buf.ndim != 1 or not buf.flags.c_contiguous or buf.dtype != STORAGE_DTYPES[dtype]:
        raise ValueError(f"ringreduce: Adasum needs a flat contiguous {STORAGE_DTYPES[dtype]} "
                         f"buffer for {NAMES[dtype]}, not {buf.dtype} of shape {buf.shape}")
    bounds = [0]
    for length in ([buf.size] if lengths is None else lengths):
        if length < 0:
            raise ValueError(f"ringreduce: Adasum tensor lengths must be >= 0, not {length}")
        bounds.append(bounds[-1] + int(length))
    if bounds[-1] != buf.size:
        raise ValueError(f"ringreduce: Adasum tensor lengths add up to {bounds[-1]}, but the "
                         f"buffer holds {buf.size} elements")
    return bounds


def _spans(bounds: list[int], start: int, stop: int) -> list[Span]:
    """(tensor, first, stop) for each tensor with elements in buf[start:stop], relative to
    start."""
    spans = []
    tensor = max(bisect.bisect_right(bounds, start) - 1, 0)
    while tensor < len(bounds) - 1 and bounds[tensor] < stop:
        first, last = max(bounds[tensor], start), min(bounds[tensor + 1], stop)
        if last > first:
            spans.append((tensor, first - start, last - start))
        tensor += 1
    return spans


def _widened(part: np.ndarray, into: np.ndarray) -> np.ndarray:
    """`part` as float64: itself, or an exact copy in `into`."""
    if part.dtype == F64:
        return part
    wide = into[:len(part)]
    np.copyto(wide, part)
    return wide


def _swap(comm: Any, send: np.ndarray, recv: np.ndarray, partner: int, tag: int,
          wait: Wait) -> None:
    """Send `send` to `partner` and receive its message into `recv`."""
    received = comm.Irecv(recv, source=partner, tag=tag)
    sent = comm.Isend(send, dest=partner, tag=tag)
    try:
        wait(sent)
        wait(received)
    except BaseException:
        abandon(sent, received)   # (their buffers, which MPI may still use)
        raise


def _blocking(request: Any) -> None:
    request.Wait()


def _allocate(purpose: str, dtype: np.dtype, count: int) -> np.ndarray:
    """Scratch for callers that pass none: fresh memory each call."""
    return np.empty(count, dtype)
