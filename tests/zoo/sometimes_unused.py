"""A model with a branch (and its parameters) that only some batches use: a batch whose
flag is 0 skips the ``extra`` layer, so its parameters get no gradient in that step."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.1, "log_every": 4}


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, inputs):  # (x (B, 4), flag (B,)) -> (B, 1)
        x, flag = inputs
        h = torch.tanh(self.body(x))
        if bool(flag[0]):
            h = torch.tanh(self.extra(h))
        return self.head(h)


def model():
    return Branchy()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(500)  # every rank takes the same branch each step
    step = 0
    for _ in range(1000):
        x = torch.randn(batch_size, 4, generator=g) + rank
        step += 1
        yield (x, torch.full((batch_size,), step % 2)), x.sum(1, keepdim=True) * 0.1


def loss(output, targets):
    return F.mse_loss(output, targets)
