"""scripts/gpu_check.sh parses, and without a GPU says so in one line (exit 2) instead of
running anything; its CPU dry mode (--device cpu) is exercised by hand (see the script)."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_check.sh")


def test_gpu_check_parses_and_refuses_without_a_gpu():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    res = subprocess.run(
        ["bash", SCRIPT, "--no-install", "--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "torch sees no GPU" in res.stderr and "--device cpu" in res.stderr
    bad = subprocess.run(["bash", SCRIPT, "--device", "tpu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "choose cuda or cpu" in bad.stderr
