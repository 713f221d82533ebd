"""A language model shaped like the Parallax paper's LM-1B, on SYNTHETIC tokens, for
projections with ``hpar profile`` (Kim et al., "Parallax: Sparsity-aware Data Parallel
Training of Deep Neural Networks", EuroSys 2019, LM on the One Billion Word benchmark).

Shape: vocabulary 793,470, input embedding 512, one LSTM layer of 2,048 units with a
projection to 512, sampled softmax with 8,192 negatives over an output embedding of
793,470 x 512 (plus a bias table), 20 tokens per sequence, 128 sequences per GPU (the
paper's 128 x 20 batch): about 813M parameters, 3.3 GB in float32, 99% in the two tables.

The tokens are NOT real text: each is drawn from a log-uniform (Zipf-like) distribution over
the frequency-sorted vocabulary, the same proposal the sampled softmax uses, so the rows a
batch touches (alpha) have the right order of magnitude but are not the real LM-1B figures.
No data set is needed and importing the file does no work.

Profiling cost: building the model allocates the two tables (3.3 GB, a few seconds). The
negatives and the output-embedding rows are looked up before the LSTM runs, so the
sparsity pass can stop each forward pass after the embedding lookups; compute is timed on
a reduced batch and scaled (``hpar profile`` picks it, or ``--timing-batch-size``), and
with ``--device-tflops`` the compute time comes from FLOPs anyway. Run::

    hpar profile examples/lm1b_shape.py --gpus 48 --hosts 8x6 --bandwidth 100Gbps --device-tflops 4
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 793_470
EMBED = 512
HIDDEN = 2048
NUM_SAMPLED = 8192
BPTT = 20

HPAR = {"batch_size": 128, "steps": 20, "lr": 0.2}


def log_uniform(shape, generator=None):
    """Ids in [0, VOCAB) with P(k) = log((k+2)/(k+1)) / log(VOCAB+1) (inverse CDF)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    return (torch.exp(u * math.log(VOCAB + 1)).floor().long() - 1).clamp_(0, VOCAB - 1)


def log_q(ids):
    ids = ids.double()
    return torch.log((torch.log(ids + 2) - torch.log(ids + 1)) / math.log(VOCAB + 1)).float()


def _table(block=1 << 15):
    """A VOCAB x EMBED table of U(-0.05, 0.05) values, a random block of rows repeated
    (cheap to build; rows repeat every ``block`` ids, harmless for a shape model)."""
    rows = torch.empty(block, EMBED).uniform_(-0.05, 0.05)
    return rows.repeat(math.ceil(VOCAB / block), 1)[:VOCAB].clone()


class LM1BShape(nn.Module):
    """Embedding -> LSTM(2048, proj 512) -> sampled softmax. ``forward((tokens, targets))``
    with both ``[batch, BPTT]`` int64; returns logits ``[batch*BPTT, 1 + NUM_SAMPLED]`` whose
    column 0 is the true word (log Q corrected, Jean et al., ACL 2015)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, EMBED, _weight=_table())
        self.softmax_w = nn.Embedding(VOCAB, EMBED, _weight=_table())
        self.softmax_b = nn.Embedding(VOCAB, 1, _weight=torch.zeros(VOCAB, 1))
        self.lstm = nn.LSTM(EMBED, HIDDEN, batch_first=True, proj_size=EMBED)

    def forward(self, inputs):
        tokens, targets = inputs
        flat = targets.reshape(-1)
        sampled = log_uniform((NUM_SAMPLED,)).to(flat.device)
        ids = torch.cat([flat, sampled])
        w, b = self.softmax_w(ids), self.softmax_b(ids).squeeze(1)  # looked up first, see above
        h, _ = self.lstm(self.embedding(tokens))
        h = h.reshape(-1, EMBED)
        n = flat.numel()
        true = (h * w[:n]).sum(1) + b[:n] - log_q(flat)
        neg = h @ w[n:].t() + b[n:] - log_q(sampled)
        neg = neg.masked_fill(sampled.unsqueeze(0) == flat.unsqueeze(1), float("-inf"))
        return torch.cat([true.unsqueeze(1), neg], 1)


def model():
    return LM1BShape()


def data(rank, world_size, batch_size):
    """Synthetic log-uniform token streams, a different seed per rank (see the docstring)."""
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        seq = log_uniform((batch_size, BPTT + 1), generator=g)
        yield (seq[:, :-1], seq[:, 1:]), seq[:, 1:]


def loss(output, targets):
    return F.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long, device=output.device))
