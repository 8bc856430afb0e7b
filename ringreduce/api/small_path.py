"""The one dispatch of an allreduce from the public calls of both front doors (Horovod's
allreduce, allreduce_, allreduce_async, allreduce_async_, and the backend's all_reduce):
`reduce_now` and `reduce_later` take a small one straight to the set's small way
(transport/small_way.py), on the caller's thread when the set's engine is idle, and every
other one the general way (reductions.allreduce_work). Below them, the small way's three
entries, each None where the call does not take it."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..core import timeline
from ..kernels.ops import ReduceOp
from ..sets.active_set import ActiveSet
from ..sets.handles import Finished, Handle
from ..sets.process_set import ProcessSet
from ..transport.negotiation import OutOfOrder
from .compression import Compression, Compressor
from .reductions import allreduce_work
from .work import run, submit

_SUM = ReduceOp.Sum


def reduce_now(ps: ActiveSet, tensor: torch.Tensor, name: Optional[str], op: Any,
               average: Optional[bool], prescale: float, postscale: float,
               compression: type[Compressor], in_place: bool,
               process_set: ProcessSet) -> torch.Tensor:
    """A synchronous allreduce of `tensor` on `ps` (`process_set`'s): its result."""
    if average is None and prescale == 1.0 and compression is Compression.none:
        out = allreduce_now(ps, tensor, name, op, postscale, in_place)
        if out is not None:
            return out
    return run(allreduce_work(tensor, average, name, op, prescale, postscale, compression,
                              in_place, process_set))


def reduce_later(ps: ActiveSet, tensor: torch.Tensor, name: Optional[str], op: Any,
                 average: Optional[bool], prescale: float, postscale: float,
                 compression: type[Compressor], in_place: bool,
                 process_set: ProcessSet) -> Handle:
    """An asynchronous allreduce of `tensor` on `ps` (`process_set`'s): its handle."""
    if average is None and prescale == 1.0 and compression is Compression.none:
        if in_place:
            handle = started(ps, tensor, name, op, postscale)
        else:
            work = queued_work(ps, tensor, name, op, postscale)
            handle = None if work is None else submit(work)
        if handle is not None:
            return handle
    return submit(allreduce_work(tensor, average, name, op, prescale, postscale, compression,
                                 in_place, process_set))


def allreduce_now(ps: Any, tensor: Any, name: Optional[str], op: Any, postscale: float,
                  in_place: bool, automatic: bool = False) -> Optional[torch.Tensor]:
    """A small synchronous allreduce on the active set `ps`, run at once on this thread when
    the set's engine is idle; None when the call does not take the small way (or the engine is
    busy), and the general path takes it. If the members' next collectives differ, the engine
    settles their order and this call waits its turn. `automatic`: `name` is one of the
    set's automatic names (the backend's, in call order), unique already, which no caller can
    take twice."""
    small = ps.transport.small
    if small is None:
        return None
    if in_place and small.begins:      # (the most frequent call)
        return small.now_in_place(ps.engine, tensor, name, op, postscale,
                                  None if automatic else name, ps.auto_name)
    case = small.case(tensor, op)
    if case is None or not ps.engine.claim_idle(None if automatic else name):
        return None
    try:
        if name is None:
            name = ps.auto_name("allreduce")
        return small.now(tensor, name, case, postscale, in_place)
    except OutOfOrder:      # (nothing was written)
        handle = ps.engine.reorder(name, small.work(tensor, name, case, postscale, in_place))
    finally:
        ps.engine.release_idle()
    return handle.wait()


def started(ps: Any, tensor: Any, name: Optional[str], op: Any,
            postscale: float) -> Optional[Handle]:
    """A small asynchronous in-place allreduce, started (`_start`); None when the call is not
    small (the general path takes it)."""
    small = ps.transport.small
    case = None if small is None else small.case(tensor, op)
    if case is None:
        return None
    named = name is not None
    name = name if named else ps.auto_name("allreduce")
    handle = _start(ps, small, tensor, name, named, case, postscale)
    return Finished(name, tensor, None, ps.engine) if handle is None else handle


def started_in_place(ps: Any, tensor: Any, name: str) -> Any:
    """`started`, for the backend's asynchronous Sum in place under its automatic `name` (DDP's
    small buckets, dist.all_reduce(t, async_op=True)): True where it ended on this thread (the
    result is in `tensor`, and no handle is made), else its handle; None where the call is not
    small (the general path takes it)."""
    small = ps.transport.small
    case = None if small is None else small.case(tensor, _SUM)
    if case is None:
        return None
    handle = _start(ps, small, tensor, name, False, case, 1.0)
    return True if handle is None else handle


def _start(ps: Any, small: Any, tensor: Any, name: str, named: bool, case: tuple,
           postscale: float) -> Optional[Handle]:
    """Both `started`s: begun on this thread when the set's engine is idle and its way `begins`
    (our part is posted at once, and if every member's is there already it completes here: a
    synchronous call's cost, not a hand-off's; otherwise the rest runs first in the queue),
    else queued whole. None where it ended here under an automatic name (`named`: the caller
    chose `name`, see Engine.begin_now)."""
    engine = ps.engine
    if small.begins and engine.claim_idle(name if named else None):
        try:
            handle = engine.begin_now(name, named, small.begin, tensor, name, case, postscale)
        finally:
            engine.release_idle()
    else:
        handle = engine.submit(name, small.work(tensor, name, case, postscale, True))
    timeline.record(name, "submitted")
    return handle


def queued_work(ps: Any, tensor: Any, name: Optional[str], op: Any,
                postscale: float) -> Optional[tuple]:
    """An asynchronous out-of-place allreduce's work (set, name, what runs) by the small way,
    where the call takes it (a handle costs enough already); else None."""
    small = ps.transport.small
    case = None if small is None else small.case(tensor, op)
    if case is None:
        return None
    name = ps.auto_name("allreduce") if name is None else name
    return ps, name, small.work(tensor, name, case, postscale, False)
