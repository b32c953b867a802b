"""Early warnings (nantrace.dynamics.early_warnings): silent on healthy runs of several models
and seeds, and each one firing, before the NaN where there is one, on a run constructed to
fail that way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from dynamics_helpers import _one_thread, classification_batches, image_batches, kinds, quiet, relu_mlp, small_cnn, train  # noqa: F401
from nantrace.demo.data import make_batch
from nantrace.demo.model import DemoTransformer
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics.early_warnings import LayerWarnings, WarningSettings

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")

DYNAMICS_KINDS = ("grad_growth", "update_ratio", "vanishing_gradient", "optimizer_state", "logit_saturation",
                  "clipping", "lr_schedule")


# ----------------------------------------------------------------- the judgements, on synthetic series
def _feed(warnings: LayerWarnings, steps: int, grad_fn, param: float = 1.0) -> list:
    out = []
    for step in range(steps):
        grad = np.asarray(grad_fn(step), dtype=float)
        out += [(step, s) for s in warnings.observe_norms(step, grad, np.full(len(grad), param))]
    return out


def test_noisy_flat_series_raise_nothing() -> None:
    rng = np.random.default_rng(0)
    warnings = LayerWarnings(["a", "b", "c"], WarningSettings(warmup=10))
    scales = np.array([1e-2, 1e-3, 1e-1])
    assert _feed(warnings, 2000, lambda s: scales * np.exp(rng.normal(0, 0.8, 3))) == []


def test_uniform_shrinking_is_convergence_not_vanishing() -> None:
    rng = np.random.default_rng(1)
    warnings = LayerWarnings(["a", "b", "c"], WarningSettings(warmup=10))
    assert _feed(warnings, 1500, lambda s: np.full(3, 1e-1 * 10 ** (-6 * s / 1500)) * np.exp(rng.normal(0, 0.3, 3))) == []


def test_one_layer_collapsing_against_the_others_is_vanishing() -> None:
    rng = np.random.default_rng(2)
    warnings = LayerWarnings(["a", "b", "c"], WarningSettings(warmup=10))
    collapse = lambda s: np.array([1e-2, 1e-2 * (1e-5 if s >= 300 else 1.0), 1e-2]) * np.exp(rng.normal(0, 0.3, 3))  # noqa: E731
    hits = _feed(warnings, 500, collapse)
    assert [(s.kind, s.module) for _, s in hits] == [("vanishing_gradient", "b")]
    assert 300 + 50 <= hits[0][0] <= 300 + 50 + 16


def test_a_steadily_growing_ratio_is_reported_once() -> None:
    rng = np.random.default_rng(3)
    warnings = LayerWarnings(["a", "b"], WarningSettings(warmup=10))
    grow = lambda s: np.array([1e-3 * (1.02 ** max(0, s - 200)), 1e-3]) * np.exp(rng.normal(0, 0.2, 2))  # noqa: E731
    hits = _feed(warnings, 600, grow)
    assert [(s.kind, s.module) for _, s in hits] == [("grad_growth", "a")]
    assert hits[0][1].details["growth"]["a"] >= 10


def test_update_ratio_must_stay_high_for_the_sustain_window() -> None:
    warnings = LayerWarnings(["a", "b"], WarningSettings(warmup=0, update_ratio_max=0.1, sustain_steps=50))
    out = []
    for step in range(0, 200, 5):
        brief_burst = 0.5 if 20 <= step < 60 else 0.01  # 40 steps: not sustained
        late = 0.3 if step >= 100 else 0.01
        out += [(step, s) for s in warnings.observe_update_ratio(step, np.array([brief_burst, late]))]
    assert [(step, s.kind, s.module, s.details["since_step"]) for step, s in out] == [(150, "update_ratio", "b", 100)]


# ----------------------------------------------------------------- healthy runs: zero false alarms
_HEALTHY = quiet(update_stats_every=2, optimizer_stats_every=2, logit_stats_every=5, dynamics_warmup=50)
"""Sampled more often and judged earlier than by default: more chances of a false alarm."""


def _mlp_run(seed: int, steps: int):
    model = relu_mlp(seed, width=32)
    return train(model, torch.optim.Adam(model.parameters(), lr=1e-3), classification_batches(seed), steps,
                 _HEALTHY, clip=5.0)


def _cnn_run(seed: int, steps: int):
    model = small_cnn(seed)
    return train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), image_batches(seed), steps, _HEALTHY)


def _transformer_run(seed: int, steps: int):
    torch.manual_seed(seed)
    model = DemoTransformer(dim=32, layers=2, max_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return train(model, opt, lambda s: make_batch(s + 7919 * seed, batch=8, max_len=16), steps, _HEALTHY, clip=1.0)


@pytest.mark.parametrize(("run", "seed", "steps"), [
    (_mlp_run, 0, 250), (_mlp_run, 1, 250), (_cnn_run, 0, 200), (_cnn_run, 1, 200), (_transformer_run, 0, 200),
    (_transformer_run, 1, 200),
], ids=["mlp-0", "mlp-1", "cnn-bn-0", "cnn-bn-1", "transformer-0", "transformer-1"])
def test_healthy_runs_raise_no_warning(run, seed: int, steps: int) -> None:
    guard = run(seed, steps)
    assert [(i.step, i.kind, i.summary) for i in guard.incidents if i.kind in DYNAMICS_KINDS] == []


# ----------------------------------------------------------------- constructed failures
def test_learning_rate_far_too_high_is_reported_by_the_update_ratio_before_the_nan() -> None:
    """SGD on least squares at 10× the learning rate that converges: the weights oscillate with a
    growing amplitude, every update about twice their norm, long before the loss overflows."""
    def run(lr: float):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(0)
        w = torch.randn(16, 1, generator=g)
        # finite anomalies (the divergence) only logged, so that the run goes on to its NaN; the
        # escalation ladder then pauses it (NonFiniteError)
        guard = nantrace.watch(model, opt, config=quiet(update_stats_every=5, dynamics_warmup=20,
                                                        finite_anomaly_action="log"))
        first_nan = None
        try:
            for step in range(220):
                x = torch.randn(64, 16, generator=g)
                opt.zero_grad()
                loss = F.mse_loss(model(x), x @ w)
                loss.backward()
                if first_nan is None and not math.isfinite(float(loss.detach())):
                    first_nan = step
                opt.step()
        except nantrace.NonFiniteError:
            pass
        finally:
            guard.close()
        return guard, first_nan

    healthy, nan_at = run(0.1)
    assert nan_at is None and kinds(healthy) == []
    failing, nan_at = run(1.0)
    warnings = [(i.step, i) for i in failing.incidents if i.kind == "update_ratio"]
    assert len(warnings) == 1 and nan_at is not None and warnings[0][0] < nan_at
    incident = warnings[0][1]
    assert incident.cause == "update_too_large" and incident.module == "0" and incident.action == "logged"
    assert incident.details["update_ratio"]["0"] > 0.1 and "learning rate" in incident.fix


def test_a_dead_relu_layer_is_reported_as_vanishing() -> None:
    model = relu_mlp(0, width=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def kill(step: int) -> None:
        if step == 130:  # every unit of the second layer dies: no gradient reaches it or the layer before
            with torch.no_grad():
                model[2].bias.fill_(-100.0)

    guard = train(model, opt, classification_batches(), 220, quiet(), before_step=kill)
    found = [i for i in guard.incidents if i.kind == "vanishing_gradient"]
    assert len(found) == 1
    incident = found[0]
    assert 130 + 50 <= incident.step <= 130 + 50 + 16
    assert set(incident.details["layers"]) == {"0", "2"} and incident.module == "0"
    assert "dead ReLU" in incident.fix and incident.cause == "vanishing_gradient"


def test_growing_gradients_are_reported_well_before_the_nan() -> None:
    """From step 120 a loss term's weight grows 5% per step (a schedule bug): gradients grow
    relative to the weights for a hundred steps before anything is non-finite, too slowly for
    a spike detector, steadily enough for the trend."""
    model = relu_mlp(0, width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = train(model, opt, classification_batches(), 280, quiet(), loss_scale=lambda s: 1.05 ** max(0, s - 120))
    growth = [i for i in guard.incidents if i.kind == "grad_growth"]
    first_nonfinite = min(i.step for i in guard.incidents if i.kind.startswith("nonfinite"))
    assert growth and growth[0].cause == "gradient_explosion" and growth[0].action == "logged"
    assert 120 < growth[0].step < first_nonfinite - 50
    assert growth[0].details["growth"][growth[0].module] >= 10
    assert len({i.module for i in growth}) == len(growth)  # once per layer


@pytest.mark.parametrize("scenario", ["dead_relu", "growing_gradients"])
def test_batched_layer_figures_report_every_warning_at_its_own_step(monkeypatch, scenario) -> None:
    """The per-layer figures of healthy steps are combined in batches; a batch ends at each sample
    that the early warnings judge, so the incidents (step, kind, module, evidence) are those of
    figures combined one step at a time (``BATCH = 1``, the reference)."""
    from nantrace.dynamics.layers import LayerStatsMonitor

    def run(batch: int) -> list[tuple]:
        monkeypatch.setattr(LayerStatsMonitor, "BATCH", batch)
        model = relu_mlp(0, width=32)
        if scenario == "dead_relu":
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

            def kill(step: int) -> None:
                if step == 130:
                    with torch.no_grad():
                        model[2].bias.fill_(-100.0)

            guard = train(model, opt, classification_batches(), 220, quiet(), before_step=kill)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            guard = train(model, opt, classification_batches(), 280, quiet(), loss_scale=lambda s: 1.05 ** max(0, s - 120))
        return [(i.step, i.kind, i.module, i.cause, str(i.details) if i.kind in DYNAMICS_KINDS else None)
                for i in guard.incidents]  # (the non-finite incidents' episode ids are random)

    batched, reference = run(LayerStatsMonitor.BATCH), run(1)
    assert batched == reference
    assert any(kind in ("vanishing_gradient", "grad_growth") for _, kind, *_ in batched)
