"""Pipeline x data parallelism (K stages x R replicas): the rank grid, exactness of gpipe and
1f1b with K = 2, R = 2 against one process on the concatenated batch, the asynchronous
schedules with replicas, checkpoints written by replica 0 and resumed by every replica, and
the planner's (K, R) choice."""
import os

import pytest
import torch

from test_pipeline import SCRIPT, assert_close_state, run_pipeline

from hpar.strategies.job import load_job
from hpar.strategies.pipeline.replicas import Grid
from hpar.strategies.pipeline.stage import split_micro


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
    from hpar.strategies.config import RunConfig
    args = dict(script="j.py", strategy="pipeline", world_size=4, steps=1, batch_size=8, lr=0.1, seed=0, run_dir="r")
    with pytest.raises(ValueError, match="--pipeline-replicas 3: .*= --gpus 4; choose a divisor"):
        RunConfig(**args, replicas=3)
    assert RunConfig(**args, replicas=2).pipeline_stages == 2
    with pytest.raises(ValueError, match="--pipeline-replicas 2 is not supported with --schedule torch-1f1b"):
        RunConfig(**args, replicas=2, schedule="torch-1f1b")


def reference(tmp_path, replicas=2, steps=10, batch_size=8, micro=4, lr=0.1, seed=3):
    """One process, each step on the concatenation of the R replicas' batches (mean loss
    over the R x M equal micro-batches = mean over the concatenated batch)."""
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
        opt.step()
        losses.append(float(loss))
    assert split_micro(x, micro)   # the runtime's micro-batches divide the batch
    return model.state_dict(), losses


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("schedule,layout", [("gpipe", "stages-adjacent"), ("1f1b", "replicas-adjacent")])
def test_two_stages_by_two_replicas_equal_one_process_on_the_concatenated_batch(tmp_path, schedule, layout):
    ref, ref_losses = reference(tmp_path)
    codes, summary, state, logs = run_pipeline(tmp_path, world_size=4, replicas=2, schedule=schedule,
                                               plan={"layout": layout})
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
    codes, summary, state, logs = run_pipeline(tmp_path, world_size=4, replicas=2, schedule="async-predict",
                                               steps=14, lr=0.05)
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
    parts = sorted(f for f in os.listdir(run_dir / "checkpoints" / "step-6") if f.endswith(".pt"))
    assert parts == ["stage0.pt", "stage1.pt"]   # replica 0 of each stage; the replicas are identical
    codes, summary, state, logs = run_pipeline(tmp_path, world_size=4, replicas=2, steps=10, resume=True)
    assert codes == [0] * 4, logs
    assert_close_state(state, ref)
