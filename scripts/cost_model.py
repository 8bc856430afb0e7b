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

    python scripts/cost_model.py --gpu [--json model.json]     (GpuMachine's fields as flags)

GPUs: 8 per node on NVLink, 1 to 1,024 nodes, our GPU node way (CUDA IPC) against NCCL's ring,
as bus bandwidth (2(P-1)/P * S / t for P GPUs). The machine's defaults are an H100 SXM node
(NVLink 4, one 400 Gb/s NIC per GPU, PCIe Gen5); the terms marked "assumed" below have not
been measured (no such machine here) and are flags.

    ours, one node       small (one-shot): o + 2 phases + S / copy + (G-1) S / peer
                         large (two-shot):  o + 3 phases + S / copy + 2(G-1)/G S / peer
                         (peer = NVLink per direction x our kernels' share of it; a phase ends
                         with a stream synchronize and an MPI handshake, nothing overlaps)
    ours, N nodes        the two-shot, with each GPU's slice s = S/G allreduced between nodes
                         in between, on its own NIC: CUDA-aware MPI, the slice above the small
                         size by the ring in 1 MiB segments (a kernel launch per segment):
                           2(N-1) (alpha + segments * launch) + 2(N-1)/N s / nic
                         below it, MPI's allgather then N-1 reductions (launches):
                           log2(N) alpha + (N-1) s / nic + (N-1) launch
                         staged, the same ring on the host, its 4 MiB pieces copied down and
                         up over PCIe while the ring runs: max(ring, 2 s / pcie) + fill
    NCCL ring            one ring over every GPU, all of it pipelined: 2(P-1)/P S / busbw plus
                         2 N (alpha + (G-1) hop); busbw in one node is NCCL's published 8xH100
                         figure, between nodes the ring's bound (min of NVLink and the node's
                         NICs, G x nic) times an efficiency.
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


def flags(parser: argparse.ArgumentParser, machine: type) -> None:
    """One flag per field of `machine`, its default the field's."""
    for field, value in asdict(machine()).items():
        parser.add_argument(f"--{field.replace('_', '-').removesuffix('-bytes')}",
                            dest=field, default=value,
                            type=parse_bytes if field.endswith("bytes") else type(value))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the GPU model (GpuMachine)")
    gpu, _ = parser.parse_known_args(argv)
    flags(parser, GpuMachine if gpu.gpu else Machine)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--json", default=None)
    args = vars(parser.parse_args(argv))
    plot_path, json_path = args.pop("plot"), args.pop("json")
    if args.pop("gpu"):
        gpu_main(GpuMachine(**args), json_path)
        return
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


# ---------------------------------------------------------------------------- GPUs

@dataclass(frozen=True)
class GpuMachine:
    gpus_per_node: int = 8
    nvlink_gbs: float = 450.0        # per GPU and direction, GB/s (H100 SXM: NVLink 4, 900 both)
    peer_share: float = 0.8          # assumed: the share of it our kernels reach reading peers
    copy_gbs: float = 1500.0         # device-to-device copy, GB/s (H200 measured 2,094; H100 less)
    phase_us: float = 15.0           # assumed: a phase's end (launch, stream sync, MPI handshake)
    launch_us: float = 5.0           # a kernel launch the host waits for
    overhead_us: float = 60.0        # assumed: Python, engine hand-off, events, per call
    nic_gbps: float = 400.0          # per GPU, one NIC each (DGX H100: 8 x NDR)
    latency_us: float = 3.0          # GPU to GPU between nodes (GPUDirect RDMA)
    pcie_gbs: float = 50.0           # pinned copies each way (PCIe Gen5 x16)
    hop_us: float = 1.0              # NCCL's step over NVLink
    nccl_node_busbw_gbs: float = 450.0   # NCCL's published 8xH100 allreduce busbw, one node
    nccl_share: float = 0.9          # assumed: share of the ring's bound NCCL reaches between nodes
    small_bytes: int = 64 * KIB      # RINGREDUCE_SMALL_MESSAGE_BYTES
    segment_bytes: int = 1 * MIB     # RINGREDUCE_SEGMENT_BYTES
    piece_bytes: int = 4 * MIB       # the staging pieces

    @property
    def nic(self) -> float:
        """Bytes per second, one GPU's NIC."""
        return self.nic_gbps * 1e9 / 8


def gpu_between_nodes(g: GpuMachine, nodes: int, size: int, cuda_aware: bool) -> float:
    """One GPU's slice (size bytes) allreduced with the same slice on the other nodes."""
    if nodes == 1:
        return 0.0
    alpha, launch = g.latency_us * 1e-6, g.launch_us * 1e-6
    if cuda_aware and size <= g.small_bytes:
        return (math.ceil(math.log2(nodes)) * alpha + (nodes - 1) * size / g.nic
                + (nodes - 1) * launch)
    segments = math.ceil(size / nodes / g.segment_bytes)
    ring = (2 * (nodes - 1) * (alpha + segments * launch)
            + 2 * (nodes - 1) / nodes * size / g.nic)
    if cuda_aware:
        return ring
    copies = 2 * size / (g.pcie_gbs * 1e9)
    return max(ring, copies) + 2 * min(size, g.piece_bytes) / (g.pcie_gbs * 1e9)


def gpu_ours(g: GpuMachine, nodes: int, size: int, cuda_aware: bool = True) -> float:
    """Our GPU node way (one-shot or two-shot), hierarchical between nodes."""
    n, peer = g.gpus_per_node, g.nvlink_gbs * 1e9 * g.peer_share
    fixed = g.overhead_us * 1e-6 + size / (g.copy_gbs * 1e9)
    if nodes == 1 and size <= g.small_bytes:
        return fixed + 2 * g.phase_us * 1e-6 + (n - 1) * size / peer
    return (fixed + 3 * g.phase_us * 1e-6 + 2 * (n - 1) / n * size / peer
            + gpu_between_nodes(g, nodes, math.ceil(size / n), cuda_aware))


def nccl_busbw(g: GpuMachine, nodes: int) -> float:
    """NCCL's ring bus bandwidth, bytes per second (published in one node, bounded beyond)."""
    if nodes == 1:
        return g.nccl_node_busbw_gbs * 1e9
    return min(g.nvlink_gbs * 1e9, g.gpus_per_node * g.nic) * g.nccl_share


def nccl_ring(g: GpuMachine, nodes: int, size: int) -> float:
    p = nodes * g.gpus_per_node
    latency = 2 * nodes * (g.latency_us * (nodes > 1) + (g.gpus_per_node - 1) * g.hop_us) * 1e-6
    return latency + 2 * (p - 1) / p * size / nccl_busbw(g, nodes)


GPU_WAYS = {"ours, CUDA-aware": lambda g, n, s: gpu_ours(g, n, s, True),
            "ours, staged": lambda g, n, s: gpu_ours(g, n, s, False),
            "NCCL ring": nccl_ring}
GPU_NODES = [1] + NODES
GPU_SIZES = [4 * KIB, 1 * MIB, 64 * MIB, 1 * GIB]


def gpu_busbw(g: GpuMachine, nodes: int, size: int, seconds: float) -> float:
    """GB/s."""
    p = nodes * g.gpus_per_node
    return 2 * (p - 1) / p * size / seconds / 1e9


def gpu_rows(g: GpuMachine) -> list[dict]:
    """Each way's predicted time (seconds) per node count and size."""
    return [{"nodes": n, "size_bytes": s, **{way: fn(g, n, s) for way, fn in GPU_WAYS.items()}}
            for n in GPU_NODES for s in GPU_SIZES]


def gpu_limits(g: GpuMachine, nodes: int, size: int) -> dict:
    """Where our time goes (seconds): what limits the node way at this size and scale."""
    n, peer = g.gpus_per_node, g.nvlink_gbs * 1e9 * g.peer_share
    one_shot = nodes == 1 and size <= g.small_bytes
    return {"per call": g.overhead_us * 1e-6,
            "phases": (2 if one_shot else 3) * g.phase_us * 1e-6,
            "copy in": size / (g.copy_gbs * 1e9),
            "NVLink reads": ((n - 1) if one_shot else 2 * (n - 1) / n) * size / peer,
            "between nodes": gpu_between_nodes(g, nodes, math.ceil(size / n), True)}


def gpu_main(g: GpuMachine, json_path: str | None) -> None:
    rows = gpu_rows(g)
    print(f"GPU allreduce cost model: {g}")
    print(f"{'nodes':>6} {'size':>8} " + " ".join(f"{w:>26}" for w in GPU_WAYS)
          + "  NCCL / ours (time)")
    for r in rows:
        n, s = r["nodes"], r["size_bytes"]
        print(f"{n:>6} {label(s):>8} " + " ".join(
            f"{r[w] * 1e6:>11.1f} us {gpu_busbw(g, n, s, r[w]):>7.1f} GB/s" for w in GPU_WAYS)
            + f"  {r['NCCL ring'] / r['ours, CUDA-aware']:.2f}")
    for nodes, size in ((1, 64 * MIB), (16, 64 * MIB), (1024, 4 * KIB)):
        parts = gpu_limits(g, nodes, size)
        total = sum(parts.values())
        print(f"where the time goes, {nodes} node(s), {label(size)}: " + ", ".join(
            f"{k} {v / total:.0%}" for k, v in parts.items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"gpu_machine": asdict(g), "rows": rows,
                       "limits": [{"nodes": n, "size_bytes": s, **gpu_limits(g, n, s)}
                                  for n in GPU_NODES for s in GPU_SIZES]}, f, indent=1)
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
