"""Elastic restarts (``--min-hosts N`` with ``--max-restarts``): a restart goes on with the
hosts that answer, as torchrun's elastic ``--nnodes MIN:MAX`` does, when at least N do.

Before each restart the hosts are checked again (the preflight every run starts with: SSH, the
same Python, torch and hpar, the script present). A host that fails it is left out: the run
restarts on the others, with as many workers as their slots hold (``--gpus`` at most), a
parameter server on each host that has workers (at most as many as before), a pipeline's K
stages with fewer replicas, and resumes from the last checkpoint at that size (every process
reads what it holds in the new layout: strategies/state/state.py). Fewer than N answering hosts end
the run, saying which did not answer. What happened is said in the live view and recorded in
summary.json (``elastic``: per restart, the hosts kept, the hosts lost, the workers).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.launcher.hosts.hostfile import Host, place_workers, total_slots
from hpar.strategies.job.config import RunConfig


@dataclass(frozen=True)
class Shrink:
    """A restart's shape: ``cfg`` for the hosts ``kept`` (None when the run cannot go on:
    ``reason`` says why); ``lost``: the hosts left out, with their problems."""

    cfg: RunConfig | None
    kept: tuple[Host, ...]
    lost: tuple[tuple[Host, str], ...]
    reason: str = ""

    def record(self, restart: int) -> dict:
        """The summary.json entry of this restart."""
        return {
            "restart": restart,
            "hosts": [h.name for h in self.kept],
            "lost": [h.name for h, _ in self.lost],
            "world_size": self.cfg.world_size if self.cfg else 0,
        }

    def describe(self) -> str:
        """The line the launcher prints."""
        lost = "; ".join(f"{h.name} ({why})" for h, why in self.lost)
        if self.cfg is None:
            return f"cannot restart: {self.reason}; not answering: {lost}"
        return (
            f"restarting on {len(self.kept)} host(s) with {self.cfg.world_size} worker(s) "
            f"(not answering: {lost}); the run resumes at this size from its last checkpoint"
        )


def shrink(cfg: RunConfig, hosts: tuple[Host, ...], answering: dict[str, str], min_hosts: int) -> Shrink:
    """The run ``cfg`` on ``hosts`` restarted on those that answer (``answering``: host name ->
    "" when it answered, else its problem), with at least ``min_hosts`` of them."""
    kept = tuple(h for h in hosts if not answering.get(h.name))
    lost = tuple((h, answering[h.name]) for h in hosts if answering.get(h.name))
    if len(kept) < min_hosts:
        return Shrink(None, kept, lost, f"{len(kept)} of {len(hosts)} host(s) answer, --min-hosts is {min_hosts}")
    workers = min(cfg.world_size, total_slots(list(kept)))
    if strategy_spec(cfg.strategy).pipelined:
        stages = cfg.world_size // cfg.replicas
        if workers < stages:
            return Shrink(
                None,
                kept,
                lost,
                f"the {len(kept)} host(s) left hold {workers} worker(s), fewer than the pipeline's {stages} stages",
            )
        replicas = workers // stages
        new = cfg.replace(world_size=stages * replicas, replicas=replicas)
    else:
        used = len({h.name for h in place_workers(list(kept), workers)}) if workers else 0
        new = cfg.replace(world_size=workers, servers=min(cfg.servers, max(used, 1)) if cfg.servers else 0)
    return Shrink(new.replace(resume=True), kept, lost)


def with_min_hosts(opts, min_hosts: int):
    """``opts`` (LaunchOptions) with ``--min-hosts``; ValueError (one line) when the flag
    cannot apply: negative, without ``--max-restarts``, or above the hosts given."""
    if not min_hosts:
        return opts
    from dataclasses import replace

    if min_hosts < 0:
        raise ValueError(f"--min-hosts must not be negative, got {min_hosts}")
    if opts.max_restarts < 1:
        raise ValueError(f"--min-hosts {min_hosts} applies to restarts: add --max-restarts N")
    if not opts.hosts or (opts.ssh is None and not getattr(opts, "ray", False)):
        raise ValueError(
            f"--min-hosts {min_hosts} needs hosts reached over SSH (--hosts) or a Ray cluster (--hosts ray)"
        )
    if min_hosts > len(opts.hosts):
        raise ValueError(f"--min-hosts {min_hosts}: only {len(opts.hosts)} host(s) given")
    return replace(opts, min_hosts=min_hosts)


__all__ = ["Shrink", "shrink", "with_min_hosts"]
