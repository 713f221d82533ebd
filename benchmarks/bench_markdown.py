"""Render the JSON written by ``hpar bench --json FILE`` as the Markdown tables of BENCHMARKS.md.

Usage: ``python benchmarks/bench_markdown.py out.json [more.json ...]``. For each file it prints the
command, date, machine and torch version, then one table per script with samples/s, step time
p50/p90, bytes per worker per step, the predicted step time and its ratio to the measured one,
and the ratio to the fastest strategy; strategies that did not run show their reason. When the
bench ran on an emulated cluster, the byte check against the kernel's counters follows. A
``--scale`` document gives one table of samples/s per script and worker count (median run,
slowest-fastest with ``--repeat``, prediction and predicted/measured), the cost model's mean
error per script, and the measured and predicted orders per point. Runs that reported their
peak memory add the predicted-against-measured table of ``hpar bench --memory``.
"""

from __future__ import annotations

import json
import os
import sys


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _point(p: dict | None) -> str:
    """One scale table cell: median samples/s (slowest-fastest run) (prediction, pred/meas)."""
    if p is None:
        return "-"
    if p.get("reason"):
        return f"n/a ({p['reason'][:40]})"
    runs = p.get("runs") or []
    spread = f" [{min(runs):,.0f}-{max(runs):,.0f}]" if len(runs) > 1 else ""
    pred = p.get("predicted_samples_per_s")
    tail = f" ({pred:,.0f}, {pred / p['samples_per_s']:.2f})" if pred else ""
    return f"{p['samples_per_s']:,.0f}{spread}{tail}" + (f" ran as {p['ran_as']}" if p.get("ran_as") else "")


def render_scale(doc: dict) -> str:
    """Markdown for one ``hpar bench --scale`` document (launcher/bench/scale.py)."""
    m = doc.get("machine", {})
    command = doc["command"] if isinstance(doc["command"], str) else " ".join(doc["command"])
    pts = doc["points"]
    strategies = list(dict.fromkeys(p["strategy"] for p in pts))
    out = [
        f"Command: `{command.replace(os.getcwd() + os.sep, '')}`  ",
        f"Machine: {m.get('cpu_count', '?')} x {m.get('cpu_model', '?')}, torch {m.get('torch')}.",
        "",
        "samples/s, all workers: median run [slowest-fastest run] (prediction, predicted/measured)",
        "",
        "| script | workers | " + " | ".join(strategies) + " |",
        "|---|---:|" + "---|" * len(strategies),
    ]
    for script in dict.fromkeys(p["script"] for p in pts):
        mine = [p for p in pts if p["script"] == script]
        for n in sorted({p["workers"] for p in mine}):
            cell = {p["strategy"]: p for p in mine if p["workers"] == n}
            out.append(
                f"| {os.path.basename(script)} | {n} | " + " | ".join(_point(cell.get(s)) for s in strategies) + " |"
            )
    out.append("")
    for script in dict.fromkeys(p["script"] for p in pts):
        errs = [
            abs(p["predicted_samples_per_s"] / p["samples_per_s"] - 1)
            for p in pts
            if p["script"] == script and p.get("samples_per_s") and p.get("predicted_samples_per_s")
        ]
        rows = [r for r in doc.get("rankings", []) if r["script"] == script]
        if errs:
            out.append(
                f"- {os.path.basename(script)}: mean absolute error {100 * sum(errs) / len(errs):.0f}% over "
                f"{len(errs)} points; order as measured at {sum(r['agree'] for r in rows)} of {len(rows)} points"
                + (
                    f", where the runs do not overlap at {sum(r.get('agree_beyond_spread', r['agree']) for r in rows)}"
                    if any("agree_beyond_spread" in r for r in rows)
                    else ""
                )
            )
    return "\n".join(out)


def render(doc: dict) -> str:
    """Markdown for one bench document (see launcher/bench_report.document)."""
    if "points" in doc:
        return render_scale(doc)
    m = doc.get("machine", {})
    command = doc["command"] if isinstance(doc["command"], str) else " ".join(doc["command"])
    command = command.replace(os.getcwd() + os.sep, "")
    out = [
        f"Command: `{command}`  ",
        f"Date: {doc.get('date')}; machine: {m.get('cpu_count', '?')} x {m.get('cpu_model', '?')}, "
        f"{m.get('memory_bytes', 0) / 2**30:.1f} GiB, GPU: {m.get('gpu') or 'none'}; torch {m.get('torch', doc.get('torch'))}.",
        "",
    ]
    by_script: dict[str, list] = {}
    for r in doc["results"]:
        by_script.setdefault(os.path.basename(r["script"]), []).append(r)
    for script, rows in by_script.items():
        out += [
            f"**{script}**",
            "",
            "| strategy | samples/s | step p50 | step p90 | sent/worker/step | recv/worker/step | predicted step | pred/meas | x fastest |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        skipped: dict[str, list[str]] = {}
        for r in rows:
            if r.get("reason"):
                skipped.setdefault(r["reason"], []).append(r["strategy"])
                continue
            b = r.get("bytes_per_step") or {}
            pm = (
                (r["predicted_step_s"] / r["step_s_p50"]) if r.get("predicted_step_s") and r.get("step_s_p50") else None
            )
            ran_as = (r.get("extra") or {}).get("ran_as")
            out.append(
                f"| {r['strategy']}{f' (ran as {ran_as})' if ran_as else ''} | {r['samples_per_s']:,.1f} | {_ms(r.get('step_s_p50'))} | {_ms(r.get('step_s_p90'))} | "
                f"{_mb(b.get('sent'))} | {_mb(b.get('recv'))} | {_ms(r.get('predicted_step_s'))} | "
                f"{'-' if pm is None else f'{pm:.2f}'} | {r['ratio']:.2f} |"
            )
        notes = [f"- not run: {', '.join(names)}: {reason}" for reason, names in skipped.items()]
        out += [""] + notes + ([""] if notes else [])
        checks = [(r["strategy"], r["counters"]) for r in rows if r.get("counters")]
        if checks:
            out += [
                "Byte check (all hosts, bytes per step after warm-up): hpar's own accounting of every byte sent vs the "
                "kernel's TCP socket counters (loopback included), and hpar's bytes addressed to another host vs the "
                "bytes that left the hosts' interfaces (frames, and their TCP payload: less 66 header bytes per packet).",
                "",
                "| strategy | hpar | TCP sockets | TCP / hpar | hpar to other hosts | interfaces | payload | payload / hpar to other hosts |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for name, c in checks:
                h, t, i = c.get("hpar_bytes_per_step"), c.get("tcp_bytes_per_step"), c.get("interface_bytes_per_step")
                rem, pay = c.get("hpar_remote_bytes_per_step"), c.get("interface_payload_bytes_per_step")
                ratio = lambda x, d: "-" if not (x and d) else f"{x / d:.2f}"
                out.append(
                    f"| {name} | {_mb(h)} | {_mb(t)} | {ratio(t, h)} | {_mb(rem)} | {_mb(i)} | {_mb(pay)} | "
                    f"{ratio(pay, rem)} |"
                )
            out.append("")
    return "\n".join(out + render_memory(doc))


def render_memory(doc: dict) -> list[str]:
    """The predicted-against-measured peak memory table (``hpar bench --memory``'s,
    launcher/bench/memory_report.py) of a bench document whose runs reported their peaks."""
    from types import SimpleNamespace
    from hpar.launcher.bench.memory_report import rows

    found = rows([SimpleNamespace(**r) for r in doc["results"]])
    if not found:
        return []
    mb = lambda n: "-" if n is None else f"{n / 1e6:,.0f} MB"
    pct = lambda x: "-" if x is None else f"{x:+.0%}"
    out = [
        "Peak memory per process above its baseline, predicted (strategies/plan/memory_model.py) and measured "
        "(the largest worker's and server's, strategies/common/measured_memory.py):",
        "",
        "| script | strategy | worker predicted | worker measured | error | server predicted | server measured | error | dominant terms (worker; server) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in found:
        terms = r["worker_terms"] + ("; " + r["server_terms"] if r["server_terms"] != "-" else "")
        out.append(
            f"| {r['script']} | {r['strategy']} | {mb(r['worker_predicted'])} | {mb(r['worker_measured'])} | "
            f"{pct(r['worker_error'])} | {mb(r['server_predicted'])} | {mb(r['server_measured'])} | "
            f"{pct(r['server_error'])} | {terms} |"
        )
    return out + [""]


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(render(json.load(open(path, encoding="utf-8"))))
