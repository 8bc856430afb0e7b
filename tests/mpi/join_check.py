"""join(): ranks that run out of data join; the others' allreduces go on with the joined ranks
contributing zeros (Average still divides by the set's size); other collectives raise
JoinedError meanwhile; join() returns the last rank to join, on every rank.

Then a DistributedOptimizer epoch with a different number of batches per rank, against one
process applying the same averaged gradients (the parameters of the rank that joined last,
broadcast after join() as Horovod's documentation says); its sparse gradients while a rank
has joined.

Usage: join_check.py [SETTINGS]   (a JSON object {label: {variable: value}}: every check once
per setting. JOIN_FIRST=k: rank k joins first, then k+1, ... around the ring; unset: each rank
first in turn)
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

import ringreduce as hvd
from checks import per_setting
from models import Net

r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def value(rank, i):
    return float(10 * rank + i + 1)


def joins_in_turn(first):
    """Rank `first` joins first, then first+1, ... around the ring."""
    order = [(first + k) % n for k in range(n)]      # the order in which ranks join
    rounds = {rank: order.index(rank) + 1 for rank in range(n)}   # rounds before joining
    for i in range(rounds[r]):
        active = [k for k in range(n) if rounds[k] > i]
        x = torch.full((70_001,), value(r, i))        # the block path on one node
        total = hvd.allreduce(x, op=hvd.Sum, name=f"round.{i}")
        assert torch.equal(total, torch.full((70_001,), sum(value(k, i) for k in active))), \
            (r, i, total[:2])
        small = hvd.allreduce(torch.full((3,), value(r, i)), op=hvd.Average)   # unnamed
        assert torch.allclose(small, torch.full((3,), sum(value(k, i) for k in active) / n)), \
            small
        begun = torch.full((3,), value(r, i))     # in place, small: begun on this thread
        hvd.synchronize(hvd.allreduce_async_(begun, op=hvd.Sum))
        assert torch.equal(begun, torch.full((3,), sum(value(k, i) for k in active))), begun
        ints = hvd.allreduce(torch.full((5,), r + 1, dtype=torch.int32), op=hvd.Max)
        assert torch.equal(ints, torch.full((5,), max(k + 1 for k in active), dtype=torch.int32))
        grouped = hvd.grouped_allreduce(
            [torch.ones(2) * (r + 1), torch.ones(3, dtype=torch.float64)], op=hvd.Sum)
        assert torch.equal(grouped[1], torch.full((3,), float(len(active)), dtype=torch.float64))
        if len(active) < n:                           # someone has joined: only allreduces run
            root = active[0]
            for call in (lambda: hvd.broadcast(torch.ones(2), root_rank=root),
                         lambda: hvd.allgather(torch.ones(1)),
                         lambda: hvd.alltoall(torch.ones(n)),
                         lambda: hvd.reducescatter(torch.ones(n)),
                         lambda: hvd.broadcast_object(1, root_rank=root)):
                try:
                    call()
                    raise AssertionError("a collective ran while a rank had joined")
                except hvd.JoinedError as e:
                    assert isinstance(e, RuntimeError) and "have joined" in str(e), e
                    assert f"{sorted(set(range(n)) - set(active))}" in str(e), e
            hvd.barrier()                              # a barrier is fine: the joined wait anyway
    last = hvd.join()
    assert last == order[-1], (last, order)
    # every rank is back in step, automatic names included
    again = hvd.allreduce(torch.ones(4), op=hvd.Sum)
    assert torch.equal(again, torch.full((4,), float(n))), again
    assert hvd.allgather(torch.tensor([r])).tolist() == list(range(n))


def joins_apart_in_time(late):
    """Every rank runs the same collectives, then rank `late` joins a second after the others:
    join() returns it, the last to join in time (as Horovod's coordinator sees the joins)."""
    hvd.allreduce(torch.ones(2), name="before the joins")
    if r == late:
        time.sleep(1.0)
    last = hvd.join()
    assert last == late, (last, late)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def uneven_epoch():
    """Rank k has k + 2 batches, then joins. The reference applies, at step s, the sum of the
    gradients of the ranks that still have data, divided by n."""
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), fusion_threshold=4096,
                                   first_bucket_bytes=1024)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(n + 1):
        if step < r + 2:
            x, y = batch(r, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        ref_opt.zero_grad()
        for k in range(n):
            if step < k + 2:
                x, y = batch(k, step)
                (F.cross_entropy(reference(x), y) / n).backward()
        ref_opt.step()
    last = hvd.join()
    assert last == n - 1                 # the rank with the most batches joins last
    # ranks that joined early stopped stepping: take the model of the one that joined last, as
    # Horovod's documentation says to
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), \
            f"{name} differs from the reference by {(p - q).abs().max().item()}"
    hvd.check_consistency(model)        # bitwise identical on every rank


def sparse_gradients_under_join():
    """A DistributedOptimizer gathers sparse gradients, which cannot run while a rank has
    joined: the others' step raises JoinedError saying to pass sparse_as_dense=True (as
    Horovod's says), at the embedding's first sparse step and at a later one; they join too,
    and every rank goes on in step. With sparse_as_dense, the joined rank's zeros take part."""
    if n == 1:
        return
    for steps_before in (0, 1):
        emb = torch.nn.Embedding(4, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       [("emb.weight", emb.weight)])
        for _ in range(steps_before):       # every rank: the embedding is known sparse
            opt.zero_grad()
            emb(torch.tensor([1])).sum().backward()
            opt.step()
        if r != 0:
            opt.zero_grad()
            emb(torch.tensor([1])).sum().backward()
            try:
                opt.step()
                raise AssertionError("a sparse gradient was gathered while rank 0 had joined")
            except hvd.JoinedError as e:
                assert "sparse_as_dense=True" in str(e) and "[0]" in str(e), e
            opt.zero_grad()
        hvd.join()
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    emb = torch.nn.Embedding(4, 2, sparse=True)
    torch.nn.init.zeros_(emb.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   [("emb.weight", emb.weight)], sparse_as_dense=True)
    if r != 0:
        (emb(torch.tensor([1])).sum() * n).backward()
        opt.step()
    hvd.join()
    # (rank 0 joined without a step of its own: its weight is as it was)
    want = 0.0 if r == 0 else -float(n - 1)
    assert torch.equal(emb.weight[1], torch.full((2,), want)), emb.weight


def adasum_under_join():
    """A grouped Adasum allreduce (what a DistributedOptimizer(op=Adasum) bucket runs) while
    rank 0 has joined: its zeros are fused as the others' tensors are, each weighed on its
    own (the joined rank ran Adasum over one fused tensor, and the set shut down with MPI's
    'Message truncated'). Adasum of a vector with itself is the vector, with zeros too."""
    if n & (n - 1):
        return      # (Adasum takes a power-of-two number of ranks)
    if r == 0:
        hvd.join()
        return
    got = hvd.grouped_allreduce([torch.full((8,), 2.0), torch.full((2,), 3.0)], op=hvd.Adasum,
                                name="adasum.joined")
    assert torch.equal(got[0], torch.full((8,), 2.0)) and torch.equal(got[1],
                                                                       torch.full((2,), 3.0))
    hvd.join()


def check_all():
    first = os.environ.get("JOIN_FIRST")
    for first in range(n) if first is None else [int(first) % n]:
        print(f"JOIN rank {r}: rank {first} joins first", flush=True)   # names the failing case
        joins_in_turn(first)
    joins_apart_in_time(0)
    joins_apart_in_time(n - 1)
    uneven_epoch()
    sparse_gradients_under_join()
    adasum_under_join()


per_setting(sys.argv[1] if len(sys.argv) > 1 else None, hvd.init, check_all, hvd.shutdown)
print(f"OK rank {r}", flush=True)
