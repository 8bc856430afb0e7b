"""One rank raises an uncaught exception while the others wait in a collective: on its main
thread (`main`), or on a thread that called a collective first (`thread`); or (`bystander`) on
a thread that called none, which ends that thread alone, and the job goes on."""
import sys
import threading
import time

import torch

import ringreduce as hvd

hvd.init()
failing, where = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "main"
mine = hvd.rank() == failing


def in_a_thread():
    if where == "thread":
        hvd.allreduce(torch.ones(4), name="in.the.thread")
    if mine:
        raise RuntimeError("injected failure on purpose")


if where == "main" and mine:
    raise RuntimeError("injected failure on purpose")
if where != "main":
    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
if where == "thread" and mine:
    time.sleep(60)      # (the abort comes first)
total = hvd.allreduce(torch.ones(4), name="after", op=hvd.Sum)
assert where == "bystander" and torch.equal(total, torch.full((4,), float(hvd.size())))
print(f"OK rank {hvd.rank()}", flush=True)
