"""Sparse gradients in a `DistributedOptimizer`, as Horovod handles them: gathered from every
rank, not reduced in a bucket (`start`), or, with sparse_as_dense, reduced densely in their
bucket and handed back to the optimizer sparse (`hand_back_sparse`), so that SparseAdam and
the like step with them; those of fewer passes than a step's are final at synchronize()
(`short_of_passes`).

A parameter is reduced on its own from the step after its gradient first came sparse, and
each step the step's agreement (step_agreement.py) tells every rank how: gathered where some
rank's gradient is sparse, allreduced where some rank's is dense (as Horovod reduces each
gradient as it comes), every rank without a gradient taking part with an empty or zero one;
a parameter sparse on some ranks and dense on others is a MismatchError on every rank. A
gradient found sparse where the plan has the parameter in a bucket (its first sparse step, or
a rank that skipped it) is agreed on once more (`agree_on_new`), so that ranks without one
gather with the others, rather than meeting other collectives.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..api.collectives import allreduce_async, sparse_allreduce_async, synchronize
from ..api.objects import allgather_object
from ..core.errors import JoinedError, MismatchError
from ..sets.process_set import ProcessSet

Named = Sequence[tuple[str, torch.Tensor]]
Started = list[tuple[torch.Tensor, Callable[[], Optional[torch.Tensor]]]]


class SparseGradients:
    """(A part of GradientReduction: the attributes it reads are set in its `_setup` and
    plan.) Where a sparse gradient goes in the step, and the step's collectives of the
    parameters reduced on their own."""

    def _sparse_gradient_leaves(self, p: torch.Tensor) -> bool:
        """A final sparse gradient, as Horovod treats it: with sparse_as_dense in a set of more
        than one, densified here and handed back sparse after the reduction; else allgathered
        on its own at synchronize() (its bucket holds zeros for it until the next plan leaves
        it out). True where it has left its bucket."""
        key = id(p)
        if self._sparse_as_dense and self._set.size > 1:
            p.grad = p.grad.to_dense()
            self._densified.add(key)
            return False
        self._found_sparse.add(key)
        return key in self._planned_sparse

    def _sparse_collectives(self, new_sparse: list) -> list:
        """Start the step's collectives of the parameters reduced on their own (the plan's
        sparse ones and those found sparse this step, by the step's agreement in a set of more
        than one); the latter are the next plan's sparse ones, on every rank alike."""
        agreed = self._agreement.layouts() if self._agrees else None
        if self._agreement.new_sparse():     # (never set in a set of one: nothing submitted)
            new_sparse, mixed = agree_on_new(self._named, new_sparse, self._pass_count,
                                             self._prefix, self._process_set, self._set.ranks)
        else:
            mixed = None
        self._sparse.update(id(p) for _, p in new_sparse)
        if mixed is not None:
            raise mixed
        return start(self._sparse_params, agreed, new_sparse, self._pass_count, self._prefix,
                     self._op, self._reduction, self._compression, self._process_set,
                     self._set.ranks)


def layouts(params: Named, counts: dict[int, int]) -> list[tuple[bool, bool]]:
    """For each parameter (reduced on its own): whether this rank's gradient is sparse, and
    whether it is this rank's own dense one (`counts` by id: its backward passes this step)."""
    return [(_sparse(p), _own_dense(p, counts)) for _, p in params]


def agree_on_new(named: Named, found: Named, counts: dict[int, int], prefix: str,
                 process_set: ProcessSet, ranks: Sequence[int]
                 ) -> tuple[Named, Optional[MismatchError]]:
    """(Collective: where some rank found a sparse gradient of a parameter its plan has in a
    bucket.) Every rank's such parameters, in `named` order, to gather on every rank; and the
    error to raise where a rank's gradient of one of them is its own dense one."""
    index = {id(p): i for i, (_, p) in enumerate(named)}
    mine = ({index[id(p)] for _, p in found},
            {i for i, (_, p) in enumerate(named) if _own_dense(p, counts)})
    with _join_hint():
        reports = allgather_object(mine, name=f"{prefix}sparse.found", process_set=process_set)
    union = sorted(set().union(*(sparse for sparse, _ in reports)))
    for i in union:
        if any(i in dense for _, dense in reports):
            return [named[i] for i in union], _mixed(
                named[i][0], _where(ranks, reports, lambda r: i in r[0]),
                _where(ranks, reports, lambda r: i in r[1]))
    return [named[i] for i in union], None


def start(planned: Named, agreed: Optional[list[tuple[bool, bool]]], found: Named,
          counts: dict[int, int], prefix: str, op: Any, reduction: tuple, compression: Any,
          process_set: ProcessSet, ranks: Sequence[int]) -> Started:
    """The collectives of the parameters reduced on their own, started in the same order on
    every rank, each with the call that waits for the gradient to set: the plan's (`planned`,
    as `agreed`, the agreement's layouts: None in a set of one) and those `found` sparse this
    step. Sparse ones are gathered with Horovod's `op`, dense ones allreduced as the buckets
    are (`reduction`: op, prescale, postscale; `compression`)."""
    if agreed is None:
        agreed = layouts(planned, counts)
    for j, ((name, _), (sparse, dense)) in enumerate(zip(planned, agreed)):
        if sparse and dense:
            reports = allgather_object(layouts(planned, counts), name=f"{prefix}sparse.layouts",
                                       process_set=process_set)
            raise _mixed(name, _where(ranks, reports, lambda r: r[j][0]),
                         _where(ranks, reports, lambda r: r[j][1]))
    started: Started = []
    for (name, p), (_, dense) in zip(planned, agreed):
        if dense:
            started.append((p, _allreduce(p, counts, f"{prefix}dense.{name}", reduction,
                                          compression, process_set)))
        else:
            started.append((p, sparse_allreduce_async(_sparse_or_empty(p),
                                                      f"{prefix}sparse.{name}", op,
                                                      process_set)))
    for name, p in found:
        started.append((p, sparse_allreduce_async(_sparse_or_empty(p), f"{prefix}sparse.{name}",
                                                  op, process_set)))
    return [(p, _hinted(wait)) for p, wait in started]


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
                                   empty_values, p.shape, check_invariants=False)


def _sparse(p: torch.Tensor) -> bool:
    return p.grad is not None and p.grad.layout == torch.sparse_coo


def _own_dense(p: torch.Tensor, counts: dict[int, int]) -> bool:
    """A dense gradient that this rank's backward made this step (not one left from before)."""
    return counts.get(id(p), 0) > 0 and p.grad is not None and p.grad.layout == torch.strided


def _allreduce(p: torch.Tensor, counts: dict[int, int], name: str, reduction: tuple,
               compression: Any, process_set: ProcessSet) -> Callable[[], torch.Tensor]:
    """p's own dense gradient (zeros where this rank has none), allreduced as a bucket is."""
    op, prescale, postscale = reduction
    grad = p.grad if _own_dense(p, counts) else torch.zeros_like(p)
    handle = allreduce_async(grad, name=name, op=op, prescale_factor=prescale,
                             postscale_factor=postscale, process_set=process_set,
                             compression=compression)
    return lambda: synchronize(handle)


@contextmanager
def _join_hint() -> Iterator[None]:
    """A JoinedError (some ranks have joined: gathers cannot run) says what to do, as
    Horovod's does."""
    try:
        yield
    except JoinedError as exc:
        raise JoinedError(f"{exc} A DistributedOptimizer gathers sparse gradients: pass "
                          "sparse_as_dense=True to reduce them in its buckets, which "
                          "joined ranks take part in.") from exc


def _hinted(wait: Callable[[], Optional[torch.Tensor]]) -> Callable[[], Optional[torch.Tensor]]:
    def hinted() -> Optional[torch.Tensor]:
        with _join_hint():
            return wait()
    return hinted


def _where(ranks: Sequence[int], reports: list, says: Callable[[Any], bool]) -> list[int]:
    """The ranks whose report (an allgather_object's, in the set's order) `says` so."""
    return [ranks[k] for k, report in enumerate(reports) if says(report)]


def _mixed(name: str, sparse_on: list[int], dense_on: list[int]) -> MismatchError:
    return MismatchError(
        f"ringreduce: the gradient of '{name}' is sparse on ranks {sparse_on} and dense on "
        f"ranks {dense_on} in this step, so the ranks cannot reduce it alike: compute it the "
        "same way on every rank (an embedding's sparse=, a dense use of its weight), or pass "
        "sparse_as_dense=True. Every rank skips the step.")
