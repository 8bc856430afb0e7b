"""The GPU node way's figures, on one node (scripts/gpu_check.sh runs it at 2 and 4 ranks, the
ranks sharing the machine's GPUs: one GPU for all of them on a one-GPU machine).

1. Allreduce busbw (bytes * 2(n-1)/n per second, the best of a few) of 1, 16, 64 and 256 MiB,
   float32 and bfloat16: the GPU node way (RINGREDUCE_GPU_NODE_WAY=ipc), the staging path
   (=staging, MPI without CUDA support), and torch.distributed on gloo with the same CUDA
   tensors; beside the yardstick, the GPU's device-to-device copy of the same size (bytes
   copied per second, one rank copying alone; also every rank at once, what each then gets).
   Each result is checked: every element equals the number of ranks.
2. 4 KiB float32 allreduce latency (median) on the node way and on staging.
3. Training a small CNN on CUDA tensors: samples per second with DistributedOptimizer and with
   DDP on the ringreduce backend, each on the node way and on staging, and with no
   communication at all (the ceiling).
Prints a table; `--json FILE` writes it with the run's metadata (docs/figures/, rendered by
scripts/docs_figures.py). Correctness of every dtype and op, and training against one
process, are scripts/gpu_check.py's.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as hvd
from bench_common import init_torch_distributed, metadata

SIZES_MIB = [1, 16, 64, 256]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WAYS = {"ipc": {"cuda_aware": False, "gpu_node_way": "ipc"},
        "staging": {"cuda_aware": False, "gpu_node_way": "staging"}}
world = MPI.COMM_WORLD


def best_seconds(fn, repeats):
    """The best of `repeats` calls (after one to warm up), each after a barrier."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        world.Barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return world.allreduce(best, op=MPI.MAX)


def busbw(nbytes, seconds):
    n = world.size
    return nbytes * 2 * (n - 1) / n / seconds / 1e9


def repeats(mib):
    return 5 if mib < 256 else 3


def exact(t, what):
    """Every element of an allreduce of ones is the number of ranks."""
    if not bool((t == world.size).all()):
        raise AssertionError(f"{what}: wrong result on rank {world.rank}")


def busbw_rows(device, name, allreduce):
    """`allreduce(t)` (a Sum of t in place) timed at every size, for every dtype: one row of
    busbw per dtype, named `name dtype`, each result checked."""
    rows = {}
    for dtype_name, dtype in DTYPES.items():
        row = []
        for mib in SIZES_MIB:
            t = torch.ones((mib << 20) // dtype.itemsize, dtype=dtype, device=device)

            def once():
                t.fill_(1)
                allreduce(t)

            row.append(busbw(mib << 20, best_seconds(once, repeats(mib))))
            exact(t, f"{name} {dtype_name} {mib} MiB")
        rows[f"{name} {dtype_name}"] = row
    return rows


def ours(device):
    """Busbw and 4 KiB latency on each of our ways."""
    table, latency = {}, {}
    for way, settings in WAYS.items():
        hvd.init(**settings)
        table.update(busbw_rows(device, way, lambda t: hvd.allreduce_(t, op=hvd.Sum)))
        small = torch.ones(1024, device=device)
        times = []
        for _ in range(220):
            world.Barrier()
            start = time.perf_counter()
            hvd.allreduce_(small, op=hvd.Max)
            times.append(time.perf_counter() - start)
        latency[way] = statistics.median(times[20:]) * 1e6
        hvd.shutdown()
    return table, latency


def gloo(device):
    """torch.distributed's gloo with the same CUDA tensors."""
    hvd.init()
    group = init_torch_distributed(gloo=True)
    table = busbw_rows(device, "gloo", lambda t: dist.all_reduce(t, group=group))
    dist.destroy_process_group()
    hvd.shutdown()
    return table


def device_copy(device):
    """Device-to-device copy of each size: bytes copied per second by one rank alone, and by
    each rank while every rank copies."""
    alone, together = [], []
    for mib in SIZES_MIB:
        src = torch.ones(mib << 18, device=device)
        dst = torch.empty_like(src)

        def copy():
            for _ in range(5):
                dst.copy_(src)

        seconds = best_seconds(copy if world.rank == 0 else (lambda: None), 3)
        alone.append(5 * (mib << 20) / seconds / 1e9)
        together.append(5 * (mib << 20) / best_seconds(copy, 3) / 1e9)
    return alone, together


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 512),
                                        torch.nn.ReLU(), torch.nn.Linear(512, 10))

    def forward(self, x):
        return self.head(self.features(x))


def samples_per_second(device, method, steps=30, batch=64):
    """Training steps of `Net` on this rank's batches; samples per second, all ranks."""
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if method == "DistributedOptimizer":
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
    elif method == "DDP":
        model = DDP(model, device_ids=[device.index])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(5):
        step()
    world.Barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return steps * batch * world.size / seconds


def training(device):
    rates = {"no communication": samples_per_second(device, "alone")}
    for way, settings in WAYS.items():
        hvd.init(**settings)
        rates[f"DistributedOptimizer, {way}"] = samples_per_second(device,
                                                                   "DistributedOptimizer")
        hvd.shutdown()
    for way in WAYS:
        hvd.init(**WAYS[way])
        init_torch_distributed(gloo=False)
        rates[f"DDP on ringreduce, {way}"] = samples_per_second(device, "DDP")
        dist.destroy_process_group()
        hvd.shutdown()
    return rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the figures here (rank 0)")
    args = parser.parse_args()
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    torch.cuda.set_device(local.rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    table, latency = ours(device)
    table.update(gloo(device))
    alone, together = device_copy(device)
    rates = training(device)
    run = metadata(world, gpu=torch.cuda.get_device_name(), torch_cuda=torch.version.cuda,
                   gpus_visible=torch.cuda.device_count())
    if world.rank != 0:
        return
    print(f"\n{world.size} ranks, {torch.cuda.device_count()} GPU(s) visible "
          f"({torch.cuda.get_device_name()}); busbw in GB/s, the copy in bytes copied/s")
    columns = {**table, "device copy": alone, "copy, every rank": together}
    print(f"{'size':>8}" + "".join(f"{name:>19}" for name in columns))
    for i, mib in enumerate(SIZES_MIB):
        print(f"{str(mib) + ' MiB':>8}" + "".join(f"{c[i]:19.2f}" for c in columns.values()))
    ratios = {name: [b / c for b, c in zip(row, alone)] for name, row in table.items()}
    print("x the device copy: " + "; ".join(f"{name} {r[2]:.3f} (64 MiB), {r[3]:.3f} "
                                            "(256 MiB)" for name, r in ratios.items()))
    print("4 KiB latency (us): " + ", ".join(f"{k} {v:.1f}" for k, v in latency.items()))
    print("training (samples/s): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run, "sizes_mib": SIZES_MIB, "busbw_GBps": table,
                       "device_copy_GBps": alone, "device_copy_every_rank_GBps": together,
                       "ratio_to_device_copy": ratios, "latency_4KiB_us": latency,
                       "training_samples_per_s": rates}, f, indent=2)


if __name__ == "__main__":
    main()
