"""What the worker scripts assert with: exact tensors, errors that name what went wrong, and
one launch run under several settings."""
import contextlib
import json
import os
import threading
from typing import Callable, Optional, Sequence, Union

import torch

import ringreduce as hvd


def check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and values, bit for bit."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: got {got.reshape(-1)[:8]} want {want.reshape(-1)[:8]}"


def horovod_scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x times `factor` as Horovod scales a reduced tensor (Average's factor is postscale /
    size, in float64; ScaleBufferCPUImpl): float64 and integers (truncated toward zero) in
    float64, float32 and the 16-bit floats by the factor cast to float32, rounded once; a
    factor of 1 leaves x as it is."""
    if factor == 1.0:
        return x
    if not x.dtype.is_floating_point:
        return (x.double() * factor).to(torch.int64).to(x.dtype)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(compute) * torch.tensor(factor, dtype=torch.float64).to(compute)).to(x.dtype)


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


def in_threads(target: Callable[[int], None], count: int) -> None:
    """target(0) ... target(count - 1), each on a thread of its own, started in that order
    (every rank alike: their places match), then waited for."""
    threads = [threading.Thread(target=target, args=(t,)) for t in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_cases(cases: Sequence[Callable[[], None]], rank: int) -> None:
    """Run every case, also after one fails; then fail naming each failed case and why. Each
    failure is printed at once too: if it leaves the other ranks waiting in that case, the job
    hangs until the test's timeout, and the output the test reports must still say why."""
    failures = []
    for case in cases:
        try:
            case()
        except Exception as e:      # an assertion, or an error the case did not expect
            failures.append(f"{case.__name__} (rank {rank}): {type(e).__name__}: {e}")
            print(f"FAILED {failures[-1]}", flush=True)
    if failures:
        raise AssertionError("; ".join(failures))


def then_barrier(check: Callable[[], None]) -> Callable[[], None]:
    """`check`, then a barrier: the next check starts with nothing of this one in flight."""
    def case() -> None:
        check()
        hvd.barrier()
    case.__name__ = check.__name__
    return case


@contextlib.contextmanager
def variables_set(variables: dict):
    """The environment with `variables` set, then as it was."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def per_setting(argument: Optional[str], start: Callable[[], None], checks: Callable[[], None],
                stop: Callable[[], None]) -> None:
    """For each setting of `argument`, a JSON object {label: {RINGREDUCE_* variable: value}}
    (None: the environment as it is): set its variables, start(), checks(), stop(). A failure
    names the setting's label, and the settings after it still run, on every rank (a rank that
    fails alone shuts down, and the others' error there is caught too); the failures of every
    setting are raised together at the end."""
    failures = []
    for label, variables in json.loads(argument or '{"as launched": {}}').items():
        with variables_set(variables):
            start()
            try:
                checks()
            except Exception as e:  # an assertion, or the error a failure on another rank gave
                failures.append(f"[{label}] {type(e).__name__}: {e}")
                print(f"FAILED {failures[-1]}", flush=True)     # (as in run_cases)
            stop()
    if failures:
        raise AssertionError("; ".join(failures))
