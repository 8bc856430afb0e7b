"""Whether the MPI library reads CUDA device memory ("CUDA-aware"), decided once at init(): the
setting `RINGREDUCE_CUDA_AWARE` when it says 0 or 1, otherwise what the library answers. The
transport then holds the GPU way that fits (ways.py).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any


def resolve_cuda_aware(setting: Any, MPI: Any, comm: Any) -> tuple[bool, str]:
    """Whether device pointers may go to MPI, and how we know: the setting when it says 0 or
    1, otherwise what the MPI library answers."""
    if setting != "auto":
        return bool(setting), "set by RINGREDUCE_CUDA_AWARE or init(cuda_aware=)"
    return query_cuda_support(MPI, comm)


def query_cuda_support(MPI: Any, comm: Any) -> tuple[bool, str]:
    """Ask the MPI library: MPIX_Query_cuda_support() (MPICH, Open MPI), else what MVAPICH2-GDR
    is told (it has no query: `MV2_USE_CUDA=1` turns its device support on), else the MPI 4.1
    memory allocation kinds of `comm`; a library that answers none is taken as not aware."""
    for library in (None, MPI.__file__):   # the global namespace, then mpi4py's dependencies
        query = getattr(ctypes.CDLL(library), "MPIX_Query_cuda_support", None)
        if query is not None:
            return bool(query()), "MPIX_Query_cuda_support()"
    if "MVAPICH2-GDR" in MPI.Get_library_version().upper():
        told = os.environ.get("MV2_USE_CUDA", "0").strip()
        return told == "1", f"MVAPICH2-GDR with MV2_USE_CUDA={told}"
    info = comm.Get_info()
    try:
        kinds = info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()
    if kinds is not None:
        return supports_cuda_memory(kinds), f"mpi_memory_alloc_kinds={kinds!r}"
    return False, "the MPI library offers no CUDA query"


def supports_cuda_memory(kinds: str) -> bool:
    """Whether an MPI 4.1 memory-kinds string ('mpi,system,cuda:device') admits CUDA device
    memory: 'cuda' with no restrictor, or with 'device' among its restrictors."""
    for kind in kinds.split(","):
        name, _, restrictors = kind.strip().partition(":")
        if name == "cuda" and (not restrictors or "device" in restrictors.split(":")):
            return True
    return False
