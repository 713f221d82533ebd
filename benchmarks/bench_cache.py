"""Benchmark the workers' hot-row caches (``--staleness s``, strategies/runtimes/hybrid/cache.py, after
HET: Miao et al., "HET: Scaling out Huge Embedding Model Training via Cache-enabled Distributed
Framework", VLDB 2022) and the dense AllReduce's compression (``--compress``, DDP's hooks:
fp16/bf16, PowerSGD after Vogels et al., NeurIPS 2019), alone or together, against plain
``hybrid``, in one run, as ratios.

For each script (examples/lm.py, examples/recsys.py) and each cluster (``--hosts 2,4,8``:
that many emulated hosts, one worker and one parameter server each, links capped at
``--rate``; or ``local:N``: N workers on this machine), it trains ``--steps`` steps with ``hpar
run --strategy hybrid`` and then with ``--staleness s`` for each s of ``--staleness`` (or each
configuration of ``--configs``: ``s2``, ``powersgd:2``, ``s2+powersgd:2``), the runs
interleaved round by round (``--repeat``) so that a burst of load on a shared machine hits them
alike, and reports per configuration:

* samples/s (summary.json's ``samples_per_s``: all workers' samples per second of wall clock
  after 2 warm-up steps), the best of the rounds and their spread (min-max);
* bytes per worker per step, sent + received (summary.json's ``bytes_per_step``, worker 0), and
  the served tables' part of them (``by_param`` without the dense AllReduce: what the cache can save);
* the cache's hit rate as measured (worker 0's lookups read from the cache, summary.json's
  ``cache.hit_rate``) and as the planner predicted it from the profile's row frequencies
  (``cache.predicted_hit_rate``, strategies/plan/costmodel_cache.py);
* the final evaluation (the script's ``evaluate()``: lm.py's validation perplexity, recsys.py's
  AUC), computed here, in this process, on the model each run left (RUN_DIR/model), so the
  runs time training alone (``--no-eval``);
* each figure's ratio against hybrid's in the same round.

Emulated hosts need root and iproute2 (launcher/bench/emulate.py, scripts/testhosts.py).

Usage: ``python benchmarks/bench_cache.py [--scripts examples/lm.py,examples/recsys.py]
[--hosts 2,4,8] [--rate 100mbit] [--steps 60] [--staleness 0,1,2,4,8] [--cache-rows 0.1]
[--repeat 1] [--json out.json] [--out out.md] [--plot out.png]``, or ``--from-json a.json,b.json
[--plot out.png]`` for the table and plot of earlier runs. Errors: a failed run raises RuntimeError with
the end of its output; the emulated hosts are removed on the way out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rate_Bps(rate: str) -> float:
    """``100mbit`` / ``1gbit`` / ``25000000bit`` -> bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"--rate {rate}: give e.g. 100mbit")


def run_one(
    script: str,
    workers: int,
    steps: int,
    staleness: int | None,
    cache_rows: float,
    run_dir: str,
    cluster_args: list[str],
    compress: str | None = None,
) -> dict:
    """``hpar run`` one configuration (stdout to RUN_DIR.log); returns its summary.json."""
    cmd = [
        sys.executable,
        "-m",
        "hpar.launcher.cli",
        "run",
        script,
        "--gpus",
        str(workers),
        "--strategy",
        "hybrid",
        "--steps",
        str(steps),
        "--run-dir",
        run_dir,
        "--plain",
        "--no-eval",
        "--precision",
        "fp32",
        "--log-every",
        str(max(1, steps // 3)),
        *cluster_args,
    ]
    if staleness is not None:
        cmd += ["--staleness", str(staleness), "--cache-rows", f"{cache_rows:g}"]
    if compress is not None:
        cmd += ["--compress", compress]
    with open(run_dir + ".log", "w") as out:
        code = subprocess.run(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        ).returncode
    if code != 0:
        with open(run_dir + ".log") as f:
            raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{f.read()[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def final_eval(script: str, run_dir: str) -> dict:
    """The script's ``evaluate()`` on the model the run left (RUN_DIR/model, strategies/state/state.py)."""
    import torch
    from hpar.strategies.state import state
    from hpar.strategies.job.contract import load_job

    job = load_job(script)
    torch.manual_seed(0)
    model = job.build_model()
    saved = state.read_all(os.path.join(run_dir, "model"))
    model.load_state_dict({k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")})
    return job.run_evaluate(model)


def figures(summary: dict, evaluation: dict) -> dict:
    b = summary.get("bytes_per_step") or {}
    cache = summary.get("cache") or {}
    tables = sum(
        v.get("sent", 0.0) + v.get("recv", 0.0)
        for k, v in (summary.get("by_param") or {}).items()
        if not k.startswith("_")
    )  # the served tables' pulls and pushes, not the dense AllReduce
    return {
        "samples_per_s": summary["samples_per_s"],
        "bytes": b.get("sent", 0.0) + b.get("recv", 0.0),
        "table_bytes": tables,
        "hit_rate": cache.get("hit_rate"),
        "predicted_hit_rate": cache.get("predicted_hit_rate"),
        "eval": evaluation,
        "step_s_p50": summary.get("step_s_p50"),
    }


def parse_config(label: str) -> tuple[int | None, str | None]:
    """``hybrid`` -> (None, None); ``s2`` -> (2, None); ``powersgd:2`` -> (None, "powersgd:2");
    ``s2+fp16`` -> (2, "fp16"): the staleness and the ``--compress`` of one configuration."""
    staleness, compress = None, None
    for part in label.split("+"):
        if part == "hybrid":
            continue
        if part[:1] == "s" and part[1:].isdigit():
            staleness = int(part[1:])
        else:
            compress = part
    return staleness, compress


def config_label(row: dict) -> str:
    """A row's configuration as ``--configs`` names it (rows of older --json files have no label)."""
    if row.get("config"):
        return row["config"]
    return "hybrid" if row["staleness"] is None else f"s{row['staleness']}"


def bench_cluster(scripts: list[str], label: str, workers: int, cluster_args: list[str], args, root: str) -> list[dict]:
    """Every script x configuration on one cluster, ``args.repeat`` interleaved rounds."""
    configs = ["hybrid"] + (
        [c for c in args.configs.split(",") if c != "hybrid"]
        if args.configs
        else [f"s{s}" for s in args.staleness.split(",")]
    )
    rows = []
    for script in scripts:
        got: dict = {c: [] for c in configs}
        for r in range(args.repeat):
            for c in configs:
                name = f"{os.path.basename(script)[:-3]}-{label}-{c.replace(':', '_')}-r{r}".replace(" ", "_")
                run_dir = os.path.join(root, name)
                t0 = time.time()
                staleness, compress = parse_config(c)
                summary = run_one(
                    script, workers, args.steps, staleness, args.cache_rows, run_dir, cluster_args, compress
                )
                fig = figures(summary, final_eval(script, run_dir))
                got[c].append(fig)
                print(
                    f"bench_cache: {name}: {fig['samples_per_s']:,.0f} samples/s, {fig['bytes'] / 1e6:.2f} MB/step, "
                    f"hit {fig['hit_rate']}, predicted {fig['predicted_hit_rate']}, eval {fig['eval']} "
                    f"({time.time() - t0:.0f} s)",
                    flush=True,
                )
        base = got["hybrid"]
        for c in configs:
            runs = got[c]
            staleness, compress = parse_config(c)
            rows.append(
                {
                    "script": os.path.basename(script),
                    "cluster": label,
                    "config": c,
                    "staleness": staleness,
                    "compress": compress,
                    "runs": runs,
                    "samples_ratio": [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs, base)],
                    "bytes_ratio": [a["bytes"] / b["bytes"] for a, b in zip(runs, base)],
                    "table_bytes_ratio": [a["table_bytes"] / b["table_bytes"] for a, b in zip(runs, base)],
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    """The table of the BENCHMARKS.md section (figures of the best round; ratios over rounds)."""
    out = [
        "| script | cluster | configuration | samples/s (best) | x hybrid (rounds) | MB/worker/step | x hybrid | tables' MB "
        "| x hybrid | hit rate measured / predicted | final eval | eval x hybrid |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---:|",
    ]
    for row in rows:
        runs = row["runs"]
        best = max(runs, key=lambda f: f["samples_per_s"])
        ((metric, value),) = list(best["eval"].items())[:1] or [("-", math.nan)]
        base = next(
            r
            for r in rows
            if r["script"] == row["script"] and r["cluster"] == row["cluster"] and config_label(r) == "hybrid"
        )
        base_eval = list(base["runs"][runs.index(best)]["eval"].values())[0] if base["runs"][0]["eval"] else math.nan
        hit = "-" if best["hit_rate"] is None else f"{best['hit_rate']:.1%} / {best['predicted_hit_rate']:.1%}"
        ratios = ", ".join(f"{x:.2f}" for x in row["samples_ratio"])
        out.append(
            f"| {row['script']} | {row['cluster']} | {config_label(row)} "
            f"| {best['samples_per_s']:,.0f} | {ratios} | {best['bytes'] / 1e6:.2f} "
            f"| {min(row['bytes_ratio']):.2f} | {best['table_bytes'] / 1e6:.2f} "
            f"| {min(row['table_bytes_ratio']):.2f} | {hit} | {metric} {value:.4g} | {value / base_eval:.4f} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    """Write a PNG: against s, per script and cluster, the tables' bytes, all bytes, samples/s
    and the final evaluation, each as a ratio to hybrid's (best round)."""
    from hpar.launcher.bench.bench_report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    titles = ["served tables' bytes / step", "all bytes / step", "samples/s", "final evaluation"]
    for key in dict.fromkeys((r["script"], r["cluster"]) for r in rows):
        mine = [r for r in rows if (r["script"], r["cluster"]) == key and not r.get("compress")]
        base = next(r for r in mine if r["staleness"] is None)["runs"][0]
        cached = sorted((r for r in mine if r["staleness"] is not None), key=lambda r: r["staleness"])
        xs = [r["staleness"] for r in cached]
        firsts = [r["runs"][0] for r in cached]
        ys = [
            [f["table_bytes"] / base["table_bytes"] for f in firsts],
            [f["bytes"] / base["bytes"] for f in firsts],
            [max(r["samples_ratio"]) for r in cached],
            [list(f["eval"].values())[0] / list(base["eval"].values())[0] if f["eval"] else math.nan for f in firsts],
        ]
        for ax, y in zip(axes, ys):
            ax.plot(xs, y, marker="o", label=f"{key[0]}, {key[1]}")
    for ax, title in zip(axes, titles):
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(title + " (x hybrid)")
        ax.set_xlabel("staleness s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scripts", default="examples/lm.py,examples/recsys.py")
    ap.add_argument("--hosts", default="2,4", help="emulated host counts, or local:N (N workers here)")
    ap.add_argument("--rate", default="100mbit", help="each emulated host's link cap")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--staleness", default="0,1,2,4,8")
    ap.add_argument(
        "--configs",
        default=None,
        help="configurations beside hybrid instead of --staleness: sN, a --compress value, or both "
        "joined by + (e.g. s2,fp16,powersgd:2,s2+powersgd:2)",
    )
    ap.add_argument("--cache-rows", type=float, default=0.1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--plot", default=None, help="write a PNG of the ratios against s here (matplotlib)")
    ap.add_argument(
        "--from-json",
        default=None,
        help="comma-separated --json files of earlier runs: table and plot of their rows, nothing run",
    )
    args = ap.parse_args()
    if args.from_json:
        rows = [row for f in args.from_json.split(",") for row in json.load(open(f))["rows"]]
        print(markdown(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
    scripts = [os.path.join(HERE, s) if not os.path.isabs(s) else s for s in args.scripts.split(",")]
    root = tempfile.mkdtemp(prefix="hpar-bench-cache-")
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for spec in args.hosts.split(","):
        if spec.startswith("local:"):
            n = int(spec.split(":")[1])
            rows += bench_cluster(scripts, f"{n} local workers", n, [], args, root)
            continue
        from hpar.launcher.bench.emulate import EmulatedCluster

        n = int(spec)
        with EmulatedCluster(n, n, _rate_Bps(args.rate)) as em:
            cluster = ["--hosts", em.host_file, "--ssh-key", em.made.key, "--env", "OMP_NUM_THREADS"]
            rows += bench_cluster(scripts, f"{n} hosts at {args.rate}", n, cluster, args, root)
    table = markdown(rows)
    print(
        f"\nbench_cache: {started:%Y-%m-%d %H:%M}-{datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC, "
        f"{args.steps} steps, cache rows {args.cache_rows:g}, run dirs under {root}\n{table}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
