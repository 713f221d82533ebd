"""Does ``--strategy auto`` pick the measured fastest plan? One row per job and cluster.

    python benchmarks/auto_table.py --out auto.json [--steps 20] [--repeat 3] [--tune-steps 6]
        [--points examples/lm.py:2,examples/recsys.py:4,...] [--strategies allreduce,hybrid,...]

For every point (a job and a cluster: ``JOB:N`` for N local workers, or ``JOB:emulate:H`` for
H emulated hosts of one worker each, root only: the bench's ``--hosts emulate:H``, and for the
run H test hosts of scripts/testhosts.py, uncapped links as the bench's) this runs, one after the other on the same machine:

1. ``hpar bench JOB --gpus N --repeat R --strategies S --json``: every strategy auto may choose
   (``--strategies``) that applies, measured in rounds (the reference: the fastest candidate and its spread, min-max over the rounds), with
   the cost model's predicted step beside each (the model's error on this point);
2. ``hpar run JOB --gpus N --strategy auto --tune on``: the plan the model chose, what the
   trials measured and chose (``summary.json``'s ``tuning``), and the trials' wall time
   (``--tune on``: the table's runs are short, which ``--tune auto`` would leave untried).

A point passes when the strategy ``auto`` trained measured, in the bench, within the spread of
the fastest strategy's (its best round at least the fastest's worst round). The cost model's
error on a point is |predicted / measured samples/s - 1| for each strategy the bench ran; the
table reports its mean per point and over all points, with whether the model's ranking of the
fastest is right. Results go to ``--out`` (JSON) and a markdown table on stdout, for
BENCHMARKS.md. A point whose bench or run fails is reported as failed with its exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# examples and the tests' zoo on 1-4 local workers (the default table: 12 points)
DEFAULT_POINTS = (
    "examples/lm.py:2",
    "examples/lm.py:4",
    "examples/recsys.py:2",
    "examples/recsys.py:4",
    "examples/cnn.py:2",
    "examples/wide.py:2",
    "examples/wide.py:4",
    "examples/hf_gpt2.py:2",
    "tests/zoo/hf_bert.py:2",
    "tests/zoo/resnet.py:2",
    "tests/zoo/encoder.py:2",
    "examples/lm.py:1",
)
# what --strategy auto may choose (the planner's pipeline runs 1f1b; hybrid-cache needs --staleness)
CANDIDATES = "allreduce,allreduce-sparse,hybrid,ps,fsdp,pipeline-1f1b"


def hpar(args: list[str], out_path: str, timeout: float) -> int:
    """Run ``hpar ARGS`` with stdout and stderr to ``out_path``; its exit code (124: timed out)."""
    with open(out_path, "w", encoding="utf-8") as f:
        try:
            return subprocess.run(
                [sys.executable, "-m", "hpar.launcher.cli", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def bench_point(
    job: str, cluster: list[str], steps: int, repeat: int, strategies: str, work: str, timeout: float
) -> dict:
    """The bench's rows for one point: {strategy: {"sps", "low", "high", "pred_sps"}}, or {"error"}."""
    out = os.path.join(work, "bench.json")
    code = hpar(
        [
            "bench",
            job,
            *cluster,
            "--steps",
            str(steps),
            "--repeat",
            str(repeat),
            "--strategies",
            strategies,
            "--json",
            out,
            "--bench-dir",
            os.path.join(work, "bench"),
        ],
        os.path.join(work, "bench.txt"),
        timeout,
    )
    if code != 0 or not os.path.exists(out):
        return {"error": f"bench exit {code}"}
    rows = {}
    for r in json.load(open(out, encoding="utf-8"))["results"]:
        if r.get("reason") or not r.get("samples_per_s"):
            continue
        runs = [x for x in (r.get("extra") or {}).get("runs_samples_per_s") or () if x] or [r["samples_per_s"]]
        name = (r.get("extra") or {}).get("ran_as") or r["strategy"]
        pred = None
        if r.get("predicted_step_s") and r.get("step_s_p50"):  # samples/s as the model predicts it
            pred = r["samples_per_s"] * r["step_s_p50"] / r["predicted_step_s"]
        rows[r["strategy"]] = {
            "sps": r["samples_per_s"],
            "low": min(runs),
            "high": max(runs),
            "pred_sps": pred,
            "ran_as": name,
        }
    return rows


def auto_point(job: str, cluster: list[str], steps: int, tune_steps: int, work: str, timeout: float) -> dict:
    """What ``--strategy auto`` (with its trials) trained: {"strategy", "model_choice", "trial_s", ...}."""
    run_dir = os.path.join(work, "auto")
    code = hpar(
        [
            "run",
            job,
            *cluster,
            "--strategy",
            "auto",
            "--tune",
            "on",
            "--tune-steps",
            str(tune_steps),
            "--steps",
            str(steps),
            "--run-dir",
            run_dir,
            "--plain",
            "--no-eval",
        ],
        os.path.join(work, "auto.txt"),
        timeout,
    )
    try:
        summary = json.load(open(os.path.join(run_dir, "summary.json"), encoding="utf-8"))
    except (OSError, ValueError):
        return {"error": f"run exit {code}"}
    tuning = summary.get("tuning") or {}
    trials = tuning.get("trials") or []
    return {
        "exit_code": code,
        "strategy": summary.get("strategy"),
        "model_choice": trials[0]["strategy"] if trials else summary.get("strategy"),
        "chosen": tuning.get("chosen"),
        "trial_s": tuning.get("trial_s"),
        "note": tuning.get("note"),
        "predicted_step_s": summary.get("predicted_step_s"),
    }


def on_test_hosts(count: int, work: str, run) -> dict:
    """``run(cluster flags)`` on ``count`` test hosts of this machine (scripts/testhosts.py:
    network namespaces with their own sshd, uncapped links, as the bench's emulated hosts),
    one worker each; the hosts are torn down after. {"error"} where they cannot be made."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import testhosts

    reason = testhosts.unavailable()
    if reason:
        return {"error": f"test hosts: {reason}"}
    prefix = f"at{os.getpid() % 10000}"
    made = testhosts.up(count, prefix=prefix, net=254)
    try:
        hosts = os.path.join(work, "hosts.txt")
        with open(hosts, "w", encoding="utf-8") as f:
            f.writelines(f"root@{a}:22 slots=1\n" for a in made.addresses)
        return run(
            ["--hosts", hosts, "--gpus", str(count), "--ssh-key", made.key, "--ssh-known-hosts", made.known_hosts]
        )
    finally:
        testhosts.down(prefix)


def verdict(rows: dict, auto: dict) -> dict:
    """Whether auto's strategy is within the fastest's spread, and the model's error here.

    A row that ran as another strategy (hybrid with nothing on its servers runs as allreduce)
    is that strategy measured again under another name: it is never the fastest (as in the
    bench's own verdict, launcher/bench/verdict.py), nor counted in the model's error (its
    prediction is for a plan that did not run); auto's run is judged by the row of the
    strategy it ran, or a row that ran as it where the bench has none of its own."""
    if "error" in rows or "error" in auto or not rows:
        return {"pass": False}
    real = {s: r for s, r in rows.items() if r["ran_as"] == s} or rows
    fastest = max(real, key=lambda s: real[s]["sps"])
    ran = (
        auto["strategy"]
        if auto["strategy"] in real
        else next((s for s in rows if rows[s]["ran_as"] == auto["strategy"]), None)
    )
    within = ran is not None and rows[ran]["high"] >= real[fastest]["low"]
    errors = [abs(r["pred_sps"] / r["sps"] - 1) for r in real.values() if r["pred_sps"]]
    predicted_fastest = max((s for s in real if real[s]["pred_sps"]), key=lambda s: real[s]["pred_sps"], default=None)
    return {
        "pass": within,
        "fastest": fastest,
        "ran": ran,
        "ratio": rows[ran]["sps"] / real[fastest]["sps"] if ran else None,
        "model_error": statistics.mean(errors) if errors else None,
        "model_ranks_fastest": predicted_fastest == fastest,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=",".join(DEFAULT_POINTS), help="JOB:N (N local workers) or JOB:emulate:H")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tune-steps", type=int, default=6)
    ap.add_argument("--strategies", default=CANDIDATES, help="the bench's strategies (default: those auto may choose)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="auto_table.json")
    args = ap.parse_args()
    results = []
    for point in args.points.split(","):
        job, _, where = point.partition(":")
        cluster = (
            ["--hosts", where, "--gpus", where.split(":")[1]] if where.startswith("emulate:") else ["--gpus", where]
        )
        work = tempfile.mkdtemp(prefix="hpar-auto-")
        rows = bench_point(job, cluster, args.steps, args.repeat, args.strategies, work, args.timeout)
        if where.startswith("emulate:"):  # hpar run needs real hosts: test hosts, one worker each
            auto = on_test_hosts(
                int(where.split(":")[1]),
                work,
                lambda hosts: auto_point(job, hosts, args.steps, args.tune_steps, work, args.timeout),
            )
        else:
            auto = auto_point(job, cluster, args.steps, args.tune_steps, work, args.timeout)
        results.append({"point": point, "bench": rows, "auto": auto, **verdict(rows, auto), "work": work})
        print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print(
        "\n| job:cluster | fastest measured | auto (model's choice) | auto / fastest | within spread | trials | "
        "model error | model ranks the fastest |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        a = r["auto"]
        print(
            f"| {r['point']} | {r.get('fastest', '-')} | {a.get('strategy', a.get('error'))} ({a.get('model_choice')}) | "
            f"{r['ratio']:.2f} | {'yes' if r['pass'] else 'no'} | {a.get('trial_s') or 0:.0f} s | "
            f"{r['model_error']:.0%} | {'yes' if r.get('model_ranks_fastest') else 'no'} |"
            if r.get("ratio") is not None
            else f"| {r['point']} | failed: {r['bench'].get('error') or a.get('error')} |"
        )
    errs = [r["model_error"] for r in results if r.get("model_error") is not None]
    print(
        f"\n{sum(r['pass'] for r in results)}/{len(results)} points within the fastest's spread; "
        f"mean model error {statistics.mean(errs):.0%} over {len(errs)} points"
        if errs
        else "no point measured"
    )
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
