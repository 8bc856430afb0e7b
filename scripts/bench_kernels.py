"""Our native CPU kernels (native/kernels.c) against the NumPy / torch equivalents, in GB/s.

    python scripts/bench_kernels.py [--mib 64] [--reps 7] [--json out.json]

GB/s counts the bytes each kernel must touch (inputs read + output written), so numbers are
comparable across kernels; the median of --reps runs. One thread (torch.set_num_threads(1)),
as each rank has under mpiexec.
"""
import argparse

import numpy as np
import torch

from ringreduce.kernels import ops as kernels
# The fused sum-and-average (divide while adding the last input) is what node.c runs on a
# node's last step; Python's kernels.reducer offers only the plain sum, so the fused form is
# benchmarked through ringreduce._native.
from ringreduce import _native
from ringreduce.kernels.buffers import CODES, as_array
from ringreduce.kernels.ops import ReduceOp

from bench_common import metadata, time_it, write_results  # (imports mpi4py after ringreduce)


def gbps(fn, nbytes, reps):
    return nbytes / time_it(fn, reps, barrier=lambda: None) / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=64, help="size of each input")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        n = args.mib * 2**20 // dtype.itemsize
        a, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
        out = torch.empty_like(a)
        A, B, O = as_array(a), as_array(b), as_array(out)
        moved = 3 * a.numel() * dtype.itemsize
        native_sum = kernels.reducer(dtype, ReduceOp.Sum)     # (out, b, a): out = a + b

        def fused(A, B, O, code=CODES[dtype]):    # a node's last step: add, then divide
            _native.combine(code, ReduceOp.Average, A.ctypes.data, B.ctypes.data, O.ctypes.data,
                            O.size, True, 2.0, 1.0)

        name = str(dtype).removeprefix("torch.")
        rows.append((f"sum {name}", "ours", gbps(lambda: native_sum(O, B, A), moved, args.reps)))
        rows.append((f"sum {name}", "torch", gbps(lambda: torch.add(a, b, out=out), moved,
                                                  args.reps)))
        if dtype != torch.bfloat16:
            rows.append((f"sum {name}", "numpy", gbps(lambda: np.add(A, B, out=O), moved,
                                                      args.reps)))
        rows.append((f"sum+average {name}", "ours (fused)",
                     gbps(lambda: fused(A, B, O), moved, args.reps)))
        rows.append((f"sum+average {name}", "torch (lerp, 1 pass)",
                     gbps(lambda: torch.lerp(a, b, 0.5, out=out), moved, args.reps)))
    x = torch.randn(args.mib * 2**20 // 4)
    for wire in (torch.bfloat16, torch.float16):
        name = str(wire).removeprefix("torch.")
        moved = x.numel() * (4 + wire.itemsize)
        rows.append((f"cast float32->{name}", "ours", gbps(lambda: kernels.cast(x, wire), moved,
                                                           args.reps)))
        rows.append((f"cast float32->{name}", "torch", gbps(lambda: x.to(wire), moved,
                                                            args.reps)))
        h = x.to(wire)
        rows.append((f"cast {name}->float32", "ours",
                     gbps(lambda: kernels.cast(h, torch.float32), moved, args.reps)))
        rows.append((f"cast {name}->float32", "torch", gbps(lambda: h.float(), moved,
                                                            args.reps)))
    print(f"kernels on {args.mib} MiB inputs, 1 thread, GB/s of bytes touched (median of "
          f"{args.reps})")
    print(f"{'kernel':>24} {'implementation':>18} {'GB/s':>8}")
    for kernel, impl, value in rows:
        print(f"{kernel:>24} {impl:>18} {value:8.2f}")
    payload = {"meta": metadata(mib=args.mib, reps=args.reps),
               "kernels": [{"kernel": k, "implementation": i, "gbps": v} for k, i, v in rows]}
    write_results(payload, args.json, None, None)


if __name__ == "__main__":
    main()
