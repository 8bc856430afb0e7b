"""SyncBatchNorm on N ranks, each with a shard of the batch, equals BatchNorm on the whole batch
in one process: outputs, input gradients, parameter gradients and running statistics."""
import torch

import ringreduce as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
BATCH = 12
torch.manual_seed(0)
x = torch.randn(BATCH, 3, 4, 4, dtype=torch.float64) * 2 + 1
upstream = torch.randn(BATCH, 3, 4, 4, dtype=torch.float64)
per = BATCH // n
mine = slice(r * per, (r + 1) * per)

reference = torch.nn.BatchNorm2d(3).double()
with torch.no_grad():
    reference.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
    reference.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
sync = hvd.SyncBatchNorm(3).double()
sync.load_state_dict(reference.state_dict())

full = x.clone().requires_grad_()
want = reference(full)
(want * upstream).sum().backward()

part = x[mine].clone().requires_grad_()
got = sync(part)
(got * upstream[mine]).sum().backward()

tol = dict(rtol=1e-9, atol=1e-9)
assert torch.allclose(got, want[mine], **tol), "forward differs"
assert torch.allclose(part.grad, full.grad[mine], **tol), "input gradient differs"
for name in ("weight", "bias"):   # a rank's parameter gradient covers its own shard only
    total = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum)
    assert torch.allclose(total, getattr(reference, name).grad, **tol), f"{name} grad differs"
assert torch.allclose(sync.running_mean, reference.running_mean, **tol)
assert torch.allclose(sync.running_var, reference.running_var, **tol)
sync.eval()
reference.eval()
assert torch.allclose(sync(x[mine]), reference(x[mine]), **tol), "eval mode differs"
print(f"OK rank {r}", flush=True)
