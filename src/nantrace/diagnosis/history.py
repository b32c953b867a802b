"""The run's own history as evidence: was the run diverging before it broke?

An op that overflows from finite inputs is almost always a symptom. When the loss (or the
gradient norm) had been growing multiplicatively for several steps before, the cause is the
divergence, not the op; the op and module stay as where it finally overflowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MIN_STEPS = 3
"""Consecutive growing steps needed to call a trend."""
MIN_RATIO = 10.0
"""Growth over the trend needed: an order of magnitude."""
NOISE = 1.1
"""A step may dip this much below the one after it and still count as part of the growth."""


@dataclasses.dataclass(frozen=True)
class Trend:
    series: str
    """``loss`` or ``grad_norm``."""
    start_step: int
    end_step: int
    start: float
    end: float

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step

    @property
    def per_step(self) -> float:
        return (self.end / self.start) ** (1 / self.steps) if self.steps and self.start > 0 else math.inf

    @property
    def cause(self) -> str:
        return "loss_divergence" if self.series == "loss" else "gradient_explosion"

    def describe(self) -> str:
        what = "the loss" if self.series == "loss" else "the gradient norm"
        if self.steps <= 0:  # the live detector's evidence carries no end step
            return f"the run was diverging: {what} grew {self.start:.3g} → {self.end:.3g} since step {self.start_step}"
        return (f"the run was diverging: {what} grew {self.start:.3g} → {self.end:.3g} over {self.steps} steps "
                f"(×{self.per_step:.2g} per step since step {self.start_step})")

    def to_dict(self) -> dict[str, Any]:
        return {"series": self.series, "start_step": self.start_step, "end_step": self.end_step,
                "start": self.start, "end": self.end, "per_step": self.per_step}


def growth(steps: list[int], values: list[float], series: str) -> Trend | None:
    """The trailing multiplicative growth of a positive series, if it is a real trend."""
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v) and v > 0]
    if len(pairs) < MIN_STEPS + 1:
        return None
    i = len(pairs) - 1
    while i > 0 and pairs[i - 1][1] <= pairs[i][1] * NOISE:
        i -= 1
    # the trend starts at its lowest point, not at an earlier, higher noisy value
    low = min(range(i, len(pairs)), key=lambda k: pairs[k][1])
    start, end = pairs[low], pairs[-1]
    if len(pairs) - 1 - low < MIN_STEPS or end[1] / start[1] < MIN_RATIO:
        return None
    return Trend(series, start[0], end[0], start[1], end[1])


def divergence(history: list[dict[str, Any]]) -> Trend | None:
    """The divergence the recorded steps show (loss first, or the gradient norm when it led)."""
    rows = [r for r in history if not r.get("skipped")]
    steps = [int(r.get("step", i)) for i, r in enumerate(rows)]
    loss = growth(steps, [r.get("loss") for r in rows], "loss")
    grad = growth(steps, [r.get("grad_norm") for r in rows], "grad_norm")
    if loss is not None and (grad is None or loss.start_step <= grad.start_step):
        return loss
    return grad
