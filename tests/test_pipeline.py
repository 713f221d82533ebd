"""The pipeline runtime as real gloo processes: exactness of gpipe/1f1b, async schedules,
stage figures, checkpoints and user errors."""

import json
import multiprocessing as mp
import os
import textwrap

import pytest

from conftest import final_state
import torch

from hpar.strategies.plan.cluster import free_port
from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.contract import load_job
from hpar.strategies.specs.decision import Plan
from hpar.strategies.plan.stage_cuts import draw_batch, split_micro

SCRIPT = textwrap.dedent("""
    import torch
    HPAR = {"batch_size": 8, "steps": 10, "lr": 0.1}

    def model():
        return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6),
                                   torch.nn.Tanh(), torch.nn.Linear(6, 3))

    def data(rank, world_size, batch_size):
        g = torch.Generator().manual_seed(1234 + rank)
        for _ in range(7):   # short epochs: the iterator restarts, as a real data set does
            x = torch.randn(batch_size, 5, generator=g)
            yield x, (x[:, :3] * 2).tanh()

    def loss(output, targets):
        return torch.nn.functional.mse_loss(output, targets)

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def evaluate(model):
        return {"w0": float(model[0].weight.sum())}
""")


def _child(rank, world, port, config_path, log_path):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HPAR_CONFIG=config_path,
        HPAR_PG_TIMEOUT="60",
    )
    torch.set_num_threads(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from hpar.workers import worker

    try:
        code = worker.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - report and exit non-zero
        import traceback

        traceback.print_exc()
        code = 3
    os.sys.stdout.flush()
    os._exit(code or 0)


def run_pipeline(tmp_path, script_text=SCRIPT, timeout=60, **overrides):
    """Run the pipeline strategy in `world_size` processes; returns (summary, state_dict, logs)."""
    script = tmp_path / "job.py"
    script.write_text(script_text)
    run_dir = tmp_path / f"run-{overrides.get('schedule', '1f1b')}-{overrides.get('world_size', 2)}"
    run_dir.mkdir(exist_ok=True)
    fields = dict(
        script=str(script),
        strategy="pipeline",
        world_size=2,
        steps=10,
        batch_size=8,
        lr=0.1,
        seed=3,
        run_dir=str(run_dir),
        log_every=5,
        micro_batches=4,
        schedule="1f1b",
    )
    fields.update(overrides)
    cfg = RunConfig(**fields)
    (run_dir / "config.json").write_text(cfg.to_json())
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.func",
            "hpar.workers.worker",
            "hpar.strategies.runtimes.pipeline.pipeline_runtime",
        ]
    )
    port = free_port()
    procs = [
        ctx.Process(
            target=_child, args=(r, cfg.world_size, port, str(run_dir / "config.json"), str(run_dir / f"rank{r}.log"))
        )
        for r in range(cfg.world_size)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    logs = [(run_dir / f"rank{r}.log").read_text() for r in range(cfg.world_size)]
    codes = [p.exitcode for p in procs]
    summary = None
    for line in logs[0].splitlines():
        if line.startswith("@hpar summary "):
            summary = json.loads(line[len("@hpar summary ") :])
    state = final_state(run_dir) if (run_dir / "model").exists() else None
    return codes, summary, state, logs


def reference(tmp_path, steps=10, batch_size=8, micro=4, lr=0.1, seed=3):
    """Single-process gradient accumulation over the same micro-batches."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    job = load_job(str(script))
    torch.manual_seed(seed)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    batches = job.batches(0, 1, batch_size)
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(split_micro(x, micro), split_micro(y, micro)):
            loss = job.compute_loss(model(xm), ym)
            (loss / micro).backward()
            total += loss.item() / micro
        opt.step()
        losses.append(total)
    return model.state_dict(), losses


def assert_close_state(state, ref):
    assert state.keys() == ref.keys()
    for k in ref:
        err = (state[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)
        assert err < 1e-5, f"{k}: relative error {err:.2e}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_schedules_equal_gradient_accumulation(tmp_path, schedule):
    ref, ref_losses = reference(tmp_path)
    for world in (2, 3, 4):
        codes, summary, state, logs = run_pipeline(tmp_path, world_size=world, schedule=schedule)
        assert codes == [0] * world, logs
        assert_close_state(state, ref)
        assert summary["loss_first"] == pytest.approx(ref_losses[0], rel=1e-5)
        assert summary["loss_last"] == pytest.approx(ref_losses[-1], rel=1e-5)
        stages = summary["stages"]
        assert [s["stage"] for s in stages] == list(range(world))
        assert [tuple(s["layers"]) for s in stages][0][0] == 0 and stages[-1]["layers"][1] == 5
        # every stage but the last sends 4 activations (+ headers); every stage but the first 4 gradients
        for s in stages:
            assert s["bytes_sent"] > 0 and s["compute_s"] > 0 and s["idle_s"] >= 0
        assert stages[0]["max_in_flight"] == (world if schedule == "1f1b" else 4)


def assert_equal_state(state, ref):
    assert state.keys() == ref.keys()
    for k in ref:
        assert torch.equal(state[k], ref[k]), f"{k}: max difference {(state[k] - ref[k]).abs().max():.3e}"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["async", "async-stash", "async-predict", "async-2bw"])
def test_async_schedules_equal_the_single_process_simulator_bit_for_bit(tmp_path, schedule):
    """The simulator is the reference of hpar's own schedules (same op order, same weights
    per pass): the 4-process runtime must give the very same bits."""
    from hpar.strategies.runtimes.pipeline.sim import simulate

    codes, summary, state, logs = run_pipeline(tmp_path, world_size=4, schedule=schedule)
    assert codes == [0] * 4, logs
    job = load_job(str(tmp_path / "job.py"))
    sim = simulate(job, schedule, 4, steps=10, batch_size=8, micro_batches=4, lr=0.1, seed=3)
    assert_equal_state(state, sim.model.state_dict())
    assert summary["loss_last"] == sim.losses[-1]
    # stage k holds at most K-k micro-batches between forward and backward (PipeDream)
    assert [s["max_in_flight"] for s in summary["stages"]] == [4, 3, 2, 1]
    if schedule == "async-2bw":  # PipeDream-2BW: the live weights and at most two stashed versions
        assert all(1 <= s["weight_versions"] <= 2 for s in summary["stages"])
    ref, _ = reference(tmp_path)
    assert any((state[k] - ref[k]).abs().max() > 1e-4 for k in ref)  # async is not the sync result


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    ref, _ = reference(tmp_path)
    run_dir = tmp_path / "run-1f1b-3"
    codes, _, _, logs = run_pipeline(tmp_path, world_size=3, steps=6, checkpoint_every=3)
    assert codes == [0] * 3, logs
    files = sorted(os.listdir(run_dir / "checkpoints" / "step-6"))
    parts = [f for f in files if not f.endswith(".sha256")]
    assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]  # one file per stage
    assert all(f + ".sha256" in files for f in parts)  # each with its checksum beside it
    codes, summary, state, logs = run_pipeline(tmp_path, world_size=3, steps=10, resume=True)
    assert codes == [0] * 3, logs
    assert_close_state(state, ref)


def _tiny_job(tmp_path, body):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(body))
    return load_job(str(script))


def test_non_sequential_model_is_refused_with_reason(tmp_path):
    from hpar.strategies.plan.stage_cuts import stage_ranges

    job = _tiny_job(
        tmp_path,
        """
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.a = torch.nn.Linear(2, 2)
            def forward(self, x): return self.a(x)
        def model(): return Net()
        def data(r, w, b): yield torch.zeros(b, 2), torch.zeros(b, 2)
        def loss(o, t): return (o - t).pow(2).mean()
    """,
    )
    with pytest.raises(ValueError, match="not a sequence of layers and it has no repeated blocks.*hpar_layers()"):
        stage_ranges(job.build_model(), 2, example=torch.zeros(4, 2))


def test_fewer_layers_than_stages_and_bad_micro_batches(tmp_path):
    from hpar.strategies.plan.stage_cuts import stage_ranges

    job = load_job(str((tmp_path / "job.py").write_text(SCRIPT) and tmp_path / "job.py"))
    with pytest.raises(ValueError, match=r"6 pipeline stages \(--gpus / --pipeline-replicas\)"):
        stage_ranges(job.build_model(), 6)
    with pytest.raises(ValueError, match="--micro-batches 3"):
        split_micro(torch.zeros(8, 5), 3)
    with pytest.raises(ValueError, match=r"into 2 contiguous stages \(--gpus / --pipeline-replicas\)"):
        stage_ranges(job.build_model(), 2, Plan(stages=[[0, 2], [3, 5]]))
    assert stage_ranges(job.build_model(), 2, Plan(stages=[[0, 1], [1, 5]])) == ((0, 1), (1, 5))
    from hpar.strategies.job.config import RunConfig

    args = dict(script="job.py", strategy="pipeline", world_size=2, steps=1, batch_size=8, lr=0.1, seed=0, run_dir="r")
    with pytest.raises(ValueError, match="--micro-batches 1: .*Schedule1F1B needs at least one per stage"):
        RunConfig(**args, schedule="torch-1f1b", micro_batches=1)
    assert RunConfig(**args, schedule="1f1b", micro_batches=1).micro_batches == 1  # hpar's own 1F1B runs M < K


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_torch_pipelining_peer_is_the_same_math(tmp_path):
    ref, ref_losses = reference(tmp_path)
    codes, summary, state, logs = run_pipeline(tmp_path, world_size=2, schedule="torch-1f1b")
    assert codes == [0, 0], logs
    assert_close_state(state, ref)
    assert summary["loss_last"] == pytest.approx(ref_losses[-1], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("action", ["sync"])
def test_divergence_guard_falls_back_or_stops_like_the_simulator(tmp_path, action):
    """lr 1.0 makes async-predict's loss rise (0.56 -> 0.91 at step 2, > 1.5 x the minimum):
    the guard trips there, the asynchronous stream is cut after step 2 + 1 + ceil(3/4) = 4,
    then the run goes on as 1f1b (sync) or ends (stop), exactly as the simulator does."""
    from hpar.strategies.runtimes.pipeline.divergence import GuardConfig
    from hpar.strategies.runtimes.pipeline.sim import simulate

    codes, summary, state, logs = run_pipeline(
        tmp_path, world_size=4, schedule="async-predict", lr=1.0, on_divergence=action, divergence_factor=1.5
    )
    assert codes == [0] * 4, logs
    job = load_job(str(tmp_path / "job.py"))
    sim = simulate(
        job, "async-predict", 4, steps=10, batch_size=8, micro_batches=4, lr=1.0, seed=3, guard=GuardConfig(action, 1.5)
    )
    assert sim.divergence["tripped"] and sim.divergence["step"] == 2 and sim.divergence["async_steps"] == 4
    assert sim.divergence["sync_steps"] == (6 if action == "sync" else 0)
    assert summary["divergence"] == sim.divergence
    assert_equal_state(state, sim.model.state_dict())
    assert summary["loss_last"] == sim.losses[-1]
    with pytest.raises(ValueError, match="--on-divergence sync: the guard watches asynchronous pipelines only"):
        RunConfig(
            script="j.py",
            strategy="pipeline",
            world_size=2,
            steps=1,
            batch_size=8,
            lr=0.1,
            seed=0,
            run_dir="r",
            schedule="1f1b",
            on_divergence="sync",
        )


def test_draw_batch_seeds_only_the_cpu_generator(monkeypatch):
    """The first and last stage draw the same batch for a step; the caller's RNG is restored, and
    no CUDA generator is reseeded (torch.manual_seed would reseed the model's dropout on a GPU)."""

    def batches():
        while True:
            yield torch.randn(3), torch.rand(2)

    def no_cuda(*args, **kwargs):
        raise AssertionError("draw_batch reseeded a CUDA generator")

    torch.manual_seed(5)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", no_cuda)
    monkeypatch.setattr(torch.cuda, "manual_seed", no_cuda)
    before = torch.get_rng_state()
    first, last = draw_batch(batches(), 3, 7), draw_batch(batches(), 3, 7)
    assert torch.equal(first[0], last[0]) and torch.equal(first[1], last[1])
    assert not torch.equal(draw_batch(batches(), 3, 8)[0], first[0])
    assert torch.equal(torch.get_rng_state(), before)
