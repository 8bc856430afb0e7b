"""One way an allreduce can go, as every entry of a set's table (ways.py) declares it, and
what one process set's ways share (`SetParts`)."""
from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional

import numpy as np
import torch

from .. import _native
from ..core.config import Settings
from ..gpu import cuda
from ..kernels import ops
from ..kernels.ops import ReduceOp
from ..kernels.scratch import ScratchPool
from . import ring
from .crossnode import BetweenNodes
from .negotiation import Negotiator
from .reduce_spec import ReduceSpec
from .shm import NodeWindow
from .signature import Signature

_AVERAGE = ReduceOp.Average     # (an enum's class attribute costs a lookup each time)
Pieces = Callable[[ReduceSpec], Callable[[np.ndarray], None]]


def scale(tensor: torch.Tensor, spec: ReduceSpec, divisor: float, factor: float) -> None:
    """A contiguous CPU tensor times factor / divisor, in place (ops.finish)."""
    if divisor != 1.0 or factor != 1.0:
        _native.finish(spec.code, tensor.data_ptr(), tensor.numel(), divisor, factor)


class SetParts:
    """What one process set's ways share: `comm` holds its members, `local` those on this
    rank's node, `cross` those with this rank's local rank (`homogeneous`: every node holds as
    many); its node window and exchanges between nodes (None where the topology has none), its
    negotiator (the signature check), settings and scratch (CPU and GPU)."""

    def __init__(self, comm: Any, local: Any, cross: Any, homogeneous: bool,
                 node: Optional[NodeWindow], between: Optional[BetweenNodes],
                 negotiator: Negotiator, settings: Settings, scratch: ScratchPool,
                 device_scratch: cuda.DeviceScratch) -> None:
        self.comm, self.local, self.cross, self.homogeneous = comm, local, cross, homogeneous
        self.node, self.between = node, between
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
        return lambda part: ops.finish(part, spec.dtype, divisor, spec.postscale)

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
        ring.ring_allreduce(comm, buf, ops.reducer(spec.dtype, spec.op), scratch, segment,
                            self.wait, finish, source)


class Way:
    """One entry of the table, on the interface every entry declares (the transport and the
    small way read nothing else): `applies` says whether it takes a request, `run` allreduces
    `src` into `dst` (the same tensor, or a contiguous one of its size and dtype on its
    device), writing `dst` only once the signatures agree.

    A way whose one exchange carries the signature with the data (`carries_signature`) also
    serves the small way (small_way.py), up to `limit` bytes, through `exchange` (a whole
    allreduce by addresses; False, nothing written, where the digests differ) and `explain`
    (what a disagreement is: PeersJoined, OutOfOrder or MismatchError, raised alike on every
    member). One whose exchange can begin without waiting (`begins`) also has `begin`, which
    posts this rank's part in place and, where every peer's is there already, finishes: True
    (done) or False (the digests differ, nothing written); None while the peers are still to
    come, and `complete` finishes it then."""

    carries_signature = False
    begins = False
    limit = 0

    def __init__(self, parts: SetParts) -> None:
        self.parts = parts

    def applies(self, src: torch.Tensor, spec: ReduceSpec) -> bool:
        return True

    def free(self) -> None:
        """Free what the way made (the set's transport is closing)."""

    def run(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        raise NotImplementedError

    def exchange(self, src: int, dst: int, nbytes: int, count: int, code: int, op: ReduceOp,
                 divisor: float, factor: float, digest: int,
                 output: Optional[Callable[[], int]] = None) -> bool:
        """`nbytes` at address `src` allreduced into `dst` (or into what `output()` makes,
        once this rank's data is on its way), times factor / divisor."""
        raise NotImplementedError

    def explain(self, describe: Callable[[], Signature]) -> NoReturn:
        raise NotImplementedError

    def begin(self, address: int, nbytes: int, count: int, code: int, op: ReduceOp,
              divisor: float, factor: float, digest: int) -> Optional[bool]:
        raise NotImplementedError

    def complete(self, address: int, count: int, code: int, op: ReduceOp, divisor: float,
                 factor: float) -> bool:
        raise NotImplementedError
