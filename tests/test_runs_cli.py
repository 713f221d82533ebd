"""`hpar runs` and `hpar clean` through the real CLI: the run directories hpar made are listed
with size, state and resume command; `clean` removes only the ones named, only hpar's own,
after asking (launcher/commands/runs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import TINY, hpar_to_file, kill_left, write_script

pytestmark = pytest.mark.multiprocess


def hpar_in(args, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpar.launcher.cli", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_runs_lists_and_clean_removes_only_what_is_named_after_asking(tmp_path):
    runs = tmp_path / "runs"
    script = write_script(tmp_path, TINY.replace('"steps": 20', '"steps": 4'))
    done = runs / "done"
    rc, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "1",
        "--strategy",
        "allreduce",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(done),
        "--plain",
        "--no-eval",
    )
    assert rc == 0 and not kill_left(done), out[-2000:]
    stopped = runs / "stopped"  # the same run, as if Ctrl-C had ended it at step 3
    shutil.copytree(done, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps({**summary, "exit_code": 130, "steps": 3}))
    (runs / "notes").mkdir()
    (runs / "notes" / "keep.txt").write_text("not a run")
    listed = hpar_in(["runs", str(runs)])
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.strip().splitlines()
    assert len(lines) == 3 and "notes" not in listed.stdout, listed.stdout
    assert lines[0].startswith(f"{done}  ") and lines[0].endswith("finished at step 4"), lines
    assert lines[1].endswith(f"interrupted at step 3, checkpoint of step 4  resume: hpar run --resume {stopped}"), lines
    assert lines[2].startswith("hpar: 2 run(s), ")

    refused = hpar_in(["clean", str(runs / "notes"), "--yes"])
    assert (
        refused.returncode == 2
        and "not an hpar run directory" in refused.stderr
        and (runs / "notes" / "keep.txt").exists()
    )
    kept = hpar_in(["clean", str(stopped)], stdin="n\n")
    assert kept.returncode == 0 and "nothing removed" in kept.stdout and stopped.is_dir(), kept.stdout
    gone = hpar_in(["clean", str(stopped)], stdin="y\n")
    assert gone.returncode == 0 and "removed 1 run directory" in gone.stdout and not stopped.exists(), gone.stdout
    gone = hpar_in(["clean", str(done), "--yes"])
    assert gone.returncode == 0 and not done.exists() and (runs / "notes" / "keep.txt").exists()
    assert hpar_in(["runs", str(runs)]).stdout.startswith("hpar: no run directories under ")
