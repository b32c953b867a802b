"""Learning-rate schedule check (nantrace.dynamics.lr_schedule): the declared schedule (dict,
callable or the scheduler itself) against the one that ran; the first divergence reported
once with its step, both values and what it looks like."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

import nantrace
from dynamics_helpers import _one_thread, quiet  # noqa: F401
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics.lr_schedule import ScheduleSpec

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")

W, T, PEAK = 10, 50, 0.1
SPEC = {"peak_lr": PEAK, "warmup_steps": W, "decay": "linear", "total_steps": T}


def _hf_linear(step: int) -> float:
    """Hugging Face's get_linear_schedule_with_warmup factor."""
    return step / W if step < W else max(0.0, (T - step) / (T - W))


def _run(make_scheduler, schedule=None, *, steps: int = 40, every: int = 1, times: int = 1, groups: int = 1):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(groups)])
    opt = torch.optim.SGD([{"params": m.parameters()} for m in model], lr=PEAK)
    scheduler = make_scheduler(opt)
    guard = nantrace.watch(model, opt, config=quiet(lr_schedule=scheduler if schedule is None else schedule))
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        if (step + 1) % every == 0:
            for _ in range(times):
                scheduler.step()
    guard.close()
    return [i for i in guard.incidents if i.kind == "lr_schedule"], guard


def test_spec_formula_matches_hugging_face_linear_and_cosine() -> None:
    linear = ScheduleSpec.from_dict(SPEC)
    cosine = ScheduleSpec.from_dict({**SPEC, "decay": "cosine"})
    for s in range(T + 5):
        assert linear.lr(s, PEAK) == pytest.approx(PEAK * _hf_linear(s))
        progress = (s - W) / (T - W)
        want = PEAK * s / W if s < W else (PEAK * 0.5 * (1 + math.cos(math.pi * progress)) if s < T else 0.0)
        assert cosine.lr(s, PEAK) == pytest.approx(want, abs=1e-12)
    assert ScheduleSpec.from_dict({"peak_lr": 1.0, "offset": 3, "warmup_steps": 4}).lr(0, 1.0) == 0.75


@pytest.mark.parametrize("make", [
    lambda o: lr_scheduler.LambdaLR(o, _hf_linear),
    lambda o: lr_scheduler.SequentialLR(o, [lr_scheduler.LinearLR(o, 0.01, total_iters=W),
                                            lr_scheduler.CosineAnnealingLR(o, T - W)], milestones=[W]),
    lambda o: lr_scheduler.OneCycleLR(o, max_lr=PEAK, total_steps=100),
    lambda o: lr_scheduler.StepLR(o, step_size=7, gamma=0.5),
], ids=["lambda", "sequential", "onecycle", "step"])
def test_a_scheduler_stepped_once_per_step_matches_itself(make) -> None:
    found, guard = _run(make)
    assert found == []
    assert nantrace.dynamics.summary(guard)["lr_schedule"] == {"checked_steps": 40, "divergence": None}


def test_a_scheduler_stepped_per_epoch_is_reported() -> None:
    found, _ = _run(lambda o: lr_scheduler.LambdaLR(o, _hf_linear), every=5)
    assert len(found) == 1
    incident = found[0]
    assert (incident.step, incident.cause, incident.action) == (1, "lr_schedule_mismatch", "logged")
    assert incident.details["lr_ran"] == 0.0 and incident.details["lr_meant"] == pytest.approx(0.01)
    assert "stepped less often than the optimizer" in incident.summary


def test_a_scheduler_stepped_twice_per_step_is_reported() -> None:
    found, _ = _run(lambda o: lr_scheduler.LambdaLR(o, _hf_linear), times=2)
    assert len(found) == 1 and found[0].step == 1
    assert "stepped about 2 times per optimizer step" in found[0].summary


@pytest.mark.parametrize(("factor", "first_step", "needle"), [
    (_hf_linear, None, None),
    (lambda s: _hf_linear(s + 1), 0, "the one meant 1 step(s) later: warmup ends 1 step(s) early"),
    (lambda s: _hf_linear(s - 1) if s >= 1 else 0.0, 1, "the one meant 1 step(s) earlier: warmup ends 1 step(s) late"),
    (lambda s: s / (W + 2) if s < W + 2 else max(0.0, (T - s) / (T - W - 2)), 1,
     "warmup lasts about 12 steps instead of 10: it ends 2 step(s) late"),
    (lambda s: min(1.0, s / W), 11, "never started to decay after warmup (step 10)"),
    (lambda s: 2 * _hf_linear(s), 1, "2× the one meant all along: a peak (base) LR of 0.2 instead of 0.1"),
], ids=["as-declared", "one-step-early", "one-step-late", "warmup-too-long", "never-decays", "peak-doubled"])
def test_declared_schedule_divergences_are_explained(factor, first_step, needle) -> None:
    found, guard = _run(lambda o: lr_scheduler.LambdaLR(o, factor), SPEC)
    if needle is None:
        assert found == []
        return
    assert len(found) == 1
    incident = found[0]
    assert incident.details["step"] == first_step
    assert f"at step {first_step}:" in incident.summary and needle in incident.summary
    ran, meant = incident.details["lr_ran"], incident.details["lr_meant"]
    assert ran == pytest.approx(PEAK * factor(first_step)) and meant == pytest.approx(PEAK * _hf_linear(first_step))
    assert nantrace.dynamics.summary(guard)["lr_schedule"]["divergence"]["step"] == first_step


def test_callable_schedule_per_group() -> None:
    def two_groups(step: int) -> list[float]:
        return [PEAK * _hf_linear(step), PEAK * _hf_linear(step)]

    found, _ = _run(lambda o: lr_scheduler.LambdaLR(o, [_hf_linear, lambda s: 0.5 * _hf_linear(s)]), two_groups, groups=2)
    assert len(found) == 1 and found[0].details["param_group"] == 1
    assert "0.5× the one meant" in found[0].summary


@pytest.mark.parametrize(("schedule", "error", "message"), [
    ({"peak_lr": 1e-3, "decay": "exponential"}, ValueError, "Config.lr_schedule['decay'] must be one of 'cosine'"),
    ({"peak_lr": 1e-3, "decay": "cosine"}, ValueError, "decay 'cosine' needs 'total_steps'"),
    ({"peak_lr": -1.0}, ValueError, "Config.lr_schedule['peak_lr'] must be a positive number"),
    ({"peak_lr": 1e-3, "warmup": 10}, ValueError, "unknown key(s) 'warmup'"),
    ({"peak_lr": 1e-3, "warmup_steps": 10, "total_steps": 5, "decay": "linear"}, ValueError, "must be an integer > warmup_steps"),
    (42, TypeError, "Config.lr_schedule must be a dict"),
])
def test_bad_schedules_are_rejected_with_the_reason(schedule, error, message) -> None:
    with pytest.raises(error) as info:
        nantrace.Config(lr_schedule=schedule)
    assert message in str(info.value)


def test_plateau_scheduler_is_rejected() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="ReduceLROnPlateau depends on the metric"):
        nantrace.Config(lr_schedule=lr_scheduler.ReduceLROnPlateau(opt))


def test_a_scheduler_that_cannot_be_copied_turns_the_check_off_with_a_warning() -> None:
    import threading

    class Holder:
        def __init__(self) -> None:
            self.lock = threading.Lock()  # cannot be deep-copied

        def factor(self, step: int) -> float:
            return 1.0

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = lr_scheduler.LambdaLR(opt, Holder().factor)
    with pytest.warns(RuntimeWarning, match="the scheduler cannot be copied to follow it"):
        guard = nantrace.watch(model, opt, config=quiet(lr_schedule=scheduler))
    guard.close()


@pytest.mark.parametrize("every", [5, 10])
def test_a_declared_schedule_stepped_per_epoch_is_described_as_a_staircase(every: int) -> None:
    """The schedule is declared per step (a dict), its scheduler stepped once every ``every`` steps (per epoch):
    the LR that ran is the declared one at ``first + (t - first) // every``, which the summary says."""
    found, _ = _run(lambda o: lr_scheduler.LambdaLR(o, _hf_linear), SPEC, every=every)
    assert len(found) == 1
    assert f"advanced once every {every} optimizer steps" in found[0].summary, found[0].summary
