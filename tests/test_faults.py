"""A failing, killed or stalled rank ends the job quickly with a message; nothing hangs."""
import pytest

from conftest import run_mpi, shared_script

STALL_REPORTS = {"RINGREDUCE_STALL_CHECK_TIME": "1"}


@pytest.mark.parametrize("n", [2, 3])
def test_exception_in_backward_on_one_rank_aborts_the_job(n):
    """Rank 1's backward raises while the others wait in its gradients' allreduce. (An
    exception in a rank's own code while the others wait: test_world.py.)"""
    message = "injected failure in backward on rank 1"
    result = run_mpi(n, "fault_check.py", "raise_in_backward", "1", timeout=60)
    assert result.returncode != 0
    assert result.seconds < 30, f"took {result.seconds:.1f}s to exit"
    assert result.output.count(message) == 1, result.output[-3000:]   # printed once
    assert "rank 1 raised an uncaught exception; aborting the job" in result.output
    assert "OK rank" not in result.output


@pytest.mark.parametrize("n,nodes", [(2, "0"), (4, "0"), (4, "2")])
def test_sigkilled_rank_ends_the_job(n, nodes):
    """Also across two simulated nodes, where the survivors wait in C for the dead rank's
    message between nodes."""
    result = run_mpi(n, "fault_check.py", "sigkill", str(n - 1), timeout=60,
                     env={"RINGREDUCE_SIMULATED_NODES": nodes})
    assert result.returncode != 0
    assert result.seconds < 30, f"took {result.seconds:.1f}s to exit"
    assert "OK rank" not in result.output


@shared_script("stall report", "fault_check.py", args=lambda n: ["sleep", "2"],
               timeout=lambda n: 90, env={**STALL_REPORTS, "FAULT_SLEEP": "3.5"})
@pytest.mark.parametrize("n", [3])
def test_stall_is_reported_with_missing_ranks_and_parameter_names(n, shared_run):
    result = shared_run()
    stall = [line for line in result.output.splitlines() if "ringreduce: stall" in line]
    assert stall, result.output[-3000:]
    assert any("which ranks [2] have not submitted" in line for line in stall), stall
    assert any("(parameters: 2.bias, 2.weight" in line for line in stall), stall
    assert all("rank 2 has waited" not in line for line in stall), stall


@pytest.mark.parametrize("n", [2])
@pytest.mark.parametrize("nodes", [
    pytest.param(nodes, marks=shared_script(
        f"stall report, small allreduce, {nodes} node(s)", "fault_check.py",
        args=lambda n: ["sleep_small", "1"], timeout=lambda n: 90,
        env={**STALL_REPORTS, "FAULT_SLEEP": "2.5", "RINGREDUCE_SIMULATED_NODES": nodes}))
    for nodes in ("1", "2")])
def test_stall_in_a_small_allreduce_is_reported(nodes, n, shared_run):
    """The small synchronous allreduce waits in C first (the node's slots, or the exchange
    between nodes): the stall watch must still see it, and name it."""
    result = shared_run()
    stall = [line for line in result.output.splitlines() if "ringreduce: stall" in line]
    assert any("allreduce 'allreduce.metric.3'" in line
               and "which ranks [1] have not submitted" in line
               for line in stall), result.output[-3000:]


def test_stall_shutdown_aborts_the_job():
    env = {"RINGREDUCE_STALL_CHECK_TIME": "1", "RINGREDUCE_STALL_SHUTDOWN_TIME": "3",
           "FAULT_SLEEP": "120"}
    result = run_mpi(2, "fault_check.py", "sleep", "1", env=env, timeout=90)
    assert result.returncode != 0
    assert result.seconds < 30, f"took {result.seconds:.1f}s to exit"
    assert "Shutting the job down after 3 s" in result.output
    assert "which ranks [1] have not submitted" in result.output


def test_a_rank_that_never_calls_init_is_reported_and_the_stall_shutdown_ends_the_job():
    """Rank 1 exits without init(): rank 0's init() waits for it (MPI's duplicate of the
    communicator is collective), saying so every check interval, then ends the job."""
    env = {"RINGREDUCE_STALL_CHECK_TIME": "1", "RINGREDUCE_STALL_SHUTDOWN_TIME": "3"}
    result = run_mpi(2, "fault_check.py", "skip_init", "1", env=env, timeout=60)
    assert result.returncode != 0
    assert result.seconds < 30, f"took {result.seconds:.1f}s to exit"
    assert "SKIPPED init() on rank 1" in result.output, result.output[-3000:]
    waited = "ringreduce: stall: rank 0 has waited 1 s in init() for the other ranks"
    assert waited in result.output, result.output[-3000:]
    assert "in init() for the other ranks of its communicator (2 ranks): every rank must " \
           "call init()" in result.output
    assert "Shutting the job down after 3 s" in result.output


@shared_script("stall while the signatures are gathered", "fault_check.py",
               args=lambda n: ["slow_gather", "1"], timeout=lambda n: 90,
               env={**STALL_REPORTS, "FAULT_SLEEP": "2.5"})
@pytest.mark.parametrize("n", [2])
def test_a_rank_late_to_a_mismatchs_report_is_waited_for_with_stall_reports(n, shared_run):
    """After the digests differ, every rank gathers the signatures for the MismatchError's
    message; rank 1 comes 2.5 s late to that gather: rank 0 says so while it waits (it
    waited silently, in a blocking allgather), then both get the error."""
    result = shared_run()
    stall = [line for line in result.output.splitlines() if "ringreduce: stall" in line]
    assert any("rank 0 has waited 1 s in collective #1 allreduce 'allreduce.mismatched'" in line
               for line in stall), result.output[-3000:]
    for rank in (0, 1):
        assert f"MISMATCH rank {rank}: " in result.output, result.output[-3000:]


@shared_script("shutdown waits for a late rank", "fault_check.py",
               args=lambda n: ["finish_late", "2"], timeout=lambda n: 90,
               env={**STALL_REPORTS, "RINGREDUCE_STALL_SHUTDOWN_TIME": "2", "FAULT_SLEEP": "2.5"})
@pytest.mark.parametrize("n", [3])
def test_ranks_waiting_in_shutdown_for_one_still_working_say_so_and_end_normally(n, shared_run):
    """Rank 2 works on (sleeps) after training while ranks 0 and 1 end their script: their
    shutdown() waits for it, naming it every check interval, and the job ends normally."""
    result = shared_run()
    for rank in (0, 1):
        assert (f"ringreduce: rank {rank} has waited 1 s in shutdown() for ranks [2] to shut "
                "down too") in result.output, result.output[-3000:]
    assert "Shutting the job down" not in result.output
