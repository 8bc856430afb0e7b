"""Between nodes, large buffers: ringreduce's ring on every rank against a ring over node leaders.

    RINGREDUCE_SIMULATED_NODES=2 mpiexec -n 4 python scripts/bench_between_nodes.py \\
        [--sizes 1M,16M,64M,256M] [--iters N]

Both are hierarchical allreduces of SIZE bytes per rank, built from ringreduce's own pieces:
    every     hvd.allreduce_ on the whole job: each block is reduced on the node, each local
              rank runs our ring between nodes on its share of the block, the node copies the
              results out (what ringreduce does)
    leaders   the node's allreduce (a process set per node, shared memory), our ring between
              the node leaders on the whole buffer (a process set of the local ranks 0), then
              a broadcast on the node
    mpi       MPI's Allreduce on the whole job;  mpi_x  MPI's Allreduce between nodes only (the
              ranks with the same local rank), of the whole SIZE
Timing as bench_allreduce.py (bench_common.py): a barrier before each call, the methods in
turns, the slowest rank's median; algbw = SIZE / time.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import ringreduce as hvd  # before mpi4py.MPI, for the thread level
from ringreduce.core.config import parse_bytes

hvd.init()
from mpi4py import MPI  # noqa: E402

from bench_common import cross_comm, slowest, time_interleaved  # noqa: E402

COMM = MPI.COMM_WORLD
NODES = hvd.cross_size()
WHERE = COMM.allgather((hvd.cross_rank(), hvd.local_rank()))    # each rank's node, place there
NODE_SETS = [hvd.add_process_set([r for r, (node, _) in enumerate(WHERE) if node == n])
             for n in range(NODES)]
LEADERS = hvd.add_process_set([r for r, (_, local) in enumerate(WHERE) if local == 0])
MY_NODE = NODE_SETS[hvd.cross_rank()]
CROSS = cross_comm(hvd.local_rank())


def leaders(t: torch.Tensor) -> None:
    hvd.allreduce_(t, op=hvd.Sum, process_set=MY_NODE)
    if hvd.local_rank() == 0:
        hvd.allreduce_(t, op=hvd.Sum, process_set=LEADERS)
    hvd.broadcast_(t, root_rank=MY_NODE.ranks[0], process_set=MY_NODE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,64M,256M")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    if NODES < 2 or hvd.local_size() < 2 or not hvd.is_homogeneous():
        raise SystemExit("needs at least 2 nodes of 2 or more ranks each "
                         "(e.g. RINGREDUCE_SIMULATED_NODES=2 mpiexec -n 4)")
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks as {NODES} nodes of {hvd.local_size()}; algbw GB/s "
              "(SIZE / time), time = slowest rank's median")
        print(f"{'size':>6} {'every':>8} {'leaders':>8} {'mpi':>8} {'mpi_x':>8}")
    for text in args.sizes.split(","):
        nbytes = parse_bytes(text)
        iters = args.iters or max(3, min(50, (256 << 20) // nbytes))
        t = torch.zeros(nbytes // 4)
        send, recv = np.zeros(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
        calls = {"every": lambda: hvd.allreduce_(t, op=hvd.Sum), "leaders": lambda: leaders(t),
                 "mpi": lambda: COMM.Allreduce(send, recv, op=MPI.SUM),
                 "mpi_x": lambda: CROSS.Allreduce(send, recv, op=MPI.SUM)}
        timed = time_interleaved({name: (call, COMM.Barrier) for name, call in calls.items()},
                                 iters)
        times = {name: slowest(seconds) for name, seconds in timed.items()}
        if hvd.rank() == 0:
            print(f"{text:>6} " + " ".join(f"{nbytes / s / 1e9:8.3f}" for s in times.values()),
                  flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
