"""Training dynamics: health statistics sampled during training and the early warnings
derived from them (layer norms, update ratios, activations, optimizer state, learning-rate
schedule, clipping, logit saturation). Each monitor computes; the guard stores and reports.

Usage::

    guard = nantrace.watch(model, optimizer, run_dir="runs/exp1",
                           config=nantrace.Config(dynamics={"lr_schedule": {"peak_lr": 3e-4, "warmup_steps": 200,
                                                               "decay": "cosine", "total_steps": 10_000}}))
    ...                                     # training; warnings arrive as incidents (action "logged")
    nantrace.dynamics.summary(guard)
    # {'layers': {...}, 'clipping': {'fraction_clipped': 0.03, 'suggested_max_norm': 1.8, ...}, ...}

See ``docs/dynamics.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..taxonomy import EARLY_WARNING_CAUSES, EARLY_WARNING_KINDS
from .base import Monitor, Signal, StepContext

if TYPE_CHECKING:
    from ..guard import Guard

__all__ = ["DYNAMICS_CAUSES", "DYNAMICS_KINDS", "Monitor", "Signal", "StepContext", "summary"]

DYNAMICS_KINDS = EARLY_WARNING_KINDS
"""Incident kinds that only the training-dynamics monitors report (always with action ``logged``);
they also report ``optimizer_state``, a kind the guard uses too."""

DYNAMICS_CAUSES = EARLY_WARNING_CAUSES
"""Cause codes that only the training-dynamics monitors use (early warnings, nothing non-finite yet)."""


def summary(guard: "Guard") -> dict[str, Any]:
    """What the guard's training-dynamics monitors measured so far, as plain data, by monitor."""
    out: dict[str, Any] = {}
    for monitor in getattr(guard, "monitors", []):
        key = getattr(monitor, "summary_key", None)
        get = getattr(monitor, "summary", None)
        if key is not None and callable(get):
            out[key] = get()
    return out
