"""The Performance page's tables, generated from the benchmarks' JSON files in docs/figures/.

    python scripts/docs_figures.py            # write docs/figures/NAME.md for each NAME.json
    python scripts/docs_figures.py --check    # exit 1 if any NAME.md is missing or stale

Each JSON file is one benchmark run, checked in as the benchmark wrote it (`--json`); this
script turns it into a markdown table that docs/performance.md includes
(`--8<-- "figures/NAME.md"`, pymdownx.snippets). A table says which run it is from: the date,
host, CPU count, rank count, MPI library, torch, ringreduce version, commit (when the file
records one) and the command line, as far as the file carries them.

Recognised files, by their shape:
    scripts/bench_allreduce.py --json   {"meta", "copies", "results", "profiles"}: one table
        per dtype (latency below 1 MiB, busbw from 1 MiB, against the copy yardstick), and one
        per --profile entry (where the time of a large node allreduce goes)
    scripts/bench_train.py --json       {"meta", "models", "results"}: samples/s per model and
        method, against no communication and DDP, and peak RSS
    scripts/bench_kernels.py --json     [{"kernel", "implementation", "gbps"}]: GB/s per kernel
    scripts/cost_model.py --json        {"machine", "rows"}: predicted times at 2-1,024 nodes
To refresh a figure, rerun its benchmark with `--json docs/figures/NAME.json` and then this
script; performance.md names the command of each.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
LATENCY_BELOW = MIB          # allreduce sizes below this are shown as latency, the rest as busbw

ALLREDUCE_METHODS = {
    "ours_": "ringreduce `allreduce_` (in place)",
    "ours": "ringreduce `allreduce` (new output tensor)",
    "bucket": "ringreduce, optimizer bucket (`allreduce_async_` on the engine thread)",
    "set_": "ringreduce `allreduce_` on a 2-rank process set inside the job",
    "mpi": "MPI `Allreduce`",
    "mpi_x": "MPI `Allreduce` between nodes only (`mpi_x`)",
    "gloo": "torch.distributed gloo",
}
TRAIN_METHODS = {
    "none": "no communication (ceiling)",
    "ringreduce": "ringreduce",
    "ringreduce_view": "ringreduce, bucket views",
    "allreduce_after": "one MPI `Allreduce` after backward",
    "ddp": "DDP gloo",
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


# ---------------------------------------------------------------------------- formatting

def size_label(nbytes: int) -> str:
    for suffix, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {suffix}"
    return f"{nbytes} B"


def num(value: float, digits: int = 3) -> str:
    """`digits` significant figures, without a trailing exponent for everyday magnitudes."""
    if value is None:
        return "n/a"
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


def provenance(meta: dict | None, source: str) -> str:
    """One line naming the run: what the file records of date, machine, ranks and versions."""
    if not meta:
        return (f"Run: `{source}` records no metadata (no date, machine, versions or "
                "command line).")
    parts = []
    if meta.get("date"):
        parts.append(meta["date"].replace("T", " "))
    where = ", ".join(meta.get("hosts") or [meta.get("hostname", "?")])
    if meta.get("cpu_count"):
        where += f" ({meta['cpu_count']} CPUs)"
    parts.append(f"on `{where}`")
    if meta.get("ranks"):
        parts.append(f"{meta['ranks']} rank{'s' * (meta['ranks'] != 1)}")
    if meta.get("mpi_library"):
        parts.append(" ".join(meta["mpi_library"].splitlines()[0].split()))
    if meta.get("torch"):
        threads = meta.get("torch_num_threads")
        parts.append(f"torch {meta['torch']}" + (f" ({threads} thread{'s' * (threads != 1)})"
                                                  if threads else ""))
    if meta.get("python"):
        parts.append(f"Python {meta['python']}")
    if meta.get("ringreduce"):
        parts.append(f"ringreduce {meta['ringreduce']}")
    parts.append(f"commit `{meta['commit'][:12]}`" if meta.get("commit")
                 else "commit not recorded")
    environment = {k: v for k, v in (meta.get("environment") or {}).items()
                   if k.startswith(("RINGREDUCE_", "HOROVOD_"))}
    if environment:
        parts.append("with " + " ".join(f"`{k}={v}`" for k, v in sorted(environment.items())))
    line = "Run: " + ", ".join(parts) + f". Data: `{source}`."
    if meta.get("argv"):
        line += f" Command: `{' '.join(str(a) for a in meta['argv'])}`."
    return line


# ---------------------------------------------------------------------------- one kind each

def allreduce(data: dict, source: str) -> str:
    meta, results, copies = data["meta"], data["results"], data["copies"]
    sizes = sorted({r["size_bytes"] for r in results})
    out = [provenance(meta, source), ""]
    ranks = meta.get("ranks")

    def fastest(nbytes: int, where: str) -> dict | None:
        rows = [c for c in copies if c["size_bytes"] == nbytes and c["where"] == where
                and c["copy"] in ("memcpy", "stream")]
        return max(rows, key=lambda c: c["bw_GBps"]) if rows else None

    def column(nbytes: int) -> str:
        return f"{size_label(nbytes)} " + ("latency" if nbytes < LATENCY_BELOW else "busbw")

    for dtype in sorted({r["dtype"] for r in results}, key=lambda d: d != "float32"):
        rows = []
        for where, label in (("every rank", "fastest copy, every rank at once (yardstick)"),
                             ("rank 0", "fastest copy, rank 0 alone")):
            cells = []
            for nbytes in sizes:
                c = fastest(nbytes, where)
                cells.append("" if nbytes < LATENCY_BELOW or c is None
                             else f"{num(c['bw_GBps'])} GB/s ({c['copy']})")
            if any(cells):
                rows.append([label] + cells)
        by_key = {(r["method"], r["size_bytes"]): r for r in results if r["dtype"] == dtype}
        for method, label in ALLREDUCE_METHODS.items():
            cells = []
            for nbytes in sizes:
                r = by_key.get((method, nbytes))
                if r is None or r["time_s"] in (None, 0):
                    cells.append("n/a")
                elif nbytes < LATENCY_BELOW:
                    speedup = r.get("speedup_vs_mpi")
                    cells.append(microseconds(r["time_s"])
                                 + (f" ({num(1 / speedup, 2)} × MPI)" if speedup else ""))
                else:
                    ratio = r.get("busbw_over_copy")
                    cells.append(f"{num(r['busbw_GBps'])} GB/s"
                                 + (f" ({num(ratio, 2)} × copy)" if ratio else ""))
            if any(c != "n/a" for c in cells):
                rows.append([label] + cells)
        spans = " across nodes" if any(r["method"] == "mpi_x" for r in results) else ""
        title = (f"allreduce, {ranks} ranks{spans}, {dtype}" if ranks
                 else f"allreduce{spans}, {dtype}")
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
        title = f"where the time goes, {dtype} in place, rank 0 (--profile)"
        out += [f"**{title}**: per phase, its time, share of the call and rate over the bytes "
                "it reads and writes", "",
                table([title] + [size_label(p["size_bytes"]) for p in chosen], rows), ""]
    return "\n".join(out)


def train(data: dict, source: str) -> str:
    meta, results = data["meta"], data["results"]
    models = {m["model"]: m for m in data["models"]}
    methods = [m for m in TRAIN_METHODS if any(r["method"] == m for r in results)]
    batch = meta.get("batch_per_rank")
    rows = []
    for name, info in models.items():
        label = (f"{TRAIN_MODELS.get(name, name)} {info['params'] / 1e6:.1f}M "
                 f"(`{name}`), samples/s")
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
                notes.append(f"{r['vs_ddp']:.2f} × DDP")
            if r.get("params_in_sync") is False:
                notes.append("ranks NOT in sync")
            cells.append(f"{r['samples_per_s']:.0f}" + (f" ({'; '.join(notes)})" if notes else ""))
        rows.append([label] + cells)
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
    return "\n".join([provenance(meta, source), "", f"**{title}**", "",
                      table(header, rows + memory), ""])


def kernels(data: list, source: str) -> str:
    kernel_names = list(dict.fromkeys(r["kernel"] for r in data))
    rows = []
    for k in kernel_names:
        cells = [f"{r['implementation']}: {num(r['gbps'])}" for r in data if r["kernel"] == k]
        rows.append([k, "; ".join(cells)])
    return "\n".join([provenance(None, source), "", "**native kernels, GB/s (one thread)**", "",
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
             f"{size_label(m['small_bytes'])}. Data: `{source}`.")
    title = f"predicted allreduce time, blocks of {size_label(m['block_bytes'])}"
    return "\n".join([model, "", f"**{title}** (fastest in bold)", "",
                      table(["size per rank", "nodes"] + algorithms, rows), ""])


def render(path: Path) -> str:
    data = json.loads(path.read_text())
    source = f"docs/figures/{path.name}"
    if isinstance(data, list):
        body = kernels(data, source)
    elif "copies" in data:
        body = allreduce(data, source)
    elif "models" in data:
        body = train(data, source)
    elif "machine" in data and "rows" in data:
        body = cost_model(data, source)
    else:
        raise ValueError(f"{path}: not a benchmark file this script knows")
    return (f"<!-- generated by scripts/docs_figures.py from {path.name}: do not edit, "
            "rerun the script -->\n" + body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated table is missing or stale")
    parser.add_argument("--dir", type=Path, default=FIGURES)
    args = parser.parse_args(argv)
    stale = []
    for path in sorted(args.dir.glob("*.json")):
        target = path.with_suffix(".md")
        text = render(path)
        current = target.read_text() if target.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(target)
        else:
            target.write_text(text)
            print(f"wrote {target}")
    orphans = [md for md in sorted(args.dir.glob("*.md")) if not md.with_suffix(".json").exists()]
    if args.check and (stale or orphans):
        for t in stale:
            print(f"stale or missing: {t} (run python scripts/docs_figures.py)", file=sys.stderr)
        for t in orphans:
            print(f"no JSON for {t}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
