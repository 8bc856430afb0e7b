"""What the benchmark scripts share: starting torch.distributed's gloo next to MPI, the
metadata that makes a result file reproducible, and writing the results."""
import datetime
import json
import os
import socket
import statistics
import sys
import time

from mpi4py import MPI


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


def time_interleaved(calls: dict, iters: int, rounds: int = 5) -> dict:
    """time_it for several methods at once, in `rounds` rounds that take them in turn: this
    machine has hiccups of tens of milliseconds, which would otherwise land on one method's
    whole median. `calls`: name -> (fn, barrier); fn None on a rank that sits the method out
    (it waits in a sleeping barrier after each of that method's rounds, with every rank).
    Returns name -> this rank's median (0.0 where it sat out)."""
    rounds = max(1, min(rounds, iters))
    times: dict = {name: [] for name in calls}
    partial = {name: any(MPI.COMM_WORLD.allgather(fn is None))
               for name, (fn, _) in calls.items()}
    for fn, _ in calls.values():
        if fn is not None:
            warm_up(fn, iters)
    for r in range(rounds):
        count = iters // rounds + (r < iters % rounds)
        for name, (fn, barrier) in calls.items():
            if fn is not None:
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


def init_gloo(comm=MPI.COMM_WORLD) -> None:
    """torch.distributed with gloo over loopback, ranks as in `comm` (a free port from rank 0)."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=datetime.timedelta(minutes=5))


def metadata(comm=MPI.COMM_WORLD, **extra) -> dict:
    """Where and with what a benchmark ran (collective: every rank must call it)."""
    import torch

    import ringreduce

    return {
        "ranks": comm.size,
        "mpi_library": MPI.Get_library_version().strip(),
        "mpi4py": __import__("mpi4py").__version__,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "ringreduce": ringreduce.__version__,
        "hostname": socket.gethostname(),
        "hosts": sorted(set(comm.allgather(socket.gethostname()))),
        "cpu_count": os.cpu_count(),
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
