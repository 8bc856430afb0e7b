"""Cost model of an allreduce at scale: ringreduce's hierarchical allreduce against a flat ring
and a tree, from 2 to 1,024 nodes and 4 KiB to 1 GiB.

    python scripts/cost_model.py [--latency-us 2] [--link-gbps 100] [--ranks-per-node 8]
                                 [--plot model.png] [--json model.json]

Alpha-beta model: a message of m bytes between nodes costs alpha + m / link; within a node the
terms are calibrated on this project's machine (bench_allreduce.py, 2 ranks, MPICH wheel):
the node's shared-memory allreduce moves `--node-gbs` GB/s of busbw for large buffers and
costs `--node-small-us` for a small one, and every call pays `--overhead-us` of Python.

    hierarchical (ours)  small: node slots, then recursive doubling between nodes, the data
                         and the signature in one message per round:
                           o + node_small + log2(N) * (alpha + S / link)
                         large: block by block, each of the node's G ranks runs the ring
                         between nodes on its 1/G of each block (all G share the node's link):
                           o + S / node_bw + (S / block) * 2(N-1) * alpha
                             + 2(N-1)/N * S / link
    flat ring            every rank in one ring; the links between nodes carry its traffic:
                           o + 2(NG-1) * alpha + 2(NG-1)/(NG) * S / link
    pipelined            the same, with the node's phases of each block overlapping the ring
                         of the previous one (not built yet: what it would buy):
                           o + max(node, ring) + min(node, ring) / blocks
    tree                 binomial reduce, then broadcast, of the whole buffer between nodes
                         (after the node's own allreduce):
                           o + node_small_or_bw + 2 * log2(N) * (alpha + S / link)

N nodes, G ranks per node, S bytes per rank. The large hierarchical term shows the block
size's price at scale: each block runs its own ring, so the latency term grows with S / block
and with N; `--block` models RINGREDUCE_BLOCK_BYTES.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from ringreduce.core.config import parse_bytes

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Machine:
    latency_us: float = 2.0          # one message between nodes, MPI over InfiniBand
    link_gbps: float = 100.0         # the node's link, gigabits per second
    ranks_per_node: int = 8
    node_gbs: float = 9.0            # node allreduce busbw, GB/s (measured: 8.5-9.9)
    node_small_us: float = 2.0       # node slots exchange for a small buffer (measured 1.4-3)
    overhead_us: float = 3.0         # Python per call (measured: 4.8 us, 1.8 us of it the C exchange)
    block_bytes: int = 1 * MIB       # RINGREDUCE_BLOCK_BYTES
    small_bytes: int = 64 * KIB      # RINGREDUCE_SMALL_MESSAGE_BYTES

    @property
    def alpha(self) -> float:
        return self.latency_us * 1e-6

    @property
    def link(self) -> float:
        """Bytes per second."""
        return self.link_gbps * 1e9 / 8


def node_time(m: Machine, size: int) -> float:
    """The node's own allreduce of `size` bytes (all of it on one node)."""
    if m.ranks_per_node == 1:
        return 0.0
    if size <= m.small_bytes:
        return m.node_small_us * 1e-6
    g = m.ranks_per_node
    return 2 * (g - 1) / g * size / (m.node_gbs * 1e9)


def ring_between_nodes(m: Machine, nodes: int, size: int) -> float:
    """Our ring between nodes, block by block: 2(N-1) messages a block, the bytes once."""
    blocks = math.ceil(size / m.block_bytes)
    return blocks * 2 * (nodes - 1) * m.alpha + 2 * (nodes - 1) / nodes * size / m.link


def hierarchical(m: Machine, nodes: int, size: int) -> float:
    o = m.overhead_us * 1e-6
    if size <= m.small_bytes:
        rounds = math.ceil(math.log2(nodes))
        return o + node_time(m, size) + rounds * (m.alpha + size / m.link)
    return o + node_time(m, size) + ring_between_nodes(m, nodes, size)


def hierarchical_pipelined(m: Machine, nodes: int, size: int) -> float:
    """What overlapping the node's phases of one block with the ring between nodes of the
    previous block would give (not built yet): the slower of the two, plus one block's fill."""
    if size <= m.small_bytes:
        return hierarchical(m, nodes, size)
    node, ring = node_time(m, size), ring_between_nodes(m, nodes, size)
    blocks = math.ceil(size / m.block_bytes)
    return m.overhead_us * 1e-6 + max(node, ring) + min(node, ring) / blocks


def flat_ring(m: Machine, nodes: int, size: int) -> float:
    p = nodes * m.ranks_per_node
    return m.overhead_us * 1e-6 + 2 * (p - 1) * m.alpha + 2 * (p - 1) / p * size / m.link


def tree(m: Machine, nodes: int, size: int) -> float:
    steps = 2 * math.ceil(math.log2(nodes))
    return m.overhead_us * 1e-6 + node_time(m, size) + steps * (m.alpha + size / m.link)


ALGORITHMS = {"hierarchical": hierarchical, "pipelined": hierarchical_pipelined,
              "flat ring": flat_ring, "tree": tree}
NODES = [2 ** k for k in range(1, 11)]                    # 2 .. 1024
SIZES = [4 * KIB * 4 ** k for k in range(10)]             # 4 KiB .. 1 GiB


def label(size: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def row(m: Machine, nodes: int, size: int) -> dict:
    """Every algorithm's predicted time for one node count and size."""
    return {"nodes": nodes, "size_bytes": size,
            **{name: fn(m, nodes, size) for name, fn in ALGORITHMS.items()}}


def table(m: Machine) -> list[dict]:
    return [row(m, n, s) for n in NODES for s in SIZES]


def best(times: dict) -> str:
    """The fastest algorithm; within 0.1 % of it, the first listed (so that equal formulas,
    such as the pipelined one with a single block, do not flip)."""
    fastest = min(times[name] for name in ALGORITHMS)
    return next(name for name in ALGORITHMS if times[name] <= fastest * 1.001)


def crossovers(m: Machine) -> list[str]:
    """Per size, the node counts where the fastest algorithm changes."""
    lines = []
    for s in SIZES:
        winners = [(n, best(row(m, n, s))) for n in NODES]
        changes = [f"{w} from {n} nodes" for i, (n, w) in enumerate(winners)
                   if i == 0 or w != winners[i - 1][1]]
        lines.append(f"{label(s):>8}: " + ", ".join(changes))
    return lines


def plot(path: str, m: Machine) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [4 * KIB, 1 * MIB, 64 * MIB, 1 * GIB]
    fig, axes = plt.subplots(1, len(shown), figsize=(16, 4.5), sharex=True)
    for ax, s in zip(axes, shown):
        for name, fn in ALGORITHMS.items():
            ax.plot(NODES, [fn(m, n, s) * 1e3 for n in NODES], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{label(s)} per rank")
        ax.set_xlabel("nodes")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted time (ms)")
    axes[0].legend()
    fig.suptitle(f"allreduce cost model: {m.ranks_per_node} ranks/node, {m.link_gbps:g} Gb/s, "
                 f"{m.latency_us:g} us per message, blocks of {label(m.block_bytes)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Machine()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-').removesuffix('-bytes')}",
                            dest=field, default=value,
                            type=parse_bytes if field.endswith("bytes") else type(value))
    parser.add_argument("--plot", default=None)
    parser.add_argument("--json", default=None)
    args = vars(parser.parse_args())
    plot_path, json_path = args.pop("plot"), args.pop("json")
    m = Machine(**args)
    rows = table(m)
    print(f"allreduce cost model: {m}")
    print(f"{'nodes':>6} {'size':>8} " + " ".join(f"{n:>13}" for n in ALGORITHMS) + "  fastest")
    for r in rows:
        if r["nodes"] in (2, 16, 128, 1024) and r["size_bytes"] in (4 * KIB, MIB, 64 * MIB, GIB):
            print(f"{r['nodes']:>6} {label(r['size_bytes']):>8} "
                  + " ".join(f"{r[n] * 1e3:>10.3f} ms" for n in ALGORITHMS) + f"  {best(r)}")
    print("crossovers (fastest algorithm as nodes grow):")
    for line in crossovers(m):
        print("  " + line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": asdict(m), "rows": rows}, f, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        plot(plot_path, m)
        print(f"wrote {plot_path}")


if __name__ == "__main__":
    main()
