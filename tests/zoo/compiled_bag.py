"""dict_bag.py's model (an EmbeddingBag over id lists, and dense layers) as a user who compiles
it brings it: model() returns torch.compile(net), an OptimizedModule whose parameters are named
``_orig_mod.bag.weight`` and so on. Same net, data and loss as dict_bag.py, so a run of each
trains the same weights.

The backend is "aot_eager" (dynamo and AOTAutograd: graph breaks, guards, the compiled
backward), not the default inductor: inductor compiles C++ on a CPU, 27 s in each process on a
2-core machine with a cold cache (2 s from its cache), against 1 s for aot_eager; see
tests/test_compiled.py."""

import torch

from dict_bag import HPAR, BagModel, data, loss  # noqa: F401  (the zoo's directory is on sys.path)


def model():
    return torch.compile(BagModel(), backend="aot_eager")


def evaluate(model):
    """Mean squared error on a held-out batch (a rank no worker draws), through the compiled model."""
    inputs, targets = next(data(99, 1, 32))
    with torch.no_grad():
        return {"mse": float(((model(inputs) - targets) ** 2).mean())}
