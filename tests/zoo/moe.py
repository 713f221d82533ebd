"""A plain-torch mixture of experts as current tutorials write one: a router picks one of 4
experts per sample (top-1), scaled by its gate; a token embedding beside the features (a table
``hybrid`` serves and ``allreduce-sparse`` gives sparse gradients). Worker 0's batches reach every expert in every
step; worker 1's reach two, a different two each step, so which experts get no gradient
differs per rank and per step (from step ``ALL_EXPERTS_UNTIL`` on: before it worker 1's
batches reach every expert too)."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 10, "batch_size": 8, "lr": 0.1, "log_every": 5}
EXPERTS, DIM, VOCAB = 4, 8, 64
ALL_EXPERTS_UNTIL = 0  # steps at the start in which every rank reaches every expert


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM)) for _ in range(EXPERTS)
        )
        self.head = nn.Linear(DIM, 1)
        with torch.no_grad():  # a router that starts out following the data's first dims
            self.router.weight.zero_()
            self.router.weight[:, :EXPERTS] += 4 * torch.eye(EXPERTS)
            self.router.bias.zero_()
            self.inp.weight.copy_(torch.eye(DIM))
            self.inp.bias.zero_()
            self.tok.weight.mul_(0.01)

    def forward(self, inputs):  # (x (B, DIM), ids (B,)) -> (B, 1)
        x, ids = inputs
        h = self.inp(x) + self.tok(ids)
        gate = F.softmax(self.router(h), dim=-1)  # (B, EXPERTS)
        weight, choice = gate.max(dim=-1)  # top-1
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            picked = (choice == e).nonzero(as_tuple=True)[0]
            if picked.numel():  # an expert no sample picked is not run
                out = out.index_add(0, picked, expert(h[picked]) * weight[picked, None])
        return self.head(h + out)


def model():
    return MoE()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1000):
        if rank == 0 or step < ALL_EXPERTS_UNTIL:
            experts = torch.arange(batch_size) % EXPERTS
        else:
            experts = (step + torch.arange(batch_size) % 2) % EXPERTS
        x = 0.3 * torch.randn(batch_size, DIM, generator=g)
        x[:, :EXPERTS] += 3 * F.one_hot(experts, EXPERTS)
        ids = torch.randint(0, VOCAB, (batch_size,), generator=g)
        yield (x, ids), torch.sin(x.sum(1, keepdim=True)) + 0.01 * ids[:, None]


def loss(output, targets):
    return F.mse_loss(output, targets)
