"""What takes peers on the "ringreduce" backend: send/recv (a sender's tensor of another size or
dtype: an error, the receiver's tensor untouched; receives matched in the order made; a
receive no one waits for yet still takes a peer's large send), subgroups, a group per thread,
the errors, and each mistake made by one rank alone."""
import datetime
import threading
import time

import torch
import torch.distributed as dist

import ringreduce as hvd
from checks import check_equal, expect
from distributed_common import AVG, SUM, close, n, r, rand, reduced


def case_send_recv():
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(3, 2)
    works = [dist.isend(rand(3, 2, seed=40), right, tag=7), dist.irecv(got, left, tag=7)]
    for work in works:
        work.wait()
    check_equal(got, rand(3, 2, seed=40, rank=left), "isend/irecv ring")
    got = torch.empty(4)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(r)), right),
           dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.get_future().wait()
    check_equal(got, torch.full((4,), float(left)), "batch_isend_irecv")
    if r == 0:
        anywhere = torch.empty(2)
        assert dist.recv(anywhere, tag=9) == n - 1
        check_equal(anywhere, torch.full((2,), 5.0), "recv from any source")
    elif r == n - 1:
        dist.send(torch.full((2,), 5.0), 0, tag=9)
    # a sender's tensor of another size or dtype: an error naming both on the receiver, whose
    # tensor is left as it was; the next message of that tag arrives whole (also a large one,
    # which MPI sends only once its receive is posted)
    large = 1 << 15     # float32s: 128 KiB
    sent = [torch.ones(3), torch.ones(5), torch.ones(4, dtype=torch.int32), torch.ones(3),
            torch.ones(large), torch.ones(large + 1), torch.ones(large, dtype=torch.int32),
            torch.ones(4), torch.arange(4.0), torch.arange(4.0)]
    if r == 0:
        works = [dist.isend(tensor, 1, tag=11) for tensor in sent]
        for work in works:
            work.wait()
    elif r == 1:
        for got, fragments in [
                (torch.full((4,), 7.0), ["rank 0 sent 3 float32 elements (12 bytes)",
                                         "4 float32 elements ((4,), 16 bytes)", "left as it"]),
                (torch.full((2, 2), 7.0), ["sent 5 float32 elements (20 bytes)", "((2, 2),"]),
                (torch.full((4,), 7.0), ["sent 4 int32 elements", "of 4 float32 elements"]),
                (torch.full((4, 2), 7.0)[:, 0], ["sent 3 float32", "4 float32 elements"]),
                (torch.full((4,), 7.0), [f"sent {large} float32 elements ({4 * large} bytes)",
                                         "4 float32 elements ((4,), 16 bytes)"]),
                (torch.full((large,), 7.0), [f"sent {large + 1} float32", f"of {large} float32"]),
                (torch.full((large,), 7.0), [f"sent {large} int32", f"of {large} float32"]),
                (torch.full((large,), 7.0), ["sent 4 float32", f"of {large} float32"])]:
            expect(hvd.RingReduceError, fragments, dist.recv, got, 0, tag=11)
            check_equal(got, torch.full(got.shape, 7.0), "a receive that failed")
        got = torch.empty(2, 2)
        dist.recv(got, 0, tag=11)
        check_equal(got, torch.arange(4.0).reshape(2, 2), "a receive after those that failed")
        columns = torch.zeros(4, 2)
        dist.recv(columns[:, 1], 0, tag=11)     # (not contiguous: it lands, then is copied)
        check_equal(columns, torch.stack([torch.zeros(4), torch.arange(4.0)], 1),
                    "a receive into a strided tensor")
    # receives that a message could match get them in the order they were made, whichever
    # is waited for first; one from another sender is not held back by them
    # (small and large ones mixed)
    lengths = [large, 2, large, 2, 2, large]
    sends = [dist.isend(torch.full((length,), float(k)), 0, tag=21)
             for k, length in enumerate(lengths)] if r == n - 1 else []
    if r == 0:
        got = [torch.empty(length) for length in lengths]
        works = [dist.irecv(got[k], None if k % 2 else n - 1, tag=21)
                 for k in range(len(lengths))]
        for k in (4, 2, 5, 1, 3, 0):
            works[k].wait()
        for k, length in enumerate(lengths):
            check_equal(got[k], torch.full((length,), float(k)), f"receive {k} of tag 21")
        assert {work.source_rank() for work in works} == {n - 1}
    for work in sends:
        work.wait()
    # a receive nobody waits for yet still takes its bytes (a peer's large send waits for
    # that): here rank 0 waits in an all_reduce while rank 1's send of 4 MiB completes
    big = torch.arange(1 << 20, dtype=torch.float32)
    if r == 0:
        got = torch.empty(1 << 20)
        work = dist.irecv(got, 1, tag=22)
        check_equal(reduced(torch.ones(2), SUM), torch.full((2,), float(n)),
                    "an all_reduce while a receive is pending")
        work.wait()
        check_equal(got, big, "a large receive waited for after an all_reduce")
    else:
        if r == 1:
            dist.send(big, 0, tag=22)
        reduced(torch.ones(2), SUM)
    # on one rank alone, a thread of its own waits in a large receive while the main thread
    # all_reduces with every rank
    if r == 0:
        got, outcome = torch.empty(1 << 20), []

        def receive():
            try:
                outcome.append(dist.recv(got, 1, tag=26))
            except Exception as error:
                outcome.append(error)

        waiter = threading.Thread(target=receive)
        waiter.start()
        check_equal(reduced(torch.ones(2), SUM), torch.full((2,), float(n)),
                    "an all_reduce beside another thread's receive")
        waiter.join(60)
        assert not waiter.is_alive() and outcome == [1], outcome
        check_equal(got, big + 1, "a large receive on a thread of one rank")
    else:
        if r == 1:
            dist.send(big + 1, 0, tag=26)
        reduced(torch.ones(2), SUM)
    # every rank receives from its left while it waits for its own large send to the right
    got = torch.empty(1 << 20)
    work = dist.irecv(got, left, tag=25)
    dist.send(big + r, right, tag=25)
    work.wait()
    check_equal(got, big + left, "large sends and receives around the ring")
    # every dtype's bytes, an empty tensor, a strided one sent
    for k, t in enumerate([torch.empty(0), torch.arange(6, dtype=torch.bfloat16),
                           torch.tensor([True, False]), torch.arange(3.0).to(torch.complex64),
                           torch.arange(8, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.arange(4.0).reshape(2, 2).t()]):
        if r == 0:
            dist.send(t, n - 1, tag=30 + k)
        elif r == n - 1:
            got = torch.empty(t.shape, dtype=t.dtype)
            dist.recv(got, 0, tag=30 + k)
            assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), k
    # a receive still waiting when its group is destroyed fails, naming it
    pair = dist.new_group([0, n - 1])
    if r == 0:
        orphan = dist.irecv(torch.empty(2), n - 1, group=pair, tag=5)
    if r in (0, n - 1):
        dist.destroy_process_group(pair)
    if r == 0:
        expect(hvd.RingReduceError, ["recv from rank 1 (tag 5)",
                                     "the group was destroyed before the message came"],
               orphan.wait)
    if n >= 3:      # rank 1 sends to rank 0 only after rank 0 has received rank n-1's
        if r == 0:
            first, second = torch.empty(1), torch.empty(1)
            from_1 = dist.irecv(first, 1, tag=23)
            dist.irecv(second, n - 1, tag=23).wait()
            dist.send(torch.ones(1), 1, tag=24)
            from_1.wait()
            check_equal(torch.cat([first, second]), torch.tensor([1.0, float(n - 1)]),
                        "receives from two senders")
        elif r == 1:
            dist.recv(torch.empty(1), 0, tag=24)
            dist.send(torch.ones(1), 0, tag=23)
        elif r == n - 1:
            dist.send(torch.full((1,), float(n - 1)), 0, tag=23)
    # torch's wait(timeout): a receive not complete by then raises; it stays posted
    if r == 0:
        late = torch.empty(2)
        work = dist.irecv(late, n - 1, tag=13)
        expect(hvd.RingReduceError, ["recv from rank", "wait()'s timeout"], work.wait,
               datetime.timedelta(seconds=0.2))
    dist.barrier()
    if r == n - 1:
        dist.send(torch.full((2,), 3.0), 0, tag=13)
    elif r == 0:
        assert work.wait()
        check_equal(late, torch.full((2,), 3.0), "a receive waited for again after a timeout")
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": r, "pad": "x" * 10 * r})
    assert objects == [{"rank": k, "pad": "x" * 10 * k} for k in range(n)], objects
    box = [f"from {n - 1}"] if r == n - 1 else [None]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [f"from {n - 1}"], box
    gathered = [None] * n if r == 1 else None
    dist.gather_object(("at", r), gathered, dst=1)
    assert gathered == ([("at", k) for k in range(n)] if r == 1 else None), gathered
    mine = [None]
    dist.scatter_object_list(mine, [f"to {k}" for k in range(n)] if r == n - 1 else None,
                             src=n - 1)
    assert mine == [f"to {r}"], mine


def case_subgroup():
    ends = [0, n - 1]
    ours, gloo = dist.new_group(ends), dist.new_group(ends, backend="gloo")
    if r in ends:
        assert dist.get_backend(ours) == "ringreduce"
        # answered as by a group with a backend per device (torch's helpers ask)
        assert ours._device_types == [torch.device("cpu"), torch.device("cuda")]
        assert ours._get_backend(torch.device("cpu")) is ours and not ours.supports_splitting
        assert dist.distributed_c10d._get_pg_default_device(ours) == torch.device("cpu")
        x = rand(9, seed=50)
        close(reduced(x, SUM, ours), reduced(x, SUM, gloo), "all_reduce on [0, n-1]")
        outputs = [torch.empty(9) for _ in ends]
        dist.all_gather(outputs, x, group=ours)
        for k, global_rank in enumerate(ends):
            check_equal(outputs[k], rand(9, seed=50, rank=global_rank), "subgroup all_gather")
        y = x.clone()
        dist.broadcast(y, src=n - 1, group=ours)
        check_equal(y, rand(9, seed=50, rank=n - 1), "subgroup broadcast")
        if r == 0:
            dist.send(torch.full((2,), 3.0), n - 1, group=ours)
        else:
            got = torch.empty(2)
            dist.recv(got, 0, group=ours)
            check_equal(got, torch.full((2,), 3.0), "subgroup send/recv")
        dist.destroy_process_group(ours)        # (members only)
        dist.destroy_process_group(gloo)
    again = dist.new_group(ends)                # a new set under a new label
    if r in ends:
        check_equal(reduced(torch.ones(2), SUM, again), torch.full((2,), 2.0), "group again")
        dist.destroy_process_group(again)
    # a group of rank 0 alone, used by rank 0 alone while the others reduce on the default
    # group (a set of one takes the small way, asynchronous calls too, on the caller's thread)
    alone = dist.new_group([0])
    if r == 0:
        x = rand(5, seed=51)
        check_equal(reduced(x, AVG, alone, async_op=True), x, "AVG on a group of one")
        check_equal(reduced(x, dist.ReduceOp.MAX, alone, async_op=True), x,
                    "MAX on a group of one")
        dist.destroy_process_group(alone)
    check_equal(reduced(torch.ones(3)), torch.full((3,), float(n)), "beside a group of one")
    # ranks out of order (sort_ranks=False, which ranks them in that order) are refused on
    # every member: our sets rank members in global order, and roots and positions would be
    # another rank's
    if n > 1:
        def backwards():
            group = dist.new_group(list(range(n))[::-1], sort_ranks=False)
            return reduced(torch.ones(2), SUM, group)

        expect(hvd.RingReduceError, ["lists its ranks out of order", "sort_ranks=True"],
               backwards)
        check_equal(reduced(torch.ones(3)), torch.full((3,), float(n)), "after the refusal")


def case_threads_each_on_a_group_of_its_own():
    """Two threads calling collectives at once, each on a group of its own, in an order that
    differs between ranks (the documented way: one group's calls pair by position)."""
    groups = [dist.new_group(list(range(n))) for _ in range(2)]
    results, errors = {}, []

    def calls(k):
        try:
            got = []
            for i in range(40):
                if (i + k + r) % 3 == 0:
                    time.sleep(0.001)           # another interleaving on each rank
                x = torch.arange(5.0) + 10 * i + 1000 * k * r      # exact sums
                if k == 0:
                    dist.all_reduce(x, group=groups[0])
                else:
                    dist.broadcast(x, src=n - 1, group=groups[1])
                got.append(x)
            results[k] = got
        except Exception as e:                  # reported below, on the case's thread
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(results) == 2, errors or "a thread did not finish"
    for i in range(40):
        check_equal(results[0][i], (torch.arange(5.0) + 10 * i) * n, f"all_reduce {i}")
        check_equal(results[1][i], torch.arange(5.0) + 10 * i + 1000 * (n - 1),
                    f"broadcast {i}")
    for group in groups:
        dist.destroy_process_group(group)


def case_errors():
    shaped = torch.ones(3 if r == 0 else 4)
    expect(hvd.MismatchError, ["shape", "(3,)", "(4,)"], dist.all_reduce, shaped)
    typed = torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64)
    expect(hvd.MismatchError, ["dtype", "float32", "float64"], dist.all_reduce, typed)
    expect(hvd.MismatchError, "shape", dist.all_gather_into_tensor,
           torch.empty(n * shaped.numel()), shaped)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")
    expect(hvd.UnsupportedError, ["ReduceOp.BAND", "integer or bool"], dist.all_reduce,
           torch.ones(2), op=dist.ReduceOp.BAND)
    expect(hvd.UnsupportedError, ["ReduceOp.BOR is not supported", "BXOR by all_reduce and"],
           dist.all_reduce_coalesced, [torch.ones(2, dtype=torch.int64)], op=dist.ReduceOp.BOR)
    group = dist.group.WORLD
    expect(hvd.UnsupportedError, "one tensor per call", group.allreduce,
           [torch.ones(1), torch.ones(1)], dist.AllreduceOptions())
    expect(ValueError, "GLOO", dist.monitored_barrier)


def case_one_rank_errs():
    """A mistake made on rank 0 alone: an error there, the others' results right, and the
    group usable after it."""
    def async_then_wait(x, op=SUM):         # rank 0 begins on its thread, the others queue
        work = dist.all_reduce(x, op=op, async_op=r == 0)
        return work.wait() if work is not None else None
    expect(hvd.MismatchError, ["shape", "(3,)", "(4,)"], async_then_wait,
           torch.ones(3 if r == 0 else 4))
    expect(hvd.MismatchError, "op", async_then_wait, torch.ones(2),
           dist.ReduceOp.MAX if r == 0 else SUM)
    want = [rand(2, seed=50, rank=k) for k in range(n)]
    outputs = [torch.empty(2) for _ in range(n - 1 if r == 0 else n)]
    if r == 0:
        expect(ValueError, ["allgather on rank 0", f"takes {n} output"], dist.all_gather,
               outputs, rand(2, seed=50))
    else:
        dist.all_gather(outputs, rand(2, seed=50))
        for k in range(n):
            check_equal(outputs[k], want[k], f"all_gather from {k} beside rank 0's mistake")
    out = torch.empty(2 * n + (1 if r == 0 else 0))
    if r == 0:
        expect(ValueError, "all_gather_into_tensor on rank 0", dist.all_gather_into_tensor,
               out, rand(2, seed=50))
    else:
        dist.all_gather_into_tensor(out, rand(2, seed=50))
        check_equal(out, torch.cat(want), "all_gather_into_tensor beside rank 0's mistake")
    # wrong output_split_sizes on rank 0: the error from the future and from wait(), each time
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    got = torch.empty(2 * n)
    splits = [2] * n if r else [1] * (n - 1) + [n + 1]
    work = dist.all_to_all_single(got, x, output_split_sizes=splits, async_op=True)
    if r == 0:
        expect(ValueError, "output_split_sizes", work.get_future().wait)
        expect(ValueError, "output_split_sizes", work.wait)
        expect(ValueError, "output_split_sizes", work.wait)
        assert isinstance(work.exception(), ValueError) and not work.is_success()
    else:
        work.wait()
        want = torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * k
                          for k in range(n)])
        check_equal(got, want, "all_to_all_single beside rank 0's mistake")
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_one_rank_refuses_its_inputs():
    """A mistake in rank 0's inputs, found before its collective could begin: ValueError
    (an unsupported op: UnsupportedError) there, at once a MismatchError quoting it on every
    other rank (not a wait for a call never made), and the group usable after each."""
    def refused(call, words, error=ValueError):
        if r == 0:
            expect(error, ["on rank 0", words], call, True)
        else:
            expect(hvd.MismatchError, ["rank 0", words], call, False)
    rows = [torch.ones(2) for _ in range(n)]
    refused(lambda bad: dist.reduce_scatter(torch.empty(2), rows + [torch.ones(2)] * bad),
            f"takes {n} input")
    refused(lambda bad: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n + bad)),
            f"multiple of {n}")
    refused(lambda bad: dist.scatter(torch.empty(2), (rows[:n - 1] if bad else rows)
                                     if r == 0 else None, src=0),
            f"takes {n} input")
    refused(lambda bad: dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n + bad)),
            "does not divide")
    refused(lambda bad: dist.all_to_all([torch.empty(1) for _ in range(n)],
                                        [torch.ones(1) for _ in range(n + bad)]),
            f"takes {n} input")
    refused(lambda bad: dist.all_reduce(torch.ones(2, dtype=torch.bool if bad else torch.uint8),
                                        op=AVG),
            "bool tensor takes SUM")
    refused(lambda bad: dist.broadcast(torch.ones(4).to_sparse() if bad else torch.ones(4),
                                       src=0),
            "dense tensors", TypeError)
    # a root or an op that rank 0 alone gets wrong (found before the call could begin)
    bad = n + 3
    refused(lambda bad_root: dist.broadcast(torch.ones(2), src=bad if bad_root else 0),
            f"rank {bad} is not a rank of")
    refused(lambda bad_root: dist.reduce(torch.ones(2), dst=bad if bad_root else 0),
            f"rank {bad} is not a rank of")
    refused(lambda bad_root: dist.gather(torch.ones(2), None, dst=bad if bad_root else 0),
            f"rank {bad} is not a rank of")
    refused(lambda bad_op: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND if bad_op
                                           else SUM),
            "ReduceOp.BAND takes integer or bool tensors", hvd.UnsupportedError)
    refused(lambda bad_op: dist.reduce(torch.ones(2), dst=0,
                                       op=dist.ReduceOp.BOR if bad_op else SUM),
            "ReduceOp.BOR takes integer or bool tensors", hvd.UnsupportedError)
    refused(lambda bad_op: dist.reduce_scatter_tensor(
        torch.empty(1, dtype=torch.int64), torch.ones(n, dtype=torch.int64),
        op=dist.ReduceOp.BXOR if bad_op else SUM),
        "ReduceOp.BXOR is not supported", hvd.UnsupportedError)
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_one_rank_calls_another_kind():
    """Rank 0 alone calls another kind of collective at a position of the group's sequence
    (small ones inline or queued, large ones on the general path): a MismatchError naming
    each rank's kind on every rank at once, not a wait for calls never made; then the group
    is usable."""
    small, big = rand(4, seed=60), rand(1 << 15, seed=61)

    def mixed(mine, theirs, kinds):
        expect(hvd.MismatchError, ["'collective' differs", "rank 0", *kinds],
               mine if r == 0 else theirs)
        check_equal(reduced(torch.full((2,), r + 1.0)), torch.full((2,), n * (n + 1) / 2),
                    "all_reduce after the mismatch")

    mixed(dist.barrier, lambda: dist.all_reduce(small.clone()), ["barrier", "allreduce"])
    mixed(lambda: dist.all_reduce(small.clone(), async_op=True).wait(),
          lambda: dist.broadcast(small.clone(), src=0), ["allreduce", "broadcast"])
    mixed(lambda: dist.all_gather_into_tensor(torch.empty(n * big.numel()), big),
          lambda: dist.all_reduce(big.clone(), async_op=True).wait(),
          ["allgather", "allreduce"])
    mixed(lambda: dist.reduce_scatter_tensor(torch.empty(big.numel()), big.repeat(n)),
          dist.barrier, ["reducescatter", "barrier"])
    # the calls with a root, each made of one without: rank 0 would have kept a result
    mixed(lambda: dist.reduce(small.clone(), dst=0), lambda: dist.all_reduce(small.clone()),
          ["'reduce'", "'allreduce'"])
    rows = [torch.empty(4) for _ in range(n)]
    mixed(lambda: dist.gather(small, rows, dst=0), lambda: dist.all_gather(rows, small),
          ["'gather'", "'allgather'"])
    # a bitwise op (an allgather within) where the others sum, or take another bitwise op
    flags = torch.arange(4, dtype=torch.int32)
    for theirs, name in ((SUM, "Sum"), (dist.ReduceOp.BOR, "BOR")):
        expect(hvd.MismatchError, ["'op' differs", "rank 0: 'BAND'", name], dist.all_reduce,
               flags.clone(), op=dist.ReduceOp.BAND if r == 0 else theirs)
    mixed(lambda: dist.scatter(torch.empty(4), [small] * n, src=0),
          lambda: dist.all_to_all_single(torch.empty(4 * n), small.repeat(n)),
          ["'scatter'", "'alltoall'"])
    check_equal(reduced(torch.ones(2)), torch.full((2,), float(n)), "all_reduce after them")


def case_one_rank_names_another_root():
    """The last rank alone names itself the root of a reduce, gather, scatter or broadcast,
    where the others name rank 0: a MismatchError on every rank, and no output written (a
    reduce or gather had two roots keep a result, a scatter failed on one rank alone with a
    shape error); then the group is usable."""
    root = n - 1 if r == n - 1 else 0
    x = torch.full((2,), r + 1.0)

    def refused(call, output):
        before = output.clone()
        expect(hvd.MismatchError, ["'root_rank' differs", "rank 0: 0", f"rank {n - 1}: {n - 1}"],
               call)
        check_equal(output, before, "an output after a refused call")

    refused(lambda: dist.reduce(x, dst=root), x)
    rows = [torch.zeros(2) for _ in range(n)]
    refused(lambda: dist.gather(x, rows if r == root else None, dst=root), torch.stack(rows))
    out = torch.zeros(2)
    sent = [torch.full((2,), k + 10.0) for k in range(n)]
    refused(lambda: dist.scatter(out, sent if r == root else None, src=root), out)
    refused(lambda: dist.broadcast(x, src=root), x)
    dist.scatter(out, sent if r == 0 else None, src=0)
    check_equal(out, torch.full((2,), r + 10.0), "scatter after them")
    dist.reduce(x, dst=0)
    if r == 0:
        check_equal(x, torch.full((2,), n * (n + 1) / 2), "reduce after them")
