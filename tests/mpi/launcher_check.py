"""Started by ringreduce-run in the tests: every rank checks the settings the flags set, then
one allreduce; EXIT_WITH makes rank 0 exit with that status instead."""
import os
import sys

import torch

import ringreduce as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
want = os.environ.get("WANT_FUSION")
if want is not None:
    assert os.environ.get("RINGREDUCE_FUSION_THRESHOLD") == want, dict(os.environ)
assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]
if r == 0 and os.environ.get("EXIT_WITH"):
    sys.exit(int(os.environ["EXIT_WITH"]))
print(f"OK rank {r} of {n}", flush=True)
