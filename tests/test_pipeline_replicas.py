"""Pipeline x data parallelism (K stages x R replicas): the rank grid, exactness of gpipe and
1f1b with K = 2, R = 2 against one process on the concatenated batch, the asynchronous
schedules with replicas, checkpoints written by replica 0 and resumed by every replica, and
the planner's (K, R) choice."""

import itertools
import os

import pytest
import torch

from test_pipeline import SCRIPT, assert_close_state, run_pipeline

from hpar.strategies.job.contract import load_job
from hpar.strategies.plan.pipeline_grid import Grid
from hpar.strategies.plan.stage_cuts import split_micro


def test_grid_layouts_cover_every_rank_once():
    for layout in ("stages-adjacent", "replicas-adjacent"):
        grid = Grid(3, 4, layout)
        seen = {grid.rank_of(k, r) for k in range(3) for r in range(4)}
        assert seen == set(range(12))
        assert all(grid.coords(grid.rank_of(k, r)) == (k, r) for k in range(3) for r in range(4))
    assert Grid(2, 2).pipeline_ranks(1) == [2, 3] and Grid(2, 2).stage_ranks(0) == [0, 2]
    assert Grid(2, 2, "replicas-adjacent").pipeline_ranks(1) == [1, 3]
    with pytest.raises(ValueError, match="layout"):
        Grid(2, 2, "diagonal")
    from hpar.strategies.job.config import RunConfig

    args = dict(script="j.py", strategy="pipeline", world_size=4, steps=1, batch_size=8, lr=0.1, seed=0, run_dir="r")
    with pytest.raises(ValueError, match="--pipeline-replicas 3: .*= --gpus 4; choose a divisor"):
        RunConfig(**args, replicas=3)
    assert RunConfig(**args, replicas=2).pipeline_stages == 2
    with pytest.raises(ValueError, match="--pipeline-replicas 2 is not supported with --schedule torch-1f1b"):
        RunConfig(**args, replicas=2, schedule="torch-1f1b")
    with pytest.raises(ValueError, match=r"async-2bw needs at least stages \(--gpus / --pipeline-replicas\) - 1 = 3"):
        RunConfig(**{**args, "world_size": 8}, replicas=2, schedule="async-2bw", micro_batches=2)


def reference(tmp_path, replicas=2, steps=10, batch_size=8, micro=4, lr=0.1, seed=3, clip=0.0):
    """One process, each step on the concatenation of the R replicas' batches (mean loss
    over the R x M equal micro-batches = mean over the concatenated batch); ``clip`` > 0:
    torch's clip_grad_norm_ on the whole model before each step."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    job = load_job(str(script))
    torch.manual_seed(seed)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    streams = [job.batches(r, replicas, batch_size) for r in range(replicas)]
    losses = []
    for _ in range(steps):
        pairs = [next(s) for s in streams]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        opt.zero_grad()
        loss = job.compute_loss(model(x), y)
        loss.backward()
        if clip:
            clipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > clip
        opt.step()
        losses.append(float(loss.detach()))
    assert not clip or clipped, "the clipping threshold must bind for the test to mean anything"
    assert split_micro(x, micro)  # the runtime's micro-batches divide the batch
    return model.state_dict(), losses


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "schedule,layout,clip", [("gpipe", "stages-adjacent", 0.0), ("1f1b", "replicas-adjacent", 0.3)]
)
def test_two_stages_by_two_replicas_equal_one_process_on_the_concatenated_batch(tmp_path, schedule, layout, clip):
    """With clipping, the norm spans every stage of the replica-averaged gradient (each
    stage's sum of squares counted once, not once per replica)."""
    ref, ref_losses = reference(tmp_path, clip=clip)
    codes, summary, state, logs = run_pipeline(
        tmp_path, world_size=4, replicas=2, schedule=schedule, plan={"layout": layout}, clip_grad_norm=clip
    )
    assert codes == [0] * 4, logs
    assert_close_state(state, ref)
    assert summary["loss_first"] == pytest.approx(ref_losses[0], rel=1e-5)
    assert summary["loss_last"] == pytest.approx(ref_losses[-1], rel=1e-5)
    assert (summary["pipeline_stages"], summary["pipeline_replicas"], summary["pipeline_layout"]) == (2, 2, layout)
    grid = Grid(2, 2, layout)
    got = {(s["stage"], s["replica"]) for s in summary["stages"]}
    assert got == {grid.coords(rank) for rank in range(4)}
    # every worker sends its stage's replica AllReduce (2(R-1)/R x its parameter bytes) besides activations
    assert all(s["bytes_sent"] > 0 for s in summary["stages"])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_async_schedule_runs_with_replicas_and_lowers_the_loss(tmp_path):
    codes, summary, state, logs = run_pipeline(
        tmp_path, world_size=4, replicas=2, schedule="async-predict", steps=14, lr=0.05
    )
    assert codes == [0] * 4, logs
    assert summary["pipeline_replicas"] == 2
    assert summary["loss_last"] < 0.5 * summary["loss_first"], summary
    assert summary["eval_last"] != summary["eval_first"]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_checkpoint_by_replica_zero_resumes_every_replica(tmp_path):
    ref, _ = reference(tmp_path)
    run_dir = tmp_path / "run-1f1b-4"
    codes, _, _, logs = run_pipeline(tmp_path, world_size=4, replicas=2, steps=6, checkpoint_every=3)
    assert codes == [0] * 4, logs
    from hpar.strategies.state import state

    keys = state.saved_keys(str(run_dir / "checkpoints" / "step-6"))
    assert {".".join(k.split(".")[:2]) for k in keys if k.startswith("rng.")} == {
        f"rng.stage{k}-r{r}" for k in (0, 1) for r in (0, 1)
    }
    assert any(k.startswith("loop.stage1") for k in keys)  # equal copies (a stage's replicas) are written once
    codes, summary, state, logs = run_pipeline(tmp_path, world_size=4, replicas=2, steps=10, resume=True)
    assert codes == [0] * 4, logs
    assert_close_state(state, ref)


def grid_profile(param_bytes: int, activation_bytes: int):
    """4 layers of 0.01 s forward + 0.02 s backward each, a batch of 32 samples."""
    from hpar.strategies.profile.profiler import LayerProfile, ParamProfile, Profile

    params = [
        ParamProfile(f"{i}.weight", (param_bytes // 4,), param_bytes, False, 1.0, 1.0, False, layer=i) for i in range(4)
    ]
    layers = [LayerProfile(str(i), 0.01, 0.02, 10**6, activation_bytes, param_bytes) for i in range(4)]
    return Profile(
        params=tuple(params),
        layers=tuple(layers),
        batch_size=32,
        samples_per_batch=32,
        workers=4,
        is_sequential=True,
        sequential_reason="",
        compute_s=0.12,
        forward_s=0.04,
        backward_s=0.08,
        forward_flops=10**6,
        backward_flops=2 * 10**6,
        update_s_per_byte=1e-10,
        timing_batch_size=32,
    )


def test_planner_places_replicas_or_stages_within_a_host_where_that_is_cheaper():
    """2 hosts x 2 GPUs, 1 GB/s between hosts, 10 GB/s within: with heavy parameters a
    stage's replicas share a host (its AllReduce stays local, the activations cross hosts);
    with heavy activations a pipeline's stages share a host. Checked against the formulas."""
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.estimates import estimate_pipeline
    from hpar.strategies.plan.costmodel_pipeline import estimate_grid

    cluster = ClusterSpec(
        hosts=2, gpus_per_host=(2, 2), servers=2, bandwidth_Bps=1e9, latency_s=0.0, intra_host_Bps=1e10
    )
    heavy_params = grid_profile(100_000_000, 1000)
    est = estimate_grid(heavy_params, cluster, Grid(2, 2, "replicas-adjacent"), 2)
    # stage of 2 layers, a micro-batch of half the batch: 0.03 s + 500 B over the shared inter-host link
    period = 0.03 + 500 / (1e9 / 2)
    # AllReduce of the stage's 200 MB between 2 replicas on one host (2(R-1)/R B / bw) + its update
    tail = 2e8 / 1e10 + 2e8 * 1e-10
    assert est.step_s == pytest.approx(3 * period + tail, rel=1e-9)
    assert est.samples_per_step == 64 and est.stages == ((0, 2), (2, 4)) and est.replicas == 2
    across = estimate_grid(heavy_params, cluster, Grid(2, 2, "stages-adjacent"), 2)
    # each host holds one member of both stages' rings: they share its link
    assert across.step_s == pytest.approx(3 * (0.03 + 500 / 1e10) + 2e8 / (1e9 / 2) + 2e8 * 1e-10, rel=1e-9)
    forced = estimate_pipeline(heavy_params, cluster, replicas=2)
    assert (forced.replicas, forced.layout) == (2, "replicas-adjacent")
    assert estimate_pipeline(heavy_params, cluster).replicas == 1  # 200 MB stages: no replicas at all
    heavy_acts = grid_profile(1000, 100_000_000)
    assert estimate_pipeline(heavy_acts, cluster, replicas=2).layout == "stages-adjacent"


@pytest.mark.timeout(300)
def test_profile_prints_a_k_by_r_pipeline_plan_for_wide_on_48_gpus(tmp_path):
    """`hpar profile --gpus 48 --hosts 8x6 examples/wide.py` (8 layers cannot fill 48 stages):
    the pipeline candidate is K stages x R replicas with K x R = 48, in the table and --json."""
    import json
    from click.testing import CliRunner
    from hpar.launcher.commands.profile import profile

    wide = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "wide.py")
    plan_out = tmp_path / "plan.json"
    args = [
        wide,
        "--gpus",
        "48",
        "--hosts",
        "8x6",
        "--bandwidth",
        "100Gbps",
        "--device-tflops",
        "15",
        "--timing-batch-size",
        "4",
    ]
    res = CliRunner().invoke(profile, args + ["--json", "--plan-out", str(plan_out)])
    assert res.exit_code == 0, res.output
    pipe = next(c for c in json.loads(res.stdout)["candidates"] if c["strategy"] == "pipeline")
    k, r = pipe["breakdown"]["stages"], pipe["breakdown"]["replicas"]
    assert pipe["available"] and k * r == 48 and 2 <= k <= 15 and r > 1, pipe
    assert f"{k} stages x {r} replicas" in pipe["note"]
    plan = json.loads(plan_out.read_text())
    if plan["strategy"] == "pipeline":
        assert len(plan["stages"]) == k and plan["replicas"] == r and plan["layout"]


def grid_transcripts(schedule: str, grid: Grid, M: int, steps: int = 2) -> list[list]:
    """Every worker's posted batches (indexed by rank), driving each replica's Links exactly as
    runtime.train does, with each replica AllReduce (gradients; the last stage's loss) recorded
    as one batch that sends to and receives from every other member of the stage's group: it
    completes only when the whole group posts it, as a collective does."""
    from test_pipeline_comm import Recorder
    from hpar.strategies.runtimes.pipeline.comm import P2P, Links
    from hpar.strategies.plan.schedules import is_synchronous, stage_ops, updates_after

    out = [None] * grid.size
    for rank in range(grid.size):
        k, r = grid.coords(rank)
        K, rec = grid.stages, Recorder()
        links = Links(k, K, torch.device("cpu"), transport=rec, ranks=grid.pipeline_ranks(r))
        act = torch.zeros(())

        def collective(channel):
            peers = [p for p in grid.stage_ranks(k) if p != rank]
            rec.post([P2P(op, torch.zeros(1), p, 9, channel) for p in peers for op in ("send", "recv")])

        def run(op, j):
            if op.kind == "F":
                if k > 0:
                    links.recv_activation()
                if k < K - 1:
                    links.send_activation(act)
            else:
                if k < K - 1:
                    links.recv_gradient()
                if updates_after(schedule, j, M):
                    collective("allreduce")
                if k > 0:
                    links.send_gradient(act)

        def end_step():
            links.flush()
            if is_synchronous(schedule):
                collective("allreduce")
            if k == K - 1:
                collective("loss")
            if K > 1 and k == K - 1:
                links.send_loss(0.0)
            elif K > 1 and k == 0:
                links.recv_loss()

        if is_synchronous(schedule):
            for _ in range(steps):
                for op in stage_ops(schedule, K, k, M):
                    run(op, op.micro)
                end_step()
        else:
            for op in stage_ops(schedule, K, k, steps * M):
                run(op, op.micro)
                if op.kind == "B" and (op.micro + 1) % M == 0:
                    end_step()
        links.flush()
        out[rank] = [b for b in rec.batches if b]
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async-predict", "async-2bw"])
def test_replicas_cannot_deadlock_and_messages_stay_within_a_replica(schedule):
    """tests/test_pipeline_comm.py's model (a dense send blocks until its receive is posted)
    over every worker of K x R grids, with the replica AllReduces as blocking collectives."""
    from test_pipeline_comm import replay

    for K, R, layout in itertools.product((2, 3, 4), (2, 3), ("stages-adjacent", "replicas-adjacent")):
        grid = Grid(K, R, layout)
        for M in (1, 2, 4):
            if schedule == "async-2bw" and M < K - 1:
                continue
            per_rank = grid_transcripts(schedule, grid, M)
            assert replay(per_rank), f"{schedule} {K}x{R} {layout} M={M} deadlocks"
            for rank, batches in enumerate(per_rank):
                k, r = grid.coords(rank)
                peers = {peer for b in batches for op, peer, ch in b if ch in ("dense", "host")}
                assert peers <= set(grid.pipeline_ranks(r)), (rank, peers)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_only_device_tensors_reach_nccl_groups_with_replicas(tmp_path):
    """1 stage x 2 replicas (two processes: the replica code without the point-to-point links,
    which tests/test_groups.py covers) with their NCCL groups (the workers' dense group and the
    stage's replica group) emulated by gloo: only the gradient AllReduce reaches them; the
    replicas' mean loss goes over gloo."""
    import json
    import torch.multiprocessing as mp
    from support.nccl_emulation import child
    from hpar.strategies.job.config import RunConfig
    from hpar.strategies.plan.cluster import free_port

    (tmp_path / "job.py").write_text(SCRIPT)
    cfg = RunConfig(
        script=str(tmp_path / "job.py"),
        strategy="pipeline",
        world_size=2,
        replicas=2,
        steps=3,
        batch_size=8,
        lr=0.1,
        seed=0,
        run_dir=str(tmp_path / "run"),
        device="cuda",
        log_every=1,
        eval=False,
        schedule="1f1b",
        micro_batches=2,
    )
    os.makedirs(cfg.run_dir)
    (tmp_path / "config.json").write_text(cfg.to_json())
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(child, args=(2, [(str(tmp_path / "config.json"), free_port())], str(out)), nprocs=2)
    for rank in range(2):
        r = json.loads((out / f"{rank}.json").read_text())["pipeline"]
        assert r["violations"] == [], f"rank {rank}: {r['violations']}"
