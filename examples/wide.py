"""A speed benchmark model for pipelining: 8 wide layers and small activations.

The model is ``nn.Sequential`` of 8 ``Linear(2048, 2048)`` layers, each followed by ReLU
(the last without), about 33.6 M parameters (134 MB in float32), while one sample's
activation between layers is only 2048 floats (8 KB). That is the regime where a pipeline
(which moves activations) beats data parallelism (which moves every gradient each step).

The data are SYNTHETIC: Gaussian inputs and a fixed random linear target, drawn from a
seeded generator, only so that the benchmark has something to compute on; the model learns
nothing of interest from them. Run: ``hpar run examples/wide.py --gpus 2 --strategy pipeline``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, LAYERS = 2048, 8
HPAR = {"batch_size": 32, "steps": 30, "lr": 0.001, "micro_batches": 4, "log_every": 5}


def model():
    layers = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def data(rank, world_size, batch_size):
    """Synthetic batches: x ~ N(0, 1) of shape (batch_size, 2048), target = x @ A / sqrt(2048)
    for a fixed random A; 64 batches per epoch, different for every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    a = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    for _ in range(64):
        x = torch.randn(batch_size, WIDTH, generator=g)
        yield x, x @ a


def loss(output, targets):
    return F.mse_loss(output, targets)


def optimizer(params):
    return torch.optim.SGD(params, lr=HPAR["lr"], momentum=0.9)
