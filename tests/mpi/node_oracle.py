"""The node protocol of native/node.c, restated in Python as a test oracle.

Same protocol (flags counting exchanges, header and data in one slot per rank for small
buffers, cache-sized blocks whose chunks each rank reduces from its input and its peers'
staging areas), same reduction order, same window layout constants (from ringreduce._native),
but its own window, and arithmetic by NumPy and torch instead of our C kernels.
node_protocol_check.py runs both on the same inputs and compares the bits.
"""
import time

import numpy as np
import torch
from mpi4py import MPI

import ringreduce as hvd
from ringreduce import _native
from checks import horovod_scaled
from ringreduce.kernels.buffers import as_array, as_tensor

LINE, PAGE, WORDS = _native.LINE, _native.PAGE, _native.HEADER_WORDS


TORCH_OPS = {hvd.Sum: torch.add, hvd.Average: torch.add, hvd.Min: torch.minimum,
             hvd.Max: torch.maximum, hvd.Product: torch.mul}


def combine(a, b, dtype, op, last, divisor, scale):
    """a op b (flat NumPy views), rounded to the dtype; on the last step also scaled as
    `finish` scales (kernels.c's fused sums give the same bits)."""
    out = TORCH_OPS[op](as_tensor(a, dtype), as_tensor(b, dtype))
    return finish(out, dtype, divisor, scale) if last else out


def finish(t, dtype, divisor, scale):
    """Horovod's scaling, by the one factor scale / divisor."""
    return horovod_scaled(t, scale / divisor)


class NodeOracle:
    def __init__(self, local, small_bytes, block_bytes):
        self.local, self.me, self.n = local, local.rank, local.size
        self.slot_bytes, self.block_bytes, segment = _native.node_layout(small_bytes, block_bytes)
        self.win = MPI.Win.Allocate_shared(segment, disp_unit=1, comm=local)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.seg = [np.frombuffer(self.win.Shared_query(r)[0], dtype=np.uint8)
                    for r in range(self.n)]
        self.flags = [s[:8].view(np.int64) for s in self.seg]
        self.flags[self.me][0] = 0
        self.win.Sync()
        local.Barrier()

    def free(self):
        self.win.Unlock_all()
        self.win.Free()

    def raised(self):
        return int(self.flags[self.me][0])

    def header(self, r, flag):
        return self.seg[r][LINE + flag % 2 * LINE:][:8 * WORDS].view(np.int64)

    def slot(self, r, flag, dtype, count):
        start = 3 * LINE + flag % 2 * self.slot_bytes
        return self.seg[r][start:start + count * dtype.itemsize].view(dtype)

    def area(self, r, flag, dtype, count):
        start = 3 * LINE + 2 * self.slot_bytes + flag // 2 % 2 * (self.block_bytes + PAGE)
        return self.seg[r][start:start + count * dtype.itemsize].view(dtype)

    def flag_and_wait(self):
        flag = self.raised() + 1
        self.win.Sync()
        self.flags[self.me][0] = flag
        while any(f[0] < flag for f in self.flags):
            time.sleep(0)
        self.win.Sync()

    def check_digests(self, flag):
        digests = {int(self.header(r, flag)[0]) for r in range(self.n)}
        assert len(digests) == 1, f"oracle: digests differ: {digests}"

    def small(self, src, dtype, op, divisor, scale, digest=0):
        """Every rank's `src` (a flat NumPy view) into its slot, then all slots reduced in rank
        order; returns the result."""
        flag = self.raised() + 1
        self.slot(self.me, flag, src.dtype, src.size)[...] = src
        self.header(self.me, flag)[:3] = (digest, src.nbytes, 0)
        self.flag_and_wait()
        self.check_digests(flag)
        slots = [self.slot(r, flag, src.dtype, src.size) for r in range(self.n)]
        return _reduce(slots, dtype, op, divisor, scale)

    def large(self, src, dtype, op, divisor, scale, digest=0):
        """Block by block, through the staging areas."""
        dst = np.empty_like(src)
        per_block = self.block_bytes // src.itemsize
        for start in range(0, src.size, per_block):
            stop = min(start + per_block, src.size)
            m = stop - start
            bounds = _bounds(m, self.n)
            flag = self.raised() + 1
            mine = self.area(self.me, flag, src.dtype, m)
            for c, (lo, hi) in enumerate(bounds):
                if c != self.me:
                    mine[lo:hi] = src[start + lo:start + hi]
            if start == 0:
                self.header(self.me, flag)[:3] = (digest, src.nbytes, 0)
            self.flag_and_wait()
            if start == 0:
                self.check_digests(flag)
            lo, hi = bounds[self.me]
            inputs = [src[start + lo:start + hi]] + [
                self.area(r, flag, src.dtype, m)[lo:hi] for r in range(self.n) if r != self.me]
            dst[start + lo:start + hi] = _reduce(inputs, dtype, op, divisor, scale)
            mine[lo:hi] = dst[start + lo:start + hi]
            self.flag_and_wait()
            for c, (clo, chi) in enumerate(bounds):
                if c != self.me:
                    dst[start + clo:start + chi] = self.area(c, flag, src.dtype, m)[clo:chi]
        return dst


def _bounds(m, n):
    base, extra = divmod(m, n)
    counts = [base + (1 if c < extra else 0) for c in range(n)]
    return [(sum(counts[:c]), sum(counts[:c + 1])) for c in range(n)]


def _reduce(inputs, dtype, op, divisor, scale):
    """inputs[0] op inputs[1] op ..., the last step finishing; a flat NumPy array."""
    acc = inputs[0]
    for k, source in enumerate(inputs[1:]):
        acc = as_array(combine(acc, source, dtype, op, k == len(inputs) - 2, divisor,
                               scale).contiguous())
    return acc
