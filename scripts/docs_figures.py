"""The Performance page's tables, and the README's headline figures, generated from the
benchmarks' JSON files in docs/figures/.

    python scripts/docs_figures.py            # write docs/figures/NAME.md for each NAME.json,
                                              # and the README's figures block
    python scripts/docs_figures.py --check    # exit 1 if anything it writes is missing or stale
    python scripts/docs_figures.py --dir /tmp/figs   # another folder (the README is left alone)

Each JSON file is one benchmark run, checked in as the benchmark wrote it (`--json`); this
script turns it into markdown that docs/performance.md includes with pymdownx.snippets: the
whole file (`--8<-- "figures/NAME.md"`) or one section of it (`--8<-- "figures/NAME.md:dist"`).
Every table says which run it is from (a "Run:" line: date, machine, ranks, MPI, torch,
ringreduce, commit, environment, command line, as far as the file records them) and names its
yardstick.

Recognised files, by their shape:
    scripts/bench_allreduce.py --json   {"meta", "copies", "results", "profiles"}: section
        `tables`, one table per dtype (latency below 1 MiB, busbw from 1 MiB, against the copy
        yardstick) and one per --profile entry; section `dist`, torch.distributed's all_reduce
        on the "ringreduce" backend (`dist_rr`) beside gloo, MPI and our own calls
    scripts/bench_train.py --json       {"meta", "models", "results"}: section `tables`,
        samples/s per model and method against no communication and DDP on gloo, step time and
        peak RSS; section `dist`, DDP on the "ringreduce" backend (`ddp_rr`) beside DDP on gloo
        and DistributedOptimizer, and where their steps' time goes (training thread's CPU,
        transport moving and waiting)
    scripts/bench_kernels.py --json     {"meta", "kernels": [{"kernel", "implementation",
        "gbps"}]} (older files: the bare list): GB/s per kernel
    scripts/cost_model.py --json        {"machine", "rows"}: predicted times at 2-1,024 nodes
    scripts/bench_p2p.py --json         {"meta", "p2p"}: torch.distributed's send/recv on the
        "ringreduce" backend, one way per size, beside MPI's Send/Recv and gloo
    scripts/gpu_check.py --json         {"meta", "sizes_mib", "busbw_GBps",
        "staging_yardsticks_GBps", "device_copy_GBps"}: allreduce busbw per GPU path (staging,
        CUDA-aware), the staging path against its yardsticks (host allreduce, pinned copy
        down and up; older files lack them) and a CUDA-aware one against the GPU's own copy
    scripts/cost_model.py --gpu --json  {"gpu_machine", "rows", "limits"}: our GPU node way
        against NCCL's ring, 1-1,024 nodes of 8 GPUs, and where our time goes
    scripts/gpu_node_bench.py --json    {"meta", "sizes_mib", "busbw_GBps", "device_copy_GBps",
        "latency_4KiB_us", "training_samples_per_s", ...}: the GPU node way, staging and gloo
        against the device's copy of each size; 4 KiB latency; training samples/s
The README's block between `<!-- figures:start -->` and `<!-- figures:end -->` is made from
allreduce-2ranks.json and train-2ranks.json. To refresh a figure, rerun its benchmark with
`--json docs/figures/NAME.json` and then this script; performance.md names the command of each.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
README = ROOT / "README.md"
README_START, README_END = "<!-- figures:start -->", "<!-- figures:end -->"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
LATENCY_BELOW = MIB          # allreduce sizes below this are shown as latency, the rest as busbw

ALLREDUCE_METHODS = {
    "ours_": "ringreduce `allreduce_` (in place)",
    "ours": "ringreduce `allreduce` (new output tensor)",
    "bucket": "ringreduce, asynchronous (`allreduce_async_` + `synchronize`)",
    "dist_rr": "torch.distributed `all_reduce` on the `\"ringreduce\"` backend (`dist_rr`)",
    "dist_sync": "the same, synchronous: `dist.all_reduce(t)` (`dist_sync`)",
    "set_": "ringreduce `allreduce_` on a 2-rank process set inside the job",
    "mpi": "MPI `Allreduce`",
    "mpi_x": "MPI `Allreduce` between nodes only (`mpi_x`)",
    "gloo": "torch.distributed `all_reduce` on gloo",
}
# The rows of the torch.distributed section: the backend, what it runs on (our asynchronous
# path, as DDP's buckets take it, and the synchronous one), and the yardsticks.
DIST_ALLREDUCE_METHODS = ("dist_rr", "dist_sync", "bucket", "ours_", "mpi", "gloo")
TRAIN_METHODS = {
    "none": "no communication (ceiling)",
    "ringreduce": "ringreduce `DistributedOptimizer`",
    "ringreduce_view": "ringreduce, bucket views",
    "allreduce_after": "one MPI `Allreduce` after backward",
    "ddp_rr": "DDP on `\"ringreduce\"`",
    "ddp_rr_view": "DDP on `\"ringreduce\"`, bucket views",
    "ddp": "DDP on gloo",
}
TRAIN_MODELS = {"mlp": "MLP", "cnn": "ResNet-18-sized CNN", "mlp10m": "MLP"}
PHASES = {
    "copy_in": "the half of the input the peer reduces → our staging area",
    "wait_in": "until the peer's area is full",
    "reduce": "our half of the input + the peer's staged half → output",
    "publish": "our reduced half → our area",
    "wait_out": "until the peer's half is reduced",
    "copy_out": "the peer's reduced half → output",
}
COST_SIZES = (4 * KIB, MIB, 64 * MIB, GIB)
COST_NODES = (2, 16, 128, 1024)
YARDSTICK = ("Yardstick: the fastest single-thread copy of the same size (glibc's `memcpy` or "
             "our streaming copy) running on every rank at once, measured in the same run; "
             "`× copy` is busbw divided by its bandwidth. Latencies are compared with MPI's "
             "`Allreduce` time (`× MPI`: below 1, ours is faster).")


# ---------------------------------------------------------------------------- formatting

def size_label(nbytes: int) -> str:
    for suffix, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {suffix}"
    return f"{nbytes} B"


def num(value: float, digits: int = 3) -> str:
    """`digits` significant figures, without a trailing exponent for everyday magnitudes."""
    if value == 0:
        return "0"
    magnitude = len(str(int(abs(value)))) if abs(value) >= 1 else 0
    decimals = max(0, digits - magnitude)
    return f"{value:,.{decimals}f}"


def microseconds(seconds: float) -> str:
    return f"{num(seconds * 1e6)} µs"


def duration(seconds: float) -> str:
    if seconds < 1e-3:
        return microseconds(seconds)
    if seconds < 1:
        return f"{num(seconds * 1e3)} ms"
    return f"{num(seconds)} s"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def section(name: str, body: str) -> str:
    """`body` as a pymdownx.snippets section, for `--8<-- "figures/NAME.md:name"`."""
    return f"<!-- --8<-- [start:{name}] -->\n{body.rstrip()}\n<!-- --8<-- [end:{name}] -->\n"


def machine(meta: dict) -> str:
    """The hosts, with their CPU model and count as far as the file records them."""
    hosts = meta.get("host_cpus") or [meta]
    described = []
    for h in hosts:
        name = h.get("hostname") or ", ".join(meta.get("hosts") or ["?"])
        cpus = []
        if h.get("cpu_count"):
            cpus.append(f"{h['cpu_count']} CPUs")
        if h.get("cpu_model"):
            cpus.append(h["cpu_model"])
        if h.get("cpus_usable") and h["cpus_usable"] != h.get("cpu_count"):
            cpus.append(f"{h['cpus_usable']} usable")
        described.append(f"`{name}`" + (f" ({', '.join(cpus)})" if cpus else ""))
    return ", ".join(described)


def commit(meta: dict, name_files: int = 3) -> str:
    """The commit, and whether tracked files differed from it (naming up to `name_files`)."""
    if not meta.get("commit"):
        return "commit not recorded"
    text = f"commit `{meta['commit'][:12]}`"
    files = meta.get("dirty_files") or []
    documents_only = (files and meta.get("dirty_count", len(files)) == len(files)
                      and all(f.startswith("docs/") or f == "README.md" for f in files))
    if meta.get("dirty") and not documents_only:    # (a figure written by the run before)
        named = ", ".join(f"`{f}`" for f in files[:name_files])
        more = meta.get("dirty_count", len(files)) - min(name_files, len(files))
        text += " with uncommitted changes"
        if named:
            text += f" to {named}" + (f" and {more} more file{'s' * (more != 1)}"
                                      if more > 0 else "")
    return text


def mpi_name(meta: dict) -> str:
    """The MPI library the run used, in a few words ("" when not recorded)."""
    if meta.get("mpi_vendor"):
        return meta["mpi_vendor"]
    library = meta.get("mpi_library")
    return " ".join(library.splitlines()[0].split()) if library else ""


def provenance(meta: dict | None, source: str) -> str:
    """One line naming the run: what the file records of date, machine, ranks, versions,
    commit, environment and command line."""
    if not meta:
        return (f"Run: `{source}` records no metadata (no date, machine, versions, commit or "
                "command line).")
    parts = []
    if meta.get("date"):
        parts.append(meta["date"].replace("T", " "))
    parts.append(f"on {machine(meta)}")
    if meta.get("ranks"):
        parts.append(f"{meta['ranks']} rank{'s' * (meta['ranks'] != 1)}")
    if mpi_name(meta):
        parts.append(mpi_name(meta))
    if meta.get("torch"):
        threads = meta.get("torch_num_threads")
        parts.append(f"torch {meta['torch']}" + (f" ({threads} thread{'s' * (threads != 1)})"
                                                  if threads else ""))
    if meta.get("python"):
        parts.append(f"Python {meta['python']}")
    if meta.get("ringreduce"):
        parts.append(f"ringreduce {meta['ringreduce']}")
    parts.append(commit(meta))
    if "environment" not in meta:
        parts.append("environment not recorded")
    elif meta["environment"]:
        parts.append("with " + " ".join(f"`{k}={v}`"
                                        for k, v in sorted(meta["environment"].items())))
    else:
        parts.append("no thread or `RINGREDUCE_*` variables set")
    line = "Run: " + ", ".join(parts) + f". Data: `{source}`."
    if meta.get("argv"):
        line += f" Command: `{' '.join(str(a) for a in meta['argv'])}`."
    return line


# ---------------------------------------------------------------------------- allreduce

def fastest_copy(copies: list, nbytes: int, where: str) -> dict | None:
    rows = [c for c in copies if c["size_bytes"] == nbytes and c["where"] == where
            and c["copy"] in ("memcpy", "stream")]
    return max(rows, key=lambda c: c["bw_GBps"]) if rows else None


def allreduce_cell(r: dict | None, nbytes: int) -> str:
    if r is None or r["time_s"] in (None, 0):
        return "n/a"
    if nbytes < LATENCY_BELOW:
        speedup = r.get("speedup_vs_mpi")
        return microseconds(r["time_s"]) + (f" ({num(1 / speedup, 2)} × MPI)" if speedup else "")
    ratio = r.get("busbw_over_copy")
    return f"{num(r['busbw_GBps'])} GB/s" + (f" ({num(ratio, 2)} × copy)" if ratio else "")


def column(nbytes: int) -> str:
    return f"{size_label(nbytes)} " + ("latency" if nbytes < LATENCY_BELOW else "busbw")


def allreduce_title(meta: dict, results: list, dtype: str) -> str:
    ranks = meta.get("ranks")
    spans = " across nodes" if any(r["method"] == "mpi_x" for r in results) else ""
    return f"allreduce, {ranks} ranks{spans}, {dtype}" if ranks else f"allreduce{spans}, {dtype}"


def allreduce_tables(data: dict, source: str) -> str:
    meta, results, copies = data["meta"], data["results"], data["copies"]
    sizes = sorted({r["size_bytes"] for r in results})
    out = [provenance(meta, source), "", YARDSTICK, ""]
    for dtype in sorted({r["dtype"] for r in results}, key=lambda d: d != "float32"):
        rows = []
        for where, label in (("every rank", "fastest copy, every rank at once (yardstick)"),
                             ("rank 0", "fastest copy, rank 0 alone")):
            cells = []
            for nbytes in sizes:
                c = fastest_copy(copies, nbytes, where)
                cells.append("" if nbytes < LATENCY_BELOW or c is None
                             else f"{num(c['bw_GBps'])} GB/s ({c['copy']})")
            if any(cells):
                rows.append([label] + cells)
        by_key = {(r["method"], r["size_bytes"]): r for r in results if r["dtype"] == dtype}
        for method, label in ALLREDUCE_METHODS.items():
            cells = [allreduce_cell(by_key.get((method, nbytes)), nbytes) for nbytes in sizes]
            if any(c != "n/a" for c in cells):
                rows.append([label] + cells)
        title = allreduce_title(meta, results, dtype)
        out += [f"**{title}**", "", table([title] + [column(s) for s in sizes], rows), ""]

    profiles = sorted(data.get("profiles") or [], key=lambda p: (p["dtype"], p["size_bytes"]))
    for dtype in dict.fromkeys(p["dtype"] for p in profiles):
        chosen = [p for p in profiles if p["dtype"] == dtype]
        phases = list(dict.fromkeys(k for p in chosen for k in p["phases"]))
        rows = []
        for phase in phases:
            cells = []
            for p in chosen:
                v = p["phases"].get(phase)
                if v is None:
                    cells.append("")
                    continue
                cell = f"{duration(v['time_s'])}, {v['time_s'] / p['time_s']:.0%}"
                if v.get("bytes_touched"):
                    cell += f", {num(v['bytes_touched'] / v['time_s'] / 1e9)} GB/s"
                cells.append(cell)
            rows.append([f"{phase.replace('_', ' ')}: {PHASES.get(phase, '')}"] + cells)
        rows.append(["whole call"] + [duration(p["time_s"]) for p in chosen])
        if all("blocks_written" in p for p in chosen):
            rows.append(["blocks staged with non-temporal stores (of all)"] +
                        [f"{p['blocks_written']['streamed']} of "
                         f"{sum(p['blocks_written'].values())}" for p in chosen])
        title = f"where the time goes, {dtype} in place, rank 0 (--profile)"
        out += [f"**{title}**: per phase, its time, share of the call and rate over the bytes "
                "it reads and writes", "",
                table([title] + [size_label(p["size_bytes"]) for p in chosen], rows), ""]
    return "\n".join(out)


def without_rows(out: list, rows: str, otherwise: str) -> str:
    """A section whose run lacks the rows it shows (`rows`, what they are): why, and how to
    fill it."""
    return "\n".join(out + [f"*This run has no {rows}: it was made before the benchmark had "
                             f"them, or {otherwise}. Rerun the command above to fill this "
                             "table.*", ""])


def allreduce_dist(data: dict, source: str) -> str:
    """torch.distributed's all_reduce on our backend beside gloo, MPI and our own calls, with
    how much faster than gloo each is (gloo's time / its time)."""
    meta, results = data["meta"], data["results"]
    out = [provenance(meta, source), ""]
    if not any(r["method"] == "dist_rr" for r in results):
        return without_rows(out, "`dist_rr` rows (torch.distributed's `all_reduce` on the "
                            "`\"ringreduce\"` backend)", "with `--no-dist`")
    out += ["Yardsticks: torch.distributed's own CPU backend, gloo, and MPI's `Allreduce`, in "
            "the same run; `× faster than gloo` is gloo's time divided by the row's, `× MPI` the "
            "row's time divided by MPI's. The asynchronous row is the same call without "
            "torch.", ""]
    sizes = sorted({r["size_bytes"] for r in results if r["method"] == "dist_rr"})
    for dtype in sorted({r["dtype"] for r in results if r["method"] == "dist_rr"},
                        key=lambda d: d != "float32"):
        by_key = {(r["method"], r["size_bytes"]): r for r in results if r["dtype"] == dtype}
        rows = []
        for method in DIST_ALLREDUCE_METHODS:
            cells = []
            for nbytes in sizes:
                r = by_key.get((method, nbytes))
                cell = allreduce_cell(r, nbytes)
                gloo = by_key.get(("gloo", nbytes))
                if (method != "gloo" and cell != "n/a" and gloo is not None
                        and gloo.get("time_s")):
                    cell += f", {num(gloo['time_s'] / r['time_s'], 2)} × faster than gloo"
                cells.append(cell)
            if any(c != "n/a" for c in cells):
                rows.append([ALLREDUCE_METHODS[method]] + cells)
        title = f"torch.distributed {allreduce_title(meta, results, dtype)}"
        out += [f"**{title}**", "", table([title] + [column(s) for s in sizes], rows), ""]
    return "\n".join(out)


def allreduce(data: dict, source: str) -> str:
    return (section("tables", allreduce_tables(data, source)) + "\n"
            + section("dist", allreduce_dist(data, source)))


# ---------------------------------------------------------------------------- training

def model_label(name: str, info: dict) -> str:
    return f"{TRAIN_MODELS.get(name, name)} {info['params'] / 1e6:.1f}M (`{name}`)"


def train_tables(data: dict, source: str) -> str:
    meta, results = data["meta"], data["results"]
    models = {m["model"]: m for m in data["models"]}
    methods = [m for m in TRAIN_METHODS if any(r["method"] == m for r in results)]
    batch = meta.get("batch_per_rank")
    rows = []
    for name, info in models.items():
        by_method = {r["method"]: r for r in results if r["model"] == name}
        cells = []
        for method in methods:
            r = by_method.get(method)
            if r is None:
                cells.append("")
                continue
            notes = []
            if method != "none" and r.get("vs_none") is not None:
                notes.append(f"{r['vs_none']:.2f} × none")
            if method not in ("ddp", "none") and r.get("vs_ddp") is not None:
                notes.append(f"{r['vs_ddp']:.2f} × DDP gloo")
            if r.get("params_in_sync") is False:
                notes.append("ranks NOT in sync")
            cells.append(f"{r['samples_per_s']:.0f}" + (f" ({'; '.join(notes)})" if notes else ""))
        rows.append([f"{model_label(name, info)}, samples/s"] + cells)
    memory = []
    for name, info in models.items():
        by_method = {r["method"]: r for r in results if r["model"] == name}
        cells = []
        for method in methods:
            r = by_method.get(method)
            cells.append("" if r is None else
                         f"{r['step_ms']:.0f} ms, "
                         f"+{max(r['peak_rss_increase_mib_per_rank']):.0f} MiB"
                         + (" (cumulative)" if r.get("peak_rss_cumulative") else ""))
        memory.append([f"{TRAIN_MODELS.get(name, name)} (`{name}`, gradients "
                       f"{info['grad_mib']:.1f} MiB): step time, peak RSS increase per rank"]
                      + cells)
    title = (f"training, {meta.get('ranks')} ranks, batch {batch}/rank" if batch
             else f"training, {meta.get('ranks')} ranks")
    header = [title] + [TRAIN_METHODS[m] for m in methods]
    yardstick = ("Yardsticks: the same ranks training with no communication (the ceiling; "
                 "`× none`) and DDP on gloo (`× DDP gloo`), in the same run; above 1 against "
                 "DDP: faster.")
    return "\n".join([provenance(meta, source), "", yardstick, "", f"**{title}**", "",
                      table(header, rows + memory), ""] + schedules(results, models))


def schedules(results: list, models: dict) -> list[str]:
    """Where each DistributedOptimizer reduced its buckets (optim/schedule.py), as it chose
    within its warm-up, with its trial steps' medians; nothing for a file without them."""
    lines = []
    for r in results:
        if "schedule" not in r:
            continue
        trials = ", ".join(f"{k} {v:.0f} ms" for k, v in r.get("schedule_trials_ms", {}).items())
        lines.append(f"- {TRAIN_MODELS.get(r['model'], r['model'])}, {TRAIN_METHODS[r['method']]}:"
                     f" buckets reduced `{r['schedule']}`"
                     + (f" (its trial steps' medians: {trials})" if trials else ""))
    return (["Bucket schedules (`RINGREDUCE_BUCKET_SCHEDULE=auto`):", ""] + lines + [""]
            if lines else [])


def view_ratio(speed: dict) -> str:
    """DDP with gradient_as_bucket_view on our backend ÷ DistributedOptimizer."""
    if speed.get("ddp_rr_view") and speed.get("ringreduce"):
        return f"{speed['ddp_rr_view'] / speed['ringreduce']:.2f} ×"
    return "n/a"


def train_dist(data: dict, source: str) -> str:
    """DDP on our backend beside DDP on gloo and DistributedOptimizer, samples/s."""
    meta, results = data["meta"], data["results"]
    out = [provenance(meta, source), ""]
    if not any(r["method"] == "ddp_rr" for r in results):
        return without_rows(out, "`ddp_rr` rows (DDP on the `\"ringreduce\"` backend)",
                            "without that method in `--methods`")
    out += ["Yardsticks: DDP on gloo, torch's own CPU backend, and ringreduce's "
            "`DistributedOptimizer`, in the same run (samples/s of the whole job; ratios above "
            "1: DDP on `\"ringreduce\"` is faster).", ""]
    rows = []
    views = any(r["method"] == "ddp_rr_view" for r in results)
    for info in data["models"]:
        name = info["model"]
        speed = {r["method"]: r["samples_per_s"] for r in results if r["model"] == name}
        if "ddp_rr" not in speed:
            continue

        def cell(method: str) -> str:
            return f"{speed[method]:.0f}" if method in speed else "n/a"

        def ratio(method: str) -> str:
            return f"{speed['ddp_rr'] / speed[method]:.2f} ×" if speed.get(method) else "n/a"

        rows.append([model_label(name, info), cell("ringreduce"), cell("ddp_rr"), cell("ddp"),
                     ratio("ddp"), ratio("ringreduce")]
                    + ([cell("ddp_rr_view"), view_ratio(speed)] if views else []))
    title = f"DDP, {meta.get('ranks')} ranks, samples/s"
    header = [title, TRAIN_METHODS["ringreduce"], TRAIN_METHODS["ddp_rr"], TRAIN_METHODS["ddp"],
              "DDP `\"ringreduce\"` ÷ DDP gloo", "DDP `\"ringreduce\"` ÷ `DistributedOptimizer`"]
    if views:
        header += [TRAIN_METHODS["ddp_rr_view"],
                   "DDP `\"ringreduce\"`, bucket views ÷ `DistributedOptimizer`"]
    return "\n".join(out + [f"**{title}**", "", table(header, rows), ""] + train_spent(data))


def train_spent(data: dict) -> list[str]:
    """Where a step's time went, per method on our transport and DDP on gloo: the training
    thread's CPU, and the node transport's moving and waiting (lines; none for a file made
    before bench_train.py recorded them)."""
    results = [r for r in data["results"] if "train_thread_cpu_ms_per_step" in r]
    methods = [m for m in ("ringreduce", "ddp_rr", "ddp_rr_view", "ddp")
               if any(r["method"] == m for r in results)]
    if not methods:
        return []

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    rows = []
    for info in data["models"]:
        by_method = {r["method"]: r for r in results if r["model"] == info["model"]}
        for method in methods:
            r = by_method.get(method)
            if r is not None:
                rows.append([f"{model_label(info['model'], info)}: {TRAIN_METHODS[method]}",
                             ms(r["step_ms"]), ms(r["train_thread_cpu_ms_per_step"]),
                             ms(r["transport_ms_per_step"]),
                             ms(r["transport_wait_ms_per_step"])])
    title = "where a step's time goes, ms per step (largest over the ranks)"
    header = [title, "step", "training thread's CPU", "transport moving bytes",
              "transport waiting for a peer"]
    return [f"**{title}**", "", table(header, rows), ""]


def train(data: dict, source: str) -> str:
    return (section("tables", train_tables(data, source)) + "\n"
            + section("dist", train_dist(data, source)))


# ---------------------------------------------------------------------------- the others

def kernels(data, source: str) -> str:
    meta, rows_in = (None, data) if isinstance(data, list) else (data.get("meta"),
                                                                 data["kernels"])
    kernel_names = list(dict.fromkeys(r["kernel"] for r in rows_in))
    rows = []
    for k in kernel_names:
        cells = [f"{r['implementation']}: {num(r['gbps'])}" for r in rows_in if r["kernel"] == k]
        rows.append([k, "; ".join(cells)])
    yardstick = ("Yardsticks: NumPy and torch running the same operation on the same inputs "
                 "(for sum+average, torch's one-pass `lerp(a, b, 0.5)`); `ours` is our C "
                 "kernels, `native/kernels.c`.")
    return "\n".join([provenance(meta, source), "", yardstick, "",
                      "**native kernels, GB/s (one thread)**", "",
                      table(["kernel", "GB/s by implementation"], rows), ""])


def cost_model(data: dict, source: str) -> str:
    m = data["machine"]
    algorithms = [k for k in data["rows"][0] if k not in ("nodes", "size_bytes")]
    rows = []
    for r in sorted(data["rows"], key=lambda r: (r["size_bytes"], r["nodes"])):
        if r["nodes"] not in COST_NODES or r["size_bytes"] not in COST_SIZES:
            continue
        best = min(algorithms, key=lambda a: r[a])
        rows.append([size_label(r["size_bytes"]), str(r["nodes"])]
                    + [f"**{duration(r[a])}**" if a == best else duration(r[a])
                       for a in algorithms])
    model = (f"Model (not a measurement): {m['ranks_per_node']} ranks per node, "
             f"{m['link_gbps']:g} Gb/s links, {m['latency_us']:g} µs per message, node busbw "
             f"{m['node_gbs']:g} GB/s, node small allreduce {m['node_small_us']:g} µs, "
             f"{m['overhead_us']:g} µs of Python per call, blocks of "
             f"{size_label(m['block_bytes'])}, small-message switch "
             f"{size_label(m['small_bytes'])}. Yardsticks: a flat ring over every rank and a "
             f"binomial tree between nodes, under the same model. Data: `{source}`.")
    title = f"predicted allreduce time, blocks of {size_label(m['block_bytes'])}"
    return "\n".join([model, "", f"**{title}** (fastest in bold)", "",
                      table(["size per rank", "nodes"] + algorithms, rows), ""])


def gpu(data: dict, source: str) -> str:
    """One GPU shared by the ranks (scripts/gpu_check.py): busbw per path and size, each
    against its yardstick in the same run. The staging path moves every byte down to pinned
    host memory, reduces it there between the ranks and moves it back up, so its yardstick is
    the slower of the host allreduce and the pinned copy down and up at that size; a
    CUDA-aware path's is the GPU's device-to-device copy (and the staging path's too in a file
    made before the run measured the other two)."""
    meta, copy, busbw = data.get("meta") or {}, data["device_copy_GBps"], data["busbw_GBps"]
    yardsticks = data.get("staging_yardsticks_GBps") or {}
    host, pinned = yardsticks.get("host allreduce"), yardsticks.get("pinned down+up")

    def cell(path: str, i: int) -> str:
        value = busbw[path][i]
        if path == "staging" and host and pinned:
            return f"{num(value)} GB/s ({value / min(host[i], pinned[i]):.2g} × yardstick)"
        return f"{num(value)} GB/s ({value / copy:.2g} × copy)"

    rows = [[f"{mib} MiB"] + [cell(p, i) for p in busbw]
            + [f"{num(column[i])} GB/s" for column in yardsticks.values()]
            for i, mib in enumerate(data["sizes_mib"])]
    yardstick = (f"Yardstick: the GPU's device-to-device copy of 256 MiB, {num(copy)} GB/s "
                 "(torch's `copy_`, a cudaMemcpy, timed with CUDA events), on "
                 f"{meta.get('gpu', 'the GPU')}; CUDA-aware MPI: "
                 f"{meta.get('cuda_aware', 'not recorded')}.")
    if host and pinned:
        yardstick += (" The staging path's yardstick is the slower of two measured in the same "
                      "run at each size, every rank at once: the host allreduce (the same "
                      "call on CPU tensors, busbw) and the pinned copy down and back up "
                      "(cudaMemcpyAsync on one stream, as staging queues them; bytes per "
                      "second down and up). Staging can beat the host allreduce of a large "
                      "buffer: it reduces the buffer in 4 MiB pieces, which stay in cache, "
                      "where the host allreduce streams it all through memory.")
    title = f"allreduce busbw, {meta.get('ranks', '?')} ranks on one GPU"
    return "\n".join([provenance(meta, source), "", yardstick, "", f"**{title}**", "",
                      table(["size"] + [f"{p} busbw" for p in busbw] + list(yardsticks), rows),
                      ""])


def gpu_cost_model(data: dict, source: str) -> str:
    """cost_model.py --gpu: our GPU node way against NCCL's ring, time and busbw per cell."""
    g = data["gpu_machine"]
    ways = [k for k in data["rows"][0] if k not in ("nodes", "size_bytes")]
    per_node = g["gpus_per_node"]

    def cell(r: dict, way: str) -> str:
        p = r["nodes"] * per_node
        busbw = 2 * (p - 1) / p * r["size_bytes"] / r[way] / 1e9
        text = duration(r[way]) + (f", {num(busbw)} GB/s" if r["size_bytes"] >= MIB else "")
        return f"**{text}**" if r[way] == min(r[w] for w in ways) else text

    rows = [[size_label(r["size_bytes"]), str(r["nodes"])] + [cell(r, w) for w in ways]
            + [f"{r['NCCL ring'] / r['ours, CUDA-aware']:.2f}"]
            for r in sorted(data["rows"], key=lambda r: (r["size_bytes"], r["nodes"]))
            if r["nodes"] in (1,) + COST_NODES]
    limits = [f"{size_label(r['size_bytes'])} on {r['nodes']} node(s): " + ", ".join(
        f"{k} {v / sum(x for k2, x in r.items() if k2 not in ('nodes', 'size_bytes')):.0%}"
        for k, v in r.items() if k not in ("nodes", "size_bytes"))
        for r in data.get("limits", []) if (r["nodes"], r["size_bytes"]) in
        ((1, 64 * MIB), (16, 64 * MIB), (1024, GIB), (1024, 4 * KIB))]
    model = (f"Model (not a measurement): {per_node} GPUs per node, NVLink "
             f"{g['nvlink_gbs']:g} GB/s per direction of which our kernels reach "
             f"{g['peer_share']:g} (assumed), device copy {g['copy_gbs']:g} GB/s, "
             f"{g['phase_us']:g} µs per phase (assumed), {g['launch_us']:g} µs per kernel "
             f"launch, {g['overhead_us']:g} µs per call (assumed), one {g['nic_gbps']:g} Gb/s "
             f"NIC per GPU with {g['latency_us']:g} µs per message, PCIe {g['pcie_gbs']:g} GB/s; "
             f"NCCL's ring: {g['nccl_node_busbw_gbs']:g} GB/s busbw in one node (published), "
             f"between nodes {g['nccl_share']:g} of its bound. Data: `{source}`.")
    return "\n".join([model, "", "**predicted GPU allreduce time and busbw** (fastest in "
                      "bold; last column: NCCL's time over ours, below 1 NCCL is faster)", "",
                      table(["size per GPU", "nodes"] + ways + ["NCCL / ours"], rows), "",
                      "Where our time goes:", ""] + [f"- {line}" for line in limits] + [""])


def gpu_node(data: dict, source: str) -> str:
    """scripts/gpu_node_bench.py: busbw of the GPU node way, staging and gloo per size, each
    against the device's own copy of that size (one rank alone) in the same run; the 4 KiB
    latency and training samples/s beside no communication."""
    meta, busbw, copy = data.get("meta") or {}, data["busbw_GBps"], data["device_copy_GBps"]
    rows = [[f"{mib} MiB"] + [f"{num(busbw[w][i])} GB/s ({busbw[w][i] / copy[i]:.2g} × copy)"
                              for w in busbw]
            + [f"{num(copy[i])} GB/s", f"{num(data['device_copy_every_rank_GBps'][i])} GB/s"]
            for i, mib in enumerate(data["sizes_mib"])]
    rates = data["training_samples_per_s"]
    alone = rates.get("no communication")
    training = [[k, f"{v:,.0f}", f"{v / alone:.2f}" if alone else ""] for k, v in rates.items()]
    title = f"GPU node way, {meta.get('ranks', '?')} ranks on {meta.get('gpu', 'one GPU')}"
    return "\n".join([
        provenance(meta, source), "",
        "Yardstick: the device-to-device copy of the same size (`cudaMemcpyAsync` through "
        "torch's `copy_`), bytes copied per second by one rank alone; beside it the same with "
        "every rank copying at once. Busbw is 2(n-1)/n x size / time.", "",
        f"**{title}: allreduce busbw**", "",
        table(["size"] + [f"{w} busbw" for w in busbw] + ["device copy", "copy, every rank"],
              rows), "",
        "4 KiB allreduce latency: " + ", ".join(
            f"{w} {microseconds(v * 1e-6)}" for w, v in data["latency_4KiB_us"].items()), "",
        "**training, samples/s** (× no communication)", "",
        table(["method", "samples/s", "× no communication"], training), ""])


# ---------------------------------------------------------------------------- send and recv

P2P_METHODS = {"dist_rr": "`dist.send` / `dist.recv` on `\"ringreduce\"`",
               "mpi": "MPI's `Send` / `Recv`", "gloo": "`dist.send` / `dist.recv` on gloo"}


def p2p(data: dict, source: str) -> str:
    """Point-to-point one-way times per size: ours beside MPI's and gloo's, with each ratio."""
    meta, results = data["meta"], data["p2p"]
    sizes = sorted({r["size_bytes"] for r in results})
    by_key = {(r["method"], r["size_bytes"]): r for r in results}
    rows = []
    for method, label in P2P_METHODS.items():
        cells = []
        for nbytes in sizes:
            r = by_key.get((method, nbytes))
            if r is None:
                cells.append("n/a")
                continue
            cell = f"{duration(r['time_s'])} ({num(r['GBps'])} GB/s)"
            if method == "dist_rr":
                ratios = [f"{num(r[key], 2)} × {name}" for key, name in
                          (("speedup_vs_mpi", "MPI"), ("speedup_vs_gloo", "gloo"))
                          if r.get(key)]
                cell += "; " + ", ".join(ratios) if ratios else ""
            cells.append(cell)
        if any(c != "n/a" for c in cells):
            rows.append([label] + cells)
    yardstick = ("Yardstick: MPI's own `Send`/`Recv` of the same bytes (NumPy arrays, mpi4py), "
                 "in the same run, beside gloo's; a time is one way, half a ping-pong's round "
                 "trip (the slowest pair's median). `× MPI` and `× gloo` are their times "
                 "divided by ours: below 1, the other is faster.")
    title = f"send/recv, one way, {meta['ranks']} ranks"
    return "\n".join([provenance(meta, source), "", yardstick, "", f"**{title}**", "",
                      table([title] + [size_label(n) for n in sizes], rows), ""])


def source_name(path: Path) -> str:
    """How a figure's page names its JSON file: from the repository root when it is ours."""
    return f"docs/figures/{path.name}" if path.resolve().parent == FIGURES else str(path)


def render(path: Path) -> str:
    data = json.loads(path.read_text())
    source = source_name(path)
    if isinstance(data, list) or "kernels" in data:
        body = kernels(data, source)
    elif "copies" in data:
        body = allreduce(data, source)
    elif "models" in data:
        body = train(data, source)
    elif "machine" in data and "rows" in data:
        body = cost_model(data, source)
    elif "gpu_machine" in data:
        body = gpu_cost_model(data, source)
    elif "latency_4KiB_us" in data:
        body = gpu_node(data, source)
    elif "busbw_GBps" in data:
        body = gpu(data, source)
    elif "p2p" in data:
        body = p2p(data, source)
    else:
        raise ValueError(f"{path}: not a benchmark file this script knows")
    return (f"<!-- generated by scripts/docs_figures.py from {path.name}: do not edit, "
            "rerun the script -->\n" + body)


# ---------------------------------------------------------------------------- the README

def short_run(meta: dict, source: str) -> str:
    """The run in a few words: file, date, machine, MPI and commit."""
    parts = [f"`{source}`"]
    if meta.get("date"):
        parts.append(meta["date"][:10])
    parts.append(machine(meta))
    if meta.get("ranks"):
        parts.append(f"{meta['ranks']} ranks")
    if mpi_name(meta):
        parts.append(mpi_name(meta))
    parts.append(commit(meta, name_files=0))
    return ", ".join(parts)


def headline(directory: Path) -> str:
    """The README's handful of figures, each with its yardstick, and the runs they are from."""
    lines, runs = [], []
    path = directory / "allreduce-2ranks.json"
    if path.exists():
        data = json.loads(path.read_text())
        meta, results = data["meta"], data["results"]
        runs.append(short_run(meta, source_name(path)))
        fp32 = {(r["method"], r["size_bytes"]): r for r in results if r["dtype"] == "float32"}
        sizes = sorted({n for m, n in fp32 if m == "ours_"})
        if sizes:
            big, small = sizes[-1], sizes[0]
            ours, mpi, gloo = (fp32.get((m, big)) for m in ("ours_", "mpi", "gloo"))
            copy = fastest_copy(data["copies"], big, "every rank")
            if big >= LATENCY_BELOW and ours and ours.get("busbw_GBps"):
                text = (f"- **Allreduce, {size_label(big)} float32 in place, {meta['ranks']} "
                        f"ranks on one machine:** {num(ours['busbw_GBps'])} GB/s busbw")
                if copy:
                    text += (f", {num(ours['busbw_GBps'] / copy['bw_GBps'], 2)} × the "
                             f"yardstick (the fastest single-thread copy of {size_label(big)} "
                             f"running on every rank at once: {num(copy['bw_GBps'])} GB/s)")
                others = [f"{label} {num(r['busbw_GBps'])} GB/s" for label, r in
                          (("MPI's own `Allreduce`", mpi), ("torch.distributed on gloo", gloo))
                          if r and r.get("busbw_GBps")]
                lines.append(text + ("; " + ", ".join(others) if others else "") + ".")
            ours_small, mpi_small = fp32.get(("ours_", small)), fp32.get(("mpi", small))
            if small < LATENCY_BELOW and ours_small and mpi_small:
                lines.append(f"- **Allreduce, {size_label(small)} float32:** "
                             f"{microseconds(ours_small['time_s'])} per call against MPI's "
                             f"`Allreduce` {microseconds(mpi_small['time_s'])} "
                             f"({num(ours_small['time_s'] / mpi_small['time_s'], 2)} × its "
                             "time), in the same run.")
            dist, dist_gloo = fp32.get(("dist_rr", big)), fp32.get(("gloo", big))
            if dist and dist.get("time_s"):
                def figure(r: dict) -> str:
                    return (f"{num(r['busbw_GBps'])} GB/s busbw" if big >= LATENCY_BELOW
                            else f"{microseconds(r['time_s'])} per call")

                text = (f"- **torch.distributed `all_reduce` on the `\"ringreduce\"` backend, "
                        f"{size_label(big)}:** {figure(dist)}")
                if copy and big >= LATENCY_BELOW:
                    text += (f", {num(dist['busbw_GBps'] / copy['bw_GBps'], 2)} × the same "
                             "yardstick")
                if dist_gloo and dist_gloo.get("time_s"):
                    text += (f"; gloo {figure(dist_gloo)}, so "
                             f"{num(dist_gloo['time_s'] / dist['time_s'], 2)} × as fast")
                lines.append(text + ".")
    path = directory / "train-2ranks.json"
    if path.exists():
        data = json.loads(path.read_text())
        meta, results = data["meta"], data["results"]
        runs.append(short_run(meta, source_name(path)))
        if data["models"]:
            info = data["models"][0]
            speed = {r["method"]: r["samples_per_s"] for r in results
                     if r["model"] == info["model"]}
            if "ringreduce" in speed:
                text = (f"- **Training** a {info['params'] / 1e6:.1f}M-parameter "
                        f"{TRAIN_MODELS.get(info['model'], info['model'])} on {meta['ranks']} "
                        f"ranks: {speed['ringreduce']:.0f} samples/s with "
                        "`DistributedOptimizer`")
                notes = []
                if speed.get("none"):
                    notes.append(f"{speed['ringreduce'] / speed['none']:.2f} × the ceiling "
                                 f"(the same ranks without communication: "
                                 f"{speed['none']:.0f})")
                if speed.get("ddp"):
                    notes.append(f"{speed['ringreduce'] / speed['ddp']:.2f} × DDP on gloo "
                                 f"({speed['ddp']:.0f})")
                lines.append(text + (", " + " and ".join(notes) if notes else "") + ".")
            if "ddp_rr" in speed and speed.get("ddp"):
                views = (f" ({speed['ddp_rr_view'] / speed['ringreduce']:.2f} × with DDP's "
                         "`gradient_as_bucket_view=True`)" if speed.get("ddp_rr_view") else "")
                against = ([f"{speed['ddp_rr'] / speed['ringreduce']:.2f} × "
                            f"`DistributedOptimizer`{views}"] if speed.get("ringreduce") else [])
                against.append(f"{speed['ddp_rr'] / speed['ddp']:.2f} × DDP on gloo")
                lines.append(f"- **DDP on the `\"ringreduce\"` backend**, same model: "
                             f"{speed['ddp_rr']:.0f} samples/s, {' and '.join(against)}.")
    if not lines:
        lines = ["- No benchmark results in `docs/figures/` yet."]
    if runs:
        lines += ["", "From " + "; ".join(runs) + "."]
    return "\n".join(lines).rstrip() + "\n"


def readme_with_headline(text: str, block: str) -> str:
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {README_START} ... {README_END} block")
    head = text[:start + len(README_START)]
    note = ("\n<!-- generated by scripts/docs_figures.py from docs/figures/: do not edit, "
            "rerun the script -->\n")
    return head + note + block + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated table is missing or stale")
    parser.add_argument("--dir", type=Path, default=FIGURES)
    parser.add_argument("--readme", type=Path, default=None,
                        help="the README whose figures block to write (default: README.md when "
                             "--dir is docs/figures, else none)")
    args = parser.parse_args(argv)
    readme = args.readme or (README if args.dir.resolve() == FIGURES else None)
    targets = {path.with_suffix(".md"): render(path) for path in sorted(args.dir.glob("*.json"))}
    if readme is not None:
        targets[readme] = readme_with_headline(readme.read_text(), headline(args.dir))
    stale = []
    for target, text in targets.items():
        current = target.read_text() if target.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(target)
        else:
            target.write_text(text)
            print(f"wrote {target}")
    orphans = [md for md in sorted(args.dir.glob("*.md"))
               if not md.with_suffix(".json").exists() and md != readme]
    if args.check and (stale or orphans):
        for t in stale:
            print(f"stale or missing: {t} (run python scripts/docs_figures.py)", file=sys.stderr)
        for t in orphans:
            print(f"no JSON for {t}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
