"""Worker process entry point: ``python -m hpar.workers.worker``.

Reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus
HPAR_CONFIG (path of the run's config.json) and HPAR_PG_RANK/HPAR_PG_WORLD_SIZE (its place in
the default process group, which also holds parameter servers), joins the group, runs the
strategy's runtime and reports through tagged stdout lines (workers/report.py). No math here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.workers import report

report.install_stack_dump()  # first, so that a stall during start-up can be diagnosed too

import torch  # noqa: E402
import torch.distributed as dist

from hpar.strategies.common import activity

from hpar.strategies.common import measured_memory as memory
from hpar.strategies.job.config import ConfigChanged, RunConfig, load_config
from hpar.strategies.job.context import WorkerContext
from hpar.strategies.common.devices import model_to_cpu
from hpar.strategies.common.gather import all_gather_ints
from hpar.strategies.common.groups import join_default_group
from hpar.strategies.job.contract import JobError, load_job
from hpar.strategies.state.safe_read import UnsafeCheckpoint
from hpar.strategies.state.state import DiskFull
from hpar.strategies.state.hf_save import is_pretrained, save_pretrained_dir


def env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise SystemExit(f"hpar worker: environment variable {name} is not set; start workers with `hpar run`")
        return default
    return int(value)


def step_time_percentiles(step_times: list[float], warmup: int = 2) -> dict:
    """``step_s_p50`` and ``step_s_p90`` (seconds) of worker 0's steps after ``warmup`` steps."""
    times = sorted(step_times[warmup:] or step_times)
    if not times:
        return {}
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    return {"step_s_p50": pick(0.5), "step_s_p90": pick(0.9)}


def init_group(cfg: RunConfig, pg_rank: int, pg_world_size: int) -> tuple[int, ...]:
    """Join the default process group (always gloo: strategies/common/groups.py says what goes over
    which group); returns the host index (GROUP_RANK) of every rank of it, gathered from all
    as int64 tensors, never pickles (a collective: servers call it too)."""
    join_default_group(pg_rank, pg_world_size, int(os.environ.get("HPAR_PG_TIMEOUT", "300")))
    return tuple(h for (h,) in all_gather_ints([env_int("GROUP_RANK", 0)]))


def leave_group(stop_beat) -> None:
    """End of a worker or server: wait for every process of the group, leave it, stop the
    heartbeat (``report.start_heartbeat``'s event)."""
    dist.barrier()
    dist.destroy_process_group()
    stop_beat.set()


def run_entry(main, prefix: str, user_errors: tuple) -> None:
    """Run an entry point's ``main()`` and end the process with its code
    (``report.exit_process``); an exception of ``user_errors`` is printed as one line
    ``PREFIX: message`` (then the user's own traceback, if any) with exit code 2. A
    ``sys.exit()`` from the user's code (SystemExit out of ``main``) ends the process with its
    code, unannounced (the launcher then reports an early exit), also without interpreter
    finalization: with the process group still up, that aborts now and then (SIGABRT, see
    ``report.exit_process``) and the launcher would report a crash instead."""
    try:
        code = main()
    except user_errors as exc:
        if not getattr(exc, "announced", False):  # else the launcher prints it, once (strategies/job/first_batch.py)
            print(f"{prefix}: {exc}", file=sys.stderr)
        if getattr(exc, "user_traceback", None):
            print(exc.user_traceback, file=sys.stderr)
        report.exit_process(2, announce=False)  # as below: gloo's threads may still be up
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
        if not isinstance(code, int):  # sys.exit("message"): printed, status 1, as Python does
            print(code, file=sys.stderr)
            code = 1
        report.exit_process(code, announce=False)
    report.exit_process(code)


def cpu_threads() -> int:
    """CPU threads of this process: ``HPAR_THREADS`` when the launcher set it (this machine's
    cores over its processes here, or the user's ``--env OMP_NUM_THREADS``), else this host's
    own cores over ``HPAR_PROCS_ON_HOST``, the hpar processes the launcher placed on it (a
    remote host's core count is only known on that host)."""
    if os.environ.get("HPAR_THREADS"):
        return max(1, int(os.environ["HPAR_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("HPAR_PROCS_ON_HOST", "1"))))


def worker_device(cfg: RunConfig, local_rank: int) -> torch.device:
    """This worker's device: GPU ``LOCAL_RANK`` of the host's visible ones (one GPU per
    worker) on CUDA, else the CPU with :func:`cpu_threads` threads."""
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(cpu_threads())
    return torch.device("cpu")


def main() -> int:
    cfg = load_config(os.environ["HPAR_CONFIG"], os.environ.get("HPAR_CONFIG_SHA256"))
    rank, world_size, local_rank = env_int("RANK"), env_int("WORLD_SIZE"), env_int("LOCAL_RANK", 0)
    pg_rank, pg_world = env_int("HPAR_PG_RANK", rank), env_int("HPAR_PG_WORLD_SIZE", world_size)
    device = worker_device(cfg, local_rank)
    activity.announce_with(lambda change: report.emit("event", change))  # the end of an activity is seen at once
    stop_beat = report.start_heartbeat(device=device, threads=torch.get_num_threads() if device.type == "cpu" else None)
    job = load_job(cfg.script)
    if job.evaluate_fn is None:  # nothing to evaluate: no process gathers or pulls a whole copy of the model for it
        cfg = dataclasses.replace(cfg, eval=False)
    host_of = init_group(cfg, pg_rank, pg_world)
    # past the rendezvous: from here the start-up bound runs to the first step (launcher/run/health.py)
    report.emit("event", {"kind": "phase", "phase": "train"})
    spec = strategy_spec(cfg.strategy)
    train = spec.load("runtime")  # imported before the memory baseline
    memory.start_process(device)  # peak memory from here to the last step (strategies/common/measured_memory.py)
    eval_first = {}
    if rank == 0 and cfg.eval and not cfg.resume and not spec.servers:  # with servers: in the runtime (served rows)
        # evaluate()'s own peak is not training's; what it leaves behind (kernels' caches) counts
        with memory.outside_window():
            torch.manual_seed(cfg.seed)
            initial = job.build_model()  # building it is start-up, not evaluate()'s time
            report.emit("event", {"kind": "phase", "phase": "evaluate"})  # the peers wait: not their stall
            with activity.doing("in evaluate() before training"):  # but it has the phase deadline
                eval_first = job.run_evaluate(initial)  # evaluate() gets the model on the CPU
            del initial
        report.emit("event", {"kind": "first_eval", "eval": eval_first})
        report.emit("event", {"kind": "phase", "phase": "train"})
    ctx = WorkerContext(
        job=job,
        cfg=cfg,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        report=lambda m: report.emit("metric", m),
        pg_rank=pg_rank,
        pg_world_size=pg_world,
        host_of=host_of,
        event=lambda e: report.emit("event", e),
        on_step=report.set_step,
        report_eval=lambda m: report.emit("eval", m),
    )
    t0 = time.time()
    result = train(ctx)
    report.emit(
        "event",
        {
            "kind": "memory",
            "role": "worker",
            "rank": rank,
            **memory.process_peak().figures(),
            "final_peak_bytes": memory.final_peak_bytes(),
            "trims": memory.trims(),
        },
    )
    if rank == 0:  # the runtimes wrote the trained model where it lives (RUN_DIR/model, strategies/state/state.py)
        assert result.model is not None or result.eval_last is not None, "rank 0 evaluates the whole model"
        report.emit("event", {"kind": "phase", "phase": "evaluate"})
        eval_last = result.eval_last
        if result.model is not None:
            model = model_to_cpu(result.model)  # every strategy hands evaluate() the CPU model
            if eval_last is None:
                with activity.doing("in evaluate() after the last step"):
                    eval_last = job.run_evaluate(model) if cfg.eval else {}
            if is_pretrained(
                model
            ):  # a transformers model: RUN_DIR/hf loads with from_pretrained (strategies/state/hf_save.py)
                with activity.doing("writing RUN_DIR/hf (save_pretrained)"):
                    save_pretrained_dir(model, os.path.join(cfg.run_dir, "hf"))
        report.emit(
            "summary",
            {
                "strategy": cfg.strategy,
                "world_size": world_size,
                "steps": cfg.steps,
                "samples_per_s": result.samples_per_s,
                "loss_first": result.loss_first,
                "loss_last": result.loss_last,
                "eval_first": eval_first,
                "eval_last": eval_last,
                "bytes_per_step": result.bytes_per_step,
                "wall_s": time.time() - t0,
                **step_time_percentiles(result.step_times),
                **result.extra,
            },
        )
    leave_group(stop_beat)
    return 0


if __name__ == "__main__":
    run_entry(main, "hpar", (JobError, DiskFull, ConfigChanged, UnsafeCheckpoint))
