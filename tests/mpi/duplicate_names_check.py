"""A name stays taken until the collective is done on every member (issue 56), as Horovod's:
Horovod's own test of a duplicate name (every rank submits 'duplicate_name', then tries it
ten times more, each try a ValueError, then a barrier), for every asynchronous collective,
repeated; where the first submission was done on a rank already (its peers' parts were
there), a second one used to be taken as a collective of its own that paired with nothing.
A name whose handle was waited for is free at once, and a synchronous call's too.

Usage: duplicate_names_check.py REPEATS
"""
import sys

import torch
from mpi4py import MPI

import ringreduce as hvd
from checks import check_equal, run_cases

world = MPI.COMM_WORLD
r, n = world.rank, world.size
REPEATS = int(sys.argv[1])
TENSOR = torch.ones(17, 17)

STARTS = {
    "reducescatter_async": lambda name: hvd.reducescatter_async(TENSOR, name=name),
    "allreduce_async": lambda name: hvd.allreduce_async(TENSOR, name=name),
    "allreduce_async_": lambda name: hvd.allreduce_async_(TENSOR.clone(), name=name),
    "allgather_async": lambda name: hvd.allgather_async(TENSOR, name=name),
    "broadcast_async": lambda name: hvd.broadcast_async(TENSOR, 0, name=name),
    "alltoall_async": lambda name: hvd.alltoall_async(torch.ones(n, 3), name=name),
}


def duplicate(kind: str):
    def case() -> None:
        start = STARTS[kind]
        for repeat in range(REPEATS):
            first = start("duplicate_name")
            refused = 0
            for _ in range(10):
                try:
                    start("duplicate_name")
                except ValueError as e:
                    assert "still in flight" in str(e), e
                    refused += 1
            assert refused == 10, f"repeat {repeat}: {10 - refused} of 10 accepted"
            hvd.barrier()       # (Horovod's test ends so: no other rank has a second one)
            hvd.synchronize(first)
        check_equal(hvd.allreduce(torch.ones(2), name=f"after {kind}", op=hvd.Sum),
                    torch.full((2,), float(n)), f"after {kind}")
    case.__name__ = f"a duplicate name of {kind}"
    return case


def waited_names_are_free_at_once() -> None:
    """The name of a collective whose handle was waited for, or of a synchronous one, may be
    submitted again at once, with nothing between."""
    for i in range(5):
        handle = hvd.allreduce_async(torch.full((3,), float(i)), name="again", op=hvd.Sum)
        check_equal(hvd.synchronize(handle), torch.full((3,), float(n * i)), f"again {i}")
        check_equal(hvd.allreduce(torch.ones(3), name="loss", op=hvd.Sum),
                    torch.full((3,), float(n)), f"loss {i}")


hvd.init()
run_cases([duplicate(kind) for kind in STARTS] + [waited_names_are_free_at_once], r)
hvd.shutdown()
print(f"OK rank {r}", flush=True)
