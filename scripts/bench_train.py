"""Training throughput: ringreduce, DDP over ringreduce and over gloo, one MPI Allreduce, none.

Run it under MPI, one process per rank, e.g.

    mpiexec -n 2 python scripts/bench_train.py
    mpiexec -n 2 python scripts/bench_train.py --models mlp10m --steps 3 --reps 1 --warmup 1 \\
        --json out.json --plot out.png      # --plot needs `pip install -e .[bench]`

Options: --models (mlp,cnn,mlp10m; default mlp,cnn), --methods (default below), --steps per
repetition (20), --warmup steps (12: DistributedOptimizer's bucket schedule, RINGREDUCE_BUCKET_
SCHEDULE=auto, is chosen within them), --reps (3), --batch per rank (32), --lr (0.01),
--json FILE, --plot FILE.png.

Synthetic data: each rank trains on its own fixed pool of random batches (seeded by rank), with
SGD (momentum 0.9) on cross-entropy, one torch thread per rank (torch.set_num_threads(1)).
Every method starts from the same seeded model and sees the same batches.

Models (float32):
    mlp       3*64*64 -> 1580 -> 1580 -> 1000, ReLU: about 23.5M parameters
    mlp10m    3*64*64 -> 714 -> 714 -> 1000, ReLU: about 10.0M parameters
    cnn       ResNet-18 (BasicBlock, BatchNorm, written here: no torchvision) on 3x64x64 images,
              1000 classes: about 11.7M parameters

Methods (default order, by expected peak memory, the order of the memory pass):
    none             plain optimizer, no gradient communication: each rank trains alone (ceiling)
    ringreduce_view  hvd.DistributedOptimizer(..., gradient_as_bucket_view=True): grads are
                     views of the bucket buffers (no pack/unpack copies)
    ringreduce       hvd.DistributedOptimizer: buckets are reduced while backward runs
    allreduce_after  after backward: concatenate all grads into one flat buffer, one
                     comm.Allreduce (mpi4py, in place, NumPy views), divide by size, copy back
    ddp_rr           torch.nn.parallel.DistributedDataParallel on torch.distributed's default
                     group, on the "ringreduce" backend (ringreduce.distributed): DDP's buckets
                     reduced by our transport. DDP copies every gradient into its buckets
                     (scaled by 1/size) and, after the reduction, back: two passes over the
                     gradients that DistributedOptimizer skips for a parameter with a bucket of
                     its own (reduced in place), e.g. the mlp's 74 MiB first layer
    ddp_rr_view      the same with DDP's gradient_as_bucket_view=True: DDP makes the gradients
                     views of its buckets after the first step, so the copy back goes; the
                     copy in stays, since zero_grad() (set_to_none) hands autograd a fresh
                     gradient each step, which DDP scales into its bucket
    ddp              torch.nn.parallel.DistributedDataParallel on a gloo group of every rank
                     (loopback TCP; without bench_common.cores_awake, which made gloo's small
                     messages quicker but DDP on gloo no faster, the cnn slower)
                     (defaults: 25 MB buckets, broadcast_buffers=True, which for the cnn also
                     broadcasts the BatchNorm buffers from rank 0 at each forward)

Two passes per model. Memory: one method at a time alone in the process, built and run for
its --warmup steps (at least one), then freed. Speed: every method built and run for --warmup
steps, then --reps rounds in which each method in turn runs --steps steps, so that a slow
spell of the machine (this VM has them, lasting seconds to minutes) lands on every method
rather than on one method's repetitions. Each repetition starts after an MPI barrier and its
time is the largest over the ranks. A step is zero_grad, forward, backward, optimizer step
(which waits for the reduction).

Columns:
    samples/s   ranks * batch * steps / time, median over the repetitions (the whole job)
    x none      samples/s / samples/s of none: the fraction of the no-communication ceiling
    x ddp       samples/s / samples/s of ddp (>1: faster than DDP over gloo)
    x rr        samples/s / samples/s of ringreduce (DistributedOptimizer)
    step(ms)    time of one step (1000 * time / steps, the same median repetition)
    cpu         CPU time of the training thread per step (ms; time.thread_time, averaged over
                every repetition, the largest over the ranks): the method's own work on that
                thread, e.g. DDP's copies into and out of its buckets, without the waits
    xfer, wait  per step (averaged likewise), the time ringreduce's node transport spent
                moving and reducing bytes in large allreduces (its copy_in, reduce, publish and
                copy_out phases, native/node.c) and waiting there for a peer's part (wait_in,
                wait_out), in ms, the largest over the ranks; "n/a" where ringreduce does not
                carry the gradients (none, allreduce_after, ddp) or the ranks share no node
                window
    sync        whether all ranks hold the same parameters afterwards (checksums of the
                parameters agree to 1e-6 relative; "-" for none, whose ranks diverge)
    peakRSS     peak resident memory of the rank (MiB) while the method ran (memory pass),
                largest over the ranks: before each method the kernel's peak counter is reset
                to the current RSS (write "5" to /proc/self/clear_refs, Linux >= 4.0) and VmHWM
                of /proc/self/status is read after its steps. Where the reset is refused,
                it is getrusage(RUSAGE_SELF).ru_maxrss instead, which is cumulative over the
                process (it never goes down): the row then says "(cumulative)", and the
                default method order, by increasing expected memory, keeps it readable.
    +peak       peakRSS minus the rank's RSS when the method started (before its model was
                built), largest over the ranks: what the method's model, gradients, momentum,
                buffers and activations added. The first method also pays one-time costs of
                the process (torch's first forward and backward), so compare the others.
The header of each model gives its parameter count and gradient size (MiB = 2**20 bytes):
a copy of the gradients, e.g. unfused .grad tensors next to bucket buffers, costs that much.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringreduce as hvd  # before mpi4py.MPI, so MPI starts with the thread level ringreduce needs

hvd.init()
from mpi4py import MPI  # noqa: E402

from bench_common import (init_torch_distributed, metadata as common_metadata,  # noqa: E402
                          write_results)
from ringreduce.optim import schedule  # noqa: E402
from ringreduce.sets.process_sets import global_set  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, NRANKS = COMM.rank, COMM.size
METHODS = ["none", "ringreduce_view", "ringreduce", "allreduce_after", "ddp_rr_view", "ddp_rr",
           "ddp"]
ON_RINGREDUCE = {"ringreduce_view", "ringreduce", "ddp_rr_view", "ddp_rr"}
WORK_PHASES, WAIT_PHASES = ("copy_in", "reduce", "publish", "copy_out"), ("wait_in", "wait_out")
GLOO = None     # torch.distributed's gloo group of every rank (bench_common.init_torch_distributed)
MODELS = ["mlp", "cnn", "mlp10m"]
IMAGE = (3, 64, 64)
CLASSES = 1000
MiB = float(1 << 20)
# Warm-up steps, enough for DistributedOptimizer's bucket schedule to be chosen (auto) before
# the steps that count, as it is after the first few steps of a real run
WARM_UP = schedule.WARM_UP_STEPS + schedule.TRIAL_STEPS + 2


# ---------------------------------------------------------------------------- models

def mlp(hidden: int) -> nn.Module:
    width = IMAGE[0] * IMAGE[1] * IMAGE[2]
    return nn.Sequential(nn.Flatten(), nn.Linear(width, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


def resnet18() -> nn.Module:
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


BUILD = {"mlp": lambda: mlp(1580), "mlp10m": lambda: mlp(714), "cnn": resnet18}


# ---------------------------------------------------------------------------- methods

def setup(method: str, model: nn.Module, lr: float):
    """(module to call, optimizer, hook run between backward and step) for one method."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if method == "none":
        return model, sgd, None
    if method in ("ringreduce", "ringreduce_view"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       gradient_as_bucket_view=method == "ringreduce_view")
        return model, opt, None
    if method in ("ddp_rr", "ddp_rr_view"):
        return nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=method == "ddp_rr_view"), sgd, None
    if method == "ddp":
        return nn.parallel.DistributedDataParallel(model, process_group=GLOO), sgd, None
    if method == "allreduce_after":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        params = [p for p in model.parameters() if p.requires_grad]
        flat = torch.empty(sum(p.numel() for p in params))
        views, offset = [], 0
        for p in params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        array = flat.numpy()

        def reduce_grads() -> None:
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            COMM.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            flat.div_(NRANKS)
            for p, v in zip(params, views):
                p.grad.copy_(v)

        return model, sgd, reduce_grads
    raise ValueError(method)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) of this process to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM") in MiB; NaN where absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / MiB
    except OSError:
        pass
    return float("nan")


def release_memory() -> None:
    """Free the last method's model and optimizer and hand the freed heap back to the OS
    (glibc malloc_trim), so that the next method starts from a clean RSS."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass   # not glibc


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB   # KiB on Linux


class Trainer:
    """One method on a fresh copy of the seeded model: `step(i)` trains on batch i."""

    def __init__(self, name: str, method: str, batches, lr: float) -> None:
        torch.manual_seed(0)
        self.method, self.batches = method, batches
        self.model = BUILD[name]()
        self.model.train()
        self.module, self.opt, self.between = setup(method, self.model, lr)

    def step(self, i: int) -> None:
        x, y = self.batches[i % len(self.batches)]
        self.opt.zero_grad()
        F.cross_entropy(self.module(x), y).backward()
        if self.between is not None:
            self.between()
        self.opt.step()

    def in_sync(self) -> bool:
        checksum = sum(p.detach().double().sum().item() for p in self.model.parameters())
        sums = COMM.allgather(checksum)
        return max(sums) - min(sums) <= 1e-6 * max(1.0, max(abs(s) for s in sums))


def measure_memory(name: str, method: str, batches, args) -> dict:
    """The memory pass: the method alone in the process, built and run for its warm-up."""
    cumulative = not reset_peak_rss()
    start_rss = status_mib("VmRSS")
    trainer = Trainer(name, method, batches, args.lr)
    for i in range(max(1, args.warmup)):
        trainer.step(i)
    peak = maxrss_mib() if cumulative else status_mib("VmHWM")
    del trainer
    release_memory()
    return {
        "peak_rss_mib_per_rank": COMM.allgather(peak),
        "start_rss_mib_per_rank": COMM.allgather(start_rss),
        "peak_rss_increase_mib_per_rank": COMM.allgather(peak - start_rss),
        "peak_rss_cumulative": any(COMM.allgather(cumulative)),
    }


def node_phases() -> dict[str, float] | None:
    """Seconds ringreduce's node window spent in each phase of large allreduces since the
    last call (native/node.c; it resets them), or None without a window."""
    node = global_set("bench_train").transport.node
    return None if node is None else node.profile(reset=True)


def per_step_ms(totals: dict[str, float], steps: int) -> dict[str, float]:
    """The largest over the ranks of each total (seconds), per step, in ms."""
    return {k: 1000 * COMM.allreduce(v, op=MPI.MAX) / steps for k, v in totals.items()}


def schedule_of(trainer: Trainer) -> dict:
    """A DistributedOptimizer's bucket schedule (optim/schedule.py): the one it took, and the
    median step time of each schedule's trials where it measured them (RINGREDUCE_BUCKET_
    SCHEDULE=auto, within the warm-up)."""
    schedule = getattr(trainer.opt, "_schedule", None)
    if schedule is None:
        return {}
    taking = "inline" if schedule.inline else "overlap"
    return {"schedule": schedule.chosen or f"{taking} (still choosing)",
            "schedule_trials_ms": {k: 1000 * v for k, v in schedule.measured().items()}}


def measure_speed(name: str, methods: list[str], batches, args) -> list[dict]:
    """The timing pass: every method built and warmed up, then their repetitions take turns,
    so that a slow spell of the machine lands on all of them, not on one method's reps. Also
    where each step's time went: the training thread's CPU and the node transport's phases,
    summed over the repetitions."""
    trainers = [Trainer(name, method, batches, args.lr) for method in methods]
    for trainer in trainers:
        for i in range(args.warmup):
            trainer.step(i)
    times: dict[str, list[float]] = {m: [] for m in methods}
    spent = {m: {"cpu": 0.0, "xfer": 0.0, "wait": 0.0} for m in methods}
    for _ in range(args.reps):
        for trainer in trainers:
            COMM.Barrier()
            node_phases()
            cpu = time.thread_time()
            start = time.perf_counter()
            for i in range(args.steps):
                trainer.step(i)
            elapsed = time.perf_counter() - start
            spent[trainer.method]["cpu"] += time.thread_time() - cpu
            phases = node_phases() or {}
            spent[trainer.method]["xfer"] += sum(phases.get(k, 0.0) for k in WORK_PHASES)
            spent[trainer.method]["wait"] += sum(phases.get(k, 0.0) for k in WAIT_PHASES)
            times[trainer.method].append(COMM.allreduce(elapsed, op=MPI.MAX))
    rows = []
    has_window = node_phases() is not None
    for trainer in trainers:
        seconds = statistics.median(times[trainer.method])
        per_step = per_step_ms(spent[trainer.method], args.reps * args.steps)
        transported = has_window and trainer.method in ON_RINGREDUCE
        rows.append({
            "model": name, "method": trainer.method, "time_s": seconds,
            "rep_times_s": times[trainer.method],
            "samples_per_s": NRANKS * args.batch * args.steps / seconds,
            "step_ms": 1000 * seconds / args.steps,
            "params_in_sync": None if trainer.method == "none" else trainer.in_sync(),
            "train_thread_cpu_ms_per_step": per_step["cpu"],
            "transport_ms_per_step": per_step["xfer"] if transported else None,
            "transport_wait_ms_per_step": per_step["wait"] if transported else None,
            **schedule_of(trainer),
        })
    del trainers
    release_memory()
    return rows


# ---------------------------------------------------------------------------- output

def metadata(args) -> dict:
    return common_metadata(batch_per_rank=args.batch, steps=args.steps, warmup=args.warmup,
                         reps=args.reps, lr=args.lr, optimizer="SGD(momentum=0.9)")


def fmt(value, spec: str, width: int) -> str:
    return f"{'n/a' if value is None else format(value, spec):>{width}}"


HEADER = (f"{'method':>16} {'samples/s':>10} {'x none':>7} {'x ddp':>7} {'x rr':>6} "
          f"{'step(ms)':>9} {'cpu':>6} {'xfer':>5} {'wait':>5} "
          f"{'sync':>5} {'peakRSS':>8} {'+peak':>7}")


def row(r: dict) -> str:
    sync = {None: "-", True: "yes", False: "NO"}[r["params_in_sync"]]
    return (f"{r['method']:>16} {r['samples_per_s']:>10.1f} {fmt(r['vs_none'], '.3f', 7)} "
            f"{fmt(r['vs_ddp'], '.3f', 7)} {fmt(r['vs_ringreduce'], '.3f', 6)} "
            f"{r['step_ms']:>9.1f} {r['train_thread_cpu_ms_per_step']:>6.1f} "
            f"{fmt(r['transport_ms_per_step'], '.1f', 5)} "
            f"{fmt(r['transport_wait_ms_per_step'], '.1f', 5)} {sync:>5} "
            f"{max(r['peak_rss_mib_per_rank']):>8.0f} "
            f"{max(r['peak_rss_increase_mib_per_rank']):>7.0f}"
            f"{' (cumulative)' if r['peak_rss_cumulative'] else ''}")


def plot(path: str, results: list[dict], models: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = [r for r in results if r["model"] == m["model"]]
        bars = ax.bar([r["method"] for r in rows], [r["samples_per_s"] for r in rows],
                      color=[f"C{METHODS.index(r['method'])}" for r in rows])
        ax.bar_label(bars, labels=[f"{r['samples_per_s']:.0f}" for r in rows], fontsize="small")
        ax.set_title(f"{m['model']} ({m['params'] / 1e6:.1f}M params)")
        ax.set_ylabel("samples/s (whole job)")
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    ranks = f"{meta['ranks']} rank{'s' * (meta['ranks'] != 1)}"
    fig.suptitle(f"training throughput: {ranks} x batch {meta['batch_per_rank']}"
                 f"\n1 torch thread/rank, {meta['hostname']}, {meta['date'][:10]}",
                 fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    global GLOO
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=WARM_UP)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    models, methods = args.models.split(","), args.methods.split(",")
    if unknown := set(models) - set(MODELS):
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {MODELS}")
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown method(s) {sorted(unknown)}; choose from {METHODS}")
    if args.steps < 1 or args.reps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--steps, --reps and --batch must be >= 1, --warmup >= 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    torch.set_num_threads(1)
    if {"ddp", "ddp_rr", "ddp_rr_view"} & set(methods):
        GLOO = init_torch_distributed()

    meta = metadata(args)
    if RANK == 0:
        ranks = f"{NRANKS} rank{'s' * (NRANKS != 1)}"
        print(f"training benchmark: {ranks} on {', '.join(meta['hosts'])}, "
              f"{meta['mpi_library'].splitlines()[0]}, torch {meta['torch']} "
              f"(1 thread/rank), batch {args.batch}/rank, {args.reps} reps x {args.steps} steps "
              f"after {args.warmup} warm-up, {meta['date']}", flush=True)

    results, model_info = [], []
    for name in models:
        torch.manual_seed(1000 + RANK)   # each rank its own data, the same for every method
        batches = [(torch.randn(args.batch, *IMAGE), torch.randint(0, CLASSES, (args.batch,)))
                   for _ in range(4)]
        torch.manual_seed(0)
        params = sum(p.numel() for p in BUILD[name]().parameters())
        info = {"model": name, "params": params, "grad_mib": params * 4 / MiB}
        model_info.append(info)
        if RANK == 0:
            print(f"\n{name}: {params:,} parameters, gradients {info['grad_mib']:.1f} MiB "
                  "(float32)")
            print(HEADER, flush=True)
        memory = [measure_memory(name, method, batches, args) for method in methods]
        rows = [{**r, **m} for r, m in zip(measure_speed(name, methods, batches, args), memory)]
        base = {r["method"]: r["samples_per_s"] for r in rows}
        for r in rows:
            r["vs_none"] = r["samples_per_s"] / base["none"] if "none" in base else None
            r["vs_ddp"] = r["samples_per_s"] / base["ddp"] if "ddp" in base else None
            r["vs_ringreduce"] = (r["samples_per_s"] / base["ringreduce"]
                                  if "ringreduce" in base else None)
            if RANK == 0:
                print(row(r), flush=True)
        if RANK == 0:
            for r in rows:
                if "schedule" in r:
                    trials = ", ".join(f"{k} {v:.1f} ms" for k, v in
                                       r["schedule_trials_ms"].items())
                    print(f"  {r['method']}: bucket schedule {r['schedule']}"
                          + (f" (trial steps' medians: {trials})" if trials else ""))
        results += rows

    if RANK == 0:
        write_results({"meta": meta, "models": model_info, "results": results}, args.json,
                      args.plot, lambda png: plot(png, results, model_info, meta))
    if {"ddp", "ddp_rr", "ddp_rr_view"} & set(methods):
        import torch.distributed as dist

        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
