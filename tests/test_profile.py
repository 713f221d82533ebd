"""Profiling a tiny real model: sparsity, layers, FLOPs, time, and the user's model untouched."""

import textwrap
import time

import pytest
import torch

from hpar.strategies.job.contract import load_job
from hpar.strategies.profile.layer_timing import pipeline_layers
from hpar.strategies.profile.profiler import Profile, profile_job

SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    V = 500

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 8)
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.out = nn.Linear(16, 4)
        def forward(self, x):
            h, _ = self.lstm(self.emb(x))
            return self.out(h[:, -1])

    torch.manual_seed(1)
    THE_MODEL = Net()          # model() hands out this very object

    def model():
        return THE_MODEL

    def data(rank, world_size, batch_size):
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(20):
            yield torch.randint(0, V, (batch_size, 3), generator=g), torch.randint(0, 4, (batch_size,), generator=g)

    def loss(output, targets):
        return nn.functional.cross_entropy(output, targets)
""")


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(SCRIPT)
    return load_job(str(path))


def test_profile_tiny_model(job):
    user_model = job.build_model()
    before = {k: v.clone() for k, v in user_model.state_dict().items()}
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    prof = profile_job(job, batch_size=6, workers=3, repeats=3)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30

    # the user's model object, its sparse flag, the RNG and the thread count are unchanged
    assert user_model.emb.sparse is False
    for k, v in user_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in user_model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads

    # alpha = mean fraction of the 500 rows one worker's first batch touches; union over 3 workers
    firsts = [next(iter(job.data_fn(r, 3, 6)))[0] for r in range(3)]
    alpha = sum(x.unique().numel() for x in firsts) / 3 / 500
    union = torch.cat([x.reshape(-1) for x in firsts]).unique().numel() / 500
    emb = next(p for p in prof.params if p.name == "emb.weight")
    assert emb.sparse and emb.embedding_module
    assert emb.alpha == pytest.approx(alpha, rel=1e-6)
    assert emb.union_alpha == pytest.approx(union, rel=1e-6)
    assert emb.union_for(1) == pytest.approx(alpha, rel=1e-6)
    assert sum(emb.row_mass) == pytest.approx(1.0, abs=1e-4)
    assert prof.params[0].name == "emb.weight"  # sparse first
    dense = [p for p in prof.params if not p.sparse]
    assert {p.name for p in dense} >= {"lstm.weight_ih_l0", "out.weight"}
    assert all(p.alpha == 1.0 for p in dense)

    # layers: the three top-level children; not a sequence
    assert [l.name for l in prof.layers] == ["emb", "lstm", "out"]
    assert not prof.is_sequential and "nn.Sequential" in prof.sequential_reason
    assert prof.layers[1].flops > 0 and prof.forward_flops > 0 and prof.backward_flops > 0
    assert prof.layers[0].activation_bytes == 6 * 3 * 8 * 4
    assert prof.layers[0].param_bytes == 500 * 8 * 4
    assert all(l.forward_s > 0 for l in prof.layers)
    assert prof.compute_s > 0 and prof.samples_per_batch == 6
    assert prof.update_s_per_byte > 0
    assert Profile.from_dict(prof.to_dict()) == prof


def test_dense_gradient_with_few_rows_is_detected_sparse(tmp_path):
    path = tmp_path / "rows.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        class Pick(nn.Module):
            def __init__(self):
                super().__init__()
                self.table = nn.Parameter(torch.randn(1000, 4))
            def forward(self, ids):
                return self.table[ids].sum(1)
        def model(): return Pick()
        def data(rank, world_size, batch_size):
            while True:
                yield torch.randint(0, 1000, (batch_size, 2)), torch.zeros(batch_size, 4)
        def loss(o, t): return ((o - t) ** 2).mean()
    """)
    )
    prof = profile_job(load_job(str(path)), batch_size=4, workers=2, repeats=2)
    (table,) = prof.params
    assert table.sparse and not table.embedding_module
    assert 0 < table.alpha <= 8 / 1000 + 1e-6  # 4 samples x 2 ids of 1000 rows


def test_sequential_layers_are_the_top_level_children_and_hpar_layers_is_honoured():
    """A nested block is one layer: the pipeline's stages cut the same top-level children
    (strategies/job/layers.py), so the profile must not flatten it."""
    seq = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    layers, ok, reason = pipeline_layers(seq)
    assert ok and reason == "" and [n for n, _ in layers] == ["0", "1"]

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())

        def forward(self, x):
            return self.body(x)

        def hpar_layers(self):
            return self.body

    layers, ok, _ = pipeline_layers(Wrapped())
    assert ok and [n for n, _ in layers] == ["body.0", "body.1"]


def test_sequential_model_profile_and_timing_scale(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        def model(): return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        def data(rank, world_size, batch_size):
            while True:
                yield torch.randn(batch_size, 32), torch.randint(0, 10, (batch_size,))
        def loss(o, t): return nn.functional.cross_entropy(o, t)
    """)
    )
    job = load_job(str(path))
    full = profile_job(job, batch_size=16, workers=2, repeats=2)
    assert full.is_sequential and len(full.layers) == 3
    assert full.layers[0].flops == 2 * 2 * 16 * 32 * 64  # fwd + grad weight (the input needs no grad)
    assert full.layers[2].flops == 3 * 2 * 16 * 64 * 10  # fwd + grad input + grad weight
    assert full.layers[2].activation_bytes == 16 * 10 * 4
    half = profile_job(job, batch_size=16, workers=2, repeats=2, timing_batch_size=8)
    assert half.timing_batch_size == 8
    assert half.layers[0].flops == full.layers[0].flops  # scaled linearly from batch 8 to 16
    assert half.layers[2].activation_bytes == full.layers[2].activation_bytes
    assert not any(p.sparse for p in full.params)


def test_bad_arguments(job):
    with pytest.raises(ValueError, match="--batch-size"):
        profile_job(job, batch_size=0, workers=2)


def test_update_probes_time_dense_and_sparse_steps_and_flag_optimizers_without_sparse_support(tmp_path):
    from hpar.strategies.profile.update import dense_update_cost, sparse_update_cost

    adagrad, adam = tmp_path / "adagrad.py", tmp_path / "adam.py"
    adagrad.write_text(SCRIPT + "\ndef optimizer(params):\n    return torch.optim.Adagrad(params, lr=0.1)\n")
    adam.write_text(SCRIPT + "\ndef optimizer(params):\n    return torch.optim.Adam(params, lr=0.1)\n")
    job_ada, job_adam = load_job(str(adagrad)), load_job(str(adam))
    assert 0 < dense_update_cost(job_ada, 1 << 20) < 1e-6  # seconds per byte
    per_byte = sparse_update_cost(job_ada, rows=5000, dim=16, alpha=0.02, workers=2)
    assert per_byte is not None and 0 < per_byte < 1e-5
    assert sparse_update_cost(job_adam, rows=5000, dim=16, alpha=0.02, workers=2) is None


class _Clock:
    """A clock that only ``time.sleep`` moves: the sleeping jobs' steps then take exactly their
    sleep, whatever the machine's load (the model's own compute counts as zero time)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def sleep_clock(monkeypatch):
    import time

    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    return clock


def _sleeping_job(tmp_path, seconds: str):
    """The tiny script with ``time.sleep(<seconds>)`` added to its forward (``x`` is the input)."""
    text = SCRIPT.replace(
        "        return self.out(h[:, -1])", f"        time.sleep({seconds})\n        return self.out(h[:, -1])"
    )
    assert text != SCRIPT
    path = tmp_path / "sleeping.py"
    path.write_text(text.replace("import torch\n", "import time\nimport torch\n", 1))
    return load_job(str(path))


def test_per_tensor_probe_times_the_optimizers_step_per_parameter_tensor(tmp_path, sleep_clock):
    """An optimizer whose step sleeps 1 ms per parameter tensor costs exactly 1 ms a tensor
    (the fake clock moves only with the sleeps); SGD's step costs a little per tensor."""
    from hpar.strategies.profile.update import per_tensor_update_cost

    sleepy = tmp_path / "sleepy.py"
    sleepy.write_text(
        SCRIPT.replace("import torch\n", "import time\nimport torch\n", 1)
        + """
class Sleepy(torch.optim.SGD):
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                time.sleep(1e-3)
def optimizer(params):
    return Sleepy(params, lr=0.1)
"""
    )
    assert per_tensor_update_cost(load_job(str(sleepy))) == pytest.approx(1e-3)


def test_timing_batch_stays_full_when_a_fixed_cost_dominates_a_small_batch(tmp_path, sleep_clock):
    """A step of 0.1 s whatever the batch (a sampled softmax's negatives, say) fits the 0.5 s
    budget at full batch; scaling a batch-1 step by 32 would have called it 3.2 s."""
    from hpar.strategies.profile.hooks import auto_timing_batch

    job = _sleeping_job(tmp_path, "0.1")
    assert auto_timing_batch(job, job.build_model(), 64, 1) == 64


def test_fixed_share_separates_per_step_from_per_sample_cost(tmp_path, sleep_clock):
    """A step sleeping 0.06 s + 0.005 s per sample: at batch 16, 0.06 of its 0.14 s is fixed."""
    from hpar.strategies.profile.hooks import fixed_share

    job = _sleeping_job(tmp_path, "0.06 + 0.005 * x.shape[0]")
    assert fixed_share(job, job.build_model(), 16, 1) == pytest.approx(0.06 / 0.14, abs=0.08)
    assert fixed_share(job, job.build_model(), 3, 1) == 0.0  # no quarter batch to compare with


DTYPE_SPY = """
import torch, torch.nn as nn
HPAR = {"precision": "bf16"}
SEEN = []
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)
    def forward(self, x):
        h = self.a(x)
        SEEN.append(h.dtype)
        return self.b(h)
def model(): return M()
def data(rank, world_size, batch_size):
    while True:
        x = torch.randn(batch_size, 4)
        yield x, x.sum(1, keepdim=True)
def loss(o, t): return ((o.float() - t) ** 2).mean()
"""


@pytest.mark.parametrize(
    "precision, dtype", [(None, torch.bfloat16), ("fp32", torch.float32), ("bf16", torch.bfloat16)]
)
def test_forward_passes_are_timed_under_the_workers_precision(tmp_path, precision, dtype):
    """bf16 autocast on a CPU without bf16 units ran examples/lm.py 6-7x slower than fp32, so
    a profile timed in fp32 mispredicted its runs: the timed forwards use the run's
    --precision (None: the script's HPAR, here bf16)."""
    path = tmp_path / "spy.py"
    path.write_text(DTYPE_SPY)
    job = load_job(str(path))
    seen = job.model_fn.__globals__["SEEN"]
    profile_job(job, 8, 1, repeats=2, warmup=1, timing_batch_size=8, precision=precision)
    assert seen[:3] == [dtype] * 3, seen[:3]
    with pytest.raises(ValueError, match="--precision"):
        profile_job(job, 8, 1, precision="fp8")


def test_fsdp_overhead_is_measured_on_copies_and_skipped_where_it_cannot_be(job, monkeypatch):
    """runtimes/dataparallel/fsdp_cost.py: FSDP2's own work per step (hooks, copies, DTensors) on one worker is
    measured (>= 0), the user's model object untouched (model() hands out one object here);
    None inside a process group of the caller's or for a model over MAX_BYTES; the cost model
    charges it to every fsdp step, times the cores' share."""
    import dataclasses
    import torch.distributed as dist
    from hpar.strategies.job.loop import precision_context
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.costmodel_fsdp import estimate_fsdp
    from hpar.strategies.runtimes.dataparallel import fsdp_cost

    user_model = job.build_model()
    batches = [next(job.batches(0, 1, 4)) for _ in range(12)]
    cast = precision_context("fp32", "cpu")
    own = fsdp_cost.fsdp_overhead_s(job, torch.device("cpu"), cast, batches, 1000)
    # the fastest FSDP step less the fastest plain one, clamped at 0: on a busy machine the two
    # minima can cross, so 0 is a measurement too (fsdp_cost.py's docstring)
    assert own is not None and 0.0 <= own < 1.0
    assert all(type(p) is torch.nn.Parameter for p in user_model.parameters()) and not dist.is_initialized()
    assert fsdp_cost.fsdp_overhead_s(job, torch.device("cpu"), cast, batches, fsdp_cost.MAX_BYTES + 1) is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert fsdp_cost.fsdp_overhead_s(job, torch.device("cpu"), cast, batches, 1000) is None
    finally:
        dist.destroy_process_group()
    prof = profile_job(job, batch_size=4, workers=2, repeats=2)
    assert prof.fsdp_overhead_s is not None  # measured (its sign on 12 steps: above)
    cluster = ClusterSpec(1, (2,), 1, 1e9, 0.0, cores_per_host=1.0)  # two workers on one core: twice the time
    base = estimate_fsdp(dataclasses.replace(prof, fsdp_overhead_s=None), cluster)
    charged = estimate_fsdp(dataclasses.replace(prof, fsdp_overhead_s=0.01), cluster)
    assert charged.step_s == pytest.approx(base.step_s + 0.02) and charged.breakdown["fsdp_own"] == pytest.approx(0.02)


def test_a_forced_strategy_is_profiled_for_what_its_plan_reads(job):
    """`hpar run --strategy X` (launcher/run/plan_run.plan_job) skips what only other plans read:
    FSDP2's own work unless X is fsdp, the tables' row frequencies unless a cache is planned, the
    compression's compute; the planner (auto) and `hpar profile` measure everything."""
    from hpar.launcher.run.flags import PlanFlags
    from hpar.launcher.run.plan_run import plan_job
    from hpar.strategies.profile.profiler import SKIPPABLE, skipped_for
    from hpar.strategies.specs.registry import ALLREDUCE, FSDP, HYBRID

    assert skipped_for(None, cache=False) == frozenset()
    assert skipped_for(ALLREDUCE.name, cache=False) == SKIPPABLE
    assert skipped_for(FSDP.name, cache=False) == SKIPPABLE - {"fsdp_overhead"}
    assert skipped_for(HYBRID.name, cache=True) == SKIPPABLE - {"hot_rows"}
    forced = profile_job(job, batch_size=6, workers=2, repeats=2, skip=skipped_for(ALLREDUCE.name, cache=False))
    whole = profile_job(job, batch_size=6, workers=2, repeats=2)
    emb = lambda prof: next(p for p in prof.params if p.name == "emb.weight")  # noqa: E731
    assert forced.fsdp_overhead_s is None and forced.compress_s is None and emb(forced).hot() is None
    assert whole.fsdp_overhead_s is not None and whole.compress_s and emb(whole).hot() is not None
    assert emb(forced).alpha == emb(whole).alpha and forced.total_bytes == whole.total_bytes  # the rest as measured
    plan, prof = plan_job(job, 6, None, 2, flags=PlanFlags(strategy=ALLREDUCE.name))
    assert plan.strategy == ALLREDUCE.name and prof.fsdp_overhead_s is None and prof.compress_s is None
