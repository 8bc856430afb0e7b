"""Every public name of `horovod.torch` 0.28 exists in ringreduce, and takes Horovod's
parameters in Horovod's order (ours may add more after them), so scripts calling by position
or by keyword run unchanged; the exception types and env aliases behave as Horovod's users
expect; and the multi-rank parity workers run at 1-4 ranks."""
import inspect
import json

import pytest

from conftest import PATHS, RANK_COUNTS, run_ok, shared_script
import ringreduce as hvd
import ringreduce.torch as as_torch
from ringreduce.core import config

TENSOR_OPS = ["average", "name", "op", "prescale_factor", "postscale_factor", "process_set"]
# name -> Horovod's parameters, in order (None: not a function, or no parameters to compare)
HOROVOD_TORCH_0_28 = {
    "init": ["comm", "process_sets"], "shutdown": [], "is_initialized": [],
    "start_timeline": ["file_path", "mark_cycles"], "stop_timeline": [],
    "size": [], "local_size": [], "cross_size": [], "rank": [], "local_rank": [],
    "cross_rank": [], "is_homogeneous": [],
    "mpi_threads_supported": [], "mpi_enabled": [], "mpi_built": [], "gloo_enabled": [],
    "gloo_built": [], "nccl_built": [], "ddl_built": [], "ccl_built": [], "cuda_built": [],
    "rocm_built": [], "gpu_available": ["ext_base_name", "verbose"],
    "split_list": None, "check_extension": None,
    "ProcessSet": None, "global_process_set": None, "add_process_set": ["process_set"],
    "remove_process_set": ["process_set"],
    "allreduce": ["tensor", "average", "name", "compression", "op", "prescale_factor",
                  "postscale_factor", "process_set"],
    "allreduce_async": ["tensor"] + TENSOR_OPS,
    "allreduce_": ["tensor"] + TENSOR_OPS,
    "allreduce_async_": ["tensor"] + TENSOR_OPS,
    "grouped_allreduce": ["tensors", "average", "name", "compression", "op", "prescale_factor",
                          "postscale_factor", "process_set"],
    "grouped_allreduce_async": ["tensors"] + TENSOR_OPS,
    "grouped_allreduce_": ["tensors"] + TENSOR_OPS,
    "grouped_allreduce_async_": ["tensors"] + TENSOR_OPS,
    "sparse_allreduce_async": ["tensor", "name", "op", "process_set"],
    "allgather": ["tensor", "name", "process_set"],
    "allgather_async": ["tensor", "name", "process_set"],
    "grouped_allgather": ["tensors", "name", "process_set"],
    "grouped_allgather_async": ["tensors", "name", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async_": ["tensor", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "process_set"],
    "alltoall_async": ["tensor", "splits", "name", "process_set"],
    "reducescatter": ["tensor", "name", "compression", "op", "process_set", "prescale_factor",
                      "postscale_factor"],
    "reducescatter_async": ["tensor", "name", "op", "process_set", "prescale_factor",
                            "postscale_factor"],
    "grouped_reducescatter": ["tensors", "name", "compression", "op", "process_set",
                              "prescale_factor", "postscale_factor"],
    "grouped_reducescatter_async": ["tensors", "name", "op", "process_set", "prescale_factor",
                                    "postscale_factor"],
    "join": ["device"], "barrier": ["process_set"], "poll": ["handle"],
    "synchronize": ["handle"],
    "Average": None, "Sum": None, "Adasum": None, "Min": None, "Max": None, "Product": None,
    "Compression": None,
    "DistributedOptimizer": ["optimizer", "named_parameters", "compression",
                             "backward_passes_per_step", "op", "gradient_predivide_factor",
                             "num_groups", "groups", "sparse_as_dense", "process_set"],
    "broadcast_parameters": ["params", "root_rank"],
    "broadcast_optimizer_state": ["optimizer", "root_rank", "model"],
    "broadcast_object": ["obj", "root_rank", "name", "process_set"],
    "allgather_object": ["obj", "name", "process_set"],
    "SyncBatchNorm": None, "elastic": None,
}
ELASTIC = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


@pytest.mark.parametrize("name", sorted(HOROVOD_TORCH_0_28))
def test_every_horovod_torch_name_exists_with_horovods_parameters(name):
    import ringreduce.torch as hvd_torch      # `import ringreduce.torch as hvd` works too

    for module in (hvd, hvd_torch):
        assert hasattr(module, name), f"{module.__name__}.{name} is missing"
    expected = HOROVOD_TORCH_0_28[name]
    if expected is None:
        return
    ours = list(inspect.signature(getattr(hvd, name)).parameters)
    assert ours[:len(expected)] == expected, f"{name}{tuple(ours)} vs Horovod's {expected}"


@pytest.mark.parametrize("name", ELASTIC)
def test_every_horovod_torch_elastic_name_exists(name):
    assert hasattr(hvd.elastic, name)


def test_horovods_submodules_are_attributes_with_their_names():
    """horovod.torch's submodules, reached as attributes (hvd.compression.Compressor), through
    `import ringreduce as hvd` and `import ringreduce.torch as hvd` alike."""
    for package in (hvd, as_torch):
        assert package.mpi_ops.allreduce_async_ is hvd.allreduce_async_
        assert package.mpi_ops.Average is hvd.Average
        assert package.functions.broadcast_optimizer_state is hvd.broadcast_optimizer_state
        assert package.optimizer.DistributedOptimizer is hvd.DistributedOptimizer
        assert package.sync_batch_norm.SyncBatchNorm is hvd.SyncBatchNorm
        assert package.compression.Compression is hvd.Compression
        assert issubclass(package.compression.FP16Compressor, package.compression.Compressor)
        assert package.compression.NoneCompressor is package.compression.Compressor


def test_ops_and_compression_match_horovods_values():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert {"none", "fp16"} <= set(vars(hvd.Compression))


def test_errors_are_caught_by_horovods_except_clauses():
    assert issubclass(hvd.RingReduceError, RuntimeError)
    assert hvd.HorovodInternalError is hvd.RingReduceError
    for error in (hvd.MismatchError, hvd.JoinedError, hvd.ConsistencyError):
        assert issubclass(error, hvd.HorovodInternalError)
    assert issubclass(hvd.NotInitializedError, ValueError)      # Horovod: ValueError
    assert issubclass(hvd.UnsupportedError, NotImplementedError)
    assert issubclass(hvd.UsageError, AssertionError)
    assert issubclass(hvd.ArgumentTypeError, TypeError)         # ours before
    assert issubclass(hvd.ArgumentTypeError, ValueError)        # Horovod's alltoall splits
    assert issubclass(hvd.NotContiguousError, ValueError)       # Horovod: ValueError
    with pytest.raises(ValueError, match="before ringreduce.init"):
        hvd.rank()


def test_horovod_environment_variables_are_honoured_or_named(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1234")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "7")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t.json")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "0")
    settings = config.Settings.load()
    assert (settings.fusion_threshold, settings.stall_check_time, settings.timeline) == \
        (1234, 7.0, "/tmp/t.json")
    assert config.ignored_horovod_variables() == ["HOROVOD_CACHE_CAPACITY", "HOROVOD_CYCLE_TIME"]
    monkeypatch.setenv("RINGREDUCE_FUSION_THRESHOLD", "99")     # ours wins over Horovod's
    assert config.Settings.load().fusion_threshold == 99
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "1")
    assert config.Settings.load().stall_check_time == 0.0


def test_init_warns_once_about_horovod_variables_it_ignores():
    result = run_ok(2, "topology_check.py", timeout=60, env={"HOROVOD_CYCLE_TIME": "5",
                                                              "PYTHONWARNINGS": "default"})
    assert result.output.count("ignoring Horovod settings it has no use for: "
                               "HOROVOD_CYCLE_TIME") == 1, result.output


@shared_script("parity", "parity_check.py", timeout=lambda n: 400)
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_parity_and_every_collectives_gradient_at_every_rank_count(n, shared_run):
    """parity_check's checks, then the gradient of every collective against a single-process
    reference (autograd_check's); a failure names its check and rank."""
    shared_run()


@shared_script("join", "join_check.py", timeout=lambda n: 240)
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_join_with_every_rank_joining_first(n, shared_run):
    """Each rank joins first in turn (the output's last 'JOIN' line names the case that
    failed)."""
    shared_run()


JOIN_PATHS = {"mpi-gather, rank 1 first": {**PATHS["mpi-gather"], "JOIN_FIRST": "1"},
              "shm-blocks, rank 1 first": {**PATHS["shm-blocks"], "JOIN_FIRST": "1"},
              "2 nodes of 2, rank 2 first": {"RINGREDUCE_SIMULATED_NODES": "2",
                                             "JOIN_FIRST": "2"}}


@shared_script("join on other paths", "join_check.py", args=lambda n: [json.dumps(JOIN_PATHS)],
               timeout=lambda n: 360)
@pytest.mark.parametrize("n", [4])
def test_join_on_other_data_paths_and_across_simulated_nodes(n, shared_run):
    """At 4 ranks, one setting per path (a failure names its setting)."""
    shared_run()
