"""A collective's work, as every public call and the optimizer hand it to the set's engine:
(the active set, the collective's name, what runs), run inline or queued; the names of a
group's collectives; and a failure before a collective began, which still meets the other
ranks' call of its name."""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..core import timeline
from ..core.errors import RingReduceError
from ..sets.active_set import ActiveSet
from ..sets.handles import Handle
from ..transport.negotiation import AGREED

Work = tuple[ActiveSet, str, Callable[[], Any]]   # the set, the collective's name, what runs


def submit(work: Work) -> Handle:
    """Queue a collective's work on its set's engine (and the timeline's "submitted" event);
    the optimizer submits its buckets and step agreement through here too."""
    ps, name, fn = work
    handle = ps.engine.submit(name, fn)
    timeline.record(name, "submitted")
    return handle


def meet_failure(ps: ActiveSet, name: str, kind: str, begun: int, error: BaseException) -> None:
    """A collective's work failed on this rank (an allocation, say). Where that came before the
    collective began here (`begun`: the set's count before the work), it still meets the other
    ranks' call of `name`, as `refusing` does, with a check that carries the error, so theirs
    fail with a MismatchError quoting it instead of waiting for ours. Once begun, a failure is
    the transport's to tell (StallWatch.failed)."""
    if not isinstance(error, Exception) or isinstance(error, AGREED) \
            or ps.transport.watch.begun != begun:
        return      # (an interrupt meets nothing: it ends the job, or the caller knows)
    signature = {"collective": kind, "name": name, "failed": f"{type(error).__name__}: {error}"}
    try:
        ps.transport.check(signature)
    except RingReduceError:
        pass    # the others' calls failed: `error` goes on


def run(work: Work) -> Any:
    """Run a collective synchronously, inline on this thread when the set's engine is idle."""
    ps, name, fn = work
    return ps.engine.run(name, fn)


def tupled(work: Work) -> Work:
    """A group's work yielding a tuple of results, as Horovod's grouped handles do."""
    ps, name, fn = work
    return ps, name, lambda: tuple(fn())


def first(work: Work) -> Work:
    """A one-tensor group's work, yielding that tensor's result instead of a list."""
    ps, name, fn = work
    return ps, name, lambda: fn()[0]


def group_names(ps: ActiveSet, name: Optional[str], kind: str, count: int) -> list[str]:
    """The names of a group's collectives: `name` alone for one tensor of a plain call,
    `name.i` for a grouped call's (however many: with the count in each signature, a rank
    passing another number of tensors meets the others' first one and gets MismatchError)."""
    base = ps.auto_name(kind) if name is None else name
    grouped = kind.startswith("grouped_")
    return [base] if count == 1 and not grouped else [f"{base}.{i}" for i in range(count)]


def no_tensors(kind: str, ps: ActiveSet) -> str:
    """The error of a group of no tensors (its first name, '<name>.0', still meets the others'
    call: `refusing`)."""
    return (f"ringreduce: {kind} on rank {ps.ranks[ps.rank]}: no tensors; a group needs one or "
            "more")


# The torch.distributed backend's calls with a root, each made of a collective without one.
ROOTED = {"allreduce": "reduce", "allgather": "gather", "alltoall": "scatter"}


def with_root(signature: dict, root: Optional[int]) -> dict:
    """The signature of a collective that the backend's reduce, gather or scatter (ROOTED) is
    made of, where `root` (a global rank) is given: that call's kind and root, which every rank
    must name alike. Otherwise a rank naming another root, or making the plain collective,
    would pair with the others' call and keep a result it was not meant to have."""
    if root is not None:
        signature["collective"] = ROOTED[signature["collective"]]
        signature["root_rank"] = root
    return signature
