"""A deep stack of 8 small layers for a 4-stage pipeline (2 layers per stage)."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.05, "log_every": 4, "micro_batches": 4}


def model():
    layers = [nn.Linear(4, 16), nn.Tanh()]
    for _ in range(2):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    layers += [nn.Linear(16, 1), nn.Identity()]
    return nn.Sequential(*layers)


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(700 + rank)
    for _ in range(1000):
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True) * 0.5


def loss(output, targets):
    return F.mse_loss(output, targets)
