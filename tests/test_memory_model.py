"""The memory model (strategies/plan/memory_model.py) and the planner's fit test, on synthetic
profiles: each strategy's counted terms, the schedules' micro-batches in flight, and a
candidate that does not fit never chosen."""

import dataclasses

import pytest

from hpar.strategies.plan.cluster import make_cluster
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.plan.memory_model import in_flight, misfit, predict
from hpar.strategies.plan.planner import choose_plan
from hpar.strategies.profile.records import LayerProfile, MemoryProfile, ParamProfile, Profile

MB = 10**6


def profile(layers=4, layer_bytes=100 * MB, table_bytes=0, ratio=1.0, step_ratio=0.0, device="cpu") -> Profile:
    """``layers`` dense layers of ``layer_bytes`` each (and an embedding table), measured at a
    step of 10 MB of activations (2.5 MB saved per layer) besides its gradients."""
    params = [
        ParamProfile(f"l{i}.weight", (1000, layer_bytes // 4000), layer_bytes, False, 1.0, 1.0, False, i)
        for i in range(layers)
    ]
    if table_bytes:
        params.insert(
            0, ParamProfile("emb.weight", (10_000, table_bytes // 40_000), table_bytes, True, 0.01, 0.02, True, 0)
        )
    grads = layers * layer_bytes
    mem = MemoryProfile(
        batch_size=32,
        layer_saved_bytes=(int(2.5 * MB),) * layers,
        forward_peak_bytes=8 * MB,
        step_peak_bytes=grads + 10 * MB,
        step_grad_bytes=grads,
        data_bytes=MB,
        optimizer_state_ratio=ratio,
        process_bytes=300 * MB,
        optimizer_step_ratio=step_ratio,
    )
    lps = tuple(
        LayerProfile(f"l{i}", 0.01, 0.02, 10**9, 1000, layer_bytes + (table_bytes if i == 0 else 0))
        for i in range(layers)
    )
    return Profile(
        params=tuple(params),
        layers=lps,
        batch_size=32,
        samples_per_batch=32,
        workers=2,
        is_sequential=True,
        sequential_reason="",
        compute_s=0.12,
        forward_s=0.04,
        backward_s=0.08,
        forward_flops=10**9,
        backward_flops=2 * 10**9,
        update_s_per_byte=1e-10,
        timing_batch_size=32,
        device=device,
        memory=mem,
    )


def cluster(workers=2, servers=None, **kw):
    return make_cluster(None, workers, servers, 1e9, 50e-6, **kw)


def test_allreduce_holds_weights_state_buckets_and_a_step():
    prof = profile(ratio=2.0)  # Adam: two state tensors per weight
    mem = predict(prof, cluster(), Estimate("allreduce", 1.0, 64, 0.0))
    p = 400 * MB
    assert mem.worker["params"] == p and mem.worker["optimizer"] == 2 * p and mem.worker["ddp_buckets"] == p
    assert mem.worker["step"] == p + 10 * MB  # the measured step with its dense gradients
    assert mem.worker_peak_bytes == sum(mem.worker.values()) and mem.server_peak_bytes is None


def test_the_optimizer_step_temporaries_count_where_they_exceed_the_activations():
    mem = predict(profile(step_ratio=1.0), cluster(), Estimate("allreduce", 1.0, 64, 0.0))
    assert mem.worker["step"] == 2 * 400 * MB  # gradients and a temporary as large (Adagrad's sqrt)


@pytest.mark.parametrize(
    "schedule, held", [("gpipe", [8, 8]), ("1f1b", [2, 1]), ("async", [2, 1]), ("async-stash", [2, 1])]
)
def test_micro_batches_in_flight_follow_the_schedule(schedule, held):
    assert [in_flight(schedule, 2, k, 8) for k in range(2)] == held
    assert in_flight("1f1b", 4, 0, 2) == 2 and in_flight("gpipe", 4, 3, 2) == 2


def test_a_pipeline_stage_holds_its_share_and_the_schedule_its_versions():
    prof = profile()
    est = Estimate("pipeline", 1.0, 32, 0.0, stages=((0, 2), (2, 4)), micro_batches=4)
    sync = predict(prof, cluster(), est, "1f1b").worker
    stash = predict(prof, cluster(), est, "async-stash").worker
    assert sync["gradients"] == 200 * MB and sync["versions"] == 0
    assert sync["params"] == 400 * MB  # on a CPU every stage keeps the whole model it was cut from
    assert predict(dataclasses.replace(prof, device="cuda"), cluster(), est, "1f1b").worker["params"] == 200 * MB
    assert stash["versions"] == 2 * 200 * MB  # stage 0 of 2: a copy per micro-batch in flight
    gpipe = predict(prof, cluster(), est, "gpipe").worker["step"]
    assert gpipe == pytest.approx(4 * 0.5 * 10 * MB / 4, rel=1e-6)  # M in flight x its half x a micro-batch's


def test_a_traced_models_first_trace_counts_on_a_cpu_stage_only():
    """Term ``trace`` (issue 67): a pipeline stage of a model cut by torch's tracer, on a CPU, pays
    the first trace (torch.export's modules); not a declared sequence, not a GPU's memory, not
    another strategy; a profile from before the figure reads as 0."""
    prof = profile()
    prof = dataclasses.replace(prof, traced=True, memory=dataclasses.replace(prof.memory, trace_bytes=40 * MB))
    est = Estimate("pipeline", 1.0, 32, 0.0, stages=((0, 2), (2, 4)), micro_batches=4)
    assert predict(prof, cluster(), est, "1f1b").worker["trace"] == 40 * MB
    assert predict(dataclasses.replace(prof, traced=False), cluster(), est, "1f1b").worker["trace"] == 0
    assert predict(dataclasses.replace(prof, device="cuda"), cluster(), est, "1f1b").worker["trace"] == 0
    assert "trace" not in predict(prof, cluster(), Estimate("allreduce", 1.0, 64, 0.0)).worker
    old = {k: v for k, v in dataclasses.asdict(prof).items()}
    del old["memory"]["trace_bytes"]
    assert Profile.from_dict(old).memory.trace_bytes == 0


def test_fsdp_shards_everything_but_the_units_it_runs():
    prof = profile(layers=8, layer_bytes=50 * MB)
    mem = predict(prof, cluster(workers=4), Estimate("fsdp", 1.0, 128, 0.0)).worker
    assert mem["params"] == 100 * MB and mem["optimizer"] == 100 * MB  # 400 MB over 4 workers
    assert mem["unsharded"] == 2 * 2 * 50 * MB  # the running and the prefetched unit, and their gradients
    build = predict(
        dataclasses.replace(prof, layers=prof.layers[:1]), cluster(workers=8), Estimate("fsdp", 1.0, 256, 0.0)
    ).worker
    assert set(build) == {"build", "first_use", "growth"}  # the whole model built before sharding dominates


def test_servers_hold_their_rows_and_their_state():
    prof = profile(layers=1, layer_bytes=10 * MB, table_bytes=800 * MB, ratio=3.0)
    place = {"emb.weight": "ps", "l0.weight": "allreduce"}
    mem = predict(
        prof, cluster(servers=2), Estimate("hybrid", 1.0, 64, 0.0, placement=place, partitions={"emb.weight": 8})
    )
    assert mem.server["shard"] == 400 * MB and mem.server["optimizer"] == 3 * 400 * MB
    assert mem.worker["params"] == 10 * MB  # the table stays on the servers
    # a server builds the whole model at start and copies its rows out: where that is more, it is the peak
    light = predict(
        dataclasses.replace(prof, memory=dataclasses.replace(prof.memory, optimizer_state_ratio=0.0)),
        cluster(servers=2),
        Estimate("hybrid", 1.0, 64, 0.0, placement=place, partitions={"emb.weight": 8}),
    )
    assert light.server == {"build": 810 * MB + 400 * MB}
    odd = predict(
        prof, cluster(servers=2), Estimate("hybrid", 1.0, 64, 0.0, placement=place, partitions={"emb.weight": 3})
    )
    assert odd.server["shard"] == pytest.approx(800 * MB * 2 / 3)  # 2 of 3 partitions on server 0


def test_a_candidate_that_does_not_fit_is_never_chosen_and_a_forced_one_is_refused():
    prof = profile(ratio=2.0)
    free = choose_plan(prof, cluster())
    need = next(c for c in free.candidates if c.strategy == "allreduce").memory
    assert need["fits"] is None or need["fits"]
    cap = (need["worker_peak_bytes"] + need["overhead_bytes"]) * 0.9
    plan = choose_plan(prof, cluster(worker_memory_bytes=cap))
    ar = next(c for c in plan.candidates if c.strategy == "allreduce")
    assert not ar.available and ar.note.startswith("needs ") and " GB per worker, " in ar.note
    assert ar.memory["fits"] is False and plan.strategy != "allreduce"
    assert f"Does not fit the memory: allreduce {ar.note}" in plan.reason
    with pytest.raises(ValueError, match=r"--strategy allreduce needs .* GB per worker, .* --force"):
        choose_plan(prof, cluster(worker_memory_bytes=cap), force="allreduce")
    assert (
        choose_plan(prof, cluster(worker_memory_bytes=cap), force="allreduce", allow_misfit=True).strategy
        == "allreduce"
    )
    assert plan.memory["worker_peak_bytes"] > 0


def test_misfit_names_the_side_that_does_not_fit():
    memory = {
        "worker_peak_bytes": 2 * 10**9,
        "server_peak_bytes": 5 * 10**9,
        "overhead_bytes": 10**9,
        "server_overhead_bytes": 10**9,
    }
    assert misfit(memory, 3.5e9, None) == ""
    assert misfit(memory, 2.5e9, None) == "needs 3 GB per worker, 2.5 GB available"
    assert misfit(memory, 4e9, 5.5e9) == "needs 6 GB per server, 5.5 GB available"


def test_bench_skips_a_strategy_that_does_not_fit_with_the_reason():
    from hpar.launcher.bench.bench_plans import does_not_fit
    from hpar.strategies.plan.estimates import estimate_all

    prof = profile(ratio=2.0)
    tight = cluster(worker_memory_bytes=1.7e9)
    estimates = {e.strategy: e for e in estimate_all(prof, tight)}
    assert does_not_fit("allreduce", prof, estimates, tight).startswith("needs ")
    assert does_not_fit("fsdp", prof, estimates, tight) is None
    assert does_not_fit("allreduce", prof, estimates, cluster()) is None


def test_evaluate_copy_after_training_counts_where_no_worker_holds_the_model():
    """A script with evaluate(): worker 0's whole copy after the last step (fsdp: its shards,
    the gathered state dict and the model loaded from it; hybrid: the copy with the served
    table pulled) is a second peak the fit test checks, naming it; allreduce holds the model
    whole already, and a script without evaluate() makes no copy."""
    prof = dataclasses.replace(profile(table_bytes=200 * MB), evaluates=True)
    p = 600 * MB
    fsdp = predict(prof, cluster(workers=4), Estimate("fsdp", 1.0, 128, 0.0))
    assert fsdp.final["params"] == p / 4 and fsdp.final["gathered"] == p and fsdp.final["copy"] == p
    assert fsdp.worker_final_bytes == sum(fsdp.final.values()) > fsdp.worker_peak_bytes
    place = {"emb.weight": "ps"} | {f"l{i}.weight": "allreduce" for i in range(4)}
    hybrid = predict(prof, cluster(servers=2), Estimate("hybrid", 1.0, 64, 0.0, placement=place))
    assert hybrid.final["params"] == 400 * MB and hybrid.final["copy"] == p
    assert predict(prof, cluster(), Estimate("allreduce", 1.0, 64, 0.0)).worker_final_bytes is None
    plain = predict(dataclasses.replace(prof, evaluates=False), cluster(workers=4), Estimate("fsdp", 1.0, 128, 0.0))
    assert plain.final == {} and plain.worker_final_bytes is None
    cap = (fsdp.worker_peak_bytes + fsdp.worker_final_bytes) / 2 + fsdp.overhead_bytes
    assert misfit(fsdp.to_dict(None), cap, None).startswith("needs ")
    assert "per worker for evaluate()'s whole copy" in misfit(fsdp.to_dict(None), cap, None)
    assert misfit(plain.to_dict(None), cap, None) == ""


def test_frozen_parameters_are_held_without_gradients_buckets_or_optimizer_state():
    """A frozen parameter (requires_grad=False) is held by the workers, but torch's optimizers
    keep no state for it and DDP buckets no gradient of it (issue 67): allreduce, fsdp and
    hybrid/ps count it in ``params`` only; a ps worker whose only AllReduce part is frozen runs
    no DDP (no reducer's runtime)."""
    base = profile(ratio=2.0)
    frozen = dataclasses.replace(base, params=(dataclasses.replace(base.params[0], frozen=True),) + base.params[1:])
    mem = predict(frozen, cluster(), Estimate("allreduce", 1.0, 64, 0.0)).worker
    assert mem["params"] == 400 * MB and mem["optimizer"] == 2 * 300 * MB and mem["ddp_buckets"] == 300 * MB
    sparse = predict(frozen, cluster(), Estimate("allreduce-sparse", 1.0, 64, 0.0)).worker
    assert sparse["optimizer"] == 2 * 300 * MB and sparse["ddp_buckets"] == 300 * MB
    fsdp = predict(frozen, cluster(workers=4), Estimate("fsdp", 1.0, 128, 0.0)).worker
    assert fsdp["params"] == 100 * MB and fsdp["optimizer"] == 2 * 75 * MB  # sharded, state for 300 MB / 4
    place = {"l0.weight": "allreduce"} | {f"l{i}.weight": "ps" for i in range(1, 4)}
    ps = predict(frozen, cluster(servers=2), Estimate("ps", 1.0, 64, 0.0, placement=place)).worker
    assert ps["params"] == 400 * MB and ps["optimizer"] == 0 and ps["ddp_buckets"] == 0 and ps["runtime"] == 0
    assert predict(base, cluster(servers=2), Estimate("ps", 1.0, 64, 0.0, placement=place)).worker["runtime"] > 0
