"""Checkpoints that survive a crash at any moment, and resume on every rank.

`save` writes on rank 0 only: to a temporary file in the same directory, flushed and fsynced,
then renamed over the old checkpoint (and the directory fsynced), so a crash mid-write leaves
the previous checkpoint whole. `load` reads on rank 0 with `weights_only=True` (no arbitrary
code from a file) and broadcasts, so every rank resumes from identical state.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch

from .collectives import barrier
from .objects import broadcast_object
from .world import rank


def save(path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Any = None) -> None:
    """Write model, optimizer and `extra` (plain data: numbers, strings, lists, dicts, tensors)
    to `path` atomically; returns on every rank once the file is complete."""
    if rank() == 0:
        state = {"model": model.state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "extra": extra}
        write_atomically(path, state)
    barrier()


def load(path: str, model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Restore model and optimizer from rank 0's `path` on every rank; returns `extra`."""
    state = None
    if rank() == 0:
        state = torch.load(path, map_location="cpu", weights_only=True)
    state = broadcast_object(state, root_rank=0, name=f"checkpoint.load {path}")
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state["extra"]


def write_atomically(path: str, state: Any) -> None:
    """torch.save to a temporary file, fsync, rename over `path`, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    for leftover in glob.glob(glob.escape(path) + ".tmp-*"):   # from writers that crashed
        os.unlink(leftover)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
