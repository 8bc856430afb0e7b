"""torch.compile stops at ringreduce: its code runs as written, never traced.

Dynamo traces the Python frames a compiled function reaches, ours too: a Horovod-style
collective or SyncBatchNorm in a compiled forward, and the torch.distributed backend's methods,
which torch's C++ calls from a compiled DDP's eager parts. Tracing our threads, locks, MPI and
ctypes fails (dynamo reaches its recursion limit, or stops at the ProcessGroup it cannot see
into), where a C++ library (Horovod's ops, gloo) is a graph break. So ringreduce's files go on
dynamo's skip list (`trace_rules.add`, which torch keeps for modules it must not trace): a call
into them is a graph break, and runs eagerly. Importing dynamo takes over a second, so this
waits for it: done at once if its rules are loaded, else when they are first imported.
It also tells whether a backward pass runs compiled (in_compiled_backward).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Optional

_RULES = ("torch._dynamo.trace_rules", "torch._dynamo.skipfiles")    # (skipfiles: torch 2.1)
_PACKAGE = __name__.partition(".")[0]     # ringreduce, every layer of it


def _skip(rules: ModuleType) -> None:
    try:
        rules.add(_PACKAGE)
    except Exception as exc:    # an API torch changed: compile as before, and say so
        warnings.warn(f"ringreduce: torch.compile may trace ringreduce's code and fail there: "
                      f"{rules.__name__}.add('{_PACKAGE}') raised {type(exc).__name__}: {exc}")


class _WhenLoaded(importlib.abc.MetaPathFinder):
    """An import hook for dynamo's rules: found as usual, then told to skip us once run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[Any]:
        if name not in _RULES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                _skip(module)

            spec.loader.exec_module = exec_module
        return spec


def in_compiled_backward() -> bool:
    """Whether this runs in a backward pass that compiled autograd compiled (its hooks call
    ours eagerly): torch runs no end-of-backward callbacks there, since the callbacks that
    Variable._execution_engine.queue_callback queues go to a graph task it never finishes.
    (Compiled autograd is loaded only with dynamo: this imports nothing.)"""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and compiled_autograd.in_compiled_autograd_region


def install() -> None:
    """Put ringreduce on dynamo's skip list now, or when dynamo's rules are imported."""
    loaded = [sys.modules[name] for name in _RULES if name in sys.modules]
    if loaded:
        _skip(loaded[0])
    elif not any(isinstance(finder, _WhenLoaded) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenLoaded())
