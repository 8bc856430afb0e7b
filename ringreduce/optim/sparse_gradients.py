"""Sparse gradients in a `DistributedOptimizer`, as Horovod handles them: gathered from every
rank, not reduced in a bucket (`gather`), or, with sparse_as_dense, reduced densely in their
bucket and handed back to the optimizer sparse (`hand_back_sparse`), so that SparseAdam and
the like step with them; those of fewer passes than a step's are final at synchronize()
(`short_of_passes`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..api.collectives import sparse_allreduce_async
from ..sets.process_set import ProcessSet

Named = Sequence[tuple[str, torch.Tensor]]


def gather(params: Named, prefix: str, op: Any, process_set: ProcessSet
           ) -> list[tuple[torch.Tensor, Callable[[], Optional[torch.Tensor]]]]:
    """Start Horovod's sparse allreduce of each parameter's gradient (an empty one where this
    rank has none: every rank takes part); each comes with the call that waits for its result,
    the gradient to set."""
    return [(p, sparse_allreduce_async(_sparse_or_empty(p), f"{prefix}sparse.{name}", op,
                                       process_set))
            for name, p in params]


def short_of_passes(params: Named, counts: dict[int, int], passes: int) -> list[torch.Tensor]:
    """The parameters whose gradient is sparse after fewer than `passes` backward passes
    (used in some passes only; `counts` by id): final at synchronize(), as Horovod's
    synchronize reduces what its hooks did not. Left in their buckets, they were zeros there
    and kept this rank's own values in .grad (the ranks trained apart, silently)."""
    return [p for _, p in params if counts.get(id(p), passes) < passes
            and p.grad is not None and p.grad.layout == torch.sparse_coo]


def hand_back_sparse(named: Named, densified: set[int]) -> None:
    """A gradient that came sparse on this rank (its id in `densified`) and was reduced densely
    goes back sparse: the reduced dense gradient's nonzero entries, coalesced."""
    for _, p in named:
        if id(p) in densified and p.grad is not None and p.grad.layout == torch.strided:
            p.grad = p.grad.to_sparse()


def _sparse_or_empty(p: torch.Tensor) -> torch.Tensor:
    """p's sparse gradient as backward made it (not coalesced: Horovod gathers it as it is, and
    the optimizer's coalesce then adds up every rank's entries at once), or an empty one where
    this rank has none."""
    if p.grad is not None and p.grad.layout == torch.sparse_coo:
        return p.grad
    empty_values = torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64, device=p.device),
                                   empty_values, p.shape)
