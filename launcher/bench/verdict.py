"""Which strategy of an `hpar bench` table is faster, said only where the measurement can
tell: the ratio of two strategies' samples/s must exceed the run-to-run spread of their step
times, estimated per run from its own steps after warm-up as p90/p50 (a run whose steps
vary by 30% cannot show a 10% difference), and, with ``--repeat``, the ratio of the fastest to
the slowest of its repeated runs (the machine's run-to-run drift). A row that ran as another strategy (a hybrid plan
with nothing on its servers runs as allreduce) is not a contender in its own name.
"""

from __future__ import annotations

import dataclasses

from hpar.launcher.bench.bench_config import COMPRESS_ROW, row_compress

MIN_MEASURED_STEPS = 10  # fewer measured steps give a p90 that is one or two samples


def spread(r) -> float:
    """The larger of p90/p50 of a result's step times and max/min of its repeated runs'
    samples/s (``extra["runs_samples_per_s"]``); >= 1.0, 1.0 when unknown."""
    out = 1.0
    if r.step_s_p50 and r.step_s_p90 and r.step_s_p50 > 0:
        out = max(out, r.step_s_p90 / r.step_s_p50)
    runs = [x for x in (r.extra or {}).get("runs_samples_per_s") or () if x]
    if len(runs) > 1:
        out = max(out, max(runs) / min(runs))
    return out


def verdict(rows: list) -> str | None:
    """One line naming the fastest contender and, for each other, its speed ratio, with
    "faster" only beyond both runs' spread and "within the spread" otherwise; None with fewer
    than two contenders. ``rows`` are bench Results of one script."""
    ran = sorted(
        (r for r in rows if r.samples_per_s and not (r.extra or {}).get("ran_as")), key=lambda r: -r.samples_per_s
    )
    if len(ran) < 2:
        return None
    best = ran[0]
    parts = []
    for r in ran[1:]:
        ratio = best.samples_per_s / r.samples_per_s
        bound = max(spread(best), spread(r))
        parts.append(
            f"{ratio:.2f}x {r.strategy}"
            + ("" if ratio > bound else f" (within the spread {bound:.2f}x: no difference shown)")
        )
    return f"fastest: {best.strategy}, " + "; ".join(parts)


def steps_warning(steps: int, warmup: int = 2) -> str | None:
    """A warning when ``--steps`` leaves too few measured steps to compare strategies."""
    if steps - warmup < MIN_MEASURED_STEPS:
        return (
            f"warning: --steps {steps} leaves {steps - warmup} measured steps after {warmup} warm-up ones; "
            f"use --steps {MIN_MEASURED_STEPS + warmup} or more to compare strategies"
        )
    return None


def with_uncompressed(results: list) -> list:
    """Each compressed row ("hybrid --compress fp16") with ``extra["vs_uncompressed"]``: its
    samples/s and bytes sent per worker per step over those of its uncompressed row of the same
    script and bench run (None where either did not run)."""
    by = {(r.script, r.strategy): r for r in results}
    out = []
    for r in results:
        base = by.get((r.script, r.strategy.split(COMPRESS_ROW, 1)[0])) if row_compress(r.strategy) else None
        if base is not None and r.samples_per_s and base.samples_per_s:
            sent, base_sent = (r.bytes_per_step or {}).get("sent"), (base.bytes_per_step or {}).get("sent")
            vs = {
                "of": base.strategy,
                "samples_per_s": r.samples_per_s / base.samples_per_s,
                "bytes_sent": sent / base_sent if sent is not None and base_sent else None,
            }
            r = dataclasses.replace(r, extra={**(r.extra or {}), "vs_uncompressed": vs})
        out.append(r)
    return out


def uncompressed_lines(rows: list) -> list[str]:
    """One line per compressed row that ran beside its uncompressed one: its bytes and samples/s as
    ratios to that row's (:func:`with_uncompressed`), the samples/s ratio said to be within the
    spread where it does not exceed both runs' spread (:func:`spread`)."""
    by = {r.strategy: r for r in rows}
    lines = []
    for r in rows:
        vs = (r.extra or {}).get("vs_uncompressed")
        if not vs:
            continue
        x = vs["samples_per_s"]
        bound = max(spread(r), spread(by[vs["of"]]))
        b = f"{vs['bytes_sent']:.2f}x" if vs["bytes_sent"] is not None else "-"
        lines.append(
            f"{r.strategy}: {b} the bytes sent per worker per step of {vs['of']}, {x:.2f}x its samples/s"
            + ("" if max(x, 1 / x) > bound else f" (within the spread {bound:.2f}x)")
        )
    return lines
