"""What the worker scripts assert with: exact tensors, and errors that name what went wrong."""
from typing import Callable, Sequence, Union

import torch


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and values, bit for bit."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: got {got.reshape(-1)[:8]} want {want.reshape(-1)[:8]}"


def expect(error: type, fragments: Union[str, Sequence[str]], fn: Callable, *args,
           **kwargs) -> str:
    """`fn(*args, **kwargs)` raises `error` whose message holds every fragment; returns the
    message."""
    try:
        fn(*args, **kwargs)
    except error as e:
        text = str(e)
        for fragment in [fragments] if isinstance(fragments, str) else fragments:
            assert fragment in text, f"{fragment!r} not in error: {text}"
        return text
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {error.__name__} "
                         f"({fragments})")
