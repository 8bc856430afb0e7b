"""Horovod parity at any rank count: grouped allgather and reducescatter, scale factors,
sparse allreduce and sparse gradients in DistributedOptimizer, Adasum (allreduce and the
optimizer, against NumPy references of Horovod's formula), the build queries, state broadcast
for every torch.optim optimizer, the optimizer's Horovod behaviours, and the gradient of every
differentiable collective (autograd_check.py's, in this launch).
"""
import copy
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ringreduce as hvd
from autograd_check import check_gradients
from checks import check_equal, expect, run_cases, then_barrier
from models import Embedder

hvd.init()
r, n = hvd.rank(), hvd.size()
power_of_two = n & (n - 1) == 0


def check_grouped_allgather_and_reducescatter():
    a = torch.full((r + 1, 2), float(r))
    b = torch.arange(3, dtype=torch.int32) + 10 * r
    got = hvd.grouped_allgather([a, b])
    check_equal(got[0], torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]), "ga[0]")
    check_equal(got[1], torch.cat([torch.arange(3, dtype=torch.int32) + 10 * k
                                   for k in range(n)]), "ga[1]")
    handle = hvd.grouped_allgather_async([b])
    check_equal(hvd.synchronize(handle)[0], got[1], "grouped_allgather_async")
    rows = 2 * n + 1
    base, extra = divmod(rows, n)
    counts = [base + (k < extra) for k in range(n)]
    start = sum(counts[:r])
    x = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * (r + 1)
    y = torch.ones(rows, dtype=torch.int64) * (r + 1)
    total = n * (n + 1) // 2
    got = hvd.grouped_reducescatter([x, y], op=hvd.Sum, prescale_factor=0.5,
                                    postscale_factor=4.0)
    want = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * total * 2.0
    check_equal(got[0], want[start:start + counts[r]], "grouped_reducescatter[0]")
    # integers: each rank's (k + 1) * 0.5 truncated, summed, times 4
    ints = sum(int((k + 1) * 0.5) for k in range(n)) * 4
    check_equal(got[1], torch.full((counts[r],), ints, dtype=torch.int64),
                "grouped_reducescatter[1]")
    handle = hvd.grouped_reducescatter_async([x], op=hvd.Average)
    check_equal(hvd.synchronize(handle)[0],
                (torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * total / n)[
                    start:start + counts[r]], "grouped_reducescatter_async")
    got = hvd.reducescatter(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.25)
    check_equal(got, (torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * total *
                      0.5 / n)[start:start + counts[r]], "reducescatter scaled")
    expect(hvd.UnsupportedError, "Adasum", hvd.reducescatter, x, op=hvd.Adasum)


def check_grouped_results_are_horovods_containers():
    """Horovod's grouped handles and in-place and allgather calls give tuples (its
    synchronize() returns the handle's tuple of outputs, and autograd's apply a tuple); its
    grouped_allreduce and grouped_reducescatter lists."""
    x, y = torch.ones(2 * n), torch.ones(n, 3)
    calls = {
        "grouped_allreduce": (list, lambda: hvd.grouped_allreduce([x, y])),
        "grouped_allreduce_": (tuple, lambda: hvd.grouped_allreduce_([x.clone(), y.clone()])),
        "grouped_allreduce_async": (tuple, lambda: hvd.synchronize(
            hvd.grouped_allreduce_async([x, y]))),
        "grouped_allreduce_async_": (tuple, lambda: hvd.synchronize(
            hvd.grouped_allreduce_async_([x.clone(), y.clone()]))),
        "grouped_allgather": (tuple, lambda: hvd.grouped_allgather([x, y])),
        "grouped_allgather, needing a gradient": (tuple, lambda: hvd.grouped_allgather(
            [x.clone().requires_grad_(), y])),
        "grouped_allgather_async": (tuple, lambda: hvd.synchronize(
            hvd.grouped_allgather_async([x, y]))),
        "grouped_reducescatter": (list, lambda: hvd.grouped_reducescatter([x, y])),
        "grouped_reducescatter_async": (tuple, lambda: hvd.synchronize(
            hvd.grouped_reducescatter_async([x, y]))),
    }
    for what, (container, call) in calls.items():
        got = call()
        assert type(got) is container and len(got) == 2, f"{what}: {type(got).__name__}"


def check_sparse_allreduce():
    # rank k contributes value k + 1 at rows k and k + 1 of a (n + 1) x 2 matrix
    indices = torch.tensor([[r, r + 1], [0, 1]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([r + 1.0, r + 1.0]), (n + 1, 2))
    for op in (hvd.Sum, hvd.Average):
        got = hvd.sparse_allreduce_async(sparse, f"sparse.{op.name}", op)()   # Horovod's call
        dense = sum(torch.sparse_coo_tensor(torch.tensor([[k, k + 1], [0, 1]]),
                                            torch.tensor([k + 1.0, k + 1.0]), (n + 1, 2)
                                            ).to_dense() for k in range(n))
        want = dense / n if op == hvd.Average else dense
        assert got.is_sparse, "sparse_allreduce_async returned a dense tensor"
        assert torch.allclose(got.to_dense(), want), f"sparse {op.name}: {got.to_dense()}"
    if n > 1:   # the last rank alone summing where the others average
        expect(hvd.MismatchError, "'op' differs", hvd.sparse_allreduce_async(
            sparse, "sparse.ops", hvd.Sum if r == n - 1 else hvd.Average))


def check_sparse_gradients_in_the_optimizer():
    """SparseAdam on sparse gradients (allgathered as Horovod does), also with
    gradient_as_bucket_view (whose plan has an empty bucket then), and with sparse_as_dense
    (reduced densely, handed back sparse, as Horovod does), each against one process on the
    whole batch."""
    def make(m):
        return [torch.optim.SparseAdam(list(m.embedding.parameters()), lr=0.05),
                torch.optim.Adam(m.head.parameters(), lr=0.05)]

    for sparse_as_dense, views in ((False, False), (False, True), (True, False)):
        torch.manual_seed(3)
        model = Embedder()
        reference = copy.deepcopy(model)
        opts = [hvd.DistributedOptimizer(o, [(name, p) for name, p in model.named_parameters()
                                             if any(p is q for g in o.param_groups
                                                    for q in g["params"])],
                                         sparse_as_dense=sparse_as_dense,
                                         gradient_as_bucket_view=views) for o in make(model)]
        ref_opts = make(reference)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 20, (4 * n, 5), generator=g)
            labels = torch.randint(0, 3, (4 * n,), generator=g)
            for o in opts:
                o.zero_grad()
            F.cross_entropy(model(tokens[4 * r:4 * r + 4]), labels[4 * r:4 * r + 4]).backward()
            for o in opts:
                o.step()
            assert model.embedding.weight.grad.is_sparse   # sparse again after the reduction
            for o in ref_opts:
                o.zero_grad()
            F.cross_entropy(reference(tokens), labels).backward()
            if sparse_as_dense and n > 1:   # Horovod's dense reduction made sparse again
                reference.embedding.weight.grad = \
                    reference.embedding.weight.grad.to_dense().to_sparse()
            for o in ref_opts:
                o.step()
            what = f"sparse_as_dense={sparse_as_dense}, views={views}, step {step}"
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), \
                    f"{what}: {name} off by {(p - q).abs().max().item()}"
        hvd.check_consistency(model)
    if n > 1:   # sparse_as_dense on the last rank alone: the wrapping's plan check says so
        model = Embedder()
        expect(hvd.MismatchError, ["'sparse_as_dense' differs", f"rank {n - 1}: True"],
               hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
               model.named_parameters(), sparse_as_dense=r == n - 1)
        # a dense embedding on the last rank alone: gathered sparse on the others, reduced in
        # its bucket there; the step's agreement tells every rank, so every rank gets a
        # MismatchError naming both instead of a gather waiting for ranks that never submit it
        torch.manual_seed(3)
        model = Embedder(sparse=r != n - 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters())
        before = [p.detach().clone() for p in model.parameters()]
        F.cross_entropy(model(torch.randint(0, 20, (4, 5))), torch.zeros(4, dtype=torch.long)
                        ).backward()
        expect(hvd.MismatchError, ["'embedding.weight' is sparse on ranks "
                                   f"{list(range(n - 1))} and dense on ranks [{n - 1}]"],
               opt.step)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def adasum_combine(a, b):
    """Horovod's pairwise Adasum in float64 (weight 1 below a squared norm of sqrt(DBL_MIN),
    adasum.h)."""
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    wa = 1 - dot / aa / 2 if aa >= tiny else 1.0
    wb = 1 - dot / bb / 2 if bb >= tiny else 1.0
    return wa * a + wb * b


def adasum_tree(vectors):
    while len(vectors) > 1:
        vectors = [adasum_combine(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def check_adasum():
    if not power_of_two:
        expect(NotImplementedError, "power-of-two", hvd.allreduce, torch.ones(4), op=hvd.Adasum)
        expect(NotImplementedError, "power-of-two", hvd.DistributedOptimizer,
               torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), op=hvd.Adasum)
        return
    vecs = [np.random.default_rng(k).standard_normal(1000) for k in range(n)]
    got = hvd.allreduce(torch.from_numpy(vecs[r]), op=hvd.Adasum)
    assert np.allclose(got.numpy(), adasum_tree(vecs), rtol=1e-12, atol=1e-12), "Adasum"
    # grouped: each tensor weighed on its own
    other = [np.random.default_rng(100 + k).standard_normal(7) for k in range(n)]
    a, b = hvd.grouped_allreduce([torch.from_numpy(vecs[r]), torch.from_numpy(other[r])],
                                 op=hvd.Adasum)
    assert np.allclose(a.numpy(), adasum_tree(vecs)) and np.allclose(b.numpy(),
                                                                      adasum_tree(other))
    # the optimizer: every rank steps its own optimizer; the deltas are combined. At lr 1e-5
    # the deltas' squared norms are ~1e-9: they still weigh (Horovod's threshold is DBL_MIN's
    # square root), so equal deltas average rather than add
    for lr in (0.1, 1e-5):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        start = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5),
                                       model.named_parameters(), op=hvd.Adasum)
        local_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.5)
                      for m in [copy.deepcopy(start) for _ in range(n)]]
        locals_ = [o.param_groups[0]["params"] for o in local_opts]
        for step in range(2):
            data = [torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * k + step),
                                dtype=torch.float64) for k in range(n)]
            opt.zero_grad()
            model(data[r]).pow(2).sum().backward()
            opt.step()
            deltas = []
            for k, (o, params) in enumerate(zip(local_opts, locals_)):
                before = [p.detach().clone() for p in params]
                o.zero_grad()
                out = data[k]
                out = torch.tanh(out @ params[0].T + params[1]) @ params[2].T + params[3]
                out.pow(2).sum().backward()
                o.step()
                deltas.append([p.detach() - b for p, b in zip(params, before)])
                for p, b in zip(params, before):
                    p.data.copy_(b)
            for i in range(4):
                combined = adasum_tree([d[i].reshape(-1).numpy() for d in deltas])
                for params in locals_:
                    params[i].data += torch.from_numpy(combined).reshape(params[i].shape)
            for i, p in enumerate(model.parameters()):
                assert torch.allclose(p, locals_[0][i], rtol=1e-10, atol=1e-12), \
                    f"Adasum optimizer, lr {lr}, step {step}: parameter {i} off by " \
                    f"{(p - locals_[0][i]).abs().max().item()}"
    hvd.check_consistency(model)
    if n > 1:
        expect(AssertionError, "Adasum", lambda: opt.skip_synchronize().__enter__())
    # Horovod's Adasum optimizer gives every trainable parameter a zero gradient as it wraps
    # (one rank alone gets the plain optimizer): an unused one steps by its weight decay
    used, unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([used, unused], lr=1.0, weight_decay=0.5),
                                   [("used", used), ("unused", unused)], op=hvd.Adasum)
    assert (unused.grad is not None) == (n > 1), unused.grad
    (used * (r + 1)).sum().backward()
    opt.step()
    assert torch.equal(unused.detach(), torch.full((2,), 0.5 if n > 1 else 1.0)), unused
    # A compressor of one's own compresses each delta, as Horovod's Adasum optimizer calls it:
    # here float16 as Compression.fp16 sends it, so the two train alike, bitwise
    given = []

    class Half(hvd.compression.Compressor):
        @staticmethod
        def compress(tensor):
            given.append(tensor.clone())
            return tensor.half(), tensor.dtype

        @staticmethod
        def decompress(tensor, dtype):
            return tensor.to(dtype)

    trained = []
    for compression in (Half, hvd.Compression.fp16):
        torch.manual_seed(6)
        model = nn.Linear(3, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), op=hvd.Adasum,
                                       compression=compression)
        for step in range(2):
            opt.zero_grad()
            model(torch.full((2, 3), float(r + step + 1))).pow(2).sum().backward()
            if compression is Half and step == 0:
                deltas = [-0.1 * p.grad for p in model.parameters()]
            opt.step()
        trained.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained)), "custom compressor vs fp16"
    if n > 1:       # (alone, the plain optimizer: nothing is compressed)
        first = {tuple(g.shape): g for g in given[:2]}
        assert len(given) == 4 and all(torch.allclose(first[tuple(d.shape)], d)
                                       for d in deltas), "the compressor is given the deltas"
    # A sparse gradient (an Embedding(sparse=True), grads None after zero_grad) stays sparse
    # for the local step, as in Horovod's Adasum optimizer, which is not given sparse_as_dense
    # (SGD adds a repeated row's entries one at a time, which rounds otherwise than densified;
    # SparseAdam takes sparse gradients alone), with or without sparse_as_dense
    def batch(k):
        rows = torch.tensor([1, 1, 2]) if k % 2 == 0 else torch.tensor([2, 3, 3])
        tiny = 2.0 ** -25
        return rows, (torch.tensor([tiny, tiny, 3.0]) if k % 2 == 0
                      else torch.tensor([1.0, tiny, tiny])) * (k + 1)

    def local_delta(k):
        emb = nn.Embedding(4, 1, sparse=True)
        nn.init.ones_(emb.weight)
        rows, scale = batch(k)
        (emb(rows).squeeze(1) * scale).sum().backward()
        torch.optim.SGD(emb.parameters(), lr=1.0).step()
        return (emb.weight.detach() - 1.0).reshape(-1).double().numpy()

    for sparse_as_dense in (False, True):
        for make in (lambda ps: torch.optim.SGD(ps, lr=1.0),
                     lambda ps: torch.optim.SparseAdam(ps, lr=0.5)):
            emb = nn.Embedding(4, 1, sparse=True)
            nn.init.ones_(emb.weight)
            opt = hvd.DistributedOptimizer(make(list(emb.parameters())),
                                           emb.named_parameters(), op=hvd.Adasum,
                                           sparse_as_dense=sparse_as_dense)
            opt.zero_grad()
            rows, scale = batch(r)
            (emb(rows).squeeze(1) * scale).sum().backward()
            opt.step()
            hvd.check_consistency(emb)
            if isinstance(opt, torch.optim.SGD):    # (bitwise at 2: one combination)
                want = 1.0 + adasum_tree([local_delta(k) for k in range(n)]).astype(np.float32)
                got = emb.weight.detach().reshape(-1).numpy()
                assert (np.array_equal(got, want) if n <= 2 else np.allclose(got, want)), \
                    f"Adasum, sparse gradient stepped locally: {got} {want}"


def check_build_queries():
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not hvd.gloo_built() and not hvd.gloo_enabled() and hvd.nccl_built() == 0
    assert not hvd.ddl_built() and not hvd.ccl_built() and not hvd.rocm_built()
    import importlib.util
    assert hvd.cuda_built() == (torch.version.cuda is not None
                                and importlib.util.find_spec("cupy") is not None)
    assert hvd.is_homogeneous()
    assert hvd.gpu_available("torch") == torch.cuda.is_available()
    assert hvd.split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]


OPTIMIZERS = {
    "SGD": lambda ps, k: torch.optim.SGD(ps, lr=0.1 * k, momentum=0.9, nesterov=True),
    "Adam": lambda ps, k: torch.optim.Adam(ps, lr=0.01 * k, betas=(0.8, 0.9), amsgrad=True),
    "AdamW": lambda ps, k: torch.optim.AdamW(ps, lr=0.01 * k, weight_decay=0.1 * k),
    "Adamax": lambda ps, k: torch.optim.Adamax(ps, lr=0.01 * k),
    "ASGD": lambda ps, k: torch.optim.ASGD(ps, lr=0.01 * k, t0=k),
    "Adadelta": lambda ps, k: torch.optim.Adadelta(ps, lr=k),
    "Adagrad": lambda ps, k: torch.optim.Adagrad(ps, lr=0.01 * k, lr_decay=0.1),
    "RMSprop": lambda ps, k: torch.optim.RMSprop(ps, lr=0.01 * k, centered=True),
    "Rprop": lambda ps, k: torch.optim.Rprop(ps, lr=0.01 * k, step_sizes=(1e-6, k)),
    "NAdam": lambda ps, k: torch.optim.NAdam(ps, lr=0.01 * k, decoupled_weight_decay=True),
    "RAdam": lambda ps, k: torch.optim.RAdam(ps, lr=0.01 * k),
    "LBFGS": lambda ps, k: torch.optim.LBFGS(ps, lr=0.1 * k, history_size=3 + k),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["Adafactor"] = lambda ps, k: torch.optim.Adafactor(ps, lr=0.01 * k)


def check_broadcast_optimizer_state():
    """Every torch.optim optimizer, with options that are not tensors, a frozen parameter that
    never gets a gradient and one that is unused: the root's state and options everywhere.
    LBFGS is refused, as in Horovod."""
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 2))
        model[0].weight.requires_grad_(False)      # frozen: never a gradient
        opt = make(model.parameters(), r + 1)
        if name == "LBFGS":
            expect(ValueError, "LBFGS", hvd.broadcast_optimizer_state, opt, root_rank=0)
            continue
        # A different history on every rank, with state everywhere (an empty state would be
        # made by a step with zero gradients on that rank alone, as in Horovod)
        for step in range(r + 1):
            def closure():
                opt.zero_grad()
                loss = model[1](model[0](torch.randn(2, 3))).sum()   # model[2] unused
                loss.backward()
                return loss
            opt.step(closure)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        mine = opt.state_dict()
        everyone = hvd.allgather_object(mine)
        for k, theirs in enumerate(everyone):
            assert _same(mine, theirs), f"{name}: rank {k}'s state differs from rank {r}'s"
        assert opt.param_groups[0]["lr"] == OPTIMIZERS[name](model.parameters(), 1
                                                             ).param_groups[0]["lr"], name


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def check_optimizer_behaviours():
    # named_parameters=None works for any model
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Sequential(nn.Linear(2, 1))})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model["b"](model["a"](torch.ones(1, 2))).sum().backward()
    opt.step()
    # step() after synchronize() without skip_synchronize(): Horovod's warning, no second
    # reduction (the gradient stays the average, not averaged twice)
    opt.zero_grad()
    model["b"](model["a"](torch.full((1, 2), float(r + 1)))).sum().backward()
    opt.synchronize()
    averaged = model["a"].weight.grad.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    texts = [str(w.message) for w in caught]
    assert any(t.startswith("optimizer.step() called without optimizer.skip_synchronize() "
                            "context after optimizer.synchronize()") for t in texts), texts
    check_equal(model["a"].weight.grad, averaged, "no second reduction")
    expect(ValueError, "DistributedOptimizer already", hvd.DistributedOptimizer, opt)
    # Horovod makes the wrapped optimizer with its class's __init__ over the param_groups
    # alone: its defaults are the class's, so a group added without an lr gets SGD's 1e-3
    opt = hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.5,
                                                   momentum=0.9))
    assert opt.defaults == torch.optim.SGD([torch.zeros(1, requires_grad=True)]).defaults
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["momentum"] == 0.9
    opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1]["momentum"] == 0

    class Scaled(torch.optim.SGD):      # (no class default for `scale`: Horovod cannot wrap it)
        def __init__(self, params, scale, **options):
            super().__init__(params, **options)

    opt = hvd.DistributedOptimizer(Scaled(nn.Linear(2, 1).parameters(), 2.0, lr=0.5))
    assert opt.defaults["lr"] == 0.5, opt.defaults

    # What the class's __init__ makes from its arguments is made anew from the groups alone,
    # with the arguments' defaults, and hooks registered on the plain optimizer stay there:
    # Horovod's wrapper steps with scale 1 (w = -lr * 1, not -lr * 10) and runs no such hook
    class Scaling(torch.optim.SGD):
        def __init__(self, params, lr=1e-3, scale=1.0):
            super().__init__(params, lr=lr)
            self.scale = scale

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(self.scale)
            return super().step(closure)

    w = nn.Parameter(torch.zeros(1))
    plain = Scaling([w], lr=0.5, scale=10.0)
    hooked = []
    plain.register_step_post_hook(lambda *_: hooked.append(1))
    opt = hvd.DistributedOptimizer(plain)
    (w * (r + 1)).sum().backward()
    opt.step()
    assert opt.scale == 1.0 and not hooked, (opt.scale, hooked)
    check_equal(w.detach(), torch.tensor([-0.5 * (n + 1) / 2]), "stepped with scale 1")
    # Adagrad's __init__ makes its state, from its argument initial_accumulator_value: the
    # wrapper's sums start at the class's 0, not the given 0.5 (and a warning says so); with
    # the default, the state is the same and nothing is said
    for given, warned in ((0.0, False), (0.5, True)):
        w = nn.Parameter(torch.ones(2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = hvd.DistributedOptimizer(torch.optim.Adagrad(
                [w], lr=0.5, initial_accumulator_value=given))
        said = [str(c.message) for c in caught if "state its class makes" in str(c.message)]
        assert bool(said) == warned, (given, said)
        assert torch.equal(opt.state[w]["sum"], torch.zeros(2)), opt.state[w]


def check_schedulers_closures_early_steps_and_release():
    x = torch.full((1, 3), float(r + 1))
    mean = (n + 1) / 2                     # the averaged gradient of sum(W x): exact
    model = nn.Linear(3, 1, bias=False)
    plain = torch.optim.SGD(model.parameters(), lr=1.0)
    # A scheduler made before wrapping patched plain.step(); the wrapper must not copy that
    # (it would step unreduced), and the scheduler must see the wrapper's steps.
    scheduler = torch.optim.lr_scheduler.StepLR(plain, 1, gamma=0.5)
    opt = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    start = model.weight.detach().clone()
    model(x).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        scheduler.step()
    texts = [str(w.message) for w in caught]
    assert not any("lr_scheduler" in t for t in texts), texts
    check_equal(model.weight.detach(), start - mean, "stepped with the averaged gradient")
    assert opt.param_groups[0]["lr"] == 0.5
    # load_state_dict (broadcast_optimizer_state, a resume) gives the wrapper new groups and
    # state: the plain optimizer the scheduler steps must keep stepping with them
    opt.load_state_dict(opt.state_dict())
    assert plain.param_groups is opt.param_groups and plain.state is opt.state
    # So with ReduceLROnPlateau made before wrapping, which sets the plain optimizer's groups'
    # learning rates and patches no step (a resume's load_state_dict left it setting dicts
    # nothing read); a group added to the plain one alone stays its own (as on Horovod)
    weights = nn.Linear(3, 1), nn.Linear(3, 1)
    plain = torch.optim.SGD(weights[0].parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(plain, patience=0, factor=0.5)
    wrapped = hvd.DistributedOptimizer(plain, named_parameters=weights[0].named_parameters())
    plain.add_param_group({"params": list(weights[1].parameters()), "lr": 1.0})
    plateau.step(1.0)
    wrapped.load_state_dict(wrapped.state_dict())
    plateau.step(2.0)                   # worse: every group's lr halved
    assert [g["lr"] for g in wrapped.param_groups] == [0.5], wrapped.param_groups
    assert [g["lr"] for g in plain.param_groups] == [0.5, 0.5], plain.param_groups
    # step(closure): the closure's backward is what gets reduced
    opt.zero_grad()
    before = model.weight.detach().clone()

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        want = model(x).sum()
    loss = opt.step(closure)
    assert torch.equal(loss.detach(), want), (loss, want)
    check_equal(model.weight.detach(), before - 0.5 * mean, "step(closure)")
    # An early step (fewer backward passes than backward_passes_per_step, as at the end of an
    # epoch with accumulation) reduces the gradients there are.
    early = nn.Linear(3, 1, bias=False)
    early_opt = hvd.DistributedOptimizer(torch.optim.SGD(early.parameters(), lr=0.0),
                                         named_parameters=early.named_parameters(),
                                         backward_passes_per_step=2)
    early(x).sum().backward()
    early_opt.step()
    check_equal(early.weight.grad, torch.full((1, 3), mean), "early step's gradient")
    # release(): no more hooks, so later backward passes stay local; stepping is refused
    early_opt.release()
    early_opt.zero_grad()
    early(x).sum().backward()
    check_equal(early.weight.grad, x, "gradient after release()")
    expect(hvd.UsageError, "released", early_opt.step)
    # SyncBatchNorm.convert_sync_batchnorm shares the tensors and reverts to the same class
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    weight = net[1].weight
    synced = hvd.SyncBatchNorm.convert_sync_batchnorm(net)
    assert type(synced[1]) is hvd.SyncBatchNorm and synced[1].weight is weight
    reverted = hvd.SyncBatchNorm.revert_sync_batchnorm(synced)
    assert type(reverted[1]) is nn.BatchNorm1d and reverted[1].weight is weight


run_cases([then_barrier(check) for check in (
    check_grouped_allgather_and_reducescatter, check_grouped_results_are_horovods_containers,
    check_sparse_allreduce,
    check_sparse_gradients_in_the_optimizer, check_adasum, check_build_queries,
    check_broadcast_optimizer_state, check_optimizer_behaviours,
    check_schedulers_closures_early_steps_and_release, check_gradients)], r)
hvd.shutdown()
print(f"OK rank {r}", flush=True)
