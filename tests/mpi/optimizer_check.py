"""DistributedOptimizer on N ranks against one process training on the whole batch; then, in
the same launch, SyncBatchNorm against BatchNorm on the whole batch (sync_bn_check.py)."""
import copy
import time
import warnings
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

import ringreduce as hvd
from checks import expect, horovod_scaled, run_cases, then_barrier
from models import Net
from sync_bn_check import check_sync_batch_norm
from ringreduce.core import timeline
from ringreduce.optim import fusion, schedule

hvd.init()
r, n = hvd.rank(), hvd.size()
BATCH = 24  # divides by 1, 2, 3 and 4
SMALL_BUCKETS = dict(fusion_threshold=2048, first_bucket_bytes=512)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def shard(t):
    per = BATCH // n
    return t[r * per:(r + 1) * per]


def fresh_model():
    torch.manual_seed(0)
    return Net()


def params_equal_across_ranks(model, what):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = MPI.COMM_WORLD.allgather(flat.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), f"{what}: parameters differ across ranks"


def assert_close(model, reference, what, tol=1e-5):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=tol, atol=tol), \
            f"{what}: {name} differs by {(p - q).abs().max().item()}"


def train(make_opt, steps=4, distributed=True, passes=1, clip=None, amp=False, sched=False,
          **kwargs):
    model = fresh_model()
    opt = make_opt(model.parameters())
    if distributed:
        opt = hvd.DistributedOptimizer(opt, model.named_parameters(),
                                       backward_passes_per_step=passes, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if amp else None
    for step in range(steps):
        x, y = data(step)
        if distributed:
            x, y = shard(x), shard(y)
        opt.zero_grad()
        for part_x, part_y in zip(x.chunk(passes), y.chunk(passes)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(part_x), part_y) / passes
            (scaler.scale(loss) if amp else loss).backward()
        if amp:
            if distributed:
                opt.synchronize()
            scaler.unscale_(opt)
            ctx = opt.skip_synchronize() if distributed else _nothing()
            with ctx:
                scaler.step(opt)
            scaler.update()
        elif clip is not None:
            if distributed:
                opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            with (opt.skip_synchronize() if distributed else _nothing()):
                opt.step()
        else:
            opt.step()
        if scheduler:
            scheduler.step()
    return model, opt


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def check_equivalence():
    for name, make in (("sgd", sgd), ("adam", adam)):
        for extra in ({}, SMALL_BUCKETS, dict(gradient_as_bucket_view=True, **SMALL_BUCKETS),
                      dict(groups=3)):
            model, _ = train(make, **extra)
            reference, _ = train(make, distributed=False)
            what = f"{name} {extra}"
            params_equal_across_ranks(model, what)
            if n == 1:   # one rank: exactly the bare optimizer
                assert all(torch.equal(p, q) for p, q in
                           zip(model.parameters(), reference.parameters())), what
            assert_close(model, reference, what)


def check_large_gradients_alone():
    """A gradient of fusion.ALONE_BYTES or more has a bucket of its own, reduced in place in
    the gradient (no buffer), between fused buckets of small ones: training goes as in one
    process, with views of buckets and with accumulated passes too, the same bits on every
    rank, and the gradient is the tensor autograd made; a rank whose large weight is laid out
    otherwise (fused there) gets a MismatchError on every rank as it wraps, and the job trains
    on. (The limit lowered, so that this small model's two weights are large.)"""
    saved, fusion.ALONE_BYTES = fusion.ALONE_BYTES, 1024
    try:
        for name, make in (("sgd", sgd), ("adam", adam)):
            for extra in ({}, dict(gradient_as_bucket_view=True), dict(passes=2)):
                model, opt = train(make, **extra)
                what = f"large gradients alone, {name} {extra}"
                if n > 1:       # (alone, nothing is reduced: no buckets)
                    alone = [b.names for b in opt._buckets if b.direct]
                    fused = [b.names for b in opt._buckets if not b.direct]
                    assert ["fc1.weight"] in alone and ["fc2.weight"] in alone, (what, alone)
                    assert fused == [["conv.bias", "conv.weight"]], (what, fused)
                params_equal_across_ranks(model, what)
                reference, _ = train(make, distributed=False, passes=extra.get("passes", 1))
                assert_close(model, reference, what)
        model = fresh_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters())
        x, y = data(0)
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        made = model.fc1.weight.grad
        opt.synchronize()
        assert model.fc1.weight.grad is made, "the gradient reduced alone was replaced"
        with opt.skip_synchronize():
            opt.step()
        if n > 1:       # the last rank's fc1.weight laid out otherwise: fused there alone
            model = fresh_model()
            if r == n - 1:
                model.fc1.weight = nn.Parameter(model.fc1.weight.detach().t().contiguous().t())
            expect(hvd.MismatchError, ["'large, reduced alone' differs", "'fc1.weight' only on"],
                   hvd.DistributedOptimizer, sgd(model.parameters()), model.named_parameters())
            model, _ = train(sgd, steps=2)
            params_equal_across_ranks(model, "large gradients alone, after a mistake")
    finally:
        fusion.ALONE_BYTES = saved


class CountingSGD(torch.optim.SGD):
    """A user's optimizer class with a step() of its own that calls super(), as many do."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def check_inheritance():
    """The wrapper is an ordinary subclass of the user's class, its life cycle first in the
    bases: isinstance holds, the user's step() runs once per step (reached with super()) and its
    own super() chain still reaches SGD; training matches one process."""
    model, opt = train(lambda params: CountingSGD(params, lr=0.1, momentum=0.9))
    reference, plain = train(lambda params: CountingSGD(params, lr=0.1, momentum=0.9),
                             distributed=False)
    mro = type(opt).__mro__
    assert isinstance(opt, CountingSGD) and type(opt).__name__ == "CountingSGD", mro
    assert mro.index(CountingSGD) > 1 and mro[-3:] == (torch.optim.SGD, torch.optim.Optimizer,
                                                        object), mro
    assert opt.steps == plain.steps == 4, (opt.steps, plain.steps)
    assert_close(model, reference, "a user's optimizer class with super()")
    params_equal_across_ranks(model, "a user's optimizer class with super()")
    hooked = {"wrapped": [], "plain": []}   # torch's step hooks run as often as on the plain
    x, y = data(r)                          # optimizer, after a reload too
    for key, net, optimizer in (("wrapped", model, opt), ("plain", reference, plain)):
        optimizer.register_step_pre_hook(lambda *args, key=key: hooked[key].append(1))
        for _ in range(2):
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            optimizer.load_state_dict(optimizer.state_dict())
    assert len(hooked["wrapped"]) == len(hooked["plain"]) > 0 and opt.steps == 6, \
        ({k: len(v) for k, v in hooked.items()}, opt.steps)


def check_features():
    reference, _ = train(sgd, distributed=False, passes=2)
    model, _ = train(sgd, passes=2, **SMALL_BUCKETS)
    assert_close(model, reference, "backward_passes_per_step=2")
    params_equal_across_ranks(model, "backward_passes_per_step=2")

    model, _ = train(sgd, clip=0.5)
    reference, _ = train(sgd, distributed=False, clip=0.5)
    assert_close(model, reference, "clipping after synchronize")

    model, _ = train(sgd, compression=hvd.Compression.fp16, **SMALL_BUCKETS)
    reference, _ = train(sgd, distributed=False)
    assert_close(model, reference, "fp16 compression", tol=2e-2)
    params_equal_across_ranks(model, "fp16 compression")

    model, opt = train(sgd, sched=True)
    reference, _ = train(sgd, distributed=False, sched=True)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.025
    assert_close(model, reference, "LR scheduler")

    model, _ = train(adam, amp=True)
    reference, _ = train(adam, distributed=False, amp=True)
    params_equal_across_ranks(model, "AMP pattern")
    assert_close(model, reference, "AMP pattern", tol=5e-2)


def check_unused_and_frozen():
    model = nn.ModuleDict({"used": nn.Linear(4, 1, bias=False), "sometimes": nn.Linear(4, 1),
                           "frozen": nn.Linear(4, 1)})
    for p in model.parameters():
        nn.init.zeros_(p)
    model["frozen"].weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   model.named_parameters(), fusion_threshold=16)
    x = torch.ones(1, 4)
    loss = model["used"](x).sum() * (r + 1) + model["frozen"](x).sum()
    if r != 0:      # rank 0 never produces the gradient of "sometimes"
        loss = loss + model["sometimes"](x).sum() * r
    loss.backward()
    opt.step()
    # gradients averaged over ranks, with rank 0's missing ones counted as zeros
    want_used = -sum(k + 1 for k in range(n)) / n
    want_sometimes = -sum(range(n)) / n
    assert torch.equal(model["used"].weight, torch.full((1, 4), want_used)), model["used"].weight
    assert torch.equal(model["sometimes"].weight, torch.full((1, 4), want_sometimes))
    assert torch.equal(model["frozen"].weight, torch.zeros(1, 4))
    params_equal_across_ranks(model, "unused/frozen")


def check_errors():
    model = fresh_model()
    named = list(model.named_parameters())
    opt = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    D = hvd.DistributedOptimizer
    expect(ValueError, "unique", lambda: D(opt(), [("w", p) for _, p in named]))
    expect(ValueError, "no name", lambda: D(opt(), named[:2]))
    expect(ValueError, "tuples", lambda: D(opt(), [p for _, p in named]))
    expect(ValueError, "backward_passes_per_step", lambda: D(opt(), named,
                                                             backward_passes_per_step=0))
    expect(ValueError, "backward_passes_per_step", lambda: D(opt(), named,
                                                             backward_passes_per_step=1.5))
    expect(ValueError, "gradient_predivide_factor", lambda: D(opt(), named, op=hvd.Sum,
                                                              gradient_predivide_factor=2.0))
    expect(ValueError, "compression", lambda: D(opt(), named, gradient_as_bucket_view=True,
                                                compression=hvd.Compression.fp16))
    if n > 1:       # (one process steps the plain optimizer, closure and all)
        expect(hvd.UnsupportedError, ["cannot wrap torch.optim.LBFGS", f"rank {r}"],
               lambda: D(torch.optim.LBFGS(model.parameters()), named))
    dist = D(opt(), named)
    x, y = data(0)
    if n == 1:      # Horovod's in a job of one process: the plain optimizer's life cycle
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        dist.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        dist.step()
        dist.zero_grad()
        return
    F.cross_entropy(model(shard(x)), shard(y)).backward()
    expect(hvd.RingReduceError, "before optimizer.step()", dist.zero_grad)
    expect(AssertionError, "backward_passes_per_step is 1",    # Horovod: AssertionError
           lambda: F.cross_entropy(model(shard(x)), shard(y)).backward())
    # the local gradient is now mixed into a reduced one: the step is refused, not taken
    before = [p.detach().clone() for p in model.parameters()]
    expect(hvd.UsageError, "call optimizer.zero_grad()", dist.step)
    expect(hvd.UsageError, "call optimizer.zero_grad()", dist.synchronize)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    dist.zero_grad()        # meets the other ranks' collectives of the step, then resets
    F.cross_entropy(model(shard(x)), shard(y)).backward()
    dist.step()
    params_equal_across_ranks(model, "after a refused step")
    dist.zero_grad()
    # predivide: sum(g / f) * f / n is the plain average
    m1, m2 = fresh_model(), fresh_model()
    o1 = D(torch.optim.SGD(m1.parameters(), lr=0.1), m1.named_parameters())
    o2 = D(torch.optim.SGD(m2.parameters(), lr=0.1), m2.named_parameters(),
           gradient_predivide_factor=2.0)
    for m, o in ((m1, o1), (m2, o2)):
        F.cross_entropy(m(shard(x)), shard(y)).backward()
        o.step()
    assert_close(m1, m2, "gradient_predivide_factor", tol=1e-6)
    # the last rank alone reducing otherwise: a MismatchError on every rank as it is wrapped
    # (where it would have trained the ranks apart)
    fp16 = {"compression": hvd.Compression.fp16}
    for everyone, last in (({}, {"op": hvd.Sum}), ({}, {"gradient_predivide_factor": 2.0}),
                           (fp16, {**fp16, "op": hvd.Sum})):
        m = fresh_model()
        expect(hvd.MismatchError, "'reduction' differs", D, torch.optim.SGD(m.parameters(),
                                                                            lr=0.1),
               m.named_parameters(), **(last if r == n - 1 else everyone))


class Conv(nn.Module):
    """Two convolutions (3 and 6 channels in) and a linear head: weights that channels_last
    lays out other than row-major."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 3)
        self.fc = nn.Linear(6 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).flatten(1))


def train_conv(distributed, channels_last=True, **options):
    torch.manual_seed(0)
    model = Conv().to(memory_format=torch.channels_last if channels_last else
                      torch.contiguous_format)
    opt = sgd(model.parameters())
    if distributed:
        opt = hvd.DistributedOptimizer(opt, model.named_parameters(), **options)
    for step in range(3):
        g = torch.Generator().manual_seed(200 + step)
        x, y = torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        if distributed:
            x, y = shard(x), shard(y)
        opt.zero_grad()
        F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y).backward()
        opt.step()
    return model


def check_groups_leave_the_predivide_factor_out():
    """As Horovod's grouped reduction: with `groups` (an int or lists), the gradients are
    bitwise those without gradient_predivide_factor; without groups the factor is used, and
    sum(g / 3) * 3 / n differs from sum(g) / n in the last bits."""
    x, y = data(0)

    def gradients(groups, factor):
        model = fresh_model()
        params = list(model.parameters())
        if groups == "lists":
            groups = [params[:2], params[3:]]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model.named_parameters(),
                                       groups=groups, gradient_predivide_factor=factor)
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        return [p.grad.clone() for p in params]

    for groups in (2, "lists"):
        plain, predivided = gradients(groups, 1.0), gradients(groups, 3.0)
        assert all(torch.equal(a, b) for a, b in zip(plain, predivided)), \
            f"groups={groups}: the predivide factor changed the gradients"
    if n > 1:
        plain, predivided = gradients(None, 1.0), gradients(None, 3.0)
        assert not all(torch.equal(a, b) for a, b in zip(plain, predivided)), \
            "without groups the predivide factor changed nothing"


def check_groups_of_several_dtypes():
    """A group holding float32 and float64 parameters (`groups` an int or lists): each
    gradient reduced in its own dtype, bitwise as allreduce reduces it alone (Horovod's
    grouped allreduce). Where a group shared one buffer in its first parameter's dtype, the
    float64 gradient lost its low bits in a float32 one (seen from 2 ranks on), and the
    float32 one was summed and averaged in float64 (from 3 ranks on: sum / 3 rounded once)."""
    thin = nn.Parameter(torch.zeros(5, dtype=torch.float32))
    wide = nn.Parameter(torch.zeros(7, dtype=torch.float64))
    also_thin = nn.Parameter(torch.zeros(3, dtype=torch.float32))
    named = [("thin", thin), ("wide", wide), ("also_thin", also_thin)]
    grads = {"thin": torch.full((5,), 0.1 * (r + 1) + (r == 0), dtype=torch.float32),
             "wide": torch.full((7,), 1 + 2.0 ** -40 * (r + 1) + (r == 0), dtype=torch.float64),
             "also_thin": torch.full((3,), 0.3 * (r + 2), dtype=torch.float32)}
    want = {name: hvd.allreduce(g, name=f"dtypes.alone.{name}") for name, g in grads.items()}
    for groups in (1, 2, [[thin, wide, also_thin]], [[wide, thin]]):
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=1.0), named,
                                       groups=groups)
        for name, p in named:
            p.grad = grads[name].clone()
        opt.synchronize()
        for name, p in named:
            assert p.grad.dtype == grads[name].dtype and torch.equal(p.grad, want[name]), \
                f"groups={groups}: {name}'s gradient {p.grad[:2].tolist()}, not " \
                f"{want[name][:2].tolist()} (as allreduce reduces it alone)"
        with opt.skip_synchronize():
            opt.step()


def check_sparse_gradient_of_some_passes():
    """A sparse gradient whose parameter takes part in some of backward_passes_per_step's
    passes only (each rank uses the embedding in one pass of two; then the same with the last
    rank using it in both) is reduced at synchronize(), as Horovod's reduces what its hooks
    did not: allgathered (its values / size), or with sparse_as_dense averaged densely,
    exactly, and the same on every rank. It was left in its bucket: zeros there, and each rank
    stepped with its own gradient (the ranks trained apart, with no error), or where the last
    rank's count was full, a MismatchError on every rank."""
    def rows(k, p):
        return [k % 6, (k + p + 1) % 6]

    for last_in_both in (False, True):
        def used(k, p):
            return (k + p) % 2 == 0 or (last_in_both and k == n - 1)

        total = torch.zeros(6, 2, dtype=torch.float64)
        for k in range(n):
            for p in range(2):
                if used(k, p):
                    total[rows(k, p)] += n * (k + 1)      # (multiples of n: total / n exact)
        for as_dense in (False, True):
            emb = nn.Embedding(6, 2, sparse=True, dtype=torch.float64)
            nn.init.zeros_(emb.weight)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.25),
                                           [("emb.weight", emb.weight)],
                                           backward_passes_per_step=2, sparse_as_dense=as_dense)
            for p in range(2):
                if used(r, p):
                    (emb(torch.tensor(rows(r, p))).sum() * n * (r + 1)).backward()
            opt.step()
            average = horovod_scaled(total, 1.0 / n) if as_dense and n > 1 else total / n
            assert torch.equal(emb.weight.detach(), -0.25 * average), \
                f"last rank in both passes: {last_in_both}, sparse_as_dense={as_dense}: " \
                f"{emb.weight.detach().tolist()}, not {(-0.25 * average).tolist()}"


def check_sparse_gradient_of_some_ranks_or_dense():
    """An embedding's gradient (sparse=True) that some ranks lack, or that comes dense in a
    step, is reduced as Horovod reduces each gradient as it comes: gathered where it is sparse
    (ranks without one take part with an empty one), allreduced where it is dense (zeros
    where a rank has none). Exact and the same on every rank, at its first sparse step (the
    plan has it in a bucket) and later (reduced on its own). Before: a MismatchError ('sparse'
    differs) where only some ranks had it, and a KeyError in the backward hook where it came
    dense after a sparse step. Sparse on some ranks and dense on others: a MismatchError on
    every rank naming both, every rank skipping the step; the next step trains on exactly."""
    def rows(k, step):
        return [k % 6, (k + step) % 6]

    # each step: which ranks use the embedding (sparse), and whether every rank adds a dense
    # term (its weight's sum: the gradient comes dense on every rank)
    steps = [([n - 1], False), ([], False), ([0], False), (list(range(n)), True),
             ([n - 1], True), (list(range(0, n, 2)), False)]
    for first_sparse_at_start in (False, True):
        emb = nn.Embedding(6, 2, sparse=True, dtype=torch.float64)
        nn.init.zeros_(emb.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       [("emb.weight", emb.weight)])
        want = torch.zeros(6, 2, dtype=torch.float64)
        for step, (users, dense) in enumerate(steps[0 if first_sparse_at_start else 1:]):
            opt.zero_grad()
            total = torch.zeros(6, 2, dtype=torch.float64)
            for k in users:
                for row in rows(k, step):
                    total[row] += n * (k + 1)     # (multiples of n: total / n exact)
            loss = None
            if r in users:
                loss = emb(torch.tensor(rows(r, step))).sum() * n * (r + 1)
            if dense:
                total += n * n      # (n from each rank)
                loss = emb.weight.sum() * n + (0 if loss is None else loss)
            if loss is not None:
                loss.backward()
            opt.step()
            want -= 0.5 * total / n
            assert torch.equal(emb.weight.detach(), want), \
                f"step {step} (users {users}, dense {dense}): {emb.weight.detach().tolist()}, " \
                f"not {want.tolist()}"
        if n == 1:
            continue
        # sparse on rank 0, dense on the last rank: an error on every rank, then exact again
        for sparse_known in (True, False):
            if not sparse_known:
                emb = nn.Embedding(6, 2, sparse=True, dtype=torch.float64)
                nn.init.zeros_(emb.weight)
                opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                               [("emb.weight", emb.weight)])
                want = torch.zeros(6, 2, dtype=torch.float64)
            opt.zero_grad()
            if r == 0:
                emb(torch.tensor([1])).sum().backward()
            elif r == n - 1:
                emb.weight.sum().backward()
            expect(hvd.MismatchError, ["'emb.weight'", "sparse on ranks [0]",
                                       f"dense on ranks [{n - 1}]"], opt.step)
            assert torch.equal(emb.weight.detach(), want), "a skipped step changed the weight"
            opt.zero_grad()
            (emb(torch.tensor([2])).sum() * n).backward()    # (gathered: n / n exact)
            opt.step()
            want[2] -= 0.5 * n
            assert torch.equal(emb.weight.detach(), want), \
                f"after the error (sparse known: {sparse_known}): " \
                f"{emb.weight.detach().tolist()}, not {want.tolist()}"


def check_param_group_added_after_wrapping():
    """A param group added after wrapping (add_param_group) is reduced from the next step on,
    named as the given named_parameters name it (or, without them, as Horovod names one); each
    rank's gradient (r + 1) averages to (n + 1) / 2 exactly. Added to the plain optimizer after
    wrapping, it is not the wrapper's: Horovod's wrapper is a new optimizer with a list of
    groups of its own, which steps without it. Horovod hooks only the parameters it was wrapped
    with: the group trained apart on each rank, and so did ours. Added on the last rank alone:
    a MismatchError on every rank naming the parameter, until every rank has added it."""
    for named, through_plain in ((True, False), (False, False), (True, True)):
        model = nn.ModuleDict({"a": nn.Linear(3, 1, bias=False),
                               "b": nn.Linear(3, 1, bias=False)})
        nn.init.zeros_(model["a"].weight)
        nn.init.zeros_(model["b"].weight)
        plain = torch.optim.SGD(model["a"].parameters(), lr=1.0)
        opt = hvd.DistributedOptimizer(plain, model.named_parameters() if named else None)
        (plain if through_plain else opt).add_param_group({"params": model["b"].parameters(),
                                                          "lr": 1.0})
        for _ in range(2):
            opt.zero_grad()
            ((model["a"].weight.sum() + model["b"].weight.sum()) * (r + 1)).backward()
            opt.step()
        for key in "ab":
            stepped = key == "a" or not through_plain
            assert torch.equal(model[key].weight,
                               torch.full((1, 3), -(n + 1.0) if stepped else 0.0)), \
                f"named={named}, on the wrapped optimizer={through_plain}: {key} " \
                f"{model[key].weight.tolist()}, stepped={stepped}"
    if n > 1:
        model = nn.ModuleDict({"a": nn.Linear(3, 1, bias=False),
                               "b": nn.Linear(3, 1, bias=False)})
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model["a"].parameters(), lr=1.0),
                                       model.named_parameters())
        for late in (True, False):
            if r == n - 1 or not late:
                if not any(p is model["b"].weight for g in opt.param_groups
                           for p in g["params"]):
                    opt.add_param_group({"params": model["b"].parameters()})
            opt.zero_grad()
            (model["a"].weight.sum() + model["b"].weight.sum()).backward()
            if late:
                expect(hvd.MismatchError, ["'b.weight' only on ranks", "add_param_group"],
                       opt.step)
            else:
                opt.step()
        params_equal_across_ranks(model, "a group added on every rank, late on some")


def check_a_parameter_in_two_optimizers():
    """A parameter that two live DistributedOptimizers reduce (its gradient averaged twice,
    one's reduction in place racing the other's packing: 1.25 for 1.5 at 2 ranks, changing
    from run to run) fails the backward pass with UsageError naming it, on every rank; once
    the second is released, the first trains on exactly. The last rank alone keeping the
    other: an error on every rank, then the same. (Alone, a rank reduces nothing: both step
    with its own gradient, as plain torch does.)"""
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    first = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), [("a", a), ("b", b)])
    second = hvd.DistributedOptimizer(torch.optim.SGD([b], lr=1.0), [("b", b)])

    def backward():
        ((a.sum() + b.sum()) * (r + 1)).backward()

    if n > 1:
        expect(hvd.UsageError, ["'b'", "reduced by two DistributedOptimizers"], backward)
        second.release()
        first.zero_grad()
        backward()
        first.step()
        for p in (a, b):
            assert torch.equal(p.detach(), torch.full((3,), -(n + 1) / 2)), \
                f"{p.tolist()}, not {-(n + 1) / 2}"
        # the last rank alone keeps an optimizer the others released: an error on every rank
        # (there, its backward's UsageError naming the parameter; on the others, their step's
        # MismatchError: the ranks wait in different collectives), then, released there too,
        # training goes on alike
        for p in (a, b):
            nn.init.zeros_(p)
        again = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), [("a", a), ("b", b)])
        if r != n - 1:
            first.release()

        def step():
            backward()
            again.step()

        if r == n - 1:      # (its own reason, the others' mismatch as the cause)
            expect(hvd.UsageError, ["'b'", f"rank {r}", "two DistributedOptimizers"], step)
        else:
            expect(hvd.MismatchError, "", step)
        if r == n - 1:
            first.release()
        again.zero_grad()
        step()
        for p in (a, b):
            assert torch.equal(p.detach(), torch.full((3,), -(n + 1) / 2)), \
                f"after one rank kept an optimizer: {p.tolist()}, not {-(n + 1) / 2}"


def check_channels_last():
    """A channels_last model: its buckets hold each weight in the weight's memory layout, so a
    gradient made a view of one keeps autograd's layout contract (the layout of its parameter),
    and training goes as in one process. A rank whose model is laid out otherwise gets a
    MismatchError on every rank, naming the strides, and the job goes on."""
    reference = train_conv(False)
    for options in (SMALL_BUCKETS, dict(gradient_as_bucket_view=True, **SMALL_BUCKETS)):
        model = train_conv(True, **options)
        params_equal_across_ranks(model, f"channels_last {options}")
        assert_close(model, reference, f"channels_last {options}")
        if options.get("gradient_as_bucket_view"):
            for name, p in model.named_parameters():
                assert p.grad.stride() == p.stride(), f"{name}: {p.grad.stride()}, {p.stride()}"
    if n > 1:
        expect(hvd.MismatchError, ["'strides' differs", "conv2.weight", "rank 0", "None"],
               train_conv, True, channels_last=r != n - 1, **SMALL_BUCKETS)
    params_equal_across_ranks(train_conv(True, **SMALL_BUCKETS), "channels_last after")


def check_overlap():
    """The first bucket is handed to the engine before backward has produced every gradient."""
    if n == 1:      # nothing is reduced in a job of one process
        return
    model = fresh_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), **SMALL_BUCKETS)
    timeline.events = []
    # conv.weight is registered first, so its gradient is among the last of backward
    model.conv.weight.register_post_accumulate_grad_hook(
        lambda p: timeline.record("conv.weight", "gradient ready"))
    x, y = data(0)
    F.cross_entropy(model(shard(x)), shard(y)).backward()
    opt.step()
    events = [(name, phase) for _, name, phase in timeline.events]
    timeline.events = None
    first = events.index((opt._buckets[0].name, "submitted"))
    last_grad = events.index(("conv.weight", "gradient ready"))
    assert first < last_grad, events
    assert len(opt._buckets) > 2 and (opt._buckets[1].name, "submitted") in events[:last_grad]


def check_bucket_schedules():
    """Buckets reduced on the engine thread (overlap), on the training thread (inline), or as
    `auto` chooses after measuring both, also where the ranks differ in it: the same bits on
    every rank and under every schedule; `auto` ends with one choice on every rank; a mistake
    on one rank in an inline bucket fails the step on every rank (not backward), and the job
    trains on."""
    steps = schedule.WARM_UP_STEPS + schedule.TRIAL_STEPS + 2    # past auto's trials
    mine = {"overlap": "overlap", "inline": "inline", "auto": "auto",
            "inline on rank 0 alone": "inline" if r == 0 else "overlap"}
    results = {}
    for what, setting in mine.items():
        hvd.shutdown()
        hvd.init(bucket_schedule=setting)
        model, opt = train(sgd, steps=steps, **SMALL_BUCKETS)
        params_equal_across_ranks(model, what)
        results[what] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if what == "auto" and n > 1:
            chosen = MPI.COMM_WORLD.allgather(opt._schedule.chosen)
            assert chosen[0] in ("overlap", "inline") and len(set(chosen)) == 1, chosen
    for what, flat in results.items():
        assert torch.equal(flat, results["overlap"]), f"{what}: other bits than overlap's"
    hvd.shutdown()
    hvd.init(bucket_schedule="inline")
    if n > 1:
        model = fresh_model()           # the last rank alone unfreezes conv.weight: its
        model.conv.weight.requires_grad_(False)     # plan (the first bucket's) differs
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(),
                                       **SMALL_BUCKETS)
        model.conv.weight.requires_grad_(r == n - 1)
        x, y = data(0)
        F.cross_entropy(model(shard(x)), shard(y)).backward()     # (its buckets fail here)
        expect(hvd.MismatchError, "conv.weight", opt.step)
        model, _ = train(sgd, steps=2, **SMALL_BUCKETS)
        params_equal_across_ranks(model, "inline, after a mistake")
    hvd.shutdown()
    hvd.init()


def check_state_helpers():
    torch.manual_seed(r)            # every rank starts from different weights
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    params_equal_across_ranks(model, "broadcast_parameters(state_dict)")
    torch.manual_seed(r + 10)
    other = Net()
    hvd.broadcast_parameters(other.named_parameters(), root_rank=n - 1)
    params_equal_across_ranks(other, "broadcast_parameters(named_parameters)")

    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (r + 1))
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)          # before the first step: empty
    # Horovod's procedure: the state is made by a step with zero gradients (which moves no
    # parameter of Adam without weight decay), then the root's is broadcast
    assert opt.param_groups[0]["lr"] == 0.001
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    x, y = data(r)
    for _ in range(r + 1):          # local steps, a different number per rank
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    # as Horovod's, the DistributedOptimizer starts with the state Adam's __init__ makes, none
    # (and says so)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = hvd.DistributedOptimizer(opt, model.named_parameters())
    assert any("starts with the state its class makes" in str(w.message) for w in caught), caught
    assert not dist.state and len(opt.state) == len(list(model.parameters()))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(dist, root_rank=0)
    state = dist.state_dict()["state"]
    assert float(state[0]["step"]) == 1.0, state[0]["step"]   # made by a zero step
    flat = torch.cat([state[i]["exp_avg"].reshape(-1) for i in sorted(state)])
    everyone = MPI.COMM_WORLD.allgather(flat.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), "optimizer state differs across ranks"
    for _ in range(2):              # and training goes on in step
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        dist.step()
        dist.zero_grad()
    params_equal_across_ranks(model, "after broadcast_optimizer_state")
    saved = copy.deepcopy(dist.state_dict())   # load_state_dict keeps the wrapper working
    dist.load_state_dict(saved)
    F.cross_entropy(model(shard(x)), shard(y)).backward()
    dist.step()
    params_equal_across_ranks(model, "after load_state_dict")

    assert hvd.broadcast_object({"epoch": r, "tag": "x"}, root_rank=n - 1) == \
        {"epoch": n - 1, "tag": "x"}
    assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]
    if n > 1:
        check_state_helpers_refuse_a_mistake_on_one_rank()


def check_state_helpers_refuse_a_mistake_on_one_rank():
    """The last rank alone with another model, other param_groups or another optimizer
    class: a MismatchError on every rank naming what differs (Horovod stalls), and the
    helpers work after."""
    last = f"only on ranks [{n - 1}]"
    torch.manual_seed(r)
    bigger = nn.Sequential(Net(), *([nn.Linear(2, 2)] if r == n - 1 else []))
    expect(hvd.MismatchError, [f"'broadcast_parameters.1.weight' {last}", "broadcast_parameters"],
           hvd.broadcast_parameters, bigger.state_dict(), root_rank=0)
    model = Net()
    groups = ([{"params": [p]} for p in model.parameters()] if r == n - 1
              else [{"params": list(model.parameters())}])
    grouped = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    expect(hvd.MismatchError, f"'lr.1' {last}", hvd.broadcast_optimizer_state, grouped, 0)
    other = (torch.optim.Adam(model.parameters(), lr=0.1) if r == n - 1
             else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    expect(hvd.MismatchError, [f"'momentum_buffer.1' only on ranks {list(range(n - 1))}",
                               "names in all"],      # (the first ten shown)
           hvd.broadcast_optimizer_state, other, 0)
    # the same names, one layer of another shape on the last rank: refused before any
    # broadcast, every tensor as it was (those before it were overwritten, and those after it
    # still being written after the error), and so with a tensor of another dtype
    for odd in (nn.Linear(2, 3), nn.Linear(3, 2).double()):
        torch.manual_seed(r)
        shaped = nn.Sequential(nn.Linear(3, 3), odd if r == n - 1 else nn.Linear(3, 2),
                               nn.Linear(2, 1))
        kept = copy.deepcopy(shaped.state_dict())
        expect(hvd.MismatchError, ["'shapes' differs", f"'broadcast_parameters.1.weight: "
                                   f"{str(odd.weight.dtype)[6:]}{tuple(odd.weight.shape)}' "
                                   f"{last}"],
               hvd.broadcast_parameters, shaped.state_dict(), root_rank=0)
        time.sleep(0.2)
        assert all(torch.equal(t, kept[k]) for k, t in shaped.state_dict().items())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    params_equal_across_ranks(model, "broadcast_parameters after a refused one")
    same = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(same, root_rank=0)
    assert same.param_groups[0]["lr"] == 0.1


def check_gradient_replaced_before_step():
    """A gradient the program replaces between backward and step (p.grad = f(p.grad)) on rank
    0 alone, while the reduction runs (the others come late): as Horovod's synchronize() sets
    each gradient to its reduced value, rank 0 steps with the average too, for a parameter
    reduced in place (a bucket of its own) and for one packed in a shared bucket. Its
    gradients are bitwise the others' (which are the averages), and so are the parameters."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 2))   # 1 MiB: alone
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), fusion_threshold=4096)
    for _ in range(2):      # (the first steps reduce beside backward, the overlap schedule)
        opt.zero_grad()
        if r != 0:
            time.sleep(0.3)
        model(torch.full((1, 512), float(r + 1))).sum().backward()
        if r == 0:
            for p in model.parameters():
                p.grad = torch.nan_to_num(p.grad)       # a new tensor, the same values
        opt.step()
        for name, p in model.named_parameters():
            everyone = MPI.COMM_WORLD.allgather(p.grad.numpy().tobytes())
            assert all(b == everyone[0] for b in everyone), f"{name}'s gradient differs"
    params_equal_across_ranks(model, "a gradient replaced before the step on rank 0")
    if n > 1:
        assert sorted(b.direct for b in opt._buckets) == [False, True], opt._buckets


def check_a_step_skipped_on_one_rank():
    """The last rank skips step() after a backward pass (a batch it chose to skip), then calls
    zero_grad(): UsageError there, the step left open, as Horovod's (its step() would finish
    it). A second zero_grad() ends it: UsageError there, and the others' step() raises
    UsageError naming that rank, the step skipped everywhere; then the ranks train in step."""
    if n == 1:
        return      # (a job of one process reduces nothing: nothing stays open)
    torch.manual_seed(6)
    model = nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.full((1, 4), float(r + 1))).sum().backward()
    if r == n - 1:
        expect(hvd.UsageError, ["zero_grad() on rank", "before optimizer.step()",
                                "second zero_grad() ends it"], opt.zero_grad)
        expect(hvd.UsageError, f"zero_grad() on rank {r} came again", opt.zero_grad)
    else:
        expect(hvd.UsageError, ["skipped on every rank", f"ranks [{n - 1}]"], opt.step)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    for _ in range(2):
        opt.zero_grad()
        model(torch.full((1, 4), float(r + 1))).sum().backward()
        opt.step()
    params_equal_across_ranks(model, "after a step skipped on one rank")


run_cases([then_barrier(check) for check in (
    check_equivalence, check_large_gradients_alone, check_inheritance, check_features,
    check_unused_and_frozen, check_errors,
    check_groups_leave_the_predivide_factor_out, check_groups_of_several_dtypes,
    check_sparse_gradient_of_some_passes, check_sparse_gradient_of_some_ranks_or_dense,
    check_param_group_added_after_wrapping, check_gradient_replaced_before_step,
    check_a_step_skipped_on_one_rank,
    check_a_parameter_in_two_optimizers,
    check_channels_last, check_overlap,
    check_bucket_schedules, check_state_helpers, check_sync_batch_norm)], r)
print(f"OK rank {r}", flush=True)
