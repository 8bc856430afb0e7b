"""ringreduce: Horovod-style data-parallel training for PyTorch over MPI.

`import ringreduce as hvd` in a script written for `horovod.torch` and run it with mpiexec.
"""
import sys

from . import checkpoint, elastic
from .api.collectives import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                              allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                              alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                              broadcast_async_, grouped_allgather, grouped_allgather_async,
                              grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                              grouped_allreduce_async_, grouped_reducescatter,
                              grouped_reducescatter_async, join, poll, reducescatter,
                              reducescatter_async, sparse_allreduce_async, synchronize)
from .api import compression
from .api.compression import Compression
from .api.objects import (allgather_object, broadcast_object, broadcast_parameters,
                          check_consistency)
from .api.sync_batch_norm import SyncBatchNorm
from .core import compile_boundary
from .core.errors import (ArgumentTypeError, CheckpointError, ConsistencyError,
                          HorovodInternalError, JoinedError, MismatchError, NotContiguousError,
                          NotInitializedError, RingReduceError, ShutDownError, UnsupportedError,
                          UsageError)
from .kernels.ops import ReduceOp
from .optim.optimizer import DistributedOptimizer
from .optim.optimizer_state import broadcast_optimizer_state
from .sets.handles import Handle
from .sets.process_set import ProcessSet, global_process_set
from .sets.process_sets import add_process_set, remove_process_set
from .sets.world import (ccl_built, check_extension, cross_rank, cross_size, cuda_built, ddl_built,
                         gloo_built, gloo_enabled, gpu_available, init, is_homogeneous,
                         is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                         mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                         split_list, start_timeline, stop_timeline)

from .core.version import __version__

compile_boundary.install()      # torch.compile runs our code eagerly rather than tracing it

# horovod.torch's submodules, which scripts reach as its attributes (hvd.mpi_ops.Sum,
# hvd.functions.broadcast_object, hvd.compression.Compressor): here the package holds every
# name of theirs itself, and `compression` is our module of that name.
mpi_ops = functions = optimizer = sync_batch_norm = sys.modules[__name__]

__all__ = [
    # start-up and topology
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous",
    # build and environment queries
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "gpu_available",
    "split_list", "check_extension",
    # process sets
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    # collectives
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "Handle",
    # training
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object", "check_consistency", "checkpoint", "SyncBatchNorm",
    "elastic",
    "start_timeline", "stop_timeline", "Compression",
    # ops
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    # errors
    "RingReduceError", "HorovodInternalError", "MismatchError", "NotInitializedError",
    "JoinedError", "ShutDownError", "UnsupportedError", "UsageError", "ConsistencyError",
    "CheckpointError", "ArgumentTypeError", "NotContiguousError",
]
