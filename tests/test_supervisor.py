"""The supervisor without a real run: it starts every process at once (start-up does not grow
with the host count) and blames the root cause of a failure, not the peer it took down."""

from __future__ import annotations

import signal

import pytest


def test_supervisor_starts_every_process_at_once(tmp_path):
    """Starting a remote process is an SSH connection: the supervisor makes them all at once, so
    start-up does not grow with the host count. Each fake start waits until every other start
    has begun (a barrier): one after another, the first would wait in vain."""
    import queue
    import threading
    from rich.console import Console
    from hpar.launcher.procs.local import ProcessSpec
    from hpar.launcher.run.progress import Progress
    from hpar.launcher.run.rundir import RunDir
    from hpar.launcher.run.supervisor import Supervisor

    n = 12
    barrier = threading.Barrier(n, timeout=10)

    class Fake:
        def __init__(self, rank):
            self.spec = ProcessSpec("worker", rank, f"h{rank}", ("true",))
            self.pid = self.pgid = None
            self.host_lost = False
            self.code = None

        def start(self):
            barrier.wait()
            self.code = 0

        def poll(self):
            return self.code

        def group_alive(self):
            return False

        terminate = kill = close_stdin = lambda self: None

    procs = [Fake(r) for r in range(n)]
    rundir = RunDir(str(tmp_path / "run"))
    with Progress([(p.spec.label, p.spec.host) for p in procs], 1, live=False, console=Console(quiet=True)) as progress:
        outcome = Supervisor(procs, queue.Queue(), rundir, progress).run()
    rundir.close()
    assert outcome.exit_code == 0, outcome


@pytest.mark.parametrize(
    "codes, said, blamed",
    [
        ((1, 1), {0: "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:13467"}, 1),
        ((-signal.SIGABRT, 1), {}, 1),  # gloo's abort on a vanished peer is a consequence
        ((1, 1), {}, 0),  # nothing tells them apart: the exit seen first
        ((1, -signal.SIGKILL), {}, 1),  # a signal from outside comes before everything
    ],
)
def test_supervisor_blames_the_root_cause_not_the_peer_it_took_down(tmp_path, codes, said, blamed):
    """Two ranks whose exits are seen in the same poll: the one whose output says a peer
    vanished (gloo's 'Connection closed by peer'), or that gloo aborted, is not the cause."""
    import queue
    from rich.console import Console
    from hpar.launcher.procs.local import ProcessSpec
    from hpar.launcher.run.progress import Progress
    from hpar.launcher.run.rundir import RunDir
    from hpar.launcher.run.supervisor import Supervisor

    class Fake:
        def __init__(self, rank, code):
            self.spec = ProcessSpec("worker", rank, "localhost", ("true",))
            self.pid = self.pgid = None
            self.host_lost, self.code, self.final = False, None, code

        def start(self):
            self.code = self.final

        def poll(self):
            return self.code

        def group_alive(self):
            return False

        terminate = kill = close_stdin = lambda self: None

    procs = [Fake(r, c) for r, c in enumerate(codes)]
    lines = queue.Queue()
    for rank, line in said.items():
        lines.put((procs[rank], line))
    rundir = RunDir(str(tmp_path / "run"))
    with Progress([(p.spec.label, p.spec.host) for p in procs], 1, live=False, console=Console(quiet=True)) as progress:
        outcome = Supervisor(procs, lines, rundir, progress).run()
    rundir.close()
    assert outcome.exit_code == 1 and outcome.failed == procs[blamed].spec.label, outcome
