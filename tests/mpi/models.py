"""The small models the multi-rank test workers train: conv + two linear layers on 8x8 inputs,
and an embedding of tokens under a linear head."""
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).flatten(1))))


class Embedder(nn.Module):
    """Rows of tokens -> their embeddings (sparse gradients by default, a recommender's)
    averaged -> a linear head over 3 classes."""

    def __init__(self, rows=20, sparse=True):
        super().__init__()
        self.embedding = nn.Embedding(rows, 4, sparse=sparse)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))
