"""Weight stashing and SpecTrain weight prediction, and the single-process simulator that
replays the pipeline schedules with the runtime's Stage code."""

import pytest
import torch

from hpar.strategies.job.contract import Job
from hpar.strategies.runtimes.pipeline.sim import simulate
from hpar.strategies.plan.stage_cuts import split_micro
from hpar.strategies.runtimes.pipeline.prediction import PassWeights


def _layer(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 2))


def _grad_step(pw, x):
    out = pw.forward(0, 0, x)
    pw.backward(0, 0, out.sum())
    pw.step()


def test_prediction_is_w_minus_s_lr_momentum_and_restores_exactly():
    m = _layer()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    pw = PassWeights(m, opt, "predict")
    x = torch.randn(4, 3)
    _grad_step(pw, x)
    _grad_step(pw, x)
    w = m[0].weight.detach().clone()
    v = opt.state[m[0].weight]["momentum_buffer"].clone()
    with pw.predicted(3):
        assert torch.allclose(m[0].weight, w - 3 * 0.1 * v)
    assert torch.equal(m[0].weight, w)
    # the forward of a pass with distance 3 computes with the predicted weights
    out = pw.forward(7, 3, x)
    expected = x @ (w - 0.3 * v).T + (m[0].bias - 0.3 * opt.state[m[0].bias]["momentum_buffer"])
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(m[0].weight, w)


def test_without_momentum_v_is_the_last_gradient():
    m = _layer()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    pw = PassWeights(m, opt, "predict")
    x = torch.randn(4, 3)
    out = pw.forward(0, 0, x)
    pw.backward(0, 0, out.sum())
    g = m[0].weight.grad.clone()
    pw.step()
    w = m[0].weight.detach().clone()
    with pw.predicted(2):
        assert torch.allclose(m[0].weight, w - 2 * 0.5 * g, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, betas=(0.8, 0.99)),
    ],
)
def test_velocity_is_the_optimizers_own_last_step_over_lr(make):
    """v (strategies/runtimes/pipeline/velocity.py) read after a step equals that step's movement / lr:
    prediction extrapolates the direction the optimizer really moves in."""
    from hpar.strategies.runtimes.pipeline.velocity import velocity

    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = make(m.parameters())
    for _ in range(4):
        before = [p.detach().clone() for p in m.parameters()]
        opt.zero_grad()
        m(torch.randn(5, 3)).pow(2).sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        group = opt.param_groups[0]
        for p, b, g in zip(m.parameters(), before, grads):
            v = velocity(opt, group, p, g)
            assert torch.allclose(v, (b - p.detach()) / group["lr"], rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize(
    "make, flag",
    [
        (lambda p: torch.optim.RMSprop(p, lr=0.01), "RMSprop"),
        (lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True), "nesterov"),
        (lambda p: torch.optim.Adam(p, lr=0.01, maximize=True), "maximize"),
    ],
)
def test_optimizer_without_a_prediction_rule_is_refused_in_one_line(make, flag):
    with pytest.raises(
        ValueError, match=f"{flag}.*async-predict has no weight prediction rule.*SGD, Adam or AdamW"
    ) as err:
        PassWeights(_layer(), make(_layer().parameters()), "predict")
    assert "\n" not in str(err.value)


def _two_passes(mode):
    """Forward micro-batch 0, update with another micro-batch, then backward micro-batch 0:
    returns (gradient of the weight, weights at forward, weights at backward)."""
    m = _layer()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    pw = PassWeights(m, opt, mode)
    x0 = torch.randn(4, 3, requires_grad=True)
    w_fwd = m[0].weight.detach().clone()
    out0 = pw.forward(0, 0, x0)
    out1 = pw.forward(1, 0, torch.randn(4, 3))
    pw.backward(1, 0, out1.pow(2).sum())
    pw.step()
    w_bwd = m[0].weight.detach().clone()
    pw.backward(0, 0, out0.sum() * 1.0, None)
    return x0.grad, w_fwd, w_bwd, pw


def test_stash_backward_uses_the_forward_weights():
    xgrad, w_fwd, w_bwd, pw = _two_passes("stash")
    assert not torch.equal(w_fwd, w_bwd)
    # d(sum(x W^T + b))/dx = ones @ W: the stashed W, not the updated one
    assert torch.allclose(xgrad, torch.ones(4, 2) @ w_fwd)
    assert pw.in_flight() == 0


def test_plain_async_backward_reads_the_live_weights():
    xgrad, w_fwd, w_bwd, _ = _two_passes("async")
    assert torch.allclose(xgrad, torch.ones(4, 2) @ w_bwd)


def test_predicted_forward_then_backward_on_the_live_weights():
    """A predicted forward (distance 2) computes with W - 2 lr v, and its backward, after
    another micro-batch's update, reads the live (updated) weights, not the predicted ones;
    the weight gradient is that of the forward's inputs."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    pw = PassWeights(m, opt, "predict")
    for _ in range(2):
        _grad_step(pw, torch.randn(5, 3))
    live = {n: p.detach().clone() for n, p in m.named_parameters()}
    v = {n: opt.state[p]["momentum_buffer"].clone() for n, p in m.named_parameters()}
    hat = {n: live[n] - 2 * 0.1 * v[n] for n in live}
    x0 = torch.randn(5, 3, requires_grad=True)
    out0 = pw.forward(0, 2, x0)
    h = torch.tanh(x0 @ hat["0.weight"].T + hat["0.bias"])
    assert torch.allclose(out0, h @ hat["2.weight"].T + hat["2.bias"], atol=1e-6)
    assert all(torch.equal(p, live[n]) for n, p in m.named_parameters())  # nothing to restore
    out1 = pw.forward(1, 0, torch.randn(5, 3))  # another micro-batch updates in between
    pw.backward(1, 0, out1.sum())
    pw.step()
    after = {n: p.detach().clone() for n, p in m.named_parameters()}
    pw.backward(0, 0, out0.sum())
    # d/dx0 of sum(tanh(x0 A^T + a) B^T + b) with the forward's activations and live A, B
    dh = torch.ones(5, 2) @ after["2.weight"] * (1 - h.detach() ** 2)
    assert torch.allclose(x0.grad, dh @ after["0.weight"], atol=1e-6)
    assert torch.allclose(m[2].weight.grad, torch.ones(5, 2).T @ h.detach(), atol=1e-6)
    assert pw.in_flight() == 0


# --- the simulator ---------------------------------------------------------------------


def _mlp_job(momentum=0.9):
    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
        )

    def data(rank, world_size, batch_size):
        g = torch.Generator().manual_seed(5)
        for _ in range(50):
            x = torch.randn(batch_size, 4, generator=g)
            yield x, x[:, :2].sin()

    return Job(
        path="mlp",
        model_fn=model,
        data_fn=data,
        loss_fn=lambda o, t: torch.nn.functional.mse_loss(o, t),
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum),
        evaluate_fn=None,
    )


def _sequential(job, steps, batch_size, micro, lr, accumulate):
    torch.manual_seed(0)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    batches = job.batches(0, 1, batch_size)
    for _ in range(steps):
        x, y = next(batches)
        for xm, ym in zip(split_micro(x, micro), split_micro(y, micro)):
            loss = job.compute_loss(model(xm), ym)
            (loss / micro).backward()  # every schedule scales micro-batch losses by 1/M
            if not accumulate:
                opt.step()
                opt.zero_grad()
        if accumulate:
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_simulated_synchronous_pipeline_equals_gradient_accumulation(schedule, stages):
    job = _mlp_job()
    sim = simulate(job, schedule, stages, steps=6, batch_size=8, micro_batches=4, lr=0.1)
    ref = _sequential(job, 6, 8, 4, 0.1, accumulate=True)
    for (n, a), b in zip(sim.model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("schedule", ["async", "async-stash", "async-predict"])
def test_one_stage_async_is_sequential_sgd_on_micro_batches_with_lr_over_m(schedule):
    job = _mlp_job()
    sim = simulate(job, schedule, 1, steps=5, batch_size=8, micro_batches=4, lr=0.1)
    ref = _sequential(job, 5, 8, 4, 0.1, accumulate=False)
    for a, b in zip(sim.model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_stash_holds_k_minus_stage_versions():
    job = _mlp_job()
    sim = simulate(job, "async-stash", 3, steps=4, batch_size=8, micro_batches=4, lr=0.1)
    assert sim.max_in_flight == 3


# --- SpecTrain's robustness argument on real data (scikit-learn digits) -----------------


def _digits_job():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    xtr, ytr = x[:1400], y[:1400]

    class Residual(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.f = torch.nn.Linear(width, width)

        def forward(self, h):
            return h + torch.tanh(self.f(h))

    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 32), *[Residual(32) for _ in range(6)], torch.nn.Linear(32, 10))

    def data(rank, world_size, batch_size):
        perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(0))
        for i in range(0, len(xtr) - batch_size + 1, batch_size):
            yield xtr[perm[i : i + batch_size]], ytr[perm[i : i + batch_size]]

    job = Job(
        path="digits",
        model_fn=model,
        data_fn=data,
        loss_fn=lambda o, t: torch.nn.functional.cross_entropy(o, t),
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        evaluate_fn=None,
    )
    return job, xtr, ytr


@pytest.mark.timeout(120)
def test_prediction_beats_stashing_and_plain_async_with_8_stages():
    """8 stages (forward staleness up to 7 updates), SGD momentum 0.9: prediction tracks
    sequential SGD more closely and reaches a lower full training loss than weight stashing
    or no correction (SpecTrain, arXiv 1809.02839, section 5)."""
    torch.set_num_threads(1)
    job, xtr, ytr = _digits_job()
    kw = dict(steps=40, batch_size=16, micro_batches=4, lr=0.008, seed=0)

    def flat(m):
        return torch.cat([p.detach().flatten() for p in m.parameters()])

    def train_loss(m):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(m(xtr), ytr).item()

    torch.manual_seed(0)
    w0 = flat(job.build_model())
    seq = flat(simulate(job, "async", 1, **kw).model)
    result = {}
    for schedule in ("async", "async-stash", "async-predict"):
        m = simulate(job, schedule, 8, **kw).model
        result[schedule] = (train_loss(m), ((flat(m) - seq).norm() / (seq - w0).norm()).item())
    loss = {s: r[0] for s, r in result.items()}
    drift = {s: r[1] for s, r in result.items()}
    assert loss["async-predict"] < loss["async-stash"] and loss["async-predict"] < loss["async"], result
    assert drift["async-predict"] < drift["async-stash"] and drift["async-predict"] < drift["async"], result


def _delayed_by_one(job, steps, batch_size, micro, lr):
    """PipeDream-2BW's update in one process: W(t+1) = W(t) - step(grad f(W(t-1)))."""
    import copy

    torch.manual_seed(0)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    older = copy.deepcopy(model)
    batches = job.batches(0, 1, batch_size)
    for _ in range(steps):
        x, y = next(batches)
        older.zero_grad()
        for xm, ym in zip(split_micro(x, micro), split_micro(y, micro)):
            (job.compute_loss(older(xm), ym) / micro).backward()
        older.load_state_dict(model.state_dict())  # W(t) becomes the next batch's version
        for p, q in zip(model.parameters(), older.parameters()):
            p.grad = q.grad
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("stages, micro", [(1, 2), (3, 2), (4, 4), (5, 6)])
def test_2bw_is_delay_one_sgd_at_every_depth(stages, micro):
    """async-2bw at K stages equals one process applying each batch's gradient, taken on
    the weights one update old, to the current weights (independent of K)."""
    job = _mlp_job()
    sim = simulate(job, "async-2bw", stages, steps=6, batch_size=12, micro_batches=micro, lr=0.1)
    ref = _delayed_by_one(job, 6, 12, micro, 0.1)
    for (n, a), b in zip(sim.model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), n
    with pytest.raises(ValueError, match="--micro-batches 2: --schedule async-2bw needs at least --gpus - 1 = 3"):
        simulate(job, "async-2bw", 4, steps=1, batch_size=12, micro_batches=2, lr=0.1)


def test_divergence_guard_stop_and_sync_in_the_simulator():
    """lr 3 makes async-predict blow up on the small MLP; the guard cuts the asynchronous
    stream 1 + ceil((K-1)/M) steps after the trip and stops there or goes on as 1f1b."""
    from hpar.strategies.runtimes.pipeline.divergence import GuardConfig, LossWatch

    job = _mlp_job()
    kw = dict(steps=12, batch_size=8, micro_batches=2, lr=3.0)
    free = simulate(job, "async-predict", 3, **kw)
    stop = simulate(job, "async-predict", 3, guard=GuardConfig("stop", 1.5), **kw)
    sync = simulate(job, "async-predict", 3, guard=GuardConfig("sync", 1.5), **kw)
    t = stop.divergence["step"]
    assert stop.divergence["async_steps"] == t + 2 and len(stop.losses) == t + 2
    assert stop.losses == free.losses[: t + 2]  # the same run up to the cut
    assert len(sync.losses) == 12 and sync.losses[: t + 2] == stop.losses
    assert sync.divergence["sync_steps"] == 12 - (t + 2)
    watch = LossWatch(GuardConfig("stop", 2.0, window=3))
    # 1.5 < 2 x 0.8 (0.5 has left the window of 3), 1.7 > 2 x 0.8
    assert [watch.observe(s, x) for s, x in enumerate([1.0, 0.5, 0.9, 0.8, 0.95, 1.5, 1.7])] == [False] * 6 + [True]
    assert watch.tripped == {"step": 6, "loss": 1.7, "recent_min": 0.8}
    assert LossWatch(GuardConfig("sync")).observe(0, float("nan"))
    with pytest.raises(ValueError, match="--divergence-factor must be above 1"):
        GuardConfig("sync", 0.5)
