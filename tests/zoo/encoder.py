"""A text classifier on torch's own nn.TransformerEncoder: token and position embeddings, the
encoder's layers (an nn.ModuleList of TransformerEncoderLayer), mean pooling, a linear head."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 10, "batch_size": 8, "lr": 0.05, "log_every": 2}
VOCAB, SEQ, DIM = 40, 8, 16


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids):  # ids (B, SEQ) -> logits (B, 2)
        h = self.encoder(self.tokens(ids) + self.positions)
        return self.head(h.mean(1))


def model():
    return Classifier()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(800 + rank)
    for _ in range(1000):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
        yield ids, (ids[:, 0] < VOCAB // 2).long()  # the class is in the first token


def loss(output, targets):
    return F.cross_entropy(output, targets)
