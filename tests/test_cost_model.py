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
