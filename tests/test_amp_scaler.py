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
    assert len(skipped) == guard.scaler_monitor.total_skips
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


def _fp16_run(init_scale: float, steps: int, *, config: nantrace.Config, collapse_at: int | None = None,
              replayable: bool = False, device: str = "cpu"):
    """A bias-free MLP under float16 autocast (a healthy run). At ``collapse_at`` the first layer's
    weights are shrunk 2e5-fold and the second's grown as much: the forward stays finite, but the
    first layer's weight gradient (a sum over the batch) overflows float16 at any scale, step after step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64, bias=False), torch.nn.Tanh(), torch.nn.Linear(64, 1, bias=False)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    guard = nantrace.watch(model, opt, scaler, config=config)

    def loss_fn(x):
        with torch.autocast(device, dtype=torch.float16):
            return model(x).float().pow(2).mean()

    if replayable:
        loss_fn = guard.replayable(loss_fn)
    g = torch.Generator().manual_seed(1)
    error = None
    try:
        for step in range(steps):
            if step == collapse_at:
                with torch.no_grad():
                    model[0].weight.mul_(5e-6)
                    model[2].weight.mul_(2e5)
            opt.zero_grad()
            scaler.scale(loss_fn(torch.randn(4096, 8, generator=g).to(device) + 4)).backward()
            scaler.step(opt)
            scaler.update()
    except nantrace.NonFiniteError as exc:
        error = exc
    guard.close()
    return guard, scaler, error


@pytest.mark.parametrize("exponent", [16, 20, 24, 28, 32, 36, 40])
def test_calibration_from_any_init_scale_is_never_an_incident(exponent, quiet):
    guard, scaler, error = _fp16_run(2.0**exponent, 40, config=quiet)
    monitor = guard.scaler_monitor
    assert error is None and guard.incidents == []
    assert monitor.total_skips == max(exponent - 18, 0), "the scaler halved its way down to its level, 2**18"
    assert monitor.level == scaler.get_scale() == 2.0 ** min(exponent, 18)
    assert monitor.probes <= monitor.total_skips


@pytest.mark.parametrize("init_exponent, replayable, origin_cause", [
    (16, False, "precision_overflow"), (40, False, "precision_overflow"),
    (40, True, "precision_overflow"),  # the float32 re-run holds off the autocast the replayed loss opens itself
])
def test_persistent_overflow_inside_the_model_is_called_at_its_first_skip(init_exponent, replayable, origin_cause, quiet):
    called_at = 30
    guard, scaler, error = _fp16_run(2.0**init_exponent, 50, config=quiet, collapse_at=30, replayable=replayable)
    first = guard.incidents[0]
    assert (first.step, first.kind, first.cause, first.phase, first.action) == (
        called_at, "scaler_collapse", "scaler_collapse", "backward", "skipped")
    assert (first.op, first.module) == ("aten.mm.default", "0")
    assert [t["name"] for t in first.details["nonfinite_grads"]] == ["0.weight"]
    assert first.details["replayed_at_scale_one"] == "non-finite" and first.details["origin_cause"] == origin_cause
    assert "even when it is replayed at scale 1" in first.summary and "0.weight" in first.summary
    # the skips that follow are one episode, counted on its incident; the ladder pauses after the skip budget
    assert first.details["count"] == 5 and first.details["steps"] == list(range(called_at, called_at + 5))
    assert [(i.step, i.kind, i.action) for i in guard.incidents] == [(called_at, "scaler_collapse", "skipped"),
                                                                     (called_at + 5, "scaler_collapse", "paused")]
    assert isinstance(error, nantrace.NonFiniteError) and error.incident is guard.incidents[-1]
    assert guard.ladder.max_consecutive_skips == 5


def test_collapse_from_the_first_step_in_the_loss_function(quiet):
    """A finite loss whose gradient is NaN at every step (sqrt at 0): called at step 0, not after 20 skips."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = nantrace.watch(model, opt, scaler, config=quiet.replace(skip_budget=8))
    singular = _singular(model)
    with pytest.raises(nantrace.NonFiniteError):
        for _ in range(16):
            _amp_step(model, opt, scaler, torch.randn(16, 8), extra=singular)
    guard.close()
    assert [(i.step, i.kind, i.cause, i.action) for i in guard.incidents] == [
        (0, "scaler_collapse", "scaler_collapse", "skipped"), (8, "scaler_collapse", "scaler_collapse", "paused")]
    first = guard.incidents[0]
    assert first.details["count"] == 8 and first.details["consecutive_skips"] == 1
    # the loss tape names the op in the loss code whose derivative is singular (no guard.replayable)
    assert (first.op, first.module, first.details["origin_cause"]) == ("aten.sqrt.default", None, "grad_singularity")
    assert "in the loss function" in first.summary
    assert guard.incidents[1].details["escalation"]["reason"].startswith("8 consecutive skipped updates")


def test_without_a_replay_the_scale_floor_calls_the_collapse(quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    guard = nantrace.watch(model, opt, scaler, config=quiet.replace(scaler_min_scale=1.0, localise=False))
    singular = _singular(model)
    for _ in range(5):
        _amp_step(model, opt, scaler, torch.randn(16, 8), extra=singular)
    guard.close()
    collapse = [i for i in guard.incidents if i.kind == "scaler_collapse"]
    assert [(i.step, i.action, i.details["count"]) for i in collapse] == [(3, "skipped", 2)]
    assert "fell to 0.5, below the floor 1" in collapse[0].summary


@pytest.mark.parametrize("case, skips, expect", [
    ("calibration from 2**40", [True] * 24 + [False] * 5, None),
    ("after its level: max_skips in a row", [False] * 3 + [True] * 5, "consecutive"),
    ("after its level: far below it", [False] * 3 + [True, False] * 12, "below the level"),
])
def test_scaler_monitor_rules_without_replays(case, skips, expect):
    from nantrace.detection.scaler import ScalerMonitor

    m = ScalerMonitor(max_skips=4, min_scale=1.0, max_drop=1024.0)
    scale, found = 2.0**40 if "calibration" in case else 2.0**16, []
    for skipped in skips:
        c = m.update(skipped=skipped, scale=scale)
        if c is not None and not c.continuing:
            found.append(c.reason)
        scale = scale / 2 if skipped else scale
    assert (found[0] if found else None) is None if expect is None else expect in found[0]


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
        assert guard.reporter.history[-1]["grad_norm"] == pytest.approx(expected, rel=1e-5)
    guard.close()
    assert guard.incidents == []
