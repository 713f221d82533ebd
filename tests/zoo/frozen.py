"""An MLP whose first layer is frozen (requires_grad=False), as when fine-tuning."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.1, "log_every": 4}


def model():
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    m[0].weight.requires_grad_(False)
    return m


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(400 + rank)
    for _ in range(1000):
        x = torch.randn(batch_size, 6, generator=g)
        yield x, x[:, :3].sum(1, keepdim=True)


def loss(output, targets):
    return F.mse_loss(output, targets)
