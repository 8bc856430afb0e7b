"""MPI start-up and shut-down, the job's ranks and topology, the timeline switch, and abort.

`init()` duplicates the user's communicator so our traffic can never match a message of
theirs, resolves the settings once, opens the global process set and any sets given, and
makes an uncaught exception on any rank end the whole job instead of leaving the others
waiting in a collective.
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import logging
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Iterable, Sequence, Union

import torch

from ..core import timeline
from ..core.config import Settings, ignored_horovod_variables
from ..core.errors import RingReduceError, ShutDownError
from ..core.mpi import mpi
from ..core.thread_places import takes_part
from ..core.version import __version__
from ..core.waiting import wait_reporting
from ..gpu.cuda_aware import resolve_cuda_aware
from ..transport import ring
from .job import is_running
from .process_set import ProcessSet
from .process_sets import global_set, register_at_init, registered_sets, start, stop

log = logging.getLogger("ringreduce")
_init_lock = threading.Lock()
_atexit_registered = False
_started_with: tuple = (None, {})    # init()'s communicator and settings, for restart()


def init(comm: Any = None, process_sets: Union[None, str, Iterable[ProcessSet]] = None,
         **settings: Any) -> None:
    """Start ringreduce on `comm` (default MPI.COMM_WORLD; as in Horovod, also a list of
    MPI_COMM_WORLD ranks, which alone then call init()). Idempotent.

    `process_sets`: ProcessSet objects to register now (they are ready for collectives when
    init returns), or "dynamic" (accepted for Horovod; sets may always be added later).
    Keyword arguments override `RINGREDUCE_*` settings, e.g. `simulated_nodes=2`.
    """
    global _atexit_registered, _started_with
    with _init_lock:
        if is_running():
            return
        resolved = Settings.load(**settings)
        _started_with = (comm, settings)
        MPI = mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RingReduceError(
                "ringreduce: MPI was initialised below MPI_THREAD_MULTIPLE; ringreduce runs "
                "collectives from its engine threads while yours run. Import ringreduce (or set "
                "mpi4py.rc.thread_level = 'multiple') before importing mpi4py.MPI.")
        given, made = _communicator(MPI, comm)
        ours = _duplicate(given, resolved)
        if made:
            given.Free()
        aware, how = resolve_cuda_aware(resolved.cuda_aware, MPI, ours)
        resolved = dataclasses.replace(resolved, cuda_aware=aware)
        _agree_on_settings(ours, resolved)
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
        if resolved.timeline and resolved.timeline != timeline.DYNAMIC:
            timeline.start(resolved.timeline, ours.rank)
        ignored = ignored_horovod_variables()
        if ignored and ours.rank == 0:
            warnings.warn(f"ringreduce: ignoring Horovod settings it has no use for: "
                          f"{', '.join(ignored)} (see docs/guide/settings.md for ours)",
                          stacklevel=2)
        log.debug("rank %d/%d: local %d/%d, cross %d/%d", ours.rank, ours.size, glob.local.rank,
                  glob.local.size, glob.cross.rank, glob.cross.size)
    register_at_init(process_sets)


def _communicator(MPI: Any, comm: Any) -> tuple[Any, bool]:
    """init()'s `comm` as a communicator, and whether it was made here: an mpi4py communicator
    as it is; None or an empty list, MPI_COMM_WORLD; Horovod's list of MPI_COMM_WORLD ranks,
    a communicator of those ranks (only they call init(); made by MPI_Comm_create_group, as
    Horovod makes it, so the others take no part)."""
    if comm is None or (isinstance(comm, (list, tuple)) and not comm):
        return MPI.COMM_WORLD, False
    if not isinstance(comm, (list, tuple)):
        return comm, False
    world, ranks = MPI.COMM_WORLD, [int(r) for r in comm]
    if world.rank not in ranks or len(set(ranks)) != len(ranks) or not all(
            0 <= r < world.size for r in ranks):
        raise ValueError(f"ringreduce: init(comm={list(comm)}) on rank {world.rank}: the list "
                         f"names distinct ranks of MPI_COMM_WORLD ({world.size} ranks), this "
                         "one among them; only the listed ranks call init()")
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group), True
    finally:
        group.Free()


def _duplicate(comm: Any, settings: Settings) -> Any:
    """`comm.Dup()`, waited for with the stall watch's reports: a rank that never calls init()
    (it exited, or took another branch) keeps every other rank here, which a report says every
    RINGREDUCE_STALL_CHECK_TIME seconds; RINGREDUCE_STALL_SHUTDOWN_TIME ends the job."""
    ours, request = comm.Idup()
    limit = settings.stall_shutdown_time

    def waited(seconds: float) -> str:
        return (f"ringreduce: stall: rank {comm.rank} has waited {seconds:.0f} s in init() "
                f"for the other ranks of its communicator ({comm.size} ranks): every rank "
                "must call init(), and a rank that never does (it exited, or took another "
                "branch) keeps the others here.")

    wait_reporting(request.Test, settings.stall_check_time,
                   lambda seconds: log.warning(waited(seconds)), limit,
                   lambda seconds: abort(f"{waited(seconds)} Shutting the job down after "
                                         f"{limit:g} s (RINGREDUCE_STALL_SHUTDOWN_TIME)."))
    return ours


def _agree_on_settings(comm: Any, settings: Settings) -> None:
    """Every rank of `comm` runs the same ringreduce release with the same Settings.AGREED, or
    every rank raises, naming what differs and which ranks have which value (one rank's
    environment lacking a variable, an init() argument computed per rank, another install on
    some node); `comm` is freed then."""
    names = ("version", *Settings.AGREED)
    mine = (__version__, *(getattr(settings, name) for name in Settings.AGREED))
    rank, everyone = comm.rank, comm.allgather(mine)
    differ = [i for i in range(len(names)) if any(values[i] != mine[i] for values in everyone)]
    if not differ:
        return
    comm.Free()
    told = []
    for i in differ:
        held: dict[Any, list[int]] = {}
        for member, values in enumerate(everyone):
            held.setdefault(values[i], []).append(member)
        name = names[i]
        what = "ringreduce's version" if name == "version" else \
            f"{name} ({Settings.env_name(name)})"
        told.append(f"{what}: " + ", ".join(f"{value!r} on ranks {ranks}"
                                            for value, ranks in held.items()))
    raise RingReduceError(
        f"ringreduce: init() on rank {rank}: what every rank must share differs "
        f"({'; '.join(told)}): ranks that moved a collective's bytes different ways would pair "
        "it anyway. Set the settings alike on every rank (export the variables to every rank, "
        "e.g. mpiexec -genv, or pass the same init() arguments), and install one ringreduce "
        "release everywhere.")


def shutdown() -> None:
    """Finish what is queued, stop the engines and free our communicators. `init()` may be
    called again afterwards."""
    _shut_down()


def _shut_down(restarting: bool = False) -> list[int]:
    """Returns the ranks that left without restarting (stop())."""
    with _init_lock:
        left = stop(restarting)     # each set's engine, window and communicators, global last
        timeline.stop()     # after the engine threads ended: no event is cut off
    return left


def restart() -> None:
    """shutdown() and init() again (collective), on init()'s communicator and settings, with
    the process sets registered now registered again, in their order: the same world, for
    elastic's reset after a member's failure inside a collective shut the job down. What held
    the old sets finds the new ones (a DistributedOptimizer at its next step)."""
    sets = registered_sets()
    comm, settings = _started_with
    rank = global_set("restart()").rank
    left = _shut_down(restarting=True)
    if left:    # init() would wait for them for ever: end here, on every rank alike
        raise ShutDownError(
            f"ringreduce: rank {rank}: cannot restart the job: ranks {left} left it for good "
            "(shutdown(), or the end of the script) while the others restarted. Every rank "
            "must take part in a restart; the job ends here.")
    init(comm, process_sets=sets, **settings)


def is_initialized() -> bool:
    """Whether init() has run (and shutdown() has not since)."""
    return is_running()


def size() -> int:
    """The number of ranks in the job (init()'s communicator)."""
    return global_set("size()").size


def rank() -> int:
    """This process's rank in the job, 0 to size() - 1."""
    return global_set("rank()").rank


def local_size() -> int:
    """The number of ranks on this node (or this simulated node)."""
    return global_set("local_size()").local.size


def local_rank() -> int:
    """This process's rank among the ranks on its node: the GPU to use."""
    return global_set("local_rank()").local.rank


def cross_size() -> int:
    """The number of nodes holding a rank with this local rank."""
    return global_set("cross_size()").cross.size


def cross_rank() -> int:
    """This node's index among the nodes holding this local rank."""
    return global_set("cross_rank()").cross.rank


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return global_set("is_homogeneous()").homogeneous


# What this library is built with, as Horovod's build queries answer it: MPI always (mpi4py),
# our own CUDA path when CuPy and a CUDA build of torch are present, none of the others.

def mpi_built() -> bool:
    """True: ringreduce runs on MPI (Horovod's build query)."""
    return True


def mpi_enabled() -> bool:
    """MPI carries every collective once ringreduce runs."""
    return is_running()


def mpi_threads_supported() -> bool:
    """Always true once initialised: init() insists on MPI_THREAD_MULTIPLE."""
    global_set("mpi_threads_supported()")
    return True


def gloo_built() -> bool:
    """False: there is no Gloo controller (Horovod's build query)."""
    return False


def gloo_enabled() -> bool:
    """False: there is no Gloo controller (Horovod's query)."""
    return False


def nccl_built() -> int:
    """Horovod returns the NCCL version code, or 0 without NCCL."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL support (Horovod's build query)."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL support (Horovod's build query)."""
    return False


def rocm_built() -> bool:
    """False: no ROCm support (Horovod's build query)."""
    return False


def cuda_built() -> bool:
    """Whether our GPU path can run: a CUDA build of torch, and CuPy to view its tensors."""
    return torch.version.cuda is not None and importlib.util.find_spec("cupy") is not None


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's helper: whether the framework sees a GPU (only 'torch' is ours)."""
    return ext_base_name == "torch" and torch.cuda.is_available()


def split_list(items: Sequence[Any], parts: int) -> list:
    """Horovod's helper: `items` cut into `parts` consecutive pieces whose lengths differ by at
    most one, longer ones first."""
    return [items[lo:hi] for lo, hi in ring.chunk_bounds(ring.balanced_counts(len(items), parts))]


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Horovod's check that its framework extension was built; ringreduce's always is."""


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this rank's timeline to `file_path` ('{rank}' in it is replaced by the
    rank, else '.rank<r>' goes before the extension); a running
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
    # The process's own stderr: an excepthook that wraps ours may have redirected sys.stderr
    # to collect what we print (torch.distributed's prefixes each line with the rank), and
    # it would never get to print it, since we do not return.
    stderr = sys.__stderr__ or sys.stderr
    stderr.write(message if message.endswith("\n") else message + "\n")
    stderr.flush()
    sys.stdout.flush()
    time.sleep(_ABORT_GRACE_SECONDS)
    mpi().COMM_WORLD.Abort(code)


def _install_abort_hooks() -> None:
    """An uncaught exception on one rank must end the job, not leave the others in a
    collective: on the main thread, on ringreduce's own, or on a thread that called a
    collective. Another thread's ends that thread alone, as Python (and so Horovod) has it:
    the others wait for nothing from it."""
    previous_hook = sys.excepthook
    previous_thread_hook = threading.excepthook

    def on_uncaught(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            return previous_hook(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort(f"ringreduce: rank {_rank_or_unknown()} raised an uncaught exception; "
              f"aborting the job.\n{text}")

    def on_thread_uncaught(args):
        if not takes_part():    # (the hook runs on the thread that raised)
            return previous_thread_hook(args)
        on_uncaught(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = on_uncaught
    threading.excepthook = on_thread_uncaught


def _rank_or_unknown() -> str:
    return str(rank()) if is_running() else "?"
