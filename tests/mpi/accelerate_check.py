"""Hugging Face Accelerate's default Accelerator() (no cpu=True) on ringreduce's default group
(issue 56): after ringreduce.distributed.init_process_group(), every rank trains its part of
the data on the group (num_processes and process_index are the job's), where it used to take
a CPU job for one process and train each rank alone, silently.

Usage: accelerate_check.py
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ringreduce as hvd
import ringreduce.distributed

world = MPI.COMM_WORLD
r, n = world.rank, world.size
saved, threads = dict(os.environ), torch.get_num_threads()
AcceleratorState._reset_state(True)      # (a script before in this process may have made one)
ringreduce.distributed.init_process_group()
try:
    accelerator = Accelerator()
    assert (accelerator.num_processes, accelerator.process_index) == (n, r), \
        (accelerator.num_processes, accelerator.process_index)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    rows = TensorDataset(torch.randn(8 * n, 4), torch.randint(0, 2, (8 * n,)))
    model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             DataLoader(rows, batch_size=4))
    assert isinstance(model, DDP) and model.process_group is dist.group.WORLD
    assert len(loader) == 2, len(loader)     # this rank's part: 8 rows of the 8n
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(weights, 0, name="accelerate.weights"), weights)
    accelerator.wait_for_everyone()
finally:
    AcceleratorState._reset_state(True)
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(threads)
print(f"OK rank {r}", flush=True)
