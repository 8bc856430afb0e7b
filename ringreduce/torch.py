"""`import ringreduce.torch as hvd` works like `import horovod.torch as hvd`."""
from ringreduce import *  # noqa: F401,F403
from ringreduce import __all__  # noqa: F401
