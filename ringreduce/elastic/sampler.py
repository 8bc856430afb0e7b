"""`ElasticSampler` (Horovod's `horovod.torch.elastic.ElasticSampler` 0.28): a dataset split
across ranks like `DistributedSampler`, which skips the samples already processed this epoch
after a reset, so an epoch interrupted by a failure resumes where its last commit was.
"""
from __future__ import annotations

import random
from typing import Iterator, Sized

from torch.utils.data import Sampler

from ..sets import world


class ElasticSampler(Sampler):
    """Splits a dataset across ranks like `DistributedSampler`, and skips the samples already
    processed this epoch when it is restored or synchronised (held by a `TorchState`).

    Horovod's definition: the order is `range(len(dataset))`, shuffled with
    `random.Random(seed + epoch)` when `shuffle`; the first `processed_num` indices of it are
    dropped; the rest is padded by repeating it from its start to a multiple of `size()`, and
    rank r takes every `size()`-th index from position r. Use: `record_batch()` after each batch,
    `set_epoch()` at the end of each epoch (it forgets the processed samples)."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set = set()   # Horovod still defines it; 0.28 never fills it
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (its own shuffle) with nothing processed. Call it at the end of an
        epoch, so that a reset in the middle of one does not process samples twice."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of `batch_size` as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-read the job's size and this rank, and recompute the indices not yet processed."""
        self.num_replicas = world.size()
        self.rank = world.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = _repeat_to_length(self.remaining_indices, self.total_size)
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _repeat_to_length(items: list[int], length: int) -> list[int]:
    """`items` extended by repeating it from its start (Horovod's padding, which also works
    when fewer items remain than there are ranks)."""
    padded = list(items)
    while len(padded) < length:
        padded.extend(items[:length - len(padded)])
    return padded
