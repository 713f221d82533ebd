"""Checkpoints written where the state lives, with torch.distributed.checkpoint (DCP).

Every process of a run (the workers, and the parameter servers of ``hybrid``/``ps``) calls
:func:`save` at the same step with the state it holds, and DCP writes it in parallel, each
process its own file, with no process gathering another's. All processes share one namespace
(``model.<name>``, ``optim.<key>``, ``loop.<part>``, ``rng.<process>``, ``cache.*``,
``compress.*``, ``meta``, ``tied.<name>``: docs/state.md, "What a checkpoint holds"); copies held
by several processes are written from the lowest rank (:func:`write`), and a table the servers
hold in row ranges is a ``ShardedTensor`` of the parameter's shape, so a load with another
layout reshards it (launcher/run/reshape.py).

Invariant: ``RUN_DIR/checkpoints/latest`` names the newest complete step and is rewritten only
once every process has written (a barrier), so a crash mid-save leaves the previous checkpoint
as it was and ``--resume`` never sees a partial step (``checkpoint.usable_step`` checks every
``.sha256`` beside DCP's files in ``checkpoints/step-N/``).

Sources: torch.distributed.checkpoint (``dcp.save``/``dcp.load``, ``FileSystemWriter``);
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for name-keyed
optimizer state (the docs name pipeline parallelism as where id-keyed state breaks). Every
read goes through strategies/state/safe_read.py: a checkpoint's pickles are read as data.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hpar.strategies.state.checkpoint import atomic_write_bytes, file_sha256, step_dir
from hpar.strategies.state import aliases, safe_read
from hpar.strategies.state.state_entries import (
    has,
    model_entries,
    optim_entries,
    process_entries,
    read_all,
    rng_key,
    saved_keys,
    set_optim,
)

# ShardedTensor is the DCP type whose shards may sit at any row offsets (a server holds
# partitions p, p+S, p+2S, ...: DTensor's Shard(0) has one contiguous block per rank)
warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DiskFull(RuntimeError):
    """A state write ran out of space; ``str(err)`` is the one line to show (the process entry
    points print it and exit 2; the launcher names the process)."""


def _no_space(exc: BaseException, path: str) -> bool:
    """Whether ``exc`` comes from a full disk: ENOSPC in its chain (DCP wraps every rank's
    failure in one CheckpointException), or torch.save's zip writer failing ("unexpected pos",
    its message for a short write) while the filesystem of ``path`` has under 1 MiB free."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        text = str(e)
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            return True
        if "unexpected pos" in text:
            try:
                return shutil.disk_usage(path).free < (1 << 20)
            except OSError:
                return False
        failures = getattr(e, "failures", None) or {}
        todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()] + [e.__cause__, e.__context__]
    return False


def write(path: str, state: dict) -> None:
    """``dcp.save`` of ``state`` into directory ``path`` (a collective over the default group,
    or this process alone without one), then a SHA-256 beside each file this process wrote.
    A key several processes hold (replicas) is written from the lowest rank that holds it
    (DCP's ``dedup_save_to_lowest_rank``; its default spreads such keys over the ranks by size):
    buffers the replicas do not keep equal (BatchNorm's running statistics, updated from each
    worker's own batches) come from worker 0 (a pipeline stage's from its first replica), the
    copy worker 0's ``evaluate()`` reads, so the saved model and every export evaluate as it did.
    Raises :class:`DiskFull` (naming ``path``) when the disk is full: nothing that was
    complete before is touched (``latest`` moves only after a whole checkpoint is written)."""
    try:
        os.makedirs(path, exist_ok=True)
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path, sync_files=True),
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
        )  # replicas: the lowest rank's copy
        _checksums(path)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (Exception, dcp.api.CheckpointException)) and _no_space(exc, path):
            raise DiskFull(
                f"no space left on device writing {path}; the last complete checkpoint is intact: free "
                "space, then `hpar run --resume RUN_DIR`"
            ) from None
        raise


def _checksums(path: str) -> None:
    """A SHA-256 beside each file this process wrote into ``path``."""
    rank = _rank()
    mine = glob.glob(os.path.join(path, f"__{rank}_*.distcp")) + (
        [os.path.join(path, ".metadata")] if rank == 0 else []
    )
    for f in mine:
        atomic_write_bytes(f + ".sha256", file_sha256(f).encode())


def read(path: str, state: dict) -> None:
    """``dcp.load`` into ``state`` in place (its tensors keep their storage; other values are
    replaced): every process asks for what it holds now, in the layout it has now. Each
    process reads on its own (``no_dist``: DCP plans the reads from the saved metadata in
    this process), so loads need no common order across workers and servers. The metadata and
    non-tensor items are read as data (strategies/state/safe_read.py): a file that names
    anything else raises ``safe_read.UnsafeCheckpoint`` (a ValueError naming it)."""
    safe_read.load(path, state)


def save(run_dir: str, step: int, state: dict, keep: int = 0) -> None:
    """Write this process's ``state`` (the namespace in the module docstring) for ``step``;
    a collective over the default group, then ``latest`` points at ``step`` and only the
    ``keep`` newest complete checkpoints stay (0: all; ``--keep-checkpoints``)."""
    from hpar.strategies.common import activity
    from hpar.strategies.state import checkpoint

    with activity.doing(f"writing the checkpoint of step {step}"):
        write(step_dir(run_dir, step), state)
    checkpoint.commit(run_dir, step, keep)


FINAL, FINAL_TMP = "model", ".tmp-model"  # RUN_DIR/model: the trained model, written as a checkpoint


def write_final(run_dir: str, entries: dict) -> None:
    """The trained model, written where it lives: every process of the run calls this (a
    collective over the default group) with its ``model.<name>`` entries (and nothing else);
    DCP writes them into ``RUN_DIR/.tmp-model``, which worker 0 renames to ``RUN_DIR/model``
    once every process has written (an older one is replaced only then). A tensor under several
    names (a tied weight) is written once, under the first name ``entries`` give it (the model's
    ``state_dict`` order, the same in every process), the others as ``tied.<name>`` records
    (strategies/state/aliases.py). ``hpar export`` turns it into one torch file, safetensors
    or a ``save_pretrained`` directory."""
    import shutil

    tmp, final = os.path.join(run_dir, FINAL_TMP), os.path.join(run_dir, FINAL)
    from hpar.strategies.common import activity

    with activity.doing("writing the trained model (RUN_DIR/model)"):
        write(tmp, aliases.stored_once(entries))
    if dist.is_initialized():
        with activity.doing(None):  # waiting for the slowest writer is no deadline of this process's
            dist.barrier()
    if _rank() == 0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)


def read_final(run_dir: str, entries: dict) -> None:
    """Fill ``entries`` (``model.<name>`` keys) from ``RUN_DIR/model`` in this process."""
    read(os.path.join(run_dir, FINAL), entries)


def final_entries(module: torch.nn.Module, model: torch.nn.Module) -> dict:
    """A stage's part of the final model, under the names the whole model's ``state_dict``
    gives its tensors: a tied weight that the tracer hands a later stage under another name
    (BERT's ``cls.predictions.decoder.bias`` for ``cls.predictions.bias``) is written under the
    model's own names, and a name the model's state_dict leaves out (Hugging Face leaves out
    tied duplicates) is left out. In the order of the model's ``state_dict`` (what
    :func:`write_final` keeps a tied weight's first name by)."""
    whole = model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for k, v in whole.items():
        names.setdefault(id(v), []).append(k)
    out = {}
    for k, v in module.state_dict(keep_vars=True).items():  # a tensor: every name the model gives it
        for name in set(names.get(id(v), [])) | ({k} if k in whole else set()):
            out[f"model.{name}"] = v.detach()
    order = {f"model.{k}": i for i, k in enumerate(whole)}
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]]))


def read_whole(run_dir: str, model: torch.nn.Module) -> None:
    """Fill ``model`` from the run's final model (RUN_DIR/model) in this process: the names
    the stages wrote (buffers outside every layer keep their values); a tied weight's later
    names (``tied.`` records) get the tensor stored under its first."""
    path = os.path.join(run_dir, FINAL)
    saved, entries = saved_keys(path), model_entries(model)
    wanted, copies = {k: v for k, v in entries.items() if k in saved}, []
    for name, first in aliases.recorded(path).items():
        dst, src = entries.get(f"model.{name}"), f"model.{first}"
        if dst is None or src not in saved:
            continue
        if src not in wanted:
            wanted[src] = dst
        elif wanted[src].data_ptr() != dst.data_ptr():  # else the model ties them itself
            copies.append((dst, wanted[src]))
    read_final(run_dir, wanted)
    for dst, src in copies:
        dst.copy_(src)


def load(run_dir: str, step: int, state: dict) -> None:
    """Fill ``state`` from checkpoint ``step`` (a collective over the default group). Raises
    ValueError naming the directory when a requested key was not saved."""
    path = step_dir(run_dir, step)
    try:
        read(path, state)
    except safe_read.UnsafeCheckpoint:
        raise
    except (Exception, dcp.api.CheckpointException) as exc:  # DCP wraps a rank's failure in a CheckpointException
        text = str(exc).replace("\n", " ")
        if "Missing key" in text or "missing" in text.lower():
            raise ValueError(
                f"{path}: the checkpoint lacks state this run needs ({text[:300]}); resume it with "
                "the script it was written by"
            ) from None
        raise


def restore_process(
    run_dir: str,
    step: int,
    module: torch.nn.Module,
    opt,
    tools,
    device: torch.device,
    part: str,
    loop: str,
    skip: frozenset = frozenset(),
) -> list[str]:
    """Load :func:`process_entries`' state of checkpoint ``step`` into this process. What the
    checkpoint lacks for this process is left as it is and named in the returned list (a
    process that did not exist when it was written has no random generators there; its
    loop state comes from ``loop.<loop>``, else from the first part's)."""
    from hpar.strategies.common.devices import rng_state, set_rng_state

    path = step_dir(run_dir, step)
    keys = saved_keys(path)
    entries = {k: v for k, v in model_entries(module).items() if k[len("model.") :] not in skip}
    if opt is not None and opt.param_groups and any(k.startswith("optim.") for k in keys):
        entries.update({k: v for k, v in optim_entries(module, opt, for_load=True).items() if k in keys})
    missing = []
    parts = sorted({".".join(k.split(".")[:2]) for k in keys if k.startswith("loop.")})  # "loop.<part>"
    loop_key = f"loop.{loop}" if f"loop.{loop}" in parts else (parts[0] if parts else None)
    if tools is not None and loop_key is not None:
        entries[loop_key] = tools.state_dict()
    if has(keys, rng_key(part)):
        entries[rng_key(part)] = rng_state(device)
    else:
        missing.append(rng_key(part))
    read(path, entries)
    set_optim(module, opt, entries)
    if tools is not None and loop_key is not None:
        tools.load_state_dict(entries[loop_key])
    if rng_key(part) in entries:
        set_rng_state(entries[rng_key(part)], device)
    return missing


__all__ = [
    "DiskFull",
    "write",
    "read",
    "save",
    "load",
    "write_final",
    "read_final",
    "final_entries",
    "read_whole",
    "FINAL",
    "FINAL_TMP",
    "model_entries",
    "optim_entries",
    "set_optim",
    "has",
    "rng_key",
    "process_entries",
    "restore_process",
    "read_all",
    "saved_keys",
]
