"""A few training steps with RINGREDUCE_TIMELINE set, then start/stop_timeline at runtime.

argv[1]: the directory for the runtime timelines. The env-started files and the one left open
at exit (closed by shutdown at exit) are checked by tests/test_timeline.py.
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ringreduce as hvd
from models import Net
from ringreduce.core import timeline

out = Path(sys.argv[1])
hvd.init()
r = hvd.rank()
torch.set_num_threads(1)
assert timeline.running(), "RINGREDUCE_TIMELINE did not start a timeline"


torch.manual_seed(0)
model = Net()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               model.named_parameters(), fusion_threshold=2048,
                               first_bucket_bytes=512)
assert len(opt._buckets) >= 3, "the test wants several buckets"


def train(steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + r)
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


train(4)

# Runtime control: stop the env-started timeline, write another, stop it, check it.
hvd.stop_timeline()
assert not timeline.running()
hvd.stop_timeline()                                        # stopping twice is harmless
path = out / f"runtime_{r}.json"
hvd.start_timeline(str(out / "runtime_{rank}.json"), mark_cycles=True)
hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="x"))   # async ones record "submitted"
hvd.synchronize(hvd.allreduce_async(torch.ones(3)))
train(1)
hvd.stop_timeline()
events = json.loads(path.read_text())["traceEvents"]      # complete JSON after stop
lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
assert {"allreduce.x", "bucket.0"} <= lanes and any(n.endswith(" (unnamed)") for n in lanes), lanes
assert any(e["name"] == "process_name" and e["args"]["name"] == f"rank {r}" for e in events)
assert any(e.get("cat") == "allreduce.x" and e["name"] == "submitted" for e in events)
assert any(e.get("cat") == "bucket.0" and e["name"] == "allreduce" for e in events)

# Left running: shutdown at exit must flush and close it.
hvd.start_timeline(str(out / "at_exit.json"))
train(1)
print(f"OK rank {r}", flush=True)
