"""A first look at ringreduce: every rank contributes its rank number, everyone gets the sum.

    mpiexec -n 2 python scripts/allreduce_demo.py
"""
import torch

import ringreduce as hvd

hvd.init()
x = torch.full((4,), float(hvd.rank()))
total = hvd.allreduce(x, op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()}: sum of ranks = {total.tolist()}", flush=True)
