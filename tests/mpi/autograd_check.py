"""The gradients of every differentiable collective against a single-process reference.

Rank r holds an input x_r and an upstream gradient u_r (both from seeds, so every rank can
rebuild everyone's). The reference rebuilds the collective in one process with torch ops on all
ranks' inputs, takes the loss sum_r (y_r * u_r).sum() and lets autograd differentiate it: that
is the exact gradient, which allreduce and alltoall match; Horovod's allgather and broadcast
average the incoming gradients instead of summing them, so their reference is divided by the
set's size, and Horovod's reducescatter multiplies them by the set's size for Sum where the
exact gradient would divide by it for Average, so its reference is multiplied by the set's
size. Results are compared to 1e-12 (float64) on every rank, at every rank count.
parity_check.py runs check_gradients() in its launch; this file also runs alone.
"""
import torch
from mpi4py import MPI

import ringreduce as hvd

r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def x_of(k, shape, salt=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * k + salt))


def u_of(k, shape, salt=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * k + salt + 50))


def check(what, got, want):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), \
        f"{what}: got {got.reshape(-1)[:4]} want {want.reshape(-1)[:4]}"


def reference(build, shapes, out_shapes, salt=0):
    """Gradient of sum_r (y_r * u_r) w.r.t. every rank's input, y = build(xs) (one process)."""
    xs = [x_of(k, shapes[k], salt).requires_grad_() for k in range(n)]
    ys = build(xs)
    sum((y * u_of(k, out_shapes[k], salt)).sum() for k, y in enumerate(ys)).backward()
    return [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]


def run(fn, shape, out_shape, salt=0):
    """This rank's gradient through the real collective."""
    x = x_of(r, shape, salt).requires_grad_()
    y = fn(x)
    (y * u_of(r, out_shape, salt)).sum().backward()
    return x.grad


# alltoall: rank k sends (k + j) % 3 rows to rank j
def splits_of(k):
    return [(k + j) % 3 for j in range(n)]


def received(j):
    return sum(splits_of(k)[j] for k in range(n))


def build_alltoall(xs):
    parts = [x.split(splits_of(k)) for k, x in enumerate(xs)]
    return [torch.cat([parts[k][j] for k in range(n)]) for j in range(n)]


def check_gradients():
    """Every differentiable collective's gradient against its reference (float64)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        gradients()
    finally:
        torch.set_default_dtype(default)


def gradients():
    shape = (3, 4)
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 2.0, 0.5)):
        factor = pre * post / (n if op == hvd.Average else 1)

        def build(xs, factor=factor):
            total = sum(xs) * factor
            return [total] * n

        want = reference(build, [shape] * n, [shape] * n, salt=1)[r]
        got = run(lambda x: hvd.allreduce(x, op=op, prescale_factor=pre,
                                          postscale_factor=post), shape, shape, salt=1)
        check(f"allreduce {op.name}", got, want)
        # grouped: two tensors, each with its own reference
        a, b = x_of(r, (2,), 2).requires_grad_(), x_of(r, (5,), 3).requires_grad_()
        ya, yb = hvd.grouped_allreduce([a, b], op=op, prescale_factor=pre,
                                       postscale_factor=post)
        ((ya * u_of(r, (2,), 2)).sum() + (yb * u_of(r, (5,), 3)).sum()).backward()
        check(f"grouped_allreduce {op.name} [0]", a.grad,
              reference(build, [(2,)] * n, [(2,)] * n, 2)[r])
        check(f"grouped_allreduce {op.name} [1]", b.grad,
              reference(build, [(5,)] * n, [(5,)] * n, 3)[r])

    # allgather: rank k sends k + 1 rows; gradients averaged over the set (Horovod's)
    rows = [(k + 1, 2) for k in range(n)]
    total = (sum(k + 1 for k in range(n)), 2)
    want = reference(lambda xs: [torch.cat(xs)] * n, rows, [total] * n, salt=4)[r] / n
    check("allgather", run(lambda x: hvd.allgather(x), rows[r], total, salt=4), want)
    c, d = x_of(r, rows[r], 5).requires_grad_(), x_of(r, (r + 2,), 6).requires_grad_()
    lengths = (sum(k + 2 for k in range(n)),)
    gc, gd = hvd.grouped_allgather([c, d])
    ((gc * u_of(r, total, 5)).sum() + (gd * u_of(r, lengths, 6)).sum()).backward()
    check("grouped_allgather [0]", c.grad,
          reference(lambda xs: [torch.cat(xs)] * n, rows, [total] * n, 5)[r] / n)
    check("grouped_allgather [1]", d.grad,
          reference(lambda xs: [torch.cat(xs)] * n, [(k + 2,) for k in range(n)],
                    [lengths] * n, 6)[r] / n)

    # broadcast: the root's input gets the averaged gradient, the others zeros
    for root in range(n):
        want = reference(lambda xs: [xs[root]] * n, [shape] * n, [shape] * n, salt=7)[r] / n
        got = run(lambda x: hvd.broadcast(x, root), shape, shape, salt=7)
        check(f"broadcast from {root}", got, want)

    # alltoall, with the splits above and with equal ones
    in_shapes = [(sum(splits_of(k)), 3) for k in range(n)]
    out_shapes = [(received(j), 3) for j in range(n)]
    want = reference(build_alltoall, in_shapes, out_shapes, salt=8)[r]
    got = run(lambda x: hvd.alltoall(x, splits=splits_of(r))[0], in_shapes[r], out_shapes[r], 8)
    check("alltoall with splits", got, want)
    even = (2 * n, 3)
    want = reference(lambda xs: [torch.cat([x.chunk(n)[j] for x in xs]) for j in range(n)],
                     [even] * n, [even] * n, salt=9)[r]
    check("alltoall", run(lambda x: hvd.alltoall(x), even, even, salt=9), want)

    # reducescatter: rank j keeps block j of the rows (lower ranks get the extra rows)
    full = (2 * n + 1, 2)
    base, extra = divmod(full[0], n)
    counts = [base + (1 if j < extra else 0) for j in range(n)]
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 0.5, 3.0)):
        factor = pre * post / (n if op == hvd.Average else 1)
        want = reference(lambda xs: list((sum(xs) * factor).split(counts)), [full] * n,
                         [(c, 2) for c in counts], salt=10)[r] * n   # Horovod's: times the size
        got = run(lambda x: hvd.reducescatter(x, op=op, prescale_factor=pre,
                                              postscale_factor=post),
                  full, (counts[r], 2), salt=10)
        check(f"reducescatter {op.name}", got, want)
        e = x_of(r, full, 11).requires_grad_()
        (ge,) = hvd.grouped_reducescatter([e], op=op, prescale_factor=pre,
                                          postscale_factor=post)
        (ge * u_of(r, (counts[r], 2), 11)).sum().backward()
        check(f"grouped_reducescatter {op.name}", e.grad,
              reference(lambda xs: list((sum(xs) * factor).split(counts)), [full] * n,
                        [(c, 2) for c in counts], 11)[r] * n)

    # only rank 0's input needs a gradient: the forward pairs with the others' plain calls,
    # each kind by its own name counter, and gives the same values
    for name, call in (("allgather", hvd.allgather), ("broadcast", lambda x: hvd.broadcast(x, 0)),
                       ("allreduce", hvd.allreduce), ("reducescatter", hvd.reducescatter)):
        x = x_of(r, (n, 2), 12)
        plain = call(x)
        mixed = call(x.clone().requires_grad_(r == 0))
        check(f"{name} with a gradient on rank 0 alone", mixed.detach(), plain)


if __name__ == "__main__":
    hvd.init()
    check_gradients()
    hvd.shutdown()
    print(f"OK rank {r}", flush=True)
