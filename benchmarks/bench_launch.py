"""Launch at scale: start-up and teardown of ``hpar run`` on H network-namespace test hosts x P
processes (scripts/testhosts.py), for several H, with a linear projection to more hosts.

    python benchmarks/bench_launch.py --hosts 2 4 8 --per-host 2 --repeats 3 --project 48 [--json out.json]

Per run (the tiny 5-layer MLP of the tests, ``--strategy allreduce``, over SSH):

- ``preflight_s``: the launcher's start to its "preflight: ... ok" line (the parallel check of
  every host);
- ``startup_s``: that line to the moment every worker has reported its first step (processes
  started over SSH, interpreters and torch imported, rendezvous, first AllReduce);
- ``teardown_s``: a SIGKILL to one worker on the last host to the moment no process of the run
  is left on any host (polled in the hosts' namespaces every 50 ms, apart from the launcher);
  ``detect_s``: to the launcher's "failed" line (printed once its teardown has seen every
  process group gone), ``launcher_exit_s``: to the launcher's own exit;
- ``ssh_connections``: the SSH connections the hosts' sshd accepted during the run (preflight,
  start and teardown; their logs' "Accepted publickey" lines).

With ``--idle``, only the launcher's own share of the teardown is measured (``idle_run``).

The projection fits ``a + b * H`` (least squares over the H measured) to each figure's median and
evaluates it at ``--project`` hosts. On one machine every emulated host shares the same cores, so
the start-up figures include CPU contention that real hosts do not have: the fit's slope is an
upper bound of the per-host cost. Needs root, iproute2 and openssh-server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import testhosts  # noqa: E402

SCRIPT = """
import time, torch, torch.nn as nn
HPAR = {"steps": 100000, "batch_size": 8, "lr": 0.01, "log_every": 1}
def model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        time.sleep(0.05)
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
"""


def _alive_in(namespaces: list[str]) -> list[int]:
    """PIDs of live processes other than sshd in the test hosts' namespaces."""
    out = []
    for ns in namespaces:
        for pid in testhosts.namespace_pids(ns):
            try:
                if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "sshd":
                    continue
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(pid)
            except OSError:
                continue
    return out


def accepted(made) -> int:
    """SSH connections the test hosts' sshd have accepted so far (from their logs)."""
    total = 0
    for i in range(len(made.hosts)):
        with open(os.path.join(made.directory, f"sshd-{i}.log"), errors="replace") as f:
            total += sum("Accepted publickey" in line for line in f)
    return total


def one_run(made, per_host: int, work: str) -> dict:
    """Start a run over ``made``'s hosts, time it, SIGKILL a worker on the last host, time the
    teardown. Returns the three figures (seconds)."""
    hosts = os.path.join(work, "hosts.txt")
    with open(hosts, "w") as f:
        f.writelines(f"root@{a}:22 slots={per_host}\n" for a in made.addresses)
    script = os.path.join(work, "job.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(SCRIPT))
    world = per_host * len(made.addresses)
    run_dir = tempfile.mkdtemp(prefix="run-", dir=work)
    os.rmdir(run_dir)
    connections = accepted(made)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpar.launcher.cli",
            "run",
            script,
            "--hosts",
            hosts,
            "--gpus",
            str(world),
            "--strategy",
            "allreduce",
            "--ssh-key",
            made.key,
            "--ssh-known-hosts",
            made.known_hosts,
            "--plain",
            "--no-eval",
            "--run-dir",
            run_dir,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    preflight = None
    first_step: set[int] = set()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if preflight is None and "preflight:" in line and " ok" in line:
                preflight = time.monotonic()
            m = re.search(r"worker ([0-9]+)\] step 1/", line)
            if m:
                first_step.add(int(m.group(1)))
                if len(first_step) == world:
                    break
        else:
            raise RuntimeError("run ended before every worker stepped:\n" + "".join(lines[-20:]))
        started = time.monotonic()
        last = made.hosts[-1].namespace
        victims = []
        for pid in testhosts.namespace_pids(last):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"hpar.workers.worker" in cmd and b"hpar.workers.guard" not in cmd:
                victims.append(pid)
        namespaces = [h.namespace for h in made.hosts]
        gone: list[float] = []

        def watch() -> None:  # the hosts, independently of the launcher's output
            while time.monotonic() - killed < 60 and _alive_in(namespaces):
                time.sleep(0.05)
            gone.append(time.monotonic())

        killed = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        detected = None
        for line in proc.stdout:  # until the launcher exits
            if detected is None and " failed: " in line:
                detected = time.monotonic()
        exited = time.monotonic()
        watcher.join()
        gone = gone[0]
        return {
            "preflight_s": preflight - t0,
            "startup_s": started - preflight,
            "teardown_s": gone - killed,
            "detect_s": (detected or exited) - killed,
            "launcher_exit_s": exited - killed,
            "exit_code": proc.wait(),
            "processes": world,
            "ssh_connections": accepted(made) - connections,
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def idle_run(made, per_host: int) -> dict:
    """The launcher's own share of a teardown, without the processes' own exit: ``per_host``
    guarded idle processes (no torch) per host, started over SSH as `hpar run` starts its workers,
    then stopped by the launcher's teardown (launcher/run/teardown.py, grace 5 s): the seconds
    from its call to its return, each host's command (call to answer; ``overlap``: their sum over
    the teardown's time, 1 if the hosts went one after another), what is left on the hosts after
    it, and the SSH connections it made."""
    import queue
    from concurrent.futures import ThreadPoolExecutor
    from hpar.launcher.hosts.hostfile import Host
    from hpar.launcher.procs.local import ProcessSpec
    from hpar.launcher.procs.ssh import RemoteProcess, SSHOptions
    from hpar.launcher.run import teardown

    lines: queue.Queue = queue.Queue()
    opts = SSHOptions(key=made.key, known_hosts=made.known_hosts)
    py, idle = sys.executable, "import time; print('up', flush=True); time.sleep(600)"
    procs = [
        RemoteProcess(
            ProcessSpec("worker", i * per_host + j, a, (py, "-m", "hpar.workers.guard", py, "-c", idle)),
            Host(a, user="root"),
            opts,
            lines,
        )
        for i, a in enumerate(made.addresses)
        for j in range(per_host)
    ]
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(lambda p: p.start(), procs))
    up, deadline = 0, time.monotonic() + 120
    while up < len(procs) and time.monotonic() < deadline:
        up += lines.get(timeout=120)[1] == "up"
    assert all(p.pgid for p in procs), "a process did not report its group"
    connections = accepted(made)
    per_host: list[float] = []  # each host's command, from its call to its answer

    def timed(real):
        def control(shell, timeout=3.0):
            start = time.monotonic()
            try:
                return real(shell, timeout)
            finally:
                per_host.append(time.monotonic() - start)

        return control

    for p in procs:
        p.control = timed(p.control)
    t0 = time.monotonic()
    left = teardown.stop_all(procs, grace=5.0)
    took = time.monotonic() - t0
    leftover = _alive_in([h.namespace for h in made.hosts])
    for p in procs:
        p.close()
    return {
        "teardown_s": took,
        "not_confirmed": left,
        "left_on_hosts": len(leftover),
        "ssh_connections": accepted(made) - connections,
        "host_commands": len(per_host),
        "host_command_median_s": statistics.median(per_host),
        "overlap": sum(per_host) / took,
    }


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--project", type=int, default=48)
    parser.add_argument("--json", default=None)
    parser.add_argument("--idle", action="store_true", help="only the launcher's teardown of idle processes (idle_run)")
    args = parser.parse_args(argv)
    reason = testhosts.unavailable()
    if reason:
        print(f"bench_launch: {reason}", file=sys.stderr)
        return 2
    results = {}
    for index, h in enumerate(args.hosts):
        prefix = f"bl{os.getpid() % 1000}h{index}"
        made = testhosts.up(h, prefix=prefix, net=250 + index % 6)  # above the tests' 100..249
        try:
            with tempfile.TemporaryDirectory() as work:
                runs = [
                    (idle_run if args.idle else one_run)(made, args.per_host, *([] if args.idle else [work]))
                    for _ in range(args.repeats)
                ]
        finally:
            testhosts.down(prefix)
        results[h] = runs
        keys = (
            ("teardown_s", "host_command_median_s", "overlap", "host_commands", "left_on_hosts", "ssh_connections")
            if args.idle
            else ("preflight_s", "startup_s", "teardown_s", "detect_s", "launcher_exit_s", "ssh_connections")
        )
        for key in keys:
            values = [r[key] for r in runs]
            print(
                f"{h} hosts x {args.per_host}: {key} median {statistics.median(values):.2f} "
                f"(min {min(values):.2f}, max {max(values):.2f})",
                flush=True,
            )
    projection = {}
    for key in ("teardown_s",) if args.idle else ("preflight_s", "startup_s", "teardown_s"):
        xs = [float(h) for h in results]
        ys = [statistics.median(r[key] for r in results[h]) for h in results]
        a, b = fit(xs, ys)
        projection[key] = {"intercept_s": a, "per_host_s": b, f"at_{args.project}_hosts_s": a + b * args.project}
        print(f"projection {key}: {a:.2f} + {b:.3f} s/host -> {a + b * args.project:.1f} s at {args.project} hosts")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_host": args.per_host, "runs": results, "projection": projection}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
