"""init() decides once whether GPU buffers go straight to MPI, logs it, and keeps the answer
in the engine's settings (RINGREDUCE_CUDA_AWARE overrides the library's answer). argv[1]: a
JSON list of RINGREDUCE_CUDA_AWARE values (null: unset), each tried by an init() of its own."""
import json
import logging
import os
import sys

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")

import ringreduce as hvd  # noqa: E402
from ringreduce.sets.process_sets import global_set  # noqa: E402

for value in json.loads(sys.argv[1]):
    os.environ.pop("RINGREDUCE_CUDA_AWARE", None)
    if value is not None:
        os.environ["RINGREDUCE_CUDA_AWARE"] = value
    print(f"INIT with {value}", flush=True)
    hvd.init()
    print(f"setting {global_set('test').transport.settings.cuda_aware}", flush=True)
    rank = hvd.rank()
    hvd.shutdown()
print(f"OK rank {rank}", flush=True)
