"""Prints each rank's topology; the test compares it with the expected layout.

argv[1], if given: Horovod's init(comm=[ranks]), a comma-separated list of MPI_COMM_WORLD
ranks; those ranks init() on it and allreduce their world ranks, the others only say OK."""
import sys

import torch

import ringreduce as hvd
from mpi4py import MPI      # (after ringreduce, which asks for MPI's thread support)

listed = [int(r) for r in sys.argv[1].split(",")] if sys.argv[1:] else None
world_rank = MPI.COMM_WORLD.rank
if listed is not None and world_rank not in listed:
    print(f"OK rank {world_rank}", flush=True)
    sys.exit(0)
hvd.init(comm=listed)
print(f"TOPO {hvd.rank()} {hvd.size()} {hvd.local_rank()} {hvd.local_size()} "
      f"{hvd.cross_rank()} {hvd.cross_size()}", flush=True)
if listed is not None:
    total = hvd.allreduce(torch.tensor([world_rank]), op=hvd.Sum).item()
    assert total == sum(listed), total
    assert hvd.rank() == listed.index(world_rank), (hvd.rank(), listed)
print(f"OK rank {world_rank}", flush=True)
