"""Gradient clipping efficacy (nantrace.dynamics.clipping): the process-wide observer of
clip_grad_norm_, its figures against a reference computed by hand, the signals, and that
torch is left exactly as found."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nantrace
from dynamics_helpers import _one_thread, classification_batches, quiet, relu_mlp, train  # noqa: F401
from nantrace.dynamics import clipping
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics.clipping import ClipMonitor, suggest_max_norm
from nantrace.patches import CLIP_FUNCTIONS

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")

ORIGINALS = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_, torch.nn.utils.clip_grads_with_norm_)


def _untouched() -> bool:
    return (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_,
            torch.nn.utils.clip_grads_with_norm_) == ORIGINALS and not any(p.installed for p in CLIP_FUNCTIONS)


def test_figures_match_norms_measured_by_hand() -> None:
    model = relu_mlp(0, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=quiet(dynamics_warmup=0))
    batches = classification_batches()
    by_hand = []
    for step in range(70):
        x, y = batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        by_hand.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))))
        returned = torch.nn.utils.clip_grad_norm_((p for p in model.parameters()), max_norm=1.0)  # a generator, as often
        assert float(returned) == pytest.approx(by_hand[-1], rel=1e-5)
        after = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
        assert after == pytest.approx(min(by_hand[-1], 1.0), rel=1e-4)  # it still clips
        opt.step()
    guard.close()
    summary = nantrace.dynamics.summary(guard)["clipping"]
    norms = np.asarray(by_hand)
    assert summary["calls"] == summary["steps"] == 70 and summary["max_norm"] == 1.0
    assert summary["steps_clipped"] == int((norms > 1.0).sum())
    assert summary["fraction_clipped"] == pytest.approx((norms > 1.0).mean())
    assert summary["pre_clip_norm"]["p50"] == pytest.approx(float(np.quantile(norms, 0.5)), rel=1e-5)
    assert summary["pre_clip_norm"]["max"] == pytest.approx(norms.max(), rel=1e-5)
    assert summary["suggested_max_norm"] == pytest.approx(float(np.quantile(norms, 0.95)), rel=1e-5)
    assert summary["nonfinite"] == 0
    assert _untouched()


@pytest.fixture
def short_window(monkeypatch):
    """Judge clipping over the last 50 steps instead of 200 (shorter runs, same logic)."""
    monkeypatch.setattr(clipping, "_ALWAYS_WINDOW", 50)


def test_clipping_on_every_step_is_reported_with_a_suggested_threshold(tmp_path, short_window) -> None:
    model = relu_mlp(0, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = train(model, opt, classification_batches(), 110, quiet(dynamics_warmup=20), clip=1e-3, run_dir=tmp_path)
    found = [i for i in guard.incidents if i.kind == "clipping"]
    assert len(found) == 1
    incident = found[0]
    assert incident.cause == "clip_threshold" and "fired on 100% of the last 50 steps" in incident.summary
    suggested = incident.details["suggested_max_norm"]
    assert suggested > 0.01 and f"{suggested:.3g}" in incident.fix
    with nantrace.storage.runstore.RunStore(tmp_path, readonly=True) as store:
        assert store.get_meta("clipping")["steps_clipped"] == 110


def test_a_healthy_threshold_raises_nothing(short_window) -> None:
    model = relu_mlp(0, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = train(model, opt, classification_batches(), 110, quiet(dynamics_warmup=20), clip=5.0)
    assert [i for i in guard.incidents if i.kind == "clipping"] == []


def test_clipping_scaled_gradients_is_reported() -> None:
    model = relu_mlp(0, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    guard = nantrace.watch(model, opt, scaler, config=quiet())
    batches = classification_batches()
    for step in range(3):
        x, y = batches(step)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if step == 2:
            scaler.unscale_(opt)  # the right order, from now on
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    guard.close()
    found = [i for i in guard.incidents if i.kind == "clipping"]
    assert len(found) == 1 and found[0].step == 0
    assert "scaler.unscale_(optimizer) before" in found[0].fix


def test_the_patch_is_reference_counted_and_ignores_other_models() -> None:
    a, b = relu_mlp(0, width=8), relu_mlp(1, width=8)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    guard_a = nantrace.watch(a, opt_a, config=quiet())
    guard_b = nantrace.watch(b, opt_b, config=quiet())
    assert all(p.installed for p in CLIP_FUNCTIONS) and torch.nn.utils.clip_grad_norm_ is not ORIGINALS[0]
    x, y = classification_batches()(0)
    for model, opt in ((a, opt_a), (b, opt_b), (b, opt_b)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    guard_a.close()
    assert all(p.installed for p in CLIP_FUNCTIONS)  # b still watches
    b_grads = [p for p in b.parameters()]
    torch.nn.utils.clip_grads_with_norm_(b_grads, 0.5, torch.tensor(1.0))  # the two-call API is seen too
    guard_b.close()
    assert _untouched()
    monitor_a = next(m for m in guard_a.monitors if isinstance(m, ClipMonitor))
    monitor_b = next(m for m in guard_b.monitors if isinstance(m, ClipMonitor))
    assert (monitor_a.calls, monitor_b.calls) == (1, 3)


def test_clip_stats_off_leaves_torch_alone() -> None:
    model = relu_mlp(0, width=8)
    guard = nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=quiet(clip_stats=False))
    assert _untouched()
    guard.close()


def test_suggest_max_norm_ignores_nonfinite_norms() -> None:
    assert suggest_max_norm([1.0, 2.0, float("inf"), float("nan"), 3.0], quantile=0.5) == 2.0
    assert suggest_max_norm([float("nan")]) is None
