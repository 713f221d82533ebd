"""An MLP with BatchNorm1d, as tabular and vision tutorials build one: running statistics
are buffers each worker updates from its own batches (issue 67)."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 6, "batch_size": 16, "lr": 0.05, "log_every": 2}


def model():
    return nn.Sequential(
        nn.Linear(8, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 1),
    )


def _batch(g, batch_size):
    x = torch.randn(batch_size, 8, generator=g) * 2 + 1
    return x, (x[:, :4].sum(1, keepdim=True) > 2).float()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(700 + rank)
    for _ in range(1000):
        yield _batch(g, batch_size)


def loss(output, targets):
    return F.binary_cross_entropy_with_logits(output, targets)


def evaluate(model):
    """Loss on a fixed held-out batch in eval mode: it reads the running statistics."""
    x, y = _batch(torch.Generator().manual_seed(99), 256)
    model.eval()
    with torch.no_grad():
        value = F.binary_cross_entropy_with_logits(model(x), y).item()
    model.train()
    return {"eval_loss": value}
