"""A model with two heads that returns a tuple (main logits, auxiliary regression)."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.1, "log_every": 4}


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(5, 16)
        self.cls = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 1)

    def forward(self, x):  # (B, 5) -> ((B, 3), (B, 1))
        h = torch.relu(self.trunk(x))
        return self.cls(h), self.aux(h)


def model():
    return TwoHeads()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(600 + rank)
    for _ in range(1000):
        x = torch.randn(batch_size, 5, generator=g)
        yield x, (x[:, :3].argmax(1), x.sum(1, keepdim=True))


def loss(output, targets):
    logits, aux = output
    labels, value = targets
    return F.cross_entropy(logits, labels) + 0.1 * F.mse_loss(aux, value)
