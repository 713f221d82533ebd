"""Benchmark hpar's pipeline: speed against torch.distributed.pipelining and DDP, and
convergence of the schedules.

Speed (real processes, gloo on CPU, one thread each): on examples/wide.py (8 Linear
2048x2048 layers, batch 32, synthetic data) with 2 stages,
  hpar ``1f1b`` vs torch.distributed.pipelining ``Schedule1F1B`` (same stages, same M),
  hpar ``async-predict`` vs hpar ``1f1b``,
  and DDP ``allreduce`` with 2 workers on the same global batch (16 per worker).
Each configuration runs ``--repeats`` times, interleaved; the best median step time counts.

Convergence (``--convergence``): examples/cnn.py (scikit-learn digits, real data) with
K stages (default 4) and M micro-batches (default 4) under ``1f1b``, ``async-stash``, ``async-predict`` and ``async`` for the same
number of samples, validation accuracy from the example's evaluate(). Uses the
single-process simulator (strategies/runtimes/pipeline/sim.py), which tests/test_pipeline.py checks
to give the same weights as the multi-process runtime.

Usage: python benchmarks/bench_pipeline.py [--steps 12] [--repeats 2] [--convergence
[--convergence-steps 200] [--convergence-stages 4] [--convergence-micro 4]] [--no-speed]
Writes the table to stdout and, with the command, machine, date and torch version, to
--out (default /tmp/bench_pipeline.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

from hpar.strategies.plan.cluster import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = os.path.join(ROOT, "examples", "wide.py")
CNN = os.path.join(ROOT, "examples", "cnn.py")


def run_workers(
    script: str,
    strategy: str,
    world: int,
    steps: int,
    batch: int,
    schedule: str = "1f1b",
    micro: int = 4,
    timeout: float = 600,
    lr: float = 0.001,
) -> dict:
    """Start ``world`` worker processes as the launcher does; returns rank 0's summary."""
    from hpar.strategies.job.config import RunConfig

    run_dir = tempfile.mkdtemp(prefix="hpar-bench-")
    cfg = RunConfig(
        script=script,
        strategy=strategy,
        world_size=world,
        steps=steps,
        batch_size=batch,
        lr=lr,
        seed=0,
        run_dir=run_dir,
        schedule=schedule,
        micro_batches=micro,
        log_every=steps,
        eval=False,
    )
    path = os.path.join(run_dir, "config.json")
    with open(path, "w") as f:
        f.write(cfg.to_json())
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            HPAR_CONFIG=path,
            HPAR_THREADS="1",
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "hpar.workers.worker"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{strategy}/{schedule} failed (exit {p.returncode}):\n{out[-3000:]}")
    for line in outs[0].splitlines():
        if line.startswith("@hpar summary "):
            return json.loads(line[len("@hpar summary ") :])
    raise RuntimeError(f"{strategy}/{schedule}: no summary\n{outs[0][-3000:]}")


def speed(steps: int, repeats: int) -> list[dict]:
    configs = [
        ("hpar 1f1b M=4", "pipeline", "1f1b", 4, 32),
        ("torch Schedule1F1B M=4", "pipeline", "torch-1f1b", 4, 32),
        ("hpar async-predict M=4", "pipeline", "async-predict", 4, 32),
        ("hpar 1f1b M=2", "pipeline", "1f1b", 2, 32),
        ("hpar 1f1b M=1", "pipeline", "1f1b", 1, 32),
        ("hpar async-predict M=1", "pipeline", "async-predict", 1, 32),
        ("DDP allreduce, 2 x 16", "allreduce", "1f1b", 1, 16),
    ]
    best: dict[str, dict] = {}
    for r in range(repeats):
        for name, strategy, schedule, micro, batch in configs:
            s = run_workers(WIDE, strategy, 2, steps, batch, schedule, micro)
            row = {
                "name": name,
                "step_s": s.get("step_s_p50", s.get("step_s_median")),
                "samples_per_s": s["samples_per_s"],
                "bytes_sent": s["bytes_per_step"]["sent"],
                "stages": s.get("stages"),
            }
            print(
                f"  run {r + 1}: {name}: {row['step_s']:.3f} s/step, {row['samples_per_s']:.1f} samples/s", flush=True
            )
            if name not in best or row["step_s"] < best[name]["step_s"]:
                best[name] = row
    return [best[name] for name, *_ in configs]


def convergence(steps: int, stages: int = 4, micro: int = 4) -> list[dict]:
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.runtimes.pipeline.sim import simulate

    torch.set_num_threads(1)
    rows = []
    for schedule in ("1f1b", "async-stash", "async-predict", "async"):
        # a fresh copy of the script per schedule: cnn.py's data() advances its epoch on
        # every call, so reusing one job would give each schedule different batches
        job = load_job(CNN)
        batch, lr = job.defaults.get("batch_size", 32), job.defaults.get("lr", 0.05)
        r = simulate(job, schedule, stages, steps=steps, batch_size=batch, micro_batches=micro, lr=lr, seed=0)
        metrics = job.run_evaluate(r.model)
        rows.append(
            {
                "schedule": schedule,
                "samples": steps * batch,
                "accuracy": metrics.get("accuracy"),
                "val_loss": metrics.get("loss"),
                "train_loss_last": r.losses[-1],
            }
        )
        print(f"  {schedule}: accuracy {metrics.get('accuracy'):.4f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--convergence", action="store_true")
    ap.add_argument("--convergence-steps", type=int, default=200)
    ap.add_argument("--convergence-stages", type=int, default=4)
    ap.add_argument("--convergence-micro", type=int, default=4, help="micro-batches per batch (M)")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--out", default="/tmp/bench_pipeline.md")
    args = ap.parse_args()
    lines = [
        "## Pipeline (issue 5)",
        "",
        f"Command: `python benchmarks/bench_pipeline.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {platform.node()}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        f"date {datetime.datetime.now().isoformat(timespec='minutes')}; torch {torch.__version__}; "
        "gloo on CPU, 1 thread per process. The machine was shared with other jobs: figures are noisy.",
        "",
    ]
    if not args.no_speed:
        print("speed on examples/wide.py (8 x Linear 2048, batch 32), 2 processes:", flush=True)
        rows = speed(args.steps, args.repeats)
        by = {r["name"]: r for r in rows}
        lines += [
            "### Speed: examples/wide.py, 2 processes",
            "",
            "| configuration | s/step (median) | samples/s | bytes sent/step (rank 0) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['name']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | {r['bytes_sent']:.0f} |" for r in rows
        ]
        ratios = []
        ratios.append(
            "hpar 1f1b / torch Schedule1F1B throughput, M=4: "
            f"{by['hpar 1f1b M=4']['samples_per_s'] / by['torch Schedule1F1B M=4']['samples_per_s']:.2f} "
            "(torch's Schedule1F1B refuses M < number of stages, so M=1 has no torch row)"
        )
        for m in (4, 1):
            ratios.append(
                f"hpar async-predict / hpar 1f1b throughput, M={m}: "
                f"{by[f'hpar async-predict M={m}']['samples_per_s'] / by[f'hpar 1f1b M={m}']['samples_per_s']:.2f}"
            )
        best_sync = max(r["samples_per_s"] for r in rows if r["name"].startswith("hpar 1f1b"))
        ratios.append(
            "hpar async-predict M=1 / the fastest hpar 1f1b (any M) throughput: "
            f"{by['hpar async-predict M=1']['samples_per_s'] / best_sync:.2f}"
        )
        best_pipe = max(r["samples_per_s"] for r in rows if r["name"].startswith("hpar"))
        ratios.append(
            f"best hpar pipeline / DDP allreduce throughput: {best_pipe / by['DDP allreduce, 2 x 16']['samples_per_s']:.2f}"
        )
        lines += [""] + [f"- {r}" for r in ratios] + [""]
        print("\n".join(ratios))
    if args.convergence:
        k, m = args.convergence_stages, args.convergence_micro
        print(f"convergence on examples/cnn.py, {k} stages, M={m} (simulator):", flush=True)
        rows = convergence(args.convergence_steps, k, m)
        lines += [
            f"### Convergence: examples/cnn.py (digits), {k} stages, M={m}, same samples",
            "",
            "| schedule | samples | val accuracy | val loss | last train loss |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['schedule']} | {r['samples']} | {r['accuracy']:.4f} | {r['val_loss']:.4f} | {r['train_loss_last']:.4f} |"
            for r in rows
        ]
        lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
