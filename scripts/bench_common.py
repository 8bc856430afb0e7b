"""What the benchmark scripts share: timing, starting torch.distributed (our backend, gloo beside it), the
metadata that says which run a result file is from (commit, machine, versions, environment),
and writing the results."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

from mpi4py import MPI


def size_label(nbytes: int) -> str:
    """A size as the benchmarks' rows name it: '4K', '64M', else the bytes."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def time_it(fn, iters: int, barrier=MPI.COMM_WORLD.Barrier) -> float:
    """Warm up (a fifth as many calls, at most 100), then the median over `iters` of one
    call's time, each call after a barrier."""
    warm_up(fn, iters)
    return statistics.median(samples(fn, iters, barrier))


def warm_up(fn, iters: int) -> None:
    for _ in range(max(1, min(100, iters // 5))):
        fn()


def samples(fn, iters: int, barrier) -> list[float]:
    """`iters` single calls' times, each call after `barrier()`."""
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def cores_awake(interval: float = 0.0002):
    """While in use, a thread of ours wakes every `interval` seconds and does nothing. On a VM
    a vCPU left idle takes long to wake, and a library that blocks in the kernel for each
    message pays that per message: on this one, gloo's 4 KiB allreduce at 2 ranks took 2.7 to
    3.9 ms without this thread and 0.5 to 0.7 ms with it (ringreduce's engine thread, which
    once looked for work this often, did the same by accident). Measured under it, gloo is
    at its best here."""
    stop = threading.Event()

    def wake() -> None:
        while not stop.wait(interval):
            pass

    thread = threading.Thread(target=wake, name="cores-awake", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def time_interleaved(calls: dict, iters: int, rounds: int = 5, awake: frozenset = frozenset()
                     ) -> dict:
    """time_it for several methods at once, in `rounds` rounds that take them in turn: this
    machine has hiccups of tens of milliseconds, which would otherwise land on one method's
    whole median. `calls`: name -> (fn, barrier); fn None on a rank that sits the method out
    (it waits in a sleeping barrier after each of that method's rounds, with every rank).
    Methods named in `awake` run under cores_awake(). Returns name -> this rank's median (0.0
    where it sat out)."""
    rounds = max(1, min(rounds, iters))
    times: dict = {name: [] for name in calls}
    partial = {name: any(MPI.COMM_WORLD.allgather(fn is None))
               for name, (fn, _) in calls.items()}

    def helped(name: str):
        return cores_awake() if name in awake else contextlib.nullcontext()

    for name, (fn, _) in calls.items():
        if fn is not None:
            with helped(name):
                warm_up(fn, iters)
    for r in range(rounds):
        count = iters // rounds + (r < iters % rounds)
        for name, (fn, barrier) in calls.items():
            if fn is not None:
                with helped(name):
                    times[name] += samples(fn, count, barrier)
            if partial[name]:
                sleeping_barrier()
    return {name: statistics.median(t) if t else 0.0 for name, t in times.items()}


def sleeping_barrier() -> None:
    """A barrier that sleeps while it waits (ranks sitting a measurement out leave the cores
    to those taking it)."""
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def slowest(seconds: float) -> float:
    """The slowest rank's time: what a collective costs the job."""
    return MPI.COMM_WORLD.allreduce(seconds, op=MPI.MAX)


def cross_comm(local_rank: int):
    """The ranks with this local rank, one per node (as ringreduce sees nodes, simulated or
    not): where MPI's own Allreduce between nodes runs, as the anchor for ours."""
    return MPI.COMM_WORLD.Split(local_rank, MPI.COMM_WORLD.rank)


def init_torch_distributed(gloo: bool = True):
    """torch.distributed's default group on the ringreduce backend (ringreduce.distributed),
    and, with `gloo`, a gloo group of every rank beside it (over loopback: one host), which
    it returns (else None). torch.distributed is imported here: the other benchmarks go
    without it."""
    import torch.distributed as dist

    import ringreduce.distributed

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ringreduce.distributed.init_process_group()
    return dist.new_group(backend="gloo") if gloo else None


# Environment variables that change what a benchmark measures: thread counts, ringreduce's and
# Horovod's settings, the MPI libraries' own tuning knobs, and which GPUs are visible.
ENVIRONMENT_PREFIXES = ("RINGREDUCE_", "HOROVOD_", "MPIR_CVAR_", "OMPI_MCA_", "UCX_", "FI_")
ENVIRONMENT_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                     "CUDA_VISIBLE_DEVICES")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment() -> dict:
    """The settings in this process's environment that bear on a measurement."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(ENVIRONMENT_PREFIXES) or k in ENVIRONMENT_NAMES}


def git_state(repository: str = REPOSITORY) -> dict:
    """The commit the benchmark's code is at and whether the working tree differs from it
    (tracked files only: `dirty_count` of them, `dirty_files` names up to 20). Empty outside
    a git checkout or without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", repository, *args], capture_output=True,
                              text=True, timeout=30, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no")
                   .splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": bool(changed), "dirty_count": len(changed),
            "dirty_files": changed[:20]}


def cpu_model() -> str | None:
    """The CPU's model name as the OS reports it (Linux: /proc/cpuinfo), else what `platform`
    knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or None


def usable_cpus() -> int | None:
    """The CPUs this process may run on (its affinity mask), which a launcher may narrow."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def metadata(comm=MPI.COMM_WORLD, **extra) -> dict:
    """Where and with what a benchmark ran (collective: every rank must call it): the date, the
    machine (hosts, CPU model and count), the software (MPI library, mpi4py, torch, NumPy,
    Python, ringreduce and the git commit of this checkout, with whether its tracked files
    were modified), the environment variables that bear on the measurement (`environment()`)
    and the command line. Rank 0's view, plus every host's CPUs when the job spans hosts;
    `extra` adds the script's own parameters."""
    import numpy
    import torch

    import ringreduce

    host = {"hostname": socket.gethostname(), "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(), "cpus_usable": usable_cpus()}
    hosts = {h["hostname"]: h for h in comm.allgather(host)}
    repository = git_state() if comm.rank == 0 else None
    return {
        "ranks": comm.size,
        "mpi_library": MPI.Get_library_version().strip(),
        "mpi_vendor": "{} {}".format(MPI.get_vendor()[0],
                                     ".".join(map(str, MPI.get_vendor()[1]))),
        "mpi4py": __import__("mpi4py").__version__,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "numpy": numpy.__version__,
        "ringreduce": ringreduce.__version__,
        **comm.bcast(repository, root=0),
        "hostname": host["hostname"],
        "hosts": sorted(hosts),
        "cpu_model": host["cpu_model"],
        "cpu_count": host["cpu_count"],
        "cpus_usable": host["cpus_usable"],
        **({"host_cpus": [hosts[h] for h in sorted(hosts)]} if len(hosts) > 1 else {}),
        "environment": environment(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "argv": sys.argv,
        **extra,
    }


def write_results(payload: dict, json_path, png_path, draw) -> None:
    """Rank 0's outputs: `payload` as JSON and `draw(png_path)` as a plot, each if asked for."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {json_path}")
    if png_path:
        draw(png_path)
        print(f"wrote {png_path}")
