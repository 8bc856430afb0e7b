"""Where the time of a small synchronous allreduce goes, layer by layer, back to back.

    mpiexec -n 2 python scripts/profile_latency.py [--bytes 4096] [--calls 3000]

Each line adds one layer of ringreduce on top of the previous one, from MPI's own Allreduce and
our bare shared-memory flag exchange, through the small allreduce in Python and in C and the
general path's digest and engine ordering, to `hvd.allreduce` (which skips the general path for
this case: checks, digest and exchange in C), so the differences show what each layer costs.
Python's garbage collector is paused, so its occasional full collections (tens of milliseconds
with torch loaded) do not blur the per-call costs. Needs ranks on one node.
"""
import argparse
import gc
import time

import numpy as np
import torch

import ringreduce as hvd
from mpi4py import MPI  # noqa: E402  (after ringreduce: the thread level)

from ringreduce.buffers import as_array
from ringreduce.collectives import allreduce_flat
from ringreduce.kernels import combiner
from ringreduce.world import world


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    hvd.init()
    comm, engine = MPI.COMM_WORLD, world().engine
    node = engine.node
    if node is None:
        raise SystemExit("run it with 2 or more ranks on one node (shared memory on)")
    x = torch.zeros(args.bytes // 4)
    out = torch.empty_like(x)
    src, dst = as_array(x), as_array(out)
    add = combiner(torch.float32, hvd.Sum)
    signature = {"collective": "allreduce", "name": "profile", "op": "Sum", "prescale": 1.0,
                 "postscale": 1.0, "dtype": "float32", "shape": tuple(x.shape)}
    layers = [
        ("MPI Allreduce (mpi4py)", lambda: comm.Allreduce(src, dst)),
        ("shared-memory flag exchange", node._raise_flag_and_wait),
        ("+ slots, header check, reduce (Python)", lambda: node.small_allreduce(
            src, dst, add, None, 0, "profile", lambda: [])),
        ("+ slots, header check, reduce (C)", lambda: node.native_small_allreduce(
            src.ctypes.data, dst.ctypes.data, src.nbytes, src.size, 0, 1.0, 1.0, 0, "profile",
            lambda: [])),
        ("+ signature digest, dispatch", lambda: allreduce_flat(
            engine, src, dst, torch.float32, hvd.Sum, signature=signature)),
        ("+ engine ordering", lambda: engine.run("profile", lambda: allreduce_flat(
            engine, src, dst, torch.float32, hvd.Sum, signature=signature))),
        ("hvd.allreduce (inline C path)", lambda: hvd.allreduce(x, op=hvd.Sum)),
        ("hvd.allreduce_ (in place)", lambda: hvd.allreduce_(x, op=hvd.Sum)),
    ]
    gc.disable()
    for label, call in layers:
        for _ in range(200):
            call()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        per_call = (time.perf_counter() - start) / args.calls * 1e6
        slowest = comm.allreduce(per_call, op=MPI.MAX)
        if comm.rank == 0:
            print(f"{label:42s} {slowest:7.1f} us per call", flush=True)
    gc.enable()
    np.testing.assert_array_equal(src, 0)   # zeros stay zeros: nothing overflowed


if __name__ == "__main__":
    main()
