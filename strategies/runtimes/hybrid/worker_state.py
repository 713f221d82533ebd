"""A hybrid/ps worker's state outside its training step: what goes into a checkpoint and comes
back on resume (the dense part: the servers write the tables), and the CPU copy of the model
that ``evaluate()`` gets (dense parameters from the worker, served tables from the servers).

Checkpoints: the part ``worker{rank}`` holds the dense parameters, the worker optimizer state
and the worker's RNG state (strategies/state/state.py); a tied alias of a served table is
the servers' to write (:func:`served_names`); with hot-row caches the next epoch's cached rows
too (strategies/runtimes/hybrid/cache_client.py).
"""

from __future__ import annotations

import torch

from hpar.strategies.common.devices import cpu_copy
from hpar.strategies.job.context import WorkerContext
from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.tying import shared_parameters
from hpar.strategies.state import checkpoint
from hpar.strategies.state import state as run_state
from hpar.strategies.runtimes.hybrid import embedding
from hpar.strategies.runtimes.hybrid.client import PSClient
from hpar.strategies.specs.servers_spec import EVAL_WHOLE_BYTES


def served_names(model, ps_names: set[str]) -> frozenset:
    """Every name under which the model's state_dict holds a parameter the servers hold (a
    tied weight has several): the servers write those, not the workers."""
    shared = shared_parameters(model)
    return frozenset(ps_names) | {alias for n in ps_names for alias in shared.get(n, [])}


def save(ctx: WorkerContext, step: int, model, opt, tools, ps_names: set[str], caches, compressor=None) -> None:
    """This worker's state (its dense part: the servers write the tables; the next epoch's
    cached rows; ``--compress powersgd``'s state, strategies/runtimes/dataparallel/compress_hooks.py) in
    checkpoint ``step``, with the servers' (strategies/state/state.py); a collective over
    the default group."""
    run_state.save(
        ctx.cfg.run_dir,
        step,
        {
            **run_state.process_entries(
                model,
                opt,
                tools if opt else None,
                ctx.device,
                f"worker{ctx.rank}",
                "workers",
                served_names(model, ps_names),
            ),
            **(caches.entries() if caches else {}),
            **(compressor.entries() if compressor else {}),
        },
        keep=ctx.cfg.keep_checkpoints,
    )


def resume(ctx: WorkerContext, model, opt, tools, ps_names: set[str], caches, compressor=None) -> int:
    """Load this worker's part of the run's latest checkpoint when ``--resume`` asks for it
    (the dense part, optimizer and loop state, RNG; the caches' rows); returns its step (0 when
    nothing was loaded); PowerSGD's state into ``compressor``."""
    step = checkpoint.latest_step(ctx.cfg.run_dir) if ctx.cfg.resume else None
    if step is None:
        return 0
    run_state.restore_process(
        ctx.cfg.run_dir,
        step,
        model,
        opt,
        tools if opt else None,
        ctx.device,
        f"worker{ctx.rank}",
        "workers",
        served_names(model, ps_names),
    )
    if caches:
        caches.restore(checkpoint.step_dir(ctx.cfg.run_dir, step))
    if compressor:
        compressor.restore(checkpoint.step_dir(ctx.cfg.run_dir, step))
    return step


def model_copy(outer, client: PSClient, whole, clock: embedding.StepClock, step: int, served=()) -> torch.nn.Module:
    """Worker rank 0, for evaluate() (``--eval-every`` and the final one): a CPU copy of the
    model as ``model()`` returns it, at the start of ``step``: the dense parameters and buffers
    from this worker, the tables kept whole (``whole``: (table, parameter) pairs) pulled now,
    and the served embeddings (``served``, ServedEmbedding items) pulled whole when together
    they hold at most ``EVAL_WHOLE_BYTES``, else still served (``embedding.attach``: each lookup
    pulls its rows from the servers as of ``step``, recording nothing under no_grad; a direct
    read of such a table's ``.weight`` sees an empty tensor), so no process holds a large served
    table whole. Its bytes are not counted as a training step's, and it reads no hot-row cache
    (cache_client.py): call :func:`done_evaluating` after evaluate()."""
    client.cache_off = True
    copy = cpu_copy(outer)
    inner = inner_module(copy)
    params = dict(inner.named_parameters())
    for t, _ in whole:
        params[t.name].data.copy_(client.pull(t, None, step).reshape(params[t.name].shape))
    size = sum(item.table.rows * item.table.dim * item.table.dtype.itemsize for item in served)
    if served and size <= EVAL_WHOLE_BYTES:
        modules = dict(inner.named_modules())
        for item in served:
            name = item.table.name
            module = modules[name[: -len(".weight")] if name.endswith(".weight") else ""]
            module.__dict__.pop("forward", None)  # the class's own forward, over the whole table
            module.weight.data = client.pull(item.table, None, step).reshape(item.table.shape)
    clock.step = step
    return copy


def done_evaluating(client: PSClient) -> None:
    """Forget the bytes of evaluate()'s pulls (they are not a training step's); training pulls
    read the hot-row caches again."""
    client.cache_off = False
    client.bytes.take()
    client.bytes.take_remote()
