"""``hpar bench``'s outputs: a rich table per script, the ``--json`` document and the
``--plot`` PNG (matplotlib, the optional extra ``plot``: ``pip install hpar[plot]``)."""

from __future__ import annotations

import datetime
import math
import os
import platform
import sys

from rich.console import Console
from rich.table import Table

from hpar.launcher.bench.driver import Result
from hpar.launcher.bench.verdict import uncompressed_lines, verdict


def _human(n: float | None, unit: str = "B") -> str:
    if n is None:
        return "-"
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    return f"{n:.3g} P{unit}"


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.1f} ms" if s is not None else "-"


def machine() -> dict:
    """This machine as the JSON records it: CPU count and model, memory bytes, OS, Python,
    torch version and CUDA device (None without one)."""
    import psutil
    import torch

    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "memory_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": gpu,
    }


def document(results: list[Result], command: list[str], settings: dict, emulation: dict | None = None) -> dict:
    """The ``--json`` object: ``results`` (one entry per script and strategy, see
    :class:`hpar.launcher.bench.driver.Result`), ``command``, ``date`` (UTC ISO 8601), ``machine``,
    ``torch``, ``settings`` (gpus, steps, batch sizes, link) and ``emulation`` (or None)."""
    import torch

    return {
        "command": " ".join(command),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "settings": settings,
        "emulation": emulation,
        "results": [r.to_dict() for r in results],
    }


def print_tables(console: Console, results: list[Result], title: str) -> None:
    """One table per script: measured samples/s, step p50/p90, bytes per worker per step,
    predicted step and its error, ratio to the fastest; the reason where a strategy did not
    run; projected columns (marked so) when the results carry a projection."""
    for script in dict.fromkeys(r.script for r in results):
        rows = [r for r in results if r.script == script]
        proj = next((r.projected for r in rows if r.projected), None)
        t = Table(title=f"{os.path.basename(script)}: {title}")
        cols = [
            "strategy",
            "samples/s",
            "step p50",
            "step p90",
            "sent/wkr/step",
            "recv/wkr/step",
            "predicted step",
            "pred/meas",
            "x fastest",
        ]
        stage_cols = any("bubble" in (r.extra or {}) or "peak_mem_bytes" in (r.extra or {}) for r in rows)
        if stage_cols:  # pipelines: idle over stage time, and the largest stage's peak memory
            cols += ["bubble", "peak mem/stage"]
        peak_cols = any("peak_bytes" in (r.extra or {}) for r in rows)
        if (
            peak_cols
        ):  # every process's peak above its baseline (strategies/common/measured_memory.py), the largest worker's
            cols += ["peak/wkr"]
        if proj:
            cols += [f"PROJECTED {proj['gpus']} GPUs samples/s"]
        for c in cols:
            t.add_column(c, justify="left" if c == "strategy" else "right", no_wrap=c == "strategy")
        for r in rows:
            pred = _ms(r.predicted_step_s)
            p_cell = []
            if proj:
                pj = r.projected or {}
                p_cell = [
                    f"{pj['samples_per_s']:,.0f} (projected)"
                    if pj.get("samples_per_s")
                    else "-"
                    if r.reason
                    else f"- ({pj.get('note') or 'n/a'})"
                ]  # the reason is printed below
            s_cell = []
            if stage_cols:
                e = r.extra or {}
                s_cell = [
                    f"{e['bubble']:.0%}" if "bubble" in e else "-",
                    _human(e.get("peak_mem_bytes")) if "peak_mem_bytes" in e else "-",
                ]
            m_cell = [_human(((r.extra or {}).get("peak_bytes") or {}).get("worker"))] if peak_cols else []
            if r.reason:
                t.add_row(
                    r.strategy,
                    "[yellow]n/a (below)[/yellow]",
                    "",
                    "",
                    "",
                    "",
                    pred,
                    "",
                    "",
                    *(["", ""] if stage_cols else []),
                    *([""] if peak_cols else []),
                    *p_cell,
                )
                continue
            b = r.bytes_per_step or {}
            err = f"{r.predicted_step_s / r.step_s_p50:.2f}" if r.predicted_step_s and r.step_s_p50 else "-"
            label = r.strategy + (f" (ran as {r.extra['ran_as']})" if r.extra.get("ran_as") else "")
            runs = [x for x in (r.extra or {}).get("runs_samples_per_s") or () if x]
            spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
            t.add_row(
                label,
                f"{r.samples_per_s:,.1f}{spread}",
                _ms(r.step_s_p50),
                _ms(r.step_s_p90),
                _human(b.get("sent")),
                _human(b.get("recv")),
                pred,
                err,
                f"{r.ratio:.2f}" if r.ratio else "-",
                *s_cell,
                *m_cell,
                *p_cell,
            )
        console.print(t)
        why: dict[str, list[str]] = {}
        for r in rows:
            if r.reason:
                why.setdefault(r.reason, []).append(r.strategy)
        for reason, names in why.items():
            console.print(f"  n/a {', '.join(names)}: {reason}", markup=False)
        line = verdict(rows)  # launcher/bench/verdict.py: faster only beyond the measured spread
        if line:
            console.print(line, markup=False)
        for line in uncompressed_lines(rows):  # --compress rows against their uncompressed one
            console.print(line, markup=False)


def finite_positive(x) -> bool:
    """True for a real number > 0 that is not inf or nan."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend. Raises ValueError naming ``--plot``
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hpar[plot]' (or matplotlib)") from None
    return plt


def plot(results: list[Result], path: str, title: str) -> None:
    """Write a PNG: per script, bars of samples/s (left) and bytes sent/received per worker per
    step (right) for every strategy; a strategy that did not run gets an empty slot labelled
    "n/a". Raises ValueError naming ``--plot`` when matplotlib is missing."""
    plt = pyplot()
    scripts = list(dict.fromkeys(r.script for r in results))
    fig, axes = plt.subplots(len(scripts), 2, figsize=(12, 3.8 * len(scripts)), squeeze=False)
    for row, script in enumerate(scripts):
        rs = [r for r in results if r.script == script]
        names = [r.strategy for r in rs]
        x = range(len(rs))
        ax = axes[row][0]
        ax.bar(x, [r.samples_per_s or 0 for r in rs], color="tab:blue")
        for i, r in enumerate(rs):
            if not r.samples_per_s:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8, color="gray")
            elif r.ratio:
                ax.text(i, r.samples_per_s, f"{r.ratio:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("samples/s (all workers)")
        ax.set_title(f"{os.path.basename(script)}: throughput (label: x fastest)", fontsize=10)
        ax = axes[row][1]
        w = 0.4
        ax.bar([i - w / 2 for i in x], [(r.bytes_per_step or {}).get("sent", 0) for r in rs], w, label="sent")
        ax.bar([i + w / 2 for i in x], [(r.bytes_per_step or {}).get("recv", 0) for r in rs], w, label="received")
        if any((r.bytes_per_step or {}).get("sent") for r in rs):
            ax.set_yscale("log")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("bytes per worker per step")
        ax.set_title(f"{os.path.basename(script)}: communication", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line() -> list[str]:
    """``hpar`` and the arguments this process was started with."""
    return ["hpar", *sys.argv[1:]]
