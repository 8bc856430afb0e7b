"""torch.compile reaching ringreduce's code runs it eagerly (ringreduce/core/compile_boundary.py):
collectives and SyncBatchNorm in a compiled forward, and a compiled DDP on the "ringreduce"
backend, whose C++ calls the group's Python methods, also under compiled autograd, as is
DistributedOptimizer. Launched on its own, so that ringreduce is imported before dynamo (the
import hook's path)."""
import sys

import ringreduce as hvd

assert "torch._dynamo" not in sys.modules, "dynamo was imported before this check could"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ringreduce.distributed as rrd  # noqa: E402
from checks import run_cases  # noqa: E402

rrd.init_process_group()
r, n = hvd.rank(), hvd.size()


class Normed(torch.nn.Module):
    """A layer, SyncBatchNorm, and a sum over the ranks, in its forward."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(4, 4), hvd.SyncBatchNorm(4)

    def forward(self, x):
        return hvd.allreduce(self.norm(self.linear(x)), op=hvd.Sum, name="compiled.sum")


def mlp(hidden=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 4, generator=g)


def collectives_in_a_compiled_forward():
    torch.manual_seed(0)
    model = Normed()
    x = torch.arange(12.0).reshape(3, 4) + r
    compiled, eager = torch.compile(model)(x), model(x)
    assert torch.allclose(compiled, eager, rtol=1e-6, atol=1e-6), (compiled, eager)
    same = hvd.allgather(compiled.unsqueeze(0))
    assert all(torch.equal(same[0], row) for row in same), "ranks differ"


def a_compiled_ddp_on_the_backend():
    model, alone = mlp(), mlp()
    ddp = torch.compile(DDP(model))
    train_against_one_process(model, alone, lambda x, y: F.mse_loss(ddp(x), y).backward())


def a_ddp_under_compiled_autograd():
    """DDP's Python reducer (dynamo's optimize_ddp="python_reducer"): DDP's own reducer stands
    aside, and each gradient is all-reduced by torch's functional collectives, which reach the
    group's allreduce from C++."""
    def wrap(model):
        ddp = DDP(model)
        assert ddp._use_python_reducer
        return ddp, None

    trains_under_compiled_autograd(wrap, optimize_ddp="python_reducer")


def a_distributed_optimizer_under_compiled_autograd():
    """DistributedOptimizer's gradient hooks in a compiled backward: the hooks are ringreduce's
    code, so they run eagerly as the backward reaches each gradient. Then with the last rank
    alone compiling its backward: its buckets pair with the others' eager ones."""
    def wrap(model):
        return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())

    trains_under_compiled_autograd(wrap)
    trains_under_compiled_autograd(wrap, compiled=r == n - 1, hidden=12)   # (a new graph)


def trains_under_compiled_autograd(wrap, compiled=True, hidden=16, **config):
    """`wrap(model)` -> (what runs the forward, the optimizer or None), made and trained with
    the forward and backward compiled (compiled autograd, dynamo's `config` too; eagerly where
    not `compiled`) against one process; fails unless the backward was compiled."""
    captures = counters["compiled_autograd"]["captures"]
    with torch._dynamo.config.patch(compiled_autograd=compiled, **config):
        model, alone = mlp(hidden), mlp(hidden)
        forward, opt = wrap(model)

        def forward_backward(x, y):
            F.mse_loss(forward(x), y).backward()

        if compiled:        # (aot_eager: inductor's C++ build would add a minute)
            forward_backward = torch.compile(forward_backward, backend="aot_eager")
        train_against_one_process(model, alone, forward_backward, opt)
    assert not compiled or counters["compiled_autograd"]["captures"] > captures, \
        "the backward was not compiled"


def train_against_one_process(model, alone, forward_backward, opt=None):
    """3 SGD steps of `model` (`forward_backward(x, y)` on this rank's shard of each batch
    computes its gradients; `opt` steps, by default plain SGD) against `alone` on the whole
    batch: the same parameters, identical on every rank."""
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_alone = torch.optim.SGD(alone.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        forward_backward(x[4 * r:4 * (r + 1)], y[4 * r:4 * (r + 1)])
        opt.step()
        opt_alone.zero_grad()
        sum(F.mse_loss(alone(x[4 * k:4 * (k + 1)]), y[4 * k:4 * (k + 1)])
            for k in range(n)).div(n).backward()
        opt_alone.step()
    for p, q in zip(model.parameters(), alone.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p, q)
        gathered = hvd.allgather(p.detach().unsqueeze(0))
        assert all(torch.equal(gathered[0], row) for row in gathered), "ranks differ"


run_cases([collectives_in_a_compiled_forward, a_compiled_ddp_on_the_backend,
           a_ddp_under_compiled_autograd, a_distributed_optimizer_under_compiled_autograd], r)
dist.destroy_process_group()
print(f"OK rank {r}", flush=True)
