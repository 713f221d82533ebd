"""Run a strategy's real ``train`` on CPU as if its workers were on CUDA with NCCL, and record
every Python-level collective that reaches a group NCCL would serve.

In each spawned worker, ``dist.init_process_group``/``dist.new_group`` asked for NCCL build a
gloo group instead and remember it as "NCCL"; the collectives are wrapped to note, for those
groups, the function that called them. On a GPU, the only tensors allowed there are on the
worker's device: DDP's gradient buckets (the comm hooks), the padded AllGather of sparse
gradients and the pipeline's activation/gradient batches. Anything else (a loss, an RNG state,
a pickled object, a barrier) is a CPU value that NCCL would reject or hang on.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

ALLOWED = {
    "counting_allreduce_hook",
    "group_allreduce_hook",
    "padded_allgather_hook",
    "padded_allgather_mean",
    "post",
    "average_gradients",
}  # the last: a pipeline stage's replica AllReduce of its device gradients
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "barrier",
    "gather_object",
    "gather",
    "reduce",
    "send",
    "recv",
    "broadcast_object_list",
    "all_to_all",
    "reduce_scatter",
)
# (isend/irecv stay unwrapped: dist.P2POp checks that its op *is* dist.isend or dist.irecv; their
# batches are checked in batch_isend_irecv)


def install() -> list:
    """Patch torch.distributed in this process; returns the list violations are appended to."""
    nccl, violations = [], []
    real_init, real_new = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, **kw):
        real_init(backend="gloo", **kw)
        if backend and "nccl" in backend:
            nccl.append(dist.group.WORLD)

    def new_group(ranks=None, timeout=None, backend=None, **kw):
        g = real_new(ranks, timeout=timeout, backend="gloo" if backend == "nccl" else backend, **kw)
        if backend == "nccl":
            nccl.append(g)
        return g

    def wrap(name, fn):
        def wrapped(*args, **kw):
            group = kw.get("group")
            if group is None and name in ("all_reduce", "broadcast", "reduce") and len(args) > 2:
                group = args[2]
            group = group if group is not None else dist.group.WORLD
            if any(group is g for g in nccl):
                caller = sys._getframe(1).f_code.co_name
                if caller not in ALLOWED:
                    violations.append(f"{name} from {caller}")
            return fn(*args, **kw)

        return wrapped

    real_batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        caller = sys._getframe(1).f_code.co_name
        if any(any(op.group is g for g in nccl) for op in ops) and caller not in ALLOWED:
            violations.append(f"batch_isend_irecv from {caller}")
        return real_batch(ops)

    dist.init_process_group, dist.new_group, dist.batch_isend_irecv = init_process_group, new_group, batch_isend_irecv
    for name in COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))
    return violations


def child(rank: int, world: int, runs: list, out_dir: str) -> None:
    """One worker of each run in ``runs`` ([(config path, port)], one after the other): the
    real init_group and runtime, with ``cfg.device == "cuda"`` but tensors on the CPU; writes
    its violations per run to OUT_DIR/rank.json."""
    import faulthandler

    faulthandler.dump_traceback_later(600, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    violations = install()
    from hpar.strategies.job.config import RunConfig
    from hpar.strategies.job.context import WorkerContext
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.specs.registry import spec
    from hpar.workers.worker import init_group

    out = {}
    for config_path, port in runs:
        os.environ["MASTER_PORT"] = str(port)
        cfg = RunConfig.from_json(open(config_path).read())
        job = load_job(cfg.script)
        host_of = init_group(cfg, rank, world)
        ctx = WorkerContext(
            job=job,
            cfg=cfg,
            rank=rank,
            world_size=world,
            local_rank=rank,
            device=torch.device("cpu"),
            report=lambda m: None,
            pg_rank=rank,
            pg_world_size=world,
            host_of=host_of,
        )
        result = spec(cfg.strategy).load("runtime")(ctx)
        dist.barrier()
        dist.destroy_process_group()
        out[cfg.strategy] = {"violations": list(violations), "loss_last": result.loss_last}
        violations.clear()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
