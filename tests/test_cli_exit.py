"""How the ``hpar`` executable ends (launcher/cli.entry): after the command, its atexit handlers
run and its output is flushed before the quick exit, with the command's exit status; a thread
still running is waited for, as Python's own exit waits; a message given to ``sys.exit`` is
printed. Each case is a real process with its output to a file."""

from __future__ import annotations

import subprocess
import sys

import pytest

PRELUDE = """
import atexit, sys, threading, time
atexit.register(lambda: print("atexit handler ran", flush=False))
sys.argv = ["hpar"] + {args!r}
"""


@pytest.mark.parametrize(
    "args,extra,code,wanted",
    [
        (["--version"], "", 0, ["hpar, version", "atexit handler ran"]),
        (["run", "no-such-script.py"], "", 2, ["no such file", "atexit handler ran"]),
        (
            ["--version"],
            "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished'))).start()\n",
            0,
            ["hpar, version", "thread finished", "atexit handler ran"],
        ),
        (["--version"], "import hpar.launcher.cli as c; c.main = lambda: sys.exit('a message')\n", 1, ["a message"]),
    ],
    ids=["exit-0", "exit-2", "thread-waited-for", "message"],
)
def test_entry_runs_atexit_flushes_and_keeps_the_exit_status(tmp_path, args, extra, code, wanted):
    script = PRELUDE.format(args=args) + extra + "from hpar.launcher.cli import entry\nentry()\n"
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        rc = subprocess.run([sys.executable, "-c", script], stdout=f, stderr=subprocess.STDOUT, timeout=120).returncode
    text = out.read_text()
    assert rc == code, text
    for line in wanted:
        assert line in text, text


QUICK = [
    ["--help"],
    ["--version"],
    ["run", "--help"],
    ["run", "--no-such-flag", "x.py"],
    ["profile", "--help"],
    ["profile"],
    ["bench", "--no-such-flag"],
    ["launch", "--help"],
    ["export", "--help"],
    ["export"],
    ["run", "--strategy", "nope", "x.py"],
    ["run", "x.py", "--gpus", "0"],
    ["run", "x.py", "--steps", "-3"],
    ["run", "x.py", "--accumulate", "0"],
    ["run", "x.py", "--keep-checkpoints", "-1"],
    ["run", "x.py", "--lr", "0"],
    ["run", "x.py", "--cache-rows", "0.5"],
    ["run", "/nonexistent/train.py", "--gpus", "2"],
    ["profile", "/nonexistent/train.py"],
    ["run", "SYNTAX_ERROR", "--gpus", "2"],
    ["profile", "SYNTAX_ERROR"],
    # a bad flag beside a script that compiles: refused before the script is loaded or any runtime asked
    ["profile", "GOOD", "--bandwidth", "fast"],
    ["profile", "GOOD", "--latency", "5"],
    ["profile", "GOOD", "--staleness", "-1"],
    ["profile", "GOOD", "--timing-batch-size", "0"],
    ["bench", "GOOD", "--steps", "2"],
    ["bench", "GOOD", "--min-seconds", "-1"],
    ["bench", "GOOD", "--link-rate", "fast"],
    ["bench", "GOOD", "--strategies", "ps", "--compress", "fp16"],
]


@pytest.mark.parametrize("args", QUICK, ids=[" ".join(a) for a in QUICK])
def test_help_version_and_usage_errors_need_no_torch(tmp_path, args):
    """`hpar --help`, `--version`, click's usage errors and the flags hpar checks itself answer
    without importing torch (the import takes seconds; the commands import it where they need it)."""
    given, refused_script = args, "SYNTAX_ERROR" in args or "/nonexistent/train.py" in args
    bad = tmp_path / "bad.py"  # a script that does not compile: refused, with its line, before torch
    bad.write_text("import torch\ndef model(:\n")
    good = tmp_path / "good.py"  # compiles; loading it would import torch
    good.write_text("import torch\n")
    args = [{"SYNTAX_ERROR": str(bad), "GOOD": str(good)}.get(a, a) for a in args]
    script = (
        f"import sys\nsys.argv = ['hpar'] + {args!r}\nfrom hpar.launcher.cli import main\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('EXIT', code, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("EXIT ") and last.endswith(" False"), out.stdout[-2000:] + out.stderr[-2000:]
    assert last.split()[1] in ("0", "2", "None"), last
    if refused_script:  # one line naming the file (and the line of a syntax error), exit 2
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith("hpar: /") and ("no such file" in line or ":2: syntax error" in line), out.stderr
        assert last.split()[1] == "2", last
    if "GOOD" in given:  # one line naming the flag, exit 2
        line = out.stderr.strip().splitlines()[-1]
        assert last.split()[1] == "2" and line.startswith("hpar: --") and given[2] in line, out.stderr


def test_hpar_help_takes_a_fraction_of_a_torch_import(tmp_path):
    """The real `hpar --help`, timed against `python -c 'import torch'` in the same test (a
    ratio, so a busy machine slows both): the best of 3 under half of the import's."""
    import time

    def best(argv) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=True)
            times.append(time.perf_counter() - t0)
        return min(times)

    help_s = best([sys.executable, "-m", "hpar.launcher.cli", "--help"])
    torch_s = best([sys.executable, "-c", "import torch"])
    assert help_s < 0.5 * torch_s, (help_s, torch_s)
