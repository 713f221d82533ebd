"""A deep ReLU MLP on a teacher-student classification task, for pipeline staleness studies.

Inputs are N(0, 1) in 32 dimensions; labels are the argmax of a fixed random two-layer tanh
teacher (32 -> 64 -> 10). The student is a 9-layer ReLU MLP (32 -> 128 x 7 -> 10) as an
``nn.Sequential`` of 17 layers, so it pipelines over up to 9 stages (one Linear each). The
training stream is endless and seeded; validation is 2,048 held-out samples.
Run: ``hpar run examples/deep_mlp.py --gpus 8 --strategy pipeline --micro-batches 1``.
Optimizer: SGD with momentum 0.9 and dampening 0.9 (the exponential moving average form of
SpecTrain), or AdamW with ``HPAR_DEEP_MLP_OPT=adamw``.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

HPAR = {"batch_size": 64, "steps": 875, "lr": 0.6, "log_every": 100}
DIM, WIDTH, DEPTH, CLASSES = 32, 128, 9, 10
_TEACHER = {}


def teacher():
    """The fixed random teacher (seed 7), built once per process."""
    if "t" not in _TEACHER:
        g = torch.Generator().manual_seed(7)
        _TEACHER["t"] = (torch.randn(DIM, 64, generator=g) / DIM**0.5, torch.randn(64, CLASSES, generator=g) / 8.0)
    return _TEACHER["t"]


def labels(x):
    a, b = teacher()
    return (torch.tanh(x @ a) @ b).argmax(1)


def model():
    layers = [nn.Linear(DIM, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    for layer in layers[:-1]:  # Glorot initialisation: with torch's default the deep stack barely trains
        if isinstance(layer, nn.Linear):
            nn.init.xavier_normal_(layer.weight)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        x = torch.randn(batch_size, DIM, generator=g)
        yield x, labels(x)


def loss(output, targets):
    return F.cross_entropy(output, targets)


def optimizer(params):
    lr = HPAR["lr"]
    if os.environ.get("HPAR_DEEP_MLP_OPT") == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.9)


def evaluate(model):
    x = torch.randn(2048, DIM, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        logits = model(x)
    return {
        "accuracy": (logits.argmax(1) == labels(x)).float().mean().item(),
        "loss": F.cross_entropy(logits, labels(x)).item(),
    }
