"""The main job: data-parallel training of a small CNN on scikit-learn's handwritten digits.

    mpiexec -n 2 python scripts/train_digits.py [--epochs 15] [--batch-size 64]
                                               [--checkpoint-dir DIR [--checkpoint-every STEPS]]

Each rank trains on its own shard of every global batch; gradients are averaged by
ringreduce's DistributedOptimizer while backward runs. Rank 0 shows a progress bar, the loss and
held-out accuracy per epoch, and the throughput; at the end it trains the same model in a
single process on whole batches (the reference, skipped with --no-reference) and prints both
accuracies, and every rank checks that all ranks hold bitwise-identical parameters.
With --checkpoint-dir, a checkpoint is written atomically every --checkpoint-every steps and a
rerun of the same command resumes from it: the final parameters equal those of an
uninterrupted run, bit for bit. The data set ships inside scikit-learn: no download.
"""
import argparse
import functools
import hashlib
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm

import ringreduce as hvd


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed=0):
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def batches(n_samples, batch_size, epoch, rank, size):
    """Global batches in a per-epoch order shared by all ranks; each rank takes its slice."""
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(1000 + epoch))
    per_rank = batch_size // size
    for start in range(0, n_samples - batch_size + 1, batch_size):
        yield order[start + rank * per_rank:start + (rank + 1) * per_rank]


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train(args, rank, size, distributed, progress=None):
    (train_x, train_y), (test_x, test_y) = load_data()
    torch.manual_seed(42)
    model = DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    done_steps = 0
    if distributed:     # (the README's order: wrap, then broadcast)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        checkpoint = os.path.join(args.checkpoint_dir or "", "checkpoint.pt")
        if args.checkpoint_dir and os.path.exists(checkpoint):
            done_steps = hvd.checkpoint.load(checkpoint, model, opt)["step"]
            if progress is not None:
                progress(f"resumed from {checkpoint} after step {done_steps}")
    steps_per_epoch = len(train_y) // args.batch_size
    samples, seconds, step = 0, 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros(1)
        bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}",
                   disable=progress is None, leave=False)
        start = time.perf_counter()
        for index in batches(len(train_y), args.batch_size, epoch, rank, size):
            step += 1
            bar.update()
            if step <= done_steps:      # resuming: these steps are in the checkpoint
                continue
            opt.zero_grad()
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            samples += args.batch_size
            if distributed and args.checkpoint_dir and step % args.checkpoint_every == 0:
                hvd.checkpoint.save(checkpoint, model, opt, extra={"step": step})
        seconds += time.perf_counter() - start
        bar.close()
        model.eval()
        if distributed:
            loss_sum = hvd.allreduce(loss_sum, op=hvd.Average, name="epoch.loss")
        if progress is not None:
            progress(f"epoch {epoch + 1:2d}: loss {loss_sum.item() / steps_per_epoch:.4f}  "
                     f"held-out accuracy {accuracy(model, test_x, test_y):.4f}")
    return model, accuracy(model, test_x, test_y), samples / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the single-process reference run")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here, and resume from them")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between saves")
    args = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)    # one thread per rank: ranks share the machine's cores
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} must divide by the {size} ranks")
    say = functools.partial(print, flush=True) if rank == 0 else None   # (lines as they come)
    if say:
        say(f"ringreduce: {size} ranks, global batch {args.batch_size} "
            f"({args.batch_size // size} per rank), {args.epochs} epochs on sklearn digits")
    model, acc, throughput = train(args, rank, size, True, say)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    try:
        hvd.check_consistency(model)
        identical = True
    except hvd.ConsistencyError as error:
        identical = False
        print(error, flush=True)
    if rank == 0:
        print(f"distributed ({size} ranks): held-out accuracy {acc:.4f}, "
              f"{throughput:,.0f} samples/s")
        if not args.no_reference and not args.checkpoint_dir:
            _, ref_acc, ref_throughput = train(args, 0, 1, False)
            print(f"single process (reference): held-out accuracy {ref_acc:.4f}, "
                  f"{ref_throughput:,.0f} samples/s")
        print(f"parameters bitwise identical on all {size} ranks: "
              f"{'yes' if identical else 'NO'} (sha256 {digest[:16]})")
    hvd.barrier()
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
