"""Join (Horovod's `join()`), as one process set's transport runs it.

A member that has run out of data sends the JOINED mark in every signature exchange. When the
others' exchange meets it (`PeersJoined`), every member takes part in one join round (an
allgather of what each runs); an allreduce then runs again through the set's ways with the
joined members contributing zeros, other collectives raise `JoinedError` on the members that
called them, and a barrier is the round itself. The joined members leave once every member has
joined. The public `join()` is in collectives.py; `ActiveSet.join` restarts the names after it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..core.errors import JoinedError, MismatchError
from ..kernels.buffers import NAMES
from ..kernels.ops import ReduceOp
from .negotiation import JOINED, RESET, Negotiator, PeersJoined, ResetPending
from .reduce_spec import ReduceSpec
from .signature import Signature, describe_mismatch, label
from .stall import StallWatch

DTYPES = {name: dtype for dtype, name in NAMES.items()}
# What a member runs, as a join round shares it: (collective, signature, reduction or None),
# the reduction being (dtype name, element count, op, prescale, postscale, on a GPU, the
# element counts of the tensors fused in it, which Adasum weighs each on its own, or None).
Description = tuple[str, Signature, Optional[tuple]]
Reduce = Callable[[torch.Tensor, torch.Tensor, ReduceSpec], None]


class JoinRounds:
    """The join protocol of one process set: `comm` holds its members (global `ranks`);
    `reduce(src, dst, spec)` runs an allreduce by the set's ways."""

    def __init__(self, comm: Any, ranks: Sequence[int], watch: StallWatch,
                 negotiator: Negotiator, reduce: Reduce) -> None:
        self.comm, self.ranks, self.watch = comm, list(ranks), watch
        self.negotiator, self.reduce = negotiator, reduce

    def join(self, device: Optional[torch.device]) -> int:
        """This member has run out of data: until every member has joined, take part in every
        allreduce the others run, with zeros (on `device`, or the one they use); returns the
        set rank that joined last (`last`)."""
        point, joined_at = self.watch.begun, time.time_ns()
        self.watch.set_joined(True)
        try:
            while True:
                digests, points = self.negotiator.exchange(JOINED, point)
                if (digests == JOINED).all():
                    self.watch.begun = int(points.max())    # every member counts alike again
                    return self.last(points, joined_at)
                description = self.round(None)
                if description is not None and description[2] is not None:
                    self._zeros(description[2], device)
                elif description is not None and description[1].get("name") == RESET:
                    raise ResetPending(
                        f"ringreduce: rank {self.ranks[self.comm.rank]}: join(){self.watch.where}"
                        f" fails: the ranks that had not joined wait in '{RESET}' after an "
                        "error; the joined ones come to the reset too.")
        finally:
            self.watch.set_joined(False)

    def last(self, points: np.ndarray, joined_at: int) -> int:
        """The member that joined last, as Horovod's coordinator, which takes joins in the
        order they reach it: the most collectives begun before joining (a join after another's
        collectives is after it), then the latest clock (for joins between the same two
        collectives), then the highest rank."""
        clocks = self.negotiator.gather(joined_at)
        return max(range(len(clocks)), key=lambda r: (int(points[r]), clocks[r], r))

    def allreduce(self, src: torch.Tensor, dst: torch.Tensor, spec: ReduceSpec) -> None:
        """An allreduce that met joined members: agree with the others on what runs, then run
        it without the signature check (the joined ones contribute zeros)."""
        reduction = (NAMES[spec.dtype], src.numel(), int(spec.op), spec.prescale,
                     spec.postscale, src.is_cuda,
                     None if spec.lengths is None else tuple(spec.lengths))
        self.round(("allreduce", spec.describe(), reduction))
        self.reduce(src, dst, spec.unchecked())

    def round(self, mine: Optional[Description]) -> Optional[Description]:
        """After an exchange in which some members had joined, every member shares what it
        runs (None when joined). Returns the active members' common description; on an active
        member, MismatchError when they disagree among themselves."""
        everyone = self.negotiator.gather(mine)
        active = [(r, d) for r, d in enumerate(everyone) if d is not None]
        resetting = [r for r, d in active if d[1].get("name") == RESET]
        if resetting:       # the elastic reset's meeting: every other member leaves for it
            if mine is not None and mine[1].get("name") != RESET:
                raise ResetPending(
                    f"ringreduce: rank {self.ranks[self.comm.rank]}: {label(mine[1])}"
                    f"{self.watch.where} fails: ranks {[self.ranks[r] for r in resetting]} "
                    f"wait in '{RESET}' after an error, other ranks having joined; every rank "
                    "fails what it runs before the reset, until it comes to the reset too.")
            return everyone[resetting[0]]
        if all(d[:2] == active[0][1][:2] for _, d in active):
            return active[0][1]
        if mine is not None:
            raise MismatchError(describe_mismatch([d[1] for _, d in active],
                                                  [self.ranks[r] for r, _ in active]))
        return None

    def refuse(self, signature: Signature, joined: PeersJoined) -> None:
        """A collective other than an allreduce met joined members: JoinedError, after the
        round the joined members wait in. But the elastic reset's meeting (RESET) returns,
        to be run again: the joined members leave join() for the reset on seeing it (`join`)
        and meet it there."""
        self.round((str(signature.get("collective")), signature, None))
        if signature.get("name") == RESET:
            return
        names = [self.ranks[r] for r in joined.ranks]
        raise JoinedError(
            f"ringreduce: {signature.get('collective')} '{signature.get('name')}' on rank "
            f"{self.ranks[self.comm.rank]}: ranks {names} of this process set have joined "
            "(join()); until every rank has joined only allreduces run, the joined ranks "
            "contributing zeros. Run it before join(), or after every rank has joined.")

    def _zeros(self, reduction: tuple, device: Optional[torch.device]) -> None:
        """A joined member's part in an allreduce: zeros of the others' dtype and length."""
        dtype_name, count, op, prescale, postscale, on_gpu, lengths = reduction
        where = (device or torch.device("cuda", torch.cuda.current_device())) if on_gpu \
            else torch.device("cpu")
        zeros = torch.zeros(count, dtype=DTYPES[dtype_name], device=where)
        self.reduce(zeros, zeros, ReduceSpec(zeros.dtype, ReduceOp(op), prescale, postscale,
                                             lengths=lengths))
