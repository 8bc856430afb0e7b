"""Host memory standing in for a GPU, for the GPU ways' checks under a real mpiexec on a machine
without one (gpu_paths_check.py, peer_node_check.py). Import it before ringreduce.

No CUDA array, stream, event or IPC handle can exist without a device, so NumPy stands in: a
"device array" is a NumPy array that has `__cuda_array_interface__`, `device` and `data.ptr`;
a fake `cupy` runs ufuncs with NumPy, our kernels with the CPU's (torch for the 16-bit
floats' scaling, ringreduce's CPU kernels for the node way's reduction, which the CPU paths'
own tests check), and copies with memmove; torch's streams, events and device guard become
no-ops. "Device memory" that the node's other processes open (cudaMalloc, CUDA IPC) is a file
in /dev/shm that each process maps. Everything else is real: MPI, the ways, their protocol.

`FAULTS` makes IPC fail where a check asks: `fail_open_on` (a local rank whose opening of its
peers' blocks fails), `private_gpus` (each rank sees only its own GPU, as under
CUDA_VISIBLE_DEVICES=<local rank>). `LIVE` counts what is allocated and mapped, per kind.
"""
import ctypes
import mmap
import os
import sys
import types
from collections import Counter

import numpy as np
import torch

from ringreduce.kernels import ops     # (the C extension only: no CUDA or CuPy touched)

FAULTS = types.SimpleNamespace(fail_open_on=None, private_gpus=False, local_rank=0)
LIVE: Counter = Counter()


class DeviceArray(np.ndarray):
    """Host memory posing as device memory."""

    __cuda_array_interface__ = {}
    device = types.SimpleNamespace(id=0)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def on_device(array):
    return np.ascontiguousarray(array).view(DeviceArray)


def at(address, count, dtype):
    """`count` elements of `dtype` at `address`, as a device array (no copy)."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype).view(DeviceArray)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dtype).view(DeviceArray)


# ---------------------------------------------------------------- kernels

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_PEER = {"u8": torch.uint8, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
         "i64": torch.int64, "f32": torch.float32, "f64": torch.float64, **_HALF}
_STORAGE = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.uint8: np.uint8,
            torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
            torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64}


def half_kernel(kind, function):
    """cuda_kernels/reduce.cu's 16-bit kernels, computed by torch on the CPU: float math, one
    rounding."""
    dtype = _HALF[kind]
    ops_ = {0: torch.add, 1: torch.add, 3: torch.minimum, 4: torch.maximum, 5: torch.mul}

    def view(array):
        return torch.from_numpy(np.asarray(array).view(np.int16)).view(dtype)

    def launch(grid, block, args):
        if function == "reduce":
            target, source, _, op = args
            view(target).copy_(ops_[int(op)](view(target).float(), view(source).float()))
        else:
            x, _, factor = args
            view(x).copy_(view(x).float() * float(factor))

    return launch


def peer_reduce(kind):
    """reduce.cu's peer_reduce_<kind>: every rank's block in rank order, by the CPU kernels."""
    dtype = _PEER[kind]
    storage = _STORAGE[dtype]

    def launch(grid, block, args):
        table, ranks, offset, out, count, op = args
        count, offset, op = int(count), int(offset), int(op)
        itemsize = np.dtype(storage).itemsize
        inputs = [at(int(address) + offset * itemsize, count, storage)
                  for address in np.asarray(table)[:int(ranks)]]
        acc = np.array(inputs[0])
        reduce = ops.reducer(dtype, ops.ReduceOp(op))
        for block_ in inputs[1:]:
            reduce(acc, block_)
        at(int(out), count, storage)[...] = acc

    return launch


def kernel(name):
    if name.startswith("peer_reduce_"):
        return peer_reduce(name.removeprefix("peer_reduce_"))
    kind, function = name.split("_")
    return half_kernel(kind, function)


# ---------------------------------------------------------------- device memory and IPC

class CUDARuntimeError(RuntimeError):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status


_mapped = {}        # address -> (mmap, the NumPy view keeping its address, path, owned)


def _map(path, nbytes, owned):
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), nbytes)
    view = np.frombuffer(mapping, dtype=np.uint8)
    address = view.ctypes.data
    _mapped[address] = (mapping, view, path, owned)
    return address


def malloc(nbytes):
    path = f"/dev/shm/ringreduce-fake-gpu-{os.getpid()}-{len(_mapped)}-{LIVE['malloc']}"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    LIVE["blocks"] += 1
    LIVE["malloc"] += 1
    return _map(path, nbytes, owned=True)


def _unmap(address):
    mapping, view, path, owned = _mapped.pop(address)
    del view
    mapping.close()
    return path, owned


def free(address):
    path, owned = _unmap(address)
    assert owned, "freed a block this process did not allocate"
    os.unlink(path)
    LIVE["blocks"] -= 1


def ipc_get_mem_handle(address):
    path = _mapped[address][2].encode()
    return path + b"\0" * (64 - len(path))


def ipc_open_mem_handle(handle, flags=1):
    if FAULTS.fail_open_on == FAULTS.local_rank:
        raise CUDARuntimeError(205, "cudaErrorMapBufferObjectFailed: mapping failed (fake)")
    path = handle.rstrip(b"\0").decode()
    LIVE["opened"] += 1
    return _map(path, os.path.getsize(path), owned=False)


def ipc_close_mem_handle(address):
    _, owned = _unmap(address)
    assert not owned, "closed a block this process allocated"
    LIVE["opened"] -= 1


def bus_id(device):
    """One GPU for every rank, or (private_gpus) a GPU of each local rank's own."""
    return f"0000:{FAULTS.local_rank if FAULTS.private_gpus else 0:02x}:00.0"


def device_by_bus_id(bus):
    if bus == bus_id(0):
        return 0
    raise CUDARuntimeError(101, "cudaErrorInvalidDevice (fake)")


def memcpy_async(target, source, size, kind, stream):
    ctypes.memmove(target, source, size)


def asarray(obj):
    if isinstance(obj, torch.Tensor):
        return on_device(obj.numpy())
    return on_device(np.asarray(obj))


class UnownedMemory:
    def __init__(self, address, size, owner, device):
        self.address, self.size = address, size


class MemoryPointer:
    def __init__(self, memory, offset):
        self.address = memory.address + offset


def ndarray(shape, dtype, memptr):
    return at(memptr.address, int(np.prod(shape)), dtype).reshape(shape)


# ---------------------------------------------------------------- streams, events, guards

class Context:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Stream(Context):
    @classmethod
    def from_external(cls, stream):
        return cls()


class TorchStream:
    cuda_stream = 0

    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        pass

    def record_event(self):
        return TorchEvent()

    def synchronize(self):
        pass


class TorchEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


runtime = types.SimpleNamespace(
    memcpyDeviceToHost=2, memcpyHostToDevice=1, memcpyAsync=memcpy_async, malloc=malloc,
    free=free, ipcGetMemHandle=ipc_get_mem_handle, ipcOpenMemHandle=ipc_open_mem_handle,
    ipcCloseMemHandle=ipc_close_mem_handle, deviceGetPCIBusId=bus_id,
    deviceGetByPCIBusId=device_by_bus_id, deviceCanAccessPeer=lambda device, peer: True,
    deviceEnablePeerAccess=lambda peer: None, CUDARuntimeError=CUDARuntimeError)

cupy = types.ModuleType("cupy")
for ufunc in ("add", "minimum", "maximum", "multiply"):
    setattr(cupy, ufunc, getattr(np, ufunc))
cupy.uint16 = np.uint16
cupy.empty = lambda count, dtype: on_device(np.empty(count, dtype))
cupy.asarray = asarray
cupy.ndarray = ndarray
cupy.RawModule = lambda code, options=(): types.SimpleNamespace(get_function=kernel)
cupy.cuda = types.SimpleNamespace(Device=Context, Stream=Stream, runtime=runtime,
                                  UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer)
cupyx = types.ModuleType("cupyx")
cupyx.empty_pinned = lambda shape, dtype: np.empty(shape, dtype)
sys.modules.update(cupy=cupy, cupyx=cupyx)
torch.cuda.Stream, torch.cuda.Event, torch.cuda.device = TorchStream, TorchEvent, Context
torch.cuda.current_stream = lambda device=None: TorchStream()
