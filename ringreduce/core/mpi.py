"""mpi4py, imported on first use with the thread level ringreduce needs.

Importing `mpi4py.MPI` starts MPI. ringreduce calls MPI from several threads at once (one engine
thread per process set, and the caller's thread for a collective run inline), so it asks for
MPI_THREAD_MULTIPLE, which can only be asked for before that import; importing it lazily also
keeps `import ringreduce` free of MPI start-up.
"""
from __future__ import annotations

import functools
import sys
from typing import Any


@functools.cache     # (a call costs a dictionary lookup: it is made per message)
def mpi() -> Any:
    """The `mpi4py.MPI` module, started with MPI_THREAD_MULTIPLE unless the user started it."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI
