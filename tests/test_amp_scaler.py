"""GradScaler awareness: calibration skips are not incidents; a non-finite loss is; a collapse is reported."""

from __future__ import annotations

import pytest
import torch

import nantrace
from conftest import mlp, same_state, snapshot


def _amp_step(model, opt, scaler, x, *, extra=None):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    if extra is not None:
        loss = extra(loss)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def _singular(model):
    """A finite extra loss term whose gradient is NaN (sqrt at exactly 0): gradients overflow at every scale."""
    def add(loss):
        out = model(torch.randn(4, 8))
        return loss + torch.sqrt((out - out.detach()).pow(2).sum())

    return add


def test_calibration_skips_are_not_incidents_but_are_recorded(tmp_path, quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    guard = nantrace.watch(model, opt, scaler, config=quiet, run_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        _amp_step(model, opt, scaler, torch.randn(16, 8, generator=g))
    guard.close()
    assert guard.incidents == []
    rows = nantrace.storage.runstore.RunStore(tmp_path, readonly=True).steps()
    skipped = [r["step"] for r in rows if r["skipped"]]
    assert len(rows) == 30 and guard.step == 30
    assert skipped[:3] == [0, 1, 2], "the scaler's early calibration skips are recorded as skipped steps"
    assert len(skipped) == guard._scaler_monitor.total_skips
    assert all(r["action"] == "scaler_skip" for r in rows if r["skipped"])
    assert rows[0]["scale"] == 2.0**30 and rows[-1]["scale"] < 2.0**30


def test_nonfinite_loss_under_a_scaler_is_an_incident(quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = nantrace.watch(model, opt, scaler, config=quiet)
    for step in range(8):
        x = torch.randn(16, 8)
        before = snapshot(model, opt)
        _amp_step(model, opt, scaler, x, extra=(lambda l: l + torch.log(torch.zeros(()))) if step == 5 else None)
        if step == 5:
            assert same_state(before, snapshot(model, opt))
    guard.close()
    assert [(i.step, i.kind, i.phase, i.action) for i in guard.incidents] == [(5, "nonfinite_loss", "forward", "skipped")]


def test_scaler_collapse_when_gradients_overflow_at_every_scale(quiet):
    """A finite loss whose gradient is NaN at every step (sqrt at 0): the scaler would halve forever."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    cfg = quiet.replace(scaler_max_skips=12, scaler_min_scale=0.0)
    guard = nantrace.watch(model, opt, scaler, config=cfg)

    singular = _singular(model)

    for _ in range(16):
        _amp_step(model, opt, scaler, torch.randn(16, 8), extra=singular)
    guard.close()
    collapse = [i for i in guard.incidents if i.kind == "scaler_collapse"]
    assert [(i.step, i.cause, i.action) for i in collapse] == [(12, "scaler_collapse", "logged")]
    assert collapse[0].details["consecutive_skips"] == 13
    assert "skipped 13 consecutive steps" in collapse[0].summary


def test_scale_floor_triggers_collapse(quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    guard = nantrace.watch(model, opt, scaler, config=quiet.replace(scaler_min_scale=1.0))

    singular = _singular(model)

    for _ in range(5):
        _amp_step(model, opt, scaler, torch.randn(16, 8), extra=singular)
    guard.close()
    collapse = [i for i in guard.incidents if i.kind == "scaler_collapse"]
    assert len(collapse) == 1 and collapse[0].step == 3
    assert "fell to 0.5, below the floor 1" in collapse[0].summary


def test_user_unscale_before_clipping_is_respected(quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    guard = nantrace.watch(model, opt, scaler, config=quiet)
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(16, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        scaler.step(opt)
        scaler.update()
        assert guard._recorder[-1]["grad_norm"] == pytest.approx(expected, rel=1e-5)
    guard.close()
    assert guard.incidents == []
