"""The GPU node way (transport/peer_node.py) under a real mpiexec, without a GPU: host memory
stands in for the device, and files in /dev/shm that every rank maps for the device memory the
node's ranks share through CUDA IPC (fake_device.py). Everything else is real: MPI, the
handshakes, the blocks' registry, the one-shot and two-shot reductions (by the CPU kernels in
the fake's kernels), the step between nodes, the fallback and its agreement.

Per setting (a JSON object {label: {variable: value}}, run one after another, init to
shutdown): the set's table holds the way where it should (with the staged or CUDA-aware way
behind it); every dtype and op, one-shot and two-shot lengths, scaled, in place and not,
exact against a reference and so bitwise identical across ranks; between (simulated) nodes,
each rank moves only its slice; a larger buffer registers larger blocks, freeing the old ones;
a process set of its own has blocks of its own, reduces from another thread at the same time
as the world, and frees them when removed; on one node, broadcast and allgather through the
blocks. Faults (variables of the fake): FAKE_FAIL_OPEN=<local
rank> (its opening of the peers' blocks fails), FAKE_PRIVATE_GPUS=1 (each rank sees only its
own GPU): with RINGREDUCE_GPU_NODE_WAY=auto every rank says why once (INFO) and stages its
buffers from then on, exact; with =ipc every rank raises the same RingReduceError naming the
rank and the reason, and the set goes on.
Usage: peer_node_check.py SETTINGS_JSON
"""
import logging
import os
import sys
import threading
import types

import torch

from fake_device import FAULTS, LIVE   # (first: it puts its cupy and torch.cuda in place)
import ringreduce as hvd
from checks import check_equal, expect, horovod_scaled, per_setting, run_cases
from mpi4py import MPI
from ringreduce.api.reductions import _allreduce_spec
from ringreduce.sets.process_sets import active, global_set
from ringreduce.transport import peer_node
from ringreduce.transport.gpu_ways import CudaAware, StagedGpu
from ringreduce.transport.peer_node import PeerMemory

r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64)
OPS = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)
LENGTHS = (1, 17, 700, 20_001)      # up to 4 KiB: one-shot on one node; beyond: two-shot


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


said = Said()
logging.getLogger("ringreduce").addHandler(said)
logging.getLogger("ringreduce").setLevel(logging.INFO)


def inputs(rank, length, dtype, op, seed=0):
    g = torch.Generator().manual_seed(1000 * rank + length + 7 * seed)
    lo = 0 if dtype == torch.uint8 else (-2 if op == hvd.Product else -8)
    return torch.randint(lo, 3 if op == hvd.Product else 9, (length,), generator=g).to(dtype)


def reference(ranks, length, dtype, op, pre=1.0, post=1.0, seed=0):
    xs = torch.stack([inputs(k, length, dtype, op, seed).double() * pre for k in ranks])
    out = {hvd.Sum: xs.sum, hvd.Average: xs.sum, hvd.Product: xs.prod,
           hvd.Min: lambda dim: xs.amin(dim), hvd.Max: lambda dim: xs.amax(dim)}[op](0)
    return horovod_scaled(out.to(dtype), post / len(ranks) if op == hvd.Average else post)


def gpu_way(held):
    """The way the set's table holds for CUDA tensors."""
    return next(w for w in held.transport.ways if isinstance(w, (PeerMemory, CudaAware,
                                                                 StagedGpu)))


def peer_way(held):
    """The set's GPU node way; None where its table holds another GPU way."""
    way = gpu_way(held)
    return way if isinstance(way, PeerMemory) else None


def gpu_allreduce(held, x, op, name, pre=1.0, post=1.0, in_place=True):
    """What the transport does with a CUDA tensor `x` (a host one here: the fake's device),
    under the set's engine: the signature says 'cuda', as a GPU rank's does."""
    cuda_like = types.SimpleNamespace(dtype=x.dtype, shape=x.shape, is_cuda=True)
    spec = _allreduce_spec(cuda_like, op, pre, post, name, None)
    out = x if in_place else torch.empty_like(x)
    way = gpu_way(held)
    held.engine.run(name, lambda: way.run(x, out, spec))
    return out


def case_the_table_holds_the_way():
    local = hvd.local_size()
    way = peer_way(global_set("test"))
    if local == 1 or os.environ.get("RINGREDUCE_GPU_NODE_WAY") == "staging":
        assert way is None, "a GPU node way where the node has one rank or it is turned off"
        return
    assert way is not None, "no GPU node way on a node of several ranks"
    aware = global_set("test").transport.settings.cuda_aware
    assert isinstance(way.fallback, CudaAware if aware else StagedGpu), way.fallback


def case_every_dtype_and_op():
    glob = global_set("test")
    for dtype in DTYPES:
        for op in OPS:
            for length in LENGTHS:
                scaled = dtype.is_floating_point and length == 700
                pre, post = (2.0, 0.5) if scaled else (1.0, 1.0)
                got = gpu_allreduce(glob, inputs(r, length, dtype, op), op,
                                    f"every.{dtype}.{op.name}.{length}", pre, post,
                                    in_place=length % 2 == 1)
                check_equal(got, reference(range(n), length, dtype, op, pre, post),
                            f"{dtype} {op.name} length {length}")


def case_between_nodes_each_rank_moves_its_slice():
    """Two-shot across nodes: what goes between nodes from this rank is its slice alone."""
    if hvd.cross_size() == 1:
        return
    glob = global_set("test")
    moved = []
    parts = glob.transport.parts
    ring, device_ring = parts.ring, peer_node.reduce_in_device_memory
    parts.ring = lambda comm, purpose, buf, spec, *rest: (moved.append(buf.size),
                                                          ring(comm, purpose, buf, spec, *rest))
    peer_node.reduce_in_device_memory = lambda array, *rest: (moved.append(array.size),
                                                              device_ring(array, *rest))
    try:
        length = 50_003
        got = gpu_allreduce(glob, inputs(r, length, torch.float32, hvd.Sum), hvd.Sum, "sliced")
    finally:
        parts.ring, peer_node.reduce_in_device_memory = ring, device_ring
    check_equal(got, reference(range(n), length, torch.float32, hvd.Sum), "sliced")
    lo, hi = peer_node.slices(length, hvd.local_size(), 4)[hvd.local_rank()]
    assert sum(moved) == hi - lo, f"moved {moved} between nodes, its slice is {hi - lo}"


def case_a_larger_buffer_registers_larger_blocks():
    glob = global_set("test")
    way = peer_way(glob)
    if way is None or way.works is False:
        return
    small = way.blocks.capacity
    assert small == peer_node.SMALLEST_BLOCK, small
    length = 300_001                # float64: 2.4 MB, so a block of 4 MiB
    got = gpu_allreduce(glob, inputs(r, length, torch.float64, hvd.Max), hvd.Max, "larger")
    check_equal(got, reference(range(n), length, torch.float64, hvd.Max), "larger")
    assert way.blocks.capacity == 4 << 20, way.blocks.capacity
    assert LIVE["blocks"] == 1 and LIVE["opened"] == hvd.local_size() - 1, dict(LIVE)


def case_a_set_of_its_own_reduces_beside_the_world():
    """{0, 1} and the world reduce from two threads at once, each through blocks of its own;
    the pair's are freed when it is removed."""
    if n < 3 or hvd.cross_size() > 1:
        return
    before = dict(LIVE)
    pair = hvd.add_process_set([0, 1])
    sets = [global_set("test")] + ([active(pair, "test")] if r < 2 else [])
    failures = []

    def reduce_on(held):
        try:
            for i in range(3):
                x = inputs(r, 9_000 + held.id, torch.int32, hvd.Sum, seed=i)
                got = gpu_allreduce(held, x, hvd.Sum, f"set{held.id}.{i}")
                check_equal(got, reference(held.ranks, 9_000 + held.id, torch.int32, hvd.Sum,
                                           seed=i), f"set {held.id}, {i}")
        except Exception as error:      # (reported by the main thread)
            failures.append(f"set {held.id}: {error!r}")

    threads = [threading.Thread(target=reduce_on, args=(held,)) for held in sets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    if r < 2 and peer_way(sets[-1]) is not None and peer_way(sets[-1]).works:
        assert LIVE["blocks"] == before["blocks"] + 1, (before, dict(LIVE))
    hvd.remove_process_set(pair)
    assert LIVE["blocks"] == before["blocks"] and LIVE["opened"] == before["opened"], \
        (before, dict(LIVE))


def case_broadcast_and_allgather_within_the_node():
    """On one node the way moves data too: a broadcast from each root through its block, and
    an allgather of parts of different sizes (one empty) through every member's; where IPC
    fails (a fault), it says so (False) and moves nothing."""
    glob = global_set("test")
    way = peer_way(glob)
    assert glob.transport.moves_on_device == (way is not None and hvd.cross_size() == 1)
    if not glob.transport.moves_on_device:
        return
    assert glob.transport.parts.local.rank == r     # (a set's member rank is its local rank)
    works = way.works is not False
    for root in range(n):
        x = inputs(r, 10_000, torch.int32, hvd.Sum) if r == root else torch.zeros(
            10_000, dtype=torch.int32)
        moved = glob.engine.run(f"broadcast.{root}", lambda: way.broadcast(x, root))
        assert moved == works, (moved, way.works)
        if moved:
            check_equal(x, inputs(root, 10_000, torch.int32, hvd.Sum), f"broadcast from {root}")
    rows = [0 if k == 0 else 3 * k + 1 for k in range(n)]
    mine = inputs(r, rows[r] * 5, torch.bfloat16, hvd.Sum).reshape(rows[r], 5)
    out = torch.full((sum(rows), 5), -1.0, dtype=torch.bfloat16)
    moved = glob.engine.run("allgather", lambda: way.allgather(mine, out, [k * 5 for k in rows]))
    assert moved == works, (moved, way.works)
    if moved:
        want = torch.cat([inputs(k, rows[k] * 5, torch.bfloat16, hvd.Sum).reshape(rows[k], 5)
                          for k in range(n)])
        check_equal(out, want, "allgather")


def case_a_fault_falls_back_or_fails_alike():
    """Where IPC fails (a fault of the fake): auto says why once and stages, exact; ipc raises
    the same error on every rank, and the set goes on."""
    if (FAULTS.fail_open_on is None and not FAULTS.private_gpus) or hvd.local_size() == 1:
        return      # (alone on its node, a rank opens nothing)
    glob = global_set("test")
    why = ("CUDA_VISIBLE_DEVICES" if FAULTS.private_gpus
           else f"node rank {FAULTS.fail_open_on}: cannot open local rank")
    if os.environ.get("RINGREDUCE_GPU_NODE_WAY") == "ipc":
        x = inputs(r, 300, torch.float32, hvd.Sum)
        expect(hvd.RingReduceError, ["GPU node way cannot share device memory", why,
                                     "RINGREDUCE_GPU_NODE_WAY=staging"],
               gpu_allreduce, glob, x, hvd.Sum, "forced")
        assert LIVE["blocks"] == 0 and LIVE["opened"] == 0, dict(LIVE)
        check_equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)),
                    "a host allreduce after the failure")
        return
    for i, length in enumerate((300, 20_001, 40)):
        got = gpu_allreduce(glob, inputs(r, length, torch.float32, hvd.Sum, i), hvd.Sum,
                            f"staged.{i}")
        check_equal(got, reference(range(n), length, torch.float32, hvd.Sum, seed=i),
                    f"staged {length}")
    lines = [line for line in said.lines if "staged through host memory" in line]
    assert len(lines) == 1 and why in lines[0], said.lines
    assert peer_way(glob).works is False and LIVE["blocks"] == 0, dict(LIVE)


def start():
    FAULTS.fail_open_on = (int(os.environ["FAKE_FAIL_OPEN"]) if "FAKE_FAIL_OPEN" in os.environ
                           else None)
    FAULTS.private_gpus = os.environ.get("FAKE_PRIVATE_GPUS") == "1"
    said.lines.clear()
    hvd.init()
    FAULTS.local_rank = hvd.local_rank()


def checks():
    cases = [case_the_table_holds_the_way, case_a_fault_falls_back_or_fails_alike]
    if os.environ.get("RINGREDUCE_GPU_NODE_WAY") != "ipc":    # (forced and failing: no more)
        cases += [case_every_dtype_and_op, case_broadcast_and_allgather_within_the_node,
                  case_between_nodes_each_rank_moves_its_slice,
                  case_a_larger_buffer_registers_larger_blocks,
                  case_a_set_of_its_own_reduces_beside_the_world]
    run_cases(cases, r)


def stop():
    hvd.shutdown()
    assert LIVE["blocks"] == 0 and LIVE["opened"] == 0, f"left after shutdown: {dict(LIVE)}"


per_setting(sys.argv[1] if len(sys.argv) > 1 else None, start, checks, stop)
print(f"OK rank {r}", flush=True)
