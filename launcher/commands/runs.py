"""``hpar runs [DIR]`` lists the run directories under DIR (default ``runs``) with their size,
state and the command that resumes each; ``hpar clean RUN_DIR...`` removes the ones the user
names, after saying what and how much and asking (``--yes`` to skip the question).

Only hpar's own run directories are listed or removed: those with its marker
(strategies/state/trust.py), owned by this user and writable by nobody else; a folder of
anything else, a run whose processes are still alive, and a path outside the named ones are
never touched.
"""

from __future__ import annotations

import json
import os
import shutil

import click

from hpar.launcher.run.progress import human_bytes
from hpar.strategies.state.trust import MARKER, check_trusted, is_marked


def _size(path: str) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size if not os.path.islink(os.path.join(root, name)) else 0
    return total


def state(run_dir: str) -> tuple[str, str]:
    """(state in words, what to do next) of the run in ``run_dir``, from its summary.json and
    checkpoints: finished, interrupted or failed at step N, or no summary (running, or its
    launcher was killed)."""
    from hpar.strategies.state.checkpoint import latest_step

    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = None
    try:
        saved = latest_step(run_dir)
    except ValueError:
        saved = None
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            command = json.load(f).get("command")  # "launch" for hpar launch's runs: nothing of hpar's to resume
    except (OSError, ValueError, AttributeError):
        command = None
    resume = f"hpar run --resume {run_dir}" if saved is not None and command != "launch" else ""
    if not isinstance(summary, dict):
        return "no summary (running, or its launcher was killed)", resume
    code, step = summary.get("exit_code"), summary.get("steps")
    if code == 0:
        return "finished" + (f" at step {step}" if isinstance(step, int) else ""), ""
    how = {130: "interrupted", 143: "terminated"}.get(code, f"failed (exit code {code})")
    at = f" at step {step}" if isinstance(step, int) and step > 0 else ""
    return how + at + (f", checkpoint of step {saved}" if saved is not None else ""), resume


def _runs_under(directory: str) -> list[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        raise ValueError(f"{directory}: no such directory; name the folder that holds your runs") from None
    return [os.path.join(directory, n) for n in names if is_marked(os.path.join(directory, n))]


def _alive(run_dir: str) -> list[int]:
    """PIDs of processes of this user that belong to the run (HPAR_CONFIG inside it)."""
    import psutil

    config, pids = os.path.join(run_dir, "config.json"), []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == os.getuid() and p.environ().get("HPAR_CONFIG") == config:
                pids.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return pids


@click.command()
@click.argument("directory", default="runs", type=click.Path(file_okay=False))
def runs(directory):
    """List the run directories under DIRECTORY (default: runs) with size, state and resume command."""
    from hpar.launcher.usage import fail

    try:
        found = _runs_under(directory)
    except ValueError as exc:
        fail(str(exc))
    if not found:
        click.echo(f"hpar: no run directories under {directory} (hpar marks its own with {MARKER})")
        return
    total = 0
    for path in found:
        size = _size(path)
        total += size
        words, resume = state(path)
        click.echo(f"{path}  {human_bytes(size)}  {words}" + (f"  resume: {resume}" if resume else ""))
    click.echo(f"hpar: {len(found)} run(s), {human_bytes(total)}; `hpar clean RUN_DIR...` removes the ones you name")


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--yes", is_flag=True, help="Remove without asking.")
def clean(run_dirs, yes):
    """Remove the named run directories (hpar's own only), after asking."""
    from hpar.launcher.usage import fail

    paths = list(dict.fromkeys(os.path.abspath(p) for p in run_dirs))
    try:
        for path in paths:
            if not os.path.isdir(path) or not is_marked(path):
                raise ValueError(f"{path}: not an hpar run directory (no {MARKER} marker); nothing removed")
            check_trusted(path, "hpar clean")
            if _alive(path):
                raise ValueError(
                    f"{path}: the run is still running (PIDs {_alive(path)[:4]}); stop it first; nothing removed"
                )
    except ValueError as exc:
        fail(str(exc))
    sizes = {p: _size(p) for p in paths}
    for path in paths:
        click.echo(f"{path}  {human_bytes(sizes[path])}  {state(path)[0]}")
    if not yes and not click.confirm(
        f"Remove these {len(paths)} run director{'y' if len(paths) == 1 else 'ies'} "
        f"({human_bytes(sum(sizes.values()))})?",
        default=False,
    ):
        click.echo("hpar: nothing removed")
        return
    for path in paths:
        shutil.rmtree(path)
    click.echo(
        f"hpar: removed {len(paths)} run director{'y' if len(paths) == 1 else 'ies'}, "
        f"{human_bytes(sum(sizes.values()))}"
    )


__all__ = ["runs", "clean", "state"]
