"""Checkpoints of the ``torchrec`` runtime through torch.distributed.checkpoint, in the run's
checkpoint namespace (strategies/state/state.py) and under the user's names.

Each worker writes what it holds, nothing gathered: its shards of every table (TorchRec's
ShardedTensors, under the replaced module's ``model.<name>.weight``, so the checkpoint reads
like any other strategy's), the dense parameters (DDP's replicas: DCP keeps one copy), the fused
optimizer's state of its shards (``optim.fused.<table>.<state>``, Adagrad's sums), the dense
optimizer's state tensors by parameter name (``optim.<name>.<state>``), the loop state and its
random generators. A resume reads into the same objects in place, in the layout this run has:
DCP cuts the saved shards to this run's, so a checkpoint resumes at another number of workers.
"""

from __future__ import annotations

import torch

from hpar.strategies.state import checkpoint
from hpar.strategies.state import state as run_state
from hpar.strategies.runtimes.torchrec.trec_shard import table_key


def _entries(step) -> dict:
    """The checkpoint entries of a TorchrecStep ``step`` (module docstring), as live objects."""
    from hpar.strategies.common.devices import rng_state

    names = {table_key(t): t.weight for t in step.tables}
    entries = {f"model.{names.get(k, k)}": v for k, v in step.dmp.state_dict().items()}
    fused = step.dmp.fused_optimizer
    for key, param in fused.params.items():
        for name, value in fused.state.get(param, {}).items():
            if hasattr(value, "local_shards") or isinstance(value, torch.Tensor):
                entries[f"optim.fused.{names.get(key, key)}.{name.split('.')[-1]}"] = value
    dense = {id(p): n for n, p in step.dense_named}
    for p, values in step.opt.state.items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                entries[f"optim.{dense[id(p)]}.{name}"] = value
    entries["loop.workers"] = step.tools.state_dict()
    entries[run_state.rng_key(f"worker{step.ctx.rank}")] = rng_state(step.ctx.device)
    return entries


def save(step, steps_done: int) -> None:
    """Write checkpoint ``steps_done`` of TorchrecStep ``step`` (a collective)."""
    run_state.save(step.cfg.run_dir, steps_done, _entries(step), keep=step.cfg.keep_checkpoints)


def resume(step) -> int:
    """Load the run's latest checkpoint into TorchrecStep ``step`` when ``--resume`` asks for
    it; returns the step to start from (0: nothing loaded)."""
    from hpar.strategies.common.devices import set_rng_state

    done = checkpoint.latest_step(step.cfg.run_dir) if step.cfg.resume else None
    if done is None:
        return 0
    path = run_state.step_dir(step.cfg.run_dir, done)
    keys = run_state.saved_keys(path)
    entries = {k: v for k, v in _entries(step).items() if k in keys or run_state.has(keys, k)}
    run_state.read(path, entries)
    step.tools.load_state_dict(entries.get("loop.workers"))
    rng = run_state.rng_key(f"worker{step.ctx.rank}")
    if rng in entries:
        set_rng_state(entries[rng], step.ctx.device)
    return done
