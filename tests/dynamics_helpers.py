"""Small models, data and a training loop shared by the training-dynamics tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pytest

import nantrace

Batch = tuple[torch.Tensor, torch.Tensor]


_DYNAMICS_DEFAULTS = {f: getattr(nantrace.Config(), f) for f in (
    "layer_stats_every", "update_stats_every", "activation_stats_every", "optimizer_stats_every", "logit_stats_every",
    "early_warnings", "clip_stats")}


def quiet(**overrides: Any) -> nantrace.Config:
    """The guard's non-finite checks only (``minimal``: no spike detection, no replay captures,
    which these tests do not need and which cost most of a tiny model's step) with every
    training-dynamics statistic at its default; no console output; finite anomalies only logged."""
    values: dict[str, Any] = dict(_DYNAMICS_DEFAULTS, print_incidents=False, finite_anomaly_action="log",
                                  localise=False)
    values.update(overrides)
    return nantrace.Config.preset("minimal", **values)


def relu_mlp(seed: int = 0, width: int = 32, depth: int = 3, classes: int = 5) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def small_cnn(seed: int = 0, classes: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, classes),
    )


def classification_batches(seed: int = 0, classes: int = 5, batch: int = 32) -> Callable[[int], Batch]:
    """A noisy linear classification task in 16 dimensions."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, classes, generator=g)

    def make(step: int) -> Batch:
        x = torch.randn(batch, 16, generator=g)
        return x, (x @ w + 0.5 * torch.randn(batch, classes, generator=g)).argmax(1)

    return make


def image_batches(seed: int = 0, classes: int = 4, batch: int = 16) -> Callable[[int], Batch]:
    g = torch.Generator().manual_seed(seed)

    def make(step: int) -> Batch:
        y = torch.randint(0, classes, (batch,), generator=g)
        return torch.randn(batch, 3, 8, 8, generator=g) + 0.3 * y[:, None, None, None].float(), y

    return make


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Callable[[int], Batch], steps: int,
          config: nantrace.Config, *, run_dir: Any = None, before_step: Callable[[int], None] | None = None,
          clip: float | None = None, loss_scale: Callable[[int], float] | None = None,
          scheduler: Any = None, input_dtype: torch.dtype | None = None) -> nantrace.Guard:
    """A plain loop under watch(); returns the closed guard (a ``NonFiniteError`` ends the loop early)."""
    guard = nantrace.watch(model, optimizer, run_dir=run_dir, config=config)
    try:
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            x, y = batches(step)
            if input_dtype is not None:
                x = x.to(input_dtype)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            if loss_scale is not None:
                loss = loss * loss_scale(step)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            try:
                optimizer.step()
            except nantrace.NonFiniteError:
                break
            if scheduler is not None:
                scheduler.step()
    finally:
        guard.close()
    return guard


def kinds(guard: nantrace.Guard, exclude: tuple[str, ...] = ("loss_spike", "grad_explosion")) -> list[tuple[int, str]]:
    """(step, kind) of the guard's incidents, leaving out the guard's own spike findings."""
    return [(i.step, i.kind) for i in guard.incidents if i.kind not in exclude]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Imported by the dynamics test modules: every test there runs on one thread (conftest's ``one_thread``)."""
    yield


def monitor_hooks(module: nn.Module, guard: Any) -> int:
    """The forward hooks on ``module`` other than the guard's capture of calls to the model's parts
    (``StepRecorder.watch_parts``): the ones a monitor installed."""
    own = guard.recorder
    return sum(1 for h in module._forward_hooks.values() if getattr(getattr(h, "func", None), "__self__", None) is not own)
