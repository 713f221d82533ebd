"""A run's trained model in the formats people load: one torch file, safetensors, or a
Hugging Face ``save_pretrained`` directory (``hpar export RUN_DIR --format F --out PATH``).

The run wrote its model where it lives (``RUN_DIR/model``, torch.distributed.checkpoint:
strategies/runstate/state.py). Exporting reads it whole in this process (shards joined: an offline
step, sized for the machine that runs it), as the model's ``state_dict``:

* ``torch``: ``torch.save`` of the state dict (``torch.load`` and ``model.load_state_dict``);
* ``safetensors``: one ``model.safetensors`` (``safetensors.torch.load_file``); a weight held
  under two names (a tied ``lm_head``) is written once, under the first, as HF does (safetensors
  refuses aliased tensors), and ``load_state_dict(..., strict=False)`` or the model's own tying
  restores the other;
* ``hf``: the script's ``model()`` (a ``transformers`` model) loaded with the state dict and
  written with its ``save_pretrained``: ``from_pretrained(OUT)`` gives the trained model.

Each is written to a temp path beside ``OUT`` and renamed into place.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from hpar.strategies.runstate.checkpoint import atomic_save

FORMATS = ("torch", "safetensors", "hf")


def trained_state(run_dir: str) -> dict[str, torch.Tensor]:
    """The trained model's state dict (the user's parameter names) from ``RUN_DIR/model``.
    Raises ValueError naming the directory when the run left none."""
    from hpar.strategies.runstate import state   # torch.distributed.checkpoint: 1 s to import, only here
    path = os.path.join(run_dir, state.FINAL)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"{run_dir}: no trained model there ({path} is missing); export a run that finished")
    return {k[len("model."):]: v for k, v in state.read_all(path).items() if k.startswith("model.")}


def unaliased(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without a second name for a tensor already listed (same storage and
    shape: a tied weight), each tensor contiguous: what safetensors accepts."""
    seen, out = set(), {}
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.contiguous()
    return out


def export(run_dir: str, fmt: str, out: str, script: str | None = None) -> str:
    """Write the trained model of ``run_dir`` as ``fmt`` (one of FORMATS) at ``out`` (a file
    for ``torch``, a directory for the others); returns what was written. ``script``: the
    run's script, for ``hf`` (default: the one its config.json names). Raises ValueError for
    an unknown format, a run without a model, or ``hf`` for a model that is not a
    ``transformers`` model."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    weights = trained_state(run_dir)
    if fmt == "torch":
        target = os.path.join(out, "model.pt") if os.path.isdir(out) else out
        atomic_save(weights, target)
        return target
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            save_file(unaliased(weights), os.path.join(tmp, "model.safetensors"))
        else:
            _save_pretrained(run_dir, script, weights, tmp)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_pretrained(run_dir: str, script: str | None, weights: dict, target: str) -> None:
    """The script's model with ``weights``, written with ``save_pretrained(target)``."""
    from hpar.strategies.common.config import RunConfig
    from hpar.strategies.models.hf import is_pretrained, save_pretrained_dir
    from hpar.strategies.models.forward import inner_module
    from hpar.strategies.common.job import load_job
    if script is None:
        script = RunConfig.from_json(open(os.path.join(run_dir, "config.json"), encoding="utf-8").read()).script
    job = load_job(script)
    model = inner_module(job.build_model())
    if not is_pretrained(model):
        raise ValueError(f"--format hf: {job.path}'s model() is a {type(model).__name__}, not a transformers model; "
                         "use --format torch or safetensors")
    missing = model.load_state_dict(weights, strict=False).missing_keys
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    assert not set(missing) - tied, f"the run's model lacks {sorted(set(missing) - tied)[:3]}"
    save_pretrained_dir(model, os.path.join(target, "hf"))
    for name in os.listdir(os.path.join(target, "hf")):
        os.replace(os.path.join(target, "hf", name), os.path.join(target, name))
    os.rmdir(os.path.join(target, "hf"))


__all__ = ["FORMATS", "trained_state", "unaliased", "export"]
