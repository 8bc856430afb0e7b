"""torch.distributed on the "ringreduce" backend (ringreduce/distributed/__init__.py) under a real mpiexec.

Usage: distributed_check.py [lightning]

Every collective against gloo's result on a gloo group of the same launch (reductions, within
float tolerance) or a reference built from every rank's inputs (data movement, exact), with our
results bitwise identical across ranks; subgroups; send/recv (a sender's tensor of another
size or dtype: an error, the receiver's tensor untouched; receives matched in the order made;
a receive no one waits for yet still takes a peer's large send); the errors; the dtypes only
moved (bool, uint16/64, float8, complex64), bool reductions, DDP with a bool buffer; DDP (plain,
small buckets, gradient_as_bucket_view, static_graph, find_unused_parameters, no_sync with
accumulation, fp16_compress_hook, hooks whose callbacks start collectives: PowerSGD) against
one process on the whole batch; DDP's join() with uneven inputs and ZeroRedundancyOptimizer
against gloo; FSDP (fully_shard) against DDP, its state saved and loaded by
torch.distributed.checkpoint (also async_save on a group of its own beside training calls) and
its whole state loaded from rank 0 alone (broadcast_from_rank0); torchmetrics syncing to the
whole-data value; Hugging Face Accelerate (prepare, gather_for_metrics) against one process;
pipelining (GPipe, 1F1B) and tensor parallelism against one process; thousands of small calls
on both front doors leaving no objects alive.
With `lightning` (2 ranks): first our Lightning strategy, which starts torch.distributed's
default group on our backend (torchmetrics syncs through it), then Lightning's own DDP
strategy with process_group_backend="ringreduce", which starts it by env:// (torch's
init_process_group), then a stalled rank's report. Each case prints "CASE <name> ok rank <r>".

The cases live by subject in distributed_collectives.py, distributed_peers.py,
distributed_training.py and distributed_lightning.py; distributed_common.py starts ringreduce
and holds what they share.
"""
import time

import torch.distributed as dist

import distributed_common as common
import ringreduce.distributed as rrd
from checks import run_cases
from distributed_collectives import (
    case_all_gather, case_all_reduce, case_all_reduce_coalesced, case_all_to_all,
    case_bool_and_complex_in_every_reduction, case_broadcast, case_calls_keep_nothing_alive,
    case_coalesced, case_dtypes_moved_and_bool_reduced, case_in_flight_waited_by_tensor,
    case_reduce_gather_scatter,
    case_inference_tensors_written, case_reduce_scatter, case_small_works_held_or_dropped,
    case_sparse_all_reduce, case_strided_inputs, case_synchronous_all_reduce,
    case_works_polled_and_their_values)
from distributed_common import LIGHTNING, n, r
from distributed_lightning import (
    case_a_group_does_not_outlive_a_restart, case_init_that_torch_refuses_then_again,
    case_lightning_ddp, case_lightning_ringreduce_strategy, case_stall)
from distributed_peers import (
    case_errors, case_one_rank_calls_another_kind, case_one_rank_errs,
    case_one_rank_names_another_root, case_one_rank_refuses_its_inputs, case_send_recv,
    case_subgroup, case_threads_each_on_a_group_of_its_own)
from distributed_training import (
    case_accelerate, case_ddp, case_ddp_bucket_fails_on_one_rank,
    case_ddp_hook_raises_on_one_rank, case_ddp_hooks_that_start_collectives,
    case_ddp_join_and_zero, case_fsdp, case_pipelining, case_tensor_parallel,
    case_torchmetrics)


# ---------------------------------------------------------------- run

def announced(case):
    def run():
        start = time.monotonic()
        case()
        print(f"CASE {case.__name__} ok rank {r} ({time.monotonic() - start:.1f} s)", flush=True)

    run.__name__ = case.__name__
    return run


first = [case_lightning_ringreduce_strategy, case_lightning_ddp] if LIGHTNING else []
run_cases([announced(case) for case in first], r)
if not dist.is_initialized():
    rrd.init_process_group()
assert dist.get_backend() == "ringreduce" and dist.get_world_size() == n
common.GLOO = dist.new_group(backend="gloo")
cases = [case_all_reduce, case_synchronous_all_reduce, case_all_reduce_coalesced,
         case_coalesced, case_broadcast, case_all_gather, case_calls_keep_nothing_alive,
         case_reduce_scatter, case_all_to_all, case_strided_inputs, case_reduce_gather_scatter,
         case_send_recv, case_subgroup,
         case_threads_each_on_a_group_of_its_own, case_errors,
         case_one_rank_errs, case_one_rank_refuses_its_inputs,
         case_one_rank_calls_another_kind, case_one_rank_names_another_root,
         case_sparse_all_reduce,
         case_dtypes_moved_and_bool_reduced, case_bool_and_complex_in_every_reduction,
         case_works_polled_and_their_values, case_small_works_held_or_dropped,
         case_inference_tensors_written, case_in_flight_waited_by_tensor, case_ddp,
         case_ddp_hooks_that_start_collectives, case_ddp_hook_raises_on_one_rank,
         case_ddp_bucket_fails_on_one_rank, case_ddp_join_and_zero, case_fsdp,
         case_torchmetrics, case_accelerate, case_pipelining, case_tensor_parallel,
         case_a_group_does_not_outlive_a_restart, case_init_that_torch_refuses_then_again]
# Alone, a rank has no peer to send to, to make a subgroup of two with, or to disagree with.
PEERS_NEEDED = (case_send_recv, case_subgroup, case_errors, case_one_rank_errs,
                case_one_rank_refuses_its_inputs, case_one_rank_calls_another_kind,
                case_one_rank_names_another_root)
cases = [case for case in cases if n > 1 or case not in PEERS_NEEDED]
run_cases([announced(case) for case in cases + ([case_stall] if LIGHTNING else [])], r)
dist.destroy_process_group()
print(f"OK rank {r}", flush=True)
