"""Small real training runs for the divergence detector and the escalation ladder: healthy
ones (noisy, heavy-tailed, falling fast early) that must raise no alarm, and diverging ones
(a warm-up to a peak learning rate several times too high) that must be caught early.

Usage::

    from divergence_runs import RUNS, train
    result = train(RUNS["mlp_warmup_too_high"], guard_kwargs={...})   # or guard_kwargs=None: no nantrace
    result.losses, result.first_nonfinite, result.guard
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nantrace


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    build: Callable[[int], tuple[nn.Module, Callable[[int], tuple[Any, Any]], Callable[..., torch.Tensor]]]
    optimizer: str
    peak_lr: float
    warmup: int
    steps: int
    healthy: bool
    clip: float | None = None


@dataclasses.dataclass
class Result:
    losses: list[float]
    grad_norms: list[float]
    lrs: list[float]
    first_nonfinite: int | None
    guard: Any
    error: BaseException | None
    applied: list[bool]


def _mlp_regression(seed: int, *, noise: str = "normal", batch: int = 32, target_scale: float = 1.0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    w = torch.randn(16, 1, generator=g)

    def batch_at(step: int):
        x = torch.randn(batch, 16, generator=g)
        if noise == "student_t":  # heavy-tailed targets: a few samples dominate a small batch's loss
            eps = torch.distributions.StudentT(1.5).sample((batch, 1))
        else:
            eps = torch.randn(batch, 1, generator=g)
        return x, target_scale * (torch.tanh(x @ w) + 0.1 * eps)

    return model, batch_at, F.mse_loss


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).flatten(1))


def _relu_classifier(seed: int):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    centers = 2 * torch.randn(10, 20, generator=g)

    def batch_at(step: int):
        y = torch.randint(0, 10, (32,), generator=g)
        return centers[y] + torch.randn(32, 20, generator=g), y

    return model, batch_at, F.cross_entropy


def _cnn(seed: int):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = _CNN()
    protos = torch.randn(4, 3, 8, 8, generator=g)

    def batch_at(step: int):
        y = torch.randint(0, 4, (8,), generator=g)
        return protos[y] + torch.randn(8, 3, 8, 8, generator=g), y

    return model, batch_at, F.cross_entropy


def _transformer(seed: int):
    from nantrace.demo.data import make_batch
    from nantrace.demo.model import DemoTransformer

    torch.manual_seed(seed)
    model = DemoTransformer(dim=32, layers=1)
    return model, (lambda step: make_batch(step + 10_000 * seed, batch=8)), F.cross_entropy


class _CharLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


def _char_lm(seed: int):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = _CharLM()
    table = torch.randint(0, 32, (32,), generator=g)  # a noisy deterministic successor: learnable, never perfect

    def batch_at(step: int):
        start = torch.randint(0, 32, (4, 1), generator=g)
        seq = [start]
        for _ in range(16):
            nxt = table[seq[-1]]
            flip = torch.rand(nxt.shape, generator=g) < 0.3
            seq.append(torch.where(flip, torch.randint(0, 32, nxt.shape, generator=g), nxt))
        s = torch.cat(seq, 1)
        return s[:, :-1], s[:, 1:]

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, batch_at, loss_fn


RUNS: dict[str, Run] = {r.name: r for r in (
    # healthy
    Run("mlp_sgd", lambda s: _mlp_regression(s), "sgd", 0.05, 20, 300, True),
    Run("mlp_heavy_tailed", lambda s: _mlp_regression(s, noise="student_t", batch=4), "adam", 3e-3, 0, 300, True),
    Run("mlp_fast_fall", lambda s: _mlp_regression(s, target_scale=30.0), "adam", 1e-2, 0, 300, True),
    Run("cnn_adam", _cnn, "adam", 3e-3, 0, 300, True),
    Run("relu_sgd_warmup", _relu_classifier, "sgd", 0.03, 40, 300, True),
    Run("transformer_warmup", _transformer, "adam", 3e-3, 30, 300, True),
    Run("char_lm", _char_lm, "adam", 1e-2, 10, 300, True),
    # diverging: a warm-up to a peak learning rate several times too high
    Run("mlp_warmup_too_high", lambda s: _mlp_regression(s), "sgd", 0.4, 50, 120, False),
    # peak 2.0: at 1.0-1.5 some seeds collapse to dead ReLUs instead of diverging, depending on the
    # CPU's kernels (seed 1 diverged on one machine and not on another)
    Run("relu_warmup_too_high", _relu_classifier, "sgd", 2.0, 40, 120, False),
)}


def _optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
    if run.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=run.peak_lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=run.peak_lr)


def lr_at(run: Run, step: int) -> float:
    return run.peak_lr * min(1.0, (step + 1) / run.warmup) if run.warmup else run.peak_lr


def train(run: Run, *, seed: int = 0, guard_kwargs: dict[str, Any] | None = None, steps: int | None = None) -> Result:
    """Train ``run``; with ``guard_kwargs`` under ``nantrace.watch(model, optimizer, **guard_kwargs)``.

    Stops at the first non-finite loss when there is no guard, or when the guard raises.
    """
    model, batch_at, loss_fn = run.build(seed)
    opt = _optimizer(run, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(run, s) / run.peak_lr)
    guard = nantrace.watch(model, opt, **guard_kwargs) if guard_kwargs is not None else None
    losses: list[float] = []
    norms: list[float] = []
    lrs: list[float] = []
    applied: list[bool] = []
    first_nonfinite = None
    error = None
    try:
        for step in range(steps or run.steps):
            x, y = batch_at(step)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)))
            losses.append(float(loss.detach()))
            lrs.append(opt.param_groups[0]["lr"])
            if not math.isfinite(losses[-1]) and first_nonfinite is None:
                first_nonfinite = step
                if guard is None:
                    break
            before = [p.detach().clone() for p in model.parameters()][:1]
            opt.step()
            applied.append(not torch.equal(before[0], next(iter(model.parameters())).detach()))
            sched.step()
    except nantrace.NonFiniteError as exc:
        error = exc
    finally:
        if guard is not None:
            guard.close()
    return Result(losses, norms, lrs, first_nonfinite, guard, error, applied)
