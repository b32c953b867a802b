"""The structure of the guard's fixed per-step cost (issue 13, item 4), pinned without timings:
what a healthy step does, counted where it happens.

- the step's check reduces gradients and parameters with ONE ``_foreach_norm`` over both;
- a healthy step builds no per-parameter index: the gradient index is one list made once;
- the forward hooks run one ``aminmax`` per floating input/output and no flag arithmetic
  (the flags are formed once, at the check), and those flags are still exact;
- the per-step context handed to monitors reuses one list of names;
- a monitor without work before the update is not entered before the update.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nantrace
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.capture import StepCapture
from nantrace.dynamics.base import Monitor, StepContext


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


class _Recorder(Monitor):
    """Keeps what every finished step handed to the monitors."""

    def __init__(self) -> None:
        self.contexts: list[StepContext] = []

    def on_step(self, ctx: StepContext) -> list[Any]:
        self.contexts.append(ctx)
        return []


@pytest.fixture
def minimal() -> nantrace.Config:
    """No sampled statistics (every step is a plain healthy step); inputs and outputs checked."""
    return nantrace.Config.preset("minimal", detection={"check_inputs": True, "check_outputs": True},
                                  outputs={"print_incidents": False})


@pytest.mark.parametrize("every, per_step", [
    (1, lambda n: [2 * n + 1]),   # every gradient and parameter, and the model's input, in one call
    (16, lambda n: [n + 1]),      # parameters known finite from their provenance: the gradients and the input
])
def test_one_foreach_norm_covers_gradients_and_parameters(monkeypatch, minimal, one_thread, every, per_step):
    """The step's one pass: the gradients', the parameters' and the model inputs' norms in one call (the
    totals are taken on the host); the forward hooks run no kernel on the inputs."""
    model, opt = _model()
    n = len(list(model.parameters()))
    calls: list[int] = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    x, y = torch.randn(4, 8), torch.randn(4, 2)
    config = minimal.replace(detection={"param_check_every": every})
    with nantrace.watch(model, opt, config=config):
        _step(model, opt, x, y)  # warm-up: the buffer plan learns, the optimizer makes its state
        monkeypatch.setattr(torch, "_foreach_norm", counting)
        for _ in range(3):
            _step(model, opt, x, y)
    assert calls == per_step(n) * 3


def test_a_healthy_step_reuses_one_gradient_index(monkeypatch, minimal, one_thread):
    from nantrace import detection

    model, opt = _model()
    n = len(list(model.parameters()))
    unwrapped: list[int] = []
    real_local = detection.sentinel.local
    monkeypatch.setattr(detection.sentinel, "local", lambda t: unwrapped.append(1) or real_local(t))
    recorder = _Recorder()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    with nantrace.watch(model, opt, config=minimal) as guard:
        guard.add_monitor(recorder)
        for _ in range(4):
            _step(model, opt, x, y)
        full_index = guard.judge._full_index
    indices = [ctx.grad_index for ctx in recorder.contexts]
    assert len(indices) == 4 and all(i is full_index for i in indices)  # the same list object: nothing built per step
    assert full_index == list(range(n))
    assert unwrapped == []  # plain tensors: no per-tensor DTensor unwrapping in the check
    names = [ctx.param_names for ctx in recorder.contexts]
    assert all(nm is names[0] for nm in names) and names[0] == [name for name, _ in model.named_parameters()]


def test_missing_gradients_still_take_the_exact_index(minimal, one_thread):
    model, opt = _model()
    recorder = _Recorder()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    with nantrace.watch(model, opt, config=minimal) as guard:
        guard.add_monitor(recorder)
        model[0].weight.requires_grad_(False)  # no gradient for parameter 0 from now on
        _step(model, opt, x, y)
    (ctx,) = recorder.contexts
    assert ctx.grad_index == list(range(1, len(list(model.parameters()))))
    assert len(ctx.health.grad_norms) == len(ctx.grad_index)


def test_a_healthy_step_runs_no_finiteness_kernel(monkeypatch, minimal, one_thread):
    model, opt = _model()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    counts = {"aminmax": 0, "isfinite": 0}
    with nantrace.watch(model, opt, config=minimal) as guard:
        _step(model, opt, x, y)
        for name in counts:
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: counts.__setitem__(
                _name, counts[_name] + 1) or _real(*a, **k))
        model(x)  # one forward: one input (kept for the step's own pass), one output (its extremes)
        capture = guard.recorder.capture
        assert counts == {"aminmax": 1, "isfinite": 0}  # no flag arithmetic; the input waits for the check
        assert len(capture.output_extremes) == 2
        assert len(capture.input_extremes) == 2 and counts["aminmax"] == 2  # reduced where a caller asks
        guard.recorder.reset()
        _step(model, opt, x, y)  # a whole step: the input's norm in the gradients' pass, judged on the host
        assert counts == {"aminmax": 3, "isfinite": 0}
        assert guard.last_step is not None and not guard.incidents


@pytest.mark.parametrize("kind", ["nan", "posinf", "neginf_mask", "huge"])
def test_inputs_judged_by_their_norm_in_the_step_pass(minimal, one_thread, kind):
    """The model's input is judged from its norm, taken in the gradients' pass: a finite norm settles it;
    any other is judged exactly by its extremes: a NaN or +inf input is non-finite, an additive ``-inf``
    mask and a finite input beyond float32's squares are not (and after such a valid input later steps
    take the inputs' extremes as each forward begins, so that no step reads twice)."""
    model, opt = _model()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    bad = x.clone()
    value = {"nan": math.nan, "posinf": math.inf, "neginf_mask": -math.inf, "huge": 3e38}[kind]
    bad[1, 2] = value
    if kind == "huge":
        bad[2, 3] = 3e38
    guard = nantrace.watch(model, opt, config=minimal)
    recorder = _Recorder()
    guard.add_monitor(recorder)
    try:
        _step(model, opt, x, y)
        policy = guard.recorder.capture.input_policy
        assert not policy.extremes_now
        opt.zero_grad()
        out = model(bad)
        loss = torch.nn.functional.mse_loss(torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0), y)
        loss.backward()
        opt.step()
        finite_input = kind in ("neginf_mask", "huge")
        assert recorder.contexts[-1].health.inputs_finite is finite_input
        assert policy.extremes_now is finite_input  # a valid input whose norm is not finite: extremes from now on
    finally:
        guard.close()


def _health(x: torch.Tensor, out: torch.Tensor):
    from nantrace.detection.sentinel import finish, read, stage

    cap = StepCapture()
    cap.note_inputs([x, torch.empty(0)])  # an empty tensor has no extremes and is skipped
    cap.note_outputs([out])
    staged = stage(grads=[torch.ones(3)], params=[torch.ones(3)], losses=[torch.tensor(0.5)], inputs_ok=None,
                   outputs_ok=None, scale=None, grads_scaled=False, input_extremes=cap.input_extremes,
                   output_extremes=cap.output_extremes)
    return cap, staged, finish(staged, read(staged)[0])


@pytest.mark.parametrize("bad_in, bad_out", [(True, False), (False, True), (True, True), (False, False)])
def test_extremes_judged_on_the_host_are_exact(bad_in, bad_out):
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0, 0] = 1e300  # finite in float64, beyond float32: must not read as overflow
    if bad_in:
        x[1, 2] = math.inf
    out = torch.randn(5).half()
    if bad_out:
        out[3] = math.nan
    cap, staged, health = _health(x, out)
    assert health.inputs_finite is (not bad_in) and health.outputs_finite is (not bad_out)
    assert health.grad_norms == [pytest.approx(math.sqrt(3))] and health.param_norms == [pytest.approx(math.sqrt(3))]
    assert staged.vector.dtype == torch.float32
    assert staged.local_flags.tolist() == [float(not bad_in), float(not bad_out), 1.0]  # the device view agrees
    assert bool(cap.inputs_ok) is (not bad_in) and bool(cap.outputs_ok) is (not bad_out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_minus_inf_alone_is_a_mask_not_a_bad_value(dtype):
    """An additive mask (0 / -inf) in and out of the model reads as finite on the host, on the
    device and in the capture's flags alike; a NaN or +inf next to it does not."""
    mask = torch.triu(torch.full((4, 4), -math.inf), 1).to(dtype)
    _, staged, health = _health(mask, mask.float())
    assert health.inputs_finite and health.outputs_finite
    assert staged.local_flags.tolist() == [1.0, 1.0, 1.0]
    for bad in (math.nan, math.inf):
        broken = mask.clone()
        broken[3, 0] = bad
        cap, staged, health = _health(broken, broken.float())
        assert not health.inputs_finite and not health.outputs_finite
        assert staged.local_flags.tolist() == [0.0, 0.0, 1.0]
        assert not bool(cap.inputs_ok) and not bool(cap.outputs_ok)


def test_flags_with_several_forwards_and_an_explicit_flag():
    cap = StepCapture()
    cap.note_inputs([torch.ones(2)])
    cap.note_inputs([torch.tensor([1.0, math.inf])])  # a second forward (gradient accumulation)
    cap.note_outputs([torch.ones(2)])
    assert bool(cap.inputs_ok) is False and bool(cap.outputs_ok) is True
    cap.outputs_ok = torch.tensor(False)  # a replay sets the flag it read from a bundle
    assert cap.output_extremes == [] and bool(cap.outputs_ok) is False
    empty = StepCapture()
    assert empty.inputs_ok is None and empty.outputs_ok is None


def test_a_nonfinite_input_is_still_caught_at_the_step(minimal, one_thread):
    model, opt = _model()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    with nantrace.watch(model, opt, config=minimal) as guard:
        _step(model, opt, x, y)
        before = [p.detach().clone() for p in model.parameters()]
        bad = x.clone()
        bad[2, 3] = math.nan
        _step(model, opt, bad, y)
        assert guard.incidents and guard.incidents[-1].details.get("nonfinite_inputs")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was blocked


def test_a_monitor_without_pre_update_work_is_not_entered(monkeypatch, minimal, one_thread):
    from nantrace.dynamics._common import SafeMonitor

    class Quiet(SafeMonitor):
        name = "quiet"

    class Busy(SafeMonitor):
        name = "busy"
        entered = 0

        def _before_update(self, step: int, params: list[torch.Tensor]) -> None:
            type(self).entered += 1

    model, opt = _model()
    with nantrace.watch(model, opt, config=minimal) as guard:
        quiet, busy = Quiet(), Busy()
        guard.add_monitor(quiet)
        guard.add_monitor(busy)
        grad_modes: list[str] = []
        real = torch.no_grad.__enter__
        monkeypatch.setattr(torch.no_grad, "__enter__", lambda self: grad_modes.append("no_grad") or real(self))
        params = list(model.parameters())
        quiet.before_update(0, params)
        assert grad_modes == []  # nothing to do: no grad-mode switch, no call
        busy.before_update(0, params)
        assert grad_modes == ["no_grad"] and Busy.entered == 1


def test_a_model_returning_a_nested_tensor_runs_and_its_nan_input_is_found(one_thread):
    """A nested tensor has no norm or min/max kernel of its own: nantrace reads it through its components
    (it never breaks the user's forward), and a NaN in the input is still a non-finite input."""
    class Ragged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            return torch.nested.as_nested_tensor([y[0, :2], y[1]])  # rows of different lengths

    torch.manual_seed(0)
    model = Ragged()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own warning that nested tensors are a prototype
        warnings.simplefilter("error", MonitorFailedWarning)  # no monitor of nantrace's fails on the nested output
        with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
            for step in range(4):
                opt.zero_grad()
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
                if step == 2:
                    x[1, 0] = math.nan
                out = model(x)
                sum(part.sum() for part in out.unbind()).backward()
                opt.step()
    assert [(i.step, i.kind, i.cause) for i in guard.incidents] == [(2, "nonfinite_input", "nonfinite_input")]
