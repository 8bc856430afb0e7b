"""`ProcessSet`, Horovod's handle on some of the job's ranks: a list of global ranks, or an
mpi4py communicator that holds them, registered collectively (process_sets.py) before
collectives take it as `process_set=`. `global_process_set` holds every rank."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from .job import state


def _is_comm(value: Any) -> bool:
    return type(value).__module__ == "mpi4py.MPI" and hasattr(value, "Get_group")


class ProcessSet:
    """A set of ranks that runs collectives together. Pass it to `init(process_sets=[...])` or
    `add_process_set`, then as `process_set=` to collectives. Roots stay global ranks."""

    process_set_id: Optional[int] = None
    ranks: Optional[list[int]] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        if _is_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ringreduce: ProcessSet takes a list of process ranks or an mpi4py "
                             f"communicator, not {type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in ranks):
            raise ValueError(f"ringreduce: ProcessSet ranks must be integers, got {ranks!r}")
        self.ranks = sorted(int(r) for r in ranks)

    def size(self) -> Optional[int]:
        """How many ranks the set holds; None until it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (its index in `ranks`); None until registered.
        (Collectives still take global root ranks.)"""
        if self.process_set_id is None:
            return None
        me = state("ProcessSet.rank()").rank
        if me not in self.ranks:
            raise ValueError(f"ringreduce: rank {me} is not part of process set "
                             f"{self.process_set_id} (ranks {self.ranks})")
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set; None while its ranks are unknown."""
        if self.ranks is None:
            return None
        return state("ProcessSet.included()").rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
