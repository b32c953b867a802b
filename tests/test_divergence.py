"""Divergence detection from the first steps (issue 12): a run whose warm-up goes to a learning
rate several times too high is flagged while its loss is still finite; healthy runs (noisy,
heavy-tailed, falling fast early, gradient norms rising early) raise no alarm."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest

import nantrace
from divergence_runs import RUNS, train
from nantrace.detection.divergence import Divergence, DivergenceDetector, GrowthTracker

HEALTHY = [name for name, run in RUNS.items() if run.healthy]
DIVERGING = [name for name, run in RUNS.items() if not run.healthy]


def _flags(losses, norms, lrs):
    d = DivergenceDetector(min_steps=4, min_factor=4.0)
    return [(s, v.cause) for s, (l, g, lr) in enumerate(zip(losses, norms, lrs))
            if (v := d.update(s, l, g, lr)) is not None and not v.continuing]


@pytest.mark.parametrize("name", HEALTHY)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_real_runs_raise_no_divergence(name, seed, one_thread):
    result = train(RUNS[name], seed=seed)
    assert result.first_nonfinite is None
    assert _flags(result.losses, result.grad_norms, result.lrs) == []


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_real_runs_under_the_guard_have_zero_incidents(name, one_thread):
    result = train(RUNS[name], seed=0, guard_kwargs={"config": nantrace.Config(print_incidents=False)})
    assert result.error is None and [(i.step, i.kind) for i in result.guard.incidents] == []


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("noise", ["lognormal", "student_t", "spiky"])
def test_synthetic_noisy_series_raise_no_divergence(seed, noise):
    """Fast-falling early phases with heavy-tailed noise, and a gradient norm that rises 30x over the
    first 40 steps while the loss falls (as transformers do after initialisation)."""
    rng = np.random.default_rng(seed)
    n = 600
    t = np.arange(n)
    trend = 0.05 + 5 * np.exp(-t / 30)  # falls 100-fold, fast, in the first steps
    if noise == "lognormal":
        eps = np.exp(0.3 * rng.standard_normal(n))
    elif noise == "student_t":
        eps = np.exp(0.2 * rng.standard_t(2, n).clip(-15, 15))
    else:  # rare bad batches: 2% of steps 3-10x the loss
        eps = np.where(rng.random(n) < 0.02, rng.uniform(3, 10, n), np.exp(0.15 * rng.standard_normal(n)))
    losses = trend * eps
    norms = (0.1 + 3 * (1 - np.exp(-t / 15))) * np.exp(0.3 * rng.standard_normal(n))
    assert _flags(losses.tolist(), norms.tolist(), [1e-3] * n) == []


@pytest.mark.parametrize("name", DIVERGING)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warmup_too_high_is_flagged_while_the_loss_is_finite(name, seed, one_thread):
    """The figures of issue 12: first incident >= 2 steps before the first non-finite loss (of the same
    run without nantrace), <= 3 incidents for the episode, never more than 10 skipped updates in a row."""
    reference = train(RUNS[name], seed=seed)
    assert reference.first_nonfinite is not None
    watched = train(RUNS[name], seed=seed, guard_kwargs={"config": nantrace.Config(print_incidents=False)})
    guard = watched.guard
    first = guard.incidents[0]
    assert reference.first_nonfinite - first.step >= 2
    assert first.cause in ("loss_divergence", "gradient_explosion") and first.action == "skipped"
    assert first.kind == {"loss_divergence": "loss_spike", "gradient_explosion": "grad_explosion"}[first.cause]
    assert math.isfinite(first.details["loss"])
    assert len(guard.incidents) <= 3 and guard.ladder.max_consecutive_skips <= 10
    assert guard.incidents[-1].action == "paused" and isinstance(watched.error, nantrace.NonFiniteError)


def test_the_diagnosis_names_growth_rate_start_and_learning_rate(one_thread):
    watched = train(RUNS["mlp_warmup_too_high"], seed=0, guard_kwargs={"config": nantrace.Config(print_incidents=False)})
    first = watched.guard.incidents[0]
    d = first.details["divergence"]
    assert (first.step, first.kind, first.cause, first.phase) == (28, "loss_spike", "loss_divergence", "forward")
    assert (d["since_step"], d["steps"], d["lr_trend"]) == (23, 5, "rising")
    assert d["factor"] == pytest.approx(d["value"] / d["start_value"]) and d["factor"] >= 4
    assert d["lr"] == pytest.approx(0.4 * 29 / 50) and d["lr_at_start"] == pytest.approx(0.4 * 24 / 50)
    assert d["grad_norm_before"] == pytest.approx(watched.grad_norms[23], rel=1e-4)
    assert "since step 23" in first.summary and "per step" in first.summary and "still rising (warm-up" in first.summary
    assert "lower the peak learning rate below" in first.fix and "lengthen the warm-up" in first.fix
    assert "clip_grad_norm_" in first.fix


@pytest.mark.parametrize("values, flagged_at", [
    ([1.0, 1.1, 1.5, 3.0, 7.0, 20.0], 4),         # 4 increases, x7 since 1.0: flagged at the 4th
    ([1.0, 1.01, 1.02, 1.03, 1.05, 1.06], None),    # steady but tiny growth
    ([1.0, 1.01, 1.02, 1.03, 40.0], None),          # one spike after small rises: not an exponential
    ([10.0, 3.0, 1.0, 1.2, 1.5, 2.5, 5.0], None),   # recovers below what the run has seen (10)
    ([1.0, 10.0, 1000.0, 1e5], 3),                  # one increase short, but steep beyond divergence_factor**3
    # batch-size-1 MSE losses of a healthy run (recorded): three rises from a trough, 168x, but not
    # 64x above the median of the steps before: noise, not the steep short divergence
    ([0.8152, 0.0387, 1.7426, 0.9828, 0.036, 0.2582, 2.227, 6.069, 0.0038, 0.7046], None),
    ([0.6732, 0.1794, 0.1562, 0.0101, 0.1461, 0.2196, 0.7475], None),
    ([0.5, 0.45, 0.48, 0.44, 2.0, 40.0, 900.0], 6),  # steep and far above its level: flagged at the third rise
])
def test_growth_tracker_rules(values, flagged_at):
    tracker = GrowthTracker("loss", min_steps=4, min_factor=4.0)
    hits = [i for i, v in enumerate(values) if tracker.update(i, v) is not None]
    assert (hits[0] if hits else None) == flagged_at


def test_a_divergence_stays_flagged_until_the_value_is_back_near_its_level():
    tracker = GrowthTracker("loss", min_steps=4, min_factor=4.0)
    series = [1.0, 1.1, 1.5, 3.0, 7.0, 8.0, 6.5, 2.1, 1.9, 1.0]
    flags = [tracker.update(i, v) is not None for i, v in enumerate(series)]
    assert flags == [False, False, False, False, True, True, True, True, False, False]


def test_the_gradient_norm_alone_needs_a_loss_history_that_is_not_falling():
    def run(losses, norms):
        d = DivergenceDetector(min_steps=4, min_factor=4.0)
        return [(i, v.cause) for i, (l, g) in enumerate(zip(losses, norms)) if (v := d.update(i, l, g, 1e-3)) is not None]

    rising = [0.1 * 3**i for i in range(6)]
    assert run([2.0 / (i + 1) for i in range(6)], rising) == []  # early: the norm rises while the loss falls
    assert run([2.0] * 6, rising) == []  # early: no loss history yet
    flat = [2.0 + 0.01 * (i % 2) for i in range(20)]
    assert run(flat + [2.0] * 6, [1.0] * 20 + rising)[0] == (24, "gradient_explosion")
    # both grow, the norm first: the gradients lead
    assert run(flat + [2.0, 2.0, 3.0, 9.0, 27.0, 81.0], [1.0] * 20 + rising)[0] == (24, "gradient_explosion")
    assert run(flat + [2.0, 2.0, 3.0, 9.0, 27.0, 81.0], [1.0] * 26)[0] == (25, "loss_divergence")


def test_state_dict_round_trip():
    d = DivergenceDetector(min_steps=4, min_factor=4.0)
    for i, v in enumerate([1.0, 0.9, 1.1, 1.5, 3.0]):
        d.update(i, v, v, 0.1)
    e = DivergenceDetector(min_steps=4, min_factor=4.0)
    e.load_state_dict(d.state_dict())
    assert e.state_dict() == d.state_dict()
    assert (d.update(5, 7.0, 7.0, 0.1) is None) == (e.update(5, 7.0, 7.0, 0.1) is None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_running_fit_is_numpys_least_squares(seed):
    """The run's slope and R² come from running sums; numpy's least squares on the run's log-values
    (no shared code) gives the same, for runs from 3 to 400 values spanning tiny to large steps."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(3, 400))
        tracker = GrowthTracker("loss", min_steps=4, min_factor=4.0)
        value = float(np.exp(rng.uniform(-20, 20)))
        values = []
        for step in range(n):
            values.append(value)
            tracker.update(step, value)
            value *= float(np.exp(rng.exponential(rng.choice([1e-6, 1e-3, 0.1, 2.0]))))
        if tracker.diverged:
            continue  # a flagged run keeps its start; compare plain runs only
        ys = np.log(np.array(values[-len(tracker._run):]))
        x = np.arange(len(ys))
        slope, intercept = np.polyfit(x, ys, 1)
        r2 = 1 - np.sum((ys - (slope * x + intercept)) ** 2) / np.sum((ys - ys.mean()) ** 2)
        growth = tracker._growth()
        assert math.log(growth.per_step) == pytest.approx(slope, rel=1e-9, abs=1e-12)
        assert growth.r2 == pytest.approx(r2, abs=1e-9)


def test_one_logarithm_per_value_however_long_the_run(monkeypatch):
    """A smooth series (a gradient norm rising through a long warm-up) makes one long run: each
    update costs the same at its 10th value and its 600th (it refitted the whole run before)."""
    from nantrace.detection import divergence

    calls = []

    class CountingMath:
        def __getattr__(self, name):
            return getattr(math, name)

        @staticmethod
        def log(x):
            calls.append(x)
            return math.log(x)

    monkeypatch.setattr(divergence, "math", CountingMath())
    detector = DivergenceDetector(min_steps=4, min_factor=4.0)
    per_update = []
    for i in range(600):
        before = len(calls)
        detector.update(i, 2.0 * 0.999 ** i, 1.0 + 0.001 * i, 1e-3)  # a falling loss, a rising norm
        per_update.append(len(calls) - before)
    assert max(per_update[100:]) == max(per_update[10:100]) <= 4


@pytest.mark.parametrize("values, flagged_at", [
    # cubic features: log-loss convex, R² of a straight line 0.53 at the flag (0.72 a step before)
    ([0.6657, 1.559, 1.933, 2.237, 78.17, 3.126e15], 5),
    # a learned learning rate running away (SGD-HD): the rise starts from the trough at 0.9004
    ([1.242, 0.9004, 1.315, 1.717, 2.546, 1.765e4, 1.248e27], 6),
    # speeding up, but only 2x before the last value: one steep step is not yet a divergence ...
    ([1.0, 1.01, 1.03, 1.07, 2.0, 30.0], None),
    # ... the next, steeper still, is
    ([1.0, 1.01, 1.03, 1.07, 2.0, 30.0, 1000.0], 6),
    # a lone spike after small rises, then a smaller rise: not accelerating, not an exponential
    ([1.0, 1.01, 1.02, 1.03, 40.0, 41.0], None),
    # a spike at the end of a rise (4.5x) that had been slowing down: not speeding up over its last three steps
    ([1.0, 4.0, 4.4, 4.5, 4.55, 200.0], None),
])
def test_growth_that_speeds_up_is_a_divergence(values, flagged_at):
    """A super-exponential growth is badly fitted by a straight line in log (R² < 0.8) yet diverges faster than
    any exponential: it counts when its last three log-increases do not shrink and it had already grown
    divergence_factor-fold before its last value; a lone spike still does not."""
    tracker = GrowthTracker("loss", min_steps=4, min_factor=4.0)
    hits = [(i, g) for i, v in enumerate(values) if (g := tracker.update(i, v)) is not None]
    assert (hits[0][0] if hits else None) == flagged_at
    if hits:
        assert hits[0][1].accelerating and hits[0][1].r2 < 0.8
        assert "growing faster every step" in Divergence(cause="loss_divergence", growth=hits[0][1], other=None,
                                                        continuing=False, lr=None, lr_at_start=None, lr_trend="unknown",
                                                        norm_before=None).summary(hits[0][0])


@pytest.mark.parametrize("seed", range(4))
def test_firing_ranges_agree_with_the_tracker_on_accelerating_and_spiky_runs(seed):
    """firing_ranges (the state's verdict as intervals of the next value, what the sync-free mode checks on the
    device) against update() on a copy, on runs that speed up, spike, or creep, at and around the boundaries."""
    rnd = random.Random(seed)
    checked = fired = speeding = 0
    for _ in range(60):
        tracker = GrowthTracker("loss", min_steps=4, min_factor=4.0)
        mode = rnd.choice(["accelerate", "spike", "creep", "noise"])
        value, rate = 1.0, rnd.uniform(0.01, 0.3)
        for step in range(40):
            if mode == "accelerate" and step > 10:
                rate = min(rate * rnd.uniform(1.0, 2.5), 5.0)
                value *= math.exp(rate * rnd.uniform(0.6, 1.4))
            elif mode == "spike":
                value = value * rnd.uniform(0.95, 1.08) if rnd.random() > 0.1 else value * rnd.uniform(5, 50)
            elif mode == "creep":
                value *= rnd.uniform(0.999, 1.05)
            else:
                value = 2 * rnd.lognormvariate(0, 0.5)
            value = min(value, 1e300)
            ranges = tracker.firing_ranges()
            candidates = [value, value * rnd.uniform(1, 100), value * rnd.uniform(0.5, 1)]
            candidates += [b * f for lo, hi in ranges for b in (lo, hi) if math.isfinite(b) and b > 0
                           for f in (0.999, 1.001)]
            for v in candidates:
                growth = copy.deepcopy(tracker).update(step, v)
                reference = growth is not None
                assert any(lo <= v <= hi for lo, hi in ranges) == reference, (mode, step, v, ranges)
                checked += 1
                fired += reference
                speeding += reference and growth.accelerating
            tracker.update(step, value)
    assert fired > 50 and speeding > 20 and checked > 5000  # the speed-up rule's intervals are exercised
