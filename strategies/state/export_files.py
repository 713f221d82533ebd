"""A run's trained model in the formats people load: one torch file, safetensors, or a
Hugging Face ``save_pretrained`` directory (``hpar export RUN_DIR --format F --out PATH``).

The run wrote its model where it lives (``RUN_DIR/model``, torch.distributed.checkpoint:
strategies/state/state.py). Exporting reads it whole in this process (shards joined: an offline
step, sized for the machine that runs it), as the model's ``state_dict``:

* ``torch``: ``torch.save`` of the state dict (``torch.load`` and ``model.load_state_dict``); a
  weight held under two names (a tied ``lm_head``) is one tensor under both, which torch.save
  stores once, and a strict ``load_state_dict`` fills both;
* ``safetensors``: one ``model.safetensors`` (``safetensors.torch.load_file``); a weight held
  under two names (a tied ``lm_head``) is written once, under the first, as HF does (safetensors
  refuses aliased tensors), and ``load_state_dict(..., strict=False)`` or the model's own tying
  restores the other;
* ``hf``: the script's ``model()`` (a ``transformers`` model) loaded with the state dict and
  written with its ``save_pretrained``: ``from_pretrained(OUT)`` gives the trained model.

Each is written into a temp folder inside ``OUT`` (or beside the torch file) and its files are
renamed into place; nothing else in ``OUT`` is touched, a file no earlier export wrote is not
replaced without ``--force``, and ``OUT`` may not be the working directory, the run directory
or an ancestor of either (:func:`check_out`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from hpar.strategies.state.checkpoint import atomic_write_bytes, default_mode

if TYPE_CHECKING:  # torch is imported where a model is read, so that `hpar export --help` needs none
    import torch

FORMATS = ("torch", "safetensors", "hf")


def trained_state(run_dir: str) -> dict[str, torch.Tensor]:
    """The trained model's state dict (the user's parameter names) from ``RUN_DIR/model``; a
    tied weight's names hold one tensor (RUN_DIR/model stores it once: state.read_all). Raises
    ValueError naming the directory when the run left none."""
    from hpar.strategies.state import state  # torch.distributed.checkpoint: 1 s to import, only here

    path = os.path.join(run_dir, state.FINAL)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"{run_dir}: no trained model there ({path} is missing); export a run that finished")
    return {k[len("model.") :]: v for k, v in state.read_all(path).items() if k.startswith("model.")}


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


MANIFEST = ".hpar-export"  # in OUT: the names earlier exports wrote there, one a line


def _within(inner: str, outer: str) -> bool:
    """Whether real path ``inner`` is ``outer`` or inside it."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_out(out: str, run_dir: str) -> None:
    """ValueError naming ``--out`` unless ``out`` may hold an export: not a file, and not the
    working directory, ``run_dir`` or an ancestor of either (an export writes into ``out``; a
    mistake there must not land in the run or the working tree)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(
            f"--out {out}: is a file; --format safetensors and hf write into a directory: name a "
            "new or earlier export directory"
        )
    real = os.path.realpath(out)
    for name, path in (("the working directory", os.getcwd()), ("the run directory", run_dir)):
        if _within(os.path.realpath(path), real):
            raise ValueError(
                f"--out {out}: is {name} or holds it; name a directory for the exported model (e.g. --out exported)"
            )


def _written_before(out: str) -> set[str]:
    try:
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}
    except OSError:
        return set()


def _check_overwrite(out: str, names: list[str], force: bool) -> None:
    """ValueError naming the first file of ``names`` in ``out`` that no earlier export wrote
    (unless ``force``)."""
    ours = _written_before(out)
    clash = [n for n in names if os.path.lexists(os.path.join(out, n)) and n not in ours]
    if clash and not force:
        raise ValueError(
            f"--out {out}: {os.path.join(out, clash[0])} exists and no hpar export wrote it; "
            "pick another --out, or pass --force to replace it"
        )


def export(run_dir: str, fmt: str, out: str, script: str | None = None, force: bool = False) -> str:
    """Write the trained model of ``run_dir`` as ``fmt`` (one of FORMATS) at ``out``; returns
    what was written. ``torch``: the file ``out`` (``out/model.pt`` when ``out`` is a
    directory); ``safetensors`` and ``hf``: their files inside the directory ``out`` (made
    when absent), each written to a temp name and renamed in, nothing else in ``out``
    touched; ``OUT/.hpar-export`` lists what exports wrote. ``script``: the run's script, for
    ``hf`` (default: the one its config.json names). Raises ValueError for an unknown format,
    a run without a model, a run directory others can write, ``hf`` for a model that is not a
    ``transformers`` model, an ``out`` refused by :func:`check_out`, and a file in the way
    that no export wrote (unless ``force``)."""
    from hpar.strategies.state.trust import check_trusted

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    check_trusted(run_dir, "RUN_DIR")  # its files are loaded, and its config names the script (hf)
    if fmt == "torch" and not os.path.isdir(out):
        directory, names = os.path.dirname(os.path.abspath(out)), [os.path.basename(out)]
    else:
        check_out(out, run_dir)
        directory, names = os.path.abspath(out), ["model.pt"] if fmt == "torch" else None
    if names:
        _check_overwrite(directory, names, force)
    weights = trained_state(run_dir)
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=directory)
    try:
        if fmt == "torch":
            import torch

            with open(os.path.join(tmp, names[0]), "wb") as f:
                torch.save(weights, f)
                f.flush()
                os.fsync(f.fileno())
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(unaliased(weights), os.path.join(tmp, "model.safetensors"))
        else:
            _save_pretrained(run_dir, script, weights, tmp)
        names = sorted(os.listdir(tmp))
        _check_overwrite(directory, names, force)
        for name in names:  # as open() would make them (safetensors writes 0600): readable where OUT is
            os.chmod(os.path.join(tmp, name), default_mode(os.path.isdir(os.path.join(tmp, name))))
            os.replace(os.path.join(tmp, name), os.path.join(directory, name))
        atomic_write_bytes(
            os.path.join(directory, MANIFEST),
            "".join(n + "\n" for n in sorted(_written_before(directory) | set(names))).encode(),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(directory, names[0]) if fmt == "torch" else out


def _save_pretrained(run_dir: str, script: str | None, weights: dict, target: str) -> None:
    """The script's model with ``weights``, written with ``save_pretrained(target)``."""
    from hpar.strategies.job.config import RunConfig
    from hpar.strategies.state.hf_save import is_pretrained, save_pretrained_dir
    from hpar.strategies.job.forward import inner_module
    from hpar.strategies.job.contract import load_job

    if script is None:
        script = RunConfig.from_json(open(os.path.join(run_dir, "config.json"), encoding="utf-8").read()).script
    job = load_job(script)
    model = inner_module(job.build_model())
    if not is_pretrained(model):
        raise ValueError(
            f"--format hf: {job.path}'s model() is a {type(model).__name__}, not a transformers model; "
            "use --format torch or safetensors"
        )
    missing = model.load_state_dict(weights, strict=False).missing_keys
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    assert not set(missing) - tied, f"the run's model lacks {sorted(set(missing) - tied)[:3]}"
    save_pretrained_dir(model, os.path.join(target, "hf"))
    for name in os.listdir(os.path.join(target, "hf")):
        os.replace(os.path.join(target, "hf", name), os.path.join(target, name))
    os.rmdir(os.path.join(target, "hf"))


__all__ = ["FORMATS", "MANIFEST", "trained_state", "unaliased", "check_out", "export"]
