"""Elastic training (`hvd.elastic`, Horovod's API) at N ranks under a real mpiexec.

python elastic_check.py [all | kill]
  all:    the ElasticSampler's exact indices, state sync from rank 0, commit/restore round
          trips, ObjectState, host updates, a training run with injected failures that must end
          bitwise equal to an uninterrupted one (also after a failure inside a bucket's
          allreduce on one rank, which restarts the job); then resets with plain collectives
          only (one rank failing alone), and the reset limit.
  kill:   a rank killed inside an elastic run must still end the job (no fault-tolerant MPI).
"""
import copy
import os
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader, TensorDataset

import ringreduce as hvd
from ringreduce import elastic
from ringreduce.sets import world
from ringreduce.transport.set_transport import Transport

hvd.init()
r, n = hvd.rank(), hvd.size()


def same_bytes_everywhere(tensors, what):
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    everyone = MPI.COMM_WORLD.allgather(flat.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), f"{what}: ranks differ"


def assert_state_dicts_equal(a, b, what):
    """Exact equality of nested state dicts (tensors bitwise)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{what}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys {a.keys()} != {b.keys()}"
        for key in a:
            assert_state_dicts_equal(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_dicts_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


# --------------------------------------------------------------------- ElasticSampler

class Indices:
    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return i


# Written out by hand from Horovod 0.28's definition: order = range(len), shuffled with
# random.Random(seed + epoch); drop processed_num; pad from the start to a multiple of size;
# rank r takes positions r, r + size, ...
SAMPLER_CASES = {
    # (length, shuffle, seed, epoch, batches recorded): {size: [indices of rank 0, 1, ...]}
    (10, False, 0, 0, 0): {1: [list(range(10))],
                           2: [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]],
                           3: [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]},
    # random.Random(0) order: [7, 8, 1, 5, 3, 4, 2, 0, 9, 6]
    (10, True, 0, 0, 0): {1: [[7, 8, 1, 5, 3, 4, 2, 0, 9, 6]],
                          2: [[7, 1, 3, 2, 9], [8, 5, 4, 0, 6]],
                          3: [[7, 5, 2, 6], [8, 3, 0, 7], [1, 4, 9, 8]]},
    # seed 7, epoch 1: random.Random(8) order [8, 2, 9, 4, 0, 7, 1, 6, 5, 3]; one batch of
    # one sample recorded drops the first `size` indices.
    (10, True, 7, 1, 1): {1: [[2, 9, 4, 0, 7, 1, 6, 5, 3]],
                          2: [[9, 0, 1, 5], [4, 7, 6, 3]],
                          3: [[4, 1, 3], [0, 6, 4], [7, 5, 0]]},
    # Fewer samples than ranks: every rank still gets one, repeated from the start (where
    # Horovod's padding stops short of the ranks and its assertion fails, at 3 ranks).
    (1, False, 0, 0, 0): {1: [[0]], 2: [[0], [0]], 3: [[0], [0], [0]]},
}


def check_sampler():
    for (length, shuffle, seed, epoch, recorded), by_size in SAMPLER_CASES.items():
        sampler = elastic.ElasticSampler(Indices(length), shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        before = list(sampler)
        for batch_idx in range(recorded):
            sampler.record_batch(batch_idx, 1)
        assert list(sampler) == before      # recording only counts, as in Horovod ...
        sampler.load_state_dict(sampler.state_dict())   # ... until a restore or sync
        want = by_size[n][r]
        assert list(sampler) == want, f"case {length, shuffle, seed, epoch}: {list(sampler)}"
        assert len(sampler) == len(want) == sampler.num_samples
        assert sampler.indices == want
        assert sampler.processed_num == recorded * n
        assert sampler.state_dict() == {"epoch": epoch, "processed_num": recorded * n}

    sampler = elastic.ElasticSampler(Indices(10), shuffle=False)
    sampler.record_batch(0, 2)
    sampler.set_epoch(3)                          # a new epoch forgets what was processed
    assert sampler.processed_num == 0 and len(sampler) == -(-10 // n)
    sampler.load_state_dict({"epoch": 0, "processed_num": 2 * n})    # indices 2n.. remain
    want = {1: [list(range(2, 10))], 2: [[4, 6, 8], [5, 7, 9]], 3: [[6, 9], [7, 6], [8, 7]]}
    assert list(sampler) == want[n][r], list(sampler)
    # A DataLoader over it: batches of this rank's indices, in order.
    loader = DataLoader(Indices(10), batch_size=2, sampler=elastic.ElasticSampler(
        Indices(10), shuffle=False))
    got = [i for batch in loader for i in batch.tolist()]
    assert got == SAMPLER_CASES[(10, False, 0, 0, 0)][n][r], got


# --------------------------------------------------------------------- states

def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def local_steps(model, opt, steps, seed):
    """Steps on this rank's own data through a DistributedOptimizer (so every rank steps)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()


def check_sync_and_round_trip():
    model = make_model(seed=10 + r)                              # different on every rank
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1)),
                                   named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = elastic.ElasticSampler(Indices(12), seed=3)
    sampler.load_state_dict({"epoch": r, "processed_num": r})
    state = elastic.TorchState(model, opt, scheduler=scheduler, sampler=sampler,
                               epoch=r, batch=10 + r, note={"from": r})
    assert state.model is model and state.optimizer is opt and state.scheduler is scheduler

    state.sync()                                                 # rank 0's, everywhere
    same_bytes_everywhere(model.state_dict().values(), "model after sync")
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    assert (state.epoch, state.batch, state.note) == (0, 10, {"from": 0})
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 0}
    assert state.model is model and state.optimizer is opt and state.scheduler is scheduler

    local_steps(model, opt, 2, seed=1)
    scheduler.step()
    state.epoch, state.batch = 1, 2
    sampler.record_batch(0, 2)
    state.commit()
    committed = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                 copy.deepcopy(scheduler.state_dict()), sampler.state_dict())

    for attempt in range(2):     # twice: a restore must not let later steps reach the commit
        local_steps(model, opt, 3, seed=2 + attempt)
        scheduler.step()
        sampler.record_batch(1, 2)
        state.epoch, state.batch = 7, 7
        state.restore()
        assert_state_dicts_equal(model.state_dict(), committed[0], f"model {attempt}")
        assert_state_dicts_equal(opt.state_dict(), committed[1], f"optimizer {attempt}")
        assert_state_dicts_equal(scheduler.state_dict(), committed[2], f"scheduler {attempt}")
        assert sampler.state_dict() == committed[3]
        assert (state.epoch, state.batch) == (1, 2)
        assert state.model is model and state.optimizer is opt and state.scheduler is scheduler
    same_bytes_everywhere(model.state_dict().values(), "model after restore")

    other = make_model(seed=99)                   # rebinding a handled attribute tracks it
    state.model = other
    with torch.no_grad():
        other[0].weight.add_(1.0)
    state.restore()
    assert torch.equal(other[0].weight, make_model(seed=99)[0].weight)


def check_object_state():
    state = elastic.ObjectState(epoch=r, name=f"rank{r}", data=[r])
    state.sync()
    assert (state.epoch, state.name, state.data) == (0, "rank0", [0])
    state.epoch = 5
    state.restore()
    assert state.epoch == 0
    state.epoch = 6
    state.commit()
    state.epoch = 9
    state.restore()
    assert state.epoch == 6
    # Horovod's signature: a broadcast function and a rank function.
    custom = elastic.ObjectState(bcast_object=lambda obj: hvd.broadcast_object(obj, 0, "c"),
                                 get_rank=hvd.rank, value=100 + r)
    custom.sync()
    assert custom.value == 100


def check_host_updates():
    resets = []

    @elastic.run
    def train(state, update):
        state.calls += 1
        if state.calls == 1:
            if r == 0:                            # only rank 0 hears it; every rank reacts
                state.on_hosts_updated(1, update)
            state.value = 10 + r                  # different per rank, committed
            state.commit()
            raise AssertionError("commit() did not raise HostsUpdatedInterrupt")
        return state.value

    for update, synced in ((elastic.HostUpdateResult.added, True),
                           (elastic.HostUpdateResult.removed, False)):
        state = elastic.ObjectState(calls=0, value=0)
        state.register_reset_callbacks([lambda: resets.append(update)])
        value = train(state, update)
        assert state.calls == 2, state.calls              # ran again, state not restored
        assert value == (10 if synced else 10 + r), (update, value)
    assert resets == [elastic.HostUpdateResult.added, elastic.HostUpdateResult.removed]
    state = elastic.ObjectState(x=1)
    state.on_hosts_updated(-1, elastic.HostUpdateResult.added)   # older than the last: ignored
    state.check_host_updates()


# --------------------------------------------------------------------- training

BATCH, EPOCHS, SAMPLES = 2, 3, 24          # 24 = 2 * 12: whole batches at 1, 2 and 3 ranks


def dataset():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)
    return TensorDataset(torch.arange(SAMPLES), x, y)


IN_A_BUCKET = "in a bucket's allreduce"
IN_THE_HOST_CHECK = "in the commit's host check"     # after the commit's save
working_way = Transport._way


def failing_way(*args, **kwargs):
    Transport._way = working_way
    raise MemoryError(f"injected inside a collective on rank {r}")


class Fault:
    """Raise HorovodInternalError once, at (epoch, batch, where), on the given ranks; or, where
    is IN_A_BUCKET, fail inside the next allreduce there (a bucket's, in backward): the others
    wait in it, and are told."""

    def __init__(self, epoch, batch, where, ranks):
        self.at, self.ranks, self.fired = (epoch, batch, where), ranks, False

    def maybe_raise(self, epoch, batch, where):
        if not self.fired and (epoch, batch, where) == self.at and r in self.ranks:
            self.fired = True
            if where == IN_A_BUCKET:
                Transport._way = failing_way
                return
            raise hvd.HorovodInternalError(f"injected failure at {self.at} on rank {r}")


def train_with(faults):
    """The documented elastic loop: commit after every batch, set_epoch at the end of one."""
    model = make_model(seed=20 + r)                             # synced by run()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.param_groups[0]["lr"] = 0.05 if r == 0 else 0.5         # synced by run() too
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    data = dataset()
    sampler = elastic.ElasticSampler(data, shuffle=True, seed=5)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)
    # each epoch's samples by batch: recorded before the commit, so a batch whose state was
    # saved counts even where the commit's host check then fails on this rank (the others'
    # failure shuts the set down while it waits there), and a batch run again after a reset
    # is recorded once
    resets, starts, committed = [], [], {e: {} for e in range(EPOCHS)}
    state.register_reset_callbacks([lambda: resets.append((state.epoch, state.batch))])
    check_host_updates = state.check_host_updates

    def host_check():   # (the commit's, after its save: batch state.batch - 1 is committed)
        fault_at(IN_THE_HOST_CHECK, state.batch - 1)
        check_host_updates()

    state.check_host_updates = host_check

    def fault_at(where, batch):
        for fault in faults:
            fault.maybe_raise(state.epoch, batch, where)

    @elastic.run
    def train(state):
        starts.append((state.epoch, state.batch))
        if len(starts) == 1:
            same_bytes_everywhere(model.state_dict().values(), "initial model after sync")
            assert opt.param_groups[0]["lr"] == 0.05
        while state.epoch < EPOCHS:
            offset = state.batch
            for i, (index, x, y) in enumerate(loader):
                fault_at("before forward", offset + i)
                fault_at(IN_A_BUCKET, offset + i)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                fault_at("after backward", offset + i)
                opt.step()
                fault_at("after step", offset + i)
                state.batch = offset + i + 1
                state.sampler.record_batch(i, BATCH)
                committed[state.epoch][state.batch] = index.tolist()
                state.commit()
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return "done"

    assert train(state) == "done"
    assert (state.epoch, state.batch) == (EPOCHS, 0)
    assert sampler.state_dict() == {"epoch": EPOCHS, "processed_num": 0}
    assert all(fault.fired for fault in faults if r in fault.ranks)
    for epoch, batches in committed.items():        # every sample once per epoch, all ranks
        indices = [i for batch in batches.values() for i in batch]
        everyone = sorted(i for part in MPI.COMM_WORLD.allgather(indices) for i in part)
        assert everyone == list(range(SAMPLES)), (epoch, everyone)
    same_bytes_everywhere(model.state_dict().values(), "final model")
    return model, resets, starts


def check_training_with_failures():
    reference, resets, starts = train_with([])
    assert resets == [] and starts == [(0, 0)]
    per_rank = SAMPLES // BATCH // n                 # batches per epoch on each rank
    faults = [Fault(0, 2, "after step", range(n)),   # rolls back a step already taken
              Fault(1, 1, "after backward", range(n))]   # buckets reduced, no step yet
    if n > 1:                                        # one rank fails alone: all must reset
        faults.append(Fault(2, per_rank - 1, "before forward", [n - 1]))
    model, resets, starts = train_with(faults)
    want = [(0, 2), (1, 1)] + ([(2, per_rank - 1)] if n > 1 else [])
    assert resets == want, resets           # callbacks saw the restored counters
    assert starts == [(0, 0)] + want, starts
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs from the uninterrupted run"
    if n > 1:   # a failure inside a collective: the job restarts (shutdown() and init())
        model, resets, starts = train_with([Fault(1, 1, IN_A_BUCKET, [n - 1])])
        assert resets == [(1, 1)] and starts == [(0, 0), (1, 1)], (resets, starts)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs from the uninterrupted run (restart)"
    if n > 1:   # one rank fails in a commit after its save (as where the others' failure
        # shuts the set down while it waits in the commit's host check): every rank resumes
        # after that batch, which counts as done
        model, resets, starts = train_with([Fault(1, 0, IN_THE_HOST_CHECK, [n - 1])])
        assert resets == [(1, 1)] and starts == [(0, 0), (1, 1)], (resets, starts)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs from the uninterrupted run (commit)"


def run_with_one_failure(steps, fail_step, fail_rank, fail, step):
    """An elastic function of `steps` steps, each `step(k)` then a commit, where `fail()` runs
    on `fail_rank` before step `fail_step` of the first attempt; returns the step each attempt
    began at."""
    attempts = []

    @elastic.run
    def train(state):
        attempts.append(state.step)
        for state.step in range(state.step, steps):
            if state.step == fail_step and r == fail_rank and len(attempts) == 1:
                fail()
            step(state.step)
            state.commit()
        return state.step

    assert train(elastic.ObjectState(step=0)) == steps - 1
    return attempts


def check_lone_failure_with_plain_collectives():
    def fail():
        raise hvd.HorovodInternalError(f"injected failure on rank {r} alone")

    def metric(k):      # the others wait here for rank n - 1
        total = hvd.allreduce(torch.full((5000,), float(k)), op=hvd.Sum, name="metric")
        assert torch.all(total == k * n)

    attempts = run_with_one_failure(6, 3, n - 1, fail, metric)
    assert attempts == [0, 2], attempts               # again from the commit of step 2


def check_lone_failure_with_unnamed_collectives():
    """Horovod names unnamed collectives by a count that its reset starts again on every rank.
    The others' unnamed collectives that failed for the reset were never run by the rank that
    failed, so every count of every set restarts from the highest: one failure is one reset,
    one run again and one round of callbacks, not a second reset for the names that the first
    left apart. (From 3 ranks, a set of ranks 1..n-1 too, the failing rank among them.)"""
    part = hvd.add_process_set(list(range(1, n))) if n > 2 else None
    attempts, callbacks = [], []

    @elastic.run
    def train(state):
        attempts.append(state.step)
        for state.step in range(state.step, 5):
            if state.step == 3 and r == n - 1 and len(attempts) == 1:
                raise hvd.HorovodInternalError(f"injected failure on rank {r} alone, unnamed")
            if part is not None and r > 0:
                inside = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=part)
                assert torch.equal(inside, torch.full((2,), float(n - 1))), inside
            total = hvd.allreduce(torch.full((3,), float(state.step)), op=hvd.Sum)
            assert torch.equal(total, torch.full((3,), float(state.step * n))), total
            handle = hvd.allreduce_async(torch.full((4,), 1.0), op=hvd.Sum)
            assert torch.equal(hvd.synchronize(handle), torch.full((4,), float(n)))
            hvd.barrier()
            state.commit()
        return state.step

    state = elastic.ObjectState(step=0)
    state.register_reset_callbacks([lambda: callbacks.append(state.step)])
    assert train(state) == 4
    assert attempts == [0, 2], attempts
    assert callbacks == [2], callbacks
    if part is not None:
        assert hvd.remove_process_set(part)


def check_failure_while_a_rank_has_joined():
    """The last rank runs out of data and joins; rank 0 then fails: the joined rank leaves
    join() for the reset (ResetPending, so its run resets too), and every rank runs again from
    the last commit, where rank 0 alone used to raise JoinedError out of run() and the joined
    rank ShutDownError. The second time through, join() returns the same rank everywhere."""
    if n == 1:
        return
    attempts = []

    @elastic.run
    def train(state):
        attempts.append(state.step)
        for state.step in range(state.step, 4):
            if r == n - 1 and state.step == 3:
                break       # out of data: joins
            if r == 0 and state.step == 3 and len(attempts) == 1:
                raise hvd.HorovodInternalError(f"injected failure on rank {r}, rank {n - 1} "
                                               "having joined")
            total = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="joined.metric")
            expected = float(n if state.step < 3 else n - 1)    # the joined rank gives zeros
            assert torch.equal(total, torch.full((3,), expected)), (state.step, total)
            if state.step < 3:
                state.commit()      # (a commit's host check is no allreduce: not after a join)
        return hvd.join()

    last = train(elastic.ObjectState(step=0))
    assert attempts == [0, 2], attempts
    everyone = hvd.allgather_object(last, name="joined.last")
    assert len(set(everyone)) == 1 and everyone[0] in range(n - 1), everyone


def check_failure_inside_a_process_set():
    """One member of a process set of ranks 0..n-2 fails inside its collective there: the set
    is shut down on its members, the last rank's next collective meets the reset, and every
    rank restarts the job, the set registered again under the same object."""
    if n < 3:
        return
    part = hvd.add_process_set(list(range(n - 1)))

    def fail():
        Transport._way = failing_way          # in the set's next allreduce

    def in_part_then_everyone(k):
        if r < n - 1:       # (1 MiB: the general path, where the failure is injected)
            total = hvd.allreduce(torch.ones(1 << 18), op=hvd.Sum, name="in.part",
                                  process_set=part)
            assert torch.equal(total, torch.full((1 << 18,), float(n - 1)))
        hvd.allreduce(torch.ones(3), op=hvd.Sum, name="everyone")

    attempts = run_with_one_failure(4, 2, n - 2, fail, in_part_then_everyone)
    assert attempts == [0, 1], attempts                # again from the commit of step 1
    assert part.process_set_id is not None and hvd.remove_process_set(part)


def check_reset_limit():
    attempts = []

    @elastic.run
    def always_fails(state):
        attempts.append(state.x)
        if n > 1:        # a program error: ranks run different collectives, every time
            hvd.allreduce(torch.ones(r + 1), name="uneven")
        raise hvd.HorovodInternalError(f"injected failure on rank {r}")

    for limit in (2, 0):
        os.environ[elastic.RESET_LIMIT_VARIABLE] = str(limit)
        attempts.clear()
        try:
            always_fails(elastic.ObjectState(x=r))
            raise AssertionError("the reset limit did not stop the retries")
        except hvd.RingReduceError as e:
            text = str(e)
            assert f"gave up after {limit + 1} failure(s)" in text, text
            assert f"RINGREDUCE_ELASTIC_RESET_LIMIT={limit}" in text, text
            cause = hvd.MismatchError if n > 1 else hvd.HorovodInternalError
            assert isinstance(e.__cause__, cause), repr(e.__cause__)
        assert attempts == [0] * (limit + 1), attempts      # synced from rank 0 each time
    del os.environ[elastic.RESET_LIMIT_VARIABLE]
    os.environ[elastic.RESET_LIMIT_VARIABLE] = "-1"
    try:
        always_fails(elastic.ObjectState(x=r))
        raise AssertionError("a bad reset limit was accepted")
    except ValueError as e:
        assert "RINGREDUCE_ELASTIC_RESET_LIMIT" in str(e)
    del os.environ[elastic.RESET_LIMIT_VARIABLE]


def check_misuse_is_not_reset():
    """As Horovod's run, which resets on HorovodInternalError only: the errors Horovod raises
    as other types (a misuse of the optimizer: AssertionError) leave the function at once, on
    every rank, with no reset, also where one rank alone made the misuse (the step's agreement
    raises it everywhere); the optimizer is usable after zero_grad()."""
    calls = []
    for error in (hvd.UsageError, hvd.UnsupportedError, hvd.NotInitializedError):
        @elastic.run
        def fails(state):
            calls.append(error)
            raise error(f"injected {error.__name__} on rank {r}")

        try:
            fails(elastic.ObjectState(x=r))
            raise AssertionError(f"{error.__name__} did not leave the function")
        except error as e:
            assert f"on rank {r}" in str(e), e
    assert calls == [hvd.UsageError, hvd.UnsupportedError, hvd.NotInitializedError], calls
    if n == 1:
        return      # (one rank has no hooks, so no misuse to make: as Horovod's)
    model = make_model(5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    passes = []

    @elastic.run
    def two_passes(state):      # a second backward pass, on rank 0 alone, with passes=1
        passes.append(1)
        for _ in range(2 if r == 0 else 1):
            model(torch.ones(2, 8)).sum().backward()
        opt.step()

    try:
        two_passes(elastic.TorchState(model=model, optimizer=opt))
        raise AssertionError("a second backward pass went unnoticed")
    except AssertionError as e:
        assert isinstance(e, hvd.UsageError), repr(e)
    assert passes == [1], passes
    opt.zero_grad()
    local_steps(model, opt, 2, seed=r)
    same_bytes_everywhere(model.parameters(), "after a misuse left an elastic run")


def check_killed_rank_ends_the_job():
    @elastic.run
    def train(state):      # plain collectives: no optimizer, whose first import is slow
        for state.batch in range(state.batch, 10_000):
            if state.batch == 3 and r == n - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce(torch.ones(4), name="metric")
            state.commit()

    train(elastic.ObjectState(batch=0))
    raise AssertionError("training went on after a rank was killed")


def check_restart_refused_when_a_rank_left_for_good():
    """The last rank leaves for good while the others restart (as when it leaves during an
    elastic reset another member's failure started): init() would wait for it for ever, so
    the restart ends with a ShutDownError naming it, on every rank that restarts."""
    if r == n - 1:
        hvd.shutdown()
        print(f"LEFT rank {r}", flush=True)
        sys.exit(0)
    try:
        world.restart()
    except hvd.ShutDownError as e:
        print(f"REFUSED rank {r}: {e}", flush=True)
        raise
    raise AssertionError("restarted without a rank that had left")


CHECKS = {"all": (check_sampler, check_sync_and_round_trip, check_object_state,
                  check_host_updates, check_training_with_failures,
                  check_lone_failure_with_plain_collectives,
                  check_lone_failure_with_unnamed_collectives,
                  check_failure_while_a_rank_has_joined,
                  check_failure_inside_a_process_set, check_reset_limit,
                  check_misuse_is_not_reset),
          "kill": (check_killed_rank_ends_the_job,),
          "leave": (check_restart_refused_when_a_rank_left_for_good,)}
for check in CHECKS[(sys.argv[1:] or ["all"])[0]]:
    check()
    hvd.barrier()
print(f"OK rank {r}", flush=True)
