"""A dense stack of 8 wide layers (33.6 MB of parameters, no embedding table), trained with
momentum SGD: the weights, their gradients and the momentum dominate a worker's memory, so
the pipeline layout that spreads them over the most stages holds the least per worker."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 4, "batch_size": 8, "lr": 0.01, "log_every": 2}
WIDTH = 1024


def model():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1], nn.Linear(WIDTH, 1))


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(800 + rank)
    for _ in range(1000):
        x = torch.randn(batch_size, WIDTH, generator=g)
        yield x, x[:, :4].sum(1, keepdim=True)


def loss(output, targets):
    return F.mse_loss(output, targets)


def optimizer(params):
    return torch.optim.SGD(params, lr=HPAR["lr"], momentum=0.9)
