"""The always-on guard: every failure caught at its step, the update blocked, exact outcomes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nantrace
from conftest import mlp, same_state, snapshot

FAIL_AT = 6


class ExpNet(nn.Module):
    """A regression model whose exp can genuinely overflow float32 on a bad batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.exp(self.lin(x)))


def _batch(step: int, failure: str) -> torch.Tensor:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    if step == FAIL_AT:
        if failure == "nan_input":
            x[3, 2] = float("nan")
        elif failure == "inf_input":
            x[0, 0] = float("inf")
        elif failure == "exp_overflow":
            x = x * 400.0
    return x


def _loss(model: nn.Module, x: torch.Tensor, step: int, failure: str) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    if step == FAIL_AT and failure == "nan_loss":
        loss = loss * float("nan")
    if step == FAIL_AT and failure == "log_zero_loss":
        loss = loss + torch.log(torch.zeros(()))
    return loss


FAILURES = {
    # failure: (kind, phase)
    "nan_input": ("nonfinite_input", "data"),
    "inf_input": ("nonfinite_input", "data"),
    "exp_overflow": ("nonfinite_loss", "forward"),
    "nan_loss": ("nonfinite_loss", "forward"),
    "log_zero_loss": ("nonfinite_loss", "forward"),
    "inf_grad": ("nonfinite_grad", "backward"),
}


def _run(failure: str, policy: str, config: nantrace.Config, *, optimizer: str = "adam", run_dir=None):
    model = ExpNet() if failure == "exp_overflow" else mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer == "adam" else torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9)
    if failure == "inf_grad":
        model[2].weight.register_hook(lambda g: g * float("inf") if _run.step == FAIL_AT else g)
    guard = nantrace.watch(model, opt, on_anomaly=policy, config=config, run_dir=run_dir)
    before = None
    raised = None
    for step in range(FAIL_AT + 4):
        _run.step = step
        x = _batch(step, failure)
        opt.zero_grad()
        loss = _loss(model, x, step, failure)
        loss.backward()
        if step == FAIL_AT:
            before = snapshot(model, opt)
        try:
            opt.step()
        except nantrace.NonFiniteError as exc:
            raised = exc
            break
        if step == FAIL_AT:
            after = snapshot(model, opt)
            assert same_state(before, after), "a blocked update changed parameters or optimizer state"
    guard.close()
    return guard, raised, before, model, opt


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_skip_blocks_the_update_and_training_goes_on(failure, optimizer, quiet):
    guard, raised, _, model, _ = _run(failure, "skip", quiet, optimizer=optimizer)
    assert raised is None
    kind, phase = FAILURES[failure]
    assert [(i.step, i.kind, i.phase, i.action) for i in guard.incidents] == [(FAIL_AT, kind, phase, "skipped")]
    assert guard.step == FAIL_AT + 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_raise_stops_before_any_change(failure, quiet):
    guard, raised, before, model, opt = _run(failure, "raise", quiet)
    assert raised is not None
    incident = raised.incident
    kind, phase = FAILURES[failure]
    assert (incident.step, incident.kind, incident.phase, incident.action) == (FAIL_AT, kind, phase, "raised")
    assert guard.incidents == [incident]
    assert same_state(before, snapshot(model, opt))
    assert f"{kind} at step {FAIL_AT}" in str(raised)


def test_pause_writes_the_bundle_then_raises(tmp_path, quiet):
    guard, raised, before, model, opt = _run("exp_overflow", "pause", quiet, run_dir=tmp_path / "run")
    assert raised is not None and raised.incident.action == "paused"
    bundle = raised.incident.bundle
    assert bundle is not None and bundle.startswith(str(tmp_path / "run" / "incidents"))
    for name in ("diagnosis.json", "env.json", "state.pt", "batch.pt"):
        assert (tmp_path / "run" / "incidents").joinpath(bundle.rsplit("/", 1)[-1], name).is_file()
    state = torch.load(f"{bundle}/state.pt", weights_only=True)
    assert same_state(state["model"], before["model"])


def test_gradient_accumulation_skips_the_whole_accumulated_update(quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=quiet)
    accum = 4
    micro = 0
    for step in range(5):
        opt.zero_grad()
        for k in range(accum):
            x = torch.randn(8, 8)
            if step == 3 and k == 2:
                x[1, 1] = float("nan")
            (model(x).pow(2).mean() / accum).backward()
            micro += 1
        before = snapshot(model, opt)
        opt.step()
        if step == 3:
            assert same_state(before, snapshot(model, opt))
    guard.close()
    assert micro == 20
    assert [(i.step, i.kind, i.action) for i in guard.incidents] == [(3, "nonfinite_input", "skipped")]
    assert guard.incidents[0].details["nonfinite_inputs"] == [{"forward": 2, "arg": "args[0]", "samples": [1], "nan": 1, "inf": 0}]
    assert guard.step == 5


def test_nonfinite_parameter_before_training_is_reported_and_cannot_be_skipped(quiet):
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=quiet)
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(nantrace.NonFiniteError) as info:
        opt.step()
    guard.close()
    inc = info.value.incident
    assert (inc.step, inc.kind, inc.cause, inc.phase, inc.action, inc.module) == (0, "nonfinite_param", "nonfinite_param", None, "raised", "2")
    assert inc.details["nonfinite_params"] == [{"name": "2.weight", "nan": 1, "inf": 0, "numel": 1024, "shape": [32, 32]}]


def test_update_that_corrupts_parameters_is_caught_at_its_own_step(quiet):
    """Adam with eps=0 divides 0 by 0 where a gradient is exactly zero: the update itself makes NaN,
    is caught at the step that made it (phase optimizer) and undone (tests/test_optimizer_phase.py)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, eps=0.0)
    guard = nantrace.watch(model, opt, config=quiet)
    x = torch.randn(8, 4)
    x[:, 3] = 0.0  # the gradient of weight[0, 3] is exactly 0 at every step
    initial = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    guard.close()
    # one episode (the escalation ladder): one incident, updated at each repeat
    assert [(i.step, i.kind, i.cause, i.phase, i.op, i.module, i.action) for i in guard.incidents] == [
        (0, "nonfinite_param", "optimizer_state", "optimizer", "aten.addcdiv_.default", "", "skipped")]
    assert guard.incidents[0].details["steps"] == [0, 1, 2] and guard.incidents[0].details["count"] == 3
    assert guard.incidents[0].details["nonfinite_params"][0]["name"] == "weight"
    assert all(torch.equal(a, b) for a, b in zip(initial, model.parameters()))


def test_sentinel_matches_a_plain_reference():
    """The fused per-step figures equal a slow, obviously-correct computation."""
    from nantrace.detection.sentinel import measure

    torch.manual_seed(0)
    grads = [torch.randn(5, 7), torch.randn(3) * 100, torch.randn(2, 2, 2)]
    params = [torch.randn(4), torch.randn(6, 6)]
    losses = [torch.tensor(1.5), torch.tensor(2.5)]
    h = measure(grads=grads, params=params, losses=losses, inputs_ok=torch.tensor(True), outputs_ok=None,
                scale=None, grads_scaled=False)
    ref_total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert h.grad_norm == pytest.approx(ref_total, rel=1e-6)
    assert h.grad_norms == pytest.approx([float(g.double().norm()) for g in grads], rel=1e-6)
    assert h.param_norm == pytest.approx(math.sqrt(sum(float((p.double() ** 2).sum()) for p in params)), rel=1e-6)
    assert h.loss == pytest.approx(2.0)
    assert h.inputs_finite and h.outputs_finite and h.grads_finite and h.loss_finite

    scaled = measure(grads=[g * 1024 for g in grads], params=[], losses=[], inputs_ok=None, outputs_ok=None,
                     scale=torch.tensor(1024.0), grads_scaled=True)
    assert scaled.grad_norm == pytest.approx(ref_total, rel=1e-5)
    assert scaled.scale == 1024.0


def test_sentinel_does_not_call_a_float32_norm_overflow_nonfinite():
    from nantrace.detection.sentinel import measure

    grads = [torch.full((1000,), 3e37)]
    h = measure(grads=grads, params=[], losses=[], inputs_ok=None, outputs_ok=None, scale=None, grads_scaled=False)
    assert h.grads_finite
    assert h.grad_norm == pytest.approx(3e37 * math.sqrt(1000), rel=1e-6)
    bad = measure(grads=[torch.tensor([1.0, float("nan")])], params=[], losses=[], inputs_ok=None, outputs_ok=None,
                  scale=None, grads_scaled=False)
    assert not bad.grads_finite


# One host read per step: counted for real (every way a value reaches Python) in tests/test_host_reads.py.
