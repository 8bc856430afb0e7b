"""The cost model's arithmetic (scripts/cost_model.py) on round numbers."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "cost_model", Path(__file__).parents[1] / "scripts" / "cost_model.py")
model = sys.modules["cost_model"] = importlib.util.module_from_spec(spec)   # for dataclasses
spec.loader.exec_module(model)

# 1 us per message, 1e9 bytes/s links, no Python overhead, no node terms.
M = model.Machine(latency_us=1.0, link_gbps=8.0, ranks_per_node=1, node_gbs=1.0,
                  node_small_us=0.0, overhead_us=0.0, block_bytes=1 << 20, small_bytes=1 << 16)


def test_small_hierarchical_is_recursive_doubling():
    # 4 nodes: 2 rounds of (alpha + S / link)
    assert model.hierarchical(M, 4, 4096) == pytest.approx(2 * (1e-6 + 4096e-9))
    assert model.hierarchical(M, 1024, 4096) == pytest.approx(10 * (1e-6 + 4096e-9))


def test_large_hierarchical_rings_every_block():
    size, nodes = 2 << 20, 4                  # 2 blocks
    ring = 2 * 2 * (nodes - 1) * 1e-6 + 2 * (nodes - 1) / nodes * size / 1e9
    assert model.hierarchical(M, nodes, size) == pytest.approx(ring)
    two = model.Machine(**{**model.asdict(M), "ranks_per_node": 2})
    node = 2 * 1 / 2 * size / 1e9             # the node's allreduce at 1 GB/s busbw
    assert model.node_time(two, size) == pytest.approx(node)
    assert model.hierarchical(two, nodes, size) == pytest.approx(node + ring)
    assert model.hierarchical_pipelined(two, nodes, size) == pytest.approx(
        max(node, ring) + min(node, ring) / 2)


def test_flat_ring_and_tree():
    size = 1 << 20
    assert model.flat_ring(M, 4, size) == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * size / 1e9)
    assert model.tree(M, 4, size) == pytest.approx(2 * 2 * (1e-6 + size / 1e9))
    assert model.tree(M, 1, size) == 0.0


def test_crossovers_name_the_fastest_as_nodes_grow():
    lines = model.crossovers(M)
    assert len(lines) == len(model.SIZES)
    assert lines[0].strip().startswith("4 KiB: hierarchical from 2 nodes")
    assert model.best(model.row(M, 8, 4096)) == "hierarchical"
    # one large block: pipelining has nothing to overlap, the two formulas tie
    two = model.Machine(**{**model.asdict(M), "ranks_per_node": 2})
    one_block = model.row(two, 1024, 1 << 20)
    assert math.isclose(one_block["hierarchical"], one_block["pipelined"])
    # a near tie (rounding) keeps the first listed: the crossovers do not flip on it
    assert model.best({"hierarchical": 1.0, "pipelined": 0.9995, "flat ring": 2.0,
                       "tree": 2.0}) == "hierarchical"


# GPUs: 4 per node, 100 GB/s peer reads (NVLink 125 x 0.8), 1e9 B/s NICs, no fixed costs but
# those a test sets.
G = model.GpuMachine(gpus_per_node=4, nvlink_gbs=125.0, peer_share=0.8, copy_gbs=1000.0,
                     phase_us=0.0, launch_us=0.0, overhead_us=0.0, nic_gbps=8.0,
                     latency_us=1.0, pcie_gbs=2.0, hop_us=0.0, nccl_node_busbw_gbs=100.0,
                     nccl_share=1.0, small_bytes=1 << 16, segment_bytes=1 << 20,
                     piece_bytes=1 << 22)


def test_gpu_node_way_in_one_node_one_shot_and_two_shot():
    small, large = 1 << 16, 1 << 26
    # one-shot: copy in, then every peer's whole buffer read
    assert model.gpu_ours(G, 1, small) == pytest.approx(small / 1e12 + 3 * small / 100e9)
    # two-shot: copy in, then 2 (G-1)/G of the buffer read from peers
    assert model.gpu_ours(G, 1, large) == pytest.approx(large / 1e12 + 1.5 * large / 100e9)
    phases = model.GpuMachine(**{**model.asdict(G), "phase_us": 10.0})
    assert model.gpu_ours(phases, 1, large) - model.gpu_ours(G, 1, large) == pytest.approx(30e-6)
    assert model.gpu_ours(phases, 1, small) - model.gpu_ours(G, 1, small) == pytest.approx(20e-6)


def test_gpu_between_nodes_moves_one_slice_per_gpu():
    size, nodes = 1 << 26, 4
    slice_ = size // 4
    ring = 2 * 3 * 1e-6 + 2 * 3 / 4 * slice_ / 1e9          # one segment per chunk: 4 MiB / 4
    assert model.gpu_between_nodes(G, nodes, slice_, True) == pytest.approx(ring)
    assert model.gpu_ours(G, nodes, size) == pytest.approx(
        model.gpu_ours(G, 1, size) + ring)
    # staged: the ring (the longer here), plus one piece's copies down and up to fill the pipe
    assert model.gpu_between_nodes(G, nodes, slice_, False) == pytest.approx(
        ring + 2 * (1 << 22) / 2e9)
    # over a slower PCIe (0.5 GB/s) the slice's copies outlast the ring
    slow = model.GpuMachine(**{**model.asdict(G), "pcie_gbs": 0.5})
    assert model.gpu_between_nodes(slow, nodes, slice_, False) == pytest.approx(
        2 * slice_ / 0.5e9 + 2 * (1 << 22) / 0.5e9)
    # a small slice: MPI's allgather (log2 N latencies) and the slices of N-1 nodes
    assert model.gpu_between_nodes(G, 8, 4096, True) == pytest.approx(3e-6 + 7 * 4096 / 1e9)
    assert model.gpu_between_nodes(G, 1, slice_, True) == 0.0


def test_nccl_ring_is_published_in_one_node_and_bounded_beyond():
    size = 1 << 26
    assert model.nccl_ring(G, 1, size) == pytest.approx(2 * 3 / 4 * size / 100e9)
    # between nodes: min(NVLink 125 GB/s, 4 NICs of 1 GB/s), 2 N latencies
    assert model.nccl_busbw(G, 2) == pytest.approx(4e9)
    assert model.nccl_ring(G, 2, size) == pytest.approx(4 * 1e-6 + 2 * 7 / 8 * size / 4e9)
    assert model.gpu_busbw(G, 2, size, model.nccl_ring(G, 2, size)) == pytest.approx(
        2 * 7 / 8 * size / model.nccl_ring(G, 2, size) / 1e9)


def test_gpu_limits_add_up_to_our_time():
    for nodes, size in ((1, 1 << 12), (1, 1 << 26), (16, 1 << 26)):
        machine = model.GpuMachine()
        parts = model.gpu_limits(machine, nodes, size)
        assert sum(parts.values()) == pytest.approx(model.gpu_ours(machine, nodes, size))
