"""Horovod 0.28's behaviours that change numbers, at 2 or more ranks, each case against a
reference that applies Horovod's procedure by hand in this process (exact where Horovod's
arithmetic is reproducible, `torch.equal`):

- broadcast_optimizer_state: the state of a fresh optimizer is made by zero gradients and one
  local step (weight decay moves the parameters once), then the state tensors and the scalars
  are broadcast from the root; the pytorch_imagenet_resnet50.py pattern trains bitwise as
  Horovod's procedure does; LBFGS is refused; model= makes SGD's gradients of sparse
  embeddings sparse; non-tensor state entries and options come from the root;
- DistributedOptimizer on a rank outside its process set steps with the local gradients;
- reducescatter's gradient: times the set's size for Sum, times prescale and postscale;
- sparse gradients (SparseAdam, SGD; sparse_as_dense) reduced as Horovod does, handed back
  sparse;
- sparse_allreduce_async returns a callable; ranks with different dense shapes get
  MismatchError;
- alltoall's float splits raise an error both `except ValueError` and `except TypeError` catch;
- `_parameter_names` and the generated names 'allreduce.noname.<group>.<index>'.

Every case runs even when an earlier one failed; the failures are printed together at the end
(then the script exits non-zero). After each case the ranks compare notes (an allgather named
after the case), so every rank reports which cases failed on any rank. (A case that left one
rank waiting for a collective the others never submit would hold the launch until its
timeout.)
"""
import copy
import sys
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringreduce as hvd
from checks import check_equal, expect, horovod_scaled
from models import Embedder

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
assert n >= 2, "run with 2 or more ranks"


class ConvNet(nn.Module):
    """A small image classifier, in the spirit of the ImageNet example's ResNet."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


def batch(step, k, rows=4):
    """Rank k's shard of step `step`'s batch (the same on every rank that asks)."""
    g = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(rows, 1, 8, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def local_gradients(model, x, y):
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def averaged(per_rank):
    """The members' gradients summed in rank order (what the shared-memory allreduce of a
    small bucket does; for 2 ranks any order gives it), then scaled by 1/count as Horovod
    averages (checks.horovod_scaled)."""
    total = [g.clone() for g in per_rank[0]]
    for grads in per_rank[1:]:
        for t, g in zip(total, grads):
            t += g
    return [horovod_scaled(t, 1.0 / len(per_rank)) for t in total]


def same_across_ranks(tensors, what, process_set=hvd.global_process_set):
    everyone = hvd.allgather_object([t.detach().clone() for t in tensors],
                                    process_set=process_set)
    for k, theirs in enumerate(everyone):
        for i, (mine, other) in enumerate(zip(tensors, theirs)):
            assert torch.equal(mine.detach(), other), f"{what}: tensor {i} differs on rank {k}"


# ---------------------------------------------------------------- broadcast_optimizer_state

def case_imagenet_pattern_trains_as_horovods_procedure():
    """SGD with momentum and weight decay wrapped in DistributedOptimizer,
    broadcast_parameters then broadcast_optimizer_state, then training: bitwise Horovod's
    procedure (zero gradients, one plain step, then steps with the averaged gradient)."""
    options = dict(lr=0.05 * n, momentum=0.9, weight_decay=0.01)
    torch.manual_seed(r)                          # every rank starts elsewhere
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), **options)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    torch.manual_seed(0)                          # the root's model, by hand
    reference = ConvNet()
    start = [p.detach().clone() for p in reference.parameters()]
    ref_opt = torch.optim.SGD(reference.parameters(), **options)
    for p in reference.parameters():
        p.grad = torch.zeros_like(p)
    ref_opt.step()
    assert not any(torch.equal(a, p) for a, p in zip(start, reference.parameters())), \
        "the reference's state step should have moved the parameters (weight decay)"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        check_equal(p.detach(), q.detach(), f"{name} after broadcast_optimizer_state")
        check_equal(p.grad, torch.zeros_like(p), f"{name}'s gradient after the state step")
        check_equal(optimizer.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                    f"{name}'s momentum after broadcast_optimizer_state")
    for step in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(batch(step, r)[0]), batch(step, r)[1]).backward()
        optimizer.step()
        grads = averaged([local_gradients(reference, *batch(step, k)) for k in range(n)])
        for q, g in zip(reference.parameters(), grads):
            q.grad = g
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            check_equal(p.detach(), q.detach(), f"{name} after training step {step}")
    same_across_ranks(list(model.parameters()), "imagenet pattern")


def case_fresh_plain_optimizer_gets_its_state_made():
    """A plain Adam before its first step: zero gradients (not for a frozen parameter), one
    step (with weight decay, the parameters move once, the same everywhere), then the root's
    state and options everywhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8 + 0.01 * r, 0.99),
                           weight_decay=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
    assert model[0].bias.grad is None, "a frozen parameter got a gradient"
    for name, p in model.named_parameters():
        if p.requires_grad:
            check_equal(p.grad, torch.zeros_like(p), f"{name}'s zero gradient")
    # the state step ran with this rank's betas; the root's come after it
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=0.01,
                               betas=(0.8 + 0.01 * r, 0.99), weight_decay=0.1)
    for p in reference.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        check_equal(p.detach(), q.detach(), f"{name} after the state step")
    assert opt.param_groups[0]["betas"] == (0.8 + 0.01 * (n - 1), 0.99), opt.param_groups[0]
    assert model[0].bias not in opt.state, "a frozen parameter got state"
    for p in (model[0].weight, model[1].weight, model[1].bias):
        check_equal(opt.state[p]["step"], torch.tensor(1.0), "Adam's step after the state step")
    same_across_ranks([t for p in opt.state for t in opt.state[p].values()], "Adam's state")


class CountingSGD(torch.optim.SGD):
    """SGD with a state entry that is not a tensor."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["calls"] = self.state[p].get("calls", 0) + 1


def case_existing_state_comes_from_the_root():
    """State made by a different number of steps on every rank, options that differ, a state
    entry that is not a tensor, two param groups, on a process set with a root other than
    rank 0 (3 ranks or more; else the global set): the root's state, no state step."""
    members = list(range(1, n)) if n >= 3 else list(range(n))
    ps = hvd.add_process_set(members) if n >= 3 else hvd.global_process_set
    try:
        if r not in members:
            return
        root = members[-1]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        opt = CountingSGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters(), "lr": 0.3 + r}],
                          lr=0.1 * (r + 1), momentum=0.5 + 0.1 * r)
        for step in range(r + 1):
            opt.zero_grad()
            model(torch.randn(2, 3, generator=torch.Generator().manual_seed(step + 10 * r))
                  ).sum().backward()
            opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=ps)
        for p, b, g in zip(model.parameters(), before, grads):
            check_equal(p.detach(), b, "a parameter moved although the state existed")
            check_equal(p.grad, g, "a gradient changed although the state existed")
        assert [g["lr"] for g in opt.param_groups] == [0.1 * (root + 1), 0.3 + root]
        assert opt.param_groups[0]["momentum"] == 0.5 + 0.1 * root
        assert all(opt.state[p]["calls"] == root + 1 for p in model.parameters()), \
            [opt.state[p]["calls"] for p in model.parameters()]
        same_across_ranks([opt.state[p]["momentum_buffer"] for p in model.parameters()],
                          "momentum from the root", ps)
    finally:
        if ps is not hvd.global_process_set:
            hvd.remove_process_set(ps)


def case_lbfgs_is_refused():
    opt = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    expect(ValueError, "LBFGS", hvd.broadcast_optimizer_state, opt, 0)


def case_a_root_wrong_on_one_rank_fails_every_rank():
    """broadcast_optimizer_state with a root outside the job on the last rank alone: its
    ValueError meets the others' call, which fails quoting it at once (it waited for a
    deadlock's second before, with no word of the cause), stateful or stateless, nothing is
    changed on that rank, and the next collectives are exact."""
    if n == 1:
        return
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)):
        p = nn.Parameter(torch.full((3,), float(r)))
        opt = make([p])
        root = n if r == n - 1 else 0
        if r == n - 1:
            expect(ValueError, f"root_rank {n} is not a rank", hvd.broadcast_optimizer_state,
                   opt, root)
            assert not opt.state and torch.equal(p.detach(), torch.full((3,), float(r)))
        else:
            expect(hvd.MismatchError, ["'broadcast_optimizer_state' cannot run: a mistake in "
                                       f"the arguments of rank {n - 1}", f"root_rank {n}"],
                   hvd.broadcast_optimizer_state, opt, root)
        total = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum)
        assert torch.equal(total, torch.full((2,), float(n * (n - 1) // 2))), total


def case_model_makes_sgds_embedding_gradients_sparse():
    """SGD: model= names the sparse embeddings, whose zero gradients are then sparse; without
    it they are dense, as Horovod's. Stateless SGD: nothing is broadcast after the step."""
    for give_model in (True, False):
        torch.manual_seed(0)
        model = Embedder(rows=12)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hvd.broadcast_optimizer_state(opt, 0, model=model if give_model else None)
        assert model.embedding.weight.grad.is_sparse == give_model, (give_model,
                                                                     model.embedding.weight.grad)
        assert not model.head.weight.grad.is_sparse and not opt.state, opt.state


def case_sparse_adam_state_is_made_with_sparse_zeros():
    torch.manual_seed(0)
    model = nn.Embedding(12, 4, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                                   model.named_parameters())
    start = model.weight.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.weight.grad.is_sparse, model.weight.grad
    check_equal(model.weight.detach(), start, "SparseAdam's state step moved the weights")
    state = opt.state[model.weight]
    check_equal(state["exp_avg"], torch.zeros(12, 4), "SparseAdam's exp_avg")
    assert int(state["step"]) == 1, state["step"]


# ---------------------------------------------------------------- outside the process set

def case_outside_the_set_steps_locally():
    """Members [0, 1] (3 ranks or more; [0] at 2): a member averages over the set; the other
    ranks step with their own gradients, with no hooks and synchronize() doing nothing."""
    members = [0, 1] if n >= 3 else [0]
    ps = hvd.add_process_set(members)
    try:
        torch.manual_seed(0)
        model = ConvNet()
        reference = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), process_set=ps)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        assert isinstance(opt, torch.optim.SGD)
        if r not in members:
            assert not opt._hooks, "hooks on a rank outside the set"
        for step in range(2):
            opt.zero_grad()
            x, y = batch(step, r)
            F.cross_entropy(model(x), y).backward()
            if step == 1:
                opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            sources = members if r in members else [r]
            grads = averaged([local_gradients(reference, *batch(step, k)) for k in sources])
            for q, g in zip(reference.parameters(), grads):
                q.grad = g
            ref_opt.step()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                check_equal(p.detach(), q.detach(), f"rank {r} ({'in' if r in members else 'outside'}"
                            f" the set) {name} after step {step}")
    finally:
        hvd.remove_process_set(ps)


# ---------------------------------------------------------------- reducescatter's gradient

def case_reducescatter_gradient_is_horovods():
    rows = 2 * n
    counts = [rows // n] * n
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0),
                          (hvd.Average, 0.25, 6.0)):
        what = f"reducescatter {op.name} prescale {pre} postscale {post}"
        x = torch.ones(rows, 3, dtype=torch.float64, requires_grad=True)
        out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
        out.backward(torch.ones_like(out))
        factor = (n if op == hvd.Sum else 1) * pre * post
        check_equal(x.grad, torch.full((rows, 3), float(factor), dtype=torch.float64),
                    f"{what}, all-ones upstream")
        # a different upstream gradient on every rank: rank k's block of the gradient is rank
        # k's upstream gradient, multiplied one factor at a time as Horovod does
        x = torch.ones(rows, 3, requires_grad=True)
        a, b = hvd.grouped_reducescatter([x, 2 * x], op=op, prescale_factor=pre,
                                         postscale_factor=post)
        upstream = [torch.arange(counts[k] * 3, dtype=torch.float32).reshape(counts[k], 3)
                    * 0.1 + k for k in range(n)]
        (a * upstream[r]).sum().backward(retain_graph=True)
        (b * upstream[r]).sum().backward()

        def scaled(g):
            if op == hvd.Sum:
                g = g * n
            if pre != 1.0:
                g = g * pre
            if post != 1.0:
                g = g * post
            return g

        want = torch.cat([scaled(u) for u in upstream]) + 2 * torch.cat(
            [scaled(u) for u in upstream])
        check_equal(x.grad, want, f"grouped {what}, per-rank upstream")
    # compressed: Horovod scales in the wire dtype (float16), then restores float32
    x = torch.ones(rows, 2, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Sum, compression=hvd.Compression.fp16,
                            prescale_factor=0.1)
    out.backward(torch.full_like(out, 0.3))
    want = ((torch.full((rows, 2), 0.3).half() * n) * 0.1).float()
    check_equal(x.grad, want, "fp16-compressed reducescatter's gradient")


# ---------------------------------------------------------------- sparse

def sparse_reference_step(reference, ref_opts, tokens, labels, rows, densely=False):
    """One process, Horovod's sparse reduction: every rank's sparse gradient of the embedding
    (values divided by the count for Average) concatenated; the dense ones averaged. With
    `densely`, Horovod's sparse_as_dense: the averaged dense gradient, made sparse again."""
    per_rank = []
    for k in range(n):
        for p in reference.parameters():
            p.grad = None
        F.cross_entropy(reference(tokens[rows * k:rows * (k + 1)]),
                        labels[rows * k:rows * (k + 1)]).backward()
        per_rank.append([p.grad for p in reference.parameters()])
    grads = []
    for i, p in enumerate(reference.parameters()):
        pieces = [grads_k[i] for grads_k in per_rank]
        if pieces[0].is_sparse and not densely:
            grads.append(torch.sparse_coo_tensor(
                torch.cat([g._indices() for g in pieces], 1),
                torch.cat([g._values() for g in pieces]) / n, p.shape, check_invariants=True))
        elif pieces[0].is_sparse:
            grads.append(averaged([[g.to_dense()] for g in pieces])[0].to_sparse())
        else:
            grads.append(averaged([[g] for g in pieces])[0])
    for p, g in zip(reference.parameters(), grads):
        p.grad = g
    for o in ref_opts:
        o.step()


def case_sparse_gradients_train_and_stay_sparse():
    """SparseAdam on a sparse embedding (plain Adam on the head), plain SGD on the whole model,
    and SparseAdam with sparse_as_dense: the reduced embedding gradient stays sparse; every rank
    holds the same parameters, those of one process stepping with Horovod's reduction."""
    setups = {
        "SparseAdam": (False, lambda m: [torch.optim.SparseAdam(list(m.embedding.parameters()),
                                                                lr=0.05),
                                         torch.optim.Adam(m.head.parameters(), lr=0.05)]),
        "SGD": (False, lambda m: [torch.optim.SGD(m.parameters(), lr=0.5)]),
        "SparseAdam, sparse_as_dense": (True, lambda m: [
            torch.optim.SparseAdam(list(m.embedding.parameters()), lr=0.05),
            torch.optim.Adam(m.head.parameters(), lr=0.05)]),
    }
    rows = 3
    for label, (densely, make) in setups.items():
        torch.manual_seed(3)
        model = Embedder(rows=12)
        reference = copy.deepcopy(model)
        opts = []
        for o in make(model):
            own = {id(q) for g in o.param_groups for q in g["params"]}
            opts.append(hvd.DistributedOptimizer(
                o, [(name, p) for name, p in model.named_parameters() if id(p) in own],
                sparse_as_dense=densely))
        ref_opts = make(reference)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 12, (rows * n, 5), generator=g)
            labels = torch.randint(0, 3, (rows * n,), generator=g)
            for o in opts:
                o.zero_grad()
            F.cross_entropy(model(tokens[rows * r:rows * (r + 1)]),
                            labels[rows * r:rows * (r + 1)]).backward()
            for o in opts:
                o.synchronize()
            assert model.embedding.weight.grad.is_sparse, \
                f"{label}: the reduced embedding gradient is not sparse"
            for o in opts:
                with o.skip_synchronize():
                    o.step()
            sparse_reference_step(reference, ref_opts, tokens, labels, rows, densely)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), \
                    f"{label} step {step}: {name} off by {(p - q).abs().max().item()}"
        same_across_ranks(list(model.parameters()), label)


def case_sparse_allreduce_async_returns_a_callable():
    rows = 2 * n + 3
    g = torch.Generator().manual_seed(r)
    dense = torch.randint(0, 4, (rows, 5), generator=g).float()
    dense[dense < 2] = 0
    for op in (hvd.Sum, hvd.Average):
        handle = hvd.sparse_allreduce_async(dense.to_sparse(), name=f"sparse.{op.name}", op=op)
        assert callable(handle) and not isinstance(handle, hvd.Handle), type(handle)
        got = handle()
        assert got.is_sparse, got
        want = hvd.allreduce(dense, op=op, name=f"dense.{op.name}")
        if op == hvd.Sum:       # small integers: exact
            check_equal(got.to_dense(), want, "sparse_allreduce_async Sum")
        else:                   # Horovod divides every rank's values, then adds them up
            assert torch.allclose(got.to_dense(), want, rtol=1e-6, atol=0), \
                f"sparse_allreduce_async Average: {got.to_dense()} vs {want}"
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.synchronize", op=hvd.Sum)
    check_equal(hvd.synchronize(handle).to_dense(), hvd.allreduce(dense, op=hvd.Sum),
                "synchronize(handle) of sparse_allreduce_async")


def case_sparse_allreduce_with_different_dense_shapes_is_a_mismatch():
    rows = 5 if r == 0 else 6
    sparse = torch.sparse_coo_tensor(torch.tensor([[rows - 1]]), torch.ones(1, 3), (rows, 3))
    handle = hvd.sparse_allreduce_async(sparse, name="shapes.differ", op=hvd.Sum)
    expect(hvd.MismatchError, ["shapes.differ", "rank 0: (5, 3)", "rank 1: (6, 3)"], handle)
    check_equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)),
                "an allreduce after the mismatch")


# ---------------------------------------------------------------- alltoall, names

def case_alltoall_float_splits():
    floats = torch.empty(n, dtype=torch.float32)
    for error in (ValueError, TypeError, hvd.ArgumentTypeError):
        expect(error, ["splits must be integers", "'alltoall.floats.split'", f"rank {r}"],
               hvd.alltoall, torch.ones(n), floats, "floats.split")
    expect(ValueError, "splits must be integers", hvd.alltoall, torch.ones(n), [0.5] * n)


def case_parameter_names_are_horovods():
    first, second = nn.Linear(2, 2), nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": first.parameters()},
                                                    {"params": second.parameters()}], lr=0.1))
    want = {first.weight: "allreduce.noname.0.0", first.bias: "allreduce.noname.0.1",
            second.weight: "allreduce.noname.1.0", second.bias: "allreduce.noname.1.1"}
    assert opt._parameter_names == want, opt._parameter_names
    assert sorted(n for b in opt._buckets for n in b.names) == sorted(want.values())
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: name for name, p in model.named_parameters()}
    assert list(named._parameter_names.values()) == sorted(named._parameter_names.values())


# ---------------------------------------------------------------- the optimizer's life cycle

def linear_and_optimizer(**options):
    """A Linear(3, 2) and its DistributedOptimizer (SGD, lr 0: the gradients are what is
    checked); rank r's input (r + 1) * ones makes its weight gradient r + 1 everywhere and its
    bias gradient 1, so sums are exact."""
    model = nn.Linear(3, 2)
    sgd = options.pop("sgd", torch.optim.SGD(model.parameters(), lr=0.0))
    return model, hvd.DistributedOptimizer(sgd, model.named_parameters(), **options)


def backward(model, scale=1.0):
    model(torch.full((1, 3), scale * (r + 1))).sum().backward()


def case_groups_short_of_gradients_take_the_predivide_factor():
    """With `groups` and gradient_predivide_factor f, Horovod reduces a group whose members are
    all ready before step() in one grouped allreduce without f, and one that is not (a member
    without a gradient; a step before backward_passes_per_step passes) member by member with
    it: prescale 1/f, postscale f / size in float32. Bitwise, on gradients whose sums are exact
    (one rank's nonzero elements each, at 3 or more ranks): the factor changes the bits."""
    f = 0.7

    def gradient(k):
        values = torch.randint(-256, 257, (64,), generator=torch.Generator().manual_seed(k)) / 64
        if n > 2:
            values[torch.arange(64) % n != k] = 0
        return values.float()

    def averaged_with(factor):
        scaled = [horovod_scaled(gradient(k), 1.0 / factor) for k in range(n)]
        return horovod_scaled(sum(scaled[1:], scaled[0]), factor / n)

    for short, passes, used in (("a member without a gradient", 1, False),
                                ("a step before the second pass", 2, True),
                                (None, 1, True)):
        a, b = nn.Parameter(torch.zeros(64)), nn.Parameter(torch.zeros(64))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), [("a", a), ("b", b)],
                                       groups=1, gradient_predivide_factor=f,
                                       backward_passes_per_step=passes)
        ((a + b if used else a) * gradient(r)).sum().backward()
        opt.step()
        want = averaged_with(f if short else 1.0)
        what = f"groups=1, f={f}, " + (short or "every gradient there")
        check_equal(-a.detach(), want, what)
        if short is None:
            check_equal(-b.detach(), want, f"{what}: the second member")
    # The last rank alone short of a gradient (a branch it did not take): the ranks would
    # reduce the group two ways (Horovod's then wait for each other): a MismatchError on every
    # rank that says so, and the next step, every gradient there, trains on
    if n > 1:
        a, b = nn.Parameter(torch.zeros(64)), nn.Parameter(torch.zeros(64))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), [("a", a), ("b", b)],
                                       groups=1, gradient_predivide_factor=f)
        ((a if r == n - 1 else a + b) * gradient(r)).sum().backward()
        expect(hvd.MismatchError,
               ["'gradients at step()' differs", f"rank {n - 1}: \"a member's"], opt.step)
        opt.zero_grad()
        ((a + b) * gradient(r)).sum().backward()
        opt.step()
        check_equal(-a.detach(), averaged_with(1.0), "after the mismatch, every gradient there")


def case_synchronize_again_reduces_again():
    """Horovod's synchronize() reduces every gradient again when called a second time, and so
    does step() after synchronize() outside skip_synchronize() (with Horovod's warning): with
    op=Sum the gradients grow by the set's size each time."""
    model, opt = linear_and_optimizer(op=hvd.Sum)
    backward(model)
    total = n * (n + 1) / 2
    opt.synchronize()
    check_equal(model.weight.grad, torch.full((2, 3), total), "after synchronize()")
    opt.synchronize()
    check_equal(model.weight.grad, torch.full((2, 3), n * total), "synchronize() again")
    check_equal(model.bias.grad, torch.full((2,), float(n * n)), "the bias, again")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught
    check_equal(model.weight.grad, torch.full((2, 3), n * n * total), "step() after them")


def case_synchronize_again_on_one_rank_only_skips_the_step_everywhere():
    """Rank 0 alone reduces its gradients again while the others go on to the next step: the
    reductions would pair with the others' next step (on Horovod, silently); the step's
    agreement tells every rank, which raises UsageError naming rank 0; then the job goes on."""
    model, opt = linear_and_optimizer()
    backward(model)
    opt.synchronize()
    if r == 0:
        expect(hvd.UsageError, ["skipped on every rank because ranks [0]",
                                "synchronize() reduced them again"], opt.synchronize)
    else:
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        backward(model)
        expect(hvd.UsageError, "skipped on every rank because ranks [0]", opt.step)
    opt.zero_grad()
    backward(model)
    opt.step()
    check_equal(model.weight.grad, torch.full((2, 3), (n + 1) / 2), "the step after")


def case_step_returns_what_the_wrapped_step_returns():
    class Reporting(torch.optim.SGD):
        def step(self, closure=None):
            loss = super().step(closure)
            return {"loss": loss}

    model = nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(Reporting(model.parameters(), lr=0.1),
                                   model.named_parameters())
    backward(model)
    assert opt.step() == {"loss": None}
    opt.zero_grad()
    plain = nn.Linear(3, 2)
    sgd = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                   plain.named_parameters())

    def closure():
        sgd.zero_grad()
        loss = plain(torch.ones(1, 3)).sum()
        loss.backward()
        return loss

    loss = sgd.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None, loss


def case_zero_grad_between_accumulated_passes_raises():
    """Horovod's zero_grad() raises once a backward pass has counted towards
    backward_passes_per_step, before any gradient is sent (its hooks keep a placeholder)."""
    model, opt = linear_and_optimizer(backward_passes_per_step=2)
    backward(model)
    expect(AssertionError, "before optimizer.step()", opt.zero_grad)
    backward(model)
    opt.step()
    check_equal(model.weight.grad, torch.full((2, 3), float(n + 1)), "two passes, averaged")
    opt.zero_grad()


def case_load_state_dict_starts_the_passes_again():
    """As Horovod's: the passes counted before load_state_dict() start again, and the
    gradients accumulated so far stay."""
    model, opt = linear_and_optimizer(backward_passes_per_step=2)
    backward(model)
    opt.load_state_dict(opt.state_dict())
    backward(model, 2.0)
    backward(model, 2.0)          # the second pass since: reduced now
    opt.step()
    check_equal(model.weight.grad, torch.full((2, 3), 5 * (n + 1) / 2),
                "three passes' gradients, averaged")


def case_step_in_skip_synchronize_without_backward_steps_locally():
    """Horovod's step() inside skip_synchronize() with no backward pass since the last step
    steps with the gradients as they are (here set by hand, different per rank)."""
    model = nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float(r))
    with opt.skip_synchronize():
        opt.step()
    for p, b in zip(model.parameters(), before):
        check_equal(p.detach(), b - r, "stepped with the local gradient")


def case_create_graph_is_refused():
    """Horovod's hook asserts that a gradient does not require grad; ours says why, and the
    job goes on after zero_grad(). On the last rank alone, the others' step is skipped too
    (UsageError naming that rank), rather than reduced with a broken one."""
    model, opt = linear_and_optimizer()
    expect(AssertionError, "create_graph",
           lambda: (model(torch.ones(1, 3)) ** 2).sum().backward(create_graph=True))
    opt.zero_grad()
    backward(model)
    opt.step()
    check_equal(model.weight.grad, torch.full((2, 3), (n + 1) / 2), "the step after")
    opt.zero_grad()
    if r == n - 1:
        expect(AssertionError, "create_graph",
               lambda: (model(torch.ones(1, 3)) ** 2).sum().backward(create_graph=True))
        opt.zero_grad()         # (its step met the others' as it raised: they skip it)
    else:
        backward(model)
        expect(hvd.UsageError, f"skipped on every rank because ranks [{n - 1}]", opt.step)
        opt.zero_grad()
    backward(model)
    opt.step()
    check_equal(model.weight.grad, torch.full((2, 3), (n + 1) / 2), "the step after one rank's")


class Halving(hvd.Compression.none):
    """A compressor of one's own, as a subclass of Horovod's none (both methods overridden)."""
    calls = 0

    @staticmethod
    def compress(tensor):
        Halving.calls += 1
        return tensor * 0.5, "halved"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "halved", ctx
        return tensor * 4


class InDouble:
    """A compressor of one's own by Horovod's interface alone (no base class)."""

    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float64), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def case_a_compressor_of_ones_own_is_called_as_horovod_calls_it():
    for compression in (Halving, InDouble):
        torch.manual_seed(5)
        model, opt = linear_and_optimizer(compression=compression)
        backward(model, 0.7)
        local = [p.grad.clone() for p in model.parameters()]
        opt.step()
        for p, g in zip(model.parameters(), local):
            wire, ctx = compression.compress(g)
            want = compression.decompress(hvd.allreduce(wire, op=hvd.Average), ctx)
            check_equal(p.grad, want, f"{compression.__name__}: a reduced gradient")
        opt.zero_grad()
    assert Halving.calls >= 4, Halving.calls
    # the collectives: compress, reduce, decompress; under autograd all three differentiated
    x = torch.full((n, 2), float(r + 1), requires_grad=True)
    for collective in (hvd.allreduce, hvd.reducescatter):
        for grad in (False, True):
            x.grad = None
            with torch.set_grad_enabled(grad):
                y = collective(x, compression=Halving, op=hvd.Sum)
            check_equal(y.detach(), torch.full_like(y, float(n * (n + 1))),
                        f"{collective.__name__} with Halving")
            if grad:
                y.sum().backward()
                check_equal(x.grad, torch.full_like(x, 2.0 * n), f"{collective.__name__}'s grad")


def case_optimizer_arguments_as_horovods():
    model = nn.Linear(3, 2)
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    D = hvd.DistributedOptimizer
    expect(ValueError, "once in groups", lambda: D(sgd(), groups=[[model.weight, model.weight]]))
    expect(ValueError, "once in groups", lambda: D(sgd(), groups=[[model.weight],
                                                                 [model.weight]]))
    expect(ValueError, "torch.Tensor", lambda: D(sgd(), groups=[[1.0]]))
    expect(ValueError, "gradient_predivide_factor",
           lambda: D(sgd(), op=None, gradient_predivide_factor=2.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        D(sgd(), num_groups=2).release()
    assert any(w.category is DeprecationWarning for w in caught), caught
    model, opt = linear_and_optimizer(backward_passes_per_step=2.0)
    backward(model)
    backward(model)
    opt.step()
    check_equal(model.weight.grad, torch.full((2, 3), float(n + 1)), "passes given as 2.0")
    first = hvd.add_process_set([0])
    try:        # on every rank, in the set or not, as Horovod's
        expect(NotImplementedError, "non-global process sets",
               lambda: D(sgd(), op=hvd.Adasum, process_set=first))
    finally:
        hvd.remove_process_set(first)
    half = nn.Linear(3, 2).to(torch.bfloat16)     # Horovod's fp16 casts bfloat16 too
    opt = D(torch.optim.SGD(half.parameters(), lr=0.1), half.named_parameters(),
            compression=hvd.Compression.fp16, fusion_threshold=1 << 20)
    assert {b.buffer.dtype for b in opt._buckets} == {torch.float16}, opt._buckets
    opt.release()


CASES = [value for key, value in list(globals().items()) if key.startswith("case_")]
mine, failed = [], set()
for case in CASES:
    try:
        case()
        note = None
    except Exception:
        note = f"{case.__name__} failed on rank {r}:\n{traceback.format_exc()}"
    # Compare notes. Should a rank still be in the case's collectives and the two fail the
    # signature check, the case ends there with MismatchError and the next attempt pairs.
    notes = [note or f"{case.__name__}: the ranks did not line up after it on rank {r}"]
    for attempt in range(2 * n):
        try:
            notes = hvd.allgather_object(note, name=f"after {case.__name__}")
            break
        except hvd.MismatchError:
            pass
    if note is not None:
        mine.append(note)
    failed.update(case.__name__ for text in notes if text is not None)
if failed:
    print(f"rank {r}: {len(mine)} failure(s) here; failed on some rank: {sorted(failed)}\n"
          + "\n".join(mine), flush=True)
    sys.exit(1)
hvd.shutdown()
print(f"OK rank {r}", flush=True)
