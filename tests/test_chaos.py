"""The chaos harness's short version (scripts/chaos.py): three random faults in a row into
real `hpar run`s; no process left, every checkpoint loads, every resume bit-identical."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(900)
def test_three_random_faults_in_a_row(tmp_path):
    out = tmp_path / "chaos.json"
    with open(tmp_path / "chaos.txt", "w") as log:
        code = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "scripts", "chaos.py"),
                "--faults",
                "3",
                "--seed",
                "1",
                "--strategies",
                "allreduce,hybrid",
                "--out",
                str(out),
                "--work",
                str(tmp_path / "work"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=880,
        ).returncode
    report = json.load(open(out))
    figures = report["figures"]
    assert code == 0, (tmp_path / "chaos.txt").read_text()[-3000:]
    assert figures["faults"] == 3 and figures["injected"] >= 2, figures
    assert figures["orphans"] == 0 and figures["checkpoint_problems"] == 0 and figures["processes_not_gone_in_15s"] == 0
    done, total = map(int, figures["resumes_bit_identical"].split("/"))
    assert total >= 1 and done == total, figures
