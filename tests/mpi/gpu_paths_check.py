"""Both GPU ways of the transport (`gpu_ways.reduce_in_device_memory`, `gpu_ways.reduce_staged`)
under a real mpiexec, without a GPU: host memory stands in for the device (fake_device.py).
Everything else is real: the ring over MPI, the staging pipeline with its slots and pieces,
the host path it calls, the finishing arithmetic. A rank passing a CPU tensor where the others
pass CUDA ones is a MismatchError on every rank. From 3 ranks on, two process sets (the world and {0, 1}) also
reduce on the one "device" from two threads at once, each with its own DeviceScratch, and
the results are exact.
Usage: gpu_paths_check.py AWARE[,AWARE...] [STAGING_PIECE_BYTES]   (AWARE 1: CUDA-aware MPI,
0: staged; each in turn, init to shutdown, in one launch)
"""
import sys
import threading
import types

import numpy as np
import torch

from fake_device import on_device   # (first: it puts its cupy and torch.cuda in place)
import ringreduce as hvd
from checks import horovod_scaled
from mpi4py import MPI
from ringreduce.api.reductions import _allreduce_spec
from ringreduce.gpu import staging
from ringreduce.kernels.buffers import as_array, as_tensor
from ringreduce.sets.process_sets import active, global_set
from ringreduce.transport import gpu_ways
from ringreduce.transport.reduce_spec import ReduceSpec

if len(sys.argv) > 2:
    staging.STAGING_PIECE_BYTES = int(sys.argv[2])
r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def reduce_device(transport, array, spec, aware):
    """What the transport's GPU way does with a CUDA tensor's memory (ways.py; this "device"
    memory is NumPy's): in device memory when MPI is CUDA-aware (or in a set of one), else
    staged through host memory, each piece reduced by the transport's host ways."""
    if aware or transport.comm.size == 1:
        settings = transport.settings
        gpu_ways.reduce_in_device_memory(array, spec.dtype, spec.op, spec.prescale, spec.postscale,
                                     transport.comm, settings.small_message_bytes,
                                     settings.segment_bytes, transport.device_scratch,
                                     transport.watch.wait_request)
    else:
        gpu_ways.reduce_staged(array, transport.host_pieces(spec), transport.device_scratch)


def inputs(rank, length, dtype, op):
    g = torch.Generator().manual_seed(1000 * rank + length)
    lo = 0 if dtype == torch.uint8 else (-2 if op == hvd.Product else -8)
    return torch.randint(lo, 3 if op == hvd.Product else 9, (length,), generator=g).to(dtype)


def reference(length, dtype, op, pre, post):
    xs = torch.stack([inputs(k, length, dtype, op).double() * pre for k in range(n)])
    out = {hvd.Sum: xs.sum, hvd.Average: xs.sum, hvd.Product: xs.prod,
           hvd.Min: lambda dim: xs.amin(dim), hvd.Max: lambda dim: xs.amax(dim)}[op](0)
    out = out.to(dtype)
    return horovod_scaled(out, post / n if op == hvd.Average else post)


def check_every_op_and_dtype(aware):
    transport = global_set("test").transport
    for dtype in (torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float32,
                  torch.float64):
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            for length in (0, 1, 17, 5000, 300_001):
                pre, post = (2.0, 0.5) if dtype.is_floating_point else (1.0, 1.0)
                array = on_device(as_array(inputs(r, length, dtype, op)))
                reduce_device(transport, array, ReduceSpec(dtype, op, pre, post), aware)
                got = as_tensor(np.asarray(array), dtype)
                want = reference(length, dtype, op, pre, post)
                what = f"cuda_aware={aware}: {dtype} {op.name} length {length}"
                # (Average: one multiply by postscale / n, on the device as on the host)
                assert torch.equal(got, want), f"{what}: got {got[:5]} want {want[:5]}"


def reduce_on(held, label, failures, aware):
    """A few allreduces on set `held`, as its transport runs them (under its engine), checked
    exactly against the sum or max of its members' inputs. The ring's scratch, the small path's
    gather and the staging slots all come from the set's DeviceScratch."""
    transport = held.transport

    def data(rank, i, length, dtype):
        g = torch.Generator().manual_seed(7919 * rank + 31 * i + length + held.id)
        return torch.randint(-8, 9, (length,), generator=g).to(dtype)

    try:
        for i in range(2):
            for dtype in (torch.int32, torch.float32, torch.bfloat16):
                for op, length in ((hvd.Sum, 12_001), (hvd.Max, 777), (hvd.Sum, 777)):
                    array = on_device(as_array(data(r, i, length, dtype)))
                    spec = ReduceSpec(dtype, op)
                    held.engine.run(f"{label}.{i}.{dtype}.{op.name}.{length}",
                                    lambda: reduce_device(transport, array, spec, aware))
                    xs = torch.stack([data(k, i, length, dtype) for k in held.ranks])
                    want = xs.sum(0).to(dtype) if op == hvd.Sum else xs.amax(0)
                    got = as_tensor(np.asarray(array), dtype)
                    if not torch.equal(got, want):
                        failures.append(f"{label} {i} {dtype} {op.name} {length}: got "
                                        f"{got[:5]} want {want[:5]}")
    except BaseException as exc:    # reported by the main thread
        failures.append(f"{label}: {exc!r}")


def check_a_cpu_tensor_among_cuda_ones(aware):
    """The last rank passes a CPU tensor where the others pass CUDA ones (their GPU way runs on
    "device" memory under the signature production gives a CUDA tensor): MismatchError saying
    that the device differs, on every rank, at the small way's size and the large ways' (the
    digests agreed before, and the CPU rank took slot memory no GPU rank had written for its
    sum), and the set goes on."""
    glob = global_set("test")
    for length in (300, 300_000):
        x = torch.full((length,), float(r + 1))
        name = f"mixed{int(aware)}.{length}"
        try:
            if r == n - 1:
                hvd.allreduce(x, name=name, op=hvd.Sum)
            else:
                cuda_like = types.SimpleNamespace(dtype=x.dtype, shape=x.shape, is_cuda=True)
                spec = _allreduce_spec(cuda_like, hvd.Sum, 1.0, 1.0, f"allreduce.{name}", None)
                array = on_device(as_array(x))

                def gpu_way():
                    glob.transport.parts.check(spec)    # as both GPU ways begin (ways.py)
                    reduce_device(glob.transport, array, spec, aware)

                glob.engine.run(f"allreduce.{name}", gpu_way)
        except hvd.MismatchError as error:
            assert all(s in str(error) for s in ("'device' differs", "'cuda'", "'cpu'")), error
        else:
            raise AssertionError(f"cuda_aware={aware}, length {length}: no MismatchError")
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)))


def check_two_sets_at_once(aware):
    pair = hvd.add_process_set([0, 1])
    sets = [global_set("test")] + ([active(pair, "test")] if r < 2 else [])
    scratches = [held.transport.device_scratch for held in sets]
    assert len({id(s) for s in scratches}) == len(sets), "two sets share a DeviceScratch"
    failures = []
    threads = [threading.Thread(target=reduce_on, args=(held, f"set{held.id}", failures, aware))
               for held in sets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, f"cuda_aware={aware}: " + "\n".join(failures)
    assert all(s.held_bytes() > 0 for s in scratches), [s.held_bytes() for s in scratches]
    hvd.remove_process_set(pair)
    assert scratches[-1].held_bytes() == (0 if r < 2 else scratches[0].held_bytes())


for aware in [word == "1" for word in sys.argv[1].split(",")]:
    hvd.init(cuda_aware=aware)
    check_every_op_and_dtype(aware)
    if n > 1:
        check_a_cpu_tensor_among_cuda_ones(aware)
    if n >= 3:
        check_two_sets_at_once(aware)
    hvd.shutdown()
print(f"OK rank {r}", flush=True)
