"""A plain-torch mixture-of-experts network built the way MoE language models are: an
embedding, then blocks (an ``nn.ModuleList``), each a residual top-1 mixture of 4 experts whose
router sends every token to one expert (data-dependent: which tokens an expert runs, and
whether it runs at all, depends on the batch), then a norm and a head. The blocks' insides
cannot be traced into one graph; the model between them can."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 6, "batch_size": 8, "lr": 0.05, "log_every": 2}
VOCAB, SEQ, DIM, EXPERTS, BLOCKS = 32, 6, 16, 4, 4


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, DIM)) for _ in range(EXPERTS)
        )

    def forward(self, h):  # (B, T, DIM) -> (B, T, DIM)
        x = self.norm(h).reshape(-1, DIM)
        weight, choice = F.softmax(self.router(x), dim=-1).max(dim=-1)  # top-1 per token
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            picked = (choice == e).nonzero(as_tuple=True)[0]
            if picked.numel():  # an expert no token picked is not run
                out = out.index_add(0, picked, expert(x[picked]) * weight[picked, None])
        return h + out.reshape(h.shape)


class MoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, DIM))
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):  # (B, T) -> (B, T, VOCAB)
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def model():
    return MoELM()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(300 + rank)
    for _ in range(1000):
        start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1)) % VOCAB  # counting sequences: next token
        yield ids[:, :-1], ids[:, 1:]


def loss(output, targets):
    return F.cross_entropy(output.reshape(-1, VOCAB), targets.reshape(-1))
