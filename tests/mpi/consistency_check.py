"""check_consistency: silent on identical ranks, a named error on every rank otherwise, and the
opt-in per-step check inside DistributedOptimizer."""
import torch
import torch.nn as nn

import ringreduce as hvd

hvd.init(consistency_check_steps=2)
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
hvd.check_consistency(model)
hvd.check_consistency(model.state_dict())
hvd.check_consistency([torch.ones(3), torch.zeros(2)])

if n > 1:
    with torch.no_grad():
        if r == n - 1:
            model[2].bias[0] += 1.0
    try:
        hvd.check_consistency(model)
        raise AssertionError("no ConsistencyError")
    except hvd.ConsistencyError as e:
        assert "'2.bias'" in str(e) and f"ranks [{n - 1}]" in str(e), e
    try:   # a different number of tensors per rank
        hvd.check_consistency([torch.ones(1)] * (1 + (r == 0)))
        raise AssertionError("no MismatchError")
    except hvd.MismatchError as e:
        assert "check_consistency" in str(e) and "'tensors'" in str(e), e
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.check_consistency(model)

    # The optimizer checks every 2 steps: a rank that changes a weight on its own is caught.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    model.train()
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        if step == 2 and r == 0:
            with torch.no_grad():
                model[0].weight[0, 0] += 1.0
        try:
            opt.step()
        except hvd.ConsistencyError as e:
            assert step == 3 and "'0.weight'" in str(e), (step, e)
            break
    else:
        raise AssertionError("the per-step consistency check never fired")
print(f"OK rank {r}", flush=True)
