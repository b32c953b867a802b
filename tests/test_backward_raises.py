"""An exception raised by ``backward()`` itself: autograd's engine stopped the backward on a value
(anomaly mode's check of a node's outputs, a gradient hook written to refuse NaN) before any gradient
was written. The step's loss and gradients are finite when it raises, so the diagnosis replays the
forward AND the backward (with the user's anomaly mode off for the replay) and names the op whose
derivative first went non-finite, as for a NaN gradient (``exception`` kind, ``backward_raised``
observed). A backward error that is not about a value (a graph freed by an earlier backward) is no
incident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 3


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # <origin:pair_sqrt>


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        self.distance = PairDistance()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.distance(self.encoder(a), self.encoder(b))


class Polar(nn.Module):
    """Turns (x, y) features into a radius: a hypot-like norm written by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 2)
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xy = self.proj(x)
        radius = xy.pow(2).sum(-1, keepdim=True).pow(0.5)  # <origin:radius_pow>
        return self.head(radius).squeeze(-1)


def _siamese_batch(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    if step == FAIL:
        b[5] = a[5]  # a duplicate pair: distance exactly 0
    margin = torch.ones(8)
    return a, b, margin


def _polar_batch(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    return x, y


def _anomaly_loop(model: nn.Module, loss_of: Callable[[nn.Module, Any], torch.Tensor], batch: Callable[[int], Any],
                  *, anomaly: bool) -> tuple[list[Any], list[str], list[torch.Tensor]]:
    """A loop that trains with anomaly mode on (as while hunting a NaN), catches the error the backward
    raises, logs it and goes on with the next batch."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    raised, before = [], None
    try:
        for step in range(FAIL + 2):
            opt.zero_grad()
            if step == FAIL:
                before = [p.detach().clone() for p in model.parameters()]
            try:
                with torch.autograd.set_detect_anomaly(anomaly):
                    loss = loss_of(model, batch(step))
                    loss.backward()
                opt.step()
            except RuntimeError as exc:
                raised.append(f"{step}: {str(exc).splitlines()[0]}")
    finally:
        guard.close()
    return guard.incidents, raised, before


def _refuse_nan(grad: torch.Tensor) -> None:
    if not torch.isfinite(grad).all():
        raise RuntimeError("gradient contains nan")


def _contrastive(model: nn.Module, batch: Any) -> torch.Tensor:
    a, b, margin = batch
    return F.relu(margin - model(a, b)).pow(2).mean()


def _regression(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


CASES = {
    # anomaly mode names PowBackward0 (0 * inf), the origin is sqrt's infinite derivative at 0
    "siamese_anomaly_mode": (Siamese, _contrastive, _siamese_batch, "pair_sqrt", "aten.sqrt.default", "distance"),
    # x ** 0.5 at 0: pow's derivative 0.5 * 0 ** -0.5 = inf
    "polar_anomaly_mode": (Polar, _regression, None, "radius_pow", "aten.pow.Tensor_Scalar", ""),  # root's forward: ""
}


def _polar_zero_batch(step: int) -> tuple[torch.Tensor, ...]:
    x, y = _polar_batch(step)
    return x, y


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_backward_stopped_by_anomaly_mode_is_localised_in_the_backward(name: str) -> None:
    make, loss_of, batch, tag, op, module = CASES[name]
    model = make()
    if batch is None:  # the polar model: a zero projection row makes the radius exactly 0 for every sample
        with torch.no_grad():
            model.proj.weight.zero_()
            model.proj.bias.zero_()
        batch = _polar_zero_batch
        fail = 0
    else:
        fail = FAIL
    incidents, raised, _ = _anomaly_loop(model, loss_of, batch, anomaly=True)
    assert raised and raised[0].startswith(f"{fail}: Function '") and "returned nan values" in raised[0]
    first = incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.cause, first.action) == \
        (fail, "exception", "backward", op, "grad_singularity", "raised")
    assert first.module == module
    assert points_at(first.source, __file__, tag)
    assert first.details["observed"] == "backward_raised"
    assert "backward() stopped with RuntimeError" in first.summary


def test_a_gradient_hook_refusing_nan_is_localised_like_anomaly_mode() -> None:
    incidents, raised, _ = _anomaly_loop(Siamese(), _contrastive, _siamese_batch, anomaly=False)
    # without anomaly mode and without a hook the step does not raise: the guard's own check blocks it
    assert not raised
    assert (incidents[0].step, incidents[0].kind, incidents[0].op, incidents[0].cause) == \
        (FAIL, "nonfinite_grad", "aten.sqrt.default", "grad_singularity")
    model = Siamese()
    for p in model.parameters():  # the user's own check, registered once: refuse a NaN gradient
        p.register_hook(_refuse_nan)
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        for step in range(FAIL + 1):
            opt.zero_grad()
            try:
                _contrastive(model, _siamese_batch(step)).backward()
                opt.step()
            except RuntimeError as exc:
                assert step == FAIL and str(exc) == "gradient contains nan"
    finally:
        guard.close()
    first = guard.incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause) == \
        (FAIL, "exception", "backward", "aten.sqrt.default", "distance", "grad_singularity")
    assert points_at(first.source, __file__, "pair_sqrt")


def test_a_backward_error_that_is_not_about_a_value_is_no_incident() -> None:
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        for step in range(3):
            opt.zero_grad()
            loss = _contrastive(model, _siamese_batch(step))
            loss.backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()  # a bug of the loop, not a value
            opt.step()
    finally:
        guard.close()
    assert guard.incidents == []
