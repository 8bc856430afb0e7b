"""init() decides once whether GPU buffers go straight to MPI, logs it, and keeps the answer
in the engine's settings (RINGREDUCE_CUDA_AWARE overrides the library's answer)."""
import logging
import sys

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")

import ringreduce as hvd  # noqa: E402
from ringreduce.process_sets import global_set  # noqa: E402

hvd.init()
print(f"setting {global_set('test').transport.settings.cuda_aware}", flush=True)
rank = hvd.rank()
hvd.shutdown()
print(f"OK rank {rank}", flush=True)
