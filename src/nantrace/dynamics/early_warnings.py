"""Early warnings from per-layer figures: the trends that come before a NaN.

Three judgements, each against the run's own history (never a fixed magic number alone),
each reported once per layer:

- ``grad_growth``: a layer's gradient/weight ratio ‖g‖/‖θ‖ rose by ``growth_factor`` over
  its own (lagged) median and is still rising: gradients are heading for an explosion.
- ``update_ratio``: a layer's update/parameter ratio ‖Δθ‖/‖θ‖ stayed above
  ``update_ratio_max`` for ``sustain_steps`` steps: the learning rate is too high for it.
- ``vanishing_gradient``: a layer's gradient fell ``vanish_decades`` orders of magnitude
  relative to the other layers (so a run that converges, where every gradient shrinks,
  is not flagged), or is exactly zero while other layers still learn.

History is kept in blocks: recent samples as they came, older ones as block medians, so a
long run costs a bounded amount of memory and a judgement a few small numpy reductions,
made every ``check_every`` samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from .base import Signal

__all__ = ["LayerWarnings", "WarningSettings"]


@dataclasses.dataclass(frozen=True)
class WarningSettings:
    """Thresholds of the layer warnings (the defaults are what ``Config`` gives)."""

    warmup: int = 100
    """Steps before anything is judged (samples from earlier steps are not kept)."""
    update_ratio_max: float = 0.1
    """Update/parameter ratio above which a layer's updates are too large."""
    sustain_steps: int = 50
    """A condition must hold over at least this many steps ..."""
    sustain_samples: int = 3
    """... and this many consecutive samples before it is reported."""
    growth_factor: float = 10.0
    """Growth of the gradient/weight ratio over its own median history that is reported."""
    vanish_decades: float = 3.0
    """Orders of magnitude a layer's relative gradient must fall to be called vanishing."""
    recent: int = 16
    """Samples that form the current level."""
    block: int = 16
    """Samples summarised by one history block median."""
    history_blocks: int = 128
    """Block medians kept (older ones are dropped)."""
    check_every: int = 16
    """Judge the gradient trends every this many samples (the update ratio on every sample)."""


class LayerWarnings:
    """Judges per-layer gradient/weight and update/parameter ratios; returns :class:`Signal`s.

    Usage::

        warnings = LayerWarnings(["body.0", "body.2", "head"], WarningSettings())
        signals = warnings.observe_norms(step, grad_norms, param_norms)   # per-layer arrays
        signals += warnings.observe_update_ratio(step, ratios)
    """

    def __init__(self, layer_names: Sequence[str], settings: WarningSettings) -> None:
        self.names = list(layer_names)
        self.settings = settings
        n = len(self.names)
        self._recent: deque[tuple[int, np.ndarray]] = deque(
            maxlen=max(settings.recent, settings.sustain_steps + 1, settings.sustain_samples + 1))
        self._block: list[np.ndarray] = []
        self._history_log: deque[np.ndarray] = deque(maxlen=settings.history_blocks)
        self._history_score: deque[np.ndarray] = deque(maxlen=settings.history_blocks)
        n_layers = len(self.names)
        self._baseline_log = np.full(n_layers, np.nan)  # lagged medians, refreshed when a block completes
        self._baseline_score = np.full(n_layers, np.nan)
        self._samples = 0
        self._above_since: list[int | None] = [None] * n
        self._above_count = np.zeros(n, dtype=np.int64)
        self._above_max = np.zeros(n)
        self._fired: set[tuple[str, int]] = set()

    # ----------------------------------------------------------------- inputs
    def observe_norms(self, step: int, grad: np.ndarray, param: np.ndarray) -> list[Signal]:
        """One sample of per-layer gradient and parameter norms (NaN where a layer is absent)."""
        return self.observe_many([step], grad[None, :], param[None, :])

    def observe_many(self, steps: Sequence[int], grad: np.ndarray, param: np.ndarray) -> list[Signal]:
        """Samples of several steps at once, in order (rows of ``grad``/``param``, one per step): the
        same judgements as one :meth:`observe_norms` per row, from one pass of array arithmetic."""
        if len(self.names) == 0 or not len(steps):
            return []
        usable = np.isfinite(grad) & np.isfinite(param) & (param > 0)
        ratio = np.divide(grad, param, out=np.full(grad.shape, np.nan), where=usable)
        log_r = np.full(grad.shape, -np.inf)
        np.log10(ratio, out=log_r, where=ratio > 0)  # exactly zero gradient -> -inf
        log_r[~usable] = np.nan
        skip = np.isinf(grad).any(axis=1)  # a non-finite step is the guard's business, not a trend
        signals: list[Signal] = []
        for i, step in enumerate(steps):
            if step >= self.settings.warmup and not skip[i]:
                signals += self._sample(step, log_r[i])
        return signals

    def samples_to_next_judgement(self) -> int:
        """How many more samples until one completes a block or is judged (a caller that batches
        samples flushes there, so that every judgement happens at the step of its own sample)."""
        s = self.settings
        to_block = max(s.block - len(self._block), 1)
        to_judge = (s.check_every // 2 - self._samples) % s.check_every or s.check_every
        return min(to_block, to_judge)

    def _sample(self, step: int, log_r: np.ndarray) -> list[Signal]:
        self._recent.append((step, log_r))
        self._block.append(log_r)
        if len(self._block) >= self.settings.block:
            block = np.stack(self._block)
            self._history_log.append(_nanmedian(block))
            self._history_score.append(_nanmedian(_scores(block)))
            self._block.clear()
            if len(self._history_log) >= 3:  # the history without its last two blocks: the level before
                lagged = list(self._history_log)[:-2]
                self._baseline_log = _nanmedian(np.stack(lagged))
                self._baseline_score = _nanmedian(np.stack(list(self._history_score)[:-2]))
        self._samples += 1
        every = self.settings.check_every
        if self._samples % every != every // 2:  # half-way between block ends: the recent level is not a block median
            return []
        return self._judge_growth() + self._judge_vanishing()

    def observe_update_ratio(self, step: int, ratio: np.ndarray) -> list[Signal]:
        """One sample of per-layer update/parameter ratios (NaN where unknown)."""
        s = self.settings
        if step < s.warmup:
            return []
        high = np.isfinite(ratio) & (ratio > s.update_ratio_max)
        hits = []
        for layer in range(len(self.names)):
            if not high[layer]:
                self._above_since[layer] = None
                self._above_count[layer] = 0
                self._above_max[layer] = 0.0
                continue
            if self._above_since[layer] is None:
                self._above_since[layer] = step
            self._above_count[layer] += 1
            self._above_max[layer] = max(self._above_max[layer], float(ratio[layer]))
            since = self._above_since[layer]
            assert since is not None
            if (self._above_count[layer] >= s.sustain_samples and step - since >= s.sustain_steps
                    and ("update_ratio", layer) not in self._fired):
                hits.append(layer)
        if not hits:
            return []
        for layer in hits:
            self._fired.add(("update_ratio", layer))
        worst = max(hits, key=lambda i: float(ratio[i]))
        since = self._above_since[worst]
        others = [self.names[i] for i in hits if i != worst]
        also = f"; also {_names(others)}" if others else ""
        return [Signal(
            kind="update_ratio", cause="update_too_large", phase="optimizer", module=self.names[worst],
            summary=(f"Layer {_q(self.names[worst])} has been updated by {float(ratio[worst]):.2g}× its own norm per step "
                     f"since step {since} (‖Δθ‖/‖θ‖ above {s.update_ratio_max:g} for {step - since} steps; healthy "
                     f"training keeps it near 1e-3){also}."),
            fix=("Lower the learning rate (or this layer's param-group LR), lengthen warmup, or check that the LR "
                 "scheduler is stepped as intended; updates this large make the loss spike and then turn NaN."),
            details={"layers": [self.names[i] for i in hits], "update_ratio": {self.names[i]: float(ratio[i]) for i in hits},
                     "since_step": since, "threshold": s.update_ratio_max},
        )]

    # -------------------------------------------------------------- judgements
    def _judge_growth(self) -> list[Signal]:
        s = self.settings
        if len(self._history_log) < 4 or len(self._recent) < s.recent:
            return []
        baseline = self._baseline_log
        current = _nanmedian(np.stack([r[1] for r in list(self._recent)[-s.recent:]]))
        last = np.stack(list(self._history_log)[-3:])
        with np.errstate(invalid="ignore"):
            rising = (np.diff(last, axis=0) > 0).all(axis=0) & (current >= last[-1])
            grew = (current - baseline) >= math.log10(s.growth_factor)
        hits = [i for i in np.flatnonzero(rising & grew & np.isfinite(current) & np.isfinite(baseline))
                if ("grad_growth", int(i)) not in self._fired]
        if not hits:
            return []
        for i in hits:
            self._fired.add(("grad_growth", int(i)))
        worst = max(hits, key=lambda i: float(current[i] - baseline[i]))
        factor = 10 ** float(current[worst] - baseline[worst])
        others = [self.names[i] for i in hits if i != worst]
        also = f"; also {_names(others)}" if others else ""
        return [Signal(
            kind="grad_growth", cause="gradient_explosion", phase="backward", module=self.names[worst],
            summary=(f"The gradient/weight ratio ‖g‖/‖θ‖ of layer {_q(self.names[worst])} grew {factor:.3g}× over its own "
                     f"history (now {10 ** float(current[worst]):.3g}, median before {10 ** float(baseline[worst]):.3g}) "
                     f"and is still rising: gradients are heading for an explosion{also}."),
            fix=("Lower the learning rate or lengthen warmup, clip gradients (torch.nn.utils.clip_grad_norm_), and check "
                 "the initialisation and normalisation of this layer; nantrace will block the first non-finite update."),
            details={"layers": [self.names[int(i)] for i in hits],
                     "growth": {self.names[int(i)]: 10 ** float(current[i] - baseline[i]) for i in hits},
                     "ratio_now": float(10 ** float(current[worst])), "ratio_before": float(10 ** float(baseline[worst]))},
        )]

    def _judge_vanishing(self) -> list[Signal]:
        s = self.settings
        if not self._recent:
            return []
        last = self._recent[-1][0]
        if self._recent[0][0] > last - s.sustain_steps:
            return []  # the window of the last sustain_steps steps is not fully covered yet
        window = [r for r in self._recent if r[0] >= last - s.sustain_steps]
        if len(window) < s.sustain_samples:
            return []
        steps = [r[0] for r in window]
        log_r = np.stack([r[1] for r in window])
        scores = _scores(log_r)
        learning = np.isfinite(log_r).any(axis=1)  # some layer still has a finite, non-zero ratio
        dead = (log_r == -np.inf).all(axis=0) & bool(learning.all())
        collapsed = np.zeros(len(self.names), dtype=bool)
        baseline = np.full(len(self.names), np.nan)
        if len(self._history_score) >= 3:
            baseline = self._baseline_score
            with np.errstate(invalid="ignore"):
                worst_recent = np.max(np.where(np.isnan(scores), np.inf, scores), axis=0)
                collapsed = np.isfinite(baseline) & (worst_recent < baseline - s.vanish_decades)
        hits = [int(i) for i in np.flatnonzero(dead | collapsed) if ("vanishing_gradient", int(i)) not in self._fired]
        if not hits:
            return []
        for i in hits:
            self._fired.add(("vanishing_gradient", i))
        first = hits[0]
        others = [self.names[i] for i in hits[1:]]
        also = f"; also {_names(others)}" if others else ""
        if dead[first]:
            what = (f"Layer {_q(self.names[first])} has received exactly zero gradient since step {steps[0]} or earlier "
                    f"while other layers still learn")
        else:
            drop = float(baseline[first] - np.max(scores[:, first]))
            what = (f"The gradient of layer {_q(self.names[first])} collapsed {10 ** drop:.1e}× relative to the other "
                    f"layers (against its own history) since step {steps[0]} or earlier")
        return [Signal(
            kind="vanishing_gradient", cause="vanishing_gradient", phase="backward", module=self.names[first],
            summary=f"{what}: the layer has stopped learning{also}.",
            fix=("Look for dead ReLUs on the path to this layer (a large negative bias, an LR spike) or saturated "
                 "sigmoid/tanh: use LeakyReLU/GELU, normalisation or residual connections, re-initialise the layer, or "
                 "lower the learning rate; a detached tensor (.detach(), .data, torch.no_grad) also cuts the gradient."),
            details={"layers": [self.names[i] for i in hits], "zero_gradient": [self.names[i] for i in hits if dead[i]],
                     "since_step": steps[0]},
        )]


def _scores(log_r: np.ndarray) -> np.ndarray:
    """Each layer's log ratio relative to the 90th percentile over the layers of the same sample.

    Exactly-zero gradients (``-inf``) and absent layers (NaN) are left out of the percentile
    (the lower of the two neighbouring ranks: a sort per row, much cheaper than
    ``np.nanquantile``); zero gradients keep score ``-inf``.
    """
    finite = np.isfinite(log_r)
    ordered = np.sort(np.where(finite, log_r, -np.inf), axis=1)  # non-finite first, then the finite values
    k = finite.sum(axis=1)
    width = log_r.shape[1]
    position = np.clip(width - k + np.floor(0.9 * np.maximum(k - 1, 0)).astype(np.int64), 0, width - 1)
    top = np.where(k > 0, ordered[np.arange(log_r.shape[0]), position], np.nan)
    with np.errstate(invalid="ignore"):
        return log_r - top[:, None]


def _nanmedian(a: np.ndarray) -> np.ndarray:
    """Column medians ignoring NaN (NaN for an all-NaN column), by one sort: ``np.nanmedian``
    goes through masked arrays and costs ten times more on these small blocks."""
    if a.shape[0] == 0:
        return np.full(a.shape[1:], np.nan)
    ordered = np.sort(a, axis=0)  # NaN sort last, -inf first
    count = (~np.isnan(a)).sum(axis=0)
    columns = np.arange(a.shape[1])
    low = ordered[np.clip((count - 1) // 2, 0, None), columns]
    high = ordered[np.clip(count // 2, 0, a.shape[0] - 1), columns]
    with np.errstate(invalid="ignore"):
        out = np.where(count % 2 == 1, low, (low + high) / 2)
    return np.where(count > 0, out, np.nan)


def _q(name: str) -> str:
    return repr(name) if name else "'' (the model's own parameters)"


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(_q(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
