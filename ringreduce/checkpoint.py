"""Checkpoints that survive a crash at any moment, and resume on every rank.

`save` writes on rank 0 only: to a temporary file in the same directory, flushed and fsynced,
then renamed over the old checkpoint (and the directory fsynced), so a crash mid-write leaves
the previous checkpoint whole. `load` reads on rank 0 with `weights_only=True` (no arbitrary
code from a file) and broadcasts, so every rank resumes from identical state. Both are
collective, and every rank learns of a failure on any one, never a hang: the ranks check first
that they name the same path (a MismatchError where one names another, e.g. a path made per
rank) and, saving, that each one's `extra` can be read back; a failure on rank 0 (a missing
file, a full disk, a file weights_only refuses) raises the same CheckpointError on every rank,
and so does a rank whose model or optimizer cannot take the loaded state.
"""
from __future__ import annotations

import glob
import io
import os
import re
import warnings
from collections import OrderedDict
from typing import Any, Optional

import torch

from .api.objects import allgather_object, broadcast_object
from .core.errors import CheckpointError
from .optim.adasum_optimizer import AdasumOptimizer
from .sets.active_set import ActiveSet, refusing
from .sets.process_set import global_process_set
from .sets.process_sets import active
from .sets.world import rank


def save(path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Any = None) -> None:
    """Write model, optimizer and `extra` (plain data: numbers, strings, lists, dicts, tensors)
    to `path` atomically; returns on every rank once the file is complete."""
    members = active(global_process_set, "checkpoint.save")
    with refusing(members, "checkpoint.save", "checkpoint.save"):
        _check_loadable(extra, "extra=...")
    _agree_on_path(members, "checkpoint.save", path)
    failure = None
    if rank() == 0:
        if isinstance(optimizer, AdasumOptimizer) and optimizer.state:
            warnings.warn("ringreduce: checkpoint.save keeps rank 0's optimizer state, which "
                          "checkpoint.load gives every rank; with op=Adasum each rank's state "
                          "(momentum, Adam's moments) is its own, so a resumed run differs "
                          "from one not interrupted")
        state = {"model": model.state_dict(),
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "extra": extra}
        try:       # (the model's and optimizer's state too: a numpy learning rate, say)
            _check_loadable(_skeleton({"model": state["model"],
                                       "optimizer": state["optimizer"]}), "model, optimizer")
            write_atomically(path, state)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {_readable(exc)}"
    failure = broadcast_object(failure, root_rank=0, name=f"checkpoint.save {path}")
    if failure is not None:
        raise CheckpointError(f"ringreduce: checkpoint.save({path!r}) failed on rank 0: "
                              f"{failure}; the previous checkpoint, if any, is intact")


def load(path: str, model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Restore model and optimizer from rank 0's `path` on every rank; returns `extra`."""
    _agree_on_path(active(global_process_set, "checkpoint.load"), "checkpoint.load", path)
    loaded: Any = None
    if rank() == 0:
        try:
            loaded = {"state": torch.load(path, map_location="cpu", weights_only=True)}
        except Exception as exc:
            loaded = {"failure": f"{type(exc).__name__}: {_readable(exc)}"}
    loaded = broadcast_object(loaded, root_rank=0, name=f"checkpoint.load {path}")
    if "failure" in loaded:
        raise CheckpointError(f"ringreduce: checkpoint.load({path!r}) failed on rank 0: "
                              f"{loaded['failure']}")
    state = loaded["state"]
    failure = None
    try:
        if optimizer is not None and state["optimizer"] is None:
            raise CheckpointError("the file holds no optimizer state (it was saved without an "
                                  "optimizer): load it without one; nothing was restored here")
        model.load_state_dict(state["model"])
        if optimizer is not None and state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    failures = allgather_object(failure, name=f"checkpoint.load {path} restored")
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        raise CheckpointError(
            f"ringreduce: checkpoint.load({path!r}): ranks {[r for r, _ in failed]} could not "
            "restore it (" + "; ".join(f"rank {r}: {f}" for r, f in failed) + "); the model "
            "and optimizer differ from the checkpoint's there")
    return state["extra"]


def _agree_on_path(members: ActiveSet, what: str, path: str) -> None:
    """Every rank names the same checkpoint (rank 0 alone reads or writes it): a path made
    per rank is a MismatchError on every rank, where the ranks would wait for each other."""
    members.agree({"collective": what, "name": what, "path": str(path)})


def _check_loadable(value: Any, what: str) -> None:
    """Refuse, before anything is written, a `value` (what save() was given: `what`) that
    load's weights_only=True could never read back."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"ringreduce: checkpoint.save({what}) holds something checkpoint.load cannot read "
            "back (it loads with weights_only=True, which runs no code from the file): "
            f"{_readable(exc)}. Store plain data: numbers, strings, lists, tuples, "
            "dicts and tensors (a learning rate as float(lr), not a NumPy scalar), e.g. "
            "torch.get_rng_state() instead of a generator, or np.random.get_state() "
            "converted with a list of its fields (the array as .tolist()).") from None


def _skeleton(value: Any) -> Any:
    """`value` with every plain tensor in its dicts, lists and tuples left out (None): what
    weights_only must read besides tensors, checked without copying them. Every other type
    stays as it is, for the check to meet: a dict or tensor of a subclass weights_only may
    refuse (a defaultdict, a tensor subclass)."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        return None
    if kind in (dict, OrderedDict):
        return kind((key, _skeleton(item)) for key, item in value.items())
    if kind in (list, tuple):
        return kind(_skeleton(item) for item in value)
    return value


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _readable(error: BaseException) -> str:
    """torch's weights_only refusal is a page of advice with the reason inside (the type it
    will not load): the reason; another error's message as it is, without terminal colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    reason = re.search(r"WeightsUnpickler error: (.*?)(?:\. |\n|$)", text)
    return f"{reason.group(1)} (weights_only=True)" if reason else text


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
