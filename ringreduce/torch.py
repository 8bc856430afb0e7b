"""`import ringreduce.torch as hvd` works like `import horovod.torch as hvd`."""
from ringreduce import *  # noqa: F401,F403
from ringreduce import __all__  # noqa: F401
from ringreduce import compression, functions, mpi_ops, optimizer, sync_batch_norm  # noqa: F401
