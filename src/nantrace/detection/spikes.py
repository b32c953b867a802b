"""Adaptive spike detection: a robust z-score over a rolling window.

Each value is compared with the median of the values just before it (the current level);
the scale is measured on exactly that residual over the window (MAD, widened by its 99th
percentile when the noise is heavy-tailed), so the threshold is calibrated on the
statistic it tests and a run's own trend does not inflate it.

Used for loss spikes and gradient-norm explosions. Positive series are compared in log
space, so a spike is judged by its *ratio* to the recent median, which is what matters
for losses and norms whose scale drifts over a run.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_MAD_TO_SIGMA = 1.4826
_LEVEL = 16  # recent values that define the current level
_Q99_TO_SIGMA = 2.576


@dataclasses.dataclass(frozen=True)
class Spike:
    """A value flagged as a spike, with the statistics it was judged against."""

    value: float
    median: float
    zscore: float
    ratio: float
    window: int


class RobustSpikeDetector:
    """Flags upward outliers of a series against its own recent history.

    A value is a spike when its robust z-score exceeds ``sigma`` *and* it exceeds the
    rolling median by ``min_ratio`` (the ratio guards a window whose MAD is nearly zero).
    Flagged values are kept out of the history, so one spike does not hide the next;
    if flags persist for a quarter of the window, the series has moved to a new level
    and the history restarts from there.
    """

    def __init__(self, *, window: int, warmup: int, sigma: float, min_ratio: float) -> None:
        self.window = window
        self.warmup = warmup
        self.sigma = sigma
        self.min_ratio = min_ratio
        self._history: deque[float] = deque(maxlen=window)
        self._flagged_run: list[float] = []

    def __len__(self) -> int:
        return len(self._history)

    def update(self, value: float) -> Spike | None:
        """Judge ``value`` against the history, then add it to the history if healthy."""
        if not math.isfinite(value):
            return None
        spike = self._judge(value)
        if spike is None:
            self._history.append(value)
            self._flagged_run.clear()
            return None
        self._flagged_run.append(value)
        if len(self._flagged_run) >= max(4, self.window // 4):
            self._history.clear()
            self._history.extend(self._flagged_run)
            self._flagged_run.clear()
        return spike

    def _judge(self, value: float) -> Spike | None:
        if len(self._history) < self.warmup:
            return None
        hist = np.fromiter(self._history, dtype=np.float64, count=len(self._history))
        use_log = value > 0 and bool((hist > 0).all())
        series = np.log(hist) if use_log else hist
        x = math.log(value) if use_log else value
        # Centre on the recent level and measure noise from step-to-step differences, so the
        # run's own trend (a loss still falling fast) does not inflate the scale.
        center = float(np.median(series[-_LEVEL:]))
        level = np.median(sliding_window_view(series[:-1], _LEVEL), axis=1)
        residuals = series[_LEVEL:] - level  # each value against the level of the values before it
        spread = np.abs(residuals - np.median(residuals))
        # Gaussian-equivalent sigma from the MAD and from the 99th percentile: equal for normal
        # noise; heavy-tailed noise (small batches, near-zero losses) widens the second.
        noise = max(_MAD_TO_SIGMA * float(np.median(spread)), float(np.quantile(spread, 0.99)) / _Q99_TO_SIGMA)
        z = (x - center) / max(noise, 1e-12)
        if use_log:
            median = math.exp(center)
            ratio = value / median
        else:
            median = center
            ratio = 1.0 + (value - median) / max(abs(median), 1e-12)
        if z > self.sigma and ratio > self.min_ratio:
            return Spike(value=value, median=median, zscore=z, ratio=ratio, window=len(hist))
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "flagged_run": list(self._flagged_run)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(state["history"], maxlen=self.window)
        self._flagged_run = list(state["flagged_run"])
