"""The exception types users catch.

`RingReduceError` subclasses `RuntimeError` so code written for Horovod's
`HorovodInternalError` (also a `RuntimeError`) keeps working; the alias is exported.
Argument errors stay plain `ValueError` / `TypeError`.
"""


class RingReduceError(RuntimeError):
    """Something went wrong in a collective or in the MPI world."""


class NotInitializedError(RingReduceError):
    """A ringreduce function was called before `ringreduce.init()`."""


class MismatchError(RingReduceError):
    """Ranks submitted different collectives (name, shape, dtype, op, root ...).

    Raised on every rank, with the same message, so no rank is left waiting.
    """


class ConsistencyError(RingReduceError):
    """Tensors that should be identical on every rank are not (see `check_consistency`)."""


HorovodInternalError = RingReduceError
