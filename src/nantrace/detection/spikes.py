"""Adaptive spike detection: a robust z-score (median / MAD) over a rolling window.

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

_MAD_TO_SIGMA = 1.4826


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
        if value > 0 and bool((hist > 0).all()):
            logs = np.log(hist)
            center = float(np.median(logs))
            mad = float(np.median(np.abs(logs - center)))
            z = (math.log(value) - center) / max(_MAD_TO_SIGMA * mad, 1e-12)
            median = math.exp(center)
            ratio = value / median
        else:
            median = float(np.median(hist))
            mad = float(np.median(np.abs(hist - median)))
            z = (value - median) / max(_MAD_TO_SIGMA * mad, 1e-12)
            ratio = 1.0 + (value - median) / max(abs(median), 1e-12)
        if z > self.sigma and ratio > self.min_ratio:
            return Spike(value=value, median=median, zscore=z, ratio=ratio, window=len(hist))
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "flagged_run": list(self._flagged_run)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(state["history"], maxlen=self.window)
        self._flagged_run = list(state["flagged_run"])
