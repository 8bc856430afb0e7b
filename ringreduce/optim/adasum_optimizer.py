"""`DistributedOptimizer(op=Adasum)`'s life cycle, as Horovod's: parameter deltas are combined
instead of gradients.

Once a parameter's gradient is final, the wrapped optimizer steps that parameter alone on this
rank (its state, momentum or Adam's moments, stays this rank's own); the step's delta goes into
the bucket, and the buckets are combined by Adasum (adasum.py) across the set; step() adds the
combined delta to where the parameter started, the same on every rank. synchronize() has
nothing to do; skip_synchronize() is refused.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..core.errors import UsageError
from . import fusion
from .gradient_reduction import GradientReduction
from .wrapped_optimizer import Options


class AdasumOptimizer(GradientReduction):
    """See the module's docstring."""

    _direct_buckets = False     # every delta goes into a bucket's buffer

    def _setup(self, options: Options) -> None:
        """As Horovod's Adasum optimizer, every trainable parameter starts with a zero
        gradient, so one without a gradient at the first step still steps (weight decay)."""
        super()._setup(options)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.new_zeros(p.shape)

    def _plan(self) -> None:
        super()._plan()
        self._start = {id(p): torch.empty_like(p) for b in self._buckets for p in b.params}
        self._group_of = {id(p): k for k, group in enumerate(self.param_groups)
                          for p in group["params"]}

    def _reset_step(self) -> None:
        super()._reset_step()
        self._stepped: set[int] = set()      # parameters stepped alone this step

    def _gradient_ready(self, p: torch.Tensor) -> None:
        self._step_alone(p)

    def _sparse_gradient_leaves(self, p: torch.Tensor) -> bool:
        """A sparse gradient stays as it is, as in Horovod's Adasum optimizer (which is not
        given sparse_as_dense): the wrapped optimizer steps with it (SGD, SparseAdam), and
        the step's delta, which Adasum combines, is dense."""
        return False

    def _pack(self, bucket: fusion.Bucket) -> Any:
        """The deltas are in the buffer already."""
        if bucket.buffer.is_cuda:
            return torch.cuda.current_stream(bucket.buffer.device).record_event()
        return None

    def _unpack(self, bucket: fusion.Bucket) -> None:
        """The combined deltas stay in the buffer, for step()."""

    def _to_compress(self, bucket: fusion.Bucket) -> list[torch.Tensor]:
        """A compressor of the user's own is given the deltas, as Horovod's Adasum optimizer
        compresses them."""
        return list(bucket.views)

    def _decompress(self) -> None:
        """Each combined delta decompressed into its place in the buffer, for step()."""
        for bucket, handle, contexts in self._compressed:
            for view, wire, context in zip(bucket.views, handle.wait(), contexts):
                view.copy_(self._compression.decompress(wire, context))
        self._compressed = []

    def _step_alone(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's step on `p` only; its delta into the bucket, `p` back to
        where it started until the combined delta arrives."""
        start = self._start[id(p)]
        start.copy_(p.detach())
        params = [group["params"] for group in self.param_groups]
        mine = self._group_of[id(p)]
        for k, group in enumerate(self.param_groups):
            group["params"] = [p] if k == mine else []
        try:
            self._step_wrapped()
        finally:
            for group, saved in zip(self.param_groups, params):
                group["params"] = saved
        self._view_of[id(p)].copy_(p.detach() - start)
        with torch.no_grad():
            p.copy_(start)
        self._stepped.add(id(p))

    def synchronize(self) -> None:
        """Nothing: Adasum combines parameter deltas at step(), as Horovod's does."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise UsageError("ringreduce: skipping synchronization is not supported with op=Adasum "
                         "(as in Horovod): the deltas are combined at step()")
        yield  # pragma: no cover

    def step(self, closure=None):
        self._check_usable()
        if self._synchronized:          # a step that failed, not yet zero_grad()'ed
            self._check_unbroken()
        loss = closure() if closure is not None else None
        self._begin_step()
        for bucket in self._buckets[self._next_bucket:]:
            for p in bucket.params:
                if id(p) not in self._stepped:
                    self._step_alone(p)
        self._complete_collectives()
        with torch.no_grad():
            for bucket in self._buckets:
                for p, delta in zip(bucket.params, bucket.views):
                    torch.add(self._start[id(p)], delta, out=p)
        self._finish_step()
        return loss
