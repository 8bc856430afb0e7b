"""MPI start-up, ranks, the local (per node) and cross (per local rank) communicators, abort.

`init()` duplicates the user's communicator so our point-to-point traffic can never match a
message of theirs, and asks for MPI_THREAD_MULTIPLE because the engine thread calls MPI while
the training thread runs (only one of them at a time: the engine serialises all our traffic).
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from . import config
from .errors import NotInitializedError, RingReduceError

log = logging.getLogger("ringreduce")


@dataclass
class World:
    comm: Any          # our private duplicate of the user's communicator
    local: Any         # ranks on the same node
    cross: Any         # ranks with the same local rank, one per node
    engine: Any        # the Engine that serialises every collective


_world: Optional[World] = None
_init_lock = threading.Lock()


def _mpi():
    """Import mpi4py.MPI asking for THREAD_MULTIPLE, unless the user already initialised MPI."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def init(comm: Any = None, **settings: Any) -> None:
    """Start ringreduce on `comm` (default MPI.COMM_WORLD). Idempotent.

    Keyword arguments override `RINGREDUCE_*` settings, e.g. `simulated_nodes=2`.
    """
    global _world
    with _init_lock:
        if _world is not None:
            return
        unknown = set(settings) - set(config.SETTINGS)
        if unknown:
            raise TypeError(f"ringreduce.init(): unknown setting(s) {sorted(unknown)}; known: "
                            f"{sorted(config.SETTINGS)}")
        resolved = {key: config.get(key, settings.get(key)) for key in config.SETTINGS}
        MPI = _mpi()
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            raise RingReduceError(
                "ringreduce: MPI was initialised with a thread level below MPI_THREAD_SERIALIZED; "
                "ringreduce's engine thread needs at least that. Import ringreduce (or set "
                "mpi4py.rc.thread_level = 'multiple') before importing mpi4py.MPI.")
        base = MPI.COMM_WORLD if comm is None else comm
        ours = base.Dup()
        nodes = resolved["simulated_nodes"]
        if nodes > 0:
            local = ours.Split(color=ours.rank * min(nodes, ours.size) // ours.size, key=ours.rank)
        else:
            local = ours.Split_type(MPI.COMM_TYPE_SHARED, key=ours.rank)
        cross = ours.Split(color=local.rank, key=ours.rank)

        from .cuda import resolve_cuda_aware   # GPU path: the choice is made and logged once

        resolved["cuda_aware"], how = resolve_cuda_aware(resolved["cuda_aware"], MPI, ours)
        log.info("ringreduce: rank %d: CUDA-aware MPI: %s (%s)", ours.rank,
                 "yes, device buffers go straight to MPI" if resolved["cuda_aware"]
                 else "no, GPU buffers are staged through pinned host memory", how)

        from .engine import Engine

        engine = Engine(ours, resolved)
        # Shared memory inside nodes needs the same rank count on every node, so that each
        # local rank's chunk has the same size as its peers' on the other nodes.
        uniform = len(set(ours.allgather(local.size))) == 1
        if resolved["shared_memory"] and local.size > 1 and uniform:
            from .shm import NodeShm

            engine.node = NodeShm(local, cross, engine.negotiator.watch,
                                  resolved["shared_small_bytes"], resolved["block_bytes"],
                                  engine.scratch.get, resolved["segment_bytes"])
            engine.negotiator.node = engine.node
        _world = World(ours, local, cross, engine)
        if resolved["abort_on_error"] and ours.size > 1:
            _install_abort_hooks()
        atexit.register(shutdown)
        if resolved["timeline"]:
            from .timeline import start_timeline

            start_timeline(resolved["timeline"])
        log.debug("rank %d/%d: local %d/%d, cross %d/%d, thread level %d", ours.rank, ours.size,
                  local.rank, local.size, cross.rank, cross.size, level)


def shutdown() -> None:
    """Stop the engine and free our communicators. `init()` may be called again afterwards."""
    global _world
    with _init_lock:
        world, _world = _world, None
    if world is None:
        return
    world.engine.shutdown()
    from .timeline import _detach

    _detach(world.engine)      # after the engine thread ended: no event is cut off
    for c in (world.cross, world.local, world.comm):
        c.Free()


def is_initialized() -> bool:
    return _world is not None


def world(what: str = "this function") -> World:
    """The running world, or a clear error naming what was called too early."""
    if _world is None:
        raise NotInitializedError(
            f"ringreduce: {what} was called before ringreduce.init(); call init() first, "
            "once per process, after importing ringreduce")
    return _world


def size() -> int:
    return world("size()").comm.size


def rank() -> int:
    return world("rank()").comm.rank


def local_size() -> int:
    return world("local_size()").local.size


def local_rank() -> int:
    return world("local_rank()").local.rank


def cross_size() -> int:
    return world("cross_size()").cross.size


def cross_rank() -> int:
    return world("cross_rank()").cross.rank


_ABORT_GRACE_SECONDS = 1.0   # lets the launcher forward our message before it kills the job


def abort(message: str, code: int = 1) -> None:
    """End the whole MPI job: print `message` once, from this rank, then MPI_Abort.

    The launcher tears the job down as soon as MPI_Abort reaches it, and can drop what this
    rank wrote just before; so wait a moment first: the message is the one thing the user needs.
    """
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(_ABORT_GRACE_SECONDS)
    MPI = _mpi()
    MPI.COMM_WORLD.Abort(code)


def _install_abort_hooks() -> None:
    """An uncaught exception on one rank must end the job, not leave the others in a collective."""
    previous_hook = sys.excepthook

    def on_uncaught(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            return previous_hook(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort(f"ringreduce: rank {_rank_or_unknown()} raised an uncaught exception; "
              f"aborting the job.\n{text}")

    def on_thread_uncaught(args):
        on_uncaught(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = on_uncaught
    threading.excepthook = on_thread_uncaught


def _rank_or_unknown() -> str:
    return str(_world.comm.rank) if _world is not None else "?"
