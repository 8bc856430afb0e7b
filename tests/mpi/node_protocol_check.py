"""The node's shared-memory allreduce (native/node.c, through hvd.allreduce) against the Python
oracle (node_oracle.py) on the same inputs, bit for bit: every op and dtype, on slots and on
blocks, with Average's division and a postscale, and random values with NaN, infinities and
integer overflow. Run with the ranks on one node, small slots and blocks (the test sets
RINGREDUCE_SHARED_SMALL_BYTES and RINGREDUCE_BLOCK_BYTES).
"""
import torch

import ringreduce as hvd
from node_oracle import NodeOracle
from ringreduce.kernels.buffers import as_array, as_tensor
from ringreduce.sets.process_sets import global_set

hvd.init()
r, n = hvd.rank(), hvd.size()
glob = global_set("node_protocol_check")
assert glob.transport.one_node, "needs 2 or more ranks on one node, shared memory on"
settings = glob.transport.settings
oracle = NodeOracle(glob.local, settings.shared_small_bytes, settings.block_bytes)

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def inputs(rank, length, dtype, salt):
    g = torch.Generator().manual_seed(1009 * rank + 13 * length + salt)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (length,), generator=g, dtype=torch.int64
                             ).to(dtype)
    x = torch.randn(length, generator=g) * 30
    x[rank::53] = float("nan")
    x[rank + 7::71] = float("inf")
    x[rank + 3::89] = -float("inf")
    return x.to(dtype)


def bits_equal(got, want):
    if got.dtype.is_floating_point:
        nan = got.isnan()
        if not torch.equal(nan, want.isnan()):
            return False
        got, want = got[~nan], want[~nan]
    return as_array(got.contiguous()).tobytes() == as_array(want.contiguous()).tobytes()


checked = 0
for salt, length in enumerate([0, 1, 17, 500, 20_011]):
    for dtype in DTYPES:
        for op in OPS:
            scale = 0.5 if dtype.is_floating_point else 1.0
            what = f"len={length} {dtype} {op.name} postscale={scale}"
            x = inputs(r, length, dtype, salt)
            got = hvd.allreduce(x, op=op, postscale_factor=scale, name=what)
            divisor = float(n) if op == hvd.Average else 1.0
            way = oracle.small if x.nbytes <= settings.shared_small_bytes else oracle.large
            want = as_tensor(way(as_array(x), dtype, op, divisor, scale).copy(), dtype)
            assert bits_equal(got, want.reshape(got.shape)), \
                f"{what}: C {got[:6]} oracle {want[:6]}"
            checked += 1
oracle.free()
hvd.shutdown()
print(f"OK rank {r} ({checked} cases)", flush=True)
