"""Reliability, round 2: python reliability_check.py MODE[,MODE...] [DIRECTORY]
(several modes: each in turn in one launch, every one also after one fails, failures named)

leave_end     rank 0 reaches the end of its script while rank 1 waits in an allreduce
leave_exit    the same through sys.exit(0)
leave_ahead   the same with rank 0's count of collectives ahead (counts can differ after the
              ranks settled an order by name): rank 1's wait ends after the grace a collective
              the leaver began gets to complete
leave_sets    (3 ranks) the last rank leaves through sys.exit(0), a member of a process set
              with rank 0 besides the job's, while the others wait in an allreduce of the job
fewer         rank 0 has fewer batches than the others and finishes first
recovery      one rank alone runs an extra backward pass, calls step() a second time,
              unfreezes a parameter, or has a backward pass raise (caught): every rank raises,
              and after zero_grad() the next step gives every rank one process's parameters
optimizer     a parameter unfrozen after wrapping; parameters no rank has a gradient for;
              two DistributedOptimizers in one backward
checkpoint    load failures and unloadable extras raise the same error on every rank
alltoall      non-integer splits are a TypeError
threads       shutdown(), and at 3 ranks remove_process_set(), while another thread of every
              rank runs synchronous allreduces of its own: they wait for the one in flight, and
              the thread's next call raises (the set's memory was freed under it: a crash)
pending       each rank leaves an asynchronous allreduce it never synchronizes, its name
              differing on rank 0, then shuts down: shutdown() ends (nothing more can come, so
              the collectives fail) instead of waiting for ever
stoppable     prints its pid, then runs allreduces for a while (the test stops rank 1)
stall         rank 1 sleeps FAULT_SLEEP seconds before its next allreduce
"""
import collections
import copy
import os
import sys
import threading
import time

import numpy as np
import torch
import torch.nn as nn

import ringreduce as hvd
from checks import check_equal, expect, run_cases
from ringreduce.sets import job

hvd.init()
r, n = hvd.rank(), hvd.size()


def stamp(what):
    print(f"{what} rank {r} at {time.time():.6f}", flush=True)


def leave():
    hvd.allreduce(torch.ones(3), name="before")
    if r == 0:
        if sys.argv[1] == "leave_ahead":
            job.current().active[0].transport.watch.begun += 3
        stamp("LEAVING")
        if sys.argv[1] == "leave_exit":
            sys.exit(0)
        return
    try:
        hvd.allreduce(torch.ones(3), name="waiting.here")
    except hvd.ShutDownError as e:
        stamp("ERROR")
        print(f"MESSAGE {e}", flush=True)
        raise            # uncaught: the job ends with a non-zero exit


def leave_sets():
    both = hvd.add_process_set([0, n - 1])
    hvd.allreduce(torch.ones(3), name="before")
    if r in (0, n - 1):
        hvd.allreduce(torch.ones(3), name="in.both", process_set=both)
    if r == n - 1:
        stamp("LEAVING")
        sys.exit(0)     # goodbye on both sets: rank 0 hears it on the job's set, where it waits
    try:
        hvd.allreduce(torch.ones(3), name="waiting.here")
    except hvd.ShutDownError as e:
        stamp("ERROR")
        print(f"MESSAGE {e}", flush=True)
        raise


def fewer():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    for step in range(3 if r == 0 else 6):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    stamp("FINISHED")


def params_equal(model, what):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather_object(flat.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), f"{what}: parameters differ across ranks"


def optimizer():
    # a parameter frozen when wrapped, unfrozen later, is reduced from then on
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    reference = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        m[0].weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:
            for m in (model, reference):
                m[0].weight.requires_grad_(True)
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * k + step))
              for k in range(n)]
        opt.zero_grad()
        model(xs[r]).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        sum(reference(x).sum() for x in xs).div(n).backward()
        ref_opt.step()
    params_equal(model, "unfrozen after wrapping")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6), f"unfrozen: {name} differs from the reference"

    # as Horovod's: a parameter no rank has a gradient for is reduced as zeros, so momentum
    # and weight decay move it as a zero gradient would (one process: no hooks, .grad None,
    # the parameter left alone); one only rank 0 lacks is reduced with its zeros; a
    # parameter frozen after wrapping is still reduced, as zeros
    torch.manual_seed(2)
    model = nn.ModuleDict({"used": nn.Linear(2, 1), "never": nn.Linear(2, 1),
                           "sometimes": nn.Linear(2, 1), "frozen": nn.Linear(2, 1)})
    sgd = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), **sgd),
                                   model.named_parameters())
    model["frozen"].requires_grad_(False)
    idle = nn.ModuleDict({k: copy.deepcopy(model[k]) for k in ("never", "frozen")})
    idle_opt = torch.optim.SGD(idle.parameters(), **sgd)
    for step in range(3):
        opt.zero_grad()
        loss = model["used"](torch.ones(1, 2)).sum() + model["frozen"](torch.ones(1, 2)).sum()
        if r != 0:
            loss = loss + model["sometimes"](torch.ones(1, 2)).sum()
        loss.backward()
        opt.step()
        if n > 1:
            for p in idle.parameters():
                p.grad = torch.zeros_like(p)
            idle_opt.step()
        for k in ("never", "frozen"):
            for p in model[k].parameters():
                assert (p.grad is None if n == 1 else torch.equal(p.grad, torch.zeros_like(p))), \
                    f"{k}: {p.grad}"
        assert (model["sometimes"].weight.grad is not None) == (n > 1), "sometimes' grad"
    for k in ("never", "frozen"):
        moved = [torch.equal(p, q) for p, q in zip(model[k].parameters(), idle[k].parameters())]
        assert all(moved), f"{k} moved otherwise than with zero gradients"
    params_equal(model, "unused parameters")

    # two DistributedOptimizers over disjoint parameters in one backward
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    first = hvd.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1),
                                     model[0].named_parameters())
    second = hvd.DistributedOptimizer(torch.optim.Adam(model[1].parameters(), lr=0.01),
                                      model[1].named_parameters())
    assert {b.name for b in first._buckets}.isdisjoint({b.name for b in second._buckets})
    for step in range(3):
        first.zero_grad()
        second.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(r + step))).sum() \
            .backward()
        first.step()
        second.step()
    params_equal(model, "two optimizers in one backward")
    try:
        hvd.DistributedOptimizer(first)
        raise AssertionError("wrapping twice did not raise")
    except ValueError as e:
        assert "DistributedOptimizer already" in str(e), e


def recovery():
    """Issue 21 items 1 and 5, with each rank in turn making the mistake alone."""
    def batch(k, step):
        return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + k))

    def models(seed, **options):
        """A seeded model with its DistributedOptimizer, and one process's copy with its SGD."""
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 1))
        reference = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 1))
        reference.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), **options)
        return model, opt, reference, torch.optim.SGD(reference.parameters(), lr=0.1)

    def matches_one_process(model, reference, what):
        params_equal(model, what)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-6), f"{what}: {name} differs from one process"

    for views in (False, True):
        for culprit in range(n):
            model, opt, reference, ref_opt = models(4, backward_passes_per_step=2,
                                                    gradient_as_bucket_view=views)
            what = f"views={views}, extra pass on rank {culprit}"
            for _ in range(2):
                model(batch(r, 0)).sum().backward()
            skipped = [f"skipped on every rank because ranks [{culprit}] broke it",
                       "zero_grad()"]
            # the culprit, having caught its error, allreduces a metric before its step(),
            # which the others call first: its broken step was settled as it raised, so the
            # metric meets theirs (it waited for their step's agreement, never submitted)
            if r == culprit:
                expect(hvd.UsageError, "computed 3 times",
                       lambda: model(batch(r, 0)).sum().backward())
            else:
                expect(hvd.UsageError, skipped, opt.step)
            metric = hvd.allreduce(torch.tensor([r]), op=hvd.Sum, name="metric after a break")
            check_equal(metric, torch.tensor([n * (n - 1) // 2]), f"{what}: the metric after")
            expect(hvd.UsageError, skipped, opt.step)
            expect(hvd.UsageError, "skipped on every rank", opt.step)   # still, until zero_grad
            for step in (1, 2):         # the recipe: zero_grad() and the step again
                opt.zero_grad()
                for _ in range(2):
                    model(batch(r, step)).sum().backward()
                opt.step()
                ref_opt.zero_grad()
                for _ in range(2):
                    sum(reference(batch(k, step)).sum() for k in range(n)).div(n).backward()
                ref_opt.step()
            matches_one_process(model, reference, what)

    # one rank alone calls step() twice on the same gradients: its second step pairs with the
    # others' next one, so every rank raises there, naming it; after zero_grad() the step
    # redone gives every rank one process's parameters. Every rank stepping twice is allowed.
    def train(model, opt, reference, ref_opt, step, steps=1):
        opt.zero_grad()
        model(batch(r, step)).sum().backward()
        ref_opt.zero_grad()
        sum(reference(batch(k, step)).sum() for k in range(n)).div(n).backward()
        for _ in range(steps):
            opt.step()
            ref_opt.step()

    for views in (False, True):
        for culprit in range(n):
            model, opt, reference, ref_opt = models(6, gradient_as_bucket_view=views)
            what = f"views={views}, step() again on rank {culprit} alone"
            train(model, opt, reference, ref_opt, 0)
            train(model, opt, reference, ref_opt, 1, steps=2)      # every rank: allowed
            skipped = [f"skipped on every rank because ranks [{culprit}] broke it",
                       f"step() on rank {culprit} came again", "zero_grad()"]
            if r == culprit:
                expect(hvd.UsageError, skipped, opt.step)
            else:       # the next step, which the culprit's second one met
                opt.zero_grad()
                model(batch(r, 2)).sum().backward()
                expect(hvd.UsageError, skipped, opt.step)
            train(model, opt, reference, ref_opt, 3)       # the recipe: zero_grad(), again
            matches_one_process(model, reference, what)

    # one rank alone steps inside skip_synchronize() without synchronize(): its step meets
    # the others' and every rank skips it, naming the culprit; after zero_grad() (which used to
    # raise on the culprit for ever) the step redone gives every rank one process's parameters
    for culprit in range(n):
        model, opt, reference, ref_opt = models(8)
        what = f"step() in skip_synchronize() without synchronize() on rank {culprit} alone"
        train(model, opt, reference, ref_opt, 0)
        opt.zero_grad()
        model(batch(r, 1)).sum().backward()
        skipped = [f"skipped on every rank because ranks [{culprit}] broke it",
                   f"skip_synchronize() on rank {culprit} before synchronize()", "zero_grad()"]
        if r == culprit:
            def skipping():
                with opt.skip_synchronize():
                    opt.step()
            expect(hvd.UsageError, skipped[1], skipping)
        else:
            expect(hvd.UsageError, skipped, opt.step)
        train(model, opt, reference, ref_opt, 2)       # the recipe: zero_grad(), again
        matches_one_process(model, reference, what)

    # a backward pass that raises on one rank alone after its first bucket went (an out-of-
    # memory error that the script catches, to skip the batch): the culprit's zero_grad(), or
    # its step(), meets the others' step, and every rank skips it, naming the culprit; the next
    # step gives every rank one process's parameters. Without the check, the culprit's next
    # step paired with the others' failed one, silently.
    def out_of_memory(grad):
        raise MemoryError("out of memory (simulated)")

    for views in (False, True):
        for culprit in range(n):
            for then in ("zero_grad", "step"):
                model, opt, reference, ref_opt = models(7, gradient_as_bucket_view=views,
                                                        first_bucket_bytes=24)
                assert len(opt._buckets) == 2, [b.names for b in opt._buckets]
                what = f"views={views}, backward raised on rank {culprit}, then {then}()"
                skipped = [f"skipped on every rank because ranks [{culprit}] broke it",
                           f"a backward pass on rank {culprit} raised before it finished",
                           "zero_grad()"]
                hidden = model[0](batch(r, 0))
                if r == culprit:
                    hidden.register_hook(out_of_memory)   # after the last layer's bucket went
                    expect(MemoryError, "out of memory",
                           lambda: model[1](hidden).sum().backward())
                    assert len(opt._handles) == 1, what
                    if then == "zero_grad":
                        opt.zero_grad()
                    else:
                        expect(hvd.UsageError, skipped, opt.step)
                else:
                    model[1](hidden).sum().backward()
                    expect(hvd.UsageError, skipped, opt.step)
                train(model, opt, reference, ref_opt, 1)
                matches_one_process(model, reference, what)

    # a parameter unfrozen on one rank only: MismatchError on every rank naming it; after
    # zero_grad() and the fix, the step goes through and the ranks agree
    for culprit in range(n):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 1))
        model[0].weight.requires_grad_(False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
        if r == culprit:
            model[0].weight.requires_grad_(True)
        model(batch(r, 3)).sum().backward()
        expect(hvd.MismatchError, ["'0.weight' only on ranks", f"[{culprit}]", "requires_grad"],
               opt.step)
        model[0].weight.requires_grad_(True)
        opt.zero_grad()
        model(batch(r, 4)).sum().backward()
        opt.step()
        params_equal(model, f"unfrozen on rank {culprit} alone, then everywhere")


def checkpoint():
    directory = sys.argv[2]
    model = nn.Linear(2, 2)
    missing = os.path.join(directory, "missing.pt")
    message = expect(hvd.CheckpointError, "missing.pt",
                     lambda: hvd.checkpoint.load(missing, model))
    assert "failed on rank 0" in message and "FileNotFoundError" in message, message
    unsafe = os.path.join(directory, "unsafe.pt")
    if r == 0:          # a file that weights_only refuses (it holds a class instance)
        torch.save({"model": model.state_dict(), "optimizer": None, "extra": Refused()}, unsafe)
    hvd.barrier()
    expect(hvd.CheckpointError, "weights_only", lambda: hvd.checkpoint.load(unsafe, model))
    expect(ValueError, "Store plain data",
           lambda: hvd.checkpoint.save(os.path.join(directory, "rng.pt"), model,
                                       extra={"numpy": np.random.get_state()}))
    good = os.path.join(directory, "good.pt")
    hvd.checkpoint.save(good, model, extra={"step": 3, "rng": torch.get_rng_state()})
    assert hvd.checkpoint.load(good, model)["step"] == 3
    # a model's or optimizer's state that load could not read back (a NumPy learning rate)
    # is refused before anything is written: the good checkpoint stays, and still loads
    numpy_lr = torch.optim.SGD(model.parameters(), lr=np.float64(0.1))
    expect(hvd.CheckpointError, ["failed on rank 0", "checkpoint.save(model, optimizer)",
                                 "numpy", "weights_only=True", "is intact"],
           lambda: hvd.checkpoint.save(good, model, numpy_lr, extra={"step": 4}))
    assert hvd.checkpoint.load(good, model)["step"] == 3
    # So is a dict or tensor of a subclass in the model's state (its extra state, a buffer),
    # which the check once saw as a plain dict or left out as a tensor: the save replaced the
    # good checkpoint with one load refused
    for odd in (collections.defaultdict(int, {"seen": 2}), torch.ones(2).as_subclass(Tagged)):
        holder = WithExtra(odd)
        expect(hvd.CheckpointError, ["failed on rank 0", "weights_only=True", "is intact"],
               lambda: hvd.checkpoint.save(good, holder, extra={"step": 5}))
        assert hvd.checkpoint.load(good, model)["step"] == 3, type(odd).__name__
    # A load given an optimizer from a file saved without one restores nothing
    lr = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.weight.add_(1.0)
    expect(hvd.CheckpointError, ["no optimizer state", "nothing was restored"],
           lambda: hvd.checkpoint.load(good, model, lr))
    assert not torch.equal(model.weight.detach(), before[0]), "the model was restored"
    # The last rank alone gives one: every rank raises, naming it (it once raised alone, and
    # the others waited for it in the load's last collective)
    expect(hvd.CheckpointError, [f"ranks [{n - 1}] could not restore it", "no optimizer state"],
           lambda: hvd.checkpoint.load(good, model, lr if r == n - 1 else None))
    # Mistakes of the last rank alone (they waited for ever on the other ranks, or failed
    # there alone): a path of its own, an extra that cannot be read back, another model.
    last = r == n - 1
    mine = os.path.join(directory, f"rank{r}.pt" if last else "good.pt")
    for call in (lambda: hvd.checkpoint.save(mine, model),
                 lambda: hvd.checkpoint.load(mine, model)):
        expect(hvd.MismatchError, ["'path' differs", f"rank{n - 1}.pt"], call)
    unread = os.path.join(directory, "unread.pt")
    extra = {"numpy": np.random.get_state()} if last else {"step": 4}
    if last:
        expect(ValueError, "Store plain data", lambda: hvd.checkpoint.save(unread, model,
                                                                         extra=extra))
    else:
        expect(hvd.MismatchError, ["cannot run", f"rank {n - 1}", "Store plain data"],
               lambda: hvd.checkpoint.save(unread, model, extra=extra))
    assert not os.path.exists(unread), "a checkpoint refused on one rank was written"
    other = nn.Linear(2, 3) if last else model
    expect(hvd.CheckpointError, [f"ranks [{n - 1}] could not restore it", "size mismatch"],
           lambda: hvd.checkpoint.load(good, other))
    assert hvd.checkpoint.load(good, model)["step"] == 3
    # the job is still usable after the failures
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n


class Refused:
    pass


class Tagged(torch.Tensor):
    """A tensor subclass: weights_only refuses it."""


class WithExtra(nn.Linear):
    """A Linear whose state holds `odd` as its extra state."""

    def __init__(self, odd):
        super().__init__(2, 2)
        self.odd = odd

    def get_extra_state(self):
        return self.odd

    def set_extra_state(self, state):
        self.odd = state


def alltoall():
    expect(TypeError, "splits must be integers",
           lambda: hvd.alltoall(torch.ones(n, 2), splits=[0.5] * (n - 1) + [n - 0.5 * (n - 1)]))
    assert hvd.alltoall(torch.ones(n, 2), splits=[1] * n)[0].shape == (n, 2)


def threads():
    errors = []

    def loop(process_set):
        try:
            while True:         # 16 MB: the node's blocks, run in C without the GIL
                hvd.allreduce(torch.ones(4_000_000), name="loop", process_set=process_set)
        except Exception as exc:
            errors.append(exc)

    for attempt in range(6):
        removing = attempt % 2 == 1 and n >= 3
        ps = hvd.add_process_set([0, 1]) if removing else hvd.global_process_set
        thread = threading.Thread(target=loop, args=(ps,), daemon=True)
        started = not removing or r in (0, 1)
        if started:
            thread.start()
            time.sleep(0.2)
        if removing:
            hvd.remove_process_set(ps)
        else:
            hvd.shutdown()
        if started:
            thread.join(30)
            assert not thread.is_alive(), f"attempt {attempt}: the thread still runs"
            assert isinstance(errors[-1], (ValueError, hvd.RingReduceError)), repr(errors[-1])
        hvd.init()
    check_equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)),
                "an allreduce after them")


def pending():
    hvd.allreduce(torch.ones(2), name="before")
    handle = hvd.allreduce_async(torch.ones(2), name="pending.x" if r == 0 else "pending.y")
    hvd.shutdown()      # (it waited for ever: the launch's timeout fails it then)
    if n > 1:
        expect(hvd.MismatchError, "cannot run", hvd.synchronize, handle)
    hvd.init()
    check_equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)),
                "an allreduce after them")


def stoppable():
    print(f"PID rank {r} {os.getpid()}", flush=True)
    for i in range(int(os.environ.get("ROUNDS", "60"))):
        hvd.allreduce(torch.ones(4), name=f"round.{i}")
        time.sleep(0.25)


def stall():
    hvd.allreduce(torch.ones(4), name="warm")
    if r == 1:
        time.sleep(float(os.environ.get("FAULT_SLEEP", "60")))
    stamp("WAITING")
    hvd.allreduce(torch.ones(4), name="stalled.here")


MODES = {"leave_end": leave, "leave_exit": leave, "leave_ahead": leave,
         "leave_sets": leave_sets, "fewer": fewer,
         "recovery": recovery, "optimizer": optimizer, "checkpoint": checkpoint,
         "alltoall": alltoall, "threads": threads,
         "pending": pending, "stoppable": stoppable, "stall": stall}
modes = sys.argv[1].split(",")
if len(modes) == 1:
    MODES[modes[0]]()
else:
    run_cases([MODES[mode] for mode in modes], r)
print(f"OK rank {r}", flush=True)
