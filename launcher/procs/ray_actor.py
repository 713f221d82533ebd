"""Processes on the nodes of a Ray cluster (``--hosts ray``, launcher/hosts/ray_nodes.py):
``RayProcess`` offers exactly the methods and attributes of ``LocalProcess``
(launcher/procs/local.py), so the supervisor, its deadlines, stacks, teardown and restarts are
the ones every other host gets. Ray is one more way to start a process, not a second launcher.

- Placement: one placement group per attempt (:class:`RayRun`), one bundle per process, each
  bundle pinned to the node the plan put the process on by that node's own resource
  ``node:<ip>`` (so the plan's locality holds whatever Ray's strategy would do); a rank reserves
  a GPU on a node with GPUs, else a CPU; a parameter server reserves nothing but its node.
  Creation waits ``PLACE_TIMEOUT_S`` at most (a group that cannot be placed waits forever in
  Ray) and then says what was asked for.
- Start: a small actor per process in its bundle (launcher/procs/ray_agent.py) runs the guarded
  command hpar runs over SSH and keeps the output lines until the launcher reads them: one
  thread per process calls ``read`` in a loop, which is also the heartbeat the guard waits for.
- Liveness: an agent that does not answer a read within ``LINK_TIMEOUT_S`` (its node or raylet
  died, the link broke) marks the host lost (``poll()`` is LOST_HOST, as over SSH); its guard
  then stops its group there (no heartbeat, or its pipe closed with the agent). When the
  launcher dies, Ray kills the actors whose owner died, and the guards stop their groups.
- Removal: :meth:`RayRun.release` kills the actors and removes the placement group; the runner
  calls it when the attempt ends, on every path (success, failure, Ctrl-C).
"""

from __future__ import annotations

import json
import os
import queue
import signal as signals
import threading

from hpar.launcher.procs.local import ProcessSpec
from hpar.launcher.procs.ssh import started_group

HEARTBEAT_S = 4.0  # the guard stops its group after this long without a heartbeat byte
LINK_TIMEOUT_S = 10.0  # an agent that does not answer a read this long: its node is lost
CONTROL_TIMEOUT_S = 5.0  # a signal or a check of a group
PLACE_TIMEOUT_S = float(os.environ.get("HPAR_RAY_PLACE_TIMEOUT", "120"))
LOST_HOST = 255
NODE_SHARE = 0.001  # of a node's own resource node:<ip>: pins a bundle to that node


def bundle(spec: ProcessSpec, host) -> dict:
    """The resources of ``spec``'s bundle on ``host`` (a RayHost): its node's own resource, plus
    a GPU (node with GPUs) or a CPU for a rank; a server reserves its node only."""
    res = {f"node:{host.name}": NODE_SHARE}
    if spec.role != "server":
        res["GPU" if getattr(host, "gpus", 0) else "CPU"] = 1.0
    return res


_AGENT = []  # the actor class, made once per launcher


def _agent_class(ray):
    if not _AGENT:
        from hpar.launcher.procs.ray_agent import ProcessAgent

        _AGENT.append(ray.remote(ProcessAgent))
    return _AGENT[0]


class RayRun:
    """One attempt's processes on a Ray cluster: ``processes`` (RayProcess, one per spec), the
    placement group made when the first starts, :meth:`release` to remove everything."""

    def __init__(self, specs: list[ProcessSpec], lines: "queue.Queue", hosts_by_name: dict):
        self.lines = lines
        self.bundles = [bundle(s, hosts_by_name[s.host]) for s in specs]
        self.processes = [RayProcess(self, i, s) for i, s in enumerate(specs)]
        self._pg = None
        self._agents: list = []
        self._lock = threading.Lock()
        self.released = False
        self._failed: str | None = None  # why the placement failed: the other processes' starts say it at once

    def _ray(self):
        from hpar.launcher.hosts.ray_nodes import import_ray

        return import_ray()

    def place(self):
        """The placement group, created and waited for once (later calls return it). Raises
        RuntimeError (one line) when Ray cannot place it within ``PLACE_TIMEOUT_S``."""
        with self._lock:
            if self._pg is not None:
                return self._pg
            if self.released or self._failed:
                raise RuntimeError(self._failed or "the run is being stopped")
            ray = self._ray()
            from ray.util.placement_group import placement_group, remove_placement_group

            pg = placement_group(self.bundles, strategy="PACK", name=f"hpar-{os.getpid()}-{id(self):x}")
            try:
                ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
            except Exception:
                remove_placement_group(pg)
                wanted = {}
                for b in self.bundles:
                    for key, value in b.items():
                        wanted[key] = wanted.get(key, 0.0) + value
                self._failed = (
                    f"Ray could not place the run's {len(self.bundles)} processes within "
                    f"{PLACE_TIMEOUT_S:.0f} s (HPAR_RAY_PLACE_TIMEOUT); they need "
                    f"{json.dumps(wanted)}: free them or add nodes (`ray status`)"
                )
                raise RuntimeError(self._failed) from None
            self._pg = pg
            return pg

    def agent(self, index: int):
        """A new agent actor in bundle ``index`` of the placement group."""
        pg = self.place()
        ray = self._ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = _agent_class(ray).options(
            num_cpus=0,
            max_concurrency=4,
            max_restarts=0,
            name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            ),
        )
        handle = remote.remote()
        with self._lock:
            self._agents.append(handle)
            if self.released:  # stopped while this one was being made
                ray.kill(handle)
                raise RuntimeError("the run is being stopped")
        return handle

    def release(self) -> None:
        """Kill every agent (their guards see their pipes close and stop their groups) and remove
        the placement group. Safe to call more than once, and when Ray is gone."""
        with self._lock:
            self.released = True
            agents, self._agents = self._agents, []
            pg, self._pg = self._pg, None
        try:
            ray = self._ray()
            if not ray.is_initialized():
                return
            for handle in agents:
                ray.kill(handle, no_restart=True)
            if pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
        except Exception:  # the cluster is unreachable: Ray removes both with this driver
            pass


class RayProcess:
    """Process ``index`` of a RayRun, with LocalProcess's interface (start, poll, signal,
    terminate, kill, group_alive, close_stdin; spec, pid, pgid, host_lost, ended)."""

    def __init__(self, run: RayRun, index: int, spec: ProcessSpec):
        self.run, self.index, self.spec = run, index, spec
        self.pid: int | None = None
        self.pgid: int | None = None
        self.host_lost = False
        self.lost_how: str | None = None
        self.ended: dict[int, str] = {}
        self._agent = None
        self._code: int | None = None
        self._done = threading.Event()

    def start(self) -> None:
        """Place the run (the first process's call), start this process's agent on its node and
        the process under its guard. Raises RuntimeError when Ray cannot place or start it."""
        ray = self.run._ray()
        self._agent = self.run.agent(self.index)
        try:
            ray.get(self._agent.start.remote(self.spec, self.spec.host, os.getcwd(), HEARTBEAT_S), timeout=120)
        except Exception as exc:
            raise RuntimeError(
                f"the Ray actor on node {self.spec.host} could not start it: "
                f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"
            ) from None
        threading.Thread(target=self._poll, name=f"hpar-ray-{self.spec.label}", daemon=True).start()

    def _poll(self) -> None:
        ray = self.run._ray()
        lines = self.run.lines
        while True:
            try:
                batch, code = ray.get(self._agent.read.remote(0.5), timeout=LINK_TIMEOUT_S)
            except Exception as exc:  # GetTimeoutError, RayActorError, ActorUnavailableError, ...
                if self.run.released:  # its agent was killed at the end of the attempt, with the group
                    self._code = -signals.SIGKILL
                    break
                self.host_lost = True
                self._code = LOST_HOST
                self.lost_how = f"its Ray actor stopped answering: {type(exc).__name__}"
                lines.put((self, f"[hpar] lost Ray node {self.spec.host} ({self.lost_how})"))
                break
            for line in batch:
                if self.pgid is None and line.startswith("@hpar event "):
                    self._record(line)
                lines.put((self, line))
            if code is not None:
                self._code = -(code - 128) if 128 < code < 128 + 65 else code
                break
        self._done.set()
        lines.put((self, None))

    def _record(self, line: str) -> None:
        pgid = started_group(line)
        if pgid is not None:
            self.pid = self.pgid = pgid  # the guard leads its group, as over SSH

    def poll(self) -> int | None:
        """Exit code once the process ended and its output is read; None while running; -N
        when it (or its guard) died of signal N; LOST_HOST when its node was lost."""
        return self._code if self._done.is_set() else None

    def _call(self, method: str, *args, default=None):
        if self._agent is None or self.host_lost:
            return default
        try:
            return self.run._ray().get(getattr(self._agent, method).remote(*args), timeout=CONTROL_TIMEOUT_S)
        except Exception:
            return default

    def signal(self, sig: int) -> None:
        """``sig`` to the recorded process group on its node (no-op before it is known, once the
        process ended, or when the node is lost: its guard stops the group then)."""
        if self.pgid is None or self._done.is_set():
            return
        self._call("signal", self.pgid, int(sig))

    def terminate(self) -> None:
        self.signal(signals.SIGTERM)

    def kill(self) -> None:
        self.signal(signals.SIGKILL)

    def group_alive(self) -> bool:
        """True while a process of the recorded group is alive on its node; False when unknown,
        ended or unreachable."""
        if self.pgid is None:
            return False
        return bool(self._call("group_alive", self.pgid, default=False))

    def close_stdin(self) -> None:
        """Close the guard's stdin on its node: it stops its group by itself."""
        self._call("close_stdin")
