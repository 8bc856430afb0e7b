"""Point-to-point waits on the torch.distributed backend that a peer does not end: a peer late
to send (the receiver logs stall reports naming it, every check interval, then gets the
message), then a peer that shuts down without sending (the receiver raises ShutDownError
naming it, instead of waiting for ever). The last rank is the peer."""
import sys
import time

import torch
import torch.distributed as dist

import ringreduce as hvd
import ringreduce.distributed as rrd

hvd.init(stall_check_time=1.0)
rrd.init_process_group()
r, n = dist.get_rank(), dist.get_world_size()
peer = n - 1
got = torch.empty(3)
if r == peer:
    time.sleep(2.5)
    dist.send(torch.full((3,), 7.0), 0, tag=5)
elif r == 0:
    dist.recv(got, peer, tag=5)
    assert got.tolist() == [7.0] * 3, got
dist.barrier()
if r == peer:
    hvd.shutdown()
    print(f"OK rank {r}", flush=True)
    sys.exit(0)
if r == 0:
    start = time.monotonic()
    try:
        dist.recv(got, peer, tag=6)
    except hvd.ShutDownError as exc:
        print(f"SHUTDOWN rank {r} after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError("a recv from a rank that shut down returned")
hvd.shutdown()
print(f"OK rank {r}", flush=True)
