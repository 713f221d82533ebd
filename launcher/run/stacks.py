"""Hang diagnosis: every process's Python stack when a run stalls, grouped by where it waits.

Workers and servers register ``faulthandler`` on SIGUSR1 (workers/report.install_stack_dump),
which writes every thread's stack to stderr even while the main thread is blocked in C code
(a gloo or NCCL collective). The supervisor sends SIGUSR1 to every process group, reads the
dumps back from the processes' output (so it works the same over SSH), writes each one to
``RUN_DIR/stacks/<role>-<rank>.txt`` and prints one line per group of processes that stand at
the same place::

    hpar: stacks (RUN_DIR/stacks):
      worker 0, server 0: in torch.distributed: all_reduce (distributed_c10d.py:2501) <- allreduce.py:120 train
      worker 1: elsewhere: data (job.py:14) <- context.py:80 batches
      worker 2: no stack (stopped by SIGSTOP)

A process that sits in torch's code (a collective, DDP's backward) waits for its peers; the one
elsewhere is the likely culprit. torch's own watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
default timeout 30 minutes for NCCL) says less, much later.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} {self.func}"

    @property
    def in_torch(self) -> bool:
        return f"{os.sep}torch{os.sep}" in self.file


def parse_dump(lines: list[str]) -> list[list[Frame]]:
    """Threads of one faulthandler dump, each a list of frames, most recent first."""
    threads: list[list[Frame]] = []
    for line in lines:
        if THREAD.match(line.strip()):
            threads.append([])
        elif threads:
            m = FRAME.match(line)
            if m:
                threads[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    return threads


def main_thread(threads: list[list[Frame]]) -> list[Frame]:
    """The main thread's frames: the one not started by ``threading`` (its oldest frame is
    the interpreter's ``runpy``, not ``threading._bootstrap``)."""
    for frames in threads:
        if frames and not (frames[-1].func == "_bootstrap" and frames[-1].file.endswith("threading.py")):
            return frames
    return threads[0] if threads else []


def where(frames: list[Frame]) -> tuple[str, str]:
    """``(kind, place)``: kind "torch" when the innermost frame is in torch (waiting for peers
    in a collective or DDP's backward), "elsewhere" otherwise; place names the innermost frame
    and the nearest caller outside torch."""
    if not frames:
        return "unknown", "no Python frame"
    top = frames[0]
    caller = next((f for f in frames[1:] if not f.in_torch), None)
    kind = "torch" if top.in_torch else "elsewhere"
    place = f"{top.func} ({os.path.basename(top.file)}:{top.line})"
    if caller is not None:
        place += f" <- {caller.short()}"
    return kind, place


def is_dump_complete(lines: list[str]) -> bool:
    """Whether ``lines`` hold at least one thread header (faulthandler writes a dump at once)."""
    return any(THREAD.match(line.strip()) for line in lines)


def summarize(dumps: dict[str, list[str]], no_stack: dict[str, str]) -> tuple[list[str], list[str]]:
    """Summary lines (one per group of processes at the same place) and the labels of the
    processes that are elsewhere than torch's code while at least one other waits in it.

    ``dumps`` maps a process label to its dump's lines; ``no_stack`` maps a label to why there is
    none (a stopped process cannot run its signal handler)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for label, lines in dumps.items():
        groups.setdefault(where(main_thread(parse_dump(lines))), []).append(label)
    out = []
    for (kind, place), labels in sorted(groups.items(), key=lambda kv: (kv[0][0] != "torch", kv[0][1])):
        prefix = (
            "in torch.distributed"
            if kind == "torch" and "distributed" in place
            else ("in torch" if kind == "torch" else kind)
        )
        out.append(f"  {', '.join(labels)}: {prefix}: {place}")
    for label, why in no_stack.items():
        out.append(f"  {label}: no stack ({why})")
    waiting = any(kind == "torch" for kind, _ in groups)
    odd = [lab for (kind, _), labels in groups.items() if kind != "torch" for lab in labels] if waiting else []
    return out, odd
