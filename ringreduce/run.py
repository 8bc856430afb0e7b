"""`ringreduce-run`: horovodrun's common flags, spelled for the MPI launcher that is installed.

Job scripts written for `horovodrun -np 8 -H node1:4,node2:4 python train.py` keep their line
with `ringreduce-run` in front (or `python -m ringreduce.run`). MPI starts the processes: this
only translates. MPICH's Hydra (and Intel MPI's) and Open MPI's `mpirun` spell hosts, host files
and environment passing differently; ringreduce's settings travel as `RINGREDUCE_*` variables.
Flags whose job needs Horovod's own driver (Gloo, elastic host discovery) are refused.
`ringreduce.runner.run` (Horovod's `horovod.run`) launches through the same functions.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from .core.errors import LaunchError
from .core.version import __version__
from .sets import world

HYDRA, OPEN_MPI = "MPICH Hydra", "Open MPI"

# horovodrun flags that need Horovod's driver or do a job MPI does, by their spellings (the
# first is the one named): (takes a value, why refused).
_ELASTIC = "elastic jobs of changing size need Horovod's elastic driver; hvd.elastic runs here " \
           "with a fixed set of ranks"
_AUTOTUNE = "ringreduce has no autotuner; see docs/guide/settings.md for its measured defaults"
_REFUSED = {
    ("--gloo",): (False, "ringreduce runs on MPI only (there is no Gloo controller)"),
    ("--host-discovery-script",): (True, _ELASTIC),
    ("--min-np", "--min-num-proc"): (True, _ELASTIC),
    ("--max-np", "--max-num-proc"): (True, _ELASTIC),
    ("--slots-per-host",): (True, _ELASTIC),
    ("--blacklist-cooldown-range",): (True, _ELASTIC),
    ("--reset-limit",): (True, _ELASTIC),
    ("--elastic-timeout",): (True, _ELASTIC),
    ("--network-interface", "--network-interfaces"): (
        True, "MPI picks the network: use your MPI's own option (e.g. Open MPI's --mca "
              "btl_tcp_if_include) through --mpi-args"),
    ("--start-timeout",): (True, "MPI's launcher has its own start-up timeout"),
    ("--ssh-identity-file", "-i"): (True, "MPI's launcher reaches the hosts with your ssh "
                                          "settings: set IdentityFile for them in ~/.ssh/config"),
    ("--output-filename",): (True, "pass your MPI's own option through --mpi-args (Open MPI: "
                                   "--output-filename DIR; MPICH Hydra: -outfile-pattern and "
                                   "-errfile-pattern)"),
    ("--tcp",): (False, "MPI picks the transport"),
    ("--cache-capacity",): (True, "ringreduce has no response cache"),
    ("--cycle-time-ms",): (True, "ringreduce has no background cycle"),
    ("--autotune",): (False, _AUTOTUNE),
    ("--autotune-log-file",): (True, _AUTOTUNE),
    ("--autotune-warmup-samples",): (True, _AUTOTUNE),
    ("--autotune-steps-per-sample",): (True, _AUTOTUNE),
    ("--autotune-bayes-opt-max-samples",): (True, _AUTOTUNE),
    ("--autotune-gaussian-process-noise",): (True, _AUTOTUNE),
    ("--mpi-threads-disable",): (False, "ringreduce's engine threads call MPI, which needs "
                                        "MPI's thread support"),
    ("--config-file",): (True, "ringreduce-run reads no config file: give its settings as "
                               "flags or RINGREDUCE_* variables (docs/guide/settings.md)"),
    ("--jsrun",): (False, "ringreduce-run starts the ranks with mpirun/mpiexec; under LSF, "
                          "run jsrun yourself"),
}
# horovodrun flags for things ringreduce has no use for: accepted, and a line on stderr says
# why they change nothing (takes a value, why).
_HIERARCHICAL = "ringreduce always reduces within each node first, then between the nodes"
_IGNORED = {
    ("--hierarchical-allreduce",): (False, _HIERARCHICAL),
    ("--no-hierarchical-allreduce",): (False, _HIERARCHICAL),
    ("--hierarchical-allgather",): (False, _HIERARCHICAL),
    ("--no-hierarchical-allgather",): (False, _HIERARCHICAL),
    ("--torus-allreduce",): (False, "ringreduce does not use NCCL"),
    ("--no-torus-allreduce",): (False, "ringreduce does not use NCCL"),
    ("--num-nccl-streams",): (True, "ringreduce does not use NCCL"),
    ("--gloo-timeout-seconds",): (True, "there is no Gloo controller"),
    ("--thread-affinity",): (True, "bind the ranks with your MPI's options (--binding-args)"),
    ("--timeline-mark-cycles",): (False, "ringreduce has no background cycle to mark"),
    ("--no-timeline-mark-cycles",): (False, "ringreduce has no background cycle to mark"),
    ("--log-level",): (True, "ringreduce logs through Python's logging, as the logger "
                             "'ringreduce'"),
    ("--log-with-timestamp",): (False, "ringreduce logs through Python's logging"),
    ("--log-without-timestamp",): (False, "ringreduce logs through Python's logging"),
    ("--log-hide-timestamp",): (False, "ringreduce logs through Python's logging"),
    ("--no-log-hide-timestamp",): (False, "ringreduce logs through Python's logging"),
    ("--prefix-output-with-timestamp", "-prefix-timestamp"): (
        False, "pass your MPI's own option through --mpi-args (Open MPI: --timestamp-output)"),
}
# horovodrun's switches for what ringreduce always does (MPI, the stall check, MPI's threads,
# no autotuning): accepted without a word.
_DEFAULTS = ("--mpi", "--stall-check", "--no-mpi-threads-disable", "--no-autotune")
# Variables horovodrun does not pass on to the ranks (its env_util.is_exportable), as Open MPI's
# `-x` would; Hydra passes the whole environment itself.
_NOT_EXPORTED = re.compile(r"BASH_FUNC_.*|OLDPWD|.*CUDA_VISIBLE_DEVICES")


def _positive_int(text: str) -> int:
    """A process count: argparse names the flag when this refuses (exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(      # (no abbreviations: horovodrun's --mpi is not --mpi-args)
        prog="ringreduce-run", allow_abbrev=False,
        description="Run a ringreduce training script under MPI with horovodrun's flags.")
    p.add_argument("-v", "--version", action="version", version=f"ringreduce {__version__}")
    p.add_argument("-np", "--num-proc", dest="np", type=_positive_int,
                   help="number of processes (under Slurm, default: the allocation's)")
    p.add_argument("-H", "--hosts", help="hosts and slots, e.g. node1:4,node2:4")
    p.add_argument("-hostfile", "--hostfile", help="file of lines 'hostname slots=N'")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port of the other hosts")
    p.add_argument("--verbose", action="store_true", help="print the command that runs")
    p.add_argument("--fusion-threshold-mb", type=float,
                   help="gradient bucket cap in MiB (RINGREDUCE_FUSION_THRESHOLD)")
    p.add_argument("--timeline-filename", help="per-rank timeline path (RINGREDUCE_TIMELINE)")
    p.add_argument("--stall-check-warning-time-seconds", type=float,
                   help="seconds before a stall is reported (RINGREDUCE_STALL_CHECK_TIME)")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float,
                   help="seconds of stall that end the job (RINGREDUCE_STALL_SHUTDOWN_TIME)")
    p.add_argument("--no-stall-check", action="store_true", help="no stall reports")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print what this build supports and exit")
    p.add_argument("--mpi-args", default="", help="extra arguments for the MPI launcher")
    p.add_argument("--binding-args", default="",
                   help="process binding arguments for the MPI launcher (before --mpi-args)")
    p.add_argument("--disable-cache", action="store_true",
                   help="accepted and ignored: there are no start-up checks to cache (MPI's "
                        "launcher starts the ranks)")
    for table, prefix in ((_REFUSED, "refused_"), (_IGNORED, "ignored_")):
        for spellings, (takes_value, _) in table.items():
            p.add_argument(*spellings, dest=_dest(prefix, spellings), help=argparse.SUPPRESS,
                           **({"default": None} if takes_value else {"action": "store_true"}))
    for flag in _DEFAULTS:
        p.add_argument(flag, action="store_true", dest=_dest("default_", (flag,)),
                       help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _dest(prefix: str, spellings: tuple[str, ...]) -> str:
    return prefix + spellings[0].strip("-").replace("-", "_")


def find_launcher(python: str = sys.executable) -> str:
    """The mpiexec beside the interpreter (the embedded wheel's), else mpirun or mpiexec on
    PATH."""
    beside = Path(python).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    raise LaunchError("no MPI launcher found: install ringreduce with the [mpich] extra, or "
                      "load your site's MPI (module load ...)")


def flavour(launcher: str) -> str:
    """Which launcher family `launcher` is, from its --version text."""
    try:
        text = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"{launcher} --version failed: {exc}") from exc
    if "Open MPI" in text or "OpenRTE" in text or "Open RTE" in text:
        return OPEN_MPI
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return HYDRA
    raise LaunchError(f"{launcher} is neither MPICH/Intel MPI's Hydra nor Open MPI's mpirun; "
                      f"run it directly ({text.strip()[:200]!r})")


def settings_environment(args: argparse.Namespace) -> dict[str, str]:
    """Our settings from horovodrun's flags, as the variables every rank reads at init()."""
    env = {}
    if args.fusion_threshold_mb is not None:
        env["RINGREDUCE_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * (1 << 20)))
    if args.timeline_filename:
        env["RINGREDUCE_TIMELINE"] = args.timeline_filename
    if args.stall_check_warning_time_seconds is not None:
        env["RINGREDUCE_STALL_CHECK_TIME"] = f"{args.stall_check_warning_time_seconds:g}"
    if args.no_stall_check:
        env["RINGREDUCE_STALL_CHECK_TIME"] = "0"
    if args.stall_check_shutdown_time_seconds is not None:
        env["RINGREDUCE_STALL_SHUTDOWN_TIME"] = f"{args.stall_check_shutdown_time_seconds:g}"
    return env


def hydra_hostfile(horovod_hostfile: str, directory: str) -> str:
    """Horovod's 'host slots=N' lines as Hydra's 'host:N' lines, in a file under `directory`."""
    lines = []
    try:
        text = Path(horovod_hostfile).read_text()
    except OSError as exc:
        raise LaunchError(f"cannot read the hostfile {horovod_hostfile!r}: "
                          f"{exc.strerror or exc}") from exc
    for raw in text.splitlines():
        words = raw.split("#")[0].split()
        if not words:
            continue
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        lines.append(f"{words[0]}:{slots[0]}" if slots else words[0])
    path = os.path.join(directory, "hosts")
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def build_command(args: argparse.Namespace, launcher: str, family: str,
                  environ: dict[str, str], scratch: str) -> list[str]:
    """The MPI launcher's command line for `args` (the environment is passed separately)."""
    if not args.command:
        raise LaunchError("no program given: ringreduce-run -np 2 python train.py")
    if args.hosts and args.hostfile:
        raise LaunchError("give -H/--hosts or --hostfile, not both")
    in_slurm = "SLURM_JOB_ID" in environ
    if args.np is None and not in_slurm:
        raise LaunchError("-np is required (outside Slurm there is no allocation to fill)")
    cmd = [launcher]
    if args.np is not None:
        cmd += ["-n", str(args.np)]
    if family == HYDRA:
        if args.hosts:
            cmd += ["-hosts", args.hosts]
        if args.hostfile:
            cmd += ["-f", hydra_hostfile(args.hostfile, scratch)]
        if args.ssh_port is not None:
            raise LaunchError("MPICH's Hydra takes no ssh port: set 'Port' for those hosts in "
                              "~/.ssh/config instead")
        # Hydra passes the whole environment to every rank by default.
    else:
        if args.hosts:
            cmd += ["-H", args.hosts]
        if args.hostfile:
            cmd += ["--hostfile", args.hostfile]
        if args.ssh_port is not None:
            cmd += ["--mca", "plm_rsh_args", f"-p {args.ssh_port}"]
        for name in sorted(environ):
            if not _NOT_EXPORTED.fullmatch(name):
                cmd += ["-x", name]
    cmd += shlex.split(args.binding_args) + shlex.split(args.mpi_args)
    return cmd + args.command


def check_build() -> str:
    """Horovod's --check-build table, answered for this build."""
    def box(yes: bool) -> str:
        return "[X]" if yes else "[ ]"
    return "\n".join([
        f"ringreduce v{__version__} (Horovod-compatible API):", "",
        "Available Frameworks:", f"    {box(False)} TensorFlow", f"    {box(True)} PyTorch",
        f"    {box(False)} MXNet", "",
        "Available Controllers:", f"    {box(world.mpi_built())} MPI",
        f"    {box(world.gloo_built())} Gloo", "",
        "Available Tensor Operations:", f"    {box(bool(world.nccl_built()))} NCCL",
        f"    {box(world.ddl_built())} DDL", f"    {box(world.ccl_built())} CCL",
        f"    {box(world.mpi_built())} MPI", f"    {box(world.gloo_built())} Gloo",
        f"    {box(world.cuda_built())} CUDA (ringreduce's own GPU path: torch with CUDA, "
        "and CuPy)", ""])


def refused(args: argparse.Namespace) -> Optional[str]:
    """Why the first of horovodrun's flags that we cannot honour is refused, if one was given."""
    for spellings in _REFUSED:
        if getattr(args, _dest("refused_", spellings)) not in (None, False):
            return f"ringreduce-run: {spellings[0]} is not supported: {why_refused(spellings[0])}"
    return None


def ignored(args: argparse.Namespace) -> list[str]:
    """A line for each of horovodrun's flags given that change nothing here, saying why."""
    return [f"ringreduce-run: ignoring {spellings[0]}: {why}"
            for spellings, (_, why) in _IGNORED.items()
            if getattr(args, _dest("ignored_", spellings)) not in (None, False)]


def why_refused(flag: str) -> str:
    """Why horovodrun's `flag` (one we refuse, e.g. "--gloo", in any of its spellings) is not
    supported."""
    return next(why for spellings, (_, why) in _REFUSED.items() if flag in spellings)


def prepare(args: argparse.Namespace, environ: dict[str, str], scratch: str,
            python: str = sys.executable) -> list[str]:
    """The MPI launcher's command for `args`, for `ringreduce-run` and `ringreduce.runner.run`
    alike: the launcher beside `python` (else on PATH), our settings added to `environ`, a
    line on stderr when placement is left to Slurm, and with --verbose the command itself."""
    launcher = find_launcher(python)
    family = flavour(launcher)
    environ.update(settings_environment(args))
    cmd = build_command(args, launcher, family, environ, scratch)
    if "SLURM_JOB_ID" in environ and not (args.hosts or args.hostfile):
        print(f"ringreduce-run: under Slurm (job {environ['SLURM_JOB_ID']}): placement "
              f"is left to {family}'s Slurm support", file=sys.stderr)
    if args.verbose:
        ours = {k: v for k, v in environ.items() if k.startswith("RINGREDUCE_")}
        print(f"ringreduce-run: {family}: "
              + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(ours.items()))
              + (" " if ours else "") + shlex.join(cmd), file=sys.stderr, flush=True)
    return cmd


def run(argv: Sequence[str], environ: Optional[dict[str, str]] = None) -> int:
    """Parse, translate, run; the exit status of the MPI launcher (128 + N if killed by N)."""
    environ = dict(os.environ if environ is None else environ)
    args = parser().parse_args(argv)
    why = refused(args)
    if why:
        print(why, file=sys.stderr)
        return 2
    for line in ignored(args):
        print(line, file=sys.stderr)
    if args.check_build:
        print(check_build())
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="ringreduce-run-") as scratch:
            return run_forwarding_signals(prepare(args, environ, scratch), environ)
    except LaunchError as exc:
        print(f"ringreduce-run: {exc}", file=sys.stderr)
        return 2


_STOP_GRACE_SECONDS = 10.0   # for the launcher to stop its ranks after SIGTERM


def run_forwarding_signals(cmd: list[str], environ: dict[str, str]) -> int:
    """Run `cmd`; its exit status (128 + N if a signal N ended it). Called from the main
    thread, SIGINT, SIGTERM and SIGHUP sent to us go to it (the MPI launcher then stops its
    ranks). Should waiting end in an exception of ours (a test's timeout, say), the launcher
    is stopped with SIGTERM, then killed, rather than left running."""
    child = subprocess.Popen(cmd, env=environ)
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, lambda number, _frame: child.send_signal(number))
                    for s in forwarded}
    try:
        code = child.wait()
    except BaseException:
        child.terminate()
        try:
            child.wait(_STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
