"""Several worker scripts in one launch, one after another, so that Python, torch and MPI start
once (3-7 s a launch on two cores) where each script would start them again.

The argument is a JSON list of {"label", "script", "args", "env", "timeout"}. Each script runs
as its own launch would: fresh globals, its own argv, its environment variables set around it,
and ringreduce shut down after it. The runner prints `SCRIPT <label> ok rank <r>` or
`SCRIPT <label> FAILED rank <r>: <why>`, then waits for every rank to finish that script
before the next one starts, so a failure in one script does not hide the others. A script
still running past its timeout on some rank (a hang, or ranks left waiting by a failure on
another) ends the job from that rank, with every thread's stack printed.
"""
import faulthandler
import json
import os
import runpy
import sys
import threading
import time
import traceback

import ringreduce as hvd
from checks import variables_set
from ringreduce.mpi import mpi

HERE = os.path.dirname(os.path.abspath(__file__))
# The runner's own communicator: its barrier never meets a collective of a script's.
runner = mpi().COMM_WORLD.Dup()
rank = runner.rank


def give_up(label: str, timeout: float) -> None:
    """The watchdog's end: say which script hung where, then end this rank (mpiexec ends the
    others)."""
    print(f"SCRIPT {label} FAILED rank {rank}: still running after {timeout:.0f} s; the stacks:",
          flush=True)
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(3)


def run_script(label: str, script: str, args: list) -> bool:
    """Run one script to its end on this rank; whether it succeeded."""
    sys.argv = [os.path.join(HERE, script), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        return True
    except BaseException as e:       # an assertion, any error, or the script's sys.exit()
        if isinstance(e, SystemExit) and e.code in (None, 0):
            return True
        why = f"{type(e).__name__}: {e}".replace("\n", " | ")[:4000]
        print(f"SCRIPT {label} FAILED rank {rank}: {why}", flush=True)
        traceback.print_exc()
        return False


def main() -> int:
    failed = []
    for entry in json.loads(sys.argv[1]):
        label, timeout = entry["label"], float(entry["timeout"])
        watchdog = threading.Timer(timeout, give_up, (label, timeout))
        watchdog.daemon = True
        watchdog.start()
        print(f"SCRIPT {label} start rank {rank}", flush=True)
        start = time.monotonic()
        with variables_set(entry.get("env", {})):
            ok = run_script(label, entry["script"], entry.get("args", []))
            try:
                if hvd.is_initialized():
                    hvd.shutdown()
            except Exception as e:
                ok = False
                print(f"SCRIPT {label} FAILED rank {rank}: shutdown() after it raised "
                      f"{type(e).__name__}: {e}", flush=True)
        sys.stdout.flush()      # (this script's output before the next one's)
        sys.stderr.flush()
        runner.Barrier()        # (mpi4py lets go of the GIL: the watchdog still fires)
        watchdog.cancel()
        if ok:
            print(f"SCRIPT {label} ok rank {rank} ({time.monotonic() - start:.1f} s)", flush=True)
        else:
            failed.append(label)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
