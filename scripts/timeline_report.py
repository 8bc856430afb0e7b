"""Summarise ringreduce timelines: how much of each rank's communication overlapped backward.

    RINGREDUCE_TIMELINE=trace.json mpiexec -n 2 python train.py
    python scripts/timeline_report.py 'trace.rank*.json' --png timeline.png

Reads the per-rank files (paths or globs), draws one row per rank with a bar per phase of each
collective ("waiting for gradients", pack, negotiate, allreduce, unpack, ...) on a shared time
axis, the backward window of every step shaded, and prints per rank and step how much of the
allreduce time fell inside backward.

Definitions. A step starts at each "pack" of bucket.0 (the first bucket submitted). A bucket's
events of a step are its pack, the "waiting for gradients" span and "gradients ready" instant just
before that pack, and the first allreduce after it. Backward of a step runs from its earliest
"waiting for gradients" start (its first gradient hook) to its last "gradients ready". Overlap =
allreduce time inside that window / all allreduce time of the step.
"""
from __future__ import annotations

import argparse
import glob
import json
from bisect import bisect_left, bisect_right
from collections import defaultdict
from pathlib import Path

COLORS = {"waiting for gradients": "#d9d9d9", "pack": "#4c72b0", "negotiate": "#dd8452",
          "allreduce": "#c44e52", "reduce-scatter": "#8c1d20", "allgather": "#e89a9c",
          "unpack": "#55a868"}
NESTED = {"reduce-scatter", "allgather"}   # drawn thinner, inside their allreduce bar


def load(path: str) -> list[dict]:
    """A timeline's events; a file cut short by a kill keeps its complete events (one a line)."""
    text = Path(path).read_text()
    try:
        return json.loads(text)["traceEvents"]
    except json.JSONDecodeError:
        events = []
        for line in text.splitlines()[1:]:
            try:
                events.append(json.loads(line.rstrip(",")))
            except json.JSONDecodeError:
                pass
        return events


def phases(events: list[dict]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(collective, phase) -> sorted (start, end) in ms; instants have start == end."""
    out = defaultdict(list)
    for e in events:
        if e.get("ph") in ("X", "i"):
            start = e["ts"] / 1e3
            out[e["cat"], e["name"]].append((start, start + e.get("dur", 0) / 1e3))
    for spans in out.values():
        spans.sort()
    return out


def _last_before(spans, after: float, until: float, key=1):
    """The latest span whose start (key=0) or end (key=1) lies in (after, until]."""
    found = [s for s in spans if after < s[key] <= until]
    return found[-1] if found else None


def steps(ph: dict) -> list[dict]:
    """Per step: its backward window and each bucket's allreduce span (see the module doc)."""
    buckets = sorted({c for c, _ in ph if c.startswith("bucket.")}, key=lambda c: int(c[7:]))
    bounds = [s for s, _ in ph.get(("bucket.0", "pack"), [])] + [float("inf")]
    out = []
    for k in range(len(bounds) - 1):
        step = {"start": bounds[k], "allreduce": {}, "waiting": [], "ready": []}
        for b in buckets:
            packs = ph.get((b, "pack"), [])
            i = bisect_left(packs, (bounds[k],))
            if i == len(packs) or packs[i][0] >= bounds[k + 1]:
                continue
            pack, previous = packs[i][0], packs[i - 1][0] if i else float("-inf")
            for name, key in (("waiting", "waiting for gradients"), ("ready", "gradients ready")):
                span = _last_before(ph.get((b, key), []), previous, pack)
                if span:
                    step[name].append(span)
            reduces = ph.get((b, "allreduce"), [])
            j = bisect_right(reduces, (pack,))
            if j < len(reduces) and reduces[j][0] < bounds[k + 1]:
                step["allreduce"][b] = reduces[j]
        if step["waiting"]:
            end = max(s[1] for s in step["ready"] or step["waiting"])
            step["backward"] = (min(s[0] for s in step["waiting"]), end)
        out.append(step)
    return out


def overlap(span, window) -> float:
    return max(0.0, min(span[1], window[1]) - max(span[0], window[0]))


def summary(rank: str, rank_steps: list[dict]) -> list[str]:
    lines, total, inside = [], 0.0, 0.0
    for k, step in enumerate(rank_steps):
        if "backward" not in step or not step["allreduce"]:
            continue
        bw = step["backward"]
        per = {b: (overlap(s, bw), s[1] - s[0]) for b, s in step["allreduce"].items()}
        comm = sum(d for _, d in per.values())
        hid = sum(o for o, _ in per.values())
        total, inside = total + comm, inside + hid
        detail = ", ".join(f"{b} {100 * o / d if d else 0:.0f}%" for b, (o, d) in per.items())
        lines.append(f"{rank} step {k}: backward {bw[1] - bw[0]:.2f} ms, allreduce {comm:.2f} ms, "
                     f"{100 * hid / comm if comm else 0:.0f}% overlapped backward ({detail})")
    if total:
        lines.append(f"{rank} all steps: {100 * inside / total:.0f}% of {total:.2f} ms of "
                     "allreduce time overlapped backward")
    return lines


def plot(ranks: dict[str, dict], all_steps: dict[str, list[dict]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.patches import Patch

    t0 = min(s for ph in ranks.values() for spans in ph.values() for s, _ in spans)
    seen = {}
    fig, axes = plt.subplots(len(ranks), 1, sharex=True, squeeze=False,
                             figsize=(12, 1.2 + 1.6 * len(ranks)))
    for ax, (rank, ph) in zip(axes[:, 0], ranks.items()):
        lanes = sorted({c for c, _ in ph}, key=lambda c: (not c.startswith("bucket."),
                                                          int(c[7:]) if c[7:].isdigit() else 0, c))
        for (collective, phase), spans in ph.items():
            bars = [(s - t0, e - s) for s, e in spans if e > s]
            if bars:
                thin = phase in NESTED
                y = lanes.index(collective) + (0.2 if thin else 0)
                color = seen[phase] = COLORS.get(phase, "#8172b3")
                ax.broken_barh(bars, (y - 0.4, 0.4 if thin else 0.8), color=color)
        for step in all_steps[rank]:
            if "backward" in step:
                ax.axvspan(step["backward"][0] - t0, step["backward"][1] - t0,
                           color="#fff2b3", zorder=0)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_ylabel(rank)
    axes[0, 0].legend(handles=[Patch(color=c, label=p) for p, c in seen.items()], fontsize=7,
                      ncol=max(1, len(seen)), loc="lower left", bbox_to_anchor=(0, 1))
    axes[-1, 0].set_xlabel("ms (shaded: backward of each step)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="per-rank timeline files or globs")
    parser.add_argument("--png", default="timeline.png", help="where to draw (default %(default)s)")
    args = parser.parse_args()
    paths = sorted({p for pattern in args.files for p in (glob.glob(pattern) or [pattern])})
    ranks = {}
    for path in paths:
        events = load(path)
        name = next((e["args"]["name"] for e in events if e.get("name") == "process_name"), path)
        ranks[name] = phases(events)
    ranks = dict(sorted(ranks.items(), key=lambda kv: (len(kv[0]), kv[0])))  # rank 2 < rank 10
    all_steps = {rank: steps(ph) for rank, ph in ranks.items()}
    for rank, rank_steps in all_steps.items():
        print("\n".join(summary(rank, rank_steps)) or f"{rank}: no DistributedOptimizer steps")
    plot(ranks, all_steps, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
