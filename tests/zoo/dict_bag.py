"""A recommendation-style model fed a dict of tensors: an EmbeddingBag over variable-length
id lists (flat ids plus offsets) and a dense feature vector."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.2, "log_every": 4}
ITEMS = 200


class BagModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(ITEMS, 8, mode="mean")
        self.dense = nn.Linear(4, 8)
        self.head = nn.Linear(16, 1)

    def forward(self, batch):  # {"dense": (B, 4), "ids": (N,), "offsets": (B,)} -> (B,)
        pooled = self.bag(batch["ids"], batch["offsets"])
        return self.head(torch.cat([pooled, torch.relu(self.dense(batch["dense"]))], 1)).squeeze(1)


def model():
    return BagModel()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(300 + rank)
    for _ in range(1000):
        lengths = torch.randint(1, 4, (batch_size,), generator=g)
        ids = torch.randint(0, ITEMS, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        dense = torch.randn(batch_size, 4, generator=g)
        yield {"dense": dense, "ids": ids, "offsets": offsets}, dense.sum(1)


def loss(output, targets):
    return F.mse_loss(output, targets)
