"""Started as `python lightning_launch_check.py DEVICES NODES` (no MPI launcher): a small
fit under Trainer(strategy="ringreduce", devices=DEVICES, num_nodes=NODES). Each rank prints
its rank and the job's size, and whether its parameters match rank 0's bit for bit."""
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringreduce as hvd
import ringreduce.lightning  # noqa: F401  (registers strategy="ringreduce")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


devices, nodes = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = pl.Trainer(strategy="ringreduce", accelerator="cpu", devices=devices, num_nodes=nodes,
                     max_epochs=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
model = Tiny()
trainer.fit(model, DataLoader(data, batch_size=8))
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
same = torch.equal(hvd.broadcast(weights, root_rank=0, name="weights"), weights)
print(f"TRAINED rank {hvd.rank()} of {hvd.size()}, parameters as rank 0's: {same}", flush=True)
