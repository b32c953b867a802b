"""on_anomaly="rollback": restore the last good state, skip the window, keep LR and updates consistent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from conftest import assert_unhooked


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def test_rollback_restores_the_last_snapshot_and_training_goes_on():
    model, opt, sched = _setup()
    cfg = nantrace.Config(print_incidents=False, rollback_interval=5)
    guard = nantrace.watch(model, opt, on_anomaly="rollback", config=cfg)
    states, lrs, applied = {}, [], 0
    for step in range(16):
        x, y = _batch(step)
        if step == 12:
            x[0, 0] = float("nan")
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        before = guard.step
        opt.step()
        applied += int(not guard.last_step["skipped"])
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        if step == 12:
            # the state is the one from before step 10's update (the newest snapshot)
            assert all(torch.equal(v, states[10][k]) for k, v in model.state_dict().items())
        assert guard.step == before + 1
    guard.close()
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.action) == (12, "nonfinite_input", "rolled_back")
    assert incident.details["restored_to_step"] == 10 and incident.details["skipped_steps"] == [10, 12]
    assert applied == 15
    # the scheduler went back with the weights: after step 12 the LR continues from the snapshot's count
    expected = [min(1.0, (s + 1) / 10) * 1e-2 for s in range(1, 13)] + [min(1.0, (s + 1) / 10) * 1e-2 for s in range(11, 14)]
    assert lrs[:12] == pytest.approx(expected[:12])
    assert lrs[12:] == pytest.approx([min(1.0, (s + 1) / 10) * 1e-2 for s in (11, 12, 13, 14)][: len(lrs) - 12])
    assert_unhooked(model)  # (the LR scheduler's own patch of opt.step is not ours)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_repeated_failure_escalates_to_pause_after_bounded_retries(tmp_path):
    model, opt, _ = _setup()
    cfg = nantrace.Config(print_incidents=False, rollback_interval=4, rollback_max_retries=2)
    guard = nantrace.watch(model, opt, on_anomaly="rollback", config=cfg, run_dir=tmp_path)
    actions = []
    with pytest.raises(nantrace.NonFiniteError) as info:
        for step in range(30):
            x, y = _batch(step)
            if step >= 6:
                x[0, 0] = float("nan")  # the data stays broken: rolling back cannot help
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            actions.append(guard.incidents[-1].action if guard.incidents and guard.incidents[-1].step == step else None)
    guard.close()
    # one episode: the second rollback is counted on the first incident (escalation ladder), then the pause
    assert [(i.action, i.details["count"]) for i in guard.incidents] == [("rolled_back", 2), ("paused", 1)]
    assert guard.incidents[0].details["rollbacks"] == 2 and guard.incidents[0].details["steps"] == [6, 7]
    assert info.value.incident.action == "paused" and info.value.incident.bundle is not None
    assert "escalated to pause" in info.value.incident.details["rollback"]


def test_rollback_with_gradient_accumulation_and_a_scaler():
    model, opt, sched = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    cfg = nantrace.Config(print_incidents=False, rollback_interval=3)
    guard = nantrace.watch(model, opt, scaler, on_anomaly="rollback", config=cfg)
    for step in range(10):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(step * 2 + micro)
            if step == 7 and micro == 1:
                x[1, 1] = float("inf")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y) / 2
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    guard.close()
    [incident] = guard.incidents
    assert (incident.step, incident.action, incident.details["restored_to_step"]) == (7, "rolled_back", 6)
    assert all(torch.isfinite(p).all() for p in model.parameters())
