"""Process sets under a real mpiexec (any rank count from 2): registration from rank lists and
from a communicator split, every collective and the optimizer on a set (exact against a
reference built from the members' inputs, identical on every member),
sets running different collectives at the same time, nested and overlapping sets, one rank's
sets progressing independently, adding and removing sets during the run, and the errors.

Usage: process_sets_check.py [stall | SETTINGS]   ("stall": a member of a set sleeps past the
stall time; SETTINGS: a JSON object {label: {RINGREDUCE_* variable: value}}, every check once per
setting, a failure named by its label)
"""
import functools
import hashlib
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

import ringreduce as hvd
from checks import check_equal, expect, horovod_scaled, per_setting
from ringreduce.sets.process_sets import close_group, open_group
from models import Net

world = MPI.COMM_WORLD
r, n = world.rank, world.size
assert n >= 2, "run with 2 or more ranks"

split = low = None


def start():
    """init() with two sets registered: evens and odds (from a communicator split), and all
    but the last rank (3 ranks or more)."""
    global split, low
    split = hvd.ProcessSet(world.Split(color=r % 2, key=r))
    low = hvd.ProcessSet(range(n - 1)) if n >= 3 else None
    hvd.init(process_sets=[split] + ([low] if low else []))


DTYPES = [torch.int32, torch.float32, torch.bfloat16, torch.float64]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
LENGTHS = [0, 17, 70_001, 300_007]     # empty, small, blocks, several blocks


def member_comm(ps):
    """A plain mpi4py communicator of the set's members, to check results independently."""
    if isinstance(ps.process_set_id, str):      # open_group's: made by the members alone
        members = world.Get_group().Incl(ps.ranks)
        comm = world.Create_group(members)
        members.Free()
        return comm
    comm = world.Split(ps.process_set_id if r in ps.ranks else MPI.UNDEFINED, r)
    return comm if comm != MPI.COMM_NULL else None


def inputs(rank, length, dtype, op=hvd.Sum, salt=0):
    return _inputs(rank, length, dtype, op, salt).clone()


@functools.lru_cache(maxsize=None)      # the same inputs and references in every setting
def _inputs(rank, length, dtype, op, salt):
    g = torch.Generator().manual_seed(7919 * rank + 31 * length + salt)
    lo, hi = (-2, 3) if op == hvd.Product else (-8, 9)
    return torch.randint(lo, hi, (length,), generator=g, dtype=torch.int64).to(dtype)


def reference(ps, length, dtype, op, salt=0):
    return _reference(tuple(ps.ranks), length, dtype, op, salt).clone()


@functools.lru_cache(maxsize=None)
def _reference(ranks, length, dtype, op, salt):
    xs = torch.stack([inputs(k, length, dtype, op, salt).double() for k in ranks])
    out = {hvd.Sum: xs.sum, hvd.Average: xs.sum, hvd.Min: xs.amin, hvd.Max: xs.amax,
           hvd.Product: xs.prod}[op](0).to(dtype)
    return horovod_scaled(out, 1.0 / len(ranks)) if op == hvd.Average else out


def same_on_members(comm, t, what):
    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    digests = comm.allgather(hashlib.sha256(raw).digest())
    assert len(set(digests)) == 1, f"{what}: results differ across the set's members"


def check_registration():
    assert hvd.global_process_set.ranks == list(range(n))
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.size() == n
    assert hvd.global_process_set.rank() == r and hvd.global_process_set.included()
    mine = [k for k in range(n) if k % 2 == r % 2]
    assert split.ranks == mine and split.process_set_id not in (None, 0), split
    assert split.size() == len(mine) and split.rank() == mine.index(r) and split.included()
    if low is not None:
        assert low.ranks == list(range(n - 1)) and low.size() == n - 1
        assert low.process_set_id not in (None, 0, split.process_set_id), (low, split)
        assert low.included() == (r < n - 1)
        if r == n - 1:
            try:
                low.rank()
                raise AssertionError("rank() of a set this rank is not in did not raise")
            except ValueError as e:
                assert "not part of process set" in str(e), e
    # every rank knows every set; the other half of the split has its own id
    others = world.allgather((split.process_set_id, tuple(split.ranks)))
    assert len({pid for pid, _ in others}) == min(n, 2), others
    unregistered = hvd.ProcessSet([0])
    assert unregistered.size() is None and unregistered.rank() is None
    assert unregistered.included() == (r == 0)


def check_collectives(ps, what):
    """Every collective on `ps`, from its members."""
    comm = member_comm(ps)
    if comm is None:
        return
    k, me = len(ps.ranks), ps.ranks.index(r)
    for length in LENGTHS:
        for dtype in DTYPES:
            for op in OPS:
                label = f"{what}: allreduce len={length} {dtype} {op.name}"
                x = inputs(r, length, dtype, op)
                got = hvd.allreduce(x, op=op, name=label, process_set=ps)
                check_equal(got, reference(ps, length, dtype, op), label)
                check_equal(x, inputs(r, length, dtype, op), f"{label}: input")
                same_on_members(comm, got, label)
    y = inputs(r, 5000, torch.float32)
    assert hvd.allreduce_(y, op=hvd.Sum, process_set=ps) is y
    check_equal(y, reference(ps, 5000, torch.float32, hvd.Sum), f"{what}: allreduce_")
    handles = [hvd.allreduce_async(inputs(r, 70_000, torch.int32, hvd.Max, salt=i), op=hvd.Max,
                                   name=f"{what}.async.{i}", process_set=ps) for i in range(3)]
    for i, h in enumerate(handles):
        check_equal(hvd.synchronize(h), reference(ps, 70_000, torch.int32, hvd.Max, salt=i),
                    f"{what}: async {i}")
    got = hvd.grouped_allreduce([inputs(r, 33, torch.float32), inputs(r, 5, torch.int64)],
                                op=hvd.Sum, process_set=ps)
    check_equal(got[0], reference(ps, 33, torch.float32, hvd.Sum), f"{what}: grouped[0]")
    check_equal(got[1], reference(ps, 5, torch.int64, hvd.Sum), f"{what}: grouped[1]")
    # allgather: member of set rank i sends i + 1 rows
    rows = torch.full((me + 1, 2), r, dtype=torch.int16)
    want = torch.cat([torch.full((i + 1, 2), g, dtype=torch.int16) for i, g in enumerate(ps.ranks)])
    check_equal(hvd.allgather(rows, process_set=ps), want, f"{what}: allgather")
    # broadcast from the set's last member, by its global rank
    root = ps.ranks[-1]
    got = hvd.broadcast(inputs(r, 1003, torch.bfloat16), root_rank=root, process_set=ps)
    check_equal(got, inputs(root, 1003, torch.bfloat16), f"{what}: broadcast from {root}")
    z = inputs(r, 10, torch.float64)
    assert hvd.broadcast_(z, root, process_set=ps) is z
    check_equal(z, inputs(root, 10, torch.float64), f"{what}: broadcast_")
    # alltoall: set rank i sends (i + j) % 3 rows to set rank j
    def splits_of(i):
        return [(i + j) % 3 for j in range(k)]

    def rows_of(i):
        return torch.arange(sum(splits_of(i)) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * i

    out, received = hvd.alltoall(rows_of(me), splits=splits_of(me), process_set=ps)
    want = torch.cat([rows_of(i)[sum(splits_of(i)[:me]):][:splits_of(i)[me]] for i in range(k)])
    check_equal(out, want, f"{what}: alltoall")
    assert received.tolist() == [splits_of(i)[me] for i in range(k)], received
    # reducescatter: set rank i keeps block i of the rows
    full = inputs(r, (2 * k + 1) * 3, torch.float32).reshape(-1, 3)
    base, extra = divmod(2 * k + 1, k)
    counts = [base + (i < extra) for i in range(k)]
    start = sum(counts[:me])
    want = reference(ps, (2 * k + 1) * 3, torch.float32, hvd.Average).reshape(-1, 3)
    check_equal(hvd.reducescatter(full, op=hvd.Average, process_set=ps),
                want[start:start + counts[me]], f"{what}: reducescatter")
    hvd.barrier(process_set=ps)
    assert hvd.broadcast_object({"from": r}, root_rank=root, process_set=ps) == {"from": root}
    assert hvd.allgather_object(r * 10, process_set=ps) == [g * 10 for g in ps.ranks]
    # autograd: allreduce backward reduces over the same set
    w = torch.full((3,), float(r + 1), requires_grad=True)
    hvd.allreduce(w * 2, op=hvd.Sum, process_set=ps).sum().backward()
    check_equal(w.grad, torch.full((3,), 2.0 * k), f"{what}: allreduce backward")
    same_on_members(comm, got, f"{what}: final")


def check_training(ps, what):
    """DistributedOptimizer, broadcast_parameters / optimizer state and SyncBatchNorm on a set
    equal one process on the members' whole batch."""
    comm = member_comm(ps)
    if comm is None:
        return
    k, me = len(ps.ranks), ps.ranks.index(r)
    batch = 12                                   # divides by every set size used here
    torch.manual_seed(100 + r)                   # different weights everywhere ...
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=ps.ranks[0], process_set=ps)
    hvd.broadcast_optimizer_state(opt, root_rank=ps.ranks[0], process_set=ps)
    torch.manual_seed(100 + ps.ranks[0])         # ... until the root's are broadcast
    reference = Net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    dist = hvd.DistributedOptimizer(opt, model.named_parameters(), process_set=ps,
                                    fusion_threshold=2048, first_bucket_bytes=512)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
        per = batch // k
        dist.zero_grad()
        F.cross_entropy(model(x[me * per:(me + 1) * per]), y[me * per:(me + 1) * per]).backward()
        dist.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), f"{what}: optimizer: {name} differs"
        same_on_members(comm, p.detach(), f"{what}: optimizer: {name}")
    hvd.check_consistency(model, process_set=ps)
    # SyncBatchNorm over the members' batch
    x = torch.randn(batch, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    sync, plain = hvd.SyncBatchNorm(3, process_set=ps).double(), torch.nn.BatchNorm2d(3).double()
    per = batch // k
    got, want = sync(x[me * per:(me + 1) * per]), plain(x)[me * per:(me + 1) * per]
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), f"{what}: SyncBatchNorm differs"
    assert torch.allclose(sync.running_var, plain.running_var, rtol=1e-9, atol=1e-9)


def check_sets_at_once():
    """The two halves of the split run different collectives at the same time, and every rank
    interleaves asynchronous work on all its sets in a rank-dependent order."""
    for i in range(20):
        if r % 2 == 0:
            got = hvd.allgather(torch.full((1,), r + i), process_set=split)
            check_equal(got, torch.tensor(split.ranks) + i, f"evens' allgather {i}")
        else:
            got = hvd.allreduce(torch.full((100_000,), float(r)), op=hvd.Sum, process_set=split)
            check_equal(got, torch.full((100_000,), float(sum(split.ranks))), f"odds' sum {i}")
    mine = [ps for ps in (hvd.global_process_set, split, low) if ps and r in ps.ranks]
    order = mine if r % 2 else list(reversed(mine))    # halves submit in opposite orders
    handles = [(ps, hvd.allreduce_async(torch.full((300_000,), float(r)), op=hvd.Sum,
                                        name="interleaved", process_set=ps)) for ps in order]
    for ps, handle in handles:
        check_equal(hvd.synchronize(handle), torch.full((300_000,), float(sum(ps.ranks))),
                    f"interleaved on {ps.ranks}")


def check_independence():
    """Rank 0's collective on the global set (with rank 1, who joins late) is pending while its
    collective on `other` completes: rank 1 joins only once rank 0 says `other` finished, so
    a shared queue would deadlock (and the test's timeout would say so)."""
    other = hvd.add_process_set([0] + list(range(2, n)))  # [0] at n = 2
    if r == 0:
        pending = hvd.allreduce_async(torch.ones(8), op=hvd.Sum, name="slow peer")
        got = hvd.allreduce(torch.ones(8), op=hvd.Sum, process_set=other)
        check_equal(got, torch.full((8,), float(len(other.ranks))), "independent set")
        assert not hvd.poll(pending), "the pending collective finished without its peer"
        world.send("done", dest=1, tag=77)
        check_equal(hvd.synchronize(pending), torch.full((8,), float(n)), "slow peer's result")
    else:
        if r == 1:
            assert world.recv(source=0, tag=77) == "done"
        else:
            hvd.allreduce(torch.ones(8), op=hvd.Sum, process_set=other)
        hvd.allreduce(torch.ones(8), op=hvd.Sum, name="slow peer")
    assert hvd.remove_process_set(other)


def check_add_and_remove():
    """Sets added and removed mid-run, overlapping and nested ones among them; the split's sets
    removed through handles made from their ids; removed handles are refused, and the same
    ranks come back under a new id."""
    added = []
    if n >= 3:
        high = hvd.add_process_set(list(range(1, n)))     # overlaps `low`
        nested = hvd.add_process_set([0, 1] if n >= 4 else [0])    # inside `low`
        added = [high, nested]
        for ps in added:
            assert ps.process_set_id not in (None, 0, split.process_set_id, low.process_set_id)
            if r in ps.ranks:
                got = hvd.allreduce(torch.full((70_001,), float(r)), op=hvd.Sum, process_set=ps)
                check_equal(got, torch.full((70_001,), float(sum(ps.ranks))), f"added {ps.ranks}")
    for set_id, ranks in sorted(set(world.allgather((split.process_set_id, tuple(split.ranks))))):
        handle = hvd.ProcessSet(ranks)
        handle.process_set_id = set_id      # every rank removes both halves, in the same order
        assert hvd.remove_process_set(handle)
    expect(ValueError, "not registered", hvd.allreduce, torch.ones(2), process_set=split)
    pair = hvd.add_process_set([0, n - 1] if n >= 3 else [0])
    old_id = pair.process_set_id
    if r in pair.ranks:
        hvd.allreduce(torch.ones(2), process_set=pair)
    stale = hvd.ProcessSet(pair.ranks)
    stale.process_set_id = old_id            # a copy of the handle, kept after removal
    assert hvd.remove_process_set(pair) and pair.process_set_id is None
    assert not hvd.remove_process_set(pair) and not hvd.remove_process_set(hvd.global_process_set)
    expect(ValueError, "not registered", hvd.allreduce, torch.ones(2), process_set=stale)
    again = hvd.add_process_set(stale.ranks)
    assert again.process_set_id not in (None, old_id), (again, old_id)
    if r in again.ranks:
        check_equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=again),
                    torch.full((2,), float(len(again.ranks))), "re-added set")
    for ps in added + [again]:
        assert hvd.remove_process_set(ps)


def check_errors():
    """Raised at once on the rank that made the mistake (registering a set, after meeting
    the others' call); the job goes on."""
    others = [ps for ps in (split, low) if ps is not None and r not in ps.ranks]
    for ps in others:
        expect(ValueError, "not in process set", hvd.allreduce, torch.ones(2), process_set=ps)
        expect(ValueError, "not in process set", hvd.barrier, process_set=ps)
        # Horovod's DistributedOptimizer outside its set: no hooks, local steps
        # (horovod_parity_check.py checks the numbers)
        outside = hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1),
                                           process_set=ps)
        assert isinstance(outside, torch.optim.SGD) and not outside._hooks
    expect(ValueError, "not registered", hvd.allgather, torch.ones(2),
           process_set=hvd.ProcessSet([r]))
    expect(ValueError, "invalid rank list", hvd.add_process_set, [0, n])
    expect(ValueError, "invalid rank list", hvd.add_process_set, [0, 0])
    expect(ValueError, "invalid rank list", hvd.add_process_set, [])
    expect(ValueError, "duplicate", hvd.add_process_set, list(range(n)))
    expect(ValueError, "duplicate", hvd.add_process_set, split.ranks)
    expect(ValueError, "registered already", hvd.add_process_set, split)
    expect(ValueError, "integers", hvd.ProcessSet, [0, "1"])
    expect(ValueError, "root_rank", hvd.broadcast, torch.ones(2),
           root_rank=next(k for k in range(n) if k not in split.ranks), process_set=split)
    if len(split.ranks) > 1:     # a mismatch on a set names the members by global rank
        message = expect(hvd.MismatchError, "'shape'", hvd.allreduce,
                         torch.ones(3 + split.ranks.index(r)), name="set_mm", process_set=split)
        assert f"rank {split.ranks[1]}: (4,)" in message, message
    check_equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)),
                "usable after the errors")


def check_one_rank_errs_registering():
    """The last rank alone makes a mistake registering sets: a ValueError there, and the
    others' call, which it meets, fails with a MismatchError quoting it (they waited for ever
    for a registration it never joined); the job goes on. Then ranks that open a group each for
    other ranks (torch.distributed's new_group) get a ValueError, where MPI waited inside."""
    last = r == n - 1

    def refused(call, words):
        if last:
            expect(ValueError, words, call)
        else:
            expect(hvd.MismatchError, ["'add_process_set' cannot run", f"rank {n - 1}", words],
                   call)

    refused(lambda: hvd.add_process_set([0, n] if last else [0]), "invalid rank list")
    refused(lambda: hvd.add_process_set(list(range(n)) if last else [0]), "duplicate")
    alone = hvd.add_process_set([0])
    if r == 0:
        check_equal(hvd.allreduce(torch.ones(1), process_set=alone), torch.ones(1),
                    "a set registered after the refusals")
    assert hvd.remove_process_set(alone)
    if n >= 3 and r < 3:    # every member hears from every member it expects: no one waits
        ranks = [[0, 1], [0, 1, 2], [1, 2]][r]
        expect(ValueError, ["open another group at this point, or this one for other ranks"],
               open_group, ranks, "group 'disputed'")
    check_equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)),
                "usable after the mistakes")


def check_init_with_other_sets_on_one_rank():
    """init(process_sets=...) on the last rank alone: MismatchError on every rank (the others
    waited for ever, or it did), and the job restarts as usual."""
    hvd.shutdown()
    sets = [hvd.ProcessSet([0])] if r == n - 1 else None
    expect(hvd.MismatchError, ["init(process_sets=...) differs",
                               f"() on ranks {list(range(n - 1))}",
                               f"((0,),) on ranks [{n - 1}]"], hvd.init, process_sets=sets)
    hvd.shutdown()
    start()


def stall():
    """Rank 1 sleeps before joining an allreduce on `low` (3 ranks or more): rank 0 reports the
    set and rank 1."""
    if r == 1:
        time.sleep(2.5)
    if r in low.ranks:
        hvd.allreduce(torch.ones(4), name="set_stall", process_set=low)


def check_groups():
    """A set made by its members alone (open_group, torch.distributed's subgroups): every
    collective on it, a mismatch naming it, closing it; a set of the same ranks registered by
    every rank afterwards is a set of its own."""
    ends = [0, n - 1]
    if r in ends:
        group = open_group(ends, "group 'ends'")
        assert group.ranks == ends and group.included()
        check_collectives(group, "group 'ends'")
        expect(hvd.MismatchError,
               ["'allreduce.g.mm'", "'shape'", f"rank 0: (3,); rank {n - 1}: (4,)"],
               hvd.allreduce, torch.ones(3 + (r == n - 1)), name="g.mm", process_set=group)
        close_group(group)
        assert group.process_set_id is None
    if n > 2:       # (at 2 ranks these are every rank: the global set)
        registered = hvd.add_process_set(ends)
        if r in ends:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=registered).item() == 2
        assert hvd.remove_process_set(registered)


def check_all():
    check_registration()
    check_collectives(hvd.global_process_set, "global")
    check_collectives(split, f"split {split.ranks}")
    if low is not None:
        check_collectives(low, f"low {low.ranks}")
    for ps in (split, low):
        if ps is not None:
            check_training(ps, f"set {ps.ranks}")
    check_sets_at_once()
    check_errors()
    check_add_and_remove()
    check_one_rank_errs_registering()     # (after the split's sets, [0] among them, are gone)
    check_independence()
    check_groups()
    check_init_with_other_sets_on_one_rank()
    hvd.barrier()


if sys.argv[1:] == ["stall"]:
    start()
    stall()
    hvd.shutdown()
else:
    per_setting(sys.argv[1] if len(sys.argv) > 1 else None, start, check_all, hvd.shutdown)
print(f"OK rank {r}", flush=True)
