"""``hpar bench --memory``: each run's predicted peak memory per worker and per server beside
the measured one (summary.json's ``predicted_peak_bytes`` and ``peak_bytes``, launcher/bench/
figures.memory_figures), the error, and the terms that dominate the prediction
(strategies/plan/memory_model.py); the table BENCHMARKS.md's "Memory" section shows."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table


def _mb(n) -> str:
    return f"{n / 1e6:,.0f} MB" if isinstance(n, (int, float)) else "-"


def error(predicted, measured) -> float | None:
    """(predicted - measured) / measured, None where either is missing."""
    if not isinstance(predicted, (int, float)) or not isinstance(measured, (int, float)) or measured <= 0:
        return None
    return (predicted - measured) / measured


def dominant(terms: dict, most: int = 3) -> str:
    """The ``most`` largest terms with their share of the whole: "params 35%, optimizer 35%"."""
    total = sum(v for v in terms.values() if v > 0)
    if not total:
        return "-"
    top = sorted(((k, v) for k, v in terms.items() if v > 0), key=lambda kv: -kv[1])[:most]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in top)


def rows(results) -> list[dict]:
    """One dict per run that reported its peaks: script, strategy, predicted and measured
    bytes per worker and per server, the errors, the dominating terms."""
    out = []
    for r in results:
        e = r.extra or {}
        if r.reason or "peak_bytes" not in e:
            continue
        meas, pred = e["peak_bytes"] or {}, e.get("predicted_peak_bytes") or {}
        terms = e.get("memory_terms") or {}
        out.append(
            {
                "script": os.path.basename(r.script),
                "strategy": r.strategy,
                "worker_predicted": pred.get("worker"),
                "worker_measured": meas.get("worker"),
                "worker_error": error(pred.get("worker"), meas.get("worker")),
                "server_predicted": pred.get("server"),
                "server_measured": meas.get("server"),
                "server_error": error(pred.get("server"), meas.get("server")),
                "worker_terms": dominant(terms.get("worker") or {}),
                "server_terms": dominant(terms.get("server") or {}),
            }
        )
    return out


def print_memory(console: Console, results, title: str) -> None:
    """The predicted-against-measured table (module docstring), one row per run."""
    t = Table(title=f"Peak memory per process, predicted and measured: {title}")
    cols = [
        "script",
        "strategy",
        "worker pred",
        "worker meas",
        "error",
        "server pred",
        "server meas",
        "error",
        "dominant terms (worker; server)",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c in ("script", "strategy", cols[-1]) else "right")
    pct = lambda x: f"{x:+.0%}" if x is not None else "-"
    for row in rows(results):
        terms = row["worker_terms"] + ("; " + row["server_terms"] if row["server_terms"] != "-" else "")
        t.add_row(
            row["script"],
            row["strategy"],
            _mb(row["worker_predicted"]),
            _mb(row["worker_measured"]),
            pct(row["worker_error"]),
            _mb(row["server_predicted"]),
            _mb(row["server_measured"]),
            pct(row["server_error"]),
            terms,
        )
    console.print(t)
