"""The small way: the most frequent latency-bound call, a small allreduce, taken from the public
call straight to the one exchange that carries its signature with its data (the node's slots
on one node, recursive doubling between nodes: the first such way in the set's table), run on
the caller's thread when the set's engine is idle (api/small_path.py takes the calls here).

It gives the same name counter, signature digest and bits as the general path, which a peer
may take for the same collective. At a few microseconds a call every Python frame shows, so
this is written flat: one lookup per table, the ReduceSpec made only where one is needed (a
mismatch, a join, a stall report), no frame between the public call and the exchange that the
general path would not have too.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch

from ..kernels.buffers import CODES, NAMES
from ..kernels.ops import ReduceOp
from .negotiation import OutOfOrder, PeersJoined, tell_members
from .reduce_spec import ReduceSpec
from .signature import AllreduceSignature
from .stall import REMEMBERED, StallWatch
from .way import Way

# Tables: an op -> (name, ReduceOp), as enum .name and ReduceOp(number) are slow; a dtype ->
# (code, name, itemsize); and two attribute lookups saved.
_OPS = {op: (op.name, op) for op in ReduceOp if op != ReduceOp.Adasum}
_DTYPES = {dtype: (code, NAMES[dtype], dtype.itemsize) for dtype, code in CODES.items()}
_AVERAGE = ReduceOp.Average
_DIGEST = AllreduceSignature.c_digest    # (the fast path's, without making the object)
_Tensor, _STRIDED = torch.Tensor, torch.strided
AfterJoins = Callable[[torch.Tensor, torch.Tensor, ReduceSpec], None]


class SmallWay:
    """The fast path of one process set through `way` (one that `carries_signature`): up to
    `limit` bytes, its `exchange` and how it explains a disagreement (`explain`).
    `after_joins(src, dst, spec)` runs an allreduce that met joined members."""

    def __init__(self, way: Way, watch: StallWatch, size: int, after_joins: AfterJoins) -> None:
        self.limit = way.limit
        self._exchange, self._explain = way.exchange, way.explain
        self._begin, self._complete = way.begin, way.complete
        self.begins = way.begins     # see begin()
        self._watch, self._after_joins = watch, after_joins
        self._average_divisor = float(size)

    def case(self, tensor: Any, op: Any) -> Optional[tuple]:
        """The op's (name, ReduceOp), the dtype's (code, name, itemsize) and the tensor's
        bytes when the call can take this way: a plain contiguous CPU tensor of at most
        `limit` bytes and an op other than Adasum; else None."""
        op_named = _OPS.get(_AVERAGE if op is None else op)
        if (op_named is None or tensor.__class__ is not _Tensor or not tensor.is_cpu
                or tensor.layout is not _STRIDED or not tensor.is_contiguous()):
            return None
        nbytes = tensor.nbytes
        dtype_named = _DTYPES.get(tensor.dtype)
        if dtype_named is None or nbytes > self.limit:
            return None
        return op_named, dtype_named, nbytes

    def now_in_place(self, engine: Any, tensor: Any, name: Optional[str], op: Any,
                     postscale: float, claimed: Optional[str],
                     auto_name: Optional[Callable[[str], str]]) -> Optional[torch.Tensor]:
        """The most frequent call of both front doors, a synchronous in-place allreduce where
        the way `begins` (dist.all_reduce(t), hvd.allreduce_(t) of a small tensor), written
        flat: after `case`, the engine's claim (`claimed`: the name to claim, None for an
        automatic one), the name (`auto_name(kind)` where `name` is None), `now`'s exchange
        with the stall count, and the release in one frame: at ~5 us a call, the frames this
        saves are 0.3-0.4 us. None, with nothing done, where the call does not take this way
        or the engine is busy. Past the exchange's common end (every digest there and equal),
        as `begin`'s."""
        case = self.case(tensor, op)
        if case is None or not engine.claim_idle(claimed):
            return None
        try:
            if name is None:
                name = auto_name("allreduce")
            (op_name, op), (code, dtype, itemsize), nbytes = case
            shape = tensor.shape
            digest = _DIGEST(name, op_name, dtype, shape, 1.0, postscale)
            watch = self._watch      # watch.begin(signature.label), written out
            begun = watch.begun = watch.begun + 1
            slot = begun % REMEMBERED
            watch.recent_counts[slot], watch.recent_labels[slot] = begun, f"allreduce '{name}'"
            if watch.published is not None:
                watch.published[0] = begun
            if watch.departures.gone or watch.departures.failures:
                watch.check_departed(begun)
            address, count = tensor.data_ptr(), nbytes // itemsize
            divisor = self._average_divisor if op is _AVERAGE else 1.0
            try:
                agreed = self._begin(address, nbytes, count, code, op, divisor, postscale,
                                     digest)
            except BaseException as error:
                tell_members(watch, error)
                raise
            if agreed:
                return tensor
            make_spec = partial(_spec, tensor.dtype, op, postscale, digest, name, op_name,
                                dtype, shape)
            finish = (partial(self._complete, address, count, code, op, divisor, postscale)
                      if agreed is None else lambda: False)
            try:
                return self._settled(finish, tensor, make_spec)
            except OutOfOrder:      # (nothing was written) the engine settles the order
                handle = engine.reorder(name, self.work(tensor, name, case, postscale, True))
        finally:
            engine.release_idle()
        return handle.wait()

    def work(self, tensor: torch.Tensor, name: str, case: tuple, postscale: float,
             in_place: bool) -> Callable[[], torch.Tensor]:
        """The whole collective, to run on the engine (or inline, after the engine settled
        the members' order)."""
        return partial(self.now, tensor, name, case, postscale, in_place)

    def now(self, tensor: torch.Tensor, name: str, case: tuple, postscale: float,
            in_place: bool) -> torch.Tensor:
        """The whole collective on this thread: `tensor`, or out of place a new tensor
        (allocated once our data is on its way: the allocation costs as much as a message, and
        every member would wait for it). Where the way `begins`, an in-place call takes
        `begin` and `complete`, one call to C where the peers are in step. Flat, as `begin`:
        the spec only where one is needed. (Its first lines are `begin`'s, written out: a
        call to share them would cost a tenth of this call's Python.)"""
        (op_name, op), (code, dtype, itemsize), nbytes = case
        shape = tensor.shape
        digest = _DIGEST(name, op_name, dtype, shape, 1.0, postscale)
        self._watch.begin(f"allreduce '{name}'")     # (signature.label, without a dict)
        address, count = tensor.data_ptr(), nbytes // itemsize
        divisor = self._average_divisor if op is _AVERAGE else 1.0
        made: Optional[torch.Tensor] = None
        try:
            if in_place and self.begins:
                agreed = self._begin(address, nbytes, count, code, op, divisor, postscale,
                                     digest)
                if agreed is None:
                    agreed = self._complete(address, count, code, op, divisor, postscale)
                if agreed:
                    return tensor
            else:
                def output() -> int:
                    nonlocal made
                    made = torch.empty_like(tensor)
                    return made.data_ptr()

                if self._exchange(address, address, nbytes, count, code, op, divisor,
                                  postscale, digest, None if in_place else output):
                    return tensor if in_place else made
            self._explain(lambda: _spec(tensor.dtype, op, postscale, digest, name, op_name,
                                        dtype, shape).describe())
        except PeersJoined:
            if not in_place and made is None:
                made = torch.empty_like(tensor)
            out = tensor if in_place else made
            self._after_joins(tensor, out, _spec(tensor.dtype, op, postscale, digest, name,
                                                 op_name, dtype, shape))
            return out
        except BaseException as error:
            tell_members(self._watch, error)
            raise
        raise AssertionError("explain() returned")     # (it raises)

    def begin(self, tensor: torch.Tensor, name: str, case: tuple, postscale: float
              ) -> tuple[bool, Any, Callable[[], torch.Tensor]]:
        """An in-place allreduce begun on this thread, where the way `begins`: our part posted
        without waiting, and completed at once if every member's part is there already.
        Returns (done, result or rest, whole) for `Engine.begin_now`; the common case, done,
        makes nothing but the digest (at a few microseconds a call, each object shows)."""
        (op_name, op), (code, dtype, itemsize), nbytes = case
        shape = tensor.shape
        digest = _DIGEST(name, op_name, dtype, shape, 1.0, postscale)
        self._watch.begin(f"allreduce '{name}'")     # (signature.label, without a dict)
        address, count = tensor.data_ptr(), nbytes // itemsize
        divisor = self._average_divisor if op is _AVERAGE else 1.0
        try:
            agreed = self._begin(address, nbytes, count, code, op, divisor, postscale, digest)
        except BaseException as error:
            tell_members(self._watch, error)
            raise
        if agreed:
            return True, tensor, None
        make_spec = partial(_spec, tensor.dtype, op, postscale, digest, name, op_name, dtype,
                            shape)
        whole = partial(self.now, tensor, name, case, postscale, True)
        if agreed is None:          # the peers are still to come: the rest waits for them
            complete = partial(self._complete, address, count, code, op, divisor, postscale)
            return False, partial(self._settled, complete, tensor, make_spec), whole
        try:
            return True, self._settled(lambda: False, tensor, make_spec), None    # differed
        except OutOfOrder:
            return False, None, whole   # the engine settles the order, then runs it whole

    def _settled(self, finish: Callable[[], bool], tensor: torch.Tensor,
                 make_spec: Callable[[], ReduceSpec]) -> torch.Tensor:
        """`begin`'s collective, ended by `finish()` (True: the digests agreed, and the result
        is in `tensor`); where they differ, the way's explanation (MismatchError, OutOfOrder)
        or the allreduce with joined members."""
        try:
            if not finish():
                self._explain(lambda: make_spec().describe())
        except PeersJoined:
            self._after_joins(tensor, tensor, make_spec())
        except BaseException as error:
            tell_members(self._watch, error)
            raise
        return tensor


def _spec(torch_dtype: torch.dtype, op: ReduceOp, postscale: float, digest: int, name: str,
          op_name: str, dtype: str, shape: torch.Size) -> ReduceSpec:
    signature = AllreduceSignature(name, op_name, dtype, shape, 1.0, postscale)
    return ReduceSpec(torch_dtype, op, 1.0, postscale, digest, signature.fields())
