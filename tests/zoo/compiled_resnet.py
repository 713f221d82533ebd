"""resnet.py's ResNet as a user who compiles it brings it: model() returns torch.compile(net).
A pipeline cuts net (the module inside the wrapper) between its residual blocks; the stages
run eagerly. The backend is "aot_eager" (see compiled_bag.py for why not inductor here)."""

import torch

from resnet import HPAR, ResNet, data, loss  # noqa: F401  (the zoo's directory is on sys.path)


def model():
    return torch.compile(ResNet(), backend="aot_eager")
