"""``hpar bench --scale 1,2,4,8``: scaling curves on emulated hosts, one worker per host.

Parallax's claim (Kim et al., EuroSys 2019, section 6) is about scale: an AllGather of sparse
gradients moves bytes that grow with the number of workers, while hybrid's pulls and pushes
to sharded parameter servers do not. ``--scale`` runs every chosen strategy on N emulated
hosts (network namespaces, launcher/bench/emulate.py) for each N, one worker per host and
the hosts' links capped at ``--link-rate``, and reports per script and strategy the measured
samples/s and bytes per worker per step against N, beside the cost model's prediction for the
same cluster (samples/s = N x batch per worker / predicted step). A point is one
``run_bench`` of the bench (launcher/bench/driver.py); its runs and plans go to
``BENCH_DIR/hosts-N``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpar.launcher.bench.driver import Result


def parse_scale(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8): distinct host counts >= 1 in increasing order. Raises
    ValueError naming ``--scale``."""
    try:
        counts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--scale {text!r}: give host counts separated by commas, e.g. --scale 1,2,4,8") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--scale {text!r}: host counts must be at least 1, e.g. --scale 1,2,4,8")
    return tuple(counts)


@dataclass(frozen=True)
class ScalePoint:
    """One strategy of one script on ``workers`` emulated hosts (one worker each): measured
    ``samples_per_s`` (None when it did not run, ``reason`` says why), ``predicted_samples_per_s``
    from the cost model, mean bytes per worker per step sent and received."""

    script: str
    strategy: str
    workers: int
    samples_per_s: float | None
    predicted_samples_per_s: float | None
    bytes_sent: float | None
    bytes_recv: float | None
    reason: str | None = None
    ran_as: str | None = None  # a hybrid plan with nothing on its servers runs as allreduce
    runs: tuple[float, ...] = ()  # every repeated run's samples/s (``--repeat``); samples_per_s is their median

    @property
    def low_high(self) -> tuple[float, float] | None:
        """(slowest, fastest) samples/s over the repeated runs, or None with fewer than two."""
        return (min(self.runs), max(self.runs)) if len(self.runs) > 1 else None

    @property
    def within_spread(self) -> bool | None:
        """Whether the prediction lies between the slowest and fastest repeated run (None
        without repeats or a prediction)."""
        if self.low_high is None or not self.predicted_samples_per_s:
            return None
        return self.low_high[0] <= self.predicted_samples_per_s <= self.low_high[1]

    @property
    def error(self) -> float | None:
        """Predicted over measured samples/s minus one (0.1 = 10% too optimistic), or None."""
        if self.samples_per_s and self.predicted_samples_per_s:
            return self.predicted_samples_per_s / self.samples_per_s - 1.0
        return None


def points(workers: int, results: list[Result]) -> list[ScalePoint]:
    """The ScalePoints of one ``run_bench`` on ``workers`` hosts."""
    out = []
    for r in results:
        bs = (r.extra or {}).get("batch_size")
        pred = workers * bs / r.predicted_step_s if bs and r.predicted_step_s else None
        b = r.bytes_per_step or {}
        out.append(
            ScalePoint(
                r.script,
                r.strategy,
                workers,
                r.samples_per_s if not r.reason else None,
                pred,
                b.get("sent"),
                b.get("recv"),
                r.reason,
                (r.extra or {}).get("ran_as"),
                tuple((r.extra or {}).get("runs_samples_per_s") or ()),
            )
        )
    return out


def _apart(a: ScalePoint, b: ScalePoint) -> bool:
    """Whether a's and b's repeated runs do not overlap (without repeats: always)."""
    if a.low_high is None or b.low_high is None:
        return True
    return a.low_high[0] > b.low_high[1] or b.low_high[0] > a.low_high[1]


def rankings(pts: list[ScalePoint]) -> list[dict]:
    """Per script and worker count with at least two strategies measured and predicted: the
    strategies fastest first as measured (samples/s) and as the cost model predicts, and
    whether the two orders agree. Rows of ``{"script", "workers", "measured", "predicted",
    "agree", "agree_beyond_spread"}``: the latter only asks the order of the pairs whose
    repeated runs do not overlap (with ``--repeat``; otherwise it equals ``agree``). A
    strategy that ran as another ("ran as allreduce") is left out."""
    out = []
    for script in dict.fromkeys(p.script for p in pts):
        for n in sorted({p.workers for p in pts if p.script == script}):
            here = [
                p
                for p in pts
                if p.script == script
                and p.workers == n
                and not p.ran_as
                and p.samples_per_s
                and p.predicted_samples_per_s
            ]
            if len(here) < 2:
                continue
            measured = [p.strategy for p in sorted(here, key=lambda p: -p.samples_per_s)]
            predicted = [p.strategy for p in sorted(here, key=lambda p: -p.predicted_samples_per_s)]
            rank = {s: i for i, s in enumerate(predicted)}
            beyond = all(
                rank[a.strategy] < rank[b.strategy]
                for a in here
                for b in here
                if a.samples_per_s > b.samples_per_s and _apart(a, b)
            )
            out.append(
                {
                    "script": script,
                    "workers": n,
                    "measured": measured,
                    "predicted": predicted,
                    "agree": measured == predicted,
                    "agree_beyond_spread": beyond,
                }
            )
    return out


def print_scale(console, pts: list[ScalePoint]) -> None:
    """One table per script: a row per strategy and host count with measured and predicted
    samples/s, the prediction's error, bytes per worker per step, and the speed-up over the
    same strategy's smallest point."""
    from rich.table import Table
    from hpar.launcher.bench.bench_report import _human

    for script in dict.fromkeys(p.script for p in pts):
        t = Table(title=f"{os.path.basename(script)}: scaling, one worker per emulated host")
        for c in (
            "strategy",
            "workers",
            "samples/s",
            "predicted",
            "pred/meas",
            "sent/wkr/step",
            "recv/wkr/step",
            "x own first point",
        ):
            t.add_column(c, justify="left" if c == "strategy" else "right")
        for strategy in dict.fromkeys(p.strategy for p in pts if p.script == script):
            mine = [p for p in pts if p.script == script and p.strategy == strategy]
            base = next((p.samples_per_s for p in mine if p.samples_per_s), None)
            for p in mine:
                if p.reason:
                    t.add_row(strategy, str(p.workers), f"n/a: {p.reason[:60]}", "", "", "", "", "")
                    continue
                spread = f" ({p.low_high[0]:,.0f}-{p.low_high[1]:,.0f})" if p.low_high else ""
                t.add_row(
                    strategy + (f" (ran as {p.ran_as})" if p.ran_as else ""),
                    str(p.workers),
                    f"{p.samples_per_s:,.1f}{spread}",
                    f"{p.predicted_samples_per_s:,.1f}" if p.predicted_samples_per_s else "-",
                    f"{p.error + 1:.2f}" if p.error is not None else "-",
                    _human(p.bytes_sent),
                    _human(p.bytes_recv),
                    f"{p.samples_per_s / base:.2f}" if base else "-",
                )
        console.print(t)
        errors = [abs(p.error) for p in pts if p.script == script and p.error is not None]
        if errors:
            within = [p.within_spread for p in pts if p.script == script and p.within_spread is not None]
            console.print(
                f"  cost model: mean absolute error {100 * sum(errors) / len(errors):.0f}% over "
                f"{len(errors)} points"
                + (
                    f" (against the median run; {sum(within)} of {len(within)} "
                    f"predictions between the slowest and fastest run)"
                    if within
                    else ""
                ),
                markup=False,
            )
        for r in rankings([p for p in pts if p.script == script]):
            speed = {p.strategy: p.samples_per_s for p in pts if p.script == script and p.workers == r["workers"]}
            order = " > ".join(f"{s} {speed[s]:,.0f}" for s in r["measured"])
            verdict = (
                "the same"
                if r["agree"]
                else " > ".join(r["predicted"])
                + (" (the same where the runs do not overlap)" if r["agree_beyond_spread"] else "")
            )
            console.print(
                f"  {r['workers']} workers: measured {order} samples/s; predicted order {verdict}", markup=False
            )


def plot_scale(pts: list[ScalePoint], path: str, title: str) -> None:
    """A PNG: per script, samples/s against workers (measured: solid with dots, the median
    run, a vertical line from the slowest to the fastest run with ``--repeat``; predicted:
    dashed, same colour) and bytes sent per worker per step against workers. Raises ValueError
    naming ``--plot`` when matplotlib is missing."""
    from hpar.launcher.bench.bench_report import pyplot

    plt = pyplot()
    scripts = list(dict.fromkeys(p.script for p in pts))
    fig, axes = plt.subplots(len(scripts), 2, figsize=(12, 3.8 * len(scripts)), squeeze=False)
    for row, script in enumerate(scripts):
        for i, strategy in enumerate(dict.fromkeys(p.strategy for p in pts if p.script == script)):
            mine = [p for p in pts if p.script == script and p.strategy == strategy]
            colour = f"C{i}"
            ran = [p for p in mine if p.samples_per_s]
            axes[row][0].plot(
                [p.workers for p in ran],
                [p.samples_per_s for p in ran],
                "o-",
                color=colour,
                label=f"{strategy} measured",
            )
            spread = [p for p in ran if p.low_high]
            if spread:  # the slowest to the fastest repeated run
                axes[row][0].vlines(
                    [p.workers for p in spread],
                    [p.low_high[0] for p in spread],
                    [p.low_high[1] for p in spread],
                    color=colour,
                    linewidth=1,
                )
            pred = [p for p in mine if p.predicted_samples_per_s]
            axes[row][0].plot(
                [p.workers for p in pred],
                [p.predicted_samples_per_s for p in pred],
                "--",
                color=colour,
                label=f"{strategy} predicted",
            )
            sent = [p for p in ran if p.bytes_sent]
            axes[row][1].plot(
                [p.workers for p in sent], [p.bytes_sent for p in sent], "o-", color=colour, label=strategy
            )
        for ax, ylabel in zip(axes[row], ("samples/s (all workers)", "bytes sent per worker per step")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("workers (one per emulated host)")
            ax.set_ylabel(ylabel)
            ax.set_title(os.path.basename(script), fontsize=10)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
