"""Stop every process group of a run, on every host at once, and return when nothing is left.

Remote processes are stopped per host, not per process: one SSH command per host
(``python -m hpar.workers.stopgroups --grace G PGID...``, workers/stopgroups.py) signals every
group hpar started there (the process group ids recorded when they started, never processes
found by name), waits on the host itself until they are gone (SIGTERM + SIGCONT, ``grace``
seconds, SIGKILL) and reports what is left. It runs in a new channel of a connection that is
already open (launcher/procs/ssh_control.py), and the hosts run theirs in parallel, so a
teardown costs about one round trip plus the processes' own exit, whatever the host count.
What the processes started in sessions of their own is stopped with them, there as here
(workers/descendants.py), and recorded in each process's ``ended``.
A host that cannot be reached is skipped: its guards stop their groups by themselves when the
launcher's heartbeat stops (workers/guard.py). Everything else (processes on this machine,
tasks of a Slurm step) is stopped through its own ``terminate``/``kill``/``group_alive``, one
thread per process.
"""

from __future__ import annotations

import json
import shlex
import time
from concurrent.futures import ThreadPoolExecutor

KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the groups to be gone


def stop_all(procs: list, grace: float, kill_wait: float = KILL_WAIT_S) -> dict[str, list]:
    """Stop every process of ``procs`` (objects with LocalProcess's methods; RemoteProcess ones
    also have ``control``) and return, per host, what is still alive or unknown afterwards:
    host name -> labels (empty dict: nothing left anywhere). ``grace`` (s) is how long a
    SIGTERMed group may take before SIGKILL."""
    remote: dict[str, list] = {}
    others = []
    for p in procs:
        if hasattr(p, "control"):
            if p.pgid is not None:
                remote.setdefault(p.host.name, []).append(p)
        else:
            others.append(p)
    left: dict[str, list] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(remote) + 1))) as pool:
        hosts = {name: pool.submit(stop_host, group, grace, kill_wait) for name, group in remote.items()}
        local = pool.submit(stop_each, others, grace, kill_wait) if others else None
        for name, future in hosts.items():
            if future.result():
                left[name] = future.result()
        for p in local.result() if local else []:
            left.setdefault(p.spec.host, []).append(p.spec.label)
    return left


def stop_command(pgids: list[int], grace: float, kill_wait: float) -> list[str]:
    """The argv (after the interpreter) that stops ``pgids`` on their host."""
    return [
        "-m",
        "hpar.workers.stopgroups",
        "--grace",
        f"{grace:g}",
        "--kill-wait",
        f"{kill_wait:g}",
        *[str(int(g)) for g in sorted(set(pgids))],
    ]


def stop_host(procs: list, grace: float, kill_wait: float) -> list[str]:
    """Stop the recorded groups of ``procs`` (RemoteProcess objects, all on one host) with one
    command on that host; returns the labels of those whose group may still be alive: none
    when the host reported nothing left or could not be reached (its guards stop themselves)."""
    from hpar.launcher.hosts.environ import allowlisted

    first = procs[0]
    python = first.opts.python or first.spec.argv[0]
    env = [f"{k}={v}" for k, v in allowlisted().items() if k == "PYTHONPATH"]  # where hpar may be found
    argv = ["env", *env, python, *stop_command([p.pgid for p in procs], grace, kill_wait)]
    done = first.control(" ".join(shlex.quote(a) for a in argv), timeout=grace + kill_wait + 10.0)
    if done is None:
        return []  # unreachable: its guards stop their groups once the launcher's heartbeat stops
    code, out = done
    marked = [line for line in out.splitlines() if line.startswith("@hpar left")]
    if code not in (0, 1) or not marked:
        return [p.spec.label for p in procs]  # the command itself failed: nothing is known
    record_ended(procs, out)
    left = {int(g) for g in marked[-1].split()[2:]}
    return [p.spec.label for p in procs if p.pgid in left]


def record_ended(procs: list, out: str) -> None:
    """Put what the host's stop command ended outside the groups (its ``@hpar ended`` line:
    processes started in sessions of their own) into each process's ``ended`` (pid ->
    description), as LocalProcess records its own."""
    for line in out.splitlines():
        if not line.startswith("@hpar ended "):
            continue
        try:
            by_group = json.loads(line[len("@hpar ended ") :])
        except ValueError:
            continue
        for p in procs:
            for item in by_group.get(str(p.pgid), []):
                p.ended.setdefault(int(str(item).split()[0]), str(item))


def stop_each(procs: list, grace: float, kill_wait: float) -> list:
    """Stop ``procs`` one by one, each from its own thread: SIGTERM to every group still alive,
    up to ``grace`` s, SIGKILL to the rest, up to ``kill_wait`` s; returns those still alive."""
    with ThreadPoolExecutor(max_workers=16) as pool:

        def still_alive(group: list) -> list:
            return [p for p, up in zip(group, pool.map(lambda q: q.group_alive(), group)) if up]

        alive = still_alive([p for p in procs if p.pgid is not None])
        list(pool.map(lambda q: q.terminate(), alive))
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = still_alive(alive)
        list(pool.map(lambda q: q.kill(), alive))
        deadline = time.monotonic() + kill_wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = still_alive(alive)
    return alive
