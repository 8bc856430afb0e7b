"""Two process sets reducing CUDA tensors on one GPU at once, from two threads (needs a GPU and
CuPy; run on 3 ranks sharing GPU 0). The world and {0, 1}: ranks 0 and 1 run both sets' allreduces
concurrently, each set with its own device scratch, pinned slots and events (cuda.DeviceScratch);
every result must be exact. Every rank prints 'OK rank <r>'.
"""
import threading

import torch

import ringreduce as hvd

hvd.init()
r = hvd.rank()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device())
pair = hvd.add_process_set([0, 1])
SETS = [("world", hvd.global_process_set, list(range(hvd.size())))] + (
    [("pair", pair, [0, 1])] if r < 2 else [])


def data(rank, label, i, length, dtype):
    g = torch.Generator().manual_seed(7919 * rank + 31 * i + length + len(label))
    return torch.randint(-8, 9, (length,), generator=g).to(dtype)


def reduce_on(label, process_set, ranks, failures):
    """Sizes on the small path, the ring and more than one 4 MiB staging piece."""
    torch.cuda.set_device(device)
    try:
        for i in range(5):
            for dtype in (torch.float32, torch.int32, torch.bfloat16):
                for length in (777, 1_300_007):
                    got = hvd.allreduce(data(r, label, i, length, dtype).to(device), op=hvd.Sum,
                                        name=f"{label}.{i}.{dtype}.{length}",
                                        process_set=process_set)
                    want = torch.stack([data(k, label, i, length, dtype) for k in ranks]).sum(0)
                    if not torch.equal(got.cpu(), want.to(dtype)):
                        failures.append(f"{label} {i} {dtype} {length}: {got[:4]} != {want[:4]}")
    except BaseException as exc:
        failures.append(f"{label}: {exc!r}")


failures = []
threads = [threading.Thread(target=reduce_on, args=(*s, failures)) for s in SETS]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not failures, "\n".join(failures)
hvd.remove_process_set(pair)
hvd.shutdown()
print(f"OK rank {r}", flush=True)
