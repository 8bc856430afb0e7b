"""Every `RINGREDUCE_*` setting in one place: its default, its parser, and its keyword twin.

A keyword argument given in code wins over the environment, which wins over the default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _parse_bool_or_auto(text: str) -> Any:
    """'auto' (decide at run time), or a boolean."""
    return "auto" if text.strip().lower() == "auto" else _parse_bool(text)


def _parse_bytes(text: str) -> int:
    """Integer byte counts, with optional K/M/G suffix (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    return int(float(number) * scale)


@dataclass(frozen=True)
class Setting:
    keyword: str
    default: Any
    parse: Callable[[str], Any]
    doc: str

    @property
    def env(self) -> str:
        return "RINGREDUCE_" + self.keyword.upper()


SETTINGS: dict[str, Setting] = {
    s.keyword: s
    for s in (
        Setting("small_message_bytes", 64 << 10, _parse_bytes,
                "allreduce payloads up to this size use the latency-optimal gather-and-reduce "
                "path instead of the bandwidth-optimal ring (over MPI)"),
        Setting("shared_small_bytes", 512 << 10, _parse_bytes,
                "shared-memory allreduce: payloads up to this size go through one slot per rank "
                "that every rank reduces (in C for the common dtypes) instead of block by block"),
        Setting("segment_bytes", 1 << 20, _parse_bytes,
                "the ring sends each chunk in segments of this size so that receiving the next "
                "segment overlaps reducing the current one"),
        Setting("shared_memory", True, _parse_bool,
                "ranks on one node allreduce through an MPI-3 shared-memory window (the ring "
                "over MPI then only runs between nodes); 0 = always the ring over MPI"),
        Setting("block_bytes", 1 << 20, _parse_bytes,
                "shared-memory allreduce of a private buffer: bytes per block, small enough for "
                "the staging areas to stay in cache"),
        Setting("fusion_threshold", 16 << 20, _parse_bytes,
                "DistributedOptimizer: the byte cap of one gradient bucket"),
        Setting("first_bucket_bytes", 1 << 20, _parse_bytes,
                "DistributedOptimizer: the cap of the first bucket, small so communication "
                "starts early in backward"),
        Setting("simulated_nodes", 0, int,
                "group the ranks into this many simulated nodes (contiguous blocks of ranks) "
                "instead of splitting by shared memory; 0 = off. For testing multi-node topology "
                "on one machine"),
        Setting("stall_check_time", 60.0, float,
                "seconds a rank waits for the others to join a collective before it logs which "
                "ranks are missing (and again every such interval); 0 = off"),
        Setting("stall_shutdown_time", 0.0, float,
                "seconds of such waiting after which the job is aborted with that message; "
                "0 = never"),
        Setting("consistency_check_steps", 0, int,
                "DistributedOptimizer: every this many steps, check that all parameters are "
                "bitwise identical across ranks (check_consistency); 0 = never"),
        Setting("cuda_aware", "auto", _parse_bool_or_auto,
                "1: hand CUDA device pointers straight to MPI; 0: stage GPU buffers through "
                "pinned host memory; auto: ask the MPI library at init()"),
        Setting("abort_on_error", True, _parse_bool,
                "an uncaught exception on any rank aborts the whole MPI job (non-zero exit) "
                "instead of leaving the other ranks waiting in a collective"),
        Setting("timeline", "", str,
                "write a Chrome-trace/Perfetto timeline of every collective's phases to this "
                "path, one file per rank ('{rank}' in the path, else '.rank<r>' before the "
                "extension); empty = off"),
    )
}


def get(keyword: str, override: Any = None) -> Any:
    """The value of a setting: `override` if given, else the environment, else the default."""
    setting = SETTINGS[keyword]
    if override is not None:
        return override
    raw = os.environ.get(setting.env)
    if raw is None:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        raise ValueError(f"ringreduce: bad value {raw!r} for {setting.env}: {exc}") from None
