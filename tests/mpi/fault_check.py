"""Fault injection in a small training loop: python fault_check.py MODE VICTIM_RANK

MODE: raise_in_backward | sigkill | sleep (past the stall time) |
      sleep_small (the same, where the others wait in a small allreduce) |
      skip_init (the victim exits without calling init()) |
      finish_late (the victim works on after the training, the others at their end) |
      slow_gather (every rank calls one allreduce with another length on the victim, which
      is slow to share its signature for the mismatch's report: the others report the stall,
      then every rank gets the MismatchError).
(A failure inside every rank's engine thread, which the job survives: errors_check.py.)
"""
import os
import signal
import sys
import time

import torch
import torch.nn as nn
from mpi4py import MPI

import ringreduce as hvd
from ringreduce.transport import negotiation

mode, victim = sys.argv[1], int(sys.argv[2])
if mode == "skip_init" and MPI.COMM_WORLD.rank == victim:
    print(f"SKIPPED init() on rank {victim}", flush=True)
    sys.exit(0)
hvd.init()
r = hvd.rank()
if mode == "slow_gather":
    gather = negotiation.Negotiator.gather

    def late_gather(self, mine):
        time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
        return gather(self, mine)

    if r == victim:      # late into the gather of the signatures, after the digests differed
        negotiation.Negotiator.gather = late_gather
    try:
        hvd.allreduce(torch.ones(1 << 18 if r == victim else 1 << 17), name="mismatched")
    except hvd.MismatchError as e:
        print(f"MISMATCH rank {r}: {e}", flush=True)
    else:
        raise AssertionError("the mismatched allreduce did not raise")
    finally:
        negotiation.Negotiator.gather = gather   # (the next script of a shared launch)
    print(f"OK rank {r}", flush=True)
    sys.exit(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"injected failure in backward on rank {r}")


for step in range(1000):
    x = torch.randn(4, 8)
    if r == victim and step == 3:
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode in ("sleep", "sleep_small"):
            time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
        if mode == "raise_in_backward":
            x = FailInBackward.apply(x.requires_grad_())
    if mode == "sleep_small":
        total = hvd.allreduce(torch.tensor([float(step)]), name=f"metric.{step}", op=hvd.Sum)
        assert total.item() == step * hvd.size(), total
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    if mode in ("sleep", "sleep_small", "finish_late") and step == 5:
        break
if mode == "finish_late" and r == victim:      # the others wait for it in shutdown()
    time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
print(f"OK rank {r}", flush=True)
