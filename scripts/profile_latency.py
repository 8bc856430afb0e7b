"""Where the time of a small synchronous allreduce goes, layer by layer, back to back.

    mpiexec -n 2 python scripts/profile_latency.py [--bytes 4096] [--calls 3000]

Each line adds one layer of ringreduce on top of the previous one, from MPI's own Allreduce and
our bare shared-memory signature exchange, through the node's small allreduce in C, the
transport (which picks the way) and the engine's ordering, to `hvd.allreduce` (whose fast path
skips the general path's checks for this case), so the differences show what each layer costs.
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

from ringreduce.buffers import CODES, as_array
from ringreduce.process_sets import global_set
from ringreduce.signature import digest
from ringreduce.reduce_spec import ReduceSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    hvd.init()
    comm, glob = MPI.COMM_WORLD, global_set("profile_latency")
    transport, node = glob.transport, glob.transport.node
    if not transport.one_node:
        raise SystemExit("run it with 2 or more ranks on one node (shared memory on)")
    x = torch.zeros(args.bytes // 4)
    out = torch.empty_like(x)
    src, dst = as_array(x), as_array(out)
    src_address, dst_address = x.data_ptr(), out.data_ptr()
    float32 = CODES[torch.float32]      # the dtype code the node's C code takes
    signature = {"collective": "allreduce", "name": "profile", "op": "Sum", "prescale": 1.0,
                 "postscale": 1.0, "dtype": "float32", "shape": tuple(x.shape)}
    spec = ReduceSpec(torch.float32, hvd.Sum, digest=digest(signature), signature=signature)
    layers = [
        ("MPI Allreduce (mpi4py)", lambda: comm.Allreduce(src, dst)),
        ("shared-memory signature exchange", lambda: node.exchange_headers(0, 0)),
        ("+ data in slots, reduce (C)", lambda: node.small(
            src_address, dst_address, x.nbytes, x.numel(), float32, hvd.Sum, 1.0, 1.0, 0)),
        ("+ transport (picks the way)", lambda: transport.allreduce(x, out, spec)),
        ("+ engine ordering", lambda: glob.engine.run(
            "profile", lambda: transport.allreduce(x, out, spec))),
        ("hvd.allreduce (fast path)", lambda: hvd.allreduce(x, op=hvd.Sum)),
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
