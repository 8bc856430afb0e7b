"""Point-to-point benchmark: torch.distributed's send/recv on the "ringreduce" backend against
MPI's own Send/Recv and torch.distributed on gloo, in the same run.

Run it under MPI, one process per rank (ranks pair up, 0 with 1, 2 with 3 ...; an odd last
rank sits out), e.g.

    mpiexec -n 2 python scripts/bench_p2p.py
    mpiexec -n 2 python scripts/bench_p2p.py --sizes 4K,1M --iters 200 --json out.json

Options: --sizes (bytes, K/M = powers of 1024; default 4K,64K,1M,16M), --iters (default:
adapts to the size), --json FILE, --no-gloo.

Methods, each a ping-pong of a float32 tensor of SIZE bytes (the even rank sends, the odd one
receives and sends it back), timed per round trip:
    dist_rr   dist.send / dist.recv on the "ringreduce" backend (ringreduce.distributed): a
              header (count, dtype) and the bytes, the receiver checking the header before
              the bytes land (ringreduce/distributed/point_to_point.py)
    mpi       mpi4py's Send / Recv of NumPy arrays on COMM_WORLD: the yardstick, MPI moving
              the bytes with nothing around it
    gloo      dist.send / dist.recv on a gloo group of every rank (loopback TCP), under
              bench_common.cores_awake as in bench_allreduce.py

Columns: time(us) one way (half the round trip; the slowest pair's median), GB/s (size / one
way), xMPI (MPI's time / ours: below 1, MPI is faster), xgloo (gloo's time / ours: above 1,
ours is faster).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import ringreduce as hvd  # before mpi4py.MPI, so MPI starts with the thread level ringreduce needs
from ringreduce.core.config import parse_bytes
from mpi4py import MPI  # noqa: E402

from bench_common import (init_torch_distributed, metadata, size_label,  # noqa: E402
                          slowest, time_interleaved, write_results)

COMM = MPI.COMM_WORLD
RANK, NRANKS = COMM.rank, COMM.size
PEER = RANK ^ 1 if (RANK ^ 1) < NRANKS else None      # (None: an odd last rank sits out)
PAIR = COMM.Split(RANK // 2, RANK)                    # a rank and its peer: their barrier
METHODS = ("dist_rr", "mpi", "gloo")


def ping_pong(send, recv):
    """One round trip with the peer by `send(peer)` and `recv(peer)` (None off a pair)."""
    if PEER is None:
        return None
    if RANK % 2 == 0:
        return lambda: (send(PEER), recv(PEER))
    return lambda: (recv(PEER), send(PEER))


def prepare(method: str, nbytes: int, gloo):
    t = torch.arange(nbytes // 4, dtype=torch.float32)
    if method == "mpi":
        a = t.numpy()
        return ping_pong(lambda p: COMM.Send(a, p), lambda p: COMM.Recv(a, p))
    group = gloo if method == "gloo" else None
    fn = ping_pong(lambda p: dist.send(t, p, group=group), lambda p: dist.recv(t, p, group=group))
    if fn is not None:
        fn()
        assert torch.equal(t, torch.arange(nbytes // 4, dtype=torch.float32)), method
    return fn


def default_iters(nbytes: int) -> int:
    return max(20, min(2000, (64 << 20) // max(nbytes, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-gloo", action="store_true")
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    if bad := [s for s in sizes if s <= 0 or s % 4]:
        parser.error(f"sizes must be positive multiples of 4 bytes, got {bad}")
    if NRANKS < 2:
        parser.error("needs at least 2 ranks (they pair up)")
    torch.set_num_threads(1)
    gloo = init_torch_distributed(gloo=not args.no_gloo)
    methods = [m for m in METHODS if m != "gloo" or gloo is not None]
    meta = metadata(sizes=sizes, iters=args.iters)
    if RANK == 0:
        print(f"point-to-point benchmark: {NRANKS} ranks on {', '.join(meta['hosts'])}, "
              f"{' '.join(meta['mpi_library'].splitlines()[0].split())}, torch {meta['torch']}, "
              f"{meta['date']}")
        print("one way = half a round trip; time = max over ranks of the median; "
              "xMPI/xgloo = their time / ours")
        print(f"{'size':>6} {'method':>8} {'iters':>5} {'time(us)':>10} {'GB/s':>8} "
              f"{'xMPI':>6} {'xgloo':>6}", flush=True)
    results = []
    for nbytes in sizes:
        iters = args.iters or default_iters(nbytes)
        calls = {m: (prepare(m, nbytes, gloo), PAIR.Barrier) for m in methods}
        timed = time_interleaved(calls, iters, awake=frozenset({"gloo"}))
        one_way = {m: slowest(timed[m]) / 2 for m in methods}
        for m in methods:
            seconds = one_way[m]
            r = {"size_bytes": nbytes, "size": size_label(nbytes), "method": m, "iters": iters,
                 "time_s": seconds, "GBps": nbytes / seconds / 1e9}
            if m == "dist_rr":
                for other in ("mpi", "gloo"):
                    r[f"speedup_vs_{other}"] = (one_way[other] / seconds if other in one_way
                                                else None)
            results.append(r)
            if RANK == 0:
                ratios = [f"{r[f'speedup_vs_{o}']:6.2f}" if r.get(f"speedup_vs_{o}") else
                          f"{'':>6}" for o in ("mpi", "gloo")]
                print(f"{r['size']:>6} {m:>8} {iters:>5} {seconds * 1e6:>10.1f} "
                      f"{r['GBps']:>8.3f} {' '.join(ratios)}", flush=True)
    if RANK == 0:
        write_results({"meta": meta, "p2p": results}, args.json, None, None)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
