"""Which strategy of an `hpar bench` table is faster, said only where the measurement can
tell: the ratio of two strategies' samples/s must exceed the run-to-run spread of their step
times, estimated per run from its own steps after warm-up as p90/p50 (a run whose steps
vary by 30% cannot show a 10% difference), and, with ``--repeat``, the ratio of the fastest to
the slowest of its repeated runs (the machine's run-to-run drift). A row that ran as another strategy (a hybrid plan
with nothing on its servers runs as allreduce) is not a contender in its own name.
"""
from __future__ import annotations

MIN_MEASURED_STEPS = 10   # fewer measured steps give a p90 that is one or two samples


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
    ran = sorted((r for r in rows if r.samples_per_s and not (r.extra or {}).get("ran_as")),
                 key=lambda r: -r.samples_per_s)
    if len(ran) < 2:
        return None
    best = ran[0]
    parts = []
    for r in ran[1:]:
        ratio = best.samples_per_s / r.samples_per_s
        bound = max(spread(best), spread(r))
        parts.append(f"{ratio:.2f}x {r.strategy}" + ("" if ratio > bound else f" (within the spread {bound:.2f}x: no difference shown)"))
    return f"fastest: {best.strategy}, " + "; ".join(parts)


def steps_warning(steps: int, warmup: int = 2) -> str | None:
    """A warning when ``--steps`` leaves too few measured steps to compare strategies."""
    if steps - warmup < MIN_MEASURED_STEPS:
        return (f"warning: --steps {steps} leaves {steps - warmup} measured steps after {warmup} warm-up ones; "
                f"use --steps {MIN_MEASURED_STEPS + warmup} or more to compare strategies")
    return None
