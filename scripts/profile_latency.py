"""Where the time of a small synchronous allreduce goes, layer by layer, back to back.

    mpiexec -n 2 python scripts/profile_latency.py [--bytes 4096] [--calls 3000]

Each line adds one layer of ringreduce on top of the previous one, from MPI's own Allreduce and
our bare shared-memory signature exchange, through the node's small allreduce in C, the
transport (which picks the way) and the engine's ordering, to `hvd.allreduce` (whose fast path
skips the general path's checks for this case), then the asynchronous call (`allreduce_async_` +
`synchronize`, a DistributedOptimizer bucket's way) and torch.distributed's on the "ringreduce"
backend: the group's own `allreduce([t]).wait()`, then with torch's `AllreduceOptions` made and
read as `dist.all_reduce` makes them, then `dist.all_reduce(t, async_op=True).wait()` itself
(what DDP does with a bucket); last the synchronous call (`dist.all_reduce(t)`, what a script
calls), the group's with torch's options and then torch's own, so the differences show what
each layer costs. The last three lines are torch's floor: the group's own call and the same two
`dist.all_reduce` calls on a group whose backend does nothing (its allreduce returns a finished
Work, or None for the synchronous call), so what torch's own layers cost, with no exchange at
all. Each line is
timed twice: back to back (the ranks' calls pipeline) and one call after each barrier (the
median, as bench_allreduce.py times its rows: a call started with every rank in step).
Python's garbage collector is paused, so its occasional full collections (tens of milliseconds
with torch loaded) do not blur the per-call costs. Needs ranks on one node.
"""
import argparse
import gc
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import ringreduce as hvd
import ringreduce.distributed
from mpi4py import MPI  # noqa: E402  (after ringreduce: the thread level)

from ringreduce.kernels.buffers import CODES, as_array
from ringreduce.sets.process_sets import global_set
from ringreduce.transport.signature import digest
from ringreduce.transport.reduce_spec import ReduceSpec


class _Finished(dist.Work):
    """A Work that is done already: the do-nothing backend's."""

    def wait(self, timeout=None) -> bool:
        return True


class _DoNothing(dist.ProcessGroup):
    """torch's floor: a Python backend whose allreduce does no work at all."""

    def allreduce(self, tensors, opts=None):
        return None if opts is not None and not opts.asyncOp else _Finished()


dist.Backend.register_backend("profile_nothing", lambda store, rank, size, timeout:
                              _DoNothing(rank, size), devices=["cpu"])


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
    ringreduce.distributed.init_process_group()
    group, SUM = dist.group.WORLD, dist.ReduceOp.SUM
    nothing = dist.new_group(backend="profile_nothing")

    def with_torch_options(asynchronous: bool):
        def call():
            options = dist.AllreduceOptions()
            options.reduceOp, options.asyncOp = SUM, asynchronous
            work = group.allreduce([x], options)
            if work is not None:        # (a synchronous call returns none: it waited)
                work.wait()

        return call

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
        ("allreduce_async_ + synchronize", lambda: hvd.synchronize(
            hvd.allreduce_async_(x, op=hvd.Sum))),
        ("backend: group.allreduce([t]).wait()", lambda: group.allreduce([x]).wait()),
        ("+ torch's AllreduceOptions", with_torch_options(True)),
        ("dist.all_reduce(t, async_op=True).wait()", lambda: dist.all_reduce(
            x, SUM, async_op=True).wait()),
        ("backend, synchronous: options, allreduce", with_torch_options(False)),
        ("dist.all_reduce(t) (synchronous)", lambda: dist.all_reduce(x, SUM)),
        ("torch's floor: group.allreduce([t]).wait()", lambda: nothing.allreduce([x]).wait()),
        ("torch's floor: async .wait(), no backend", lambda: dist.all_reduce(
            x, SUM, group=nothing, async_op=True).wait()),
        ("torch's floor: synchronous, no backend", lambda: dist.all_reduce(
            x, SUM, group=nothing)),
    ]
    gc.disable()
    if comm.rank == 0:
        print(f"{'layer':44s} {'back to back':>13} {'after a barrier':>16}  (us per call, the "
              "slowest rank's)", flush=True)
    for label, call in layers:
        for _ in range(200):
            call()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        per_call = (time.perf_counter() - start) / args.calls * 1e6
        single = []
        for _ in range(args.calls):
            comm.Barrier()
            start = time.perf_counter()
            call()
            single.append(time.perf_counter() - start)
        back_to_back = comm.allreduce(per_call, op=MPI.MAX)
        after_barrier = comm.allreduce(statistics.median(single) * 1e6, op=MPI.MAX)
        if comm.rank == 0:
            print(f"{label:44s} {back_to_back:13.1f} {after_barrier:16.1f}", flush=True)
    gc.enable()
    np.testing.assert_array_equal(src, 0)   # zeros stay zeros: nothing overflowed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
