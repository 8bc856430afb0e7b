"""A torch.distributed ProcessGroup on a ringreduce process set: how torch's collectives become
ours (ringreduce/distributed/__init__.py registers it as the backend "ringreduce").

Each collective becomes one of ringreduce's public collectives on the group's set, so it takes
the same transport, signature check (MismatchError on every rank), stall report and bitwise-
identical results as the Horovod-style API. torch's calls carry no names: each gets the set's
next automatic name ('dist.noname.7'), counted over calls of every kind, so members pair them
by their position in the group's sequence, the order torch requires of every rank; a rank whose
call at a position is of another kind (a barrier where the others all_reduce) then fails the
signature check on every rank (MismatchError), where a count per kind would leave both waiting
for calls never made. Gathers send one row per rank (the signature then holds the whole shape),
gather is an allgather whose root keeps the rows, reduce-scatters reduce one row per rank,
reduce is an allreduce whose root keeps the result, scatter an all-to-all in which only the
root sends, and a sparse all_reduce gathers every rank's entries (Horovod's sparse allreduce)
and writes their coalesced sum over the input, as gloo does; so do all_reduce and reduce
with BAND, BOR or BXOR (ops ours lack), folding the rows in rank order. Each call returns a
`CollectiveWork` (work.py); a synchronous `all_reduce` runs as `allreduce_`. send/recv:
MPI point-to-point on a communicator of the group's own (point_to_point.py).
"""
from __future__ import annotations

from .group_movements import Movements
from .group_reductions import Reductions


class RingReduceGroup(Reductions, Movements):
    """A torch.distributed process group on a ringreduce process set: `process_set` holds
    the group's ranks in group-rank order, `channel` its point-to-point messages. Its calls:
    group_reductions.py and group_movements.py, on group_base.py."""
