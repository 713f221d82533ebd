"""Check the current cost model against the runs of an earlier ``hpar bench --scale``.

Every ``hpar bench`` keeps, per script and host count, the profile and the cluster its
predictions were made from (``<bench dir>/hosts-N/<script>-profile.json``). This script
recomputes each measured point's prediction from them with the cost model as it is now
(strategies/plan/costmodel.py), next to the prediction the bench printed and the measured
samples/s, and prints each script's mean absolute error and the points where the predicted
order of strategies differs from the measured one. Nothing is run: it takes seconds.

A change to the cost model checked this way has seen these points; say so beside any figure
it gives (BENCHMARKS.md), and confirm with a fresh run.

Usage: ``python benchmarks/repredict.py scale.json [--bench-dir DIR] [--request-cpu-s S|probe]
[--replace-request-cpu]`` (default: the bench directory recorded in the JSON's settings).
``--request-cpu-s`` gives clusters saved without a measured request CPU one (``probe``:
measure it now with strategies/plan/probe.probe_requests); with ``--replace-request-cpu``
every saved cluster gets it (benches saved before the request probe measured what it does now).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from hpar.launcher.bench.bench_config import bench_entry, row_compress
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.estimates import estimate_all
from hpar.strategies.profile.profiler import Profile


def load_saved(path: str) -> tuple[Profile, ClusterSpec]:
    """The (Profile, ClusterSpec) an ``hpar bench`` saved in ``path``; fields the Profile or the
    ClusterSpec no longer has are left out (a bench before 2026-11-27's gradient_exchange_s saved
    its sparse-only sparse_exchange_s, and the run of f130106 a sparse update's fixed part, which
    the model does not read)."""
    saved = json.load(open(path, encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(ClusterSpec)}
    cluster = {k: v for k, v in saved["cluster"].items() if k in known}
    cluster["gpus_per_host"] = tuple(cluster["gpus_per_host"])
    fields = {f.name for f in dataclasses.fields(Profile)}
    return Profile.from_dict({k: v for k, v in saved["profile"].items() if k in fields}), ClusterSpec(**cluster)


def repredict(doc: dict, bench_dir: str, request_cpu_s: float | None = None, replace: bool = False) -> list[dict]:
    """For every measured point of a ``--scale`` document: ``{"script", "strategy", "workers",
    "measured", "then", "now"}`` in samples/s over all workers (``then``: the bench's
    prediction; ``now``: the current cost model's, None when a saved profile is missing or
    the strategy is infeasible). ``request_cpu_s`` fills a saved cluster's missing
    ``request_cpu_s``, or with ``replace`` takes the place of every saved one."""
    rows, cache = [], {}
    for p in doc["points"]:
        if not p.get("samples_per_s"):
            continue
        stem = os.path.splitext(os.path.basename(p["script"]))[0]
        path = os.path.join(bench_dir, f"hosts-{p['workers']}", f"{stem}-profile.json")
        now = None
        if os.path.isfile(path):
            if path not in cache:
                profile, cluster = load_saved(path)
                if request_cpu_s is not None and (replace or cluster.request_cpu_s is None):
                    cluster = dataclasses.replace(cluster, request_cpu_s=request_cpu_s)
                cache[path] = (profile, {e.strategy: e for e in estimate_all(profile, cluster)})
            profile, estimates = cache[path]
            est = None if row_compress(p["strategy"]) else estimates.get(bench_entry(p["strategy"])[0])
            if est is not None and est.feasible and est.step_s > 0:
                now = p["workers"] * profile.batch_size / est.step_s
        rows.append(
            {
                "script": stem,
                "strategy": p["strategy"],
                "workers": p["workers"],
                "measured": p["samples_per_s"],
                "then": p.get("predicted_samples_per_s"),
                "now": now,
                "ran_as": p.get("ran_as"),
            }
        )
    return rows


def _mape(rows: list[dict], key: str) -> str:
    errs = [abs(r[key] / r["measured"] - 1) for r in rows if r[key]]
    return f"{100 * sum(errs) / len(errs):.0f}% over {len(errs)}" if errs else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scale_json")
    ap.add_argument("--bench-dir", default=None)
    ap.add_argument("--request-cpu-s", default=None)
    ap.add_argument(
        "--replace-request-cpu",
        action="store_true",
        help="use --request-cpu-s for every saved cluster, not only those without one",
    )
    args = ap.parse_args(argv)
    doc = json.load(open(args.scale_json, encoding="utf-8"))
    bench_dir = args.bench_dir or doc["settings"]["bench_dir"]
    request = args.request_cpu_s
    if request == "probe":
        from hpar.strategies.runtimes.hybrid.request_probe import probe_requests

        request = probe_requests()
        print(f"request CPU measured now: {request * 1e6:.0f} us")
    rows = repredict(doc, bench_dir, None if request is None else float(request), args.replace_request_cpu)
    print("| script | workers | strategy | measured | predicted then (x) | predicted now (x) |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        cell = lambda v: "-" if not v else f"{v:,.0f} ({v / r['measured']:.2f})"
        print(
            f"| {r['script']} | {r['workers']} | {r['strategy']} | {r['measured']:,.0f} | {cell(r['then'])} | {cell(r['now'])} |"
        )
    for script in dict.fromkeys(r["script"] for r in rows):
        mine = [r for r in rows if r["script"] == script]
        wrong = []
        for n in sorted({r["workers"] for r in mine}):
            here = [r for r in mine if r["workers"] == n and r["now"] and not r["ran_as"]]
            if len(here) > 1 and [r["strategy"] for r in sorted(here, key=lambda r: -r["measured"])] != [
                r["strategy"] for r in sorted(here, key=lambda r: -r["now"])
            ]:
                wrong.append(n)
        if not any(r["now"] for r in mine):
            print(
                f"- {script}: mean absolute error then {_mape(mine, 'then')} points; no saved profiles to predict now"
            )
            continue
        print(
            f"- {script}: mean absolute error then {_mape(mine, 'then')}, now {_mape(mine, 'now')} points; "
            f"predicted order differs from the measured one at {wrong or 'no'} workers"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
