"""``--strategy auto`` checked by measurement (``--tune auto|on|off``, ``--tune-steps N``).

The cost model ranks the strategies; it will always miss some regime (processes sharing a
core, per-step costs on the host, a slowdown only a run shows). What autotuners do (DeepSpeed's
autotuner runs short experiments; cuDNN's benchmark mode times its candidates) is measure
where measuring is cheap. So, before training, ``hpar run --strategy auto`` takes the planner's
candidates within ``FACTOR`` of the predicted best (at most ``MOST``), runs each for a short
trial on the real cluster, through the same launcher as the run (2 warm-up steps, then
``--tune-steps`` measured ones, in ``RUN_DIR/trials/<strategy>``), and trains with the fastest
measured one: the planner's choice unless another measured faster beyond the trial's own
spread (the p50 to p90 of its step times over the square root of their number: the rate's
uncertainty, not one step's). The run itself starts from the seed, as any run
does, so its result does not depend on the trial. The trial table (predicted and measured step
per candidate), the choice and its reason are printed and go to summary.json (``tuning``).

Cost: each trial starts its processes; in ``auto`` mode the trials are shortened to fit in
``BUDGET`` (5%) of the run's predicted length, or skipped when even the shortest would not,
saying so (``on`` always runs them; ``off`` keeps the model's choice). ``hpar profile`` stays
model-only: it plans clusters the user does not have.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable

from hpar.strategies.plan.costmodel_compress import is_compressed_row
from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import HYBRID_CACHE
from hpar.strategies.state.trust import claim

FACTOR = 2.0  # candidates whose predicted samples/s is within this factor of the best
MOST = 3  # at most this many candidates
WARMUP = 2  # steps a trial runs before it measures (the run's summary leaves 2 out too)
BUDGET = 0.05  # share of the run's predicted length the trials may take in auto mode
START_S = 10.0  # seconds a trial's processes take to start and finish (a 2-worker CPU run here: 6-12 s)
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Trial:
    """One candidate's trial: the model's step, the measured one (p50 and p90 over the measured
    steps), samples/s over its measured window, its wall seconds, and how it ended."""

    strategy: str
    predicted_step_s: float
    step_s_p50: float = math.nan
    step_s_p90: float = math.nan
    samples_per_s: float = 0.0
    wall_s: float = 0.0
    exit_code: int = 0
    steps: int = 1  # measured steps

    @property
    def spread(self) -> float:
        """How far this trial's samples/s may wander: (p90 - p50) / p50 of its measured steps
        (about 1.3 standard deviations of one step, for normal noise) over the square root of
        their number, since the figure is the rate over all of them (the standard error of a
        mean of n steps is the steps' deviation over sqrt(n)). One step's own spread when
        ``steps`` is 1."""
        if not self.step_s_p50 > 0:
            return 0.0
        return (self.step_s_p90 - self.step_s_p50) / self.step_s_p50 / math.sqrt(max(self.steps, 1))


def planned_name(plan: Plan) -> str:
    """The planner's choice as its candidate is named: ``hybrid-cache`` for hybrid with the
    workers' hot-row caches (a plan's ``cache``, strategies/plan/costmodel_cache.py)."""
    return HYBRID_CACHE.name if plan.strategy == HYBRID_CACHE.runs_as and plan.cache else plan.strategy


def candidates(plan: Plan) -> list[tuple[str, float]]:
    """``(strategy, predicted step seconds)`` of the planner's runnable candidates within
    ``FACTOR`` of the best predicted samples/s, fastest first, at most ``MOST``; the first is
    the planner's choice."""
    runnable = [
        c for c in plan.candidates if c.available and c.samples_per_s > 0 and not is_compressed_row(c.strategy)
    ]  # --compress's rows: trials run the user's --compress
    if not runnable:
        return []
    best = max(c.samples_per_s for c in runnable)
    near = sorted((c for c in runnable if c.samples_per_s >= best / FACTOR), key=lambda c: -c.samples_per_s)
    chosen = [c for c in near if c.strategy == planned_name(plan)]
    ordered = chosen + [c for c in near if c.strategy != planned_name(plan)]
    return [(c.strategy, c.predicted_step_s) for c in ordered[:MOST]]


def trial_steps(mode: str, wanted: int, run_steps: int, cands: list[tuple[str, float]]) -> tuple[int, str]:
    """Measured steps per trial for ``mode`` and ``--tune-steps`` ``wanted`` (0: no trial), and
    what to say when they were shortened or dropped to keep within ``BUDGET`` of the run."""
    if mode == "off" or len(cands) < 2:
        return 0, ""
    if mode == "on":
        return wanted, ""
    slowest = max(step for _, step in cands)
    run_s = START_S + run_steps * cands[0][1]
    room = BUDGET * run_s / len(cands) - START_S - WARMUP * slowest
    fits = int(room // slowest) if slowest > 0 else wanted
    if fits >= wanted:
        return wanted, ""
    cost = len(cands) * (START_S + (WARMUP + 2) * slowest)
    if fits < 2:
        return 0, (
            f"no trial: {len(cands)} trials of at least 2 steps would take ~{cost:.0f} s, over "
            f"{BUDGET:.0%} of the run's predicted {run_s:.0f} s (--tune on runs them anyway)"
        )
    return (
        fits,
        f"trials shortened to {fits} measured steps to stay within {BUDGET:.0%} of the run's predicted {run_s:.0f} s",
    )


def choose(trials: list[Trial]) -> tuple[str, str]:
    """The strategy to train with and why: the fastest measured, unless the planner's choice
    (``trials[0]``) measured within that one's spread of it: at least its samples/s over
    (1 + its spread), the spread being its p90 step over its p50 step, minus 1 (which may
    exceed 100% on a busy machine), over the square root of its measured steps
    (:attr:`Trial.spread`)."""
    ran = [t for t in trials if t.exit_code == 0 and t.samples_per_s > 0]
    planned = trials[0]
    if not ran:
        return planned.strategy, "no trial finished; the cost model's choice"
    best = max(ran, key=lambda t: t.samples_per_s)
    if best is planned:
        return planned.strategy, f"{planned.strategy} measured fastest ({planned.samples_per_s:,.0f} samples/s)"
    if planned in ran and planned.samples_per_s * (1 + best.spread) >= best.samples_per_s:
        return planned.strategy, (
            f"{planned.strategy} ({planned.samples_per_s:,.0f} samples/s) is within "
            f"{best.strategy}'s measured spread ({best.samples_per_s:,.0f}, "
            f"{best.spread:.0%}): the cost model's choice stays"
        )
    rank = [t.strategy for t in trials].index(best.strategy) + 1
    return best.strategy, (
        f"{best.strategy} measured {best.samples_per_s:,.0f} samples/s against "
        f"{planned.strategy}'s {planned.samples_per_s:,.0f} ({best.samples_per_s / max(planned.samples_per_s, 1e-9):.2f}x, "
        f"beyond the {best.spread:.0%} spread); the cost model ranked it {_ordinal(rank)}"
    )


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"#{n}")


def run_trials(
    say: Callable[[str], None], cfg, cands: list[tuple[str, float]], steps: int, resolve_for, launch
) -> list[Trial]:
    """Run each candidate for ``WARMUP + steps`` steps: ``resolve_for(out, strategy, plan_file,
    run_dir, steps, True)`` gives its (config, options, rendezvous address) as ``hpar run`` would,
    ``launch(cfg, opts, out, master)`` runs it; ``out``, the text file its output goes to, is its
    trial directory's ``output.txt``. One line per trial goes to ``say``. An exception from
    ``launch`` ends the trials (the launcher's, after a Ctrl-C: launcher/cli.py)."""
    trials = []
    for strategy, predicted in cands:
        directory = os.path.join(cfg.run_dir, "trials", strategy)
        os.makedirs(directory, exist_ok=True)
        plan_file = os.path.join(directory, "plan.json")
        alternative = cfg.plan.alternatives.get(strategy)  # a plan dict (launcher/run/plan_run.plan_job)
        plan = (
            cfg.plan
            if strategy == planned_name(cfg.plan)
            else Plan.from_dict(alternative)
            if alternative
            else Plan(strategy=strategy)
        )
        with open(plan_file, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in plan.to_dict().items() if k not in ("alternatives", "tuning")}, f)
        with open(os.path.join(directory, "output.txt"), "w", encoding="utf-8") as out:
            start = time.monotonic()
            try:
                tcfg, topts, master = resolve_for(
                    out, strategy, plan_file, os.path.join(directory, "run"), WARMUP + steps, True
                )
                outcome = launch(tcfg, replace(topts, live=False, max_restarts=0, min_hosts=0), out, master)
            except ValueError as exc:
                out.write(f"hpar: {exc}\n")
                trials.append(Trial(strategy, predicted, wall_s=time.monotonic() - start, exit_code=2))
                continue
        s = outcome.summary or {}
        trial = Trial(
            strategy,
            predicted,
            s.get("step_s_p50", math.nan),
            s.get("step_s_p90", math.nan),
            s.get("samples_per_s", 0.0),
            time.monotonic() - start,
            outcome.exit_code,
            steps,
        )
        trials.append(trial)
        say(
            f"hpar: trial {strategy}: predicted {predicted * 1e3:.1f} ms/step, measured "
            f"{trial.step_s_p50 * 1e3:.1f} ms (p90 {trial.step_s_p90 * 1e3:.1f}), "
            f"{trial.samples_per_s:,.0f} samples/s"
            if outcome.exit_code == 0
            else f"hpar: trial {strategy}: ended with exit code {outcome.exit_code} (see {directory}/output.txt)"
        )
    return trials


def record(trials: list[Trial], chosen: str, reason: str, note: str) -> dict:
    """The ``tuning`` entry of the plan and of summary.json."""
    return {
        "trials": [
            {
                "strategy": t.strategy,
                "predicted_step_s": t.predicted_step_s,
                "step_s_p50": t.step_s_p50,
                "step_s_p90": t.step_s_p90,
                "samples_per_s": t.samples_per_s,
                "wall_s": t.wall_s,
                "exit_code": t.exit_code,
                "steps": t.steps,
                "spread": t.spread,
            }
            for t in trials
        ],
        "chosen": chosen,
        "reason": reason,
        "trial_s": sum(t.wall_s for t in trials),
        **({"note": note} if note else {}),
    }


def tune(say: Callable[[str], None], cfg, opts, master: str, mode: str, steps: int, resolve_for, launch):
    """The run to start after ``--tune``'s trials (module docstring): ``cfg``, ``opts``,
    ``master`` as ``hpar run`` resolved them for the planner's choice, or those of the
    strategy that measured faster; its plan records the trials under ``tuning``.
    ``resolve_for(out, strategy, plan_file, run_dir, steps, trial)`` resolves a candidate
    as ``hpar run --plan plan_file`` would (``trial``: a short run without evaluation or
    checkpoints; ``out``: the text file a trial's output goes to, None for the run's own
    output); ``launch(cfg, opts, out, master)`` runs one; ``say`` prints one line."""
    cands = candidates(cfg.plan)
    n, note = trial_steps(mode, steps, cfg.steps, cands)
    if note:
        say(f"hpar: --tune: {note}")
    if n == 0:
        return cfg, opts, master
    say(
        f"hpar: --tune: a {WARMUP}+{n}-step trial of each of {', '.join(s for s, _ in cands)} "
        "(the cost model's best and those within 2x of it)"
    )
    claim(cfg.run_dir, opts.group_readable)  # the run's own directory, marked before the trials write into it
    trials = run_trials(say, cfg, cands, n, resolve_for, launch)
    chosen, reason = choose(trials)
    say(f"hpar: --tune chose {reason} (trials: {sum(t.wall_s for t in trials):.0f} s)")
    tuning = record(trials, chosen, reason, note)
    if chosen != planned_name(cfg.plan):
        plan_file = os.path.join(cfg.run_dir, "trials", chosen, "plan.json")
        cfg, opts, master = resolve_for(None, chosen, plan_file, cfg.run_dir, cfg.steps, False)
    return cfg.replace(plan=replace(cfg.plan, tuning=tuning)), opts, master


__all__ = [
    "MODES",
    "Trial",
    "planned_name",
    "candidates",
    "trial_steps",
    "choose",
    "run_trials",
    "record",
    "tune",
]
