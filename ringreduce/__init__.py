"""ringreduce: Horovod-style data-parallel training for PyTorch over MPI.

`import ringreduce as hvd` in a script written for `horovod.torch` and run it with mpiexec.
"""
from .collectives import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                          allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                          alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                          broadcast_async_, grouped_allreduce, grouped_allreduce_,
                          grouped_allreduce_async, grouped_allreduce_async_, poll, reducescatter,
                          reducescatter_async, synchronize)
from .compression import Compression
from .engine import Handle
from . import checkpoint
from .errors import (ConsistencyError, HorovodInternalError, MismatchError, NotInitializedError,
                     RingReduceError)
from .kernels import ReduceOp
from .objects import (allgather_object, broadcast_object, broadcast_optimizer_state,
                      broadcast_parameters, check_consistency)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm
from .world import (cross_rank, cross_size, init, is_initialized, local_rank, local_size, rank,
                    shutdown, size, start_timeline, stop_timeline)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "poll",
    "synchronize", "Handle", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "check_consistency",
    "checkpoint", "SyncBatchNorm", "start_timeline", "stop_timeline",
    "Compression", "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "RingReduceError", "HorovodInternalError", "MismatchError", "NotInitializedError",
    "ConsistencyError",
]
