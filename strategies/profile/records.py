"""The profile's records: what ``hpar profile`` measured of a job, per parameter, per layer
and for the whole step (strategies/profile/profiler.py measures them; the cost model in
strategies/plan/ reads them). Plain frozen dataclasses, saved as JSON with ``to_dict`` and
read back with ``from_dict``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamProfile:
    """One parameter. ``bytes`` = numel * element size; ``alpha``/``union_alpha`` are
    fractions of rows (first dimension) in [0, 1], 1.0 for dense parameters; ``union_curve``
    holds (k workers, union fraction) pairs; ``row_mass`` splits the rows into equal
    contiguous buckets and gives the share of all row touches in each (sums to 1; says how
    hot rows sit, which decides server load under row-range partitioning);
    ``hot_rows``/``hot_counts``/``hot_batches``/``hot_touches`` the most looked-up rows and how
    many of the profiled batches looked each up (strategies/profile/hot_rows.py: the hot-row
    cache's first rows and its predicted hit rate); ``layer`` indexes ``Profile.layers`` (-1: none);
    ``tied_to``: for an embedding table whose weight a non-embedding module also holds (an output
    layer tied to it: strategies/job/tying.py), the other names of that weight (its gradient
    is dense, so it is measured and placed as a dense parameter, ``embedding_module`` False);
    ``frozen``: ``requires_grad=False`` (fine-tuning), never placed on the servers; ``lookups``/``bags``
    (embeddings) the ids one worker's batch feeds the table and the rows the lookup returns (an
    nn.EmbeddingBag's pooled bags, an nn.Embedding's one row per id): what TorchRec's all-to-alls
    carry (strategies/plan/costmodel_torchrec.py)."""

    name: str
    shape: tuple[int, ...]
    bytes: int
    sparse: bool
    alpha: float
    union_alpha: float
    embedding_module: bool
    layer: int = -1
    union_curve: tuple[tuple[int, float], ...] = ()
    row_mass: tuple[float, ...] = ()
    dedup_s: float = 0.0  # embeddings: seconds to deduplicate one batch's ids on the host
    hot_rows: tuple[int, ...] = ()
    hot_counts: tuple[int, ...] = ()
    hot_batches: int = 0
    hot_touches: int = 0
    tied_to: tuple[str, ...] = ()
    frozen: bool = False  # requires_grad=False: no gradient, no update; kept on the workers, never served
    lookups: float = 0.0  # embeddings: ids one worker's batch looks up (sparsity.py; 0: not measured)
    bags: float = 0.0  # embeddings: rows its lookups return: pooled bags, or one per id (0: not measured)

    def hot(self):
        """The profiled row frequencies as hot_rows.HotRows (None where none were measured)."""
        if not self.hot_batches:
            return None
        from hpar.strategies.profile.hot_rows import HotRows

        return HotRows(self.hot_rows, self.hot_counts, self.hot_batches, self.hot_touches)

    @property
    def rows(self) -> int:
        return int(self.shape[0]) if self.shape else 1

    def union_for(self, k: int) -> float:
        """Fraction of rows touched by the union of k workers' batches (log-linear
        interpolation in k between measured points; alpha for k=1)."""
        if not self.sparse or k <= 1 or not self.union_curve:
            return self.alpha if k <= 1 else self.union_alpha
        pts = sorted(self.union_curve)
        if k >= pts[-1][0]:
            return pts[-1][1]
        lo = max((p for p in pts if p[0] <= k), default=(1, self.alpha))
        hi = min(p for p in pts if p[0] >= k)
        if hi[0] == lo[0]:
            return hi[1]
        t = (math.log(k) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
        return lo[1] + t * (hi[1] - lo[1])


@dataclass(frozen=True)
class LayerProfile:
    """One layer (a pipeline layer or a top-level child). Seconds per batch of
    ``Profile.batch_size``; ``flops`` = forward + backward; ``activation_bytes`` = bytes of
    the layer's output tensors (what a pipeline stage boundary after it would send)."""

    name: str
    forward_s: float
    backward_s: float
    flops: int
    activation_bytes: int
    param_bytes: int


@dataclass(frozen=True)
class MemoryProfile:
    """What one worker's step holds, measured (strategies/profile/memory_profile.py says how), in
    bytes: per layer saved for backward, the step's peaks above its start at the end of forward
    and over the whole step, the gradients that step made, ``data()``'s iterator and batch, the
    optimizer's state per parameter byte, a process's fixed resident overhead and, on CUDA, the
    device memory outside torch's allocator, what a process's first forward adds once, and what
    steps on new shapes keep (``growth_*``, ``shape_counts``: strategies/profile/shapes.py).
    Activation figures are at ``batch_size`` samples."""

    batch_size: int
    layer_saved_bytes: tuple[int, ...]
    forward_peak_bytes: int
    step_peak_bytes: int
    step_grad_bytes: int
    data_bytes: int
    optimizer_state_ratio: float
    process_bytes: int
    device_overhead_bytes: int = 0
    first_use_bytes: int = 0
    optimizer_step_ratio: float = 0.0
    model_extra_bytes: int = 0
    rows_suffice: bool = True
    growth_bytes: int = 0
    growth_steps: int = 0
    growth_new_shapes: int = 0
    shape_counts: tuple[int, ...] = ()
    trace_bytes: int = 0  # a traced model's first trace in a process (0: none, or a profile from before)

    def scaled(self, batch: float) -> "MemoryProfile":
        """The activation figures at ``batch`` samples (linear in the batch; the gradients
        and the rest stay)."""
        f = batch / max(self.batch_size, 1)
        grads = self.step_grad_bytes
        return dataclasses.replace(
            self,
            batch_size=batch,
            layer_saved_bytes=tuple(int(b * f) for b in self.layer_saved_bytes),
            forward_peak_bytes=int(self.forward_peak_bytes * f),
            step_peak_bytes=grads + int(max(0, self.step_peak_bytes - grads) * f),
        )


@dataclass(frozen=True)
class Profile:
    """A measured job. ``compute_s`` = forward (with loss) + backward seconds of one
    worker's batch on ``device`` ("cpu": one CPU thread; "cuda": one GPU); ``update_s_per_byte``
    the optimizer there, ``host_update_s_per_byte`` on one CPU thread (the parameter servers';
    None: measured on the CPU already); ``forward_flops``/``backward_flops`` per batch;
    ``samples_per_batch`` = leading dimension of one batch's inputs; ``workers`` = N the
    sparsity was measured for; ``fixed_share`` the part of ``compute_s`` that a smaller
    batch does not shrink (``hooks.fixed_share``); ``data_s`` the seconds a worker takes to
    draw one batch from ``data()`` and move it to the device; ``update_s_per_tensor`` the
    optimizer's seconds per parameter tensor beside its bytes (``update.per_tensor_update_cost``);
    ``fsdp_overhead_s`` what ``fully_shard`` adds to a step before any byte moves
    (``fsdp_cost.fsdp_overhead_s``); ``step_overhead_s`` the host's own seconds of a step on
    an accelerator beyond the timed parts (``step_overhead.step_overhead_s``; None on a CPU)."""

    params: tuple[ParamProfile, ...]
    layers: tuple[LayerProfile, ...]
    batch_size: int
    samples_per_batch: int
    workers: int
    is_sequential: bool
    sequential_reason: str
    compute_s: float
    forward_s: float
    backward_s: float
    forward_flops: int
    backward_flops: int
    update_s_per_byte: float
    timing_batch_size: int
    profile_s: float = 0.0
    sparse_update_s_per_byte: float | None = None
    sparse_gradients_ok: bool = True
    fixed_share: float = 0.0
    device: str = "cpu"
    host_update_s_per_byte: float | None = None
    data_s: float = 0.0  # seconds to draw one batch and move it to the device (device.data_seconds)
    server_optimizer_note: str = ""  # why the parameter servers cannot apply the optimizer ("": they can)
    unused_params: tuple[
        str, ...
    ] = ()  # trainable parameters without a gradient in a profiled step (profile/unused.py)
    unused_by_rank: bool = False  # ranks' batches left different parameters without a gradient in one step (MoE)
    evaluates: bool = False  # the script defines evaluate() (plan/memory_sharded.py: worker 0's whole copy)
    traced: bool = False  # the layers come from torch's tracer (strategies/job/traced.py), not a declared sequence
    shared_params: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (parameter, the layers holding it): tied weights
    memory: MemoryProfile | None = None  # measured memory terms (profile/memory_profile.py); None: not measured
    update_s_per_tensor: float = 0.0  # the optimizer's step per parameter tensor (0: not measured)
    host_update_s_per_tensor: float | None = None  # the same on one CPU thread (servers; None: measured there already)
    fsdp_overhead_s: float | None = (
        None  # FSDP2's own work per step, one worker (runtimes/dataparallel/fsdp_cost.py; None: not measured)
    )
    step_overhead_s: float | None = None  # the host's own seconds a step on a GPU (profile/step_overhead.py; None: CPU)
    # --compress's own compute per step on the device: (setting, dense layers' s, embedding tables' s; -1: not
    # measured), profile/compress_cost.py; None: not measured (a profile from before)
    compress_s: tuple[tuple[str, float, float], ...] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def trained(self) -> tuple[ParamProfile, ...]:
        """The trainable parameters (not ``frozen``): those with a gradient to exchange and an update."""
        return tuple(p for p in self.params if not p.frozen)

    @property
    def trainable_bytes(self) -> int:
        return sum(p.bytes for p in self.trained)

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def compression_s(self, setting: str) -> tuple[float, float] | None:
        """The measured seconds per step of compression ``setting`` (``"powersgd:2"``): (the
        dense layers', the embedding tables'; -1.0 not measured); None where not measured."""
        return next(((d, t) for s, d, t in self.compress_s or () if s == setting), None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        d = dict(d)
        d["params"] = tuple(
            ParamProfile(
                **{
                    **p,
                    "shape": tuple(p["shape"]),
                    "union_curve": tuple(tuple(x) for x in p.get("union_curve", ())),
                    "row_mass": tuple(p.get("row_mass", ())),
                    "hot_rows": tuple(p.get("hot_rows", ())),
                    "hot_counts": tuple(p.get("hot_counts", ())),
                    "tied_to": tuple(p.get("tied_to", ())),
                }
            )
            for p in d["params"]
        )
        d["layers"] = tuple(LayerProfile(**l) for l in d["layers"])
        d["unused_params"] = tuple(d.get("unused_params", ()))
        d["shared_params"] = tuple((n, tuple(ls)) for n, ls in d.get("shared_params", ()))
        if d.get("compress_s") is not None:
            d["compress_s"] = tuple((str(c), float(a), float(b)) for c, a, b in d["compress_s"])
        if d.get("memory"):
            d["memory"] = MemoryProfile(
                **{
                    **d["memory"],
                    "layer_saved_bytes": tuple(d["memory"]["layer_saved_bytes"]),
                    "shape_counts": tuple(d["memory"].get("shape_counts", ())),
                }
            )
        return cls(**d)
