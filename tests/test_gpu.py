"""The GPU path: what runs without a device here, the rest on a GPU (skipped without one).

Without a device: the staging pipeline's pieces, order and overlap (driven by NumPy buffers
and queued copies that behave like in-order stream copies), both GPU ways of the transport under a
real mpiexec with NumPy standing in for device memory (and two process sets reducing at once
from two threads, each with its own DeviceScratch), the DeviceScratch bookkeeping with NumPy
allocators, every CUDA kernel source compiling with nvcc, CUDA-aware detection with the real
MPI library and the override, the placement errors, and buckets that follow their parameters'
device.
"""
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import run_mpi, run_ok
import ringreduce as hvd
from ringreduce.api import collectives
from ringreduce.core import config
from ringreduce.gpu import cuda, cuda_aware, device_kernels, staging
from ringreduce.kernels import ops
from ringreduce.kernels.buffers import CODES, as_array as as_array_of
from ringreduce.optim import fusion
from ringreduce.core.mpi import mpi
from ringreduce.transport import peer_node
from ringreduce.transport.stall import StallWatch
from ringreduce.transport.set_transport import Transport

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "ringreduce" / "gpu" / device_kernels.KERNEL_DIR


def _gpu_ready() -> str:
    """Why the GPU tests cannot run here, or '' when they can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install -e '.[cuda12]' or '.[cuda13]')"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # CuPy's CUDA runtime cannot reach the driver
        return f"CuPy cannot use the GPU: {exc}"
    return ""


GPU_MISSING = _gpu_ready()


# ---------------------------------------------------------------- the staging pipeline

class QueuedCopies:
    """Stands in for DeviceCopies: a NumPy 'device' array, two host slots, and copies queued
    in order like a CUDA stream's, run only when a wait or drain needs them."""

    def __init__(self, device: np.ndarray, piece: int) -> None:
        self.device = device
        self.slots = np.full((2, piece), -1, dtype=device.dtype)
        self.queue: list = []
        self.log: list[str] = []

    def slot(self, k):
        return self.slots[k % 2]

    def down(self, k, lo, hi):
        def copy():
            self.slots[k % 2][:hi - lo] = self.device[lo:hi]
            self.log.append(f"landed {k}")
        self.queue.append((f"down {k}", copy))
        self.log.append(f"queued down {k}")

    def up(self, k, lo, hi):
        def copy():
            self.device[lo:hi] = self.slots[k % 2][:hi - lo]
            self.log.append(f"back {k}")
        self.queue.append((f"up {k}", copy))
        self.log.append(f"queued up {k}")

    def wait(self, k):
        while self.queue:
            label, copy = self.queue.pop(0)
            copy()
            if label == f"down {k}":
                return
        raise AssertionError(f"waited for piece {k}, whose copy down was never queued")

    def drain(self):
        while self.queue:
            self.queue.pop(0)[1]()


@pytest.mark.parametrize("length,piece", [(0, 4), (1, 4), (4, 4), (11, 4), (40, 3), (7, 100)])
def test_staging_reduces_every_piece_once_in_place(length, piece):
    device = np.arange(length, dtype=np.int64)
    copies = QueuedCopies(device, piece)
    seen = []

    def reduce_host(host):
        seen.append(host.copy())
        host *= 10      # stands in for the host allreduce of this piece

    staging.staged_allreduce(copies, length, piece, reduce_host)
    assert np.array_equal(device, np.arange(length) * 10)
    assert [len(s) for s in seen] == [min(piece, length - lo) for lo in range(0, length, piece)]
    assert np.array_equal(np.concatenate(seen) if seen else device, np.arange(length))
    assert not copies.queue


def test_staging_overlaps_copies_with_mpi_work():
    """While piece k is reduced, piece k+1's copy down is already queued (not yet run: the
    stream does it meanwhile), and piece k's copy back is queued as soon as k is done."""
    device = np.arange(20, dtype=np.float32)
    copies = QueuedCopies(device, 4)
    states = []

    def reduce_host(host):
        k = len(states)
        states.append((f"queued down {k + 1}" in copies.log, f"landed {k + 1}" in copies.log))
        host += 1

    staging.staged_allreduce(copies, 20, 4, reduce_host)
    assert states[:-1] == [(True, False)] * 4       # next piece in flight during this one
    assert copies.log.index("back 0") < copies.log.index("landed 2")  # a slot is refilled
    assert np.array_equal(device, np.arange(20) + 1)                 # after its piece went back


# ---------------------------------------------------------------- kernels

def test_kernel_sources_define_every_kernel_used():
    """KERNEL_MODULES names exactly the package's .cu files and every module device_kernels.py
    launches from, so the packaging test, which enumerates it, covers every kernel."""
    assert {p.stem for p in KERNELS.glob("*.cu")} == set(device_kernels.KERNEL_MODULES)
    tree = ast.parse(Path(device_kernels.__file__).read_text())
    launched = {call.args[0].value for call in ast.walk(tree)
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "kernel"
                and isinstance(call.args[0], ast.Constant)}
    assert launched == set(device_kernels.KERNEL_MODULES)
    sources = {name: device_kernels.kernel_source(name) for name in device_kernels.KERNEL_MODULES}
    for kind in ("bf16", "fp16"):
        assert f"HALF_KERNELS({kind}," in sources["reduce"]
    for kind in device_kernels._PEER.values():      # every dtype the CPU kernels take
        assert f"PEER_REDUCE({kind}," in sources["reduce"]
    assert set(device_kernels._PEER) == set(CODES)
    for size in (1, 2, 4, 8):
        assert f"BATCHED_COPY({size}," in sources["batched_copy"]
    for text in sources.values():   # the op codes come as -D options: nothing to include
        assert "#include" not in text
    assert device_kernels.kernel_options() == (
        "-DRR_OP_AVERAGE=0", "-DRR_OP_SUM=1", "-DRR_OP_ADASUM=2", "-DRR_OP_MIN=3",
        "-DRR_OP_MAX=4", "-DRR_OP_PRODUCT=5")


def test_a_missing_kernel_source_says_the_install_is_broken(monkeypatch):
    monkeypatch.setattr(device_kernels, "KERNEL_DIR", "gone")
    with pytest.raises(hvd.RingReduceError) as caught:
        device_kernels.kernel_source("reduce")
    message = str(caught.value)
    assert "gone/reduce.cu is missing from the installed package" in message
    assert "--force-reinstall" in message and "cuda12" not in message
    with pytest.raises(ValueError, match="'nope' is not one of ringreduce's CUDA kernel"):
        device_kernels.kernel_source("nope")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not installed")
@pytest.mark.parametrize("name", device_kernels.KERNEL_MODULES)
def test_kernel_compiles_with_nvcc(name, tmp_path):
    """The text kernel_source() gives NVRTC, with kernel_options() and no include path."""
    ptx, copy = tmp_path / "out.ptx", tmp_path / f"{name}.cu"
    copy.write_text(device_kernels.kernel_source(name))
    done = subprocess.run(["nvcc", "--ptx", "-arch=sm_80", *device_kernels.kernel_options(), "-o",
                           str(ptx), str(copy)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    entries = {line.split()[-1].rstrip("(") for line in ptx.read_text().splitlines()
               if ".entry" in line}
    expected = ({f"{k}_{f}" for k in ("bf16", "fp16") for f in ("reduce", "scale")}
                | {f"peer_reduce_{k}" for k in device_kernels._PEER.values()}
                if name == "reduce" else {f"batched_copy_{n}" for n in (1, 2, 4, 8)})
    assert entries == expected   # extern "C": the names device_kernels.py asks CuPy for
    if name == "reduce":        # without the op codes it refuses to compile, and says why
        done = subprocess.run(["nvcc", "--ptx", "-arch=sm_80", "-o", str(ptx), str(copy)],
                              capture_output=True, text=True)
        assert done.returncode != 0 and "kernel_options()" in done.stderr


# ---------------------------------------------------------------- each set's device scratch

class Allocations:
    """NumPy allocators standing in for CuPy's and torch's, recording each call."""

    def __init__(self):
        self.calls = []

    def device(self, device, nbytes):
        self.calls.append(("device", device, nbytes))
        return np.zeros(nbytes, np.uint8)

    def pinned(self, nbytes):
        self.calls.append(("pinned", nbytes))
        return np.zeros(nbytes, np.uint8)

    def events(self):
        self.calls.append(("events",))
        return [object(), object()]


def test_device_scratch_grows_one_block_per_device_and_purpose():
    made = Allocations()
    scratch = cuda.DeviceScratch(made.device, made.pinned, made.events)
    assert scratch.held_bytes() == 0 and made.calls == []
    ring = scratch.device(0, "ring", np.float32, 100)
    assert ring.dtype == np.float32 and ring.size == 100
    assert np.shares_memory(scratch.device(0, "ring", np.int16, 150), ring)   # reused
    assert not np.shares_memory(scratch.device(0, "gather", np.float32, 4), ring)
    assert not np.shares_memory(scratch.device(1, "ring", np.float32, 100), ring)
    assert made.calls == [("device", 0, 400), ("device", 0, 64), ("device", 1, 400)]
    assert scratch.device(0, "ring", np.float64, 100).nbytes == 800     # grows
    assert made.calls[-1] == ("device", 0, 800)
    slots = scratch.pinned(0, 1000)
    assert np.shares_memory(scratch.pinned(0, 10), slots) and slots.nbytes == 1000
    assert scratch.events(0) is scratch.events(0) and scratch.events(1) is not scratch.events(0)
    assert made.calls[3:] == [("device", 0, 800), ("pinned", 1000), ("events",), ("events",)]
    assert scratch.held_bytes() == 800 + 64 + 400 + 1000
    scratch.free()
    assert scratch.held_bytes() == 0
    scratch.device(0, "ring", np.float32, 1)       # a later use allocates anew
    assert made.calls[-1] == ("device", 0, 64)


def test_each_transport_owns_its_device_scratch_made_without_cuda(monkeypatch):
    """Two transports (two process sets, on real MPI communicators of one rank) each own a
    DeviceScratch, made without importing CuPy or touching CUDA, and free drops it."""
    monkeypatch.setitem(sys.modules, "cupy", None)      # an import of CuPy would fail
    monkeypatch.setitem(sys.modules, "cupyx", None)
    monkeypatch.setattr(torch.cuda, "Event", None)
    MPI, settings = mpi(), config.Settings.load()
    transports = []
    for _ in range(2):
        comm = MPI.COMM_SELF.Dup()
        watch = StallWatch(comm, 0, 0, print, [0], "")
        transports.append(Transport(comm, comm, comm, settings, watch, [0], True))
    try:
        a, b = (t.device_scratch for t in transports)
        assert isinstance(a, cuda.DeviceScratch) and a is not b
        made = Allocations()
        a._device_block, a._pinned_block, a._event_pair = made.device, made.pinned, made.events
        a.device(0, "ring", np.float32, 10), a.pinned(0, 10), a.events(0)
        assert a.held_bytes() == 64 + 10 and b.held_bytes() == 0
    finally:
        for transport in transports:
            transport.free()
            transport.comm.Free()
    assert a.held_bytes() == 0 and a._events == {}


# ---------------------------------------------------------------- CUDA-aware MPI

@pytest.mark.parametrize("kinds,aware", [("mpi,system", False), ("mpi,system,cuda", True),
                                          ("mpi, cuda:device", True), ("cuda:host", False),
                                          ("cuda:host:device", True), ("rocm:device", False)])
def test_memory_alloc_kinds_parsing(kinds, aware):
    assert cuda_aware.supports_cuda_memory(kinds) is aware


def test_override_wins_without_asking_mpi(monkeypatch):
    assert cuda_aware.resolve_cuda_aware(True, None, None)[0] is True
    assert cuda_aware.resolve_cuda_aware(False, None, None)[0] is False
    for text, value in (("auto", "auto"), ("1", True), ("0", False), ("AUTO", "auto")):
        monkeypatch.setenv("RINGREDUCE_CUDA_AWARE", text)
        assert config.Settings.load().cuda_aware == value
    monkeypatch.setenv("RINGREDUCE_CUDA_AWARE", "sometimes")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_AWARE"):
        config.Settings.load()


def test_the_real_mpi_library_answers():
    """The MPICH wheel has MPIX_Query_cuda_support and is built without CUDA."""
    code = ("from mpi4py import MPI; from ringreduce.gpu import cuda_aware; "
            "print(cuda_aware.query_cuda_support(MPI, MPI.COMM_WORLD))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(False, 'MPIX_Query_cuda_support()')"


@pytest.mark.parametrize("told, aware", [("1", True), ("0", False), (None, False)])
def test_mvapich2_gdr_is_aware_where_told(monkeypatch, told, aware):
    """MVAPICH2-GDR has no MPIX_Query_cuda_support: MV2_USE_CUDA=1 is what turns its device
    support on, so that decides (its library version names it); its communicator's info is
    not asked."""
    monkeypatch.setattr(cuda_aware.ctypes, "CDLL", lambda library: SimpleNamespace())
    if told is None:
        monkeypatch.delenv("MV2_USE_CUDA", raising=False)
    else:
        monkeypatch.setenv("MV2_USE_CUDA", told)
    gdr = SimpleNamespace(__file__="mpi4py/MPI.so", Get_library_version=lambda:
                          "MVAPICH2-GDR Version 2.3.7\nMVAPICH2-GDR Release date: ...")
    got, how = cuda_aware.query_cuda_support(gdr, comm=None)
    assert got is aware and how == f"MVAPICH2-GDR with MV2_USE_CUDA={told or 0}"
    other = SimpleNamespace(__file__="mpi4py/MPI.so", Get_library_version=lambda: "MPICH 3.2")
    info = SimpleNamespace(Get=lambda key: None, Free=lambda: None)
    assert cuda_aware.query_cuda_support(other, SimpleNamespace(Get_info=lambda: info)) == (
        False, "the MPI library offers no CUDA query")


def test_init_logs_the_choice_once():
    """Each init() (one launch: an init per setting, a shutdown after each) logs its choice
    once, and keeps it in the settings."""
    expected = {None: "no, GPU buffers are staged", "1": "yes, device buffers go straight",
                "0": "no, GPU buffers are staged"}
    result = run_mpi(1, "gpu_aware_check.py", json.dumps(list(expected)), timeout=60)
    assert result.returncode == 0, result.output
    inits = result.output.split("INIT with ")[1:]
    assert len(inits) == len(expected), result.output
    for (setting, want), output in zip(expected.items(), inits):
        assert output.startswith(f"{setting}\n"), output
        lines = [line for line in output.splitlines() if "CUDA-aware MPI" in line]
        assert len(lines) == 1 and want in lines[0], (setting, output)
        assert ("MPIX_Query_cuda_support()" in lines[0]) == (setting is None), (setting, output)
        assert f"setting {setting == '1'}" in output, (setting, output)


# ---------------------------------------------------------------- placement, without a device

def test_reductions_take_the_tensor_on_its_device_and_the_rest_a_host_copy(monkeypatch):
    """Whichever device is current (as Horovod's and NCCL's): a reduction works on the
    tensor's own device memory, the other collectives on a host copy; allgather and broadcast
    in device memory too where the set's members share one node's (the GPU node way)."""
    monkeypatch.setitem(sys.modules, "cupy", ModuleType("cupy"))  # CuPy present or not
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    host = torch.arange(3)

    class OnGpu(SimpleNamespace):           # no CUDA tensor can exist here
        def detach(self):
            return self

        def cpu(self):
            return host

    elsewhere = OnGpu(device=torch.device("cuda", 1))
    assert cuda.device_tensor(elsewhere, "allreduce") is elsewhere
    for what in ("allgather", "broadcast", "alltoall", "reducescatter"):
        assert cuda.device_tensor(elsewhere, what) is host
    for what in ("allgather", "grouped_allgather", "broadcast", "broadcast_"):
        assert cuda.device_tensor(elsewhere, what, in_node=True) is elsewhere
    for what in ("alltoall", "reducescatter"):
        assert cuda.device_tensor(elsewhere, what, in_node=True) is host


@pytest.mark.parametrize("initialised, device, want", [
    (False, -1, 3),     # CUDA untouched: the local rank's GPU (7 % 4), not GPU 0
    (True, -1, 2),      # this thread's current GPU
    (False, 1, 1), (True, 1, 1)])
def test_a_joined_rank_makes_its_zeros_on_its_own_gpu(monkeypatch, initialised, device, want):
    """join()'s zeros for the others' GPU allreduces: the device asked for, else this thread's
    current GPU, else (CUDA untouched on this rank) its local rank's, never GPU 0 by default."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert collectives.zeros_device(device, local_rank=7) == torch.device("cuda", want)


def test_without_cuda_a_joined_rank_makes_cpu_zeros(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert collectives.zeros_device(-1, local_rank=1) is None


def test_without_cupy_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # makes `import cupy` fail
    with pytest.raises(hvd.RingReduceError, match=r"ringreduce\[cuda12\]"):
        cuda.device_tensor(SimpleNamespace(device=torch.device("cuda", 0)), "allreduce")


def test_batched_copy_declines_pairs_it_cannot_copy_in_one_launch():
    a, b = torch.zeros(3), torch.zeros(3)
    assert device_kernels._batched_copy([], None)
    for moves in ([(None, a)], [(a, None)], [(a, b.double())], [(torch.zeros(3, 2).t(), b)]):
        assert not device_kernels._batched_copy(moves, None)


def test_a_sparse_gradient_leaves_packing_to_the_bucket():
    """pack/unpack's pairs: every gradient that is not its view already, and none at all where
    one is sparse (its data pointer cannot be read; Bucket.pack writes zeros for it)."""
    dense, viewed, sparse = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    (bucket,) = fusion.plan([("dense", dense), ("viewed", viewed), ("sparse", sparse)],
                            threshold=1 << 20, first_bucket=1 << 20, direct=False)
    views = dict(zip(bucket.params, bucket.views))
    dense.grad, viewed.grad = torch.ones(3), views[viewed]
    assert device_kernels._moves(bucket, to_buffer=True) == [(None, views[sparse]),
                                                   (dense.grad, views[dense])]
    assert device_kernels._moves(bucket, to_buffer=False)[1] == (views[dense], dense.grad)
    sparse.grad = torch.ones(3).to_sparse()
    assert device_kernels._moves(bucket, to_buffer=True) is None
    assert device_kernels._moves(bucket, to_buffer=False) is None


def test_after_sets_the_event_for_this_thread_only_inside_the_block():
    with cuda.after("outer"):
        with cuda.after(None):
            assert cuda._ready.event == "outer"
        with cuda.after("inner"):
            assert cuda._ready.event == "inner"
        assert cuda._ready.event == "outer"
    assert cuda._ready.event is None


def test_buckets_follow_their_parameters_device():
    """Meta tensors stand in for a second device: buckets split where the device changes."""
    params = [("a", torch.nn.Parameter(torch.zeros(4))),
              ("b", torch.nn.Parameter(torch.zeros(4, device="meta"))),
              ("c", torch.nn.Parameter(torch.zeros(4, device="meta")))]
    buckets = fusion.plan(params, threshold=1 << 20, first_bucket=1 << 20)
    assert [(b.names, b.buffer.device.type) for b in buckets] == [(["c", "b"], "meta"),
                                                                  (["a"], "cpu")]
    with pytest.raises(ValueError, match="spans several devices"):
        fusion.plan(params, 1 << 20, 1 << 20, explicit_groups=[[p for _, p in params]])


@pytest.mark.parametrize("n", [2, 3])
def test_device_paths_under_mpi_with_numpy_standing_in_for_the_device(n):
    """The GPU ways' CUDA-aware ring and staging pipeline (one after the other, in one launch),
    every op and several dtypes, with small segments and 4 KiB staging pieces so that both cut
    buffers into many parts."""
    run_ok(n, "gpu_paths_check.py", "1,0", "4096", timeout=400,
           env={"RINGREDUCE_SEGMENT_BYTES": "1024", "RINGREDUCE_SMALL_MESSAGE_BYTES": "4096"})


# ---------------------------------------------------------------- the GPU node way

PEER_SETTINGS = {
    "one node": {"RINGREDUCE_SMALL_MESSAGE_BYTES": "4096"},
    "2 nodes": {"RINGREDUCE_SIMULATED_NODES": "2"},
    "2 nodes, CUDA-aware": {"RINGREDUCE_SIMULATED_NODES": "2", "RINGREDUCE_CUDA_AWARE": "1"},
    "a node a rank": {"RINGREDUCE_SIMULATED_NODES": "4"},
    "turned off": {"RINGREDUCE_GPU_NODE_WAY": "staging"},
    "opening fails on local rank 1": {"FAKE_FAIL_OPEN": "1"},
    "each rank sees its own GPU only": {"FAKE_PRIVATE_GPUS": "1"},
    "opening fails, ipc forced": {"FAKE_FAIL_OPEN": "1", "RINGREDUCE_GPU_NODE_WAY": "ipc"}}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_gpu_node_way_under_mpi_with_host_memory_standing_in_for_the_device(n):
    """transport/peer_node.py's protocol, registry, fallback and step between nodes, each
    setting in turn (peer_node_check.py says what each checks); the simulated nodes at 4 ranks
    only (2 nodes of 2, 4 of 1)."""
    settings = {label: env for label, env in PEER_SETTINGS.items()
                if n == 4 or "RINGREDUCE_SIMULATED_NODES" not in env}
    run_ok(n, "peer_node_check.py", json.dumps(settings), timeout=300)


@pytest.mark.parametrize("count, ranks, itemsize", [
    (0, 2, 4), (1, 4, 4), (63, 2, 4), (64, 2, 4), (1000, 3, 2), (50_003, 4, 4), (7, 8, 8)])
def test_slices_cover_the_buffer_on_whole_lines(count, ranks, itemsize):
    """Each local rank's slice of the two-shot: consecutive, covering every element once,
    starting on a SLICE_ALIGNMENT boundary, as even as whole lines allow."""
    bounds = peer_node.slices(count, ranks, itemsize)
    assert len(bounds) == ranks and bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    line = peer_node.SLICE_ALIGNMENT // itemsize
    assert all(lo % line == 0 or lo == count for lo, _ in bounds)
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) < 2 * line, sizes   # (a line more, the last one partial)


def test_the_gpu_node_way_setting():
    for text, value in (("auto", "auto"), ("IPC", "ipc"), (" staging ", "staging")):
        assert config.Settings.load(gpu_node_way=text).gpu_node_way == value
    with pytest.raises(ValueError, match="expected auto, ipc or staging"):
        config.Settings.load(gpu_node_way="nccl")
    assert "gpu_node_way" in config.Settings.AGREED


# ---------------------------------------------------------------- on a GPU

@pytest.mark.skipif(bool(GPU_MISSING), reason=GPU_MISSING)
def test_gpu_allreduce_and_training_on_two_ranks():
    run_ok(2, str(ROOT / "scripts" / "gpu_check.py"), "--no-bench", timeout=280,
           env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                             os.environ.get("PYTHONPATH")]))})



@pytest.mark.skipif(bool(GPU_MISSING), reason=GPU_MISSING)
def test_two_process_sets_reduce_on_one_gpu_at_once():
    """The world and {0, 1} from two threads on 3 ranks sharing the GPU, each set with its own
    device scratch: exact results."""
    run_ok(3, "gpu_sets_check.py", timeout=240)


@pytest.mark.skipif(bool(GPU_MISSING), reason=GPU_MISSING)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32])
def test_device_kernels_reduce_and_scale_as_torch_does(dtype):
    """The reduction and scaling a CUDA-aware ring runs on the GPU (our half kernels, CuPy's
    ufuncs for the rest), which MPI without CUDA support never reaches: bit for bit as torch
    computes `a op b` and `x * factor` on the device (one rounding, from float32 math, for
    the 16-bit floats)."""
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        a, b = (torch.randn(100_003, generator=g).to(dtype).cuda() for _ in range(2))
    else:
        a, b = (torch.randint(-50, 50, (100_003,), generator=g).to(dtype).cuda()
                for _ in range(2))
    stream = torch.cuda.current_stream()
    ops = {hvd.Sum: torch.add, hvd.Min: torch.minimum, hvd.Max: torch.maximum,
           hvd.Product: torch.mul}
    for op, torch_op in ops.items():
        target = a.clone()
        torch.cuda.synchronize()    # (CuPy launches on its current stream, maybe not torch's)
        device_kernels.device_reducer(dtype, op, stream)(cuda.as_device_array(target),
                                                cuda.as_device_array(b))
        torch.cuda.synchronize()
        assert torch.equal(target, torch_op(a, b)), f"{dtype} {op.name}"
    x = a.clone()
    torch.cuda.synchronize()
    device_kernels.scale(cuda.as_device_array(x), dtype, 0.37)
    torch.cuda.synchronize()
    if dtype.is_floating_point:
        want = (a.float() * 0.37).to(dtype) if dtype in (torch.float16, torch.bfloat16) \
            else a * torch.tensor(0.37, dtype=dtype)
    else:
        want = (a.double() * 0.37).to(torch.int64).to(dtype)
    assert torch.equal(x, want), f"{dtype} scale"


@pytest.mark.skipif(bool(GPU_MISSING), reason=GPU_MISSING)
@pytest.mark.parametrize("dtype", sorted(CODES, key=str))
def test_device_kernels_reduce_from_peers_as_the_cpu_node_way(dtype):
    """The GPU node way's kernel (peer_reduce_*), three blocks in rank order, from an offset,
    into one of them: bit for bit what the CPU's kernels compute step by step (the CPU node
    way's order and rounding), for every op; NaN where the CPU has NaN, and signed zeros
    as the CPU has them."""
    cp = pytest.importorskip("cupy")
    g = torch.Generator().manual_seed(1)
    length, offset = 70_001, 3
    if dtype.is_floating_point:
        blocks = [torch.randn(length, generator=g).to(dtype) for _ in range(3)]
        blocks[1][:4] = torch.tensor([float("nan"), -0.0, 0.0, float("inf")]).to(dtype)
        blocks[2][:4] = torch.tensor([1.0, 0.0, -0.0, float("nan")]).to(dtype)
    else:
        lo = 0 if dtype == torch.uint8 else -100
        blocks = [torch.randint(lo, 100, (length,), generator=g).to(dtype) for _ in range(3)]
    for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
        want = blocks[0][offset:].clone()
        reduce = ops.reducer(dtype, op)
        for block in blocks[1:]:
            reduce(as_array_of(want), as_array_of(block[offset:].contiguous()))
        on_gpu = [b.cuda() for b in blocks]
        table = cp.asarray(np.array([b.data_ptr() for b in on_gpu], dtype=np.uint64))
        out = on_gpu[2][offset:]         # (into one of the inputs, as the two-shot does)
        torch.cuda.synchronize()
        device_kernels.reduce_from_peers(table, 3, offset, out.data_ptr(), out.numel(), dtype,
                                         op)
        torch.cuda.synchronize()
        got = out.cpu()
        nan = want.isnan() if dtype.is_floating_point else torch.zeros_like(want, dtype=bool)
        assert torch.equal(got.isnan() if dtype.is_floating_point else nan, nan), dtype
        assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8)), \
            f"{dtype} {op.name}"    # (elsewhere bit for bit, signed zeros too)

