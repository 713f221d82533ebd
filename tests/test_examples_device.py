"""The shipped examples are device-agnostic (issue 13, item 6): with the model on another
device than the CPU (``meta`` here: no GPU on this machine), every tensor that reaches a layer
in ``evaluate(model)`` and in a training forward is on the model's device."""

import os

import pytest
import torch

from hpar.strategies.job.contract import load_job

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class Reached(Exception):
    """The first layer call was checked; a meta tensor has no values to go on with."""


def _check_devices(model: torch.nn.Module, device: torch.device, stop_after: type) -> list:
    """Hooks asserting that every tensor argument of every layer is on ``device``; raise
    Reached once a layer of type ``stop_after`` has been checked."""
    seen = []

    def pre(module, args, kwargs):
        for t in [*args, *kwargs.values()]:
            for x in t if isinstance(t, (tuple, list)) else [t]:
                if isinstance(x, torch.Tensor):
                    assert x.device == device, f"{type(module).__name__} got a tensor on {x.device}, model on {device}"
        seen.append(type(module).__name__)
        if isinstance(module, stop_after):
            raise Reached

    for m in model.modules():
        m.register_forward_pre_hook(pre, with_kwargs=True)
    return seen


@pytest.fixture(autouse=True)
def autocast_on_meta(monkeypatch):
    """``meta`` stands in for a GPU here; autocast has no meta device type, so a model that
    enters ``torch.autocast(x.device.type)`` gets the CPU's (on a GPU it would get CUDA's)."""
    real = torch.autocast
    monkeypatch.setattr(
        torch, "autocast", lambda device_type, *a, **kw: real("cpu" if device_type == "meta" else device_type, *a, **kw)
    )


@pytest.mark.parametrize(
    "name, stop_after", [("lm.py", torch.nn.Linear), ("cnn.py", torch.nn.Linear), ("recsys.py", torch.nn.Linear)]
)
def test_evaluate_feeds_the_models_device(name, stop_after):
    job = load_job(os.path.join(EXAMPLES, name))
    model = job.build_model().to("meta").eval()
    seen = _check_devices(model, torch.device("meta"), stop_after)
    with pytest.raises(Reached), torch.no_grad():
        job.evaluate_fn(model)
    assert len(seen) >= 2


def test_lm_sampled_negatives_follow_the_targets_device():
    job = load_job(os.path.join(EXAMPLES, "lm.py"))
    model = job.build_model().to("meta").train()
    (tokens, targets), _ = next(job.batches(0, 1, 4))
    _check_devices(model, torch.device("meta"), torch.nn.Embedding)
    model.embedding._forward_pre_hooks.clear()  # check the output table's lookup: the candidates
    _check_devices(model.softmax_w, torch.device("meta"), torch.nn.Embedding)
    with pytest.raises((Reached, NotImplementedError)) as info:
        model((tokens.to("meta"), targets.to("meta")))
    assert info.type is Reached or "unique" in str(info.value), info.value


def test_lm1b_shape_forward_and_loss_stay_on_the_models_device():
    """examples/lm1b_shape.py draws its sampled negatives and the loss's targets inside
    forward and loss(): they follow the batch's device (on a GPU the profile once failed with
    "Expected all tensors to be on the same device"). The model is built on ``meta`` (its
    3.3 GB tables cost nothing there); the batch comes from data() on the CPU and is moved."""
    job = load_job(os.path.join(EXAMPLES, "lm1b_shape.py"))
    with torch.device("meta"):
        model = job.build_model()
    (tokens, targets), y = next(job.batches(0, 1, 2))
    out = model((tokens.to("meta"), targets.to("meta")))
    assert out.device.type == "meta" and out.shape == (2 * 20, 1 + 8192)
    assert job.compute_loss(out, y.to("meta")).device.type == "meta"
