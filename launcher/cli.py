"""The ``hpar`` command line: ``hpar run``, ``hpar profile``, ``hpar bench``, ``hpar launch``,
``hpar export``.

User errors (a bad script, flag, host file or plan) print one line ``hpar: <message>`` on
stderr and exit with code 2 before any process starts.
"""

from __future__ import annotations

import sys

import click
from rich.console import Console

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.job.errors import JobError

from hpar.launcher.run.run_options import run_options
from hpar.launcher.usage import EXIT_USAGE, fail, interrupted  # noqa: F401 (EXIT_USAGE: part of the CLI's interface)


class TrialInterrupted(Exception):
    """One of ``--tune``'s trials ended by Ctrl-C (exit code 130) or SIGTERM (143): hpar stops
    there, starting no other trial and no run, and exits with that code."""

    def __init__(self, strategy: str, exit_code: int):
        super().__init__(f"--tune's trial of {strategy}")
        self.exit_code = exit_code


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hpar")
def main() -> None:
    """hpar: profile a single-device PyTorch model, pick hybrid data parallelism or a balanced
    pipeline, and launch it over many GPUs and hosts."""


@main.command()
@run_options
def run(min_hosts, tune, tune_steps, precision, clip_grad_norm, accumulate, eval_every, **given):
    """Train SCRIPT on --gpus workers (and servers) with the chosen strategy."""
    from hpar.launcher.run.flags import check_ranges
    from hpar.strategies.job.config import check_cache_flags, check_loop_flags
    from hpar.strategies.job.errors import check_script_file

    try:  # what can be refused before torch is imported and the script loaded, in well under a second
        check_ranges(**given, tune_steps=tune_steps, min_hosts=min_hosts)
        check_loop_flags(precision, clip_grad_norm, accumulate, eval_every)
        check_cache_flags(given.get("cache_rows"), given.get("staleness"))
        if given.get("compress") is not None:
            from hpar.strategies.job.compression import Compression

            Compression.parse(given["compress"])
        if given.get("script") and not given.get("resume_dir"):
            check_script_file(given["script"])  # there, readable, compiles
    except ValueError as exc:
        fail(str(exc))
    from hpar.launcher.commands import run as run_command
    from hpar.launcher.run.reshape import NothingToDo
    from hpar.launcher.run.elastic import with_min_hosts
    from hpar.launcher.run.leftovers import ended_at_exit
    from hpar.strategies.plan.tuning import tune as tune_run

    console = Console(soft_wrap=True)
    from hpar.launcher.run.flags import Flags

    flags = Flags.of(
        loop_flags={
            "precision": precision,
            "clip_grad_norm": clip_grad_norm,
            "accumulate": accumulate,
            "eval_every": eval_every,
        },
        **given,
    )  # launcher/run/flags.py
    from hpar.launcher.run.runner import launch
    from hpar.launcher.run.progress import STOPPED_BY

    with ended_at_exit(lambda line: console.print(line, markup=False)):  # what the script left running in the launcher
        try:
            if tune_steps < 1:
                raise ValueError(f"--tune-steps must be at least 1, got {tune_steps}")
            cfg, opts, master = run_command.resolve(console, flags)
            opts = with_min_hosts(opts, min_hosts)
            if flags.plan.strategy == "auto" and not flags.plan.plan_file and not flags.run.resume_dir:  # run/tuning.py

                def console_for(out):  # a trial's output goes to its own file (strategies/plan/tuning.py)
                    return console if out is None else Console(file=out, soft_wrap=True)

                def trial_launch(c, o, out, m):  # a trial ended by Ctrl-C or SIGTERM ends hpar: no other trial, no run
                    outcome = launch(c, o, console_for(out), m)
                    if outcome.exit_code in STOPPED_BY:
                        raise TrialInterrupted(c.strategy, outcome.exit_code)
                    return outcome

                def resolve_for(out, chosen, path, directory, n, trial):
                    over = dict(strategy=chosen, plan_file=path, run_dir=directory, steps=n)
                    if strategy_spec(chosen).runs_as:  # hybrid-cache: hybrid with the caches its plan file names
                        over["strategy"] = strategy_spec(chosen).runs_as
                    elif flags.plan.staleness is not None:  # the other candidates run without the caches
                        over.update(staleness=None, cache_rows=None)
                    if flags.plan.compress is not None and not strategy_spec(over["strategy"]).compress_hooks:
                        over.update(compress=None)  # a candidate without DDP's AllReduce runs uncompressed
                    if trial:
                        over.update(no_eval=True, checkpoint_every=0, plain=True, max_restarts=0)
                    c, o, m = run_command.resolve(console_for(out), flags.but(**over))
                    return c, (o if trial else with_min_hosts(o, min_hosts)), m

                cfg, opts, master = tune_run(
                    lambda m: console.print(m, markup=False),
                    cfg,
                    opts,
                    master,
                    tune,
                    tune_steps,
                    resolve_for,
                    trial_launch,
                )
        except NothingToDo as done:  # --resume of a finished run: its own figures, exit 0
            console.print(str(done), markup=False)
            sys.exit(0)
        except JobError as exc:
            fail(str(exc), exc.user_traceback)
        except ValueError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            interrupted("loading, profiling and planning the run")
        except TrialInterrupted as exc:  # its processes were stopped by launch, as a run's are
            how = STOPPED_BY[exc.exit_code]
            console.print(f"hpar: {how} during {exc}; its processes were stopped, no run started", markup=False)
            sys.exit(exc.exit_code)
        outcome = launch(cfg, opts, console, master)
        from hpar.launcher.run.progress import final_line, stopped_line

        if outcome.exit_code == 0 and outcome.summary:
            console.print(final_line(outcome.summary, cfg.run_dir), markup=False)
        elif outcome.exit_code != 0:
            console.print(stopped_line(outcome.summary or {}, cfg.run_dir, outcome.exit_code), markup=False)
        sys.exit(outcome.exit_code)


def _register_commands() -> None:
    """``profile`` and ``bench`` live in their own modules (imported here, after ``main``)."""
    from hpar.launcher.commands.bench import bench
    from hpar.launcher.commands.export import export
    from hpar.launcher.commands.launch import launch
    from hpar.launcher.commands.profile import profile
    from hpar.launcher.commands.runs import clean, runs

    main.add_command(runs)
    main.add_command(clean)
    main.add_command(profile)
    main.add_command(bench)
    main.add_command(launch)
    main.add_command(export)


_register_commands()


def entry() -> None:
    """The ``hpar`` executable: :func:`main`, then a quick exit. Finalizing an interpreter that
    imported torch takes a noticeable part of a second (module teardown, more once an optimizer
    has imported torch._dynamo; BENCHMARKS.md, "Launch and teardown at scale"), paid by every
    command after its last line. By then hpar has nothing left
    to do: its atexit handlers run, its output is flushed, and the process ends with main's
    exit status (``os._exit``). Where a thread is still running, or the exit carries a message
    (``sys.exit("...")``), Python's own exit, which waits for the thread or prints the message."""
    import atexit
    import os
    import threading

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if threading.active_count() > 1 or not (code is None or isinstance(code, int)):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
