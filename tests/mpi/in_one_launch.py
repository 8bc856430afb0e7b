"""Several worker scripts in one launch, one after another, so that Python, torch and MPI start
once (3-7 s a launch on two cores) where each script would start them again.

The argument: a JSON list of {"label", "script", "args", "env", "timeout", "output"}. Each
script runs as its own launch would: fresh globals and fresh imports of this folder's modules,
its own argv, its environment variables set around it, and ringreduce shut down after it. Its
output, Python's and C's (file descriptors 1 and 2), goes to `<output>.<rank>.log`, so that a
test reads what its own script printed, not its neighbours'. The runner prints
`SCRIPT <label> ok rank <r>` or `SCRIPT <label> FAILED rank <r>: <why>` to the launch's
output, then waits for every rank to finish that script before the next one starts, so a
failure in one script does not hide the others. A script still running past its timeout on
some rank (a hang, or ranks left waiting by a failure on another) ends the job from that rank,
with every thread's stack printed to its log. A script that patches a module (a class's method,
say) must put it back before it ends: the next scripts run in the same process.
"""
import faulthandler
import contextlib
import json
import os
import runpy
import sys
import threading
import time
import traceback

import ringreduce as hvd
from checks import variables_set
from ringreduce.core.mpi import mpi

HERE = os.path.dirname(os.path.abspath(__file__))
# The runner's own communicator: its barrier never meets a collective of a script's.
runner = mpi().COMM_WORLD.Dup()
rank = runner.rank
LAUNCH_OUTPUT = os.dup(1)       # the launch's own output, while fd 1 goes to a script's log


def say(line: str) -> None:
    """A line to the launch's own output and to the current script's log."""
    print(line, flush=True)
    os.write(LAUNCH_OUTPUT, (line + "\n").encode())


@contextlib.contextmanager
def output_to(path: str):
    """File descriptors 1 and 2 (and so Python's and C's output) to `path`, then back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def give_up(label: str, timeout: float) -> None:
    """The watchdog's end: say which script hung where, then end this rank (mpiexec ends the
    others)."""
    say(f"SCRIPT {label} FAILED rank {rank}: still running after {timeout:.0f} s; the stacks "
        "are in its log")
    print("the stacks:", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(3)


def forget_modules_of_this_folder(known: set) -> None:
    """Modules of tests/mpi a script imported (its cases, its set-up) are imported again by
    the next script that wants them, so their set-up runs again as in a launch of its own."""
    for name, module in list(sys.modules.items()):
        if name not in known and (getattr(module, "__file__", None) or "").startswith(HERE):
            del sys.modules[name]


def run_script(label: str, script: str, args: list) -> bool:
    """Run one script to its end on this rank; whether it succeeded."""
    sys.argv = [os.path.join(HERE, script), *args]
    known = set(sys.modules)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        return True
    except BaseException as e:       # an assertion, any error, or the script's sys.exit()
        if isinstance(e, SystemExit) and e.code in (None, 0):
            return True
        why = f"{type(e).__name__}: {e}".replace("\n", " | ")[:4000]
        say(f"SCRIPT {label} FAILED rank {rank}: {why}")
        traceback.print_exc()
        return False
    finally:
        forget_modules_of_this_folder(known)


def main() -> int:
    failed = []
    for entry in json.loads(sys.argv[1]):
        label, timeout = entry["label"], float(entry["timeout"])
        watchdog = threading.Timer(timeout, give_up, (label, timeout))
        watchdog.daemon = True
        watchdog.start()
        print(f"SCRIPT {label} start rank {rank}", flush=True)
        start = time.monotonic()
        with output_to(f"{entry['output']}.{rank}.log"), variables_set(entry.get("env", {})):
            ok = run_script(label, entry["script"], entry.get("args", []))
            try:
                if hvd.is_initialized():
                    hvd.shutdown()
            except Exception as e:
                ok = False
                say(f"SCRIPT {label} FAILED rank {rank}: shutdown() after it raised "
                    f"{type(e).__name__}: {e}")
            runner.Barrier()    # (mpi4py lets go of the GIL: the watchdog still fires)
        watchdog.cancel()
        if ok:
            print(f"SCRIPT {label} ok rank {rank} ({time.monotonic() - start:.1f} s)", flush=True)
        else:
            failed.append(label)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
