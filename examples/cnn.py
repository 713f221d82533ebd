"""A dense convolutional classifier on the handwritten digits bundled with scikit-learn.

Data: the 1,797 8x8 grey-scale digit images of ``sklearn.datasets.load_digits`` (a copy of the
UCI "Optical Recognition of Handwritten Digits" test set, shipped inside scikit-learn, so no
download is needed). The first 1,500 images (after a fixed shuffle) train, the other 297
validate. The model is an ``nn.Sequential`` of 12 layers, so it can also be pipelined.
Run: ``hpar run examples/cnn.py --gpus 2``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

HPAR = {"batch_size": 32, "steps": 200, "lr": 0.05, "log_every": 10}
TRAIN = 1500
_CACHE = {}


def digits():
    """(images (N, 1, 8, 8) scaled to [0, 1], labels (N,)), in a fixed shuffled order."""
    if "digits" not in _CACHE:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        _CACHE["digits"] = (x[order], y[order])
    return _CACHE["digits"]


def model():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def data(rank, world_size, batch_size):
    """This rank's batches of one epoch: a seeded shuffle of the training images, split so that
    rank r takes the r-th slice of every global batch of world_size * batch_size images."""
    x, y = digits()
    x, y = x[:TRAIN], y[:TRAIN]
    epoch = _CACHE.get(("epoch", rank), 0)
    _CACHE[("epoch", rank)] = epoch + 1
    order = torch.randperm(TRAIN, generator=torch.Generator().manual_seed(epoch))
    step = world_size * batch_size
    for start in range(0, TRAIN - step + 1, step):
        idx = order[start + rank * batch_size : start + (rank + 1) * batch_size]
        yield x[idx], y[idx]


def loss(output, targets):
    return F.cross_entropy(output, targets)


def optimizer(params):
    return torch.optim.SGD(params, lr=HPAR["lr"], momentum=0.9)


def evaluate(model):
    """Held-out accuracy and loss, on whatever device the model is (hpar hands it over on the CPU)."""
    dev = next(model.parameters()).device
    x, y = (t[TRAIN:].to(dev) for t in digits())
    logits = model(x)
    return {"accuracy": (logits.argmax(1) == y).float().mean().item(), "loss": F.cross_entropy(logits, y).item()}
