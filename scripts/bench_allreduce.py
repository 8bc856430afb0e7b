"""Allreduce benchmark: ringreduce against MPI's own Allreduce, torch.distributed (gloo) and copies.

Run it under MPI, one process per rank, e.g.

    mpiexec -n 4 python scripts/bench_allreduce.py
    mpiexec -n 2 python scripts/bench_allreduce.py --sizes 4K,1M --iters 5 \\
        --json out.json --plot out.png      # --plot needs `pip install -e .[bench]`

Options: --sizes (bytes per rank, K/M/G = powers of 1024; default 4K,64K,1M,16M,64M,256M),
--dtypes (float32,bfloat16), --iters (default: adapts to the size, 1000 for small messages and
about 5 for 256M), --json FILE, --plot FILE.png, --no-gloo (skip gloo's row),
--no-dist (skip torch.distributed altogether: the dist_rr and gloo rows),
--profile (the in-place allreduce's time per phase, see bench_profile).

Methods, each reducing (Sum) a buffer of SIZE bytes on every rank:
    ours      ringreduce.allreduce(t, op=Sum)   (out of place, synchronous)
    ours_     ringreduce.allreduce_(t, op=Sum)  (in place)
    bucket    an asynchronous in-place call: allreduce_async_ then synchronize (a small one
              begins on the caller's thread and completes there when the peers are in step;
              a large one runs on the engine thread, as the optimizer's buckets do)
    set_      allreduce_ on a process set of ranks 0 and 1 while the other ranks idle (jobs of
              3 ranks or more); its busbw counts the set's 2 ranks
    mpi       comm.Allreduce(send, recv, op=MPI.SUM) on NumPy arrays ("n/a" for bfloat16,
              which MPI cannot sum)
    mpi_x     the same on the cross communicator (one rank per node, all such communicators
              at once), when the job spans nodes (RINGREDUCE_SIMULATED_NODES counts): MPI's
              own allreduce between nodes, of the whole SIZE
    dist_rr   torch.distributed.all_reduce(t, async_op=True).wait() on the "ringreduce" backend
              (ringreduce.distributed: the default group, our global set), in place: what
              DDP does with a bucket
    dist_sync torch.distributed.all_reduce(t) on that backend: the synchronous call a script
              makes (metrics, a loss)
    gloo      torch.distributed.all_reduce with the gloo backend, over loopback TCP (a gloo
              group of every rank next to that default group), timed while a thread of the
              benchmark wakes every 0.2 ms (bench_common.cores_awake): gloo blocks in the
              kernel for each message, and on a VM an idle vCPU is slow to wake (here a 4K
              allreduce took 2.7-3.9 ms without that thread, 0.5-0.7 ms with it)
    memcpy    glibc's memcpy (np.copyto) of SIZE bytes, on rank 0 alone (the other ranks idle at
              a sleeping barrier) and on every rank at once
    stream    the same with our non-temporal-store copy (native/kernels.c rr_copy_stream)
    copy_     torch's dst.copy_(src) on rank 0 alone, for reference only
    The yardstick is the fastest of the memcpy and stream rows of that size run on every rank
    at once: a rank's node allreduce must read its input and write its result, the traffic of
    one copy, while every other rank does the same.

Timing: a few warm-up calls, then per iteration: barrier, time one call. The methods of a size
take turns, in five rounds of a fifth of the iterations each, so that a hiccup of the machine
lands on all of them rather than on one method's whole median. A rank's time is the median over
its iterations; the reported time is the largest of the ranks' medians.

Columns (nccl-tests definitions, GB/s = 1e9 bytes/s):
    time(us)    the reported time of one call
    algbw       SIZE / time
    busbw       algbw * 2(n-1)/n, n = ranks: the traffic per rank of an ideal ring, so it is
                comparable across rank counts and to hardware bandwidth
    bus/copy    busbw / the yardstick copy bandwidth of the same size (every rank at once)
    bus/alone   busbw / the fastest copy on rank 0 alone (the memory bandwidth one core gets)
    xMPI, xMPIx, xgloo  speedup of ours (and dist_rr, dist_sync) over mpi, mpi_x, gloo = their
                time / our time (>1: ours is faster)

The environment is left alone (e.g. OMP_NUM_THREADS); torch.get_num_threads() is reported.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import ringreduce as hvd  # before mpi4py.MPI, so MPI starts with the thread level ringreduce needs
from ringreduce.core.config import parse_bytes
from ringreduce.kernels.ops import copy_stream
from ringreduce.sets.process_sets import global_set

hvd.init()
from mpi4py import MPI  # noqa: E402

from bench_common import (cross_comm, init_torch_distributed,  # noqa: E402
                          metadata as common_metadata, size_label, sleeping_barrier,
                          slowest, time_interleaved, time_it, write_results)

COMM = MPI.COMM_WORLD
RANK, NRANKS = COMM.rank, COMM.size
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS = ["ours", "ours_", "bucket", "dist_rr", "dist_sync", "set_", "mpi", "mpi_x",
           "gloo"]
# Ranks with the same local rank, one per node (as ringreduce sees nodes, simulated or not):
# MPI's Allreduce between nodes, the part of a hierarchical allreduce that crosses them.
CROSS = cross_comm(hvd.local_rank()) if hvd.cross_size() > 1 else None
PAIR = hvd.add_process_set([0, 1]) if NRANKS >= 3 else None    # a 2-rank set inside the job
PAIR_COMM = COMM.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)  # its members, for barriers


def default_iters(nbytes: int) -> int:
    """About 1 GiB of payload per measurement, 1000 calls at most (small sizes: a median over
    a few milliseconds would follow one of the machine's hiccups), 5 for 256M."""
    return max(5, min(1000, (1 << 30) // nbytes))


# Each method is prepared (buffers made, the result checked once) and returns what to time:
# (call, barrier), the call None on a rank that sits it out; all are timed in turn
# (bench_common.time_interleaved). In-place methods reduce zeros, so repeated sums neither
# overflow nor change the data.
WORLD_BARRIER = MPI.COMM_WORLD.Barrier


def prepare_ours(nbytes: int, dtype: torch.dtype):
    t = torch.ones(nbytes // dtype.itemsize, dtype=dtype)
    out = hvd.allreduce(t, op=hvd.Sum)
    assert torch.all(out == NRANKS), "ringreduce.allreduce returned a wrong sum"
    return lambda: hvd.allreduce(t, op=hvd.Sum), WORLD_BARRIER


def prepare_ours_inplace(nbytes: int, dtype: torch.dtype):
    t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
    return lambda: hvd.allreduce_(t, op=hvd.Sum), WORLD_BARRIER


def prepare_bucket(nbytes: int, dtype: torch.dtype):
    t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
    return (lambda: hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum, name="bench.bucket")),
            WORLD_BARRIER)


def prepare_set(nbytes: int, dtype: torch.dtype):
    """In place on the set {0, 1}; the other ranks wait in a barrier that sleeps."""
    if RANK not in PAIR.ranks:
        return None, None
    t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
    return lambda: hvd.allreduce_(t, op=hvd.Sum, process_set=PAIR), PAIR_COMM.Barrier


def mpi_allreduce(comm):
    """MPI's own Allreduce of SIZE bytes on `comm` (every rank's at once)."""

    def prepare(nbytes: int, dtype: torch.dtype):
        if dtype == torch.bfloat16:
            return None  # MPI has no bfloat16 type to sum
        send = np.ones(nbytes // 4, dtype=np.float32)
        recv = np.empty_like(send)
        return lambda: comm.Allreduce(send, recv, op=MPI.SUM), WORLD_BARRIER

    return prepare


GLOO = None    # torch.distributed's gloo group of every rank (bench_common.init_torch_distributed)


def prepare_dist(asynchronous: bool):
    """An all_reduce on our backend: asynchronous then waited for (what DDP does with a
    bucket), or synchronous (what a script calls)."""
    import torch.distributed as dist

    def prepare(nbytes: int, dtype: torch.dtype):
        t = torch.ones(nbytes // dtype.itemsize, dtype=dtype)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True).wait()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        assert torch.all(t == NRANKS * NRANKS), \
            "all_reduce on the ringreduce backend returned a wrong sum"
        t.zero_()
        if asynchronous:
            return (lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True).wait(),
                    WORLD_BARRIER)
        return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM), WORLD_BARRIER

    return prepare


def prepare_gloo(nbytes: int, dtype: torch.dtype):
    import torch.distributed as dist

    t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
    return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=GLOO), WORLD_BARRIER


def bench_methods(prepare: dict, nbytes: int, dtype: torch.dtype, iters: int) -> dict:
    """Every available method's time (the slowest rank's median), None where not run."""
    calls = {m: p(nbytes, dtype) if p else None for m, p in prepare.items()}
    timed = time_interleaved({m: c for m, c in calls.items() if c is not None}, iters,
                             awake=frozenset({"gloo"}))
    return {m: slowest(timed[m]) if m in timed else None for m in prepare}


def bench_copies(nbytes: int, iters: int) -> list[dict]:
    """The copy yardsticks: one thread copying SIZE bytes between two buffers, on rank 0 alone
    (the others wait in a sleeping barrier) and on every rank at once (the slowest rank's
    median, as the allreduce is timed). `memcpy` is glibc's (NumPy's copyto), `stream` ours
    with non-temporal stores (ringreduce.kernels.ops.copy_stream), `copy_` torch's Tensor.copy_."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    dst_address, src_address = dst.ctypes.data, src.ctypes.data     # (a microsecond each)
    copies = {"memcpy": lambda: np.copyto(dst, src),
              "stream": lambda: copy_stream(dst_address, src_address, nbytes),
              "copy_": lambda: tdst.copy_(tsrc)}
    rows = []

    def row(name: str, where: str, seconds: float) -> None:
        rows.append({"size_bytes": nbytes, "size": size_label(nbytes), "copy": name,
                     "where": where, "iters": iters, "time_s": seconds,
                     "bw_GBps": nbytes / seconds / 1e9})

    for name, copy in copies.items():
        alone = time_it(copy, iters, barrier=lambda: None) if RANK == 0 else 0.0
        sleeping_barrier()
        row(name, "rank 0", COMM.bcast(alone, root=0))
        if name != "copy_" and NRANKS > 1:
            row(name, "every rank", slowest(time_it(copy, iters)))
    return rows


def yardstick(rows: list[dict], where: str = "every rank") -> dict:
    """The fastest single-thread copy (glibc's or ours; torch's copy_ is for reference only)
    run `where`: on every rank at once, the condition the allreduce runs in, where the ranks
    share the machine's memory bandwidth; or on "rank 0" alone."""
    here = [r for r in rows if r["copy"] != "copy_" and r["where"] == where]
    return max(here or [r for r in rows if r["copy"] != "copy_"], key=lambda r: r["bw_GBps"])


def bench_profile(nbytes: int, dtype: torch.dtype, iters: int) -> dict | None:
    """Where an in-place allreduce of SIZE bytes spends its time on this node, phase by phase
    (native/node.c), with the bytes each phase reads and writes per rank (B = SIZE, n ranks):
    copy_in B(n-1)/n each way, reduce B/n from each of n places + B/n written, publish B/n
    each way, copy_out B(n-1)/n each way; and how many blocks rank 0 staged with plain and
    with non-temporal stores (native/node.c measures both ways and writes the cheaper)."""
    node = global_set("bench_profile").transport.node
    if node is None or nbytes <= node.small_bytes:     # the block path only
        return None
    t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
    hvd.allreduce_(t, op=hvd.Sum)
    node.profile(reset=True)
    before = node.blocks_written()
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        hvd.allreduce_(t, op=hvd.Sum)
    total = (time.perf_counter() - start) / iters
    phases = {k: v / iters for k, v in node.profile(reset=True).items()}
    written = {k: v - before[k] for k, v in node.blocks_written().items()}
    n = hvd.local_size()        # the node's ranks share its allreduce
    touched = {"copy_in": 2 * nbytes * (n - 1) / n, "reduce": nbytes * (n + 1) / n,
               "publish": 2 * nbytes / n, "copy_out": 2 * nbytes * (n - 1) / n}
    return {"size_bytes": nbytes, "dtype": str(dtype).removeprefix("torch."), "time_s": total,
            "phases": {k: {"time_s": v, "bytes_touched": touched.get(k)}
                       for k, v in phases.items()},
            "blocks_written": written}


def print_profile(p: dict) -> None:
    print(f"  profile {size_label(p['size_bytes'])} {p['dtype']} in place, rank 0: "
          f"{p['time_s'] * 1e6:.0f} us per call; blocks staged with plain stores "
          f"{p['blocks_written']['plain']}, non-temporal {p['blocks_written']['streamed']}",
          flush=True)
    for phase, v in p["phases"].items():
        rate = (f"{v['bytes_touched'] / v['time_s'] / 1e9:7.1f} GB/s over "
                f"{v['bytes_touched'] / 2**20:.0f} MiB read+written" if v["bytes_touched"]
                and v["time_s"] else "")
        print(f"    {phase:9s} {v['time_s'] * 1e6:9.0f} us {v['time_s'] / p['time_s']:6.1%}  {rate}",
              flush=True)


def metadata(args) -> dict:
    return common_metadata(iters=args.iters or "adaptive")


def fmt(value, spec: str, width: int) -> str:
    return f"{'n/a' if value is None else format(value, spec):>{width}}"


HEADER = (f"{'size':>6} {'dtype':>9} {'method':>9} {'iters':>5} {'time(us)':>11} "
          f"{'algbw':>8} {'busbw':>8} {'bus/copy':>9} {'bus/alone':>9} {'xMPI':>6} {'xMPIx':>6} "
          f"{'xgloo':>6}")


def row(r: dict) -> str:
    return (f"{r['size']:>6} {r['dtype']:>9} {r['method']:>9} {r['iters']:>5} "
            f"{fmt(r['latency_us'], '.1f', 11)} {fmt(r['algbw_GBps'], '.3f', 8)} "
            f"{fmt(r['busbw_GBps'], '.3f', 8)} {fmt(r['busbw_over_copy'], '.3f', 9)} "
            f"{fmt(r['busbw_over_alone'], '.3f', 9)} "
            f"{fmt(r.get('speedup_vs_mpi'), '.2f', 6)} {fmt(r.get('speedup_vs_mpi_x'), '.2f', 6)} "
            f"{fmt(r.get('speedup_vs_gloo'), '.2f', 6)}")


def plot(path: str, results: list[dict], copies: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        for method in METHODS:
            points = [(r["size_bytes"], r["busbw_GBps"]) for r in results
                      if r["dtype"] == dtype and r["method"] == method and r["busbw_GBps"]]
            if points:
                ax.plot(*zip(*points), marker="o",
                        linestyle="-" if dtype == "float32" else ":", label=f"{method} {dtype}")
    sizes = sorted({c["size_bytes"] for c in copies})
    best = [yardstick([c for c in copies if c["size_bytes"] == size]) for size in sizes]
    ax.plot(sizes, [b["bw_GBps"] for b in best], color="black", linestyle="--",
            label="fastest copy, every rank at once (glibc memcpy or ours, streaming)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # busbw spans orders of magnitude from 4K to 256M
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"allreduce busbw, {meta['ranks']} ranks on {meta['hostname']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    global GLOO
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--no-dist", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="after each size and dtype: the in-place allreduce's time per "
                             "phase on this node (sizes above the small-message switch, 512K)")
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    dtypes = args.dtypes.split(",")
    if unknown := set(dtypes) - set(DTYPES):
        parser.error(f"unknown dtype(s) {sorted(unknown)}; choose from {sorted(DTYPES)}")
    if bad := [s for s in sizes if s <= 0 or s % 4]:
        parser.error(f"sizes must be positive multiples of 4 bytes, got {bad}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    args.no_gloo |= args.no_dist
    if not args.no_dist:
        GLOO = init_torch_distributed(gloo=not args.no_gloo)

    meta = metadata(args)
    if RANK == 0:
        print(f"allreduce benchmark: {NRANKS} ranks on {', '.join(meta['hosts'])}, "
              f"{' '.join(meta['mpi_library'].splitlines()[0].split())}, torch {meta['torch']} "
              f"({meta['torch_num_threads']} threads), {meta['date']}")
        print("GB/s = 1e9 B/s; time = max over ranks of the median; xMPI/xgloo = their time / ours")
        print(HEADER, flush=True)

    bench = {"ours": prepare_ours, "ours_": prepare_ours_inplace, "bucket": prepare_bucket,
             "dist_rr": None if args.no_dist else prepare_dist(asynchronous=True),
             "dist_sync": None if args.no_dist else prepare_dist(asynchronous=False),
             "set_": prepare_set if PAIR is not None else None, "mpi": mpi_allreduce(COMM),
             "mpi_x": mpi_allreduce(CROSS) if CROSS is not None else None,
             "gloo": None if args.no_gloo else prepare_gloo}
    results, every_copy, profiles = [], [], []
    for nbytes in sizes:
        iters = args.iters or default_iters(nbytes)
        copies = bench_copies(nbytes, iters)
        every_copy += copies
        best, alone = yardstick(copies), yardstick(copies, "rank 0")
        if RANK == 0:
            for c in copies:
                mark = "  <- yardstick" if c is best else "  <- alone" if c is alone else ""
                print(f"{size_label(nbytes):>6} {'-':>9} {c['copy']:>9} {iters:>5} "
                      f"{c['time_s'] * 1e6:>11.1f} {c['bw_GBps']:>8.3f}  ({c['where']}){mark}",
                      flush=True)
        for dtype in dtypes:
            times = bench_methods(bench, nbytes, DTYPES[dtype], iters)
            for method, seconds in times.items():
                if bench[method] is None:
                    continue
                ranks = (len(PAIR.ranks) if method == "set_" else CROSS.size
                         if method == "mpi_x" else NRANKS)
                algbw = nbytes / seconds / 1e9 if seconds else None
                busbw = algbw * 2 * (ranks - 1) / ranks if algbw is not None else None
                r = {"size_bytes": nbytes, "size": size_label(nbytes), "dtype": dtype,
                     "method": method, "iters": iters, "time_s": seconds,
                     "latency_us": seconds * 1e6 if seconds else None,
                     "algbw_GBps": algbw, "busbw_GBps": busbw,
                     "busbw_over_copy": busbw / best["bw_GBps"] if busbw else None,
                     "busbw_over_alone": busbw / alone["bw_GBps"] if busbw else None}
                if method.startswith("ours") or method.startswith("dist_"):
                    for other in ("mpi", "mpi_x", "gloo"):
                        theirs = times[other]
                        r[f"speedup_vs_{other}"] = theirs / seconds if theirs else None
                results.append(r)
                if RANK == 0:
                    print(row(r), flush=True)
            if args.profile:
                profile = bench_profile(nbytes, DTYPES[dtype], iters)
                if profile is not None and RANK == 0:
                    profiles.append(profile)
                    print_profile(profile)

    if RANK == 0:
        write_results({"meta": meta, "copies": every_copy, "results": results,
                       "profiles": profiles}, args.json, args.plot,
                      lambda png: plot(png, results, every_copy, meta))
    if not args.no_dist:
        import torch.distributed as dist

        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
