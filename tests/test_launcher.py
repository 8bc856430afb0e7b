"""ringreduce-run: horovodrun's flags on both embedded MPIs, refusals, exit status."""
import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading

import pytest

from conftest import WORKERS, worker_env
from ringreduce import run as launcher

CHECK = str(WORKERS / "launcher_check.py")
OPEN_MPI_ROOT = ["--mpi-args", "--oversubscribe --allow-run-as-root"]


def launch(python, *flags, env=None, timeout=120):
    full_env = worker_env(env)
    return subprocess.run([python, "-m", "ringreduce.run", *flags], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


def assert_ran(result, n):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for r in range(n):
        assert f"OK rank {r} of {n}" in result.stdout, result.stdout[-3000:]


# One launch per MPI with every flag (-np alone starts the exit-status and SIGTERM tests' jobs;
# each flag's translation for either MPI is also checked without a launch, further down).
def test_mpich_np_and_hosts():
    result = launch(sys.executable, "-np", "2", "-H", "localhost:2", "--verbose",
                    "--fusion-threshold-mb", "8", sys.executable, CHECK,
                    env={"WANT_FUSION": str(8 << 20)})
    assert_ran(result, 2)
    assert "ringreduce-run: MPICH Hydra: RINGREDUCE_FUSION_THRESHOLD=8388608 " in result.stderr
    assert "-hosts localhost:2" in result.stderr


def test_open_mpi_np_and_hosts(openmpi_python):
    result = launch(openmpi_python, "-np", "2", "-H", "localhost:2", "--verbose",
                    "--fusion-threshold-mb", "8", *OPEN_MPI_ROOT, openmpi_python, CHECK,
                    env={"WANT_FUSION": str(8 << 20)}, timeout=300)
    assert_ran(result, 2)
    assert "ringreduce-run: Open MPI: " in result.stderr
    assert "-x RINGREDUCE_FUSION_THRESHOLD" in result.stderr, result.stderr
    assert "-H localhost:2" in result.stderr


def test_exit_status_passes_through():
    result = launch(sys.executable, "-np", "2", sys.executable, CHECK, env={"EXIT_WITH": "3"})
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])


def answer(capfd, *flags, environ=None):
    """The launcher's exit status, stdout and stderr for `flags`, run in this process: for
    what it answers before starting a job (a refusal, --check-build), which needs no
    interpreter of its own (that costs 2 s a test to import torch). capfd also catches the
    output of any job it should wrongly start."""
    try:
        code = launcher.run(list(flags), environ)
    except SystemExit as exit:          # argparse's own refusals
        code = exit.code
    out, err = capfd.readouterr()
    return code, out, err


def test_check_build(capfd):
    code, out, _ = answer(capfd, "--check-build")
    assert code == 0
    assert "[X] PyTorch" in out and "[X] MPI" in out
    assert "[ ] NCCL" in out and "[ ] Gloo" in out


@pytest.mark.parametrize("flags,message", [
    (["--gloo"], "--gloo is not supported: ringreduce runs on MPI only"),
    (["--host-discovery-script", "d.sh"], "elastic jobs of changing size"),
    (["--min-np", "2"], "elastic jobs of changing size"),
    (["--max-num-proc", "4"], "--max-np is not supported: elastic jobs of changing size"),
    (["-i", "key"], "--ssh-identity-file is not supported"),
    (["--config-file", "c.yaml"], "reads no config file"),
    (["--mpi-threads-disable"], "needs MPI's thread support"),
])
def test_flags_it_cannot_honour_are_refused(capfd, flags, message):
    code, out, err = answer(capfd, "-np", "2", *flags, sys.executable, CHECK)
    assert code == 2
    assert message in err
    assert "OK rank" not in out


@pytest.mark.parametrize("count", ["0", "-3", "two"])
def test_a_process_count_that_is_not_positive_is_refused(capfd, count):
    code, out, err = answer(capfd, "-np", count, sys.executable, CHECK)
    assert code == 2
    assert f"argument -np/--num-proc: must be a positive integer, got '{count}'" in err
    assert "OK rank" not in out


def test_unknown_flag_and_missing_np_are_errors(capfd):
    code, _, err = answer(capfd, "-np", "2", "--bogus", sys.executable, CHECK)
    assert code == 2 and "unrecognized arguments: --bogus" in err
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    code, out, err = answer(capfd, sys.executable, CHECK, environ=env)
    assert code == 2 and "-np is required" in err
    assert "OK rank" not in out


def test_a_hostfile_that_cannot_be_read_is_named(capfd, tmp_path):
    missing = tmp_path / "no-such-hosts"
    code, out, err = answer(capfd, "-np", "2", "--hostfile", str(missing), sys.executable, CHECK)
    assert code == 2 and f"cannot read the hostfile '{missing}'" in err, err
    assert "Traceback" not in err and "OK rank" not in out


def test_horovodruns_other_flags_are_taken_whole_and_named_when_they_change_nothing():
    """No abbreviations (horovodrun's --mpi is its controller switch, not --mpi-args with the
    program as its value); flags for what ringreduce has no use for are accepted, each named
    on stderr; the default switches silently."""
    args = launcher.parser().parse_args(
        ["--mpi", "-np", "2", "--hierarchical-allreduce", "--log-level", "INFO",
         "-prefix-timestamp", "--stall-check", "--no-autotune", "-cb", "python", "x.py"])
    assert args.mpi_args == "" and args.command == ["python", "x.py"] and args.check_build
    assert launcher.refused(args) is None
    assert launcher.ignored(args) == [
        "ringreduce-run: ignoring --hierarchical-allreduce: ringreduce always reduces within "
        "each node first, then between the nodes",
        "ringreduce-run: ignoring --log-level: ringreduce logs through Python's logging, as the "
        "logger 'ringreduce'",
        "ringreduce-run: ignoring --prefix-output-with-timestamp: pass your MPI's own option "
        "through --mpi-args (Open MPI: --timestamp-output)"]
    with pytest.raises(SystemExit):
        launcher.parser().parse_args(["--mpi-arg", "-x", "-np", "2", "python", "x.py"])


def test_open_mpi_gets_the_environment_horovodrun_passes(tmp_path):
    """Every variable but those horovodrun keeps back (env_util.is_exportable): a job's own
    (DATA_DIR) reaches ranks on other hosts; --binding-args go before --mpi-args."""
    args = launcher.parser().parse_args(["-np", "2", "--binding-args=--bind-to core",
                                         "--mpi-args=--tag-output", "python", "x.py"])
    env = {"PATH": "/bin", "DATA_DIR": "/data", "OLDPWD": "/", "CUDA_VISIBLE_DEVICES": "0",
           "BASH_FUNC_f%%": "() {  :\n}"}
    cmd = launcher.build_command(args, "mpirun", launcher.OPEN_MPI, env, str(tmp_path))
    assert cmd == ["mpirun", "-n", "2", "-x", "DATA_DIR", "-x", "PATH", "--bind-to", "core",
                   "--tag-output", "python", "x.py"]


def test_translation_for_each_launcher(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=4\nnode2 slots=2\n")
    args = launcher.parser().parse_args(
        ["-np", "6", "--hostfile", str(hostfile), "--stall-check-warning-time-seconds", "5",
         "-p", "2222", "python", "train.py", "--lr", "0.1"])
    env = {"PATH": "/bin", **launcher.settings_environment(args)}
    assert env["RINGREDUCE_STALL_CHECK_TIME"] == "5"
    ompi = launcher.build_command(args, "mpirun", launcher.OPEN_MPI, env, str(tmp_path))
    assert ompi[:3] == ["mpirun", "-n", "6"]
    assert ["--hostfile", str(hostfile)] == ompi[3:5]
    assert ["--mca", "plm_rsh_args", "-p 2222"] == ompi[5:8]
    assert "RINGREDUCE_STALL_CHECK_TIME" in ompi and ompi[-4:] == ["python", "train.py",
                                                                     "--lr", "0.1"]
    with pytest.raises(launcher.LaunchError, match="ssh/config"):
        launcher.build_command(args, "mpiexec", launcher.HYDRA, env, str(tmp_path))
    args.ssh_port = None
    hydra = launcher.build_command(args, "mpiexec", launcher.HYDRA, env, str(tmp_path))
    assert hydra[:4] == ["mpiexec", "-n", "6", "-f"]
    assert open(hydra[4]).read() == "node1:4\nnode2:2\n"
    slurm = argparse.Namespace(**{**vars(args), "np": None, "hostfile": None})
    assert launcher.build_command(slurm, "mpiexec", launcher.HYDRA, {"SLURM_JOB_ID": "7"},
                                  str(tmp_path))[1:] == ["python", "train.py", "--lr", "0.1"]


def test_sigterm_to_the_launcher_stops_the_job():
    env = worker_env({"ROUNDS": "400"})
    proc = subprocess.Popen([sys.executable, "-m", "ringreduce.run", "-np", "2", sys.executable,
                             str(WORKERS / "reliability_check.py"), "stoppable"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    started, seen = False, []
    watchdog = threading.Timer(60, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()                # the readline loop below ends by then whatever happens
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("PID rank 1"):
                started = True
                break
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        watchdog.cancel()           # (never fires into a later test)
        with contextlib.suppress(ProcessLookupError):   # the group: mpiexec and ranks too
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert started, f"the job never started its ranks: {''.join(seen)[-3000:]}"
    assert proc.returncode not in (0, -signal.SIGKILL), proc.returncode
    assert "OK rank" not in proc.stdout.read()
