"""Every `RINGREDUCE_*` setting in one typed object, built once at `init()`.

Each field has a default, a parser for its environment variable and a doc line. A keyword
argument given to `init()` wins over `RINGREDUCE_<NAME>`, which wins over the Horovod variable
that means the same (HOROVOD_FUSION_THRESHOLD ...), which wins over the default. Horovod
variables that ringreduce has no use for are listed by `ignored_horovod_variables`, so that
init() can say once that they are ignored.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Union


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _parse_bool_or_auto(text: str) -> Union[bool, str]:
    """'auto' (decide at run time), or a boolean."""
    return "auto" if text.strip().lower() == "auto" else _parse_bool(text)


def _parse_gpu_node_way(text: str) -> str:
    choice = text.strip().lower()
    if choice not in ("auto", "ipc", "staging"):
        raise ValueError(f"expected auto, ipc or staging, got {text!r}")
    return choice


def _parse_bucket_schedule(text: str) -> str:
    choice = text.strip().lower()
    if choice not in ("auto", "overlap", "inline"):
        raise ValueError(f"expected auto, overlap or inline, got {text!r}")
    return choice


def parse_bytes(text: str) -> int:
    """Integer byte counts, with optional K/M/G suffix (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError("expected a byte count: a number with an optional K, M or G suffix "
                         "(powers of 1024: 64K, 16M)")
    return int(value)


def _parse_path(text: str) -> str:
    """A file's path; empty: none. A blank one, or one naming a directory, is a mistake."""
    if text and not text.strip():
        raise ValueError("a blank path; leave it empty for none")
    if text.endswith(("/", os.sep)):
        raise ValueError("a directory, not a file's path")
    return text


_GIB = 1 << 30
_NO_LIMIT = float("inf")
_SHORTEST_SECONDS = 1.0     # a time setting's least value but 0 (off): reports and shutdowns
                            # sooner than this take the job over (1e-300 printed 11,400 lines
                            # in 6 s)


def _setting(default: Any, parse: Callable[[str], Any], doc: str, horovod: str = "",
             accepted: tuple[float, float] = (0, _NO_LIMIT), off: bool = False) -> Any:
    """A field; `horovod` names the Horovod environment variable that means the same;
    `accepted` is the range of a number (both ends included); `off`: 0 is accepted too, for
    none."""
    return dataclasses.field(default=default, metadata={
        "parse": parse, "doc": doc, "horovod": horovod, "accepted": accepted, "off": off})


def _parsed(field: Any, raw: str, source: str) -> Any:
    """`raw` read by `field`'s parser, or a ValueError naming `source` (the variable, or
    init()'s keyword)."""
    try:
        return field.metadata["parse"](raw)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"ringreduce: bad value {raw!r} for {source}: {exc}") from None


def _in_range(value: Any, field: Any) -> bool:
    low, high = field.metadata["accepted"]
    return isinstance(value, bool) or not isinstance(value, (int, float)) or \
        low <= value <= high or (field.metadata["off"] and value == 0)


def _describe_range(field: Any) -> str:
    low, high = field.metadata["accepted"]
    off = "0 (off), or " if field.metadata["off"] else ""
    if high == _NO_LIMIT:
        return f"{off}a number >= {low:g}"
    return f"{off}{low:.0f} to {high:.0f}" + (f" ({high / _GIB:g} GiB)" if high >= _GIB else "")


@dataclass(frozen=True)
class Settings:
    small_message_bytes: int = _setting(
        64 << 10, parse_bytes,
        "allreduce payloads up to this size use the latency-optimal ways instead of the "
        "bandwidth-optimal ring: the gather-and-reduce path over MPI, or between nodes the "
        "recursive doubling that carries the signature with the data", accepted=(0, _GIB))
    shared_small_bytes: int = _setting(
        512 << 10, parse_bytes,
        "shared-memory allreduce: payloads up to this size go through one slot per rank that "
        "every rank reduces, instead of block by block", accepted=(0, _GIB))
    segment_bytes: int = _setting(
        1 << 20, parse_bytes,
        "the ring sends each chunk in segments of this size so that receiving the next segment "
        "overlaps reducing the current one", accepted=(1, _GIB))
    shared_memory: bool = _setting(
        True, _parse_bool,
        "ranks on one node allreduce through an MPI-3 shared-memory window (the ring over MPI "
        "then only runs between nodes); 0 = always the ring over MPI")
    block_bytes: int = _setting(
        1 << 20, parse_bytes,
        "shared-memory allreduce of a large buffer: bytes per block, small enough for the "
        "staging areas to stay in cache", accepted=(1, _GIB))
    fusion_threshold: int = _setting(
        16 << 20, parse_bytes, "DistributedOptimizer: the byte cap of one gradient bucket",
        horovod="HOROVOD_FUSION_THRESHOLD")
    first_bucket_bytes: int = _setting(
        1 << 20, parse_bytes,
        "DistributedOptimizer: the cap of the first bucket, small so communication starts early "
        "in backward")
    bucket_schedule: str = _setting(
        "auto", _parse_bucket_schedule,
        "DistributedOptimizer: where each bucket is reduced as soon as it fills: overlap: on "
        "the engine thread, while backward goes on; inline: on the training thread, backward "
        "pausing for it (quicker where each rank has one busy core); auto: measure both over "
        "the first 38 steps and keep the quicker (overlap only where more than 5% quicker), "
        "the same on every rank (overlap on GPUs)")
    simulated_nodes: int = _setting(
        0, int,
        "group the ranks into this many simulated nodes (contiguous blocks of ranks) instead of "
        "splitting by shared memory; 0 = off. For testing multi-node topology on one machine")
    stall_check_time: float = _setting(
        60.0, float,
        "seconds a rank waits for the others to join a collective (or to reach init(), or "
        "shutdown()) before it logs so (and again every such interval); 0 = off",
        horovod="HOROVOD_STALL_CHECK_TIME_SECONDS", accepted=(_SHORTEST_SECONDS, _NO_LIMIT),
        off=True)
    stall_shutdown_time: float = _setting(
        0.0, float,
        "seconds of such waiting (in a collective or init()) after which the job is aborted "
        "with that message; 0 = never",
        horovod="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", accepted=(_SHORTEST_SECONDS, _NO_LIMIT),
        off=True)
    consistency_check_steps: int = _setting(
        0, int,
        "DistributedOptimizer: every this many steps, check that all parameters are bitwise "
        "identical across ranks (check_consistency); 0 = never")
    cuda_aware: Union[bool, str] = _setting(
        "auto", _parse_bool_or_auto,
        "1: hand CUDA device pointers straight to MPI; 0: stage GPU buffers through pinned host "
        "memory; auto: ask the MPI library at init()")
    gpu_node_way: str = _setting(
        "auto", _parse_gpu_node_way,
        "how CUDA tensors are reduced among the ranks of a node: ipc: in device memory shared "
        "through CUDA IPC, by ringreduce's kernels; staging: through host memory (or MPI, "
        "where it is CUDA-aware); auto: ipc where every node can share its GPUs' memory, else "
        "staging, said once")
    abort_on_error: bool = _setting(
        True, _parse_bool,
        "an uncaught exception on any rank aborts the whole MPI job (non-zero exit) instead of "
        "leaving the other ranks waiting in a collective")
    timeline: str = _setting(
        "", _parse_path,
        "write a Chrome-trace/Perfetto timeline of every collective's phases to this path, one "
        "file per rank ('{rank}' in the path, else '.rank<r>' before the extension); empty or "
        "DYNAMIC (Horovod's: only start_timeline() starts one) = off",
        horovod="HOROVOD_TIMELINE")

    # What every rank must set alike: how a collective's bytes move (the ways and their sizes,
    # the topology, device pointers to MPI) and which collectives run (the optimizer's checks).
    # Ranks that differ would pair one collective under one signature and move its bytes two
    # ways (wrong sums, or a hang); init() compares them.
    AGREED = ("small_message_bytes", "shared_small_bytes", "segment_bytes", "shared_memory",
              "block_bytes", "simulated_nodes", "cuda_aware", "gpu_node_way",
              "consistency_check_steps")

    @staticmethod
    def env_name(name: str) -> str:
        return "RINGREDUCE_" + name.upper()

    @classmethod
    def load(cls, **overrides: Any) -> "Settings":
        """Keyword arguments (None = not given), else the environment, else the defaults."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(overrides) - set(known)
        if unknown:
            raise TypeError(f"ringreduce: unknown setting(s) {sorted(unknown)}; known: "
                            f"{sorted(known)}")
        values = {}
        if _parse_bool(os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0")):
            values["stall_check_time"] = 0.0
        for name, f in known.items():
            ours, horovods = cls.env_name(name), f.metadata["horovod"]
            if overrides.get(name) is not None:
                value = overrides[name]
                if isinstance(value, str):      # as the environment spells it ("0", "16M")
                    value = _parsed(f, value, f"init({name}=)")
                values[name] = overrides[name] = value
                continue
            if ours in os.environ:
                variable = ours
            elif horovods and horovods in os.environ and name not in values:
                variable = horovods
            else:
                continue
            raw = os.environ[variable]
            values[name] = _parsed(f, raw, variable)
            if not _in_range(values[name], f):
                raise ValueError(f"ringreduce: {variable}={raw} is out of range: expected "
                                 f"{_describe_range(f)}")
        for name, value in overrides.items():
            if value is not None and not _in_range(value, known[name]):
                raise ValueError(f"ringreduce: init({name}={value!r}) is out of range "
                                 f"({cls.env_name(name)}): expected "
                                 f"{_describe_range(known[name])}")
        return cls(**values)


# Horovod variables whose job ringreduce does another way (or always does): no warning.
_HOROVOD_HONOURED = {"HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_DYNAMIC_PROCESS_SETS"} | {
    f.metadata["horovod"] for f in dataclasses.fields(Settings) if f.metadata["horovod"]}


def ignored_horovod_variables(environ: Any = None) -> list[str]:
    """The HOROVOD_* variables set in the environment that ringreduce does not use (cycle
    time, cache capacity, autotuning ...: it has no background cycle or response cache)."""
    environ = os.environ if environ is None else environ
    return sorted(v for v in environ if v.startswith("HOROVOD_") and v not in _HOROVOD_HONOURED)
