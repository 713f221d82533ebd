"""Models as people bring them, through the real `hpar run` (stdout to a file, as a batch job):
Hugging Face GPT-2 (tied embedding), Llama (RMSNorm, rotary) and BERT (dict batches with
padding and attention masks, fed as ``model(**batch)``) built from small configs, a ResNet
written the usual way, and an nn.TransformerEncoder classifier. None is an nn.Sequential or has
hpar_layers(): torch's tracer cuts them into pipeline stages (strategies/job/traced.py).

Synchronous pipelines must equal one process on the same batches (gradient accumulation over
micro-batches), also with a weight tied across stages and with replicas; an asynchronous
schedule with a tied weight is refused before start. The runs share tests/test_zoo.py's
machinery (one run per set of flags per session, no process left).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from conftest import single_process_reference, final_state
from test_zoo import ZOO, check_trained, hpar_run

pytestmark = pytest.mark.multiprocess
needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (pip install -e '.[hf]')"
)
HF = ("hf_gpt2", "hf_llama", "hf_bert")
STEPS, BATCH = 10, 8


def _metric_losses(run_dir) -> dict[int, float]:
    """Rank 0's loss per step from the run's metrics.jsonl (``--log-every 1``)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("kind") == "metric" and m.get("rank") == 0 and m.get("loss") is not None:
            out[m["step"]] = m
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_hf) for n in HF] + ["resnet", "encoder"])
def test_profile_offers_a_pipeline_with_its_stage_split(name):
    """`hpar profile`'s planner (in this process) lists pipeline as runnable for every zoo model
    here, with the layer range of each stage in its note."""
    from hpar.launcher.run.cluster_build import build_cluster
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.plan.planner import choose_plan
    from hpar.strategies.profile.profiler import profile_job

    job = load_job(os.path.join(ZOO, f"{name}.py"))
    profile = profile_job(job, BATCH, 4, repeats=1, warmup=1)
    plan = choose_plan(
        profile, build_cluster(4, None, None, "10Gbps", "50us", None), force="pipeline", pipeline_replicas=1
    )
    assert plan.strategy == "pipeline" and len(plan.stages) == 4, plan
    assert next(c.available for c in plan.candidates if c.strategy == "pipeline")
    note = next(c.note for c in plan.candidates if c.strategy == "pipeline")
    assert "4 stages" in note and "layers [0, " in note, note


# (model, flags, replicas): 4 stages of 1f1b; BERT also as 2 stages x 2 replicas (its tied
# decoder on both stages of each replica); the ResNet with one micro-batch (BatchNorm's
# statistics over a micro-batch are not the batch's: one micro-batch is the exact case).
EXACT = [
    ("hf_llama", ("--micro-batches", "4", "--pipeline-replicas", "1"), 1),
    ("hf_bert", ("--micro-batches", "2", "--pipeline-replicas", "2"), 2),
    ("encoder", ("--micro-batches", "4", "--pipeline-replicas", "1"), 1),
    ("resnet", ("--micro-batches", "1", "--pipeline-replicas", "1"), 1),
]


@pytest.mark.parametrize(
    "name,flags,replicas",
    [pytest.param(*e, marks=needs_hf) if e[0] in HF else e for e in EXACT],
    ids=[e[0] for e in EXACT],
)
def test_synchronous_pipeline_equals_one_process(tmp_path_factory, name, flags, replicas):
    """1f1b on 4 workers trains the weights one process trains on the same (concatenated)
    batches, within float tolerance (micro-batch accumulation changes the summation order)."""
    r = hpar_run(tmp_path_factory, name, "pipeline", 4, "--schedule", "1f1b", *flags)
    check_trained(r)
    assert r["summary"]["pipeline_replicas"] == replicas, r["summary"]
    lr = {"hf_llama": 0.05, "hf_bert": 0.05}.get(name, 0.05)
    ref = single_process_reference(os.path.join(ZOO, f"{name}.py"), replicas, STEPS, BATCH, lr)
    got = final_state(r["run_dir"])
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=k)


@needs_hf
def test_gpt2_tied_across_stages_stays_one_parameter(tmp_path_factory):
    """GPT-2's lm_head is its token embedding: on 4 stages the first and the last hold it. With
    AdamW and clipping, every step's loss and gradient norm equal one process's, and the two
    copies (stage 0's transformer.wte.weight, stage 3's lm_head.weight, each written by its
    stage under its own name in the checkpoint) are bitwise equal after every step."""
    r = hpar_run(
        tmp_path_factory,
        "hf_gpt2",
        "pipeline",
        4,
        "--schedule",
        "1f1b",
        "--micro-batches",
        "4",
        "--pipeline-replicas",
        "1",
        "--clip-grad-norm",
        "0.5",
        "--log-every",
        "1",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "0",
    )
    check_trained(r)
    from hpar.strategies.state import state
    from hpar.strategies.job.contract import load_job

    job = load_job(os.path.join(ZOO, "hf_gpt2.py"))
    torch.manual_seed(0)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), 0.01)
    batches = job.batches(0, 1, BATCH)
    metrics = _metric_losses(r["run_dir"])
    for step in range(1, STEPS + 1):
        x, y = next(batches)
        opt.zero_grad()
        loss = job.compute_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        assert metrics[step]["loss"] == pytest.approx(float(loss), rel=1e-4), step
        assert metrics[step]["grad_norm"] == pytest.approx(float(norm), rel=1e-4), step
        saved = state.read_all(str(r["run_dir"] / "checkpoints" / f"step-{step}"))
        first, last = saved["model.transformer.wte.weight"], saved["model.lm_head.weight"]  # stage 0's, stage 3's
        assert torch.equal(first, last), step


@needs_hf
def test_async_schedule_with_a_tied_weight_is_refused_before_start(tmp_path):
    """(With a plan file, as `hpar profile --plan-out` writes one, so that nothing is profiled.)"""
    from conftest import hpar_to_file

    run_dir, plan = tmp_path / "run", tmp_path / "plan.json"
    plan.write_text(json.dumps({"strategy": "pipeline", "stages": [[0, 3], [3, 6]], "micro_batches": 2}))
    rc, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        os.path.join(ZOO, "hf_gpt2.py"),
        "--gpus",
        "2",
        "--plan",
        str(plan),
        "--schedule",
        "async-predict",
        "--run-dir",
        str(run_dir),
    )
    assert rc == 2, out
    assert "parameter 'transformer.wte.weight' is shared by stages 0, 1" in out and "--schedule 1f1b" in out, out
    assert not run_dir.exists()


@needs_hf
def test_llama_trains_under_weight_prediction(tmp_path_factory):
    """An untied Llama under SpecTrain's asynchronous schedule with weight prediction: the
    traced stages run on predicted weights (torch.func.functional_call reaches the graph)."""
    check_trained(
        hpar_run(tmp_path_factory, "hf_llama", "pipeline", 2, "--schedule", "async-predict", "--micro-batches", "4")
    )


@needs_hf
def test_bert_dict_batches_under_allreduce_equal_one_process(tmp_path_factory):
    """A dict batch {input_ids, attention_mask} reaches BERT as model(**batch) in every worker;
    2 workers equal one process on the concatenated batch."""
    r = hpar_run(tmp_path_factory, "hf_bert", "allreduce", 2)
    check_trained(r)
    ref = single_process_reference(os.path.join(ZOO, "hf_bert.py"), 2, STEPS, BATCH, 0.05)
    got = final_state(r["run_dir"])
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=k)


@needs_hf
def test_hf_gpt2_example_pipeline_equals_one_process_and_loads_with_from_pretrained(tmp_path):
    """examples/hf_gpt2.py (GPT-2 on WikiText-2) on 2 pipeline stages with 1f1b (the tied embedding
    held by both; 4 stages of the zoo's GPT-2 are tested above) trains what one process trains (`--strategy allreduce --gpus 1`): every step's loss, and the weights; the run
    leaves RUN_DIR/hf, which GPT2LMHeadModel.from_pretrained loads into a model whose
    evaluate() gives the run's final validation loss."""
    from conftest import REPO, hpar_to_file, kill_left

    script = os.path.join(REPO, "examples", "hf_gpt2.py")
    runs = {}
    for name, flags in (
        ("pipeline", ("--gpus", "2", "--strategy", "pipeline", "--schedule", "1f1b", "--pipeline-replicas", "1")),
        ("one", ("--gpus", "1", "--strategy", "allreduce", "--no-eval")),
    ):
        run_dir = tmp_path / name
        rc, out = hpar_to_file(
            tmp_path / f"{name}.txt",
            "run",
            script,
            *flags,
            "--steps",
            "4",
            "--log-every",
            "1",
            "--run-dir",
            str(run_dir),
            cwd=str(tmp_path),
            timeout=400,
        )
        assert rc == 0, out[-3000:]
        assert not kill_left(run_dir)
        runs[name] = run_dir
    pipe, one = _metric_losses(runs["pipeline"]), _metric_losses(runs["one"])
    assert sorted(pipe) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert pipe[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), step
    a, b = final_state(runs["pipeline"]), final_state(runs["one"])
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4, msg=k)  # AdamW: 4 steps of ~lr each
    from transformers import GPT2LMHeadModel
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_gpt2_example", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loaded = GPT2LMHeadModel.from_pretrained(str(runs["pipeline"] / "hf")).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again by from_pretrained
    with torch.no_grad():
        got = example.evaluate(loaded)
    summary = json.loads((runs["pipeline"] / "summary.json").read_text())
    assert got["val_loss"] == pytest.approx(summary["eval_last"]["val_loss"], rel=1e-6)


def test_compiled_model_is_cut_into_a_pipeline_as_the_module_inside(tmp_path_factory):
    """model() returning torch.compile(ResNet()): the pipeline cuts the module inside the
    wrapper (its stages run eagerly) and trains the same weights, under the same names, as the
    uncompiled ResNet's pipeline."""
    flags = ("--schedule", "1f1b", "--micro-batches", "1", "--pipeline-replicas", "1")
    compiled, plain = (
        hpar_run(tmp_path_factory, name, "pipeline", 4, *flags) for name in ("compiled_resnet", "resnet")
    )
    check_trained(compiled)
    a, b = final_state(compiled["run_dir"]), final_state(plain["run_dir"])
    assert a.keys() == b.keys() and not any("_orig_mod" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@needs_hf
def test_hpar_export_hf_loads_with_from_pretrained(tmp_path_factory, tmp_path):
    """`hpar export RUN_DIR --format hf` of the GPT-2 pipeline run (each stage wrote its part of
    RUN_DIR/model): GPT2LMHeadModel.from_pretrained loads it, tied again, and its logits on a
    fixed batch equal the trained model's (the script's model() with the run's final state)."""
    from conftest import hpar_to_file
    from hpar.strategies.job.contract import load_job
    from transformers import GPT2LMHeadModel

    r = hpar_run(
        tmp_path_factory,
        "hf_gpt2",
        "pipeline",
        4,
        "--schedule",
        "1f1b",
        "--micro-batches",
        "4",
        "--pipeline-replicas",
        "1",
        "--clip-grad-norm",
        "0.5",
        "--log-every",
        "1",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "0",
    )
    check_trained(r)
    rc, out = hpar_to_file(
        tmp_path / "export.txt", "export", str(r["run_dir"]), "--format", "hf", "--out", str(tmp_path / "hf")
    )
    assert rc == 0, out
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    trained = load_job(os.path.join(ZOO, "hf_gpt2.py")).build_model().eval()
    trained.load_state_dict(final_state(r["run_dir"]))
    ids = torch.arange(24).view(2, 12) % 64
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=0)
