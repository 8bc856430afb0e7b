"""PyTorch Lightning with ringreduce: a CNN on scikit-learn's handwritten digits.

    pip install -e ".[mpich,lightning,demo]"
    mpiexec -n 2 python scripts/train_lightning.py [--epochs 8] [--batch-size 32]
                                                   [--accumulate 1] [--checkpoint-dir DIR]

The usual LightningModule; `import ringreduce.lightning` registers the strategy, and
`Trainer(strategy="ringreduce")` does the rest: each rank gets a DistributedSampler shard,
gradients are averaged by ringreduce's ring allreduce while backward runs, metrics logged with
sync_dist=True are averaged over the ranks, and rank 0 writes the checkpoints. At the end
every rank checks that all ranks hold bitwise-identical parameters. With --checkpoint-dir, a
rerun resumes from the last checkpoint. --batch-size is per rank.
"""
import argparse
import hashlib
import os
import warnings

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ringreduce as hvd
import ringreduce.lightning  # noqa: F401  (registers strategy="ringreduce")
from train_digits import load_data     # the same data as the main job


class DigitsModule(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True,
                 prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)]


class EpochReport(pl.Callback):
    """One line per epoch on rank 0 (the metrics are the ranks' averages already)."""

    def on_validation_epoch_end(self, trainer, module):
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        print(f"epoch {trainer.current_epoch + 1:2d}  "
              f"last batch's train_loss {metrics['train_loss']:.4f}  "
              f"val_loss {metrics['val_loss']:.4f}  val_acc {metrics['val_acc']:.4f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="accumulate_grad_batches (backward passes per step)")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)                  # CPU: one thread per rank per core
    pl.seed_everything(42, verbose=False)
    (x, y), (x_held_out, y_held_out) = load_data()
    train, held_out = TensorDataset(x, y), TensorDataset(x_held_out, y_held_out)
    callbacks = [EpochReport()]
    last = None
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True))
        candidate = os.path.join(args.checkpoint_dir, "last.ckpt")
        last = candidate if os.path.exists(candidate) else None
    trainer = pl.Trainer(strategy="ringreduce", accelerator="auto", max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate, sync_batchnorm=True,
                         gradient_clip_val=1.0, logger=False, callbacks=callbacks,
                         enable_checkpointing=bool(args.checkpoint_dir),
                         enable_progress_bar=False, enable_model_summary=False)
    if trainer.is_global_zero:
        print(f"ringreduce strategy: {hvd.size()} ranks, device {trainer.strategy.root_device}, "
              f"{args.batch_size} samples per rank per batch", flush=True)
    module = DigitsModule(args.lr)
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(held_out, batch_size=args.batch_size), ckpt_path=last)
    hvd.check_consistency(module)      # ConsistencyError on every rank if they differ
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes()
                                     for t in module.state_dict().values())).hexdigest()
    if trainer.is_global_zero:
        print(f"final val_acc {trainer.callback_metrics['val_acc']:.4f}; parameters "
              f"bitwise-identical on all {hvd.size()} ranks (sha256 {digest[:12]})", flush=True)


if __name__ == "__main__":
    main()
