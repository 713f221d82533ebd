"""The planner on hand-made profiles: hybrid for an embedding-dominated model, allreduce for a
dense CNN, pipeline for a deep sequence of wide layers on a slow link; each prediction is
checked against a hand computation of the cost model's formulas."""

import dataclasses
import json

import pytest

from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.specs.decision import Plan
from hpar.strategies.plan.planner import choose_plan
from hpar.strategies.profile.profiler import LayerProfile, ParamProfile, Profile

UPB = 1e-10  # update seconds per byte


def make_profile(params, layers, fwd, bwd, samples=32, sequential=False):
    return Profile(
        params=tuple(params),
        layers=tuple(layers),
        batch_size=samples,
        samples_per_batch=samples,
        workers=8,
        is_sequential=sequential,
        sequential_reason="" if sequential else "not a sequence",
        compute_s=fwd + bwd,
        forward_s=fwd,
        backward_s=bwd,
        forward_flops=10**9,
        backward_flops=2 * 10**9,
        update_s_per_byte=UPB,
        timing_batch_size=samples,
    )


def ring(nbytes, n, bw):
    return 2 * (n - 1) / n * nbytes / bw


def test_embedding_dominated_model_gets_hybrid():
    emb = ParamProfile(
        "emb.weight", (100_000, 256), 102_400_000, True, 0.1, 0.5, True, layer=0, union_curve=((1, 0.1), (16, 0.5))
    )
    dense = ParamProfile("lstm.weight", (1000, 1000), 4_000_000, False, 1.0, 1.0, False, layer=1)
    prof = make_profile(
        [emb, dense],
        [LayerProfile("emb", 0.01, 0.01, 0, 10, emb.bytes), LayerProfile("lstm", 0.04, 0.09, 10**9, 10, dense.bytes)],
        0.05,
        0.1,
    )
    bw, n = 1.25e9, 16
    cluster = ClusterSpec(hosts=4, gpus_per_host=(4, 4, 4, 4), servers=4, bandwidth_Bps=bw, latency_s=0.0)
    plan = choose_plan(prof, cluster)
    assert plan.strategy == "hybrid"
    assert plan.placement == {"emb.weight": "ps", "lstm.weight": "allreduce"}
    assert plan.partitions == {"emb.weight": 4} and plan.servers == 4
    got = {c.strategy: c for c in plan.candidates}
    # allreduce: fwd + max(bwd, AR(lstm)) + AR(emb, layer 0: not overlapped) + update (+ dense emb grad)
    ar = 0.05 + max(0.1, ring(4e6, n, bw)) + ring(102.4e6, n, bw) + (106.4e6 + 102.4e6) * UPB
    assert got["allreduce"].predicted_step_s == pytest.approx(ar, rel=1e-9)
    assert got["allreduce"].bytes_per_step == pytest.approx(2 * 15 / 16 * 106.4e6)
    row = 1024 + 8  # a row of 256 floats and its int64 id
    # allreduce-sparse: AllGather of 10% of the rows from each of 15 peers, merge of 16, update of the union
    ag = 15 * 0.1 * 1e5 * row / bw
    ars = 0.05 + max(0.1, ring(4e6, n, bw)) + ag + n * 0.1 * 102.4e6 * UPB + (4e6 + 0.5 * 102.4e6) * UPB
    assert got["allreduce-sparse"].predicted_step_s == pytest.approx(ars, rel=1e-9)
    # hybrid: a worker pulls 10% of the rows; a host pushes the union of its 4 workers' rows
    # (log-interpolated between 1 and 16 workers: 0.1 + 0.5 * 0.4 = 0.3); a server on each of
    # the 4 hosts shares its host's full-duplex link, its bytes going the other way than its
    # host's workers' (so the busier direction counts, not the sum); 3/4 of the traffic leaves the host.
    pull_w, push_h = 0.1 * 1e5 * row, 0.3 * 1e5 * row
    pull = max(4 * pull_w, n * pull_w / 4) * 0.75 / bw
    push = max(push_h, 4 * push_h / 4) * 0.75 / bw
    server = (4 * push_h + 0.5 * 102.4e6) * UPB / 4
    hy = pull + 0.05 + max(0.1, ring(4e6, n, bw)) + push + max(server, 4e6 * UPB)
    assert got["hybrid"].predicted_step_s == pytest.approx(hy, rel=1e-9)
    assert got["hybrid"].samples_per_s == pytest.approx(n * 32 / hy)
    assert hy < ars < ar
    assert "hybrid" in plan.reason


def cnn_profile():
    sizes = [(1_000, 8_000_000), (40_000, 4_000_000), (1_000_000, 1_000_000), (40_000, 40)]
    params, layers = [], []
    for i, (pb, act) in enumerate(sizes):
        params.append(ParamProfile(f"{i}.weight", (pb // 4,), pb, False, 1.0, 1.0, False, layer=i))
        layers.append(LayerProfile(str(i), 0.01, 0.02, 10**8, act, pb))
    return make_profile(params, layers, 0.04, 0.08, sequential=True)


def test_dense_cnn_gets_allreduce():
    prof = cnn_profile()
    bw = 1.25e9
    cluster = ClusterSpec(hosts=1, gpus_per_host=(4,), servers=1, bandwidth_Bps=bw, latency_s=0.0)
    plan = choose_plan(prof, cluster)
    assert plan.strategy == "allreduce" and plan.stages == []
    got = {c.strategy: c for c in plan.candidates}
    total = 1_000 + 40_000 + 1_000_000 + 40_000
    ar = 0.04 + max(0.08, ring(total - 1000, 4, bw)) + ring(1000, 4, bw) + total * UPB
    assert got["allreduce"].predicted_step_s == pytest.approx(ar, rel=1e-9)
    assert got["allreduce"].samples_per_s == pytest.approx(4 * 32 / ar)
    # the pipeline must ship 8 MB/4 MB activations per batch over the link, and idles in the bubble
    assert got["pipeline"].samples_per_s < got["allreduce"].samples_per_s
    assert "overlaps backward" in plan.reason


def test_deep_wide_sequence_on_slow_link_gets_pipeline():
    params, layers = [], []
    for i in range(8):
        params.append(ParamProfile(f"{i}.weight", (5000, 2500), 50_000_000, False, 1.0, 1.0, False, layer=i))
        layers.append(LayerProfile(str(i), 0.02, 0.03, 10**9, 65_536, 50_000_000))
    prof = make_profile(params, layers, 0.16, 0.24, sequential=True)
    bw = 1.25e8  # 1 Gbps
    cluster = ClusterSpec(hosts=4, gpus_per_host=(1, 1, 1, 1), servers=4, bandwidth_Bps=bw, latency_s=0.0)
    plan = choose_plan(prof, cluster)
    assert plan.strategy == "pipeline"
    assert plan.stages == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert plan.micro_batches == 16  # the largest of K, 2K, 4K: the bubble shrinks, no per-message cost
    # middle stage per micro-batch: 2 layers of 0.05/16 s + activation out + gradient in (65536/16 B each)
    period = 2 * 0.05 / 16 + 2 * (65_536 // 16) / bw
    step = (16 + 4 - 1) * period + 100_000_000 * UPB
    pipe = next(c for c in plan.candidates if c.strategy == "pipeline")
    assert pipe.predicted_step_s == pytest.approx(step, rel=1e-9)
    assert pipe.breakdown["bubble"] == pytest.approx(3 / 19)
    assert pipe.samples_per_s == pytest.approx(32 / step)
    ar = next(c for c in plan.candidates if c.strategy == "allreduce")
    assert ar.predicted_step_s > ring(400e6, 4, bw)


def test_plan_json_round_trip():
    """A Plan (strategies/specs/decision.py) goes through to_dict/from_dict and through the run
    config's JSON unchanged; a partial plan keeps the defaults of what it leaves out; an unknown
    key is refused in one line naming it."""
    from hpar.strategies.job.config import RunConfig
    from hpar.strategies.specs.decision import Candidate

    plan = choose_plan(cnn_profile(), ClusterSpec(1, (2,), 1, 1e9, 1e-5))
    plan = dataclasses.replace(
        plan,
        tuning={"chosen": plan.strategy},
        sparse_exchange="allgather-padded",
        local_aggregation=False,
        sparse_optimizer="lazy",
    )
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan and all(isinstance(c, Candidate) for c in again.candidates) and again.candidates
    cfg = RunConfig(
        script="x.py",
        strategy=plan.strategy,
        world_size=2,
        steps=1,
        batch_size=4,
        lr=0.1,
        seed=0,
        run_dir="r",
        plan=plan.to_dict(),
    )
    assert cfg.plan == plan and json.loads(cfg.to_json())["plan"] == plan.to_dict()
    assert RunConfig.from_json(cfg.to_json()) == cfg and RunConfig.from_json(cfg.to_json()).plan == plan
    partial = Plan.from_dict({"strategy": "allreduce", "stages": [(0, 2), (2, 4)], "partitions": {"e": "3"}})
    assert partial == Plan(strategy="allreduce", stages=[[0, 2], [2, 4]], partitions={"e": 3})
    assert partial.micro_batches == 0 and partial.replicas == 1 and partial.pull_ahead and partial.unused_params is None
    assert Plan().empty and not partial.empty and Plan.from_dict({}) == Plan()
    assert (
        RunConfig(
            script="x.py", strategy="allreduce", world_size=1, steps=1, batch_size=1, lr=0.1, seed=0, run_dir="r"
        ).plan
        == Plan()
    )
    with pytest.raises(ValueError) as exc:
        Plan.from_dict({"strategy": "pipeline", "stagse": [[0, 2]]})
    assert str(exc.value) == (
        "--plan: unknown key 'stagse' (did you mean 'stages'?); write it with `hpar profile --plan-out`"
    )
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        RunConfig(
            script="x.py",
            strategy="allreduce",
            world_size=1,
            steps=1,
            batch_size=1,
            lr=0.1,
            seed=0,
            run_dir="r",
            plan={"bogus": 1},
        )
    with pytest.raises(ValueError, match="not a plan written by hpar profile"):
        Plan.from_dict({"strategy": "allreduce", "candidates": [{"strategy": "allreduce"}]})


def test_async_pipeline_has_no_bubble_but_updates_every_micro_batch():
    from hpar.strategies.plan.estimates import estimate_async_pipeline, estimate_pipeline

    params = [ParamProfile(f"{i}.weight", (5000, 2500), 50_000_000, False, 1.0, 1.0, False, layer=i) for i in range(4)]
    layers = [LayerProfile(str(i), 0.02, 0.03, 10**9, 65_536, 50_000_000) for i in range(4)]
    prof = make_profile(params, layers, 0.08, 0.12, sequential=True)
    cluster = ClusterSpec(hosts=2, gpus_per_host=(1, 1), servers=2, bandwidth_Bps=1.25e8, latency_s=0.0)
    sync = estimate_pipeline(prof, cluster)
    m, period, update = sync.micro_batches, sync.breakdown["period"], 100_000_000 * UPB  # 2 layers per stage
    assert sync.step_s == pytest.approx((m + 1) * period + update, rel=1e-9)
    plain = estimate_async_pipeline(sync, "async")
    predict = estimate_async_pipeline(sync, "async-predict")
    assert plain.step_s == pytest.approx(m * (period + update), rel=1e-9)
    assert predict.step_s == pytest.approx(m * (period + 1.5 * update), rel=1e-9)
    assert plain.breakdown["bubble"] == 0.0 and predict.stages == sync.stages
    assert estimate_async_pipeline(sync, "1f1b") is sync


def test_fixed_share_of_compute_makes_fewer_micro_batches_faster():
    """On a CPU a micro-batch costs fixed_share + (1 - fixed_share)/M of the batch: at 0.8
    (wide.py's layers stream their weights whatever the batch) one micro-batch beats four."""
    import dataclasses
    from hpar.strategies.plan.estimates import estimate_pipeline

    params = [ParamProfile(f"{i}.weight", (100, 100), 40_000, False, 1.0, 1.0, False, layer=i) for i in range(4)]
    layers = [LayerProfile(str(i), 0.02, 0.03, 10**6, 0, 40_000) for i in range(4)]
    prof = dataclasses.replace(make_profile(params, layers, 0.08, 0.12, sequential=True), fixed_share=0.8)
    cluster = ClusterSpec(hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=0.0)
    est = estimate_pipeline(prof, cluster)
    update = 2 * 40_000 * UPB  # the busiest stage's 2 layers
    by_m = {m: (m + 1) * 2 * 0.05 * (0.8 + 0.2 / m) + update for m in (1, 2, 4, 8)}
    assert est.micro_batches == 1 and by_m[1] == min(by_m.values())
    assert est.step_s == pytest.approx(by_m[1], rel=1e-9)
    linear = estimate_pipeline(dataclasses.replace(prof, fixed_share=0.0), cluster)
    assert linear.micro_batches == 8  # compute proportional to the batch: the bubble decides
    assert linear.step_s == pytest.approx(9 * 2 * 0.05 / 8 + update, rel=1e-9)


def test_hybrid_with_nothing_on_its_servers_never_wins_and_near_ties_go_simpler(monkeypatch):
    """A dense CNN where the cost model puts hybrid (every parameter on AllReduce) a hair ahead
    of allreduce: the plan is allreduce, hybrid is listed as not runnable in its own name;
    predictions within TIE of each other go to the simpler strategy."""
    from hpar.strategies.plan import estimates, plan_reasons, planner
    from hpar.strategies.plan.costmodel import Estimate

    real = estimates.estimate_all

    def hybrid_ahead(profile, cluster):
        out = real(profile, cluster)
        ar = next(e for e in out if e.strategy == "allreduce")
        return [dataclasses.replace(e, step_s=ar.step_s * 0.999) if e.strategy == "hybrid" else e for e in out]

    monkeypatch.setattr(planner, "estimate_all", hybrid_ahead)
    plan = choose_plan(
        cnn_profile(), ClusterSpec(hosts=1, gpus_per_host=(4,), servers=1, bandwidth_Bps=1.25e9, latency_s=0.0)
    )
    hybrid = next(c for c in plan.candidates if c.strategy == "hybrid")
    assert plan.strategy == "allreduce" and not hybrid.available and "same as allreduce" in hybrid.note
    assert plan.reason.startswith("allreduce: ") and plan.reason.count("allreduce:") == 1
    est = lambda name, step: Estimate(name, step, 32, 0.0)
    assert plan_reasons.fastest_simplest([est("pipeline", 0.098), est("allreduce", 0.1)]).strategy == "allreduce"
    assert plan_reasons.fastest_simplest([est("pipeline", 0.05), est("allreduce", 0.1)]).strategy == "pipeline"
    # in a tie an uncompressed plan goes before a compressed one, even of a simpler strategy
    hybrid, squeezed = est("hybrid", 0.1), est("allreduce", 0.098)
    assert plan_reasons.fastest_simplest([squeezed, hybrid], {id(squeezed): "powersgd:2"}) is hybrid
    assert plan_reasons.fastest_simplest([est("hybrid", 0.2), squeezed], {id(squeezed): "powersgd:2"}) is squeezed
    # the reason of a tie says why the slower prediction was taken
    why = plan_reasons.plan_reason(
        est("allreduce", 0.1),
        cnn_profile(),
        ClusterSpec(hosts=1, gpus_per_host=(4,), servers=1, bandwidth_Bps=1.25e9, latency_s=0.0),
        est("pipeline", 0.098),
    )
    assert (
        why.startswith("allreduce: the gradients are dense")
        and why.endswith(
            "; taken though pipeline is predicted faster (0.98x its samples/s): within 5% of the fastest, the simpler plan "
            "wins (a tie: the cost model is not finer than that)."
        )
        and "the fastest predicted step" not in why
    ), why


def test_allreduce_reason_says_why_on_one_worker_and_on_an_embedding_model():
    """One worker exchanges nothing; an embedding-heavy model that AllReduce still wins on is
    not called dense (the reason seen on a 1-GPU machine said "dense (98% ... embedding)")."""
    emb = ParamProfile(
        "emb.weight", (10_000, 64), 2_560_000, True, 0.9, 1.0, True, layer=0, union_curve=((1, 0.9), (16, 1.0))
    )
    dense = ParamProfile("fc.weight", (100, 100), 40_000, False, 1.0, 1.0, False, layer=1)
    prof = make_profile(
        [emb, dense],
        [LayerProfile("emb", 0.01, 0.01, 0, 10, emb.bytes), LayerProfile("fc", 0.04, 0.09, 10**9, 10, dense.bytes)],
        0.05,
        0.1,
    )
    one = choose_plan(prof, ClusterSpec(hosts=1, gpus_per_host=(1,), servers=1, bandwidth_Bps=1.25e9, latency_s=0.0))
    assert one.strategy == "allreduce" and "one worker" in one.reason
    four = choose_plan(prof, ClusterSpec(hosts=1, gpus_per_host=(4,), servers=1, bandwidth_Bps=1.25e10, latency_s=0.0))
    assert four.strategy == "allreduce", four.reason
    assert "embedding tables hold 98%" in four.reason and "dense" not in four.reason


def test_micro_batches_divide_the_batch():
    """The micro-batches the planner tries ({1, K, 2K, 4K}) move to the nearest divisor of the
    batch, at least K where the batch has one: 3 stages and a batch of 32 (a plan of 3 micro-
    batches would be refused by `hpar run` itself) try 1, 4, 8, 16."""
    from hpar.strategies.plan.estimates import estimate_pipeline
    from hpar.strategies.plan.schedules import micro_batch_count

    assert [micro_batch_count(f, 32, min(f, 3)) for f in (1, 3, 6, 12)] == [1, 4, 8, 16]
    assert [micro_batch_count(f, 30, min(f, 4)) for f in (1, 4, 8, 16)] == [1, 5, 10, 15]  # 8: 6 and 10 tie, the larger
    assert micro_batch_count(3, 7, 3) == 7 and micro_batch_count(4, 2, 3) == 2  # none >= K in a batch of 2: the nearest
    assert micro_batch_count(64, 32, 3) == 32
    params = [ParamProfile(f"{i}.weight", (100, 100), 40_000, False, 1.0, 1.0, False, layer=i) for i in range(3)]
    layers = [LayerProfile(str(i), 0.02, 0.03, 10**6, 4096, 40_000) for i in range(3)]
    cluster = ClusterSpec(hosts=1, gpus_per_host=(3,), servers=1, bandwidth_Bps=1e9, latency_s=0.0)
    seen = []
    for share in (0.0, 0.3, 0.6, 0.9):  # each fixed share of compute favours another M
        prof = dataclasses.replace(
            make_profile(params, layers, 0.06, 0.09, samples=32, sequential=True), fixed_share=share
        )
        est = estimate_pipeline(prof, cluster)
        assert len(est.stages) == 3 and 32 % est.micro_batches == 0, (share, est.micro_batches)
        seen.append(est.micro_batches)
    assert seen[0] == 16 and seen[-1] == 1, seen


def test_weight_tied_across_stages_withdraws_the_asynchronous_pipeline():
    """A weight held by the first and the last layer (GPT-2's tied lm_head) lands on two stages
    of any split: under an asynchronous schedule the pipeline is not offered, with the reason;
    under 1f1b it is (the stages sum its gradient: strategies/runtimes/pipeline/ties.py)."""
    params, layers = [], []
    for i in range(8):
        params.append(ParamProfile(f"{i}.weight", (5000, 2500), 50_000_000, False, 1.0, 1.0, False, layer=i))
        layers.append(LayerProfile(str(i), 0.02, 0.03, 10**9, 65_536, 50_000_000))
    prof = dataclasses.replace(
        make_profile(params, layers, 0.16, 0.24, sequential=True), shared_params=(("0.weight", (0, 7)),)
    )
    cluster = ClusterSpec(hosts=4, gpus_per_host=(1, 1, 1, 1), servers=4, bandwidth_Bps=1.25e8, latency_s=0.0)
    assert choose_plan(prof, cluster).strategy == "pipeline"
    plan = choose_plan(prof, cluster, schedule="async-predict")
    pipe = next(c for c in plan.candidates if c.strategy == "pipeline")
    assert plan.strategy != "pipeline" and not pipe.available
    assert "parameter '0.weight' is shared by stages 0, 3" in pipe.note and "1f1b" in pipe.note, pipe.note


def test_the_update_costs_a_profiled_time_per_parameter_tensor():
    """Profile.update_s_per_tensor adds tensors x that time to each strategy's optimizer step:
    allreduce steps every tensor, a pipeline stage its own, the busiest stage's counting."""
    params = [ParamProfile(f"l{i}.weight", (100, 100), 40_000, False, 1.0, 1.0, False, layer=i // 2) for i in range(8)]
    layers = [LayerProfile(f"l{i}", 0.01, 0.02, 10**6, 4_000, 80_000) for i in range(4)]
    base = make_profile(params, layers, 0.04, 0.08, sequential=True)
    per = dataclasses.replace(base, update_s_per_tensor=1e-3)
    cluster = ClusterSpec(hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=0.0)
    from hpar.strategies.plan.estimates import estimate_all

    before = {e.strategy: e for e in estimate_all(base, cluster)}
    after = {e.strategy: e for e in estimate_all(per, cluster)}
    assert after["allreduce"].step_s - before["allreduce"].step_s == pytest.approx(8e-3)
    assert after["fsdp"].step_s - before["fsdp"].step_s == pytest.approx(8e-3)  # every tensor, sharded
    assert after["pipeline"].stages == before["pipeline"].stages == ((0, 2), (2, 4))
    assert after["pipeline"].step_s - before["pipeline"].step_s == pytest.approx(4e-3)  # a stage's 4 tensors
    assert after["ps"].breakdown["server_update"] - before["ps"].breakdown["server_update"] == pytest.approx(8e-3)


def test_pipeline_on_shared_cores_pays_measured_messages_and_the_cores_share():
    """One host's CPU workers: a stage's message costs one step of the measured small AllReduce's
    ring (allreduce_fixed_s / 2(N-1)), not the link's latency, twice a period and once for the
    step's loss; every layer's compute is slowed by the host's load alike (the last layer too,
    which takes the loss and the time no layer was given)."""
    from hpar.strategies.plan.pipeline_grid import Grid
    from hpar.strategies.plan.costmodel import cost_setting
    from hpar.strategies.plan.costmodel_pipeline import estimate_grid, message_s

    layers = [LayerProfile(str(i), f, b, 1, 0, 0) for i, (f, b) in enumerate([(0.003, 0.006), (0.001, 0.002)])]
    prof = make_profile([], layers, 0.005, 0.010, sequential=True)  # 3 ms of loss and unattributed time
    one = ClusterSpec(1, (2,), 1, 1e12, 1e-5)
    probed = dataclasses.replace(one, allreduce_fixed_s=0.002)
    assert message_s(cost_setting(prof, one)) == pytest.approx(1e-5)
    assert message_s(cost_setting(prof, probed)) == pytest.approx(0.001)  # a 2-rank ring: 2 messages
    est = estimate_grid(prof, probed, Grid(2, 1), 1)
    # stages 9 ms and 3 + 3 ms; (1 + 2 - 1) periods of the slowest + 2 messages, the loss's message
    assert est.step_s == pytest.approx(2 * (0.009 + 2 * 0.001) + 0.001)
    assert est.breakdown["message"] == pytest.approx(0.001)
    shared = dataclasses.replace(probed, cores_per_host=1.0)  # 2 workers on 1 core: compute x2
    assert estimate_grid(prof, shared, Grid(2, 1), 1).step_s == pytest.approx(2 * (0.018 + 2 * 0.001) + 0.001)
    # several hosts: the link's latency, measured collectives ignored
    hosts = ClusterSpec(2, (1, 1), 1, 1e12, 1e-5, allreduce_fixed_s=0.002)
    assert message_s(cost_setting(prof, hosts)) == pytest.approx(1e-5)
