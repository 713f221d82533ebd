"""Word-level language model on WikiText-2, shaped like the Parallax paper's LM.

A large input embedding and a sampled-softmax output embedding hold ~98% of the parameters
(both nn.Embedding tables over the whole vocabulary of the shipped text, 18,328 words); an
LSTM sits between. Training uses sampled softmax: each step scores the batch's target words
plus ``NUM_SAMPLED`` negatives drawn from a log-uniform (Zipf) proposal over the
frequency-sorted vocabulary, with the usual log Q correction (Jean et al., ACL 2015; the
candidate sampler of TensorFlow's ``sampled_softmax_loss``). ``evaluate`` computes the full
softmax perplexity on the validation split.

Data: trains on WikiText-2 *test*, evaluates on *valid* (examples/data/wikitext-2, CC BY-SA 3.0).
Run: ``hpar run examples/lm.py --gpus 2``.
"""

import collections
import gzip
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "wikitext-2")
BPTT = 35
EMBED = 256
HIDDEN = 96
NUM_SAMPLED = 128
EVAL_TOKENS = 10_000

HPAR = {
    "batch_size": 32,
    "steps": 200,
    "lr": 0.05,
    "log_every": 10,
    "precision": "bf16",
    "eval_every": 50,
    "clip_grad_norm": 2.0,
}
WARMUP = 20  # steps of linear warm-up before the cosine decay


def _tokens(split):
    with gzip.open(os.path.join(DATA, f"{split}.txt.gz"), "rt", encoding="utf-8") as f:
        return f.read().replace("\n", " <eos> ").split()


_CACHE = {}


def corpus():
    """(vocabulary sorted by frequency, train ids, valid ids); the vocabulary covers both splits."""
    if "corpus" not in _CACHE:
        train, valid = _tokens("test"), _tokens("valid")
        counts = collections.Counter(train + valid)
        vocab = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        index = {w: i for i, w in enumerate(vocab)}
        _CACHE["corpus"] = (vocab, torch.tensor([index[w] for w in train]), torch.tensor([index[w] for w in valid]))
    return _CACHE["corpus"]


def log_uniform_log_q(ids, vocab_size):
    """log of the log-uniform proposal probability of each id (ids sorted by frequency)."""
    ids = ids.double()
    p = (torch.log(ids + 2) - torch.log(ids + 1)) / math.log(vocab_size + 1)
    return torch.log(p).float()


class SampledSoftmaxLM(nn.Module):
    """Embedding(V, 256) -> LSTM(256, 96) -> Linear(96, 256) -> sampled softmax over Embedding(V, 256) + bias.

    ``forward((tokens, targets))`` with tokens and targets of shape (batch, BPTT) returns
    (logits over the candidate set, shape (batch*BPTT, C); target index in the candidate set,
    shape (batch*BPTT,)) in training mode, and full-vocabulary logits in eval mode.
    """

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, EMBED)
        self.lstm = nn.LSTM(EMBED, HIDDEN, batch_first=True)
        self.proj = nn.Linear(HIDDEN, EMBED)
        self.softmax_w = nn.Embedding(vocab_size, EMBED)
        self.softmax_b = nn.Embedding(vocab_size, 1)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.uniform_(self.softmax_w.weight, -0.1, 0.1)
        nn.init.zeros_(self.softmax_b.weight)

    def hidden(self, tokens):
        # the LSTM runs in fp32 even under bf16 autocast (oneDNN's CPU LSTM has no bf16 kernel
        # on every CPU); the projections and the softmax matmul take the autocast dtype
        with torch.autocast(tokens.device.type, enabled=False):
            out, _ = self.lstm(self.embedding(tokens).float())
        return self.proj(out).reshape(-1, EMBED)

    def forward(self, inputs):
        tokens, targets = inputs
        h = self.hidden(tokens)
        if not self.training:
            return h @ self.softmax_w.weight.t() + self.softmax_b.weight.t()
        u = torch.rand(NUM_SAMPLED, device=targets.device)  # on the targets' device (CPU or GPU)
        sampled = (torch.exp(u * math.log(self.vocab_size + 1)) - 1).long().clamp_(0, self.vocab_size - 1)
        candidates, inverse = torch.unique(torch.cat([targets.reshape(-1), sampled]), return_inverse=True)
        logits = h @ self.softmax_w(candidates).t() + self.softmax_b(candidates).t()
        logits = logits - log_uniform_log_q(candidates, self.vocab_size)
        return logits, inverse[: targets.numel()]


def model():
    return SampledSoftmaxLM(len(corpus()[0]))


def windows(rank, world_size, batch_size, length):
    """This rank's contiguous shard of the training stream as (batch, length) windows of
    tokens and of the tokens one position on (the targets)."""
    ids = corpus()[1]
    shard = len(ids) // world_size
    ids = ids[rank * shard : (rank + 1) * shard]
    rows = (len(ids) - 1) // batch_size
    x = ids[: rows * batch_size].view(batch_size, rows)
    y = ids[1 : rows * batch_size + 1].view(batch_size, rows)
    for i in range(0, rows - length + 1, length):
        yield x[:, i : i + length], y[:, i : i + length]


def data(rank, world_size, batch_size):
    """This rank's contiguous shard of the training stream, as (batch, BPTT) windows."""
    for x, y in windows(rank, world_size, batch_size, BPTT):
        yield (x, y), y


def loss(output, targets):
    if isinstance(output, tuple):
        logits, target_index = output
        return F.cross_entropy(logits, target_index)
    return F.cross_entropy(output, targets.reshape(-1))


def optimizer(params):
    return torch.optim.Adagrad(params, lr=HPAR["lr"])


def warmup_cosine(opt, total, warmup=WARMUP):
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% of the rate at step ``total``."""

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def scheduler(opt):
    """Linear warm-up over WARMUP steps, then cosine decay to 10% of the rate at the last step."""
    return warmup_cosine(opt, HPAR["steps"])


def evaluate(model):
    """Full-softmax perplexity on the first EVAL_TOKENS tokens of the validation split
    (on whatever device the model is: hpar hands it over on the CPU)."""
    dev = next(model.parameters()).device
    ids = corpus()[2][: EVAL_TOKENS + 1].to(dev)
    rows = (len(ids) - 1) // BPTT
    x = ids[: rows * BPTT].view(rows, BPTT)
    y = ids[1 : rows * BPTT + 1].view(rows, BPTT)
    total, count = 0.0, 0
    for i in range(0, rows, 64):
        logits = model((x[i : i + 64], y[i : i + 64]))
        total += F.cross_entropy(logits, y[i : i + 64].reshape(-1), reduction="sum").item()
        count += y[i : i + 64].numel()
    return {"perplexity": math.exp(total / count)}
