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
import itertools
import math
import statistics
from collections import deque
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_MAD_TO_SIGMA = 1.4826
_LEVEL = 16  # recent values that define the current level
_Q99_TO_SIGMA = 2.576
_NOISE_EVERY = 8
"""The noise scale moves slowly: it is re-estimated after this many new healthy values (a
detector sees one value per step, and the estimate is the costliest part of a judgement)."""


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
        self._noise: tuple[bool, float] | None = None  # (log space?, scale) of the last estimate
        self._stale = 0  # healthy values added since that estimate
        self._nonpositive = 0  # values <= 0 in the history: the series is judged in log space when none
        self._recent_logs: deque[float] = deque(maxlen=min(_LEVEL, window))  # log of the last _LEVEL values (NaN if <= 0)
        self._threshold: float | None = None  # threshold() of the history as it is, until it changes

    def __len__(self) -> int:
        return len(self._history)

    def update(self, value: float) -> Spike | None:
        """Judge ``value`` against the history, then add it to the history if healthy."""
        if not math.isfinite(value):
            return None
        spike = self._judge(value)
        if spike is None:
            self._push(value)
            self._flagged_run.clear()
            self._stale += 1
            return None
        self._flagged_run.append(value)
        if len(self._flagged_run) >= max(4, self.window // 4):
            self._restart(self._flagged_run)
            self._flagged_run.clear()
        return spike

    def _push(self, value: float) -> None:
        """Add a value to the history, keeping the positivity count and the recent logarithms."""
        hist = self._history
        if len(hist) == hist.maxlen and hist[0] <= 0:
            self._nonpositive -= 1
        hist.append(value)
        if value <= 0:
            self._nonpositive += 1
        self._recent_logs.append(math.log(value) if value > 0 else math.nan)
        self._threshold = None

    def _restart(self, values: list[float]) -> None:
        """The history becomes ``values`` (the series moved to a new level, or a loaded state)."""
        self._history.clear()
        self._recent_logs.clear()
        self._nonpositive = 0
        for v in values:
            self._push(v)
        self._noise = None

    def threshold(self) -> float:
        """The value above which the next :meth:`update` flags a spike (``inf`` in warm-up).

        ``update(v)`` flags ``v`` exactly when ``v`` is finite and ``v > threshold()``, so the
        judgement can be made elsewhere (on the device, or by another rank from this number)
        and agree with this detector bit for bit.
        """
        if len(self._history) < self.warmup:
            return math.inf
        if self._threshold is not None:  # nothing was added since it was computed
            return self._threshold
        use_log = self._nonpositive == 0
        center, noise = self._level(use_log)
        if use_log:  # z > sigma and ratio > min_ratio, solved for the value
            threshold = max(math.exp(center + self.sigma * noise), self.min_ratio * math.exp(center))
        else:
            threshold = center + max(self.sigma * noise, (self.min_ratio - 1.0) * max(abs(center), 1e-12))
        self._threshold = threshold
        return threshold

    def _level(self, use_log: bool) -> tuple[float, float]:
        """(current level, noise scale) of the history, in log space when ``use_log``."""
        hist = self._history
        if use_log:
            recent = list(self._recent_logs)
        else:
            recent = list(itertools.islice(hist, len(hist) - _LEVEL, None))
        # Centre on the recent level; the noise is measured from each value's residual
        # against the level before it, so the run's own trend (a loss still falling fast)
        # does not inflate the scale.
        center = statistics.median(recent)
        if self._noise is None or self._noise[0] != use_log or self._stale >= _NOISE_EVERY:
            series = np.fromiter(hist, dtype=np.float64, count=len(hist))
            self._noise = (use_log, _noise_scale(np.log(series) if use_log else series))
            self._stale = 0
        return center, max(self._noise[1], 1e-12)

    def _judge(self, value: float) -> Spike | None:
        if not value > self.threshold():
            return None
        use_log = self._nonpositive == 0  # a value above a positive threshold is positive
        center, noise = self._level(use_log)
        x = math.log(value) if use_log else value
        z = (x - center) / noise
        if use_log:
            median = math.exp(center)
            ratio = value / median
        else:
            median = center
            ratio = 1.0 + (value - median) / max(abs(median), 1e-12)
        return Spike(value=value, median=median, zscore=z, ratio=ratio, window=len(self._history))

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "flagged_run": list(self._flagged_run)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(maxlen=self.window)
        self._restart(list(state["history"])[-self.window:])
        self._flagged_run = list(state["flagged_run"])


def _noise_scale(series: np.ndarray) -> float:
    """Gaussian-equivalent noise of ``series`` around its own rolling level.

    Each value is taken against the median of the values before it; the scale of those
    residuals is the larger of the MAD's and the 99th percentile's estimate (equal for normal
    noise; heavy-tailed noise, as with small batches or near-zero losses, widens the second).

    Computed from sorted copies (one sort of the level windows, two of the residuals): the same
    numbers as ``np.median`` and ``np.quantile``'s linear interpolation, bit for bit, at a fifth
    of their cost (``tests/test_spikes.py`` holds them side by side).
    """
    level = _median_of_sorted(np.sort(sliding_window_view(series[:-1], _LEVEL), axis=1))
    residuals = series[_LEVEL:] - level
    spread = np.sort(np.abs(residuals - _median_of_sorted(np.sort(residuals))))
    return max(_MAD_TO_SIGMA * float(_median_of_sorted(spread)), _quantile_of_sorted(spread, 0.99) / _Q99_TO_SIGMA)


def _median_of_sorted(s: np.ndarray) -> Any:
    """The median along the last axis of an array sorted along it (the mean of the middle two for an even count)."""
    n = s.shape[-1]
    half = n // 2
    return s[..., half] if n % 2 else (s[..., half - 1] + s[..., half]) / 2.0


def _quantile_of_sorted(s: np.ndarray, q: float) -> float:
    """The ``q`` quantile of a sorted vector by linear interpolation, in the form NumPy evaluates it."""
    n = s.shape[0]
    virtual = q * (n - 1)
    below = math.floor(virtual)
    gamma = virtual - below
    a, b = float(s[below]), float(s[min(below + 1, n - 1)])
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma
