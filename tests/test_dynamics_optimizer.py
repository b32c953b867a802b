"""Adam-family state (nantrace.dynamics.optimizer_state): the per-tensor device reduction
against a plain reference, the eps/dtype check, exp_avg_sq underflow and exp_avg drift."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nantrace
from dynamics_helpers import _one_thread, classification_batches, quiet, relu_mlp, train  # noqa: F401
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics.optimizer_state import OptimizerStateMonitor, eps_problem, tensor_state_stats

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")


def _reference_stats(m: torch.Tensor, v: torch.Tensor, threshold: float) -> list[float]:
    """Element by element, in Python floats."""
    ms = [float(x) for x in m.flatten()]
    vs = [float(x) for x in v.flatten()]
    return [
        math.sqrt(sum(x * x for x in ms)),
        max(vs),
        min(vs),
        float(sum(1 for a, b in zip(ms, vs) if a != 0 and b < threshold)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_state_statistics_match_a_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    m = (torch.randn(7, 5, generator=g) * 1e-3).to(dtype)
    m[0, :3] = 0
    v = (torch.rand(7, 5, generator=g) * 1e-6).to(dtype)
    v[1] = 0
    v[2, :2] = 1e-20 if dtype != torch.float16 else 0
    threshold = 1e-16 * 0.5
    got = tensor_state_stats(m, v, threshold).tolist()
    want = _reference_stats(m, v, threshold)
    assert got[3] == want[3] and got[4] == 0
    assert got[2] == pytest.approx(want[2], abs=1e-30)
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == pytest.approx(want[1], rel=1e-5)


@pytest.mark.parametrize(("eps", "dtype", "needle"), [
    (1e-8, torch.float32, None),
    (1e-8, torch.bfloat16, None),
    (1e-4, torch.float16, None),
    (0.0, torch.float32, "is not positive"),
    (1e-8, torch.float16, "rounds to 0 in float16"),
    (1e-6, torch.float16, "below the smallest normal float16"),
    (1e-40, torch.float32, "below the smallest normal float32"),
    (1e-46, torch.float32, "rounds to 0 in float32"),
])
def test_eps_problem(eps: float, dtype: torch.dtype, needle: str | None) -> None:
    problem = eps_problem(eps, dtype)
    assert (problem is None) == (needle is None)
    if needle:
        assert needle in problem  # type: ignore[operator]


def test_fp16_state_with_eps_1e_8_is_caught_at_the_first_update() -> None:
    """model.half() + Adam(eps=1e-8): eps is 0 in the float16 state. The very first update divides
    by it; the guard's update check catches it at that step, names eps, and undoes it (before the
    dynamics monitor could even see the state: it never survives)."""
    model = relu_mlp(0, width=16).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    guard = train(model, opt, classification_batches(), 6, quiet(), input_dtype=torch.float16)
    first = guard.incidents[0]
    assert (first.step, first.kind, first.phase, first.cause, first.action) == (
        0, "nonfinite_param", "optimizer", "optimizer_state", "skipped")
    assert "rounds to 0 in float16" in first.summary and "float32" in first.fix
    assert first.details["hyperparameters"]["eps"] == 1e-8 and first.details["state"] == "exp_avg_sq"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_exp_avg_sq_underflow_in_fp16_state_is_reported() -> None:
    """A usable eps (1e-4) but gradients so small that v = g² flushes to zero in float16."""
    model = relu_mlp(0, width=16).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    guard = train(model, opt, classification_batches(), 30, quiet(optimizer_stats_every=5), input_dtype=torch.float16,
                  loss_scale=lambda s: 1e-4)
    found = [i for i in guard.incidents if i.kind == "optimizer_state"]
    assert found and "exp_avg_sq has underflowed" in found[0].summary
    assert all(f > 0.5 for f in found[0].details["underflow_fraction"].values())
    summary = nantrace.dynamics.summary(guard)["optimizer_state"]
    assert summary["exp_avg_sq_min"][found[0].module] == 0.0


def test_exp_avg_drift_is_reported_once_at_the_jump() -> None:
    model = relu_mlp(0, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = train(model, opt, classification_batches(), 150, quiet(optimizer_stats_every=5, dynamics_warmup=40),
                  loss_scale=lambda s: 1.0 if s < 120 else 1000.0)
    found = [i for i in guard.incidents if i.kind == "optimizer_state"]
    assert len(found) == 1 and "exp_avg of layer" in found[0].summary
    assert found[0].step == 121  # sampled at step 120 (the jump), read at the next step
    assert max(found[0].details["factor"].values()) > 10


def test_healthy_adam_and_sgd_raise_nothing_and_sgd_has_no_state_figures() -> None:
    model = relu_mlp(0, width=16)
    guard = train(model, torch.optim.Adam(model.parameters(), lr=1e-3), classification_batches(), 60,
                  quiet(optimizer_stats_every=3, dynamics_warmup=10))
    assert [i for i in guard.incidents if i.kind == "optimizer_state"] == []
    summary = nantrace.dynamics.summary(guard)["optimizer_state"]
    assert set(summary["exp_avg_norm"]) == {"0", "2", "4", "6"}
    assert all(0 <= f < 0.5 for f in summary["underflow_fraction"].values())
    model = relu_mlp(0, width=16)
    guard = train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), classification_batches(), 10,
                  quiet(optimizer_stats_every=1))
    assert nantrace.dynamics.summary(guard)["optimizer_state"] == {} and not guard.incidents


def test_layer_figures_combine_the_tensors_of_a_layer() -> None:
    model = relu_mlp(0, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = train(model, opt, classification_batches(), 4, quiet(optimizer_stats_every=3))
    monitor = next(m for m in guard.monitors if isinstance(m, OptimizerStateMonitor))
    assert monitor.latest is not None and monitor.latest.step == 3
    for layer, name in enumerate(monitor.index.names):
        w, b = model[int(name)].weight, model[int(name)].bias
        m_norm = math.sqrt(float(opt.state[w]["exp_avg"].double().pow(2).sum() + opt.state[b]["exp_avg"].double().pow(2).sum()))
        assert monitor.latest.exp_avg_norm[layer] == pytest.approx(m_norm, rel=1e-5)
        v_min = min(float(opt.state[w]["exp_avg_sq"].min()), float(opt.state[b]["exp_avg_sq"].min()))
        assert monitor.latest.exp_avg_sq_min[layer] == pytest.approx(v_min)
    assert not np.isnan(monitor.latest.underflow_fraction).any()


@pytest.mark.parametrize("shape", [(512, 512), (1000, 333), (4096, 64)])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7])
def test_large_state_underflow_is_estimated_from_a_strided_sample(shape: tuple[int, int], fraction: float) -> None:
    """Above UNDERFLOW_SAMPLE entries the count is an estimate: within 1 % of the entries of the exact count
    (itself made here by plain comparisons), whole columns of dead units included (a power-of-two row length
    must not make the sample read one column again and again); ‖m‖, the extremes of v and finiteness stay exact."""
    from nantrace.dynamics.optimizer_state import UNDERFLOW_SAMPLE

    g = torch.Generator().manual_seed(1)
    m = torch.randn(shape, generator=g) * 1e-3
    v = torch.rand(shape, generator=g) * 1e-6
    v[torch.rand(shape, generator=g) < fraction] = 1e-20  # underflowed second moments
    m[:, ::7] = 0  # dead units: m = 0, never counted
    v[:, ::7] = 0
    assert m.numel() > UNDERFLOW_SAMPLE
    threshold = 1e-16
    exact = int(((m != 0) & (v < threshold)).sum())
    got = tensor_state_stats(m, v, threshold).tolist()
    assert abs(got[3] - exact) <= 0.01 * m.numel()
    assert got[0] == pytest.approx(float(m.double().norm()), rel=1e-6)
    assert got[1] == float(v.max()) and got[2] == float(v.min()) and got[4] == 0
    v[-1, -1] = float("nan")
    assert tensor_state_stats(m, v, threshold).tolist()[4] > 0  # outside the sample: found all the same
