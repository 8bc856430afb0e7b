"""MPI start-up and shut-down, the job's ranks and topology, the timeline switch, and abort.

`init()` duplicates the user's communicator so our traffic can never match a message of
theirs, resolves the settings once, opens the global process set and any sets given, and
makes an uncaught exception on any rank end the whole job instead of leaving the others
waiting in a collective.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import threading
import time
import traceback
from typing import Any, Iterable, Optional, Union

from . import timeline
from .config import Settings
from .cuda import resolve_cuda_aware
from .errors import RingReduceError
from .mpi import mpi
from .process_sets import ProcessSet, global_set, is_running, register_at_init, start, stop

log = logging.getLogger("ringreduce")
_init_lock = threading.Lock()
_atexit_registered = False


def init(comm: Any = None, process_sets: Union[None, str, Iterable[ProcessSet]] = None,
         **settings: Any) -> None:
    """Start ringreduce on `comm` (default MPI.COMM_WORLD). Idempotent.

    `process_sets`: ProcessSet objects to register now (they are ready for collectives when
    init returns), or "dynamic" (accepted for Horovod; sets may always be added later).
    Keyword arguments override `RINGREDUCE_*` settings, e.g. `simulated_nodes=2`.
    """
    global _atexit_registered
    with _init_lock:
        if is_running():
            return
        resolved = Settings.load(**settings)
        MPI = mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RingReduceError(
                "ringreduce: MPI was initialised below MPI_THREAD_MULTIPLE; ringreduce runs "
                "collectives from its engine threads while yours run. Import ringreduce (or set "
                "mpi4py.rc.thread_level = 'multiple') before importing mpi4py.MPI.")
        ours = (MPI.COMM_WORLD if comm is None else comm).Dup()
        aware, how = resolve_cuda_aware(resolved.cuda_aware, MPI, ours)
        resolved = dataclasses.replace(resolved, cuda_aware=aware)
        log.info("ringreduce: rank %d: CUDA-aware MPI: %s (%s)", ours.rank,
                 "yes, device buffers go straight to MPI" if aware
                 else "no, GPU buffers are staged through pinned host memory", how)
        nodes = min(resolved.simulated_nodes, ours.size)
        size = ours.size
        glob = start(ours, resolved, abort,
                     (lambda rank: rank * nodes // size) if nodes > 0 else None)
        if resolved.abort_on_error and ours.size > 1:
            _install_abort_hooks()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        if resolved.timeline:
            timeline.start(resolved.timeline, ours.rank)
        log.debug("rank %d/%d: local %d/%d, cross %d/%d", ours.rank, ours.size, glob.local.rank,
                  glob.local.size, glob.cross.rank, glob.cross.size)
    register_at_init(process_sets)


def shutdown() -> None:
    """Finish what is queued, stop the engines and free our communicators. `init()` may be
    called again afterwards."""
    with _init_lock:
        stop()              # each set's engine, window and communicators, the global one last
        timeline.stop()     # after the engine threads ended: no event is cut off


def is_initialized() -> bool:
    return is_running()


def size() -> int:
    return global_set("size()").size


def rank() -> int:
    return global_set("rank()").rank


def local_size() -> int:
    return global_set("local_size()").local.size


def local_rank() -> int:
    return global_set("local_rank()").local.rank


def cross_size() -> int:
    return global_set("cross_size()").cross.size


def cross_rank() -> int:
    return global_set("cross_rank()").cross.rank


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this rank's timeline to `file_path` (see `timeline.rank_path`); a running
    one is stopped first. Every rank must call it for a complete picture, but it is not
    collective. `mark_cycles` is accepted for Horovod and ignored: ringreduce has no background
    negotiation cycles to mark (each collective is negotiated when it runs)."""
    glob = global_set("start_timeline()")
    stop_timeline()
    timeline.start(file_path, glob.ranks[glob.rank])


def stop_timeline() -> None:
    """Stop and close this rank's timeline, if one runs. Collectives already submitted on the
    global set finish first (the switch runs in its order), so none of their spans is cut."""
    glob = global_set("stop_timeline()")
    if timeline.running():
        glob.engine.run(f"timeline.stop.{time.monotonic_ns()}", timeline.stop)


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
    mpi().COMM_WORLD.Abort(code)


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
    return str(rank()) if is_running() else "?"
