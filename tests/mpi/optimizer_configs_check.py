"""DistributedOptimizer in random configurations (seeded: the same on every rank), each against
a simulation of every rank in one process reduced as Horovod reduces.

Usage: optimizer_configs_check.py [configurations] [seed]

A configuration draws from: backward_passes_per_step, fusion threshold and first bucket,
`groups`, op and gradient_predivide_factor, gradient_as_bucket_view, sparse_as_dense,
zero_grad(set_to_none), compression (none, fp16 or bf16), a layer of 1 MiB (a bucket of its
own), a float32 layer and a float16 or bfloat16 one beside the float64 ones, a sparse or dense
embedding and a branch that each rank uses in passes of its own (or in none), the embedding's
weight used densely by every rank in some steps (its gradient then dense), a frozen layer, two
optimizers over one backward, and a process set without the last rank. The simulation runs
each member's passes on a copy of the model and reduces each gradient in its own dtype (zeros
where a member has none; cast to the wire dtype first where compression applies, and back
after; Average scaled as Horovod scales, the predivide factor unused with `groups` (where
Horovod uses it for a group short of gradients, the bits differ, within rounding); a sparse
one gathered, its values / size, unless it came dense). Parameters are bitwise the same on
every member and within rounding of the simulation (its sums run in another order). Each
configuration is a case of its own.
"""
import random
import sys

import torch
import torch.nn as nn

import ringreduce as hvd
from checks import horovod_scaled, run_cases

CONFIGURATIONS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
SEED = int(sys.argv[2]) if len(sys.argv) > 2 else 1
hvd.init()
r, n = hvd.rank(), hvd.size()
plan = random.Random(SEED)
LR = 2.0 ** -8
TOLERANCES = {torch.float16: 1e-2, torch.bfloat16: 1e-2}    # (else 1e-5: see train)
COMPRESSIONS = {None: hvd.Compression.none, torch.float16: hvd.Compression.fp16,
                torch.bfloat16: hvd.Compression.bf16}


class Net(nn.Module):
    """Integer-valued weights and inputs: float64 gradients are exact at the first step. (No
    ReLU: a pre-activation of exactly 0, frequent here, would turn a last-bit difference of a
    later step into a different gradient.)"""

    def __init__(self, c):
        super().__init__()
        wide = 8192 if c["big"] else 32        # b's weight: 1 MiB of float64 when big
        self.a = nn.Linear(8, 16, dtype=torch.float64)
        self.b = nn.Linear(16, wide, dtype=torch.float64)
        self.c = nn.Linear(wide, 2, dtype=torch.float32)
        self.branch = nn.Linear(8, 2, dtype=torch.float64)
        self.emb = nn.Embedding(10, 2, sparse=c["sparse"], dtype=torch.float64)
        self.frozen = nn.Linear(8, 2, dtype=torch.float64).requires_grad_(False)
        self.low = nn.Linear(8, 2, dtype=c["low"]) if c["low"] else None
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g).to(p.dtype))

    def forward(self, x, idx, branch, embedding):
        out = self.c(self.b(self.a(x)).float()).double() + self.frozen(x)
        if branch:
            out = out + self.branch(x)
        if embedding:
            out = out + self.emb(idx)
        if self.low is not None:
            out = out + self.low(x.to(self.low.weight.dtype)).double()
        return out


def draw():
    """The next configuration of the plan."""
    c = dict(big=plan.random() < 0.3, sparse=plan.random() < 0.4,
             low=plan.choice([None, None, torch.float16, torch.bfloat16]),
             passes=plan.choice([1, 1, 2, 3]), threshold=plan.choice([64, 4096, 1 << 26]),
             first=plan.choice([None, 256]), groups=plan.choice([None, None, 1, 2]),
             predivide=plan.choice([1.0, 1.0, 2.0]), op=plan.choice([hvd.Average, hvd.Sum]),
             views=plan.random() < 0.3, sparse_as_dense=plan.random() < 0.3,
             branch=plan.choice([0.0, 0.5, 1.0]), embedding=plan.choice([0.0, 0.5, 1.0]),
             set_to_none=plan.random() < 0.5, steps=plan.choice([1, 2, 3]),
             two=plan.random() < 0.3, subset=n > 2 and plan.random() < 0.3,
             seed=plan.randrange(2**31))
    extra = random.Random(c["seed"])      # (draws added later: the plan's sequence stays)
    c["dense_embedding"] = extra.choice([0.0, 0.5, 0.5])
    # (bucket views take no compression: a ValueError. This model's gradients pass float16's
    # range with the big layer, or after a step, as an untuned model's may on Horovod too:
    # bf16 with the big layer, one step with fp16)
    c["compression"] = extra.choice([None, None, torch.float16, torch.bfloat16])
    if c["views"]:
        c["compression"] = None
    elif c["compression"] == torch.float16 and c["big"]:
        c["compression"] = torch.bfloat16
    elif c["compression"] == torch.float16:
        c["steps"] = 1
    if c["op"] == hvd.Sum:
        c["predivide"] = 1.0        # (a factor with Sum is a ValueError, as in Horovod)
    return c


def uses(c, k, step, p):
    """Whether member k uses the branch and the embedding in pass p of a step: each member
    its own passes (a member may have no embedding gradient where others have one)."""
    draws = random.Random(hash((c["seed"], k, step, p)))
    embedding = draws.random() < c["embedding"]
    return draws.random() < c["branch"], embedding


def dense_embedding(c, step):
    """Whether every member uses the embedding's weight densely in the step's first pass."""
    return random.Random(hash((c["seed"], step))).random() < c["dense_embedding"]


def loss(model, c, k, step, p):
    g = torch.Generator().manual_seed(c["seed"] + 1000 * step + 10 * k + p)
    x = torch.randint(-2, 3, (4, 8), generator=g).double()
    idx = torch.randint(0, 10, (4,), generator=g)
    out = model(x, idx, *uses(c, k, step, p)).sum()
    if p == 0 and dense_embedding(c, step):
        out = out + model.emb.weight.sum()
    return out * int(torch.randint(1, 4, (1,), generator=g))


def wrap(model, c, process_set):
    """The DistributedOptimizer(s) of the configuration: one, or two over one backward."""
    options = dict(backward_passes_per_step=c["passes"], op=c["op"],
                   gradient_predivide_factor=c["predivide"], fusion_threshold=c["threshold"],
                   sparse_as_dense=c["sparse_as_dense"], gradient_as_bucket_view=c["views"],
                   compression=COMPRESSIONS[c["compression"]], process_set=process_set)
    if c["first"]:
        options["first_bucket_bytes"] = c["first"]
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    parts = ([named] if not c["two"] else
             [[(nm, p) for nm, p in named if nm[0] in "ab"],
              [(nm, p) for nm, p in named if nm[0] not in "ab"]])
    return [hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in part], lr=LR), part,
                                     groups=c["groups"], **options) for part in parts]


def simulated_step(reference, c, members, step):
    """Every member's passes on a copy of `reference`, reduced as Horovod reduces, stepped."""
    grads = []
    for k in members:
        copy = Net(c)
        copy.load_state_dict(reference.state_dict())
        for p in range(c["passes"]):
            loss(copy, c, k, step, p).backward()
        grads.append({name: q.grad for name, q in copy.named_parameters()})
    predivide = 1.0 if c["groups"] else c["predivide"]
    gathered = c["sparse"] and not c["sparse_as_dense"] and not dense_embedding(c, step)
    with torch.no_grad():
        for name, q in reference.named_parameters():
            own = [g[name] for g in grads]
            if not q.requires_grad or (gathered and name == "emb.weight"
                                       and all(g is None for g in own)):
                continue
            own = [torch.zeros_like(q) if g is None else g.to_dense() for g in own]
            if not (name == "emb.weight" and gathered):
                own = [sent(g, c["compression"]) for g in own]
            if c["op"] == hvd.Average and not (name == "emb.weight" and gathered):
                own = [horovod_scaled(g, 1.0 / predivide) for g in own]
                total = horovod_scaled(sum(own[1:], own[0]), predivide / len(members))
            elif c["op"] == hvd.Average:        # gathered: each member's values / size
                total = sum(g / len(members) for g in own[1:]) + own[0] / len(members)
            else:
                total = sum(own[1:], own[0])
            q -= LR * total.to(q.dtype)


def sent(g, wire):
    """A gradient as compression sends it: Horovod's fp16 casts every floating dtype to
    float16; our bf16 casts those wider than bfloat16 (float32, float64)."""
    if wire == torch.float16 or (wire == torch.bfloat16 and g.dtype.itemsize > 2):
        return g.to(wire)
    return g


def configuration(i, c):
    def case():
        members = list(range(n - 1)) if c["subset"] else list(range(n))
        process_set = hvd.add_process_set(members) if c["subset"] else hvd.global_process_set
        try:
            if r in members:
                train(c, members, process_set)
        finally:
            if c["subset"]:
                hvd.remove_process_set(process_set)
    case.__name__ = f"configuration {i} {c}"
    return case


def train(c, members, process_set):
    model, reference = Net(c), Net(c)
    optimizers = wrap(model, c, process_set)
    for step in range(c["steps"]):
        for opt in optimizers:
            opt.zero_grad(set_to_none=c["set_to_none"])
        for p in range(c["passes"]):
            loss(model, c, r, step, p).backward()
        for opt in optimizers:
            opt.step()
        simulated_step(reference, c, members, step)
    flat = torch.cat([q.detach().double().reshape(-1) for q in model.parameters()])
    everyone = hvd.allgather_object(flat.numpy().tobytes(), process_set=process_set)
    assert all(b == everyone[0] for b in everyone), "parameters differ across members"
    for (name, q), want in zip(model.named_parameters(), reference.parameters()):
        # within rounding, on the tensor's scale: float32 sums taken in another order (the
        # ring's, the blocks') differ in their last bits, which the float32 layer carries into
        # the float64 ones' gradients
        error = (q.double() - want.double()).abs().max().item()
        scale = max(want.double().abs().max().item(), 1.0)
        tolerance = TOLERANCES.get(c["compression"] or q.dtype, 1e-5)
        assert error <= tolerance * scale, \
            f"{name} off the simulation by {error} (on a scale of {scale})"


run_cases([configuration(i, draw()) for i in range(CONFIGURATIONS)], r)
print(f"OK rank {r}", flush=True)
