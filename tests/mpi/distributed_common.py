"""What the torch.distributed backend's checks share (distributed_check.py runs them): ringreduce
started for them, this rank and the job's size, gloo's group to compare with (`GLOO`, made by
distributed_check.py once the default group runs), and how results are compared."""
import sys
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ringreduce as hvd
from models import Net

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
LIGHTNING = "lightning" in sys.argv[1:]
STALL_CHECK_TIME = 1.0 if LIGHTNING else 60.0      # (case_stall's report, at 2 ranks)
hvd.init(stall_check_time=STALL_CHECK_TIME)
r, n = hvd.rank(), hvd.size()
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
GLOO = None        # gloo's group of every rank, beside the default group (distributed_check.py)


def rand(*shape, seed=0, rank=None):
    """Rank `rank`'s (default: this rank's) input: the same on every call."""
    g = torch.Generator().manual_seed(1000 * seed + (r if rank is None else rank))
    return torch.randn(*shape, generator=g)


def close(got, want, what, rtol=1e-5, atol=1e-6):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    assert torch.allclose(got, want, rtol=rtol, atol=atol), \
        f"{what}: off by {(got - want).abs().max().item():.3g}"


def everywhere(t, what):
    """Bitwise identical on every rank."""
    hvd.check_consistency([(what, t)])


def against_gloo(fn, what, rtol=1e-5):
    """fn(group) on our default group and on gloo's: close, ours identical everywhere."""
    ours, theirs = fn(None), fn(GLOO)
    close(ours, theirs, what, rtol=rtol)
    everywhere(ours, what)
    return ours


def reduced(x, op=SUM, group=None, async_op=False):
    x = x.clone()
    work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
    if async_op:
        assert work.get_future().wait()[0] is x
        work.wait()
    return x


# ---------------------------------------------------------------- training against one process

BATCH = 24          # divides by 1, 2, 3 (and each half by 2 and 3)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def shard(t):
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


class WithUnused(nn.Module):
    """Net with a layer the forward never uses (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.net, self.unused = Net(), nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


class Masked(nn.Module):
    """Net with a bool buffer, as a causal mask is (DDP broadcasts buffers)."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.register_buffer("keep", torch.arange(10) % 3 != 0)

    def forward(self, x):
        return self.net(x).masked_fill(~self.keep, 0.0)


def train(make, wrap=None, steps=3, accumulate=1, batches=None):
    """SGD with momentum on `batches(step)` (default: `data`); `wrap` makes the distributed
    model (then each rank takes its shard of every micro-batch), None trains one process on
    the whole batch."""
    torch.manual_seed(0)
    model = make()
    stepper = wrap(model) if wrap is not None else model
    opt = torch.optim.SGD(stepper.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = (batches or data)(step)
        opt.zero_grad()
        for k, (mx, my) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            if wrap is not None:
                mx, my = shard(mx), shard(my)
            last = k == accumulate - 1
            sync = stepper.no_sync() if wrap is not None and not last else nullcontext()
            with sync:
                F.cross_entropy(stepper(mx), my).backward()
        opt.step()
    return model


def same_model(got, want, what, rtol=1e-6, atol=1e-7):
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        close(full.detach(), q.detach(), f"{what}: {name}", rtol=rtol, atol=atol)
        everywhere(full.detach(), f"{what}: {name}")
