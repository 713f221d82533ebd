"""What the planner decided, as typed values: :class:`Plan` (the chosen strategy and everything
its runtime reads) and :class:`Candidate` (one strategy as predicted).

A Plan is what ``hpar profile --plan-out`` writes (``Plan.to_dict()`` as JSON), what ``hpar run
--plan FILE`` reads (:meth:`Plan.from_dict`, any subset of the keys: a partial plan such as
``{"strategy": "allreduce", "sparse_exchange": "allgather-padded"}``), and the run config's
``plan`` field (strategies/job/config.py). Every field has a default that means "not
planned": the runtimes fall back to their own choice.

The runtimes read: ``placement`` (parameter name -> "allreduce" | "ps") and ``partitions``
(row partitions per PS-placed parameter), ``sparse_optimizer`` ("exact" or "lazy",
strategies/runtimes/hybrid/shard.py), ``local_aggregation`` (None: decided from the hosts,
strategies/runtimes/hybrid/hybrid_runtime.make_groups), ``pull_ahead`` (strategies/runtimes/hybrid/worker_parts.py),
``cache`` (the workers' hot-row caches: staleness, rows, ``hot_rows``, ``predicted_hit_rate``,
``refresh_steps``; strategies/plan/costmodel_cache.plan_cache), ``sparse_exchange``
(allreduce-sparse: "gloo-sparse" | "allgather-padded", strategies/runtimes/dataparallel/sparse_allgather.py);
pipeline: ``stages`` ([start, end) layer indices of ``profile.pipeline_layers(model)``),
``replicas``, ``layout`` (strategies/runtimes/pipeline/replicas.py), ``micro_batches`` and ``schedule``.
``hpar run`` reads ``unused_params`` (DDP's ``find_unused_parameters``), ``servers``,
``alternatives`` (the other candidates' plans as dicts, for ``--tune``) and records ``memory``
(the predicted peaks, strategies/plan/memory_model.py) and ``tuning`` (strategies/plan/tuning.py).

Torch-free and runtime-free: the run config imports it, and ``hpar --help`` must not import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field

HOW = "write it with `hpar profile --plan-out`"


@dataclass(frozen=True)
class Candidate:
    """One strategy as predicted: seconds per step, samples/s over all workers, bytes one
    worker sends per step; ``available`` False when hpar cannot run it for this job (no
    runtime yet, or the job does not fit it), with ``note`` saying why; ``memory``: its
    predicted peaks (``MemoryEstimate.to_dict``: ``worker_peak_bytes``, ``server_peak_bytes``,
    ``fits``, the terms)."""

    strategy: str
    predicted_step_s: float
    samples_per_s: float
    bytes_per_step: float
    available: bool
    note: str = ""
    breakdown: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The chosen strategy and everything its runtime needs (module docstring). ``stages`` is
    a list of [start, end) layer index pairs (pipeline only), ``servers`` the parameter-server
    count (hybrid and ps only, else 0), ``micro_batches`` 0 when not planned, ``reason`` one
    sentence, ``candidates`` every strategy, ``compute`` where the predicted compute times come
    from (strategies/plan/planner.compute_source). The empty Plan (:attr:`empty`) plans nothing."""

    strategy: str = ""
    placement: dict[str, str] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)
    servers: int = 0
    stages: list[list[int]] = field(default_factory=list)
    micro_batches: int = 0  # 0: not planned
    schedule: str = ""
    reason: str = ""
    candidates: list[Candidate] = field(default_factory=list)
    predicted_step_s: float = 0.0
    samples_per_s: float = 0.0
    compute: str = ""
    replicas: int = 1  # pipeline: R replicas of the K stages
    layout: str = ""  # pipeline: rank layout (strategies/runtimes/pipeline/replicas.py)
    pull_ahead: bool = True  # hybrid/ps: request the next step's rows during this one (hybrid/embedding.py)
    alternatives: dict = field(default_factory=dict)  # hpar run --strategy auto: the other candidates' plans (--tune)
    unused_params: list[str] | None = (
        None  # got no gradient in a profiled step (None: not profiled): strategies/runtimes/dataparallel/ddp.py
    )
    cache: dict = field(default_factory=dict)  # hybrid with hot-row caches (costmodel_cache.plan_cache); {}: none
    memory: dict = field(
        default_factory=dict
    )  # the chosen candidate's predicted peaks (strategies/plan/memory_model.py)
    sparse_optimizer: str = "exact"  # hybrid/ps: the servers' sparse update, "exact" or "lazy" (hybrid/shard.py)
    sparse_exchange: str = ""  # allreduce-sparse: "gloo-sparse" | "allgather-padded" ("": by backend)
    local_aggregation: bool | None = None  # hybrid: sum a host's pushes first (None: when a server is remote)
    tuning: dict = field(default_factory=dict)  # --tune's trials and choice (launcher/run/tuning.record)
    compress: str = (
        ""  # the --compress setting the planner chose (auto with --compress; plan/costmodel_compress.py): "" none
    )

    @property
    def empty(self) -> bool:
        """True for a Plan that plans nothing (every field its default)."""
        return self == Plan()

    def to_dict(self) -> dict:
        """The plan as JSON-able values (candidates as dicts); :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON, keys sorted: what ``--plan-out`` writes."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, source: str = "--plan") -> "Plan":
        """Inverse of :meth:`to_dict`, for any subset of its keys (the others keep their
        defaults). Raises ValueError, one line starting with ``source`` (where the plan came
        from), for something not a dict, an unknown key (naming it, and the key it may be a typo
        of) or a candidate of the wrong shape."""
        if isinstance(d, Plan):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"{source}: not an hpar plan (a JSON object), got {type(d).__name__}; {HOW}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in known)
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{source}: unknown key {unknown[0]!r}{hint}; {HOW}")
        d = dict(d)
        try:
            if "candidates" in d:
                d["candidates"] = [c if isinstance(c, Candidate) else Candidate(**c) for c in d["candidates"] or []]
            if isinstance(
                d.get("stages"), (list, tuple)
            ):  # its shape is checked where it is used (launcher/run/validate.py)
                d["stages"] = [list(s) if isinstance(s, (list, tuple)) else s for s in d["stages"]]
            if "partitions" in d:
                d["partitions"] = {k: int(v) for k, v in (d["partitions"] or {}).items()}
            for name in ("placement", "cache", "memory", "alternatives", "tuning"):
                if name in d and d[name] is None:
                    d[name] = {}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{source}: not a plan written by hpar profile ({exc}); {HOW}") from None
        return cls(**d)


__all__ = ["Candidate", "Plan"]
