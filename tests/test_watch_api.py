"""nantrace.watch: argument validation, hook hygiene, close() and the context manager."""

from __future__ import annotations

import os

import pytest
import torch

import nantrace
from conftest import assert_unhooked, mlp, same_state, snapshot


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(model="not a model"), TypeError, "model must be a torch.nn.Module, got str"),
        (dict(optimizer=object()), TypeError, "optimizer must be a torch.optim.Optimizer or None, got object"),
        (dict(scaler=3), TypeError, "scaler must be a torch.amp.GradScaler or None, got int"),
        (dict(on_anomaly="explode"), ValueError, "unknown on_anomaly 'explode'; expected one of 'skip', 'raise', 'rollback', 'pause'"),
        (dict(on_anomaly=None), ValueError, "unknown on_anomaly None"),
        (dict(config={"spike_sigma": 3}), TypeError, "config must be a nantrace.Config, got dict"),
        (dict(run_dir=42), TypeError, "run_dir must be a path (str or os.PathLike) or None, got int"),
    ],
)
def test_bad_arguments_raise_and_leave_nothing_hooked(kwargs, error, message):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = dict(model=model, optimizer=opt)
    args.update(kwargs)
    with pytest.raises(error) as info:
        nantrace.watch(args.pop("model"), args.pop("optimizer"), **args)
    assert message in str(info.value)
    assert_unhooked(model, opt)


def test_scaler_without_optimizer_is_rejected():
    model = mlp()
    with pytest.raises(ValueError, match="a scaler was given without an optimizer"):
        nantrace.watch(model, None, torch.amp.GradScaler("cpu"))
    assert_unhooked(model)


def test_run_dir_that_is_a_file_is_rejected(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    model = mlp()
    with pytest.raises(ValueError, match="exists and is not a directory"):
        nantrace.watch(model, run_dir=path)
    assert_unhooked(model)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("spike_window", 2, "Config.detection.spike_window must be an integer >= 24, got 2"),
        ("spike_sigma", 0.5, "Config.detection.spike_sigma must be a number >= 1, got 0.5"),
        ("finite_anomaly_action", "ignore", "Config.response.finite_anomaly_action must be 'policy' or 'log', got 'ignore'"),
        ("check_loss", "yes", "Config.detection.check_loss must be a bool, got 'yes'"),
        ("model_factory", "nocolon", "Config.outputs.model_factory must be 'module:callable'"),
    ],
)
def test_config_validation_names_the_field(field, value, message):
    with pytest.raises((ValueError, TypeError)) as info:
        nantrace.Config(**{field: value})
    assert message in str(info.value)


def test_config_warmup_longer_than_window():
    with pytest.raises(ValueError, match=r"spike_warmup \(200\) must not exceed Config.detection.spike_window \(128\)"):
        nantrace.Config(spike_warmup=200)


@pytest.mark.parametrize("name", ["minimal", "default", "thorough"])
def test_presets(name):
    cfg = nantrace.Config.preset(name, print_incidents=False)
    assert cfg.print_incidents is False
    if name == "minimal":
        assert not cfg.detect_loss_spikes and not cfg.check_inputs
    with pytest.raises(ValueError, match="unknown Config preset 'fast'; expected one of minimal, default, thorough"):
        nantrace.Config.preset("fast")


def test_close_leaves_model_optimizer_and_scaler_as_found(quiet):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler_keys = set(scaler.__dict__)
    original_backward = torch.autograd.backward
    guard = nantrace.watch(model, opt, scaler, config=quiet)
    assert torch.autograd.backward is not original_backward
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    guard.close()
    guard.close()  # idempotent
    assert torch.autograd.backward is original_backward
    assert_unhooked(model, opt, scaler, scaler_keys)
    # the loop still works unguarded
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("policy", ["skip", "raise", "rollback", "pause"])
def test_a_closed_guard_lets_go_of_the_model_without_the_cycle_collector(policy, tmp_path):
    # Snapshots, replay records and bundles must not form reference cycles with the guard:
    # a user who drops the model after close() gets its memory back at once (on a GPU too).
    import gc
    import weakref

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch's own lazy imports happen here, not below

    def run() -> tuple[weakref.ref, weakref.ref, int]:
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        guard = nantrace.watch(model, opt, run_dir=tmp_path / policy, on_anomaly=policy,
                               config=nantrace.Config(print_incidents=False, rollback_interval=1))
        for step in range(6):
            x = torch.randn(4, 8)
            if step == 3:
                x[1, 2] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            try:
                opt.step()
            except nantrace.NonFiniteError:
                break
        n = len(guard.incidents)
        guard.close()
        return weakref.ref(guard), weakref.ref(model), n

    gc.collect()
    gc.disable()
    try:
        guard_ref, model_ref, incidents = run()
        assert incidents == 1
        assert guard_ref() is None and model_ref() is None
    finally:
        gc.enable()


def test_context_manager_closes(quiet):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, config=quiet) as guard:
        assert not guard.closed
    assert guard.closed
    assert_unhooked(model, opt)


def test_guard_does_not_disturb_a_healthy_step_bit_for_bit(quiet):
    """The same training run with and without the guard ends in identical state."""
    def train(guarded: bool):
        model = mlp(seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = nantrace.watch(model, opt, config=quiet) if guarded else None
        g = torch.Generator().manual_seed(0)
        for _ in range(20):
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        if guard:
            guard.close()
        return snapshot(model, opt)

    assert same_state(train(False), train(True))


def test_no_run_dir_writes_nothing(tmp_path, quiet, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, config=quiet):
        for step in range(5):
            x = torch.randn(4, 8)
            if step == 2:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert os.listdir(tmp_path) == []


def test_two_guards_keep_the_backward_patch_until_the_last_closes(quiet):
    a, b = mlp(0), mlp(1)
    original = torch.autograd.backward
    ga = nantrace.watch(a, torch.optim.SGD(a.parameters(), lr=0.1), config=quiet)
    gb = nantrace.watch(b, torch.optim.SGD(b.parameters(), lr=0.1), config=quiet)
    ga.close()
    assert torch.autograd.backward is not original
    gb.close()
    assert torch.autograd.backward is original


def test_public_api_names():
    for name in ("watch", "Guard", "Config", "Incident", "NonFiniteError", "__version__", "replay"):
        assert hasattr(nantrace, name), name
    assert issubclass(nantrace.NonFiniteError, RuntimeError)
