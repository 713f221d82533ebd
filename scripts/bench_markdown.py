"""Render the JSON written by ``hpar bench --json FILE`` as the Markdown tables of BENCHMARKS.md.

Usage: ``python scripts/bench_markdown.py out.json [more.json ...]``. For each file it prints the
command, date, machine and torch version, then one table per script with samples/s, step time
p50/p90, bytes per worker per step, the predicted step time and its ratio to the measured one,
and the ratio to the fastest strategy; strategies that did not run show their reason. When the
bench ran on an emulated cluster, the byte check against the kernel's counters follows.
"""
from __future__ import annotations

import json
import os
import sys


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def render(doc: dict) -> str:
    """Markdown for one bench document (see launcher/bench_report.document)."""
    m = doc.get("machine", {})
    command = doc["command"] if isinstance(doc["command"], str) else " ".join(doc["command"])
    command = command.replace(os.getcwd() + os.sep, "")
    out = [f"Command: `{command}`  ",
           f"Date: {doc.get('date')}; machine: {m.get('cpu_count', '?')} x {m.get('cpu_model', '?')}, "
           f"{m.get('memory_bytes', 0) / 2**30:.1f} GiB, GPU: {m.get('gpu') or 'none'}; torch {m.get('torch', doc.get('torch'))}.", ""]
    by_script: dict[str, list] = {}
    for r in doc["results"]:
        by_script.setdefault(os.path.basename(r["script"]), []).append(r)
    for script, rows in by_script.items():
        out += [f"**{script}**", "",
                "| strategy | samples/s | step p50 | step p90 | sent/worker/step | recv/worker/step | predicted step | pred/meas | x fastest |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        skipped: dict[str, list[str]] = {}
        for r in rows:
            if r.get("reason"):
                skipped.setdefault(r["reason"], []).append(r["strategy"])
                continue
            b = r.get("bytes_per_step") or {}
            pm = (r["predicted_step_s"] / r["step_s_p50"]) if r.get("predicted_step_s") and r.get("step_s_p50") else None
            ran_as = (r.get("extra") or {}).get("ran_as")
            out.append(f"| {r['strategy']}{f' (ran as {ran_as})' if ran_as else ''} | {r['samples_per_s']:,.1f} | {_ms(r.get('step_s_p50'))} | {_ms(r.get('step_s_p90'))} | "
                       f"{_mb(b.get('sent'))} | {_mb(b.get('recv'))} | {_ms(r.get('predicted_step_s'))} | "
                       f"{'-' if pm is None else f'{pm:.2f}'} | {r['ratio']:.2f} |")
        notes = [f"- not run: {', '.join(names)}: {reason}" for reason, names in skipped.items()]
        out += [""] + notes + ([""] if notes else [])
        checks = [(r["strategy"], r["counters"]) for r in rows if r.get("counters")]
        if checks:
            out += ["Byte check (all hosts, bytes per step after warm-up): hpar's own accounting of every byte sent vs the "
                    "kernel's TCP socket counters (loopback included), and hpar's bytes addressed to another host vs the "
                    "bytes that left the hosts' interfaces (frames, and their TCP payload: less 66 header bytes per packet).", "",
                    "| strategy | hpar | TCP sockets | TCP / hpar | hpar to other hosts | interfaces | payload | payload / hpar to other hosts |",
                    "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for name, c in checks:
                h, t, i = c.get("hpar_bytes_per_step"), c.get("tcp_bytes_per_step"), c.get("interface_bytes_per_step")
                rem, pay = c.get("hpar_remote_bytes_per_step"), c.get("interface_payload_bytes_per_step")
                ratio = lambda x, d: "-" if not (x and d) else f"{x / d:.2f}"
                out.append(f"| {name} | {_mb(h)} | {_mb(t)} | {ratio(t, h)} | {_mb(rem)} | {_mb(i)} | {_mb(pay)} | "
                           f"{ratio(pay, rem)} |")
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(render(json.load(open(path, encoding="utf-8"))))
