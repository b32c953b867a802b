"""A bfloat16 rounding upstream of the failing op is ``precision_overflow`` when the step replayed
in float32 is finite (API.md), even though the op's own float64 recompute at its bfloat16 inputs
fails too: ``sigmoid(8)`` rounds to exactly 1 in bfloat16, so ``log(1 - p)`` is log 0 there and
in float64, but the float32 step never takes log 0 (``classify._fits_float32``). In zero-code mode
the failing code is the loss tape's: the whole step, forwards and tape, is replayed in float32
(``localiser._tape_low_precision``, ``replay_step(full_precision=True)``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nantrace

BAD_STEP = 3


def _bce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(model(x).squeeze(-1))
    return (-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).float().mean()  # origin: bce


def _batches(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    out = []
    for step in range(5):
        x, y = torch.randn(8, 8, generator=g), (torch.rand(8, generator=g) > 0.5).float()
        if step == BAD_STEP:  # examples the model is sure of: a bias-free ReLU net scaled to logit 8
            with torch.no_grad():
                base = torch.randn(64, 8, generator=g)
                logit = model(base).squeeze(-1)
                keep = logit > 0.05
                x, y = (base[keep] * (8.0 / logit[keep]).unsqueeze(-1))[:8], torch.zeros(8)
        out.append((x, y))
    return out


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_bf16_rounding_before_the_log_is_a_precision_overflow(one_thread, replayable):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 1, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = _batches(model)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(_bce) if replayable else _bce
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
        incidents = list(guard.incidents)
    (got,) = incidents
    assert (got.step, got.kind, got.op, got.module, got.cause, got.action) == (
        BAD_STEP, "nonfinite_loss", "aten.log.default", None, "precision_overflow", "skipped")
    assert got.details.get("float32_rerun_finite") is True
    # nothing overflowed: the summary says what rounded, not "overflowed bfloat16 (3.4e38 max)"
    assert "rounded in bfloat16" in got.summary and "overflowed" not in got.summary, got.summary


def _bce_own_autocast(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the step's own autocast, as a training_step opens it
        p = torch.sigmoid(model(x).squeeze(-1))
        return (-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).float().mean()


class _OwnAutocast(nn.Module):
    """A model whose forward opens its own bfloat16 autocast (and keeps the loss in it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.sigmoid(self.net(x).squeeze(-1))


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("where", ["loss_code", "model_forward"])
def test_an_autocast_opened_inside_the_replayed_code_is_held_off_in_the_float32_rerun(one_thread, where, replayable):
    """The float32 re-run turns off every autocast the replayed code opens itself, and leaves the
    user's autocast objects as they were (training after the incident still runs in bfloat16)."""
    torch.manual_seed(0)
    if where == "model_forward":
        model: nn.Module = _OwnAutocast()
        inner = model.net

        def loss_of(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            p = m(x)
            return (-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).float().mean()
    else:
        model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 1, bias=False))
        inner, loss_of = model, _bce_own_autocast
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = _batches(inner)
    dtypes = []
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(loss_of) if replayable else loss_of
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            with torch.no_grad():
                dtypes.append(inner(x).dtype if where == "loss_code" else model(x).dtype)
        incidents = list(guard.incidents)
    (got,) = incidents
    assert (got.step, got.kind, got.op, got.cause, got.action) == (
        BAD_STEP, "nonfinite_loss", "aten.log.default", "precision_overflow", "skipped")
    assert got.details.get("float32_rerun_finite") is True
    assert torch.is_autocast_enabled("cpu") is False
    if where == "model_forward":
        assert set(dtypes) == {torch.bfloat16}  # the model's own autocast still works after the re-run
