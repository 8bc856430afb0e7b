"""Process-wide state that outlives the collectives and sets that made it: the MPI requests an
error left pending (a peer left or failed, transport/stall.py), anywhere in ringreduce. MPI may
still read or write their buffers, so the requests and the buffers are kept here, alive for
the life of the process (`abandon`). (The running job's sets: sets/job.py.)"""
from __future__ import annotations

from typing import Any

_ABANDONED: list[Any] = []


def abandon(*kept: Any) -> None:
    """Keep these requests and buffers alive for good."""
    _ABANDONED.extend(kept)

