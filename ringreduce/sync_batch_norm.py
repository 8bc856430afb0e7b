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

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """`module` with every BatchNorm layer replaced by a SyncBatchNorm sharing its
        parameters and running statistics (torch.nn.SyncBatchNorm's method of that name);
        `revert_sync_batchnorm` undoes it."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            synced = cls(module.num_features, module.eps, module.momentum, module.affine,
                         module.track_running_stats, process_set)
            _share_state(module, synced)
            synced.original_class = type(module)
            module = synced
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return module

    @classmethod
    def revert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """`module` with each SyncBatchNorm made by convert_sync_batchnorm back to the class it
        replaced, sharing parameters and statistics."""
        if isinstance(module, cls) and hasattr(module, "original_class"):
            plain = module.original_class(module.num_features, module.eps, module.momentum,
                                          module.affine, module.track_running_stats)
            _share_state(module, plain)
            module = plain
        for name, child in module.named_children():
            module.add_module(name, cls.revert_sync_batchnorm(child))
        return module

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
        count = torch.tensor([input.numel() / channels], dtype=input.dtype, device=input.device)
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


def _share_state(source: _BatchNorm, target: _BatchNorm) -> None:
    """`target` takes `source`'s parameters, running statistics, mode and place (the same
    tensors, so an optimizer made before the swap still trains them)."""
    if source.affine:
        target.weight, target.bias = source.weight, source.bias
    if source.track_running_stats:
        target.running_mean = source.running_mean
        target.running_var = source.running_var
        target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
