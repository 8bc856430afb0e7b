"""Error paths: every rank gets a clear error of the right type naming the tensor, nothing
hangs, inputs are untouched, and the job is still usable afterwards. Then check_consistency
and the optimizer's per-step consistency check."""
import threading
import time

import torch

import ringreduce as hvd
from checks import expect
from ringreduce.api import reductions
from ringreduce.sets import world
from ringreduce.sets.process_sets import active
from ringreduce.transport.set_transport import Transport
from ringreduce.transport.ways import SetParts

try:
    hvd.allreduce(torch.ones(3))
    raise AssertionError("allreduce before init() did not raise")
except hvd.NotInitializedError as e:
    assert "init()" in str(e), e
try:
    hvd.rank()
    raise AssertionError("rank() before init() did not raise")
except hvd.NotInitializedError:
    pass

hvd.init()
hvd.init()  # idempotent
r, n = hvd.rank(), hvd.size()


here = f"rank {r}"
# Local argument errors: raised on the rank that made them, before any MPI traffic. A dtype or
# layout a collective does not take is Horovod's ValueError ("Tensor type ... is not
# supported."), and a TypeError as ours was: ArgumentTypeError.
expect(hvd.ArgumentTypeError, ["'allreduce.flags'", here, "bool"], hvd.allreduce,
       torch.ones(3, dtype=torch.bool), name="flags")
expect(hvd.ArgumentTypeError, ["'allreduce.cplx'", here, "complex64"], hvd.allreduce,
       torch.ones(3, dtype=torch.complex64), name="cplx")
expect(hvd.ArgumentTypeError, ["'allreduce.sp'", here, "sparse"], hvd.allreduce,
       torch.eye(3).to_sparse(),
       name="sp")
# A tensor that is not contiguous: Horovod's ValueError ('Tensor is required to be
# contiguous.') for every collective, in place or not (NotContiguousError), the input
# untouched; also with the dtype refused first, as Horovod checks the type first.
strided = torch.arange(12.0).reshape(3, 4).t()
not_contiguous = {
    "allreduce": lambda t, name: hvd.allreduce(t, name=name),
    "allreduce_": lambda t, name: hvd.allreduce_(t, name=name),
    "allreduce_async": lambda t, name: hvd.allreduce_async(t, name=name),
    "allreduce_async_": lambda t, name: hvd.allreduce_async_(t, name=name),
    "grad_allreduce": lambda t, name: hvd.allreduce(t.detach().requires_grad_(), name=name),
    "grouped_allreduce": lambda t, name: hvd.grouped_allreduce([torch.ones(2), t], name=name),
    "grouped_allreduce_": lambda t, name: hvd.grouped_allreduce_([torch.ones(2), t], name=name),
    "allgather": lambda t, name: hvd.allgather(t, name=name),
    "grouped_allgather": lambda t, name: hvd.grouped_allgather([torch.ones(2), t], name=name),
    "broadcast": lambda t, name: hvd.broadcast(t, 0, name=name),
    "broadcast_": lambda t, name: hvd.broadcast_(t, 0, name=name),
    "broadcast_async_": lambda t, name: hvd.broadcast_async_(t, 0, name=name),
    "alltoall": lambda t, name: hvd.alltoall(t, name=name),
    "reducescatter": lambda t, name: hvd.reducescatter(t, name=name),
    "grouped_reducescatter": lambda t, name: hvd.grouped_reducescatter([torch.ones(n), t],
                                                                      name=name),
}
for kind, call in not_contiguous.items():
    before = strided.clone()
    expect(hvd.NotContiguousError, [f".{kind}.strided", here, "not contiguous"], call, strided,
           f"{kind}.strided")
    assert torch.equal(strided, before) and not strided.is_contiguous(), kind
assert issubclass(hvd.NotContiguousError, ValueError)
expect(hvd.ArgumentTypeError, ["bool"], hvd.allreduce, torch.ones(3, 4, dtype=torch.bool).t())
expect(TypeError, ["'allreduce.lst'", "torch.Tensor"], hvd.allreduce, [1, 2], name="lst")
expect(ValueError, ["'broadcast.b'", "root_rank", str(n)], hvd.broadcast, torch.ones(2), n,
       name="b")
expect(ValueError, ["'broadcast.b2'", "root_rank"], hvd.broadcast, torch.ones(2), -1, name="b2")
expect(ValueError, ["'alltoall.a2a'", "non-negative"], hvd.alltoall, torch.ones(n, 2),
       splits=[-1] + [1] * (n - 1) if n > 1 else [-1], name="a2a")
expect(ValueError, ["'alltoall.a2b'", "summing to at most"], hvd.alltoall, torch.ones(n, 2),
       splits=[2] * n, name="a2b")     # (fewer than the rows are fine, as in Horovod)
expect(ValueError, ["'allreduce.dev'", here, "meta"], hvd.allreduce, torch.ones(2, device="meta"),
       name="dev")
expect(ValueError, ["'broadcast.dev2'", here, "meta"], hvd.broadcast_,
       torch.ones(2, device="meta"), 0,
       name="dev2")
expect(hvd.UnsupportedError, ["Adasum only reduces allreduces"], hvd.reducescatter,
       torch.ones(2), op=hvd.Adasum)
if n & (n - 1):     # Horovod's Adasum needs a power-of-two number of ranks
    expect(NotImplementedError, ["power-of-two", str(n)], hvd.allreduce, torch.ones(2),
           op=hvd.Adasum)
# Adasum on a set other than the global one: Horovod's NotImplementedError, before the tensor
# is looked at, from every allreduce; the set goes on.
if n > 1:     # (a set of rank 0 alone is the global set at 1 rank)
    alone = hvd.add_process_set([0])
    if r == 0:
        adasum_calls = {
            "allreduce": lambda name: hvd.allreduce(torch.ones(2), name=name, op=hvd.Adasum,
                                                    process_set=alone),
            "allreduce_": lambda name: hvd.allreduce_(torch.ones(2), name=name, op=hvd.Adasum,
                                                      process_set=alone),
            "allreduce_async": lambda name: hvd.allreduce_async(
                torch.ones(2), name=name, op=hvd.Adasum, process_set=alone),
            "grouped_allreduce": lambda name: hvd.grouped_allreduce(
                [torch.ones(2)], name=name, op=hvd.Adasum, process_set=alone),
            "compressed": lambda name: hvd.allreduce(
                torch.ones(2), name=name, op=hvd.Adasum, process_set=alone,
                compression=hvd.Compression.fp16),
            "bool": lambda name: hvd.allreduce(torch.ones(2, dtype=torch.bool), name=name,
                                               op=hvd.Adasum, process_set=alone),
        }
        for kind, call in adasum_calls.items():
            expect(NotImplementedError, [f".adasum.{kind}'", here,
                                         "Adasum does not support non-global process sets"],
                   call, f"adasum.{kind}")
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=alone),
                           torch.ones(2))
    assert hvd.remove_process_set(alone)
expect(ValueError, ["not both"], hvd.allreduce, torch.ones(2), average=True, op=hvd.Sum)
expect(ValueError, ["'reducescatter.rs0'", "at least one dimension"], hvd.reducescatter,
       torch.tensor(1.0),
       name="rs0")

# A name reused while the first collective is still in flight (the engine is held on an
# event so that "in flight" is certain, not a race).
from ringreduce.sets.process_sets import global_set

release = threading.Event()
blocker = global_set("test").engine.submit("test.blocker", release.wait)
h = hvd.allreduce_async(torch.ones(1000), name="dup")
expect(ValueError, ["'allreduce.dup'", "in flight", here], hvd.allreduce_async, torch.ones(3),
       name="dup")
assert not hvd.poll(h)
release.set()
hvd.synchronize(blocker)
assert torch.equal(hvd.synchronize(h), torch.ones(1000))

# Cross-rank mismatches: MismatchError on every rank, naming the tensor and each rank's value.
if n > 1:
    x = torch.ones(3 + r)
    msg = expect(hvd.MismatchError,
                 ["'allreduce.shape_mm'", "'shape'", "rank 0: (3,)", "rank 1: (4,)"],
                 hvd.allreduce_, x, name="shape_mm")
    assert torch.equal(x, torch.ones(3 + r)), "input changed by a failed collective"
    # a grouped allreduce of one tensor on rank 0 (which signs as one allreduce) and of two
    # on the others: the number of tensors named (it said "'dtype' differs", with a None)
    expect(hvd.MismatchError, ["'number of tensors' differs", "rank 0: 1", "rank 1: 2"],
           hvd.grouped_allreduce, [torch.ones(2)] * (1 + (r > 0)), name="count_mm")
    # the same on the block-by-block path, and between it and the small path
    big = torch.ones(300_000 + r)
    expect(hvd.MismatchError, ["'allreduce.big_mm'", "'shape'", "rank 0: (300000,)"],
           hvd.allreduce_,
           big, name="big_mm")
    assert torch.equal(big, torch.ones(300_000 + r)), "input changed by a failed collective"
    expect(hvd.MismatchError,
           ["'allreduce.mixed_mm'", "'shape'", "rank 0: (300000,)", "rank 1: (10,)"],
           hvd.allreduce, torch.ones(300_000 if r == 0 else 10), name="mixed_mm")
    dtype = torch.float32 if r == 0 else torch.float64
    expect(hvd.MismatchError, ["'allreduce.dtype_mm'", "'dtype'", "float32", "float64"],
           hvd.allreduce,
           torch.ones(4, dtype=dtype), name="dtype_mm")
    expect(hvd.MismatchError, ["'allreduce.op_mm'", "'op'", "Sum", "Max"], hvd.allreduce,
           torch.ones(4),
           name="op_mm", op=hvd.Sum if r == 0 else hvd.Max)
    expect(hvd.MismatchError, ["'broadcast.root_mm'", "'root_rank'"], hvd.broadcast, torch.ones(4),
           root_rank=0 if r == 0 else 1, name="root_mm")
    # One name given to a collective of another kind on rank 0 than on the others: names are
    # qualified by kind (Horovod's), so the two never pair; after a stall check's time (1 s in
    # this launch) every rank fails its call with MismatchError naming both, and goes on. Each
    # kind's check carries the name it was submitted under (a sparse allreduce's once carried
    # others, and the engine put it back in order without end).
    kinds = {
        "allgather": lambda name: hvd.allgather(torch.ones(2), name=name),
        "broadcast": lambda name: hvd.broadcast(torch.ones(2), 0, name=name),
        "sparse_allreduce": lambda name: hvd.sparse_allreduce_async(
            torch.eye(3).to_sparse(), name, hvd.Sum)(),
        "broadcast_object": lambda name: hvd.broadcast_object(1, 0, name=name),
        "check_consistency": lambda name: hvd.check_consistency([torch.ones(2)], name=name),
    }
    others = list(range(1, n))
    for kind, call in kinds.items():
        name = f"{kind}_mm"
        mine = f"{kind}.{name}" if r == 0 else f"allreduce.{name}"
        expect(hvd.MismatchError, [f"rank {r}: collective '{mine}' cannot run",
                                   f"the name '{name}' was given to", f"{kind} on ranks [0]",
                                   f"allreduce on ranks {others}", "never pair"],
               call if r == 0 else lambda name: hvd.allreduce(torch.ones(3), name=name), name)
    # Not a mistake: rank 0 has both kinds of one name pending for longer than a stall check
    # while the others wait in another collective before submitting them; all complete.
    if r == 0:
        both = [hvd.allreduce_async(torch.ones(2), name="both", op=hvd.Sum),
                hvd.allgather_async(torch.ones(1), name="both")]
        time.sleep(2.5)
        x = hvd.allreduce(torch.ones(1), name="x_first", op=hvd.Sum)
    else:
        x = hvd.allreduce(torch.ones(1), name="x_first", op=hvd.Sum)
        both = [hvd.allgather_async(torch.ones(1), name="both"),
                hvd.allreduce_async(torch.ones(2), name="both", op=hvd.Sum)][::-1]
    assert torch.equal(x, torch.full((1,), float(n)))
    assert torch.equal(hvd.synchronize(both[0]), torch.full((2,), float(n)))
    assert torch.equal(hvd.synchronize(both[1]), torch.ones(n))
    expect(hvd.MismatchError, ["'allgather.ag_mm'", "trailing shape"], hvd.allgather,
           torch.ones(2, 1 + (r > 0)), name="ag_mm")
    expect(hvd.MismatchError, ["'allreduce.scale_mm'", "'prescale'"], hvd.allreduce, torch.ones(4),
           name="scale_mm", prescale_factor=1.0 if r == 0 else 2.0)
    # A grouped call given another number of tensors on the last rank alone (2 against 1, 3
    # against 2): its first tensor meets the others', and the count differs
    for mine, theirs in ((2, 1), (3, 2)):
        count = mine if r == n - 1 else theirs
        expect(hvd.MismatchError, ["'tensors' differs", f"rank {n - 1}: {mine}"],
               hvd.grouped_allgather, [torch.ones(2)] * count)
        expect(hvd.MismatchError, ["'tensors' differs", f"rank {n - 1}: {mine}"],
               hvd.grouped_reducescatter, [torch.ones(n)] * count)
    # A mistake in the arguments of the last rank alone, named or not: TypeError/ValueError
    # (or UnsupportedError) there, at once a MismatchError quoting it on the others (not a
    # wait for a call never made), and the automatic names still in step afterwards.
    last = r == n - 1
    refused = ["cannot run", f"arguments of rank {n - 1}"]
    flags = torch.ones(3, dtype=torch.bool if last else torch.float32)
    wide = torch.ones(3, dtype=torch.complex128 if last else torch.float32)   # moved: 16 bytes
    if last:
        expect(hvd.ArgumentTypeError, ["'allreduce.one_bad'", "bool"], hvd.allreduce, flags,
               name="one_bad")
        expect(ValueError, ["does not divide"], hvd.alltoall, torch.ones(n + 1, 2))
        expect(ValueError, ["root_rank"], hvd.broadcast_, torch.ones(2), n)
        expect(TypeError, ["'grouped_allreduce.one_bad_group[1]'", "bool"], hvd.grouped_allreduce,
               [torch.ones(2), flags], name="one_bad_group")
        expect(ValueError, ["at least one dimension"], hvd.reducescatter, torch.tensor(1.0))
        expect(hvd.UnsupportedError, ["Adasum only reduces allreduces"], hvd.reducescatter,
               torch.ones(n), op=hvd.Adasum)
        expect(TypeError, ["'grouped_allgather.one_bad_gather.1'", "complex128"],
               hvd.grouped_allgather,
               [torch.ones(2), wide], name="one_bad_gather")
        expect(TypeError, ["'sparse_allreduce.one_bad_sparse'", "sparse COO"],
               hvd.sparse_allreduce_async,
               torch.ones(3), "one_bad_sparse", hvd.Sum)
        expect(ValueError, ["root_rank"], hvd.broadcast_object, {"a": r}, root_rank=n + 5)
        expect(hvd.HorovodInternalError, ["Adasum"], hvd.allreduce,
               torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    else:
        expect(hvd.MismatchError, refused + ["'allreduce.one_bad'", "bool"], hvd.allreduce, flags,
               name="one_bad")
        expect(hvd.MismatchError, refused + ["does not divide"], hvd.alltoall,
               torch.ones(n, 2))
        expect(hvd.MismatchError, refused + ["root_rank"], hvd.broadcast_, torch.ones(2), 0)
        expect(hvd.MismatchError, refused + ["bool"], hvd.grouped_allreduce,
               [torch.ones(2), flags], name="one_bad_group")
        expect(hvd.MismatchError, refused + ["at least one dimension"], hvd.reducescatter,
               torch.ones(n))
        expect(hvd.MismatchError, refused + ["Adasum only reduces allreduces"],
               hvd.reducescatter, torch.ones(n))
        expect(hvd.MismatchError, refused + ["complex128"], hvd.grouped_allgather,
               [torch.ones(2), wide], name="one_bad_gather")
        expect(hvd.MismatchError, refused + ["sparse COO"],
               lambda: hvd.sparse_allreduce_async(torch.eye(3).to_sparse(), "one_bad_sparse",
                                                  hvd.Sum)())
        expect(hvd.MismatchError, refused + ["root_rank"], hvd.broadcast_object, {"a": r},
               root_rank=0)
        expect(hvd.MismatchError, refused + ["Adasum"], hvd.allreduce,
               torch.ones(2, dtype=torch.int32), op=hvd.Sum)
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    assert torch.equal(hvd.alltoall(torch.ones(n, 2)), torch.ones(n, 2))
    # The last rank's tensor alone is not contiguous (the others' are): NotContiguousError
    # there, at once a MismatchError quoting it on the others, nothing written anywhere, and
    # the collectives after it (unnamed ones too) run as usual.
    odd = torch.ones(3, 4).t() if last else torch.ones(4, 3)
    big = torch.ones(2, 300_000).t() if last else torch.ones(300_000, 2)
    one_odd = {
        "nc.allreduce_": lambda t, name: hvd.allreduce_(t, name=name, op=hvd.Sum),
        "nc.broadcast_": lambda t, name: hvd.broadcast_(t, 0, name=name),
        "nc.allgather": lambda t, name: hvd.allgather(t, name=name),
        "nc.alltoall": lambda t, name: hvd.alltoall(t, splits=[1] * n, name=name),
        "nc.reducescatter": lambda t, name: hvd.reducescatter(t, name=name),
        "nc.grouped_allreduce": lambda t, name: hvd.grouped_allreduce([torch.ones(2), t],
                                                                      name=name),
        "nc.big": lambda t, name: hvd.allreduce_(big, name=name),
        None: lambda t, name: hvd.allreduce_(t, op=hvd.Sum),
    }
    for name, call in one_odd.items():
        named = [f".{name}", "not contiguous"] if name else ["not contiguous"]
        if last:
            expect(hvd.NotContiguousError, named + [here], call, odd, name)
        else:
            expect(hvd.MismatchError, refused + named, call, odd, name)
        assert torch.equal(odd, torch.ones_like(odd)) and torch.equal(big, torch.ones_like(big))
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    assert torch.equal(hvd.allreduce_(odd.contiguous(), op=hvd.Sum),
                       torch.full((4, 3), float(n)))
    # A different number of parameters per rank, or the same ones bucketed otherwise: the
    # plan's check names them, as the optimizer is wrapped (a rank with more buckets waited
    # for ever at the step). A mistake in one rank's arguments meets the others' check.
    layers = [torch.nn.Linear(2, 2) for _ in range(2)]
    model = torch.nn.Sequential(*layers)

    def wrapped(mine):
        return lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model.named_parameters(),
                                                **(mine if r == 0 else {}))
    other = torch.nn.Sequential(*layers[:1 + (r == 0)])
    expect(hvd.MismatchError, ["plan'", "'plan' differs", "'1.weight' only on ranks [0]"],
           lambda: hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                            other.named_parameters()))
    expect(hvd.MismatchError, ["plan'", "the same names in another order"],
           wrapped({"num_groups": 2}))
    expect(hvd.MismatchError, ["plan'", "the same names in another order"],
           wrapped({"groups": [list(layers[0].parameters()), list(layers[1].parameters())]}))
    expect(hvd.MismatchError, ["plan'", "'bucket sizes' differs", "rank 0: (1, 3)"],
           wrapped({"first_bucket_bytes": 8}))
    expect(hvd.MismatchError, ["plan'", "'backward_passes_per_step' differs"],
           wrapped({"backward_passes_per_step": 2}))
    # Without named_parameters the names are positional: the last rank listing its parameters
    # in another order (of other shapes) summed one parameter's gradient with another's
    # elementwise, silently; the plan's shapes tell them apart
    shaped = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    listed = list(shaped.parameters())
    expect(hvd.MismatchError, ["plan'", "'allreduce.noname.0.0: (3, 2)' only on ranks"],
           lambda: hvd.DistributedOptimizer(torch.optim.SGD(
               listed[::-1] if r == n - 1 else listed, lr=0.1)))
    for mistake, words in (({"backward_passes_per_step": 0}, "backward_passes_per_step"),
                           ({"groups": "two"}, "groups must be")):
        if r == 0:
            expect(ValueError, words, wrapped(mistake))
        else:
            expect(hvd.MismatchError, ["plan' cannot run", "rank 0", words], wrapped({}))
    # Later, at a step: a parameter unfrozen on the last rank only gives it a bucket more (the
    # others' first buckets match its own); that rank waited for ever for the others' third
    # bucket. Now every rank's step fails, step after step, until every rank unfreezes it.
    frozen = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    frozen[0].weight.requires_grad_(False)
    hvd.broadcast_parameters(frozen.state_dict(), 0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(frozen.parameters(), lr=0.1), frozen.named_parameters(),
        groups=[[frozen[1].weight, frozen[1].bias], [frozen[0].bias], [frozen[0].weight]])

    def frozen_step(model, opt):
        opt.zero_grad()
        model(torch.ones(2, 2, requires_grad=True) * (r + 1)).sum().backward()
        opt.step()
    frozen_step(frozen, opt)
    frozen[0].weight.requires_grad_(last)
    for _ in range(2):
        expect(hvd.MismatchError, ["bucket.0'", "'plan' differs",
                                   f"'0.weight' only on ranks [{n - 1}]"], frozen_step, frozen, opt)
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    # Frozen again on that rank, the flags agree again, and so does the plan: the failed plans
    # left no trace (issue 56: every step failed for ever, naming the parameter).
    frozen[0].weight.requires_grad_(False)
    frozen[0].weight.grad = None
    frozen_step(frozen, opt)
    hvd.check_consistency(frozen, name="frozen again everywhere")
    frozen[0].weight.requires_grad_(True)
    frozen_step(frozen, opt)
    hvd.check_consistency(frozen, name="unfrozen everywhere")
    # The same where every parameter was frozen at wrapping: the empty plan's first bucket, of
    # no parameters, meets the last rank's (it waited for ever for the others' first bucket).
    all_frozen = torch.nn.Linear(2, 1).requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(all_frozen.parameters(), lr=0.1),
                                   all_frozen.named_parameters())
    frozen_step(all_frozen, opt)
    all_frozen.weight.requires_grad_(last)
    expect(hvd.MismatchError, ["bucket.0'", f"'weight' only on ranks [{n - 1}]"],
           frozen_step, all_frozen, opt)
    handles = [hvd.allreduce_async(torch.ones(10), name="fine.0"),
               hvd.allreduce_async(torch.ones(10 + r), name="async_mm"),
               hvd.allreduce_async(torch.ones(10), name="fine.1")]
    assert torch.equal(hvd.synchronize(handles[0]), torch.ones(10))
    expect(hvd.MismatchError, ["'allreduce.async_mm'"], hvd.synchronize, handles[1])
    assert torch.equal(hvd.synchronize(handles[2]), torch.ones(10))
    # In place, small: begun on this thread (completed there when the peers are in step); the
    # mismatch still comes from synchronize, and the tensor is left as it was.
    mine = torch.ones(10 + (r == n - 1))
    handles = [hvd.allreduce_async_(torch.ones(10), name="fine_.0"),
               hvd.allreduce_async_(mine, name="async_mm_"),
               hvd.allreduce_async_(torch.ones(10), name="fine_.1")]
    assert torch.equal(hvd.synchronize(handles[0]), torch.ones(10))
    expect(hvd.MismatchError, ["'allreduce.async_mm_'", "shape"], hvd.synchronize, handles[1])
    assert torch.equal(mine, torch.ones(10 + (r == n - 1))), "async_mm_: tensor changed"
    assert torch.equal(hvd.synchronize(handles[2]), torch.ones(10))

# Any exception on one rank's engine thread (here from a compressor's decompress, after the
# exchange) fails that collective there: with a RingReduceError chaining it, or, an interrupt
# (KeyboardInterrupt, SystemExit), as itself; the other ranks get their result, and the
# engine goes on (a thread that died would hang the next ones).
class Exploding(hvd.Compression.fp16):
    raised = None

    @classmethod
    def decompress(cls, tensor, ctx):
        if r == n - 1 and cls.raised is not None:
            raise cls.raised("injected on the engine thread")
        return super().decompress(tensor, ctx)


for error in (KeyboardInterrupt, MemoryError, SystemExit):
    Exploding.raised = error
    handle = hvd.allreduce_async(torch.ones(4), name=f"exploding.{error.__name__}", op=hvd.Sum,
                                 compression=Exploding)
    if r == n - 1 and issubclass(error, Exception):
        expect(hvd.RingReduceError, [error.__name__, "injected on the engine thread",
                                     f"exploding.{error.__name__}"], hvd.synchronize, handle)
    elif r == n - 1:
        expect(error, "injected on the engine thread", hvd.synchronize, handle)
    else:
        assert torch.equal(hvd.synchronize(handle), torch.full((4,), float(n))), error
    assert torch.equal(hvd.allreduce_async(torch.ones(2), op=hvd.Sum).wait(),
                       torch.full((2,), float(n))), f"engine unusable after {error.__name__}"


# A failure inside the engine thread's reduction on every rank (MPI's, say) reaches
# DistributedOptimizer.step() as a RingReduceError naming the bucket, its cause chained; then
# the job goes on. (A job of one process reduces no gradient, as Horovod's.)
def broken_reduce(*args, **kwargs):
    raise OSError("injected failure inside the engine thread")


if n > 1:
    layer = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1),
                                   named_parameters=layer.named_parameters())
    working_reduce, Transport.allreduce = Transport.allreduce, broken_reduce
    try:
        layer(torch.ones(4, 8)).sum().backward()    # (the bucket starts here, in its hook)
        opt.step()
        raise AssertionError("step() did not raise")
    except hvd.RingReduceError as e:
        assert isinstance(e.__cause__, OSError), repr(e.__cause__)
        assert "bucket.0" in str(e) and "injected failure inside the engine" in str(e), e
    finally:
        Transport.allreduce = working_reduce
assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)))

# Empty and 0-d tensors give correct results in every collective.
assert hvd.allreduce(torch.ones(0, 3)).shape == (0, 3)
assert hvd.allgather(torch.ones(0, 2)).shape == (0, 2)
assert hvd.broadcast(torch.ones(0), 0).shape == (0,)
assert hvd.alltoall(torch.ones(0, 2)).shape == (0, 2)
assert hvd.reducescatter(torch.ones(0, 2)).shape == (0, 2)
assert hvd.broadcast(torch.tensor(float(r)), 0).item() == 0.0
assert hvd.allreduce(torch.tensor(2, dtype=torch.int32), op=hvd.Product).item() == 2 ** n

# Still usable afterwards.
assert torch.equal(hvd.allreduce(torch.ones(5) * r, op=hvd.Sum), torch.full((5,), n * (n - 1) / 2))
hvd.barrier()

# An object that one rank cannot pickle: broadcast_object's root, or one rank in
# allgather_object, refuses it in the signature check, so every rank raises (the same
# MismatchError quoting it), and the job goes on. Where every rank's pickling fails alike (and
# at 1 rank), each raises its own pickling error, as on Horovod (which pickles first), and the
# set goes on (it was once shut down).
if n > 1:
    expect(hvd.MismatchError,
           ["'broadcast_object.lock'", f"rank {n - 1}: TypeError: cannot pickle"],
           hvd.broadcast_object, threading.Lock() if r == n - 1 else 0, root_rank=n - 1,
           name="lock")
    expect(hvd.MismatchError, ["'allgather_object.locks'", "rank 0: TypeError: cannot pickle"],
           hvd.allgather_object, threading.Lock() if r == 0 else r, name="locks")
else:
    expect(TypeError, "cannot pickle", hvd.broadcast_object, threading.Lock(), name="lock")
expect(TypeError, "cannot pickle", hvd.allgather_object, threading.Lock(), name="all locks")
expect(TypeError, "cannot pickle", hvd.allgather_object, {"lock": threading.Lock()})
assert hvd.broadcast_object({"from": r}, root_rank=n - 1) == {"from": n - 1}
assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(n)]


# Objects travel by cloudpickle, as on Horovod: a lambda, a closure, a class of __main__.
class Config:
    def __init__(self, rank):
        self.rank = rank


def scaler(factor):
    return lambda x: x * factor


got = hvd.broadcast_object((lambda x: x + n, scaler(r + 10), Config(r)), root_rank=n - 1)
assert (got[0](1), got[1](2), got[2].rank) == (1 + n, 2 * (n + 9), n - 1), "broadcast_object"
everyone = hvd.allgather_object((scaler(r), Config(r)))
assert [(f(3), c.rank) for f, c in everyone] == [(3 * k, k) for k in range(n)], "allgather_object"

# A failure on one rank before its collective began there (the output's allocation): the call
# still meets the others' (a check carrying the error), so theirs fail with a MismatchError
# quoting it, its own with the error as cause, and the set goes on.
def expect_met(name, injected, call, *args, **kwargs):
    """`call` fails on rank n-1 with MemoryError(injected), met on the others."""
    try:
        call(*args, name=name, op=hvd.Sum, **kwargs)
        raise AssertionError(f"{name}: no error")
    except hvd.RingReduceError as e:
        if r == n - 1:
            assert isinstance(e.__cause__, MemoryError) and f".{name}'" in str(e), repr(e)
        else:
            assert isinstance(e, hvd.MismatchError), repr(e)
            for fragment in [f".{name}' cannot run: a failure before its data moved, on rank",
                             f"rank {n - 1}: MemoryError: {injected}"]:
                assert fragment in str(e), f"{fragment!r} not in {e}"


def failing_fresh(*args, **kwargs):
    reductions.fresh = allocating
    raise MemoryError("injected before the collective")


allocating = reductions.fresh
if r == n - 1:
    reductions.fresh = failing_fresh
try:
    expect_met("early", "injected before the collective", hvd.allreduce, torch.ones(1 << 18))
finally:
    reductions.fresh = allocating
assert torch.equal(hvd.allreduce(torch.ones(1 << 18), op=hvd.Sum),
                   torch.full((1 << 18,), float(n)))

# The same for a group of two dtypes, whose second fused buffer cannot be made on rank n-1:
# every buffer is made before the first exchange, so the failure still meets the others' call.
def failing_cat(*args, **kwargs):
    failing_cat.calls += 1
    if failing_cat.calls == 2:
        raise MemoryError("injected at the second fusion")
    return concatenating(*args, **kwargs)


failing_cat.calls = 0
concatenating = torch.cat
if r == n - 1:
    torch.cat = failing_cat
try:
    expect_met("early2", "injected at the second fusion", hvd.grouped_allreduce,
               [torch.ones(4), torch.ones(4, dtype=torch.float64)])
finally:
    torch.cat = concatenating
assert [t.tolist() for t in hvd.grouped_allreduce(
    [torch.ones(2), torch.ones(2, dtype=torch.float64)], op=hvd.Sum)] == [[float(n)] * 2] * 2

# A failure of one rank's own inside a collective, once the members have agreed to run it
# (they wait for data it will never send): every member raises, the others ShutDownError naming
# that rank and its cause, at once (no stall); every later collective on that set says so (its
# traffic is out of step), until shutdown() and init() start afresh, here before the next part.
# First in a set of ranks 0..n-2 (from 3 ranks), its last member failing: the job's other sets
# go on, and the broken set can be removed and added afresh; then in the global set, rank n-1
# failing.
def failing_check(self, spec):
    checking(self, spec)
    if spec.describe()["name"] == "allreduce.lone":
        raise MemoryError("injected on one rank")


def fail_alone(failing_rank, process_set):
    if r == failing_rank:
        SetParts.check = failing_check
    try:
        hvd.allreduce(torch.ones(1 << 18), name="lone", op=hvd.Sum, prescale_factor=2.0,
                      process_set=process_set)  # (checked on its own on every path, then)
        raise AssertionError("no error")
    except hvd.RingReduceError as e:
        if r == failing_rank:
            assert isinstance(e.__cause__, MemoryError) and "'allreduce.lone'" in str(e), repr(e)
            assert "failed here (MemoryError: injected on one rank), and the other members " \
                "were told" in str(e), str(e)
        else:
            assert isinstance(e, hvd.ShutDownError), repr(e)
            for fragment in [f"rank {failing_rank} failed in its collective",
                             "allreduce 'allreduce.lone'",
                             "MemoryError: injected on one rank", "out of step"]:
                assert fragment in str(e), f"{fragment!r} not in {e}"
    finally:
        SetParts.check = checking
    expect(hvd.ShutDownError, ["allreduce 'allreduce.lone'", "shutdown() and init()"],
           hvd.allgather,
           torch.ones(1), name="after.lone", process_set=process_set)
    # (a small named in-place allreduce, the small way's flat call, counts it as begun first)
    expect(hvd.ShutDownError, ["allreduce 'allreduce.lone'", "shutdown() and init()"],
           hvd.allreduce_, torch.ones(1), name="after.lone.small", process_set=process_set)
    if process_set is not hvd.global_process_set:
        expect(hvd.ShutDownError, "remove_process_set() and add_process_set()", hvd.barrier,
               process_set=process_set)


checking = SetParts.check
if n > 2:
    part = hvd.add_process_set(list(range(n - 1)))
    if r < n - 1:
        fail_alone(n - 2, part)
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)))
    assert hvd.remove_process_set(part)
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)))
    part = hvd.add_process_set(list(range(n - 1)))     # the same ranks afresh
    if r < n - 1:
        assert torch.equal(hvd.allreduce(torch.ones(1 << 18), op=hvd.Sum, process_set=part),
                           torch.full((1 << 18,), float(n - 1)))
    assert hvd.remove_process_set(part)
# A DistributedOptimizer made before the failure and the shutdown() + init() that follow it
# trains on after them, as Horovod's does: one step before, one after, equal to one process's.
torch.manual_seed(3)
survivor = torch.nn.Linear(4, 3)
reference = torch.nn.Linear(4, 3)
reference.load_state_dict(survivor.state_dict())
survivor_opt = hvd.DistributedOptimizer(torch.optim.SGD(survivor.parameters(), lr=0.1),
                                        survivor.named_parameters())
reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)


def survivor_step(step):
    def batch(k):
        return torch.arange(12.0).reshape(3, 4) * (k + 1) + step

    survivor_opt.zero_grad()
    survivor(batch(r)).sum().backward()
    survivor_opt.step()
    reference_opt.zero_grad()
    sum(reference(batch(k)).sum() for k in range(n)).div(n).backward()
    reference_opt.step()


survivor_step(0)
stale = hvd.add_process_set([0]) if n > 1 else None
if n > 1:
    fail_alone(n - 1, hvd.global_process_set)

# check_consistency: silent on identical ranks, a named error on every rank otherwise; and the
# opt-in per-step check inside DistributedOptimizer, every 2 steps from a new init().
hvd.shutdown()
hvd.init(consistency_check_steps=2)
survivor_step(1)
# a set registered before shutdown() is not registered after init(), and
# does not stand for a set registered since under the same id
if stale is not None:
    assert stale.process_set_id is None, stale
    fresh = hvd.add_process_set([0])
    expect(ValueError, "not registered", hvd.allreduce, torch.ones(1), process_set=stale)
    assert stale.process_set_id is None and fresh.process_set_id is not None
    assert hvd.remove_process_set(fresh)
for mine, theirs in zip(survivor.parameters(), reference.parameters()):
    assert torch.allclose(mine, theirs, atol=1e-5), "the optimizer after init() again"
assert hvd.allgather(survivor.weight.detach().reshape(1, -1)).unique(dim=0).shape[0] == 1
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                            torch.nn.Linear(4, 2))
hvd.check_consistency(model)
hvd.check_consistency(model.state_dict())
hvd.check_consistency([torch.ones(3), torch.zeros(2)])

if n > 1:
    with torch.no_grad():
        if r == n - 1:
            model[2].bias[0] += 1.0
    try:
        hvd.check_consistency(model)
        raise AssertionError("no ConsistencyError")
    except hvd.ConsistencyError as e:
        assert "'2.bias'" in str(e) and f"ranks [{n - 1}]" in str(e), e
    try:   # a different number of tensors per rank
        hvd.check_consistency([torch.ones(1)] * (1 + (r == 0)))
        raise AssertionError("no MismatchError")
    except hvd.MismatchError as e:
        assert "check_consistency" in str(e) and "'tensors'" in str(e), e
    # the same bytes as a tensor of another shape, or of another dtype, are another tensor
    for odd in (torch.zeros(4), torch.zeros(2, 2, dtype=torch.int32)):
        try:
            hvd.check_consistency([("t", odd if r == n - 1 else torch.zeros(2, 2))])
            raise AssertionError("no ConsistencyError")
        except hvd.ConsistencyError as e:
            assert "'t'" in str(e) and f"ranks [{n - 1}]" in str(e), e
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.check_consistency(model)

    # The optimizer checks every 2 steps: a rank that changes a weight on its own is caught.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    model.train()
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        if step == 2 and r == 0:
            with torch.no_grad():
                model[0].weight[0, 0] += 1.0
        try:
            opt.step()
        except hvd.ConsistencyError as e:
            assert step == 3 and "'0.weight'" in str(e), (step, e)
            break
    else:
        raise AssertionError("the per-step consistency check never fired")

# A small asynchronous allreduce that one rank begins late: the others post theirs and find
# the peers missing (the way's begin says None), so the rest waits in the queue and completes
# in synchronize(); with a shape of its own on the late rank, a MismatchError everywhere.
small = active(hvd.global_process_set, "late").transport.small
if n > 1 and small is not None and small.begins:
    outcomes, begin = [], small._begin
    small._begin = lambda *args: outcomes.append(begin(*args)) or outcomes[-1]
    try:
        for late in range(n):
            if r == late:
                time.sleep(0.05)
            handle = hvd.allreduce_async_(torch.full((4,), float(r + 1)), op=hvd.Sum)
            assert torch.equal(hvd.synchronize(handle), torch.full((4,), n * (n + 1) / 2))
        if r == 0:
            time.sleep(0.05)
        expect(hvd.MismatchError, ["'allreduce.late_mm'", "'shape' differs"], hvd.synchronize,
               hvd.allreduce_async_(torch.ones(4 + (r == n - 1)), name="late_mm"))
    finally:
        small._begin = begin
    assert None in outcomes, outcomes       # (each rank was early n - 1 times)

# Deadlocks of the program: the last rank alone calls something else, and then every thread
# that submits collectives, on every rank, waits for one that no other rank has pending (a
# name of its own, SyncBatchNorm in eval mode, a barrier against an allreduce): after a second
# of that, not after stall reports, every rank fails the collective it waits in with
# MismatchError saying what each rank has pending, and the job goes on (its unnamed
# collectives too: their counts of automatic names are realigned). Not a deadlock: a rank
# whose other thread, one that has submitted before, is still to submit the others' one.
if n > 1:
    last, stuck = r == n - 1, "none can come"
    expect(hvd.MismatchError, [f"rank {r}: collective 'allreduce.{'b' if last else 'a'}_dl'",
                               stuck, f"rank {n - 1}: 'allreduce.b_dl'",
                               "rank 0: 'allreduce.a_dl'"],
           hvd.allreduce, torch.ones(2), name="b_dl" if last else "a_dl")
    norm = hvd.SyncBatchNorm(3)
    norm.train(not last)
    expect(hvd.MismatchError, [stuck, f"rank {n - 1}: 'allreduce.loss_dl'",
                               "rank 0: 'allgather.sync_batch_norm"],
           lambda: hvd.allreduce(norm(torch.randn(4, 3)).sum().detach(), name="loss_dl"))
    norm.train()
    assert torch.equal(hvd.allreduce(torch.ones(2), name="after_dl", op=hvd.Sum),
                       torch.full((2,), float(n)))
    late = {}

    def later() -> None:
        hvd.allreduce(torch.ones(1), name="warm_dl")    # a submitter of the set from now on
        if last:
            time.sleep(2.5)
            late["a"] = hvd.allreduce(torch.ones(2), name="late_a_dl", op=hvd.Sum)

    thread = threading.Thread(target=later)
    thread.start()
    if last:
        late["b"] = hvd.allreduce(torch.ones(2), name="late_b_dl", op=hvd.Sum)
    else:
        late["a"] = hvd.allreduce(torch.ones(2), name="late_a_dl", op=hvd.Sum)
        late["b"] = hvd.allreduce(torch.ones(2), name="late_b_dl", op=hvd.Sum)
    thread.join()
    assert all(torch.equal(late[k], torch.full((2,), float(n))) for k in "ab"), late
    # Two optimizers (a GAN's) stepped in the other order on the last rank: each step's
    # agreement waits for the other optimizer's on the others. Both steps fail on every rank
    # (the first in a deadlock, the second where each rank owes it, or in another), and the
    # next steps, in one order, train the ranks alike.
    torch.manual_seed(5)
    nets = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                           [(f"net{i}.{k}", p)
                                            for k, p in net.named_parameters()])
                  for i, net in enumerate(nets)]

    def gan_step(order: list, fails: bool) -> None:
        for net, opt in zip(nets, optimizers):
            opt.zero_grad()
            net(torch.randn(4, 3)).sum().backward()
        for i in order:
            if fails:
                expect(hvd.MismatchError, "agreement' cannot run", optimizers[i].step)
            else:
                optimizers[i].step()

    gan_step([1, 0] if last else [0, 1], fails=True)
    gan_step([0, 1], fails=False)
    for net in nets:
        for p in net.parameters():
            assert torch.equal(hvd.allreduce(p.detach(), name="dl_p", op=hvd.Max), p.detach())
    # A barrier against an allreduce: automatic names count per kind, so each rank failed one
    # of another kind; the counts are realigned, so the unnamed collectives after it pair.
    expect(hvd.MismatchError, [stuck, f"rank {n - 1}: 'barrier.noname.",
                               "rank 0: 'allreduce.noname."],
           lambda: hvd.barrier() if last else hvd.allreduce(torch.ones(2)))
    for k in range(3):
        assert torch.equal(hvd.allreduce(torch.full((2,), float(r + k)), op=hvd.Sum),
                           torch.full((2,), float(n * k + n * (n - 1) // 2)))
        hvd.barrier()
    assert hvd.allgather_object(r) == list(range(n))
    # One named collective more on the last rank (caught): the others fail the one they wait
    # in, which the last rank runs next; there it fails at once (it owes it), where it met
    # the others' next one in another deadlock, and that the one after, without end
    if last:
        expect(hvd.MismatchError, [stuck, "'allreduce.extra_dl'"], hvd.allreduce,
               torch.ones(2), name="extra_dl")
    expect(hvd.MismatchError,
           ["'allreduce.k0_dl' cannot run", f"failed on ranks {list(range(n - 1))} already"
            if last else stuck], hvd.allreduce, torch.ones(2), name="k0_dl")
    for k in (1, 2):
        assert torch.equal(hvd.allreduce(torch.full((2,), float(r)), name=f"k{k}_dl",
                                         op=hvd.Sum),
                           torch.full((2,), float(n * (n - 1) // 2)))
# A group of no tensors: a ValueError saying so, on every rank that passed one; where only the
# last rank did, its first name still meets the others' call, which fails quoting it; the
# calls after are exact.
for kind, call in (("grouped_allgather", hvd.grouped_allgather),
                   ("grouped_reducescatter", hvd.grouped_reducescatter)):
    for alone in ((False, True) if n > 1 else (False,)):
        empty = not alone or r == n - 1
        if empty:
            expect(ValueError, f"{kind} on rank {r}: no tensors", call, [])
        else:
            expect(hvd.MismatchError, ["a mistake in the arguments of rank", "no tensors"],
                   call, [torch.ones(n, 2)])
        total = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum)
        assert torch.equal(total, torch.full((2,), float(n * (n - 1) // 2))), (kind, total)
# A setting that decides how bytes move, set otherwise on the last rank alone (an init()
# argument computed per rank), then another ringreduce release there: init() fails on every
# rank, naming it and who has which value, before any collective could pair two ways; init()
# with them alike works.
if n > 1:
    hvd.shutdown()
    expect(hvd.RingReduceError, [f"init() on rank {r}", "small_message_bytes "
                                 "(RINGREDUCE_SMALL_MESSAGE_BYTES): 65536 on ranks "
                                 f"{list(range(n - 1))}, 4096 on ranks [{n - 1}]"],
           hvd.init, small_message_bytes=4096 if r == n - 1 else 65536)
    assert not hvd.is_initialized()
    release = world.__version__         # another install of ringreduce on the last rank
    world.__version__ = "0.0.1" if r == n - 1 else release
    expect(hvd.RingReduceError, [f"init() on rank {r}", f"ringreduce's version: {release!r} on "
                                 f"ranks {list(range(n - 1))}, '0.0.1' on ranks [{n - 1}]"],
           hvd.init)
    world.__version__ = release
    hvd.init()
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
print(f"OK rank {r}", flush=True)
