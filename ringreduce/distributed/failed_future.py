"""A torch Future completed with a collective's error, for C++ readers too.

`torch.futures.Future.set_exception` stores the exception as the future's *value*, with a
Python unwrap function that raises it from `wait()` and `value()`; C++ sees a future that
succeeded. DDP's reducer reads a bucket's result in C++: its built-in allreduce extracts the
tensors from the value by pickling it (none from an exception: it then indexes an empty list
and crashes the process), and a communication hook's result is cast to a Tensor ("Unable to
cast ... to Tensor"). So a failed future here holds a `Failure` instead, which raises the
collective's error wherever it is read as data: pickled, or turned into a string. DDP's
backward() then raises our error, and Python's `wait()` and `value()` raise it as before.
"""
from __future__ import annotations

from typing import Any, NoReturn


class Failure:
    """The value of a failed future: `error`, raised by whatever reads this as data."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce_ex__(self, protocol: Any) -> NoReturn:    # C++'s extractTensors pickles
        raise self.error

    def __str__(self) -> str:      # C++'s cast of a hook's result to a Tensor formats it
        raise self.error

    def __repr__(self) -> str:
        return f"<ringreduce.Failure {type(self.error).__name__}: {self.error}>"


def _raise(value: Failure) -> NoReturn:
    raise value.error


def fail(future: Any, error: BaseException) -> None:
    """Complete torch Future `future` with `error` (set_exception, readable in C++ too)."""
    future._set_unwrap_func(_raise)
    future.set_result(Failure(error))
