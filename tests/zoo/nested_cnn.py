"""A CNN written as an nn.Sequential of blocks (each block an nn.Sequential with
BatchNorm, and a head with Dropout): its layers are the 3 top-level blocks."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.05, "log_every": 4}


def model():
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 2 * 2, 3)),
    )


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(200 + rank)
    for _ in range(1000):
        y = torch.randint(0, 3, (batch_size,), generator=g)
        x = torch.randn(batch_size, 1, 8, 8, generator=g) * 0.3 + y.view(-1, 1, 1, 1).float()
        yield x, y


def loss(output, targets):
    return F.cross_entropy(output, targets)
