"""`ringreduce.runner.run`: Horovod's `horovod.run`, a Python function on N ranks.

`run(fn, args, kwargs, num_proc=N)` calls `fn(*args, **kwargs)` on every rank of an MPI job
and returns the return values as a list in rank order; scripts written for
`horovod.run(...)` call `ringreduce.runner.run(...)` with the same arguments. The job starts
through `ringreduce-run`'s code (ringreduce/run.py: the launcher, its flavour, hosts,
refusals). The function travels by cloudpickle (a function of `__main__`, a lambda or a
closure by value, others by reference: each rank gets the caller's `sys.path` to import them)
in a temporary directory the caller makes, and each rank leaves its outcome there in a file of
its own: its pickled return value, or the traceback of what it raised. The directory must be
one every host sees: on several hosts, point TMPDIR at a shared file system.

The function may call `ringreduce.init()` (as Horovod's call `hvd.init()`), or not. A rank
whose function raises ends the whole job (MPI_Abort, after writing its traceback), so that no
other rank waits for it in a collective; `run` then raises RuntimeError naming it.

Run as `python -m ringreduce.runner DIRECTORY`, this module is that rank side.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import cloudpickle

from . import run as launcher
from .core.mpi import mpi
from .sets import world

CALL = "call.pkl"          # (the caller's sys.path, the cloudpickled (fn, args, kwargs))
_OK, _RAISED = "ok", "raised"

# Horovod's keyword arguments that need its own driver, as ringreduce-run's flags: refused
# with that flag's reason when given (not None; False for the switches).
_REFUSED_ARGUMENTS = {
    "min_num_proc": "--min-np", "max_num_proc": "--max-np", "min_np": "--min-np",
    "max_np": "--max-np", "slots": "--slots-per-host", "reset_limit": "--reset-limit",
    "cooldown_range": "--blacklist-cooldown-range",
    "host_discovery_script": "--host-discovery-script", "start_timeout": "--start-timeout",
    "ssh_identity_file": "--ssh-identity-file",
    "output_filename": "--output-filename", "use_gloo": "--gloo",
    "network_interface": "--network-interface", "network_interfaces": "--network-interface",
}


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
        num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
        max_num_proc: Optional[int] = None, slots: Optional[int] = None,
        reset_limit: Optional[int] = None, cooldown_range: Any = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        host_discovery_script: Optional[str] = None, start_timeout: Optional[int] = None,
        ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None,
        disable_cache: Optional[bool] = None, output_filename: Optional[str] = None,
        verbose: Any = None, use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        network_interfaces: Any = None, executable: Optional[str] = None,
        np: Optional[int] = None, min_np: Optional[int] = None, max_np: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None) -> list:
    """`fn(*args, **kwargs)` on `num_proc` ranks; their return values in rank order.

    Horovod's signature (`np` is its deprecated `num_proc`), plus `env`: the environment of
    the launcher and the ranks (default: this process's). `num_proc` left out means 1, as in
    Horovod, except under Slurm without hosts, where the allocation decides (as with
    `ringreduce-run`). `hosts` ("h1:4,h2:4"), `hostfile`, `ssh_port`, `mpi_args` and
    `verbose` act as `ringreduce-run`'s flags; `executable` is the Python every rank runs
    (default this one; the MPI launcher beside it is preferred). `use_mpi` and `use_gloo`
    left out or False let the runner choose, as Horovod's do (Horovod's MNIST example passes
    both False): it runs over MPI, as with `use_mpi=True`. Arguments that need Horovod's own
    driver (the elastic ones, `use_gloo=True`, network interfaces, ...) raise ValueError
    saying why, as `ringreduce-run` refuses their flags.

    Raises RuntimeError naming the ranks that raised (with their tracebacks) or returned
    nothing, and the launcher's exit status, when any rank fails.
    """
    given = {"min_num_proc": min_num_proc, "max_num_proc": max_num_proc, "slots": slots,
             "reset_limit": reset_limit, "cooldown_range": cooldown_range,
             "host_discovery_script": host_discovery_script, "start_timeout": start_timeout,
             "ssh_identity_file": ssh_identity_file,
             "output_filename": output_filename, "use_gloo": use_gloo,
             "network_interface": network_interface, "network_interfaces": network_interfaces,
             "min_np": min_np, "max_np": max_np}
    for name, value in given.items():
        if value is not None and value is not False:
            raise ValueError(f"ringreduce.runner.run: {name}={value!r} is not supported: "
                             f"{launcher.why_refused(_REFUSED_ARGUMENTS[name])}")
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning,
                      stacklevel=2)
        if num_proc is not None and num_proc != np:
            raise ValueError(f"ringreduce.runner.run: num_proc={num_proc} and np={np} differ")
        num_proc = np
    if hosts is not None and hostfile is not None:
        raise ValueError("ringreduce.runner.run: give hosts or hostfile, not both")
    environ = dict(os.environ if env is None else env)
    if num_proc is None and not ("SLURM_JOB_ID" in environ and not (hosts or hostfile)):
        num_proc = 1
    python = _python(executable)
    call = pickle.dumps((list(sys.path), cloudpickle.dumps((fn, tuple(args), kwargs or {}))))

    with tempfile.TemporaryDirectory(prefix="ringreduce-runner-") as directory:
        Path(directory, CALL).write_bytes(call)
        # ringreduce-run's flags, each with its value after "=" (a value may start with "-").
        flags = {"--num-proc": num_proc, "--hosts": hosts, "--hostfile": hostfile,
                 "--ssh-port": ssh_port, "--mpi-args": mpi_args or None}
        argv = [f"{flag}={value}" for flag, value in flags.items() if value is not None]
        argv += ["--verbose"] * bool(verbose) + [python, "-m", __name__, directory]
        try:
            parsed = launcher.parser().parse_args(argv)
        except SystemExit as exc:       # argparse's way to say a value is wrong
            raise ValueError(f"ringreduce.runner.run: invalid arguments (see above): "
                             f"{argv[:-4]}") from exc
        try:
            cmd = launcher.prepare(parsed, environ, directory, python)
        except launcher.LaunchError as exc:
            raise ValueError(f"ringreduce.runner.run: {exc}") from exc
        code = launcher.run_forwarding_signals(cmd, environ)
        return collect(directory, num_proc, code)


def _python(executable: Optional[str]) -> str:
    if executable is None:
        return sys.executable
    found = shutil.which(executable)
    if found is None:
        raise ValueError(f"ringreduce.runner.run: executable {executable!r} not found")
    return os.path.abspath(found)


def collect(directory: str, num_proc: Optional[int], code: int) -> list:
    """The return values the ranks left in `directory`, in rank order; RuntimeError, naming
    the ranks, if any raised or left nothing, or if the launcher's exit status `code` is not
    0."""
    outcomes = {}
    for path in Path(directory).glob("rank.*"):
        outcomes[int(path.name.split(".")[1])] = cloudpickle.loads(path.read_bytes())
    ranks = num_proc if num_proc is not None else \
        max((size for _, size, _ in outcomes.values()), default=0)
    raised = {r: outcomes[r][2] for r in sorted(outcomes) if outcomes[r][0] == _RAISED}
    missing = [r for r in range(ranks) if r not in outcomes]
    if not raised and not missing and code == 0 and ranks > 0:
        return [outcomes[r][2] for r in range(ranks)]
    problems = []
    if raised:
        problems.append("; ".join(f"rank {r} raised {_last_line(text)}"
                                  for r, text in raised.items()))
    if missing:
        problems.append(f"{_ranks(missing)} returned nothing"
                        + (" (ended with the job)" if raised else ""))
    if ranks == 0:
        problems.append("no rank started (see the launcher's output above)")
    if not problems:
        problems.append("every rank returned, but the launcher failed")
    tracebacks = "".join(f"\n--- rank {r} ---\n{text}" for r, text in raised.items())
    raise RuntimeError(f"ringreduce.runner.run: {', '.join(problems)} (MPI launcher exit "
                       f"status {code}){tracebacks}")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no traceback)"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# ---------------------------------------------------------------- the rank side

def work(directory: str) -> int:
    """One rank: call the function in `directory`'s call file and leave its outcome in
    rank.<rank> there; a rank that fails ends the whole job. Exit status 0, or 1 for a
    failure in a job of one rank."""
    comm = mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        path, call = pickle.loads(Path(directory, CALL).read_bytes())
        # the caller's path first, in its order (a checkout it put before site-packages
        # stays before it), then this interpreter's own entries it lacks
        sys.path[:] = path + [p for p in sys.path if p not in path]
        fn, args, kwargs = cloudpickle.loads(call)
        outcome = cloudpickle.dumps((_OK, size, fn(*args, **kwargs)))
        failure = None
    except BaseException:    # noqa: B036 - SystemExit and KeyboardInterrupt fail a rank too
        failure = traceback.format_exc()
        outcome = pickle.dumps((_RAISED, size, failure))
    try:
        part = Path(directory, f".rank.{rank}.part")
        part.write_bytes(outcome)
        os.replace(part, Path(directory, f"rank.{rank}"))
    except OSError as exc:
        failure = (failure or "") + (
            f"cannot write its outcome in {directory} ({exc}): the directory must be on a "
            "file system every host sees (set TMPDIR)\n")
    if failure is None:
        return 0
    message = f"ringreduce.runner: rank {rank} failed; ending the job.\n{failure}"
    if size > 1:
        world.abort(message)
    else:
        sys.stderr.write(message)
    return 1


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ringreduce.runner",
                                description="The rank side of ringreduce.runner.run.")
    p.add_argument("directory", help="the directory ringreduce.runner.run made")
    sys.exit(work(p.parse_args(argv).directory))


if __name__ == "__main__":
    main()
