"""How the ``hpar`` executable ends (launcher/cli.entry): after the command, its atexit handlers
run and its output is flushed before the quick exit, with the command's exit status; a thread
still running is waited for, as Python's own exit waits; a message given to ``sys.exit`` is
printed. Each case is a real process with its output to a file."""
from __future__ import annotations

import subprocess
import sys

import pytest

PRELUDE = '''
import atexit, sys, threading, time
atexit.register(lambda: print("atexit handler ran", flush=False))
sys.argv = ["hpar"] + {args!r}
'''


@pytest.mark.parametrize("args,extra,code,wanted", [
    (["--version"], "", 0, ["hpar, version", "atexit handler ran"]),
    (["run", "no-such-script.py"], "", 2, ["no such file", "atexit handler ran"]),
    (["--version"], "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished'))).start()\n", 0,
     ["hpar, version", "thread finished", "atexit handler ran"]),
    (["--version"], "import hpar.launcher.cli as c; c.main = lambda: sys.exit('a message')\n", 1, ["a message"]),
], ids=["exit-0", "exit-2", "thread-waited-for", "message"])
def test_entry_runs_atexit_flushes_and_keeps_the_exit_status(tmp_path, args, extra, code, wanted):
    script = PRELUDE.format(args=args) + extra + "from hpar.launcher.cli import entry\nentry()\n"
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        rc = subprocess.run([sys.executable, "-c", script], stdout=f, stderr=subprocess.STDOUT, timeout=120).returncode
    text = out.read_text()
    assert rc == code, text
    for line in wanted:
        assert line in text, text
