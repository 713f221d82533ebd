"""A small language model whose output projection shares the embedding's weight (weight
tying, as in most language models): ``self.out.weight = self.emb.weight``; a second,
untied table of document ids is row-sparse (what hybrid serves from its servers)."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 12, "batch_size": 8, "lr": 0.5, "log_every": 4}
VOCAB, DIM, CTX, DOCS = 64, 16, 4, 1000


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.doc = nn.Embedding(DOCS, DIM)
        self.mix = nn.Linear(CTX * DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight  # one parameter, two users

    def forward(self, ids):  # ids (B, CTX + 1): tokens, document -> logits (B, VOCAB)
        h = self.mix(self.emb(ids[:, :CTX]).flatten(1)) + self.doc(ids[:, CTX])
        return self.out(torch.tanh(h))


def model():
    return TiedLM()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(1000):
        ids = torch.randint(0, VOCAB, (batch_size, CTX), generator=g)
        doc = torch.randint(0, DOCS, (batch_size, 1), generator=g)
        yield torch.cat([ids, doc], 1), (ids[:, 0] + 1) % VOCAB  # next token: learnable from the first one


def loss(output, targets):
    return F.cross_entropy(output, targets)
