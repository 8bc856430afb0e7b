"""`hvd.elastic` (Horovod's elastic API) at 1-3 ranks under a real mpiexec, plus its pure logic
in one process."""
import pytest

from conftest import PATHS, run_mpi, shared_script
from ringreduce import elastic
from ringreduce.core.errors import HorovodInternalError

BATCHES_PER_RANK = {1: 12, 2: 6, 3: 4}      # elastic_check.py: 24 samples, batches of 2


@shared_script("elastic", "elastic_check.py")
@pytest.mark.parametrize("n", [1, 2])
def test_elastic_training_sync_commit_restore_and_resets(n, shared_run):
    check_resets(n, shared_run().output)


@shared_script("elastic on MPI's paths", "elastic_check.py", env=PATHS["mpi-ring"])
@pytest.mark.parametrize("n", [3])
def test_elastic_at_three_ranks_on_mpis_paths(n, shared_run):
    """Over MPI's paths (no shared memory): the reset agreement then meets the others'
    collective there too (the signature check by Iallgather, which the gather and ring paths
    share)."""
    check_resets(n, shared_run().output)


def check_resets(n: int, output: str) -> None:
    # Rank 0 reports each reset, with every rank's error; the failures injected on every rank
    # (and, from 2 ranks on, one rank's alone) are recovered from, then the limit ends a
    # deterministic error.
    resets = 3 if n > 1 else 2
    assert f"elastic reset {resets} of at most 5 after" in output, output[-3000:]
    assert f"elastic reset {resets + 1} of at most 5" not in output
    if n > 1:
        # the rank that failed is named first; the others' collectives stopped for the reset
        alone = (f"elastic reset 3 of at most 5 after rank {n - 1}: RingReduceError: injected "
                 f"failure at (2, {BATCHES_PER_RANK[n] - 1}, 'before forward') on rank {n - 1}; "
                 "then, stopped for the reset, rank 0: ResetPending: ")
        assert alone in output, output[-3000:]
        assert (f"ranks [{n - 1}] wait in 'allgather_object.ringreduce.elastic.reset' after an "
                "error") in output
    assert output.count("elastic reset after a host update") == 2
    if n > 1:   # a failure inside a bucket's allreduce on one rank: the job restarts
        assert output.count("a failure inside a collective shut a set down; shutdown() and "
                            "init() on every rank") == (2 if n > 2 else 1), output[-3000:]
        assert (f"failed here (MemoryError: injected inside a collective on rank {n - 1}), "
                "and the other members were told") in output, output[-3000:]
    if n > 1:   # plain collectives: a lone failure stops the others' for the reset
        assert (f"after rank {n - 1}: RingReduceError: injected failure on rank {n - 1} alone; "
                "then, stopped for the reset, rank 0: ResetPending") in output, output[-3000:]


def test_killed_rank_ends_an_elastic_job():
    result = run_mpi(2, "elastic_check.py", "kill", timeout=60)
    assert result.returncode != 0
    assert result.seconds < 30, f"took {result.seconds:.1f}s to exit"
    assert "OK rank" not in result.output


@pytest.mark.parametrize("n", [3])
def test_restart_without_a_rank_that_left_for_good_ends_the_job(n):
    """A restart (elastic's, after a failure inside a collective) that a rank left for good
    does not wait for it in init(): every rank that restarts raises, naming it."""
    result = run_mpi(n, "elastic_check.py", "leave", timeout=60)
    assert result.returncode != 0
    assert result.seconds < 30, f"took {result.seconds:.1f}s to exit"
    assert f"LEFT rank {n - 1}" in result.output, result.output[-3000:]
    for rank in range(n - 1):
        assert (f"REFUSED rank {rank}: ringreduce: rank {rank}: cannot restart the job: ranks "
                f"[{n - 1}] left it for good") in result.output, result.output[-3000:]


def test_reset_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(elastic.RESET_LIMIT_VARIABLE, raising=False)
    assert elastic.reset_limit() == elastic.DEFAULT_RESET_LIMIT == 5
    monkeypatch.setenv(elastic.RESET_LIMIT_VARIABLE, "0")
    assert elastic.reset_limit() == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv(elastic.RESET_LIMIT_VARIABLE, bad)
        with pytest.raises(ValueError, match=elastic.RESET_LIMIT_VARIABLE):
            elastic.reset_limit()


def test_horovods_names_and_exception_types():
    for name in ("run", "TorchState", "ElasticSampler", "State", "ObjectState",
                 "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
                 "SamplerStateHandler", "get_handler_registry", "set_handler_registry",
                 "HostsUpdatedInterrupt", "HostUpdateResult"):
        assert name in elastic.__all__ and hasattr(elastic, name), name
    # An interrupt must not be caught as a failure (which would restore the commit).
    assert not issubclass(elastic.HostsUpdatedInterrupt, HorovodInternalError)
    assert elastic.HostsUpdatedInterrupt(True).skip_sync
    assert elastic.HostUpdateResult.mixed == (elastic.HostUpdateResult.added
                                              | elastic.HostUpdateResult.removed)
