"""torch's collectives on the "ringreduce" backend: every one against gloo's result on a gloo
group of the same launch (reductions, within float tolerance) or a reference built from every
rank's inputs (data movement, exact), ours bitwise identical across ranks; sparse all_reduce;
the dtypes only moved (bool, uint16/64, float8, complex64), bool and complex reductions; Works
polled and their futures' values, small ones held or dropped; outputs waited by torch's
wait_tensor; inference tensors written; thousands of small calls leaving no objects alive."""
import gc
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import allow_inflight_collective_as_graph_input_ctx
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as hvd
from checks import check_equal, expect
from models import Embedder
import distributed_common as common
from distributed_common import AVG, BATCH, SUM, against_gloo, close, everywhere, Masked, n, r, rand, reduced, same_model, train


def case_all_reduce():
    x, positive = rand(37), 1 + 0.1 * rand(37, seed=1)
    for op, t in ((SUM, x), (dist.ReduceOp.PRODUCT, positive), (dist.ReduceOp.MIN, x),
                  (dist.ReduceOp.MAX, x)):
        against_gloo(lambda g: reduced(t, op, g), f"all_reduce {op}")
    total = reduced(x, SUM, common.GLOO)
    close(reduced(x, AVG), total / n, "all_reduce AVG")
    close(reduced(x, dist._make_nccl_premul_sum(0.5)), total * 0.5, "all_reduce PREMUL_SUM")
    close(reduced(x, SUM, async_op=True), total, "all_reduce async_op")
    big = rand(300_000, seed=2)          # the node's blocks, not its slots
    against_gloo(lambda g: reduced(big, SUM, g), "all_reduce 1.2 MB")
    ints = torch.arange(10, dtype=torch.int64) * (r + 1)
    check_equal(reduced(ints), torch.arange(10) * (n * (n + 1) // 2), "all_reduce int64")
    strided = rand(8, 6, seed=3).t()     # not contiguous: reduced, written back in place
    against_gloo(lambda g: reduced(strided, SUM, g), "all_reduce transposed")


def case_synchronous_all_reduce():
    """A synchronous all_reduce (the group called with asyncOp False, as dist.all_reduce calls
    it), small and large, strided: done when the call returns, which returns no Work (torch's
    contract for a backend that waited itself); one rank calling synchronously where the others
    do not, or with its engine busy, pairs with their calls."""
    pg = dist.distributed_c10d._get_default_group()
    for length in (5, 300_000):             # the small way, and the general one
        for strided in (False, True):
            what = f"synchronous all_reduce of {length} floats" + (", strided" if strided
                                                                  else "")
            opts = dist.AllreduceOptions()
            opts.reduceOp, opts.asyncOp = SUM, False
            whole = torch.full((length, 2), float(r + 1))
            mine = whole[:, 0] if strided else whole[:, 0].contiguous()
            assert pg.allreduce([mine], opts) is None, f"{what}: a Work"
            check_equal(mine, torch.full((length,), float(n * (n + 1) // 2)), what)
            check_equal(whole[:, 1], torch.full((length,), float(r + 1)), f"{what}: beside it")
    # The ranks' calls on different paths: rank 0 alone synchronous, the others asynchronous;
    # then rank 0 alone with a large allreduce still queued, so that its small synchronous
    # call waits for the engine where the others' run at once.
    small = torch.full((5,), float(r + 1))
    work = dist.all_reduce(small, async_op=r != 0)
    if r != 0:
        work.wait()
    total = float(n * (n + 1) // 2)
    check_equal(small, torch.full((5,), total), "all_reduce, synchronous on rank 0 alone")
    large = torch.full((300_000,), float(r + 1))
    pending = dist.all_reduce(large, async_op=r == 0)
    dist.all_reduce(small)
    if r == 0:
        pending.wait()
    check_equal(large, torch.full((300_000,), total), "all_reduce, queued on rank 0 alone")
    check_equal(small, torch.full((5,), total * n), "all_reduce after it, synchronous")


def case_all_reduce_coalesced():
    def run(group):
        tensors = [rand(5, seed=4), rand(2, 3, seed=5)]
        dist.all_reduce_coalesced(tensors, group=group)
        return torch.cat([t.reshape(-1) for t in tensors])
    against_gloo(run, "all_reduce_coalesced")


def case_coalesced():
    """FSDP's coalescing manager: several all_gather_into_tensor / reduce_scatter_tensor calls
    become one allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced."""
    outs, ins = [torch.empty(3 * n), torch.empty(n, 2)], [rand(3, seed=40), rand(2, seed=41)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for out, x in zip(outs, ins):
            dist.all_gather_into_tensor(out, x)
    cm.wait()
    for out, seed, width in ((outs[0], 40, 3), (outs[1], 41, 2)):
        want = torch.cat([rand(width, seed=seed, rank=k) for k in range(n)])
        check_equal(out.reshape(-1), want, f"coalesced all_gather_into_tensor seed {seed}")
    outs = [torch.empty(3), torch.empty(2, 2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], rand(3 * n, seed=42))
        dist.reduce_scatter_tensor(outs[1], rand(2 * n, 2, seed=43))
    cm.wait()
    for out, seed, shape in ((outs[0], 42, (3 * n,)), (outs[1], 43, (2 * n, 2))):
        whole = sum(rand(*shape, seed=seed, rank=k) for k in range(n))
        close(out.reshape(-1), whole.reshape(n, -1)[r], f"coalesced reduce_scatter_tensor {seed}")

    def uneven():
        with dist._coalescing_manager():
            dist.reduce_scatter_tensor(torch.empty(3), rand(3 * n + 1, seed=44))
    expect(ValueError, "must hold" if n > 1 else "4 torch.float32 elements arrived", uneven)

    def older_form():
        with dist._coalescing_manager(device=torch.device("cpu")):
            dist.all_reduce(torch.ones(2))
    expect(hvd.UnsupportedError, "coalescing manager given a device", older_form)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after refusal")


def case_broadcast():
    for src in range(n):
        x = rand(5, 3, seed=6)
        dist.broadcast(x, src=src)
        check_equal(x, rand(5, 3, seed=6, rank=src), f"broadcast from {src}")


def case_all_gather():
    outputs = [torch.empty(4, 2) for _ in range(n)]
    dist.all_gather(outputs, rand(4, 2, seed=7))
    for k in range(n):
        check_equal(outputs[k], rand(4, 2, seed=7, rank=k), f"all_gather from {k}")
    want = torch.cat([rand(3, seed=8, rank=k) for k in range(n)])
    for shape in ((3 * n,), (n, 3)):
        out = torch.empty(shape)
        work = dist.all_gather_into_tensor(out, rand(3, seed=8), async_op=True)
        work.wait()
        check_equal(out.reshape(-1), want, f"all_gather_into_tensor {shape}")


def case_calls_keep_nothing_alive():
    """Hundreds of small calls, each kind on both front doors, leave no objects behind: a
    per-call object kept alive (the stall watch once kept each call's closures to name it in
    a report) is promoted by the garbage collector and later swept by a full collection, a
    pause of ~80 ms with torch loaded, every ~100k calls."""
    x = torch.ones(256)
    calls = {"allreduce_ (small way)": lambda: hvd.allreduce_(x, op=hvd.Max),
             "allreduce_async_ + synchronize": lambda: hvd.synchronize(
                 hvd.allreduce_async_(x, op=hvd.Max)),
             "allreduce_ of 1 MiB (general path)": lambda: hvd.allreduce_(
                 torch.ones(1 << 18), op=hvd.Max),
             "broadcast_ (signature check)": lambda: hvd.broadcast_(x, 0),
             "dist.all_reduce async": lambda: dist.all_reduce(x, dist.ReduceOp.MAX,
                                                              async_op=True).wait(),
             "dist.broadcast": lambda: dist.broadcast(x, 0)}
    kept = {}
    for what, call in calls.items():
        for _ in range(10):
            call()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            for _ in range(500):
                call()
            kept[what] = len(gc.get_objects()) - before
        finally:
            gc.enable()
    assert all(k < 50 for k in kept.values()), f"objects left by 500 calls: {kept}"
    check_equal(x, torch.ones(256), "the calls' tensor")


def case_small_works_held_or_dropped():
    """Small asynchronous all_reduces that end on the caller's thread (on rank 0, which starts
    each last) return a Work that the group makes again only where somebody still holds the
    last one: each Work held stays its call's (its value, its future), a future asked of a
    Work then dropped stays its call's while later calls reuse that Work, and a Work weakly
    referenced is not reused."""
    total = n * (n + 1) // 2
    held, futures = [], []
    for k in range(6):
        if r == 0:
            time.sleep(0.02)        # (the others' parts are there: it ends on rank 0's thread)
        mine = torch.full((2,), float(r + 1 + k))
        work = dist.all_reduce(mine, async_op=True)
        if k < 3:
            held.append((mine, work))
        else:
            futures.append((mine, work.get_future()))
            del work
    for k, (mine, work) in enumerate(held):
        work.wait()
        assert work.result()[0] is mine, f"held Work {k}: another call's value"
        assert work.get_future().wait()[0] is mine, f"held Work {k}: another call's future"
        check_equal(mine, torch.full((2,), float(total + n * k)), f"held Work {k}")
    assert len({id(future) for _, future in futures}) == 3, "dropped Works: one future shared"
    for k, (mine, future) in enumerate(futures, 3):
        assert future.wait()[0] is mine, f"future of dropped Work {k}: another call's value"
        check_equal(mine, torch.full((2,), float(total + n * k)), f"dropped Work {k}")
    # A Work dropped but weakly referenced (a finalizer, a WeakKeyDictionary) is not another
    # call's Work: a weak reference finds it gone or still its call's
    notes, finalized, refs = weakref.WeakKeyDictionary(), [], []
    for k in range(3):
        if r == 0:
            time.sleep(0.02)
        mine = torch.full((2,), float(k))
        work = dist.all_reduce(mine, async_op=True)
        work.wait()
        assert work not in notes, f"weakly kept Work {k}: another call's Work"
        notes[work] = k
        weakref.finalize(work, finalized.append, k)
        refs.append((weakref.ref(work), mine))
        del work
    for k, (ref, mine) in enumerate(refs):
        kept = ref()
        assert kept is None or kept.result()[0] is mine, f"weak reference {k}: another call's"
    assert sorted(finalized) == [k for k, (ref, _) in enumerate(refs) if ref() is None], \
        f"finalizers run {finalized}"


def case_inference_tensors_written():
    """Tensors made under torch.inference_mode (an evaluation loop's counts) and handed to
    collectives after it are written as gloo writes them, where a copy back into them raised
    (on the ranks whose output is copied: reduce's root alone, so the ranks diverged)."""
    def made(t):
        with torch.inference_mode():
            return t.clone()

    ints = torch.tensor([1, 2, 4, 8]) << r
    every = [torch.tensor([1, 2, 4, 8]) << k for k in range(n)]
    strided = made(rand(4, 2, seed=81)).t()
    dist.all_reduce(strided)
    close(strided, sum(rand(4, 2, seed=81, rank=k) for k in range(n)).t(),
          "all_reduce of a transposed inference tensor")
    bits = made(ints)
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)
    folded = every[0]
    for other in every[1:]:
        folded = folded | other
    check_equal(bits, folded, "all_reduce BOR of an inference tensor")
    kept = made(rand(3, seed=82))
    dist.reduce(kept, 0)
    close(kept, sum(rand(3, seed=82, rank=k) for k in range(n)) if r == 0 else rand(3, seed=82),
          "reduce into an inference tensor")
    rows = made(torch.zeros(2 * n))
    dist.all_to_all_single(rows, torch.arange(2.0 * n) + 10 * r)
    check_equal(rows, torch.tensor([10.0 * k + i for k in range(n) for i in (2 * r, 2 * r + 1)]),
                "all_to_all_single into an inference tensor")
    scattered = made(torch.zeros(2))
    dist.scatter(scattered, [torch.full((2,), 5.0 * k) for k in range(n)] if r == 0 else None, 0)
    check_equal(scattered, torch.full((2,), 5.0 * r), "scatter into an inference tensor")


def case_in_flight_waited_by_tensor():
    """Under torch's allow_inflight_collective_as_graph_input_ctx (a collective begun in eager,
    its output waited in a compiled region) `wait_tensor` on a collective's output waits for it,
    as for torch's own backends, where it returned at once (rank 0 comes late: the others'
    outputs were read unreduced or untouched); the Work dropped, or waited first."""
    wait_tensor = torch.ops._c10d_functional.wait_tensor
    length = 1 << 16            # (the general path: a Work that waits)
    total = float(n * (n + 1) // 2)
    for waited_first in (False, True):
        if r == 0:
            time.sleep(0.1)
        with allow_inflight_collective_as_graph_input_ctx():
            summed = torch.full((length,), float(r + 1))
            works = [dist.all_reduce(summed, async_op=True)]
            sent = torch.full((length,), float(r + 1))
            works.append(dist.broadcast(sent, n - 1, async_op=True))
            gathered = torch.zeros(length * n)
            works.append(dist.all_gather_into_tensor(gathered, torch.full((length,), float(r)),
                                                     async_op=True))
            if waited_first:
                for work in works:
                    work.wait()
            del works
            for out in (summed, sent, gathered):
                wait_tensor(out)
            what = " (Works waited first)" if waited_first else ""
            check_equal(summed, torch.full((length,), total), f"all_reduce, wait_tensor{what}")
            check_equal(sent, torch.full((length,), float(n)), f"broadcast, wait_tensor{what}")
            check_equal(gathered, torch.arange(float(n)).repeat_interleave(length),
                        f"all_gather_into_tensor, wait_tensor{what}")


def case_reduce_scatter():
    def listed(group, op=SUM):
        out = torch.empty(4)
        dist.reduce_scatter(out, [rand(4, seed=10 + k) for k in range(n)], op=op, group=group)
        return out

    def tensor(group, op=SUM):
        out = torch.empty(2, 3)
        dist.reduce_scatter_tensor(out, rand(2 * n, 3, seed=20), op=op, group=group)
        return out

    for run in (listed, tensor):
        ours, theirs = run(None), run(common.GLOO)
        close(ours, theirs, f"reduce_scatter ({run.__name__})")
        close(run(None, AVG), theirs / n, f"reduce_scatter AVG ({run.__name__})")


def case_all_to_all():
    counts = [[(a + b) % 3 + 1 for b in range(n)] for a in range(n)]     # rows a sends b

    def rows(k):
        return 100 * k + torch.arange(sum(counts[k]), dtype=torch.float32).unsqueeze(1) \
            * torch.ones(1, 2)

    def mine_from(k):
        start = sum(counts[k][:r])
        return rows(k)[start:start + counts[k][r]]

    out = torch.empty(sum(counts[k][r] for k in range(n)), 2)
    dist.all_to_all_single(out, rows(r), [counts[k][r] for k in range(n)], counts[r])
    check_equal(out, torch.cat([mine_from(k) for k in range(n)]), "all_to_all_single uneven")
    even = torch.empty(2 * n)
    dist.all_to_all_single(even, 10 * r + torch.arange(2.0 * n))
    want = torch.cat([10 * k + torch.arange(2.0 * r, 2.0 * r + 2) for k in range(n)])
    check_equal(even, want, "all_to_all_single even")
    outputs = [torch.empty(counts[k][r]) for k in range(n)]
    dist.all_to_all(outputs, [torch.full((counts[r][k],), float(r)) for k in range(n)])
    for k in range(n):
        check_equal(outputs[k], torch.full((counts[k][r],), float(k)), f"all_to_all from {k}")


def case_strided_inputs():
    """Tensors that are not contiguous, which gloo takes (all_to_all_single aside) and the
    Horovod-style collectives refuse as Horovod's do: the backend copies them, and writes an
    in-place result back."""
    def strided(seed):
        return rand(3, 2 * n, seed=seed).t()     # (2n, 3), not contiguous

    def coalesced(group):
        tensors = [strided(50), strided(51)]
        dist.all_reduce_coalesced(tensors, group=group)
        return torch.cat([t.reshape(-1) for t in tensors])

    def broadcast(group):
        x = strided(52)
        dist.broadcast(x, src=n - 1, group=group)
        return x

    def gathered(group):
        outs = [torch.empty(2 * n, 3) for _ in range(n)]
        dist.all_gather(outs, strided(53), group=group)
        into = torch.empty(2 * n * n, 3)
        dist.all_gather_into_tensor(into, strided(54), group=group)
        return torch.cat([*outs, into])

    def reduced(group):         # (on the root; then each rank's rows)
        x, out = strided(55), torch.empty(2, 3)
        dist.reduce(x, dst=0, group=group)
        dist.reduce_scatter_tensor(out, strided(56), group=group)
        return torch.cat([x, out]) if r == 0 else out

    for run in (coalesced, broadcast, gathered):
        against_gloo(run, f"{run.__name__}, not contiguous")
    close(reduced(None), reduced(common.GLOO), "reduce and reduce_scatter_tensor, not contiguous")
    got = torch.empty(2 * n, 3)
    dist.all_to_all_single(got, strided(57))
    want = torch.cat([rand(3, 2 * n, seed=57, rank=k).t()[2 * r:2 * r + 2] for k in range(n)])
    check_equal(got, want, "all_to_all_single, not contiguous")
    # input_split_sizes must cover the input's rows, as gloo checks (alltoall itself sends the
    # rows they cover, as Horovod's)
    expect(ValueError, "input_split_sizes", dist.all_to_all_single, torch.empty(n, 3),
           torch.ones(n + 1, 3), [1] * n, [1] * n)


def case_reduce_gather_scatter():
    root = n - 1
    x = rand(6, seed=30)
    ours, theirs = x.clone(), x.clone()
    dist.reduce(ours, dst=root)
    dist.reduce(theirs, dst=root, group=common.GLOO)
    if r == root:
        close(ours, theirs, "reduce")
    gathered = [torch.empty(6) for _ in range(n)] if r == 0 else None
    dist.gather(x, gathered, dst=0)
    if r == 0:
        for k in range(n):
            check_equal(gathered[k], rand(6, seed=30, rank=k), f"gather from {k}")
    out = torch.empty(2, 2)
    pieces = [torch.full((2, 2), 10.0 * k) for k in range(n)] if r == 1 % n else None
    dist.scatter(out, pieces, src=1 % n)
    check_equal(out, torch.full((2, 2), 10.0 * r), "scatter")
    dist.barrier()
    dist.barrier(async_op=True).wait()


def sparse_entries(k, length=6):
    """Rank k's sparse COO vector, not coalesced: a row every rank shares, and a row of its
    own k + 1 times (duplicates add up; each rank holds another number of entries); integer
    values, so every sum is exact."""
    indices = torch.tensor([[length - 1] + [k] * (k + 1)])
    values = torch.tensor([10.0] + [k + 1.0] * (k + 1))
    return torch.sparse_coo_tensor(indices, values, (length,))


def case_sparse_all_reduce():
    """A sparse COO tensor (a sparse embedding's gradient, as DDP hands it over) reduced as
    gloo reduces one: the sum of every rank's entries, coalesced and written over the input,
    exact and identical on every rank, for SUM, AVG and PREMUL_SUM, synchronous or not; a
    rank that passes a dense tensor, a sparse one of another size or an op we do not reduce
    fails every rank's call at once; DDP on a model with a sparse embedding trains to one
    process's parameters."""
    total = sum(sparse_entries(k).to_dense() for k in range(n))
    for label, op, scale in (("SUM", SUM, 1.0), ("AVG", AVG, 1.0 / n),
                             ("PREMUL_SUM", dist._make_nccl_premul_sum(0.5), 0.5)):
        for async_op in (False, True):
            mine = sparse_entries(r)
            work = dist.all_reduce(mine, op=op, async_op=async_op)
            if async_op:
                assert work.get_future().wait()[0] is mine
                work.wait()
            what = f"sparse all_reduce {label} async_op={async_op}"
            assert mine.is_sparse and mine.is_coalesced(), f"{what}: not coalesced sparse"
            if label == "AVG":      # each rank's values divided, then added: not exact
                close(mine.to_dense(), total * scale, what)
            else:
                check_equal(mine.to_dense(), total * scale, what)
            everywhere(mine.to_dense(), what)
            everywhere(mine._indices(), f"{what}: indices")
    theirs = sparse_entries(r)
    dist.all_reduce(theirs, group=common.GLOO)
    ours = reduced(sparse_entries(r))
    check_equal(ours._indices(), theirs._indices(), "sparse all_reduce's indices, as gloo's")
    check_equal(ours._values(), theirs._values(), "sparse all_reduce's values, as gloo's")
    if n > 1:       # (mistakes that need another rank)
        expect(hvd.MismatchError, ["'collective' differs", "sparse_allreduce", "allreduce"],
               dist.all_reduce, sparse_entries(r) if r == 0 else torch.ones(6))
        expect(hvd.MismatchError, ["'dense shape' differs", "(6,)", "(7,)"], dist.all_reduce,
               sparse_entries(r, 6 if r == 0 else 7))
    if r == 0:
        expect(hvd.UnsupportedError, ["sparse tensor on rank 0", "not MAX"], dist.all_reduce,
               sparse_entries(r), op=dist.ReduceOp.MAX)
    else:
        expect(hvd.MismatchError, ["mistake in the arguments of rank 0", "not MAX"],
               dist.all_reduce, sparse_entries(r))
    # the other calls take dense tensors only, as gloo: a TypeError naming the call and rank
    rows = 12       # (divides by 1 to 4)
    for kind, call in (
            ("broadcast", lambda: dist.broadcast(sparse_entries(r, rows), src=0)),
            ("allgather", lambda: dist.all_gather([torch.empty(rows) for _ in range(n)],
                                                  sparse_entries(r, rows))),
            ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(
                torch.empty(rows * n), sparse_entries(r, rows))),
            ("reduce", lambda: dist.reduce(sparse_entries(r, rows), dst=0)),
            ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(
                torch.empty(rows // n), sparse_entries(r, rows))),
            ("all_to_all_single", lambda: dist.all_to_all_single(
                torch.empty(rows), sparse_entries(r, rows)))):
        expect(TypeError, [kind, f"rank {r}", "dense tensors"], call)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")
    reference, wrapped = train(Embedder, batches=tokens), train(Embedder, DDP, batches=tokens)
    assert wrapped.embedding.weight.grad.is_sparse, "DDP's embedding gradient is not sparse"
    same_model(wrapped, reference, "DDP, sparse embedding")


def tokens(step):
    """A batch of rows of 5 tokens for Embedder, with labels."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 20, (BATCH, 5), generator=g), torch.randint(0, 3, (BATCH,), generator=g)


# dtypes we do not reduce, which torch's callers still move: DDP broadcasts a model's buffers
# (a transformer's bool causal mask), libraries gather bool and uint tensors
MOVED = (torch.bool, torch.uint16, torch.uint64, torch.float8_e4m3fn, torch.complex64)


def moved(dtype, k, rows=2):
    """Rank k's input of `dtype`: `rows` rows of 3, different on every rank."""
    base = torch.arange(rows * 3).reshape(rows, 3) + 7 * k
    if dtype == torch.bool:
        return base % (k + 2) == 0
    if dtype == torch.complex64:
        return torch.complex(base.float(), -base.float())
    return base.to(torch.float32 if dtype.is_floating_point else torch.int64).to(dtype)


def same_bits(got, want, what):
    """Same dtype, shape and bytes (float8 has no torch.equal)."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    check_equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8), what)


def case_dtypes_moved_and_bool_reduced():
    """Every data-moving collective takes any dtype of 1, 2, 4 or 8 bytes an element, on both
    front doors, the dtype still in the signature; bool reduces as gloo reduces it; DDP takes
    a model with a bool buffer."""
    root = n - 1
    for dtype in MOVED:
        what = f"{dtype} "
        x = moved(dtype, r)
        dist.broadcast(x, src=root)
        same_bits(x, moved(dtype, root), what + "broadcast")
        outs = [torch.empty(2, 3, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, moved(dtype, r))
        for k in range(n):
            same_bits(outs[k], moved(dtype, k), what + f"all_gather from {k}")
        out = torch.empty(2 * n, 3, dtype=dtype)
        dist.all_gather_into_tensor(out, moved(dtype, r))
        same_bits(out, torch.cat([moved(dtype, k) for k in range(n)]), what + "into tensor")
        got = torch.empty(n, 3, dtype=dtype)
        dist.all_to_all_single(got, moved(dtype, r, rows=n))
        same_bits(got, torch.stack([moved(dtype, k, rows=n)[r] for k in range(n)]),
                  what + "all_to_all_single")
        whole = torch.cat([moved(dtype, k) for k in range(n)])
        same_bits(hvd.allgather(moved(dtype, r)), whole, what + "hvd.allgather")
        same_bits(hvd.broadcast(moved(dtype, r), root), moved(dtype, root), what + "hvd.broadcast")
    strided = moved(torch.bool, r, rows=3).t()          # not contiguous: written back in place
    dist.broadcast(strided, src=0)
    same_bits(strided, moved(torch.bool, 0, rows=3).t(), "bool broadcast transposed")
    typed = torch.zeros(3, dtype=torch.bool if r == 0 else torch.uint8)
    if n > 1:
        expect(hvd.MismatchError, ["dtype", "bool", "uint8"], dist.broadcast, typed, src=0)
    flags = torch.stack([moved(torch.bool, k) for k in range(n)])
    for op, want in ((SUM, flags.any(0)), (dist.ReduceOp.MAX, flags.any(0)),
                     (dist.ReduceOp.MIN, flags.all(0)), (dist.ReduceOp.PRODUCT, flags.all(0))):
        for async_op in (False, True):
            check_equal(reduced(moved(torch.bool, r), op, async_op=async_op), want,
                        f"bool all_reduce {op} async_op={async_op}")
    kept = moved(torch.bool, r)
    dist.reduce(kept, dst=root, op=dist.ReduceOp.MIN)
    check_equal(kept, flags.all(0) if r == root else moved(torch.bool, r), "bool reduce MIN")
    expect(ValueError, ["bool", "not AVG"], dist.all_reduce, moved(torch.bool, r), AVG)
    # BAND, BOR, BXOR as gloo has them, on integer and bool tensors
    folds = {dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
             dist.ReduceOp.BXOR: torch.bitwise_xor}
    for dtype in (torch.uint8, torch.int32, torch.int64, torch.bool):
        mine = [moved(dtype, k) if dtype == torch.bool else (torch.arange(6).reshape(2, 3)
                * (k + 3) + k).to(dtype) for k in range(n)]
        for op, fold in folds.items():
            want = mine[0]
            for k in range(1, n):
                want = fold(want, mine[k])
            for async_op in (False, True):
                same_bits(reduced(mine[r], op, async_op=async_op), want,
                          f"{dtype} all_reduce {op} async_op={async_op}")
            kept = mine[r].clone().t()      # (not contiguous: written in place)
            dist.reduce(kept, dst=root, op=op)
            same_bits(kept, want.t() if r == root else mine[r].t(), f"{dtype} reduce {op}")
            pairs = torch.stack([mine[r], mine[r]], -1)     # every other element: a strided
            dist.all_reduce(pairs[..., 0], op=op)           # view even flattened
            same_bits(pairs[..., 0].contiguous(), want, f"{dtype} all_reduce {op}, strided")
            same_bits(pairs[..., 1].contiguous(), mine[r], f"{dtype} {op}: the rest untouched")
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")
    same_model(train(Masked, DDP), train(Masked), "DDP with a bool buffer")


def case_bool_and_complex_in_every_reduction():
    """Bool tensors reduce as gloo reduces them in every reduction (reduce_scatter in both
    forms, all_reduce_coalesced, the coalescing manager's all_reduce), and complex ones in
    reduce and reduce_scatter, which torch hands the backend as they are (all_reduce's it
    turns into real ones first)."""
    flags = torch.stack([moved(torch.bool, k, rows=n).reshape(-1) for k in range(n)])
    width = flags.shape[1] // n
    for op, want in ((SUM, flags.any(0)), (dist.ReduceOp.MAX, flags.any(0)),
                     (dist.ReduceOp.MIN, flags.all(0)), (dist.ReduceOp.PRODUCT, flags.all(0))):
        mine = want[r * width:(r + 1) * width]
        out = torch.empty(width, dtype=torch.bool)
        dist.reduce_scatter_tensor(out, flags[r].clone(), op=op)
        check_equal(out, mine, f"bool reduce_scatter_tensor {op}")
        out = torch.empty(width, dtype=torch.bool)
        dist.reduce_scatter(out, list(flags[r].clone().chunk(n)), op=op)
        check_equal(out, mine, f"bool reduce_scatter {op}")
    outs = [torch.empty(width, dtype=torch.bool) for _ in range(2)]
    with dist._coalescing_manager():
        for out in outs:
            dist.reduce_scatter_tensor(out, flags[r].clone())
    for out in outs:
        check_equal(out, flags.any(0)[r * width:(r + 1) * width],
                    "bool reduce_scatter_tensor SUM, coalesced")
    pair = [flags[r][:3].clone(), flags[r][3:].clone()]
    dist.all_reduce_coalesced(pair)
    check_equal(torch.cat(pair), flags.any(0), "bool all_reduce_coalesced SUM")
    pair = [flags[r][:3].clone(), flags[r][3:].clone()]
    with dist._coalescing_manager():
        for t in pair:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
    check_equal(torch.cat(pair), flags.all(0), "bool all_reduce MIN, coalesced")

    def mixed():        # (torch's all_reduce_coalesced refuses mixed dtypes itself)
        with dist._coalescing_manager():
            dist.all_reduce(flags[r].clone())
            dist.all_reduce(torch.ones(2))
    expect(hvd.ArgumentTypeError, "mixes bool tensors", mixed)

    def waves(k, rows=2 * n):
        return torch.complex(rand(rows, 3, seed=60, rank=k), rand(rows, 3, seed=61, rank=k))
    whole = sum(waves(k) for k in range(n))
    root = n - 1
    for op, want in ((SUM, whole), (AVG, whole / n)):
        kept = waves(r).t()         # (not contiguous: written in place)
        dist.reduce(kept, dst=root, op=op)
        close(kept.t(), want if r == root else waves(r), f"complex reduce {op}")
        out = torch.empty(2, 3, dtype=torch.complex64)
        dist.reduce_scatter_tensor(out, waves(r), op=op)
        close(out, want[2 * r:2 * r + 2], f"complex reduce_scatter_tensor {op}")
        out = torch.empty(2, 3, dtype=torch.complex64)
        dist.reduce_scatter(out, list(waves(r).chunk(n)), op=op)
        close(out, want[2 * r:2 * r + 2], f"complex reduce_scatter {op}")
    expect(hvd.ArgumentTypeError, ["complex", "not MAX"], dist.reduce, waves(r), dst=0,
           op=dist.ReduceOp.MAX)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_works_polled_and_their_values():
    """A Work polled with is_completed() alone, as gloo's users may, completes with its outputs
    written (without wait()); its future's value is gloo's (all_gather: the output list;
    gather: the root's list, elsewhere none; all_gather_into_tensor: the output's chunk per
    rank); a small all_reduce that one rank starts last, and its callback's collective; a
    synchronous all_reduce of a parameter's transposed view runs, as on gloo."""
    root = n - 1
    gathered = [torch.empty(2) for _ in range(n)]
    flat = torch.empty(2 * n)
    gather_list = [torch.empty(2) for _ in range(n)] if r == root else None
    scattered = torch.empty(2)
    rows = torch.empty(n)
    summed = torch.empty(2)
    kept = rand(2, seed=71)
    strided = rand(4, 3, seed=72).t()
    calls = {
        "all_gather": lambda: dist.all_gather(gathered, rand(2, seed=70), async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(flat, rand(2, seed=70),
                                                                      async_op=True),
        "gather": lambda: dist.gather(rand(2, seed=70), gather_list, dst=root, async_op=True),
        "scatter": lambda: dist.scatter(scattered, [rand(2, seed=73, rank=k) for k in range(n)]
                                        if r == root else None, src=root, async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(
            rows, torch.arange(n, dtype=torch.float32) + 10 * r, async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            summed, rand(2 * n, seed=74), async_op=True),
        "reduce": lambda: dist.reduce(kept, dst=root, async_op=True),
        "all_reduce, transposed": lambda: dist.all_reduce(strided, async_op=True),
    }
    works = {what: call() for what, call in calls.items()}
    deadline = time.monotonic() + 30
    for what, work in works.items():
        while not work.is_completed():
            assert time.monotonic() < deadline, f"{what}: never completed while polled"
            time.sleep(0.001)
    want = [rand(2, seed=70, rank=k) for k in range(n)]
    for k in range(n):
        check_equal(gathered[k], want[k], f"all_gather polled, from {k}")
    check_equal(flat, torch.cat(want), "all_gather_into_tensor polled")
    if r == root:
        for k in range(n):
            check_equal(gather_list[k], want[k], f"gather polled, from {k}")
    check_equal(scattered, rand(2, seed=73, rank=r), "scatter polled")
    check_equal(rows, torch.tensor([10.0 * k + r for k in range(n)]), "all_to_all_single polled")
    close(summed, sum(rand(2 * n, seed=74, rank=k) for k in range(n))[2 * r:2 * r + 2],
          "reduce_scatter_tensor polled")
    close(kept, sum(rand(2, seed=71, rank=k) for k in range(n)) if r == root
          else rand(2, seed=71), "reduce polled")
    close(strided, sum(rand(4, 3, seed=72, rank=k) for k in range(n)).t(),
          "all_reduce transposed, polled")
    values = {what: work.get_future().wait() for what, work in works.items()}
    assert len(values["all_gather"]) == n and all(
        v is t for v, t in zip(values["all_gather"], gathered)), "all_gather's value"
    assert len(values["gather"]) == (n if r == root else 0), "gather's value"
    chunks = values["all_gather_into_tensor"]
    assert len(chunks) == n and all(c.shape == (2,) for c in chunks), "into tensor's value"
    check_equal(torch.cat(chunks), flat, "all_gather_into_tensor's value")
    # A small all_reduce that rank 0 starts last: there it ends on the caller's thread (a Work
    # done from the start), elsewhere it ends later; the same Work either way, and a callback
    # chained on its future starts a collective that pairs across ranks.
    if r == 0:
        time.sleep(0.05)
    mine = torch.full((3,), float(r + 1))
    work = dist.all_reduce(mine, async_op=True)
    counted = work.get_future().then(lambda fut: reduced(torch.ones(1), async_op=True))
    while not work.is_completed():
        assert time.monotonic() < deadline, "small all_reduce: never completed while polled"
        time.sleep(0.001)
    assert work.is_success() and work.exception() is None, "small all_reduce: not a success"
    assert work.result()[0] is mine and work.get_future().wait()[0] is mine, "its value"
    assert work.get_future() is work.get_future(), "small all_reduce: one future"
    check_equal(mine, torch.full((3,), n * (n + 1) / 2), "small all_reduce polled")
    check_equal(counted.wait(), torch.full((1,), float(n)), "all_reduce in its callback")
    weight = nn.Parameter(rand(4, 3, seed=75))
    dist.all_reduce(weight.t())         # (in place on a view of a leaf: as gloo, no error)
    close(weight.detach(), sum(rand(4, 3, seed=75, rank=k) for k in range(n)),
          "all_reduce of a parameter's transposed view")
