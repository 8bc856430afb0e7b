"""ringreduce.runner.run (Horovod's horovod.run) under the real mpiexec: return values in rank
order, a rank that raises, refused arguments."""
import sys
import time

import pytest
import torch

import ringreduce as hvd
from ringreduce import runner


def rank_size_and_sum(base, scale=1):
    """A function of this module: it travels by reference (the ranks get the caller's
    sys.path to import this module)."""
    hvd.init()
    total = hvd.allreduce(torch.tensor(scale * (hvd.rank() + base)), op=hvd.Sum)
    return hvd.rank(), hvd.size(), total.item()


def path_seen():
    """This rank's sys.path."""
    return list(sys.path)


def expected(n, base, scale=1):
    return [(r, n, scale * sum(range(n)) + scale * base * n) for r in range(n)]


@pytest.mark.timeout(60)
def test_module_function_in_rank_order_with_np():
    with pytest.warns(DeprecationWarning, match="np is deprecated"):
        results = runner.run(rank_size_and_sum, args=(10,), kwargs={"scale": 2}, np=2)
    assert results == expected(2, 10, scale=2)


@pytest.mark.timeout(60)
def test_leaving_the_choice_of_controller_to_the_runner_runs_over_mpi():
    """Horovod's MNIST example passes use_mpi=False, use_gloo=False: "choose"; so does
    use_mpi=False alone, and use_mpi=True asks for MPI."""
    for choice in ({"use_mpi": False, "use_gloo": False}, {"use_mpi": False},
                   {"use_mpi": True}):
        assert runner.run(rank_size_and_sum, args=(1,), num_proc=2, **choice) == \
            expected(2, 1), choice


@pytest.mark.timeout(60)
def test_closure_by_value_at_three_ranks():
    """A closure and a lambda travel by value; values come back as returned (a tensor and
    a lambda too)."""
    offset, scale = 100, 3

    def closure():
        hvd.init()
        rank, size, total = rank_size_and_sum(offset, scale=scale)
        return rank, size, total, torch.full((2,), float(rank)), lambda x: x + rank

    results = runner.run(lambda: closure(), num_proc=3)
    assert [r[:3] for r in results] == expected(3, offset, scale)
    for rank, result in enumerate(results):
        assert torch.equal(result[3], torch.full((2,), float(rank)))
        assert result[4](1) == rank + 1


def fail_on_rank_one():
    """Rank 1 raises while rank 0 waits for it in an allreduce: without the abort, rank 0
    would wait forever."""
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one gives up")
    hvd.allreduce(torch.ones(3), name="waits.for.rank.one")
    return "unreachable"


@pytest.mark.timeout(60)
def test_a_rank_that_raises_ends_the_job_and_is_named():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        runner.run(fail_on_rank_one, num_proc=2)
    seconds = time.monotonic() - start
    message = str(error.value)
    assert "rank 1 raised ValueError: rank one gives up" in message, message
    assert "rank 0 raised" not in message, message
    assert "MPI launcher exit status" in message and "--- rank 1 ---" in message
    assert seconds < 30, f"took {seconds:.1f}s: the other rank waited"


@pytest.mark.parametrize("argument,value,why", [
    ("min_num_proc", 2, "elastic jobs of changing size"),
    ("host_discovery_script", "discover.sh", "elastic jobs of changing size"),
    ("use_gloo", True, "ringreduce runs on MPI only"),
    ("network_interfaces", ["eth0"], "MPI picks the network"),
    ("ssh_identity_file", "~/.ssh/id", "~/.ssh/config"),
])
def test_arguments_that_need_horovods_driver_are_refused(argument, value, why):
    with pytest.raises(ValueError, match=f"{argument}=.* is not supported: .*{why}"):
        runner.run(rank_size_and_sum, args=(0,), num_proc=2, **{argument: value})


def test_hosts_and_hostfile_together_are_refused():
    with pytest.raises(ValueError, match="hosts or hostfile, not both"):
        runner.run(rank_size_and_sum, args=(0,), num_proc=2, hosts="localhost:2",
                   hostfile="hosts")


@pytest.mark.timeout(60)
def test_function_that_never_initialises():
    """Horovod's functions call hvd.init() themselves; one that does not runs too."""
    assert runner.run(lambda: (hvd.is_initialized(), "plain"), num_proc=2) == \
        [(False, "plain")] * 2


@pytest.mark.timeout(60)
def test_the_ranks_search_the_callers_path_first_in_its_order(tmp_path):
    """A directory the caller put first (a checkout before site-packages) stays first on the
    ranks, where it once came after their own entries."""
    sys.path.insert(0, str(tmp_path))
    try:
        caller = list(sys.path)
        seen, = runner.run(path_seen, num_proc=1)
    finally:
        sys.path.remove(str(tmp_path))
    assert seen[:len(caller)] == caller, (seen[:4], caller[:4])
