"""Adaptive loss-spike and gradient-explosion detection: catch real spikes, no false alarms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.detection.spikes import RobustSpikeDetector


def _det(**kw) -> RobustSpikeDetector:
    args = dict(window=128, warmup=32, sigma=6.0, min_ratio=1.5)
    args.update(kw)
    return RobustSpikeDetector(**args)


def test_no_verdict_during_warmup():
    d = _det()
    assert all(d.update(v) is None for v in [1.0] * 31 + [1e6])


def test_spike_after_warmup_is_flagged_with_its_statistics():
    d = _det()
    rng = np.random.default_rng(0)
    for v in 2.0 + 0.05 * rng.standard_normal(100):
        assert d.update(float(v)) is None
    spike = d.update(20.0)
    assert spike is not None
    assert spike.ratio == pytest.approx(10.0, rel=0.05) and spike.zscore > 6 and spike.window == 100


def test_flagged_values_stay_out_of_the_history_until_a_new_level_persists():
    d = _det(window=32, warmup=24)
    for _ in range(32):
        d.update(1.0)
    flags = [d.update(5.0) is not None for _ in range(10)]
    assert flags[:8] == [True] * 8  # window // 4 = 8 consecutive flags, then the level is accepted
    assert d.update(5.0) is None


@pytest.mark.parametrize("seed", range(5))
def test_noisy_series_raise_no_false_alarm(seed):
    rng = np.random.default_rng(seed)
    loss = _det()
    norm = _det(min_ratio=5.0)
    n = 5000
    trend = np.exp(-np.arange(n) / 1500)
    losses = (0.1 + trend) * np.exp(0.25 * rng.standard_normal(n))
    norms = (1 + trend) * np.exp(0.4 * rng.standard_normal(n))
    assert [i for i, v in enumerate(losses) if loss.update(float(v))] == []
    assert [i for i, v in enumerate(norms) if norm.update(float(v))] == []


def test_state_dict_round_trip():
    d = _det()
    for v in range(50):
        d.update(1.0 + v / 100)
    e = _det()
    e.load_state_dict(d.state_dict())
    assert e.state_dict() == d.state_dict()
    assert (d.update(100.0) is None) == (e.update(100.0) is None)


# ----------------------------------------------------------------------------- whole runs
class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


def _healthy_run(kind: str, seed: int, steps: int, *, amp: bool = False, spike_at=None, explode_at=None):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 100)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
        w = torch.randn(8, 1, generator=g)

        def batch():
            x = torch.randn(8, 8, generator=g)
            return x, x @ w + 0.3 * torch.randn(8, 1, generator=g)

        loss_fn = F.mse_loss
    elif kind == "cnn":
        model = SmallCNN()
        protos = torch.randn(4, 3, 8, 8, generator=g)

        def batch():
            y = torch.randint(0, 4, (8,), generator=g)
            return protos[y] + 1.0 * torch.randn(8, 3, 8, 8, generator=g), y

        loss_fn = F.cross_entropy
    else:
        from nantrace.demo.data import make_batch
        from nantrace.demo.model import DemoTransformer

        model = DemoTransformer(dim=32, layers=1)
        counter = iter(range(10**9))

        def batch():
            return make_batch(next(counter) + seed * 10000, batch=8)

        loss_fn = F.cross_entropy
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24) if amp else None
    guard = nantrace.watch(model, opt, scaler, config=nantrace.Config(print_incidents=False))
    if explode_at is not None:
        last = list(model.parameters())[-2]
        last.register_hook(lambda grad: grad * 1e4 if guard.step == explode_at else grad)
    for step in range(steps):
        x, y = batch()
        if step == spike_at:
            y = y * 30 if kind == "mlp" else (y + 1) % 4
            if kind != "mlp":
                model.head.weight.data.mul_(1.0)  # labels shifted: the model is confidently wrong
        opt.zero_grad()
        if amp:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    guard.close()
    return guard, scaler


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_runs_have_zero_false_alarms(kind, seed):
    guard, _ = _healthy_run(kind, seed, 300)
    assert [(i.step, i.kind) for i in guard.incidents] == []


def test_healthy_amp_run_whose_scaler_skips_early_steps_has_zero_false_alarms():
    guard, scaler = _healthy_run("mlp", 0, 300, amp=True)
    assert guard.scaler_monitor.total_skips > 0
    assert [(i.step, i.kind) for i in guard.incidents] == []


def test_real_loss_spike_is_caught_at_its_step():
    guard, _ = _healthy_run("mlp", 0, 200, spike_at=150)
    assert [(i.step, i.kind, i.cause, i.phase, i.action) for i in guard.incidents] == [
        (150, "loss_spike", "loss_divergence", "forward", "skipped")
    ]
    assert guard.incidents[0].details["ratio"] > 5


def test_gradient_explosion_is_caught_at_its_step():
    guard, _ = _healthy_run("mlp", 1, 200, explode_at=150)
    assert [(i.step, i.kind, i.cause, i.phase, i.action) for i in guard.incidents] == [
        (150, "grad_explosion", "gradient_explosion", "backward", "skipped")
    ]


def test_finite_anomalies_can_be_logged_only():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, finite_anomaly_action="log"))
    for step in range(60):
        x = torch.randn(16, 4)
        y = torch.zeros(16, 1) + (100.0 if step == 50 else 0.0)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    guard.close()
    assert [(i.step, i.kind, i.action) for i in guard.incidents][:1] == [(50, "loss_spike", "logged")]


def _reference_noise_scale(series: np.ndarray) -> float:
    """The noise scale with NumPy's own median and quantile (the definition the fast one must match)."""
    from numpy.lib.stride_tricks import sliding_window_view

    level = np.median(sliding_window_view(series[:-1], 16), axis=1)
    residuals = series[16:] - level
    spread = np.abs(residuals - np.median(residuals))
    return max(1.4826 * float(np.median(spread)), float(np.quantile(spread, 0.99)) / 2.576)


@pytest.mark.parametrize("shape", ["normal", "log_uniform", "ties", "random_walk", "spiky"])
def test_the_noise_scale_is_numpys_median_and_quantile_bit_for_bit(shape):
    from nantrace.detection.spikes import _noise_scale

    rng = np.random.default_rng(7)
    for _ in range(400):
        n = int(rng.integers(17, 260))
        series = {"normal": lambda: rng.standard_normal(n),
                  "log_uniform": lambda: np.log(rng.random(n) + 1e-3),
                  "ties": lambda: np.round(rng.random(n), 1),
                  "random_walk": lambda: np.cumsum(rng.standard_normal(n)),
                  "spiky": lambda: rng.standard_normal(n) * np.where(rng.random(n) < 0.05, 100.0, 1.0)}[shape]()
        assert _noise_scale(series) == _reference_noise_scale(series), n


class _ReferenceSpikes:
    """The detector's rule computed from scratch at every value (NumPy, no running state): the
    level is the median of the last 16 accepted values, the noise the larger of the MAD's and the
    99th percentile's estimate of the residuals against the rolling level, re-estimated after every
    8 accepted values; log space when every accepted value is positive."""

    def __init__(self, window: int, warmup: int, sigma: float, min_ratio: float) -> None:
        self.window, self.warmup, self.sigma, self.min_ratio = window, warmup, sigma, min_ratio
        self.hist: list[float] = []
        self.run: list[float] = []
        self.noise: tuple[bool, float] | None = None
        self.stale = 0

    def _noise(self, series: np.ndarray) -> float:
        level = np.array([np.median(series[i:i + 16]) for i in range(len(series) - 16)])
        res = series[16:] - level
        spread = np.abs(res - np.median(res))
        return max(1.4826 * float(np.median(spread)), float(np.quantile(spread, 0.99)) / 2.576)

    def threshold(self) -> float:
        if len(self.hist) < self.warmup:
            return float("inf")
        log = min(self.hist) > 0
        series = np.log(np.array(self.hist)) if log else np.array(self.hist)
        center = float(np.median(series[-16:]))
        if self.noise is None or self.noise[0] != log or self.stale >= 8:
            self.noise, self.stale = (log, self._noise(series)), 0
        noise = max(self.noise[1], 1e-12)
        if log:
            return max(math.exp(center + self.sigma * noise), self.min_ratio * math.exp(center))
        return center + max(self.sigma * noise, (self.min_ratio - 1.0) * max(abs(center), 1e-12))

    def update(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if not value > self.threshold():
            self.hist = (self.hist + [value])[-self.window:]
            self.run, self.stale = [], self.stale + 1
            return False
        self.run.append(value)
        if len(self.run) >= max(4, self.window // 4):
            self.hist, self.run, self.noise = list(self.run), [], None
        return True


@pytest.mark.parametrize("seed", range(6))
def test_verdicts_and_thresholds_match_a_from_scratch_reference(seed):
    """The detector keeps running figures (a count of non-positive values, the recent logarithms, the
    threshold until the history changes); every verdict and threshold must equal the rule computed
    from scratch, through spikes, level shifts, values crossing zero, and a state reload."""
    rng = np.random.default_rng(seed)
    n = 400
    base = np.exp(rng.normal(0, 0.05, n)) * np.linspace(3.0, 1.0, n)
    base[rng.choice(n, 12, replace=False)] *= 8.0  # spikes
    base[250:300] *= 20.0  # a new level that persists
    if seed % 2:
        base[120:140] -= 2.5  # values at and below zero: the series leaves log space for a while
    base[rng.choice(n, 3, replace=False)] = np.nan
    det = RobustSpikeDetector(window=64, warmup=20, sigma=6.0, min_ratio=1.5)
    ref = _ReferenceSpikes(64, 20, 6.0, 1.5)
    for i, v in enumerate(base.tolist()):
        if i == 330:  # a resumed run: the detector's state reloaded into a new one
            det2 = RobustSpikeDetector(window=64, warmup=20, sigma=6.0, min_ratio=1.5)
            det2.load_state_dict(det.state_dict())
            det, ref.noise = det2, None
        assert det.threshold() == pytest.approx(ref.threshold(), rel=1e-12), i
        assert (det.update(v) is not None) == ref.update(v), i
