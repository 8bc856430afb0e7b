"""`SyncBatchNorm`: batch normalization with statistics over the whole global batch.

Forward: each rank computes its per-channel count, mean and M2 (sum of squared deviations from
its mean) in float32 or wider (two passes: the deviations from a first mean, corrected by their
own sum), one allgather named `sync_batch_norm.stats` brings every member's (count, mean, M2)
in float64, and every rank combines them in rank order with the parallel formula (Chan et
al.), as torch.nn.SyncBatchNorm does: no E[x^2] - E[x]^2 cancellation, counts exact in float64,
members with an empty batch skipped, and the same float64 statistics bitwise on every rank.
Backward is the standard SyncBN backward: per channel sum(dy) and sum(dy * xhat), one float64
allreduce named `sync_batch_norm.backward`, then the local formula; weight and bias gradients
cover this rank's shard only (as torch's; the optimizer's allreduce sums them).

float16 and bfloat16 inputs are computed in float32 and returned in their dtype, as
torch.nn.BatchNorm does on the CPU; float64 inputs are computed in float64.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..sets.active_set import refusing
from ..sets.process_set import ProcessSet, global_process_set
from ..sets.process_sets import active
from ..transport.signature import qualified
from .collectives import Sum, allgather, allreduce

STATS_NAME = "sync_batch_norm.stats"
BACKWARD_NAME = "sync_batch_norm.backward"


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
        if input.size(1) == 0:
            raise ValueError("ringreduce: SyncBatchNorm's input has no channels")

    def _check_channels(self, input: torch.Tensor) -> None:
        """The input's channels against the weight and running statistics it is used with (as
        Horovod's kernels refuse them; without either, any number goes, as there)."""
        if input.size(1) != self.num_features and (self.weight is not None
                                                   or self.running_mean is not None):
            raise ValueError(f"ringreduce: SyncBatchNorm({self.num_features}) got an input of "
                             f"{input.size(1)} channels (shape {tuple(input.shape)})")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # As Horovod's: the running statistics normalize in eval only while they are tracked;
        # otherwise the batch's, which update the running ones wherever those exist (a module
        # whose track_running_stats was turned off after it was made keeps them). (torch's
        # BatchNorm uses them in eval whenever they exist, and updates them only in training.)
        if not self.training and self.track_running_stats:
            self._check_channels(input)
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        ps = active(self.process_set, "SyncBatchNorm.forward()")
        with refusing(ps, qualified("allgather", STATS_NAME), "allgather"):
            self._check_channels(input)     # (one rank's mistake fails the others' call)
        count, mean, m2 = _global_stats(input, self.process_set)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)    # (after the collective: one that fails counts
            if self.momentum is None:           # no batch); cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if count == 1:                                # as F.batch_norm with batch statistics
            raise ValueError("ringreduce: SyncBatchNorm expects more than 1 value per channel "
                             "when training (the whole batch over the process set has 1)")
        if count > 0:
            _update_running(self.running_mean, self.running_var, mean, m2, count, factor)
        var = m2 / count if count > 0 else m2
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd,
                                            count, self.process_set)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (float16 and bfloat16 are widened)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduced_dims(input: torch.Tensor) -> list[int]:
    return [0] + list(range(2, input.dim()))


def _channel_view(t: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return t.view([1, -1] + [1] * (input.dim() - 2))


@torch.no_grad()
def _global_stats(input: torch.Tensor, process_set: ProcessSet
                  ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) per channel over every member's batch: float64, bitwise the same on
    every member (combined in rank order from one allgather)."""
    channels = input.size(1)
    local_count = input.numel() // channels
    mean = torch.zeros(channels, dtype=torch.float64, device=input.device)
    m2 = torch.zeros(channels, dtype=torch.float64, device=input.device)
    if local_count > 0:
        dims = _reduced_dims(input)
        x = input.to(_compute_dtype(input.dtype))
        first = x.mean(dims)
        deviation = x - _channel_view(first, input)
        total = deviation.sum(dims).double()             # small: the first mean's error
        m2 = deviation.square_().sum(dims).double() - total * total / local_count
        m2 = m2.clamp_(min=0.0)
        mean = first.double() + total / local_count
    count = torch.full((1,), float(local_count), dtype=torch.float64, device=input.device)
    local = torch.cat([count, mean, m2]).unsqueeze(0)
    gathered = allgather(local, name=STATS_NAME, process_set=process_set)
    counts = gathered[:, 0].tolist()
    n = 0.0
    for rank, n_b in enumerate(counts):                 # Chan et al., in rank order
        if n_b == 0:
            continue
        mean_b = gathered[rank, 1:channels + 1]
        m2_b = gathered[rank, channels + 1:]
        if n == 0:
            mean, m2 = mean_b.clone(), m2_b.clone()
        else:
            n_ab = n + n_b
            delta = mean_b - mean
            mean = mean + delta * (n_b / n_ab)
            m2 = m2 + m2_b + delta * delta * (n * n_b / n_ab)
        n += n_b
    return int(n), mean, m2


@torch.no_grad()
def _update_running(running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    mean: torch.Tensor, m2: torch.Tensor, count: int, factor: float) -> None:
    """torch's BatchNorm update: the batch mean and the unbiased batch variance, with weight
    `factor` (momentum, or 1/num_batches_tracked for momentum=None); computed in float64."""
    if running_mean is not None:
        running_mean.copy_(running_mean.double() * (1.0 - factor) + mean * factor)
    if running_var is not None:
        unbiased = m2 / max(count - 1, 1)
        running_var.copy_(running_var.double() * (1.0 - factor) + unbiased * factor)


def _normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                input: torch.Tensor) -> torch.Tensor:
    """(x - mean) * invstd in x's dtype (float32 or float64), a new tensor. The float64 mean
    is subtracted in two parts (its float32 rounding, then the rest), so a large mean does not
    cost the deviations their precision."""
    high = mean.to(x.dtype)
    out = x - _channel_view(high, input)
    if x.dtype != torch.float64:
        out.sub_(_channel_view((mean - high.double()).to(x.dtype), input))
    return out.mul_(_channel_view(invstd.to(x.dtype), input))


class _SyncBatchNormFunction(torch.autograd.Function):
    """The normalization with the global statistics (computed without autograd by the module);
    its backward carries the gradient through those statistics with one allreduce."""

    @staticmethod
    def forward(ctx, input, weight, bias, mean, invstd, count, process_set):
        x = input.to(_compute_dtype(input.dtype))
        out = _normalized(x, mean, invstd, input)
        if weight is not None:
            out.mul_(_channel_view(weight.to(out.dtype), input))
        if bias is not None:
            out.add_(_channel_view(bias.to(out.dtype), input))
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count, ctx.process_set = count, process_set
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute = _compute_dtype(input.dtype)
        dims = _reduced_dims(input)
        dy = grad_output.to(compute)
        xhat = _normalized(input.to(compute), mean, invstd, input)
        sum_dy = dy.sum(dims).double()
        sum_dy_xhat = (dy * xhat).sum(dims).double()
        grad_input = grad_weight = grad_bias = None
        if need_weight and weight is not None:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if need_bias and ctx.bias_dtype is not None:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        if need_input:
            sums = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum, name=BACKWARD_NAME,
                             process_set=ctx.process_set)
            channels = input.size(1)
            count = max(ctx.count, 1)
            mean_dy = sums[:channels] / count
            mean_dy_xhat = sums[channels:] / count
            scale = invstd if weight is None else invstd * weight.double()
            # weight * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))
            grad = xhat.mul_(_channel_view(-mean_dy_xhat.to(compute), input))
            grad.add_(dy).sub_(_channel_view(mean_dy.to(compute), input))
            grad.mul_(_channel_view(scale.to(compute), input))
            grad_input = grad.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


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
