"""SyncBatchNorm on N ranks, each with a shard of the batch (unequal shards, some empty), equals
torch.nn.BatchNorm on the whole batch in one process: outputs, input gradients, weight and bias
gradients (summed over the ranks), running statistics, eval mode. float64; float32 with a
channel mean of 1e4 (also against float64 on the same inputs, tightly); float16 and bfloat16;
float16 with more than 2048 values per channel per rank. The statistics are bitwise identical
on every rank. Every case runs; the failures are gathered and named together at the end.
optimizer_check.py runs these cases in its launch; this file also runs alone.

RINGREDUCE_SYNC_BN_ERRORS=1 prints each comparison's largest error."""
import copy
import os
import traceback

import torch

import ringreduce as hvd
from mpi4py import MPI
from ringreduce.api.sync_batch_norm import _global_stats

r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
SHOW = os.environ.get("RINGREDUCE_SYNC_BN_ERRORS") == "1"
failures: list[str] = []


def close(case, what, got, want, rtol, atol):
    """Record a failure unless `got` is finite where `want` is and within the tolerance."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        failures.append(f"{case}: {what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    err = (got - want).abs().max().item() if got.numel() else 0.0
    if SHOW and r == 0:
        print(f"  {case}: {what}: max abs error {err:.3g}", flush=True)
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        nan = " (NaN)" if torch.isnan(got).any() else ""
        failures.append(f"{case}: {what}: max abs error {err:.3g}{nan} over rtol={rtol} "
                        f"atol={atol}")


def expect(case, ok, what):
    if not ok:
        failures.append(f"{case}: {what}")


def shards(total_sizes):
    """This rank's rows of a batch split into `total_sizes` (one size per rank)."""
    start = sum(total_sizes[:r])
    return slice(start, start + total_sizes[r])


def identical_everywhere(case, what, tensor):
    """`tensor` (float64 here) is bitwise the same on every rank."""
    rows = hvd.allgather(tensor.detach().double().reshape(1, -1), name=f"sbn.{case}.{what}")
    expect(case, all(torch.equal(rows[0], row) for row in rows), f"{what} differs between ranks")


def compare(case, cls, channels, tail, sizes, dtype, param_dtype=None, mean=1.0,
            std=2.0, steps=2, momentum=0.1, affine=True, track=True, tol=(1e-10, 1e-10),
            truth_tol=None, stats_tol=None):
    """SyncBatchNorm on this rank's shard vs `cls` on the whole batch (inputs in `dtype`,
    parameters and running statistics in `param_dtype`), `steps` training steps then eval.
    truth_tol: also against `cls` in float64 on the same (rounded) inputs."""
    param_dtype = param_dtype or (dtype if dtype == torch.float64 else torch.float32)
    gen = torch.Generator().manual_seed(len(case) * 7919 + channels)
    ref = cls(channels, momentum=momentum, affine=affine, track_running_stats=track)
    ref = ref.to(param_dtype)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(1 + 0.5 * torch.randn(channels, generator=gen))
            ref.bias.copy_(torch.randn(channels, generator=gen))
    sync = hvd.SyncBatchNorm(channels, momentum=momentum, affine=affine,
                             track_running_stats=track).to(param_dtype)
    sync.load_state_dict(ref.state_dict())
    truth = copy.deepcopy(ref).double() if truth_tol else None
    mine = shards(sizes)
    stats_tol = stats_tol or tol
    for step in range(steps):
        shape = (sum(sizes), channels) + tuple(tail)
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean).to(dtype)
        up = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        models = [(ref, dtype, tol)] + ([(truth, torch.float64, truth_tol)] if truth else [])
        results = []
        for model, dt, _ in models:
            model.zero_grad()
            full = x.to(dt).clone().requires_grad_()
            out = model(full)
            out.backward(up.to(dt))
            results.append((out, full.grad, model))
        sync.zero_grad()
        part = x[mine].clone().requires_grad_()
        got = sync(part)
        got.backward(up[mine])
        expect(case, got.dtype == dtype and part.grad.dtype == dtype,
               f"step {step}: result dtypes {got.dtype}, {part.grad.dtype}")
        sums = {}
        for name in ("weight", "bias") if affine else ():   # each rank's covers its shard
            sums[name] = hvd.allreduce(getattr(sync, name).grad.double(), op=hvd.Sum,
                                       name=f"sbn.{case}.{step}.{name}")
        for (out, grad, model), (_, dt, (rtol, atol)) in zip(results, models):
            label = f"step {step} vs {str(dt).replace('torch.', '')}"
            close(case, f"{label} output", got, out[mine], rtol, atol)
            close(case, f"{label} input grad", part.grad, grad[mine], rtol, atol)
            for name, total in sums.items():
                close(case, f"{label} {name} grad", total, getattr(model, name).grad, rtol,
                      max(atol, rtol * getattr(model, name).grad.abs().max().item()))
        count, gmean, gm2 = _global_stats(part.detach(), sync.process_set)
        expect(case, count == sum(sizes) * x[0, 0].numel(), f"count {count}")
        identical_everywhere(case, f"stats{step}", torch.cat([gmean, gm2]))
    if track:
        for model, dt, (rtol, atol) in [(ref, dtype, stats_tol)] + (
                [(truth, torch.float64, truth_tol)] if truth else []):
            label = f"vs {str(dt).replace('torch.', '')}"
            close(case, f"running_mean {label}", sync.running_mean, model.running_mean, rtol,
                  atol)
            close(case, f"running_var {label}", sync.running_var, model.running_var, rtol, atol)
        expect(case, int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == steps,
               f"num_batches_tracked {int(sync.num_batches_tracked)}")
        identical_everywhere(case, "running", torch.cat([sync.running_mean.double(),
                                                         sync.running_var.double()]))
    sync.eval()
    ref.eval()
    with torch.no_grad():
        x = (torch.randn((sum(sizes), channels) + tuple(tail), generator=gen,
                         dtype=torch.float64) * std + mean).to(dtype)
        close(case, "eval output", sync(x[mine]), ref(x)[mine], *tol)


def one_value_per_channel():
    """A whole batch of one value per channel raises on every rank, as BatchNorm does."""
    sizes = [1] + [0] * (n - 1)
    sync = hvd.SyncBatchNorm(3).double()
    try:
        sync(torch.randn(sizes[r], 3, dtype=torch.float64))
    except ValueError:
        pass
    else:
        failures.append("one value per channel: no ValueError")
    try:
        torch.nn.BatchNorm1d(3)(torch.randn(1, 3))
        failures.append("one value per channel: torch's BatchNorm1d no longer raises")
    except ValueError:
        pass


def failed_forward_counts_no_batch():
    """A forward whose statistics' collective fails (the last rank passes another number of
    channels, caught) changes no running statistic: with momentum=None the next batch is the
    first counted, and the running mean is its mean, as torch's BatchNorm1d has it (it counted
    the failed one, and weighed the next by 1/2, on every rank)."""
    if n == 1:
        return
    sync = hvd.SyncBatchNorm(3, momentum=None).double()
    try:
        sync(torch.randn(4, 5 if r == n - 1 else 3, dtype=torch.float64))
        failures.append("another number of channels on one rank: no error")
    except (hvd.MismatchError, ValueError) as error:    # that rank's own, quoted to the others
        want = ValueError if r == n - 1 else hvd.MismatchError
        expect("failed forward", isinstance(error, want) and "SyncBatchNorm(3) got an input of "
               "5 channels" in str(error), f"{type(error).__name__}: {error}")
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    sync(x)
    ref = torch.nn.BatchNorm1d(3, momentum=None).double()
    ref(torch.cat([x] * n))
    expect("failed forward", int(sync.num_batches_tracked) == 1,
           f"num_batches_tracked {int(sync.num_batches_tracked)}")
    expect("failed forward", torch.equal(sync.running_mean, ref.running_mean),
           f"running_mean {sync.running_mean.tolist()} want {ref.running_mean.tolist()}")


def tracking_turned_off():
    """track_running_stats turned off after the module was made (its buffers kept): as
    Horovod's, batch statistics over the set in eval too, and they update the running ones
    (with momentum, the unbiased variance), counting no batch; torch's BatchNorm instead
    normalizes with the running statistics in eval and updates none."""
    case = "tracking turned off"
    sizes = [2 + i for i in range(n)]
    x = torch.randn(sum(sizes), 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(11)) * 2 + 5
    for training in (False, True):
        sync = hvd.SyncBatchNorm(3).double().train(training)
        sync.track_running_stats = False
        ref = torch.nn.BatchNorm1d(3).double()      # training: batch statistics, updated
        want = ref(x)
        got = sync(x[shards(sizes)])
        close(case, f"output (training={training})", got, want[shards(sizes)], 1e-12, 1e-12)
        close(case, f"running_mean (training={training})", sync.running_mean,
              ref.running_mean, 1e-12, 1e-12)
        close(case, f"running_var (training={training})", sync.running_var,
              ref.running_var, 1e-12, 1e-12)
        expect(case, int(sync.num_batches_tracked) == 0,
               f"num_batches_tracked {int(sync.num_batches_tracked)} (training={training})")


def channels_against_num_features():
    """An input whose channels are not num_features: ValueError on every rank, before any
    statistic moves, where a weight or running statistics would be broadcast over them; with
    neither, as on Horovod, any number of channels normalizes."""
    case = "channels against num_features"
    x = torch.randn(5, 4, dtype=torch.float64)
    for track, affine in ((True, True), (False, True), (True, False)):
        sync = hvd.SyncBatchNorm(1, affine=affine, track_running_stats=track).double()
        for training in (True, False):
            try:
                sync.train(training)(x)
                failures.append(f"{case}: 4 channels into SyncBatchNorm(1) (track={track}, "
                                f"affine={affine}, training={training}): no error")
            except ValueError as error:
                expect(case, "SyncBatchNorm(1) got an input of 4 channels" in str(error),
                       str(error))
        if track:
            expect(case, int(sync.num_batches_tracked) == 0,
                   f"num_batches_tracked {int(sync.num_batches_tracked)}")
    free = hvd.SyncBatchNorm(1, affine=False, track_running_stats=False).double()
    sizes = [5] * n
    whole = torch.randn(5 * n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = torch.nn.functional.batch_norm(whole, None, None, training=True)
    close(case, "no weight, no statistics", free(whole[shards(sizes)]), want[shards(sizes)],
          1e-12, 1e-12)


def converted_model():
    """convert_sync_batchnorm on a model with two BatchNorm layers (the same collective names
    twice a step), trained two steps, against the plain model on the whole batch; revert."""
    case = "converted model"
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 1),
                                torch.nn.BatchNorm2d(3, momentum=None)).double()
    synced = hvd.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    expect(case, sum(isinstance(m, hvd.SyncBatchNorm) for m in synced.modules()) == 2,
           "convert_sync_batchnorm did not swap both layers")
    sizes = [2 + (i % 3) for i in range(n)]
    mine = shards(sizes)
    for step in range(2):
        x = torch.randn(sum(sizes), 2, 5, 5, dtype=torch.float64)
        plain.zero_grad()
        synced.zero_grad()
        full = x.clone().requires_grad_()
        want = plain(full)
        want.square().sum().backward()
        part = x[mine].clone().requires_grad_()
        got = synced(part)
        got.square().sum().backward()
        close(case, f"step {step} output", got, want[mine], 1e-10, 1e-10)
        close(case, f"step {step} input grad", part.grad, full.grad[mine], 1e-10, 1e-10)
        for (name, p), q in zip(synced.named_parameters(), plain.parameters()):
            total = hvd.allreduce(p.grad, op=hvd.Sum, name=f"sbn.model.{step}.{name}")
            close(case, f"step {step} {name} grad", total, q.grad, 1e-9, 1e-9)
    for a, b in zip(synced.buffers(), plain.buffers()):
        close(case, "buffers", a, b, 1e-10, 1e-10)
    reverted = hvd.SyncBatchNorm.revert_sync_batchnorm(synced)
    expect(case, [type(m) for m in reverted.modules()] == [type(m) for m in plain.modules()],
           "revert_sync_batchnorm did not restore the classes")


def in_process_set():
    """A SyncBatchNorm on a set of ranks 0 and 2 equals BatchNorm on their shards alone."""
    ps = hvd.add_process_set([0, 2])
    if r in (0, 2):
        sync = hvd.SyncBatchNorm(3, process_set=ps).double()
        ref = torch.nn.BatchNorm2d(3).double()
        x = torch.randn(7, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        mine = slice(0, 3) if r == 0 else slice(3, 7)
        full = x.clone().requires_grad_()
        want = ref(full)
        (want * x).sum().backward()
        part = x[mine].clone().requires_grad_()
        got = sync(part)
        (got * x[mine]).sum().backward()
        close("process set", "output", got, want[mine], 1e-10, 1e-10)
        close("process set", "input grad", part.grad, full.grad[mine], 1e-10, 1e-10)
        close("process set", "running_var", sync.running_var, ref.running_var, 1e-10, 1e-10)
    hvd.remove_process_set(ps)


unequal = [3 + 2 * i for i in range(n)]                     # 3, 5, 7, ...
with_empty = [4 + i for i in range(n - 1)] + [0] if n > 1 else [5]
CASES = [
    ("one value per channel", one_value_per_channel),
    ("a failed forward counts no batch", failed_forward_counts_no_batch),
    ("float64 2d", lambda: compare("float64 2d", torch.nn.BatchNorm2d, 3, (4, 4), [4] * n,
                                   torch.float64)),
    ("float64 empty rank, momentum None", lambda: compare(
        "float64 empty rank, momentum None", torch.nn.BatchNorm1d, 3, (), with_empty,
        torch.float64, steps=3, momentum=None)),
    ("float64 no running stats, no affine", lambda: compare(
        "float64 no running stats, no affine", torch.nn.BatchNorm2d, 2, (3, 2), with_empty,
        torch.float64, affine=False, track=False)),
    # Tight against float64 on the same float32 inputs; loose against torch's float32, whose
    # own error at this mean (it forms x * scale + shift) is ~1e-3 of the output's scale.
    ("float32 mean 1e4", lambda: compare(
        "float32 mean 1e4", torch.nn.BatchNorm2d, 4, (5, 5), unequal, torch.float32,
        mean=1e4, std=0.5, tol=(2e-2, 5e-3), truth_tol=(2e-6, 2e-6), stats_tol=(1e-6, 1e-6))),
    ("float16", lambda: compare(
        "float16", torch.nn.BatchNorm2d, 3, (4, 3), with_empty, torch.float16,
        tol=(2e-3, 4e-3), stats_tol=(1e-5, 1e-5))),
    ("float16 over 2048 per channel", lambda: compare(
        "float16 over 2048 per channel", torch.nn.BatchNorm1d, 2, (429,),
        [7 + i for i in range(n)], torch.float16, mean=3.0, std=1.5, steps=1,
        tol=(2e-3, 4e-3), stats_tol=(1e-6, 1e-6))),
    ("bfloat16", lambda: compare(
        "bfloat16", torch.nn.BatchNorm1d, 3, (6,), unequal, torch.bfloat16,
        param_dtype=torch.bfloat16, tol=(1.6e-2, 3e-2))),
    ("converted model", converted_model),
    ("tracking turned off", tracking_turned_off),
    ("channels against num_features", channels_against_num_features),
]
if n >= 3:
    CASES.append(("process set", in_process_set))



def check_sync_batch_norm():
    """Every case, then the failures of every rank named together."""
    failures.clear()
    for name, run in CASES:
        try:
            run()
        except Exception as error:                             # noqa: BLE001 - reported below
            failures.append(f"{name}: raised {type(error).__name__}: {error}")
            traceback.print_exc()
    everyone = hvd.allgather_object(failures)
    bad = [f"rank {i}: {f}" for i, fs in enumerate(everyone) for f in fs]
    assert not bad, "SyncBatchNorm failed:\n" + "\n".join(bad)


if __name__ == "__main__":
    hvd.init()
    check_sync_batch_norm()
    print(f"OK rank {r}", flush=True)
