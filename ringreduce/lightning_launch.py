"""How `Trainer(strategy="ringreduce", devices=N)` starts its processes when the script was
started as `python train.py`, without an MPI launcher: as Lightning's own `ddp` re-runs the
script once per device (its subprocess launcher), this re-runs it under the installed MPI's
launcher on N ranks (`ringreduce-run -np N`, run.py) and ends this process with that job's
exit status; the job itself trained. It never trains one process alone where `devices` and
`num_nodes` ask for more: processes on other nodes it cannot start (MPI's launcher, told the
hosts, does), and a launcher that started fewer than asked is an error saying how many to
start."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn, Optional

from .core.errors import LaunchError
from .run import run as launch
from .sets import world

# What an MPI launcher (Hydra, Open MPI's, Slurm's srun with PMI or PMIx) gives each process.
_LAUNCHED = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    return world.size() > 1 or any(name in os.environ for name in _LAUNCHED)


def needs_launching(processes: int, nodes: int) -> bool:
    """Whether this process must start the job's `processes` per node on `nodes` nodes itself
    (True), or they run already (False); LaunchError where neither is so."""
    wanted = processes * nodes
    if world.size() == wanted or wanted == 1:
        return False
    if launched_by_mpi():
        if world.size() > 1:
            return False        # (the launcher's count rules, as Lightning's MPI environment)
        raise LaunchError(
            f"ringreduce: the Trainer asks for {wanted} processes (devices={processes}, "
            f"num_nodes={nodes}), but the MPI launcher started 1: launch {wanted} "
            f"(mpiexec -n {wanted} python ...), or pass devices=1")
    if nodes > 1:
        raise LaunchError(
            f"ringreduce: Trainer(num_nodes={nodes}) was started without an MPI launcher, "
            "which alone starts processes on other nodes: start the script on every node with "
            f"ringreduce-run -np {wanted} -H host1:{processes},host2:{processes},... python "
            "... (or mpiexec, or srun under Slurm)")
    return True


def script_argv() -> list[str]:
    """How this process's script was started, to start it again: `-m module` where it was
    run as a module, else its path; then its arguments."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    path = getattr(main, "__file__", None)
    if path is None:
        raise LaunchError(
            "ringreduce: an interactive session cannot be started again on several ranks: "
            "put the training in a script and run it with mpiexec -n N python train.py")
    return [os.path.abspath(path), *sys.argv[1:]]


def run_on_ranks(processes: int, say: Callable[[str], Any]) -> NoReturn:
    """This script on `processes` ranks under the MPI launcher; exits with the job's status."""
    argv = ["-np", str(processes), sys.executable, *script_argv()]
    say(f"ringreduce: started without an MPI launcher: running this script on {processes} "
        f"ranks (ringreduce-run {' '.join(argv)}); this process ends with the job")
    code = launch(argv, dict(os.environ))
    sys.stdout.flush()
    sys.exit(code)


def launcher_class(base: type) -> type:
    """A Lightning launcher (on `base`, the package's `_Launcher`) that runs the script on
    `processes` ranks at the Trainer's first fit, validate, test or predict."""
    class MpiScriptLauncher(base):
        def __init__(self, processes: int, say: Callable[[str], Any]) -> None:
            self.processes, self.say = processes, say

        @property
        def is_interactive_compatible(self) -> bool:
            return False

        def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None,
                   **kwargs: Any) -> NoReturn:
            run_on_ranks(self.processes, self.say)

        def kill(self, signum: Any) -> None:
            """(The job runs in the launcher's processes, which stop with it.)"""

    return MpiScriptLauncher
