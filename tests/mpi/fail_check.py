"""One rank raises an uncaught exception while the others wait in a collective."""
import sys

import torch

import ringreduce as hvd

hvd.init()
if hvd.rank() == int(sys.argv[1]):
    raise RuntimeError("injected failure on purpose")
hvd.allreduce(torch.ones(4), name="never.completes")
print(f"UNEXPECTED finish rank {hvd.rank()}", flush=True)
