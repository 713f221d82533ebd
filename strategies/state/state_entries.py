"""One process's entries in a checkpoint's namespace (strategies/state/state.py saves and loads
them with torch.distributed.checkpoint): its model's state (``model.<name>``), its optimizer's
state keyed by parameter name (``optim.<key>``, torch's ``get_optimizer_state_dict``), its loop
state (``loop.<part>``) and random generators (``rng.<process>``); and what a checkpoint holds,
read as data (strategies/state/safe_read.py)."""

from __future__ import annotations

import torch

from hpar.strategies.state import aliases, safe_read


OPTIONS = None  # StateDictOptions(flatten_optimizer_state_dict=True), made on first use


def _options():
    global OPTIONS
    if OPTIONS is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    return OPTIONS


def model_entries(module: torch.nn.Module) -> dict:
    """``model.<name>`` entries of ``module``'s state dict (its live tensors: a load fills them)."""
    return {f"model.{k}": v for k, v in module.state_dict().items()}


def optim_entries(module: torch.nn.Module, opt: torch.optim.Optimizer | None, for_load: bool = False) -> dict:
    """``optim.<key>`` entries of ``opt`` (over parameters of ``module``) keyed by parameter
    name. Empty before the optimizer's first step, unless ``for_load``: torch then makes its
    state with a step at learning rate 0 (``_init_optim_state``), which a load overwrites; at
    a save that step would count in Adam's bias correction, so nothing is saved instead."""
    if opt is None or not (opt.state or for_load):
        return {}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {f"optim.{k}": v for k, v in get_optimizer_state_dict(module, opt, options=_options()).items()}


def set_optim(module: torch.nn.Module, opt: torch.optim.Optimizer | None, entries: dict) -> None:
    """Load :func:`optim_entries` (as filled by :func:`read`) into ``opt``."""
    loaded = {k[len("optim.") :]: v for k, v in entries.items() if k.startswith("optim.")}
    if opt is None or not loaded:
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, opt, loaded, options=_options())


def has(keys: set[str], prefix: str) -> bool:
    """Whether a checkpoint's ``keys`` (:func:`saved_keys`, flattened) hold entry ``prefix``."""
    return any(k == prefix or k.startswith(prefix + ".") for k in keys)


def rng_key(part: str) -> str:
    """The key of process ``part``'s random generators ("worker3", "server0", "stage1-r0")."""
    return f"rng.{part}"


def process_entries(
    module: torch.nn.Module, opt, tools, device: torch.device, part: str, loop: str, skip: frozenset = frozenset()
) -> dict:
    """What one training process holds, in the checkpoint namespace: ``module``'s state (but
    the names in ``skip``: tables the servers hold), ``opt``'s state by name, ``tools``'
    loop state under ``loop.<loop>`` (equal on the replicas that share ``loop``) and its
    random generators under ``rng.<part>``."""
    from hpar.strategies.common.devices import rng_state

    entries = {k: v for k, v in model_entries(module).items() if k[len("model.") :] not in skip}
    entries.update(optim_entries(module, opt))
    if tools is not None:
        entries[f"loop.{loop}"] = tools.state_dict()
    entries[rng_key(part)] = rng_state(device)
    return entries


def read_all(path: str) -> dict:
    """Everything the DCP checkpoint in ``path`` holds, in this process (shards joined into
    whole tensors, nested entries as saved: what torch's ``dcp_to_torch_save`` gives, read as
    data by ``safe_read.load_all``, which raises ``safe_read.UnsafeCheckpoint``), a tied weight's
    later names as the very tensor stored under its first (``aliases.with_aliases``). For
    ``hpar export``, tools and tests: it holds the whole state in memory."""
    return aliases.with_aliases(safe_read.load_all(path))


def saved_keys(path: str) -> set[str]:
    """The keys of the DCP checkpoint in directory ``path`` (read from its metadata, as data:
    ``safe_read.read_metadata``, which raises ``safe_read.UnsafeCheckpoint``)."""
    return set(safe_read.read_metadata(path).state_dict_metadata)
