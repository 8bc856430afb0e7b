"""The exception types users catch.

`RingReduceError` subclasses `RuntimeError` so code written for Horovod's
`HorovodInternalError` (also a `RuntimeError`) keeps working; the alias is exported. Where
Horovod raises another built-in type, ours derives from it too, so `except` clauses written for
Horovod still catch it. Argument errors are `ValueError` / `TypeError`, or a subclass of these
where a message of its own helps (`ArgumentTypeError`, `NotContiguousError`).
"""


class RingReduceError(RuntimeError):
    """Something went wrong in a collective or in the MPI world."""


class NotInitializedError(RingReduceError, ValueError):
    """A ringreduce function was called before `ringreduce.init()` (Horovod: ValueError)."""


class ShutDownError(RingReduceError):
    """A member of the process set shut down (ringreduce.shutdown(), or the end of its script)
    while this rank waited in a collective with it, or before this rank started one: it could
    never complete. Names the rank that left and the collective. Also raised on every member
    once one has failed inside a collective (its traffic is out of step then), until
    shutdown() and init(). `restartable`: a member failed (or left to start afresh) and none
    left for good, so that shutdown() and init() on every rank bring the set back (elastic's
    reset does)."""

    def __init__(self, message: str, restartable: bool = False) -> None:
        super().__init__(message)
        self.restartable = restartable


class JoinedError(RingReduceError):
    """A collective other than an allreduce was called while some rank of its process set has
    joined (`join()`): that rank has no data to contribute. Raised on the ranks that called it."""


class UsageError(RingReduceError, AssertionError):
    """DistributedOptimizer's calls came in an order that cannot give right results (zero_grad
    between backward and step, more backward passes than announced ...; Horovod: AssertionError).
    Raised on the rank that made it."""


class UnsupportedError(RingReduceError, NotImplementedError):
    """A combination Horovod does not implement either (Horovod: NotImplementedError), such as
    Adasum on a rank count that is not a power of two."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type where Horovod raises ValueError (for instance `alltoall`
    splits that are not integers: Horovod's users catch `(torch.FatalError, ValueError)`, or
    a tensor whose dtype or layout a collective does not take: Horovod's "Tensor type ... is
    not supported."). Also a `TypeError`, as it was before, so either `except` clause catches
    it. Like every argument error it is raised on the rank that made the mistake, before any
    of its data moves (the other ranks' call of that name fails with MismatchError quoting
    it)."""


class NotContiguousError(ValueError):
    """A collective was given a tensor that is not contiguous (a transposed or sliced view):
    Horovod raises ValueError('Tensor is required to be contiguous.') for every collective, in
    place or not. Raised on the rank that passed it, before any data moves, like every
    argument error; pass `tensor.contiguous()` (and copy an in-place result back)."""


class MismatchError(RingReduceError):
    """Ranks submitted different collectives (name, shape, dtype, op, root ...).

    Raised on every rank, with the same message, so no rank is left waiting.
    """


class CheckpointError(RingReduceError):
    """checkpoint.save or checkpoint.load failed on rank 0; raised on every rank alike."""


class ConsistencyError(RingReduceError):
    """Tensors that should be identical on every rank are not (see `check_consistency`)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank by `commit()` / `check_host_updates()` after a host update; `run`
    then resets without restoring the commit. `skip_sync`: hosts were only removed, so the
    remaining ranks are in sync already. Not a `HorovodInternalError`, as in Horovod."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were added or removed; resetting")
        self.skip_sync = skip_sync


class LaunchError(Exception):
    """A flag or combination `ringreduce-run` (run.py) cannot honour; the message says why."""


HorovodInternalError = RingReduceError
