"""`SyncBatchNorm`: batch normalization with statistics over the whole global batch.

Each rank sums its inputs and their squares per channel; one allreduce gives the global mean
and variance. The allreduce is differentiable (its gradient is the allreduce of the incoming
gradients), so backward reaches every rank's inputs through the shared statistics without a
hand-written backward, and matches BatchNorm on the whole batch in one process.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .collectives import Sum, allreduce
from .process_sets import ProcessSet, active, global_process_set


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm{1,2,3}d (Horovod's `hvd.SyncBatchNorm`), with statistics
    over the members of `process_set`."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set, device=None,
                 dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"ringreduce: SyncBatchNorm expects at least 2D input (got "
                             f"{input.dim()}D)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        active(self.process_set, "SyncBatchNorm.forward()")
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() / channels], dtype=input.dtype)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(local, op=Sum, process_set=self.process_set)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n.item())
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        self.num_batches_tracked += 1
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
