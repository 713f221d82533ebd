"""Recommendation-style click-through model on a SYNTHETIC Zipf-distributed click stream.

The data is synthetic (no real users): user, item and category ids are drawn from Zipf
laws (popular ids much more frequent, as in real click logs), each sample carries a user,
a candidate item with its category, and a bag of 8 recently clicked items. The click label
is drawn from a hidden ground-truth model (a dot product of fixed random user and item
vectors plus an item-popularity bias, through a sigmoid), so a model can learn it and the
validation AUC measures how much it did (0.5 = chance).

Model (DLRM/Wide&Deep-shaped): three large nn.Embedding tables (users, items, categories)
and an nn.EmbeddingBag over the item history, ~3.2M embedding parameters in all, feeding a
small MLP. The tables hold >99% of the parameters while a batch touches a few hundred
rows: the case hybrid data parallelism (Parallax) is for.

Run: ``hpar run examples/recsys.py --gpus 2 --strategy hybrid``.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

USERS, ITEMS, CATEGORIES = 100_000, 50_000, 1_000
DIM, HISTORY, LATENT = 16, 8, 8
ZIPF_S = 1.05
VALID_SAMPLES = 20_000

HPAR = {"batch_size": 256, "steps": 300, "lr": 0.1, "log_every": 20}

_CACHE = {}


def _zipf_cdf(n):
    if n not in _CACHE:
        w = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** ZIPF_S
        _CACHE[n] = torch.cumsum(w, 0) / w.sum()
    return _CACHE[n]


def zipf(n, size, generator):
    """``size`` ids in [0, n) drawn from a Zipf law with exponent ZIPF_S; ids are scattered
    by a fixed permutation so popular ids are not all adjacent rows."""
    u = torch.rand(size, generator=generator, dtype=torch.float64)
    rank = torch.searchsorted(_zipf_cdf(n), u).clamp_(max=n - 1)
    return _perm(n)[rank]


def _perm(n):
    key = ("perm", n)
    if key not in _CACHE:
        _CACHE[key] = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    return _CACHE[key]


def _truth():
    """The hidden ground-truth model that draws the click labels (fixed seed)."""
    if "truth" not in _CACHE:
        g = torch.Generator().manual_seed(12345)
        _CACHE["truth"] = (
            torch.randn(USERS, LATENT, generator=g),
            torch.randn(ITEMS, LATENT, generator=g),
            torch.randn(ITEMS, generator=g) * 0.5,
        )
    return _CACHE["truth"]


def _samples(n, generator):
    users = zipf(USERS, (n,), generator)
    items = zipf(ITEMS, (n,), generator)
    categories = items % CATEGORIES
    history = zipf(ITEMS, (n, HISTORY), generator)
    u, v, b = _truth()
    score = (
        (u[users] * v[items]).sum(1) / math.sqrt(LATENT) * 1.5 + b[items] + 0.2 * (v[history].mean(1) * v[items]).sum(1)
    )
    clicks = torch.bernoulli(torch.sigmoid(score), generator=generator)
    return {"user": users, "item": items, "category": categories, "history": history}, clicks


class ClickModel(nn.Module):
    """Embeddings (user, item, category, bag of history items) -> MLP -> click logit."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(USERS, DIM)
        self.item = nn.Embedding(ITEMS, DIM)
        self.category = nn.Embedding(CATEGORIES, DIM)
        self.history = nn.EmbeddingBag(ITEMS, DIM, mode="mean")
        for emb in (self.user, self.item, self.category, self.history):
            nn.init.normal_(emb.weight, std=0.05)
        self.mlp = nn.Sequential(nn.Linear(4 * DIM + 2, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        u, i = self.user(x["user"]), self.item(x["item"])
        c, h = self.category(x["category"]), self.history(x["history"])
        dots = torch.stack([(u * i).sum(1), (h * i).sum(1)], 1)
        return self.mlp(torch.cat([u, i, c, h, dots], 1)).squeeze(1)


def model():
    return ClickModel()


def data(rank, world_size, batch_size):
    """This rank's endless synthetic click stream (independent seed per rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(1_000_000):
        yield _samples(batch_size, g)


def loss(output, targets):
    return F.binary_cross_entropy_with_logits(output, targets)


def optimizer(params):
    return torch.optim.Adagrad(params, lr=HPAR["lr"])


def auc(scores, labels):
    """Area under the ROC curve (Mann-Whitney U statistic, ties averaged)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    sorted_scores = scores[order]
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    mean_rank = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, ranks[order]) / counts
    ranks[order] = mean_rank[inverse]
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def evaluate(model):
    """Validation AUC and log-loss on VALID_SAMPLES held-out synthetic samples (on whatever
    device the model is: hpar hands it over on the CPU; the metrics are computed on the CPU)."""
    dev = next(model.parameters()).device
    x, y = _samples(VALID_SAMPLES, torch.Generator().manual_seed(999))
    logits = torch.cat(
        [model({k: v[i : i + 4096].to(dev) for k, v in x.items()}).cpu() for i in range(0, VALID_SAMPLES, 4096)]
    )
    return {"auc": auc(logits, y), "logloss": F.binary_cross_entropy_with_logits(logits, y).item()}
