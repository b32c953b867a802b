"""Divergence detection from the first step: growth judged by its rate, not by its size.

A run whose learning rate (or warm-up) is too high does not spike once: its loss and
gradient norm grow by a roughly constant factor per step until something overflows. The
robust z-score of :mod:`.spikes` needs a window of history before it can judge; this
detector needs none. It watches each positive series for *consecutive multiplicative
growth*: a run of ``min_steps`` or more increases in a row whose total factor is at least
``min_factor`` (one increase fewer when the factor is at least ``min_factor**3``: a growth
that steep leaves no time to wait) and whose logarithm is well fitted by a straight line (an exponential,
R² >= 0.8) or speeds up (a super-exponential growth, whose log is convex: the last three log-increases
do not shrink, and the run had already grown ``min_factor``-fold before its last value), and which has
reached a new high against the series' own recent past. When the series has history, the growth must
also stand out from its step-to-step noise.

Why these conditions give no false alarm on healthy runs: a healthy loss falls or
fluctuates; four increases in a row of a noisy series are rare (1 in 120 for independent
noise), and when they happen their total stays within the noise, or one heavy-tailed
value makes most of it (a spike, badly fitted by an exponential, and no acceleration either:
the rise before it was small, or the value after it rises less), or it does not exceed what the
run has already seen. A gradient norm, on the other hand, legitimately grows
for many steps early in training while the loss falls fast; so the gradient norm alone
counts only once the loss has a history and is not falling (at or above its recent median).
When both grow, the cause is ``gradient_explosion`` if the norm began growing first.

Once a divergence is flagged the detector stays in that state while the series remains
above its pre-growth level by ``sqrt(min_factor)``: every such step is reported again
(``continuing``), so a skipped update does not make the divergence look healed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque

import torch

__all__ = ["Divergence", "DivergenceDetector", "DivergenceRanges", "Growth", "GrowthTracker"]

_MIN_R2 = 0.8
"""An exponential must explain this much of the run's log-variance (a lone spike does not)."""
_NOISE_Z = 4.0
"""With history, the run's log-growth must exceed this many noise sigmas (scaled by sqrt(steps))."""
_NOISE_MIN_DIFFS = 16
_MAD_TO_SIGMA = 1.4826
_LEVEL_WINDOW = 32
"""How many recent healthy values the level of a short history is the median of."""


@dataclasses.dataclass(frozen=True)
class Growth:
    """A run of consecutive growth of one series."""

    series: str
    since_step: int
    """The step whose value the growth started from (the last value before the first increase)."""
    steps: int
    """Increases in a row."""
    start_value: float
    value: float
    factor: float
    """``value / start_value``."""
    per_step: float
    """Growth factor per step of the fitted exponential."""
    r2: float
    accelerating: bool = False
    """Accepted because it speeds up (super-exponential), not because an exponential fits it."""


class GrowthTracker:
    """Consecutive multiplicative growth of one positive series (loss or gradient norm)."""

    def __init__(self, series: str, *, min_steps: int, min_factor: float, history: int = 128) -> None:
        self.series = series
        self.min_steps = min_steps
        self.min_factor = min_factor
        self._past: deque[tuple[int, float]] = deque(maxlen=history)
        """Healthy (step, value) pairs before the current run, for the new-high and noise tests."""
        self._run: list[tuple[int, float]] = []
        self._sums = _LogSums()
        """Running sums of the run's log-values: its fit costs the same at its 5th value and its 500th
        (a smooth series, e.g. a gradient norm rising through a long warm-up, makes long runs)."""
        self._flagged_from: float | None = None
        """While diverged: the value the flagged growth started from."""

    @property
    def diverged(self) -> bool:
        return self._flagged_from is not None

    def value_at(self, step: int) -> float | None:
        """The value recorded at ``step`` if it is still remembered."""
        for s, v in reversed(self._run):
            if s == step:
                return v
        for s, v in reversed(self._past):
            if s == step:
                return v
        return None

    def latest(self) -> float | None:
        return self._run[-1][1] if self._run else (self._past[-1][1] if self._past else None)

    def update(self, step: int, value: float | None) -> Growth | None:
        """Add this step's value; the growth when the series is diverging (or still diverged)."""
        if value is None or not math.isfinite(value) or value <= 0:
            self._end_run()
            return None
        if self._flagged_from is not None:
            if value >= self._flagged_from * math.sqrt(self.min_factor):
                self._extend(step, value)
                return self._growth()
            self._flagged_from = None  # back near its level: the episode is over, judge afresh
            self._run = []
            self._sums = _LogSums()
        if self._run and value > self._run[-1][1]:
            self._extend(step, value)
        else:
            self._end_run()
            self._extend(step, value)
        growth = self._judge()
        if growth is not None:
            self._flagged_from = growth.start_value
        return growth

    def firing_ranges(self) -> list[tuple[float, float]]:
        """The values ``v`` for which the next :meth:`update` reports a growth, as closed
        intervals ``[lo, hi]`` (empty: no value can), computed from the state alone.

        So the verdict on the next value can be reached where that value lives (on the device,
        without reading it): ``update(step, v)`` returns a growth exactly when ``v`` lies in
        one of the intervals (up to rounding at their ends). Each condition of :meth:`_judge`
        is a bound on ``v``, except the fit, R² >= 0.8, which is a quadratic inequality in
        ``log v`` (the slope's covariance is linear in it, the variance quadratic).
        """
        if self._flagged_from is not None:  # still diverged while above the pre-growth level
            return [(self._flagged_from * math.sqrt(self.min_factor), math.inf)]
        run = self._run
        k = len(run)  # entries before the next value; it becomes increase number k
        if k == 0 or k < max(2, self.min_steps - 1):
            return []
        v0 = run[0][1]
        lows = [math.nextafter(run[-1][1], math.inf), v0 * self.min_factor]
        if k < self.min_steps:
            lows.append(v0 * self.min_factor ** 3)
        if self._past:
            lows.append(math.nextafter(max(v for _, v in self._past), math.inf))
        sigma = self._noise()
        if sigma is not None:
            lows.append(v0 * math.exp(_NOISE_Z * sigma * math.sqrt(k)))
        elif self._past and k < self.min_steps:
            lows.append(self._level() * self.min_factor ** 3)  # type: ignore[operator]
        low = math.log(max(lows))
        ranges = [(math.exp(max(a, low)), math.exp(b)) for a, b in self._sums.r2_intervals() if b >= low]
        speeding = self._speeding_from()
        if speeding is not None:  # or it speeds up: a log-increase at least the last one's
            ranges.append((math.exp(max(low, speeding)), math.inf))
        return ranges

    def _speeding_from(self) -> float | None:
        """The log of the smallest next value with which the run speeds up (:meth:`_speeds_up`), or
        None when the run as it is rules that out."""
        run = self._run
        if len(run) < 3 or run[-1][1] < run[0][1] * self.min_factor:
            return None
        y0, y1, y2 = (math.log(v) for _, v in run[-3:])
        if y2 - y1 < y1 - y0:
            return None
        return y2 + (y2 - y1)

    def _extend(self, step: int, value: float) -> None:
        self._run.append((step, value))
        self._sums.add(math.log(value))

    def _end_run(self) -> None:
        if self._flagged_from is None:
            self._past.extend(self._run)
        self._run = []
        self._sums = _LogSums()

    def recent(self, k: int) -> tuple[list[float], int]:
        """The last ``k`` values of the past and the current run, oldest first, and how many there are
        in all (without copying the whole history)."""
        out = [v for _, v in self._run[-k:]]
        if len(out) < k and self._past:
            take = min(k - len(out), len(self._past))
            out = [self._past[-i][1] for i in range(take, 0, -1)] + out
        return out, len(self._past) + len(self._run)

    def _judge(self) -> Growth | None:
        run = self._run
        if len(run) - 1 < max(2, self.min_steps - 1):
            return None
        growth = self._growth()
        if growth.factor < self.min_factor:
            return None
        if growth.r2 < _MIN_R2:
            if not self._speeds_up():
                return None
            growth = dataclasses.replace(growth, accelerating=True)
        if growth.steps < self.min_steps and growth.factor < self.min_factor ** 3:
            return None  # one increase short: only a growth this steep counts already
        if self._past and growth.value <= max(v for _, v in self._past):
            return None  # not above what the run has already seen: a recovery, not a divergence
        sigma = self._noise()
        if sigma is not None and math.log(growth.factor) < _NOISE_Z * sigma * math.sqrt(growth.steps):
            return None
        if sigma is None and growth.steps < self.min_steps:
            level = self._level()
            if level is not None and growth.value < level * self.min_factor ** 3:
                return None  # the short, steep run rose from a trough of a noisy start, not from where the series sits
        return growth

    def _speeds_up(self) -> bool:
        """The growth accelerates (super-exponential, convex in log: cubic features, a learning rate that
        grows itself): its last three log-increases do not shrink, and the run had already grown by
        ``min_factor`` before its last value, so a slow rise that ends in one spike is not it."""
        run = self._run
        if len(run) < 4 or run[-2][1] < run[0][1] * self.min_factor:
            return False
        y0, y1, y2, y3 = (math.log(v) for _, v in run[-4:])
        return y1 - y0 <= y2 - y1 <= y3 - y2

    def _level(self) -> float | None:
        """The median of the recent healthy past: where a series sits while its history is too short
        for a noise estimate. A noisy loss (batch size 1, heavy tails) can rise 64x in three steps from
        one of its troughs without diverging; a divergence that steep climbs that far above its level."""
        if not self._past:
            return None
        values = sorted(v for _, v in itertools.islice(reversed(self._past), _LEVEL_WINDOW))
        return values[len(values) // 2]

    def _growth(self) -> Growth:
        run = self._run
        slope, r2 = self._sums.fit()
        return Growth(series=self.series, since_step=run[0][0], steps=len(run) - 1, start_value=run[0][1],
                      value=run[-1][1], factor=run[-1][1] / run[0][1], per_step=math.exp(slope), r2=r2)

    def _noise(self) -> float | None:
        """Robust sigma of the step-to-step log changes in the healthy past (None: too little history)."""
        past = list(self._past)
        diffs = [math.log(b[1] / a[1]) for a, b in zip(past, past[1:]) if b[0] == a[0] + 1]
        if len(diffs) < _NOISE_MIN_DIFFS:
            return None
        diffs.sort()
        median = diffs[len(diffs) // 2]
        spread = sorted(abs(d - median) for d in diffs)
        return _MAD_TO_SIGMA * spread[len(spread) // 2]

    def state_dict(self) -> dict[str, object]:
        return {"past": list(self._past), "run": list(self._run), "flagged_from": self._flagged_from}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._past = deque((tuple(p) for p in state["past"]), maxlen=self._past.maxlen)  # type: ignore[misc, union-attr]
        self._run = []
        self._sums = _LogSums()
        for step, value in state["run"]:  # type: ignore[union-attr]
            self._extend(step, value)
        self._flagged_from = state["flagged_from"]  # type: ignore[assignment]


class _LogSums:
    """Σy, Σy², Σi·y over a run's log-values y_i (i = 0, 1, ...), kept relative to the first one (the
    fit is shift-invariant; the shift keeps the sums small): the least-squares fit and its R² in O(1)."""

    __slots__ = ("n", "origin", "s", "q", "si")

    def __init__(self) -> None:
        self.n = 0
        self.origin = 0.0
        self.s = self.q = self.si = 0.0

    def add(self, y: float) -> None:
        if self.n == 0:
            self.origin = y
        d = y - self.origin
        self.s += d
        self.q += d * d
        self.si += self.n * d
        self.n += 1

    def fit(self) -> tuple[float, float]:
        """Least-squares slope of the values against 0..n-1, and R²."""
        n = self.n
        mx = (n - 1) / 2
        sxx = n * (n * n - 1) / 12
        sxy = self.si - mx * self.s
        syy = max(self.q - self.s * self.s / n, 0.0)
        slope = sxy / sxx
        r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
        return slope, r2

    def r2_intervals(self) -> list[tuple[float, float]]:
        """The values ``y`` for which one more value ``y`` gives R² >= ``_MIN_R2``, as intervals.

        With ``n = len + 1`` points at 0..n-1: ``sxy = A + b·y`` and ``syy = Q + y² - (S + y)²/n``;
        R² >= c is ``sxy² - c·sxx·syy >= 0``, a quadratic in ``y`` (solved relative to the origin).
        """
        n = self.n + 1
        mx = (n - 1) / 2
        sxx = n * (n * n - 1) / 12
        a_lin = self.si - mx * self.s
        b = (n - 1) - mx
        s, q = self.s, self.q
        c = _MIN_R2 * sxx
        a2 = b * b - c * (1 - 1 / n)
        a1 = 2 * a_lin * b + c * 2 * s / n
        a0 = a_lin * a_lin - c * (q - s * s / n)
        inf, o = math.inf, self.origin
        if a2 == 0:
            if a1 == 0:
                return [(-inf, inf)] if a0 >= 0 else []
            root = -a0 / a1 + o
            return [(root, inf)] if a1 > 0 else [(-inf, root)]
        disc = a1 * a1 - 4 * a2 * a0
        if disc < 0:
            return [(-inf, inf)] if a2 > 0 else []
        r1, r2 = sorted(((-a1 - math.sqrt(disc)) / (2 * a2) + o, (-a1 + math.sqrt(disc)) / (2 * a2) + o))
        return [(-inf, r1), (r2, inf)] if a2 > 0 else [(r1, r2)]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A diverging run, with the evidence for its summary and fix."""

    cause: str
    """``loss_divergence`` (the loss grows) or ``gradient_explosion`` (the gradient norm led)."""
    growth: Growth
    """The growth of the leading series."""
    other: Growth | None
    """The other series' growth over the same steps, when it grows too."""
    continuing: bool
    """False at the step the divergence is first flagged; True while it persists."""
    lr: float | None
    lr_at_start: float | None
    """The learning rate when the growth began."""
    lr_trend: str
    """``"rising"`` (warm-up), ``"constant"``, ``"decaying"`` or ``"unknown"``."""
    norm_before: float | None
    """The gradient norm when the growth began (a clipping threshold to start from)."""

    @property
    def kind(self) -> str:
        return "loss_spike" if self.cause == "loss_divergence" else "grad_explosion"

    def summary(self, step: int) -> str:
        g = self.growth
        name = "loss" if g.series == "loss" else "gradient norm"
        rate = "growing faster every step" if g.accelerating else f"×{g.per_step:.2f} per step, fitted exponential"
        text = (f"The {name} is diverging: it grew {g.factor:.3g}× in {g.steps} steps in a row since step {g.since_step} "
                f"({g.start_value:.4g} → {g.value:.4g}, {rate})")
        if self.continuing:
            text = f"The divergence goes on at step {step}: the {name} is {g.value:.4g}, still far above {g.start_value:.4g} (step {g.since_step})"
        if self.other is not None:
            other = "loss" if self.other.series == "loss" else "gradient norm"
            text += f"; the {other} grew {self.other.factor:.3g}× since step {self.other.since_step}"
        if self.lr is not None:
            text += f"; learning rate {self.lr:.3g}"
            text += {"rising": f", still rising (warm-up; it was {self.lr_at_start:.3g} when the growth began)",
                     "constant": ", constant", "decaying": ", decaying"}.get(self.lr_trend, "") if self.lr_at_start is not None else ""
        return text + "."

    def fix(self) -> str:
        lr_hint = ""
        if self.lr_at_start is not None and self.lr is not None:
            if self.lr_trend == "rising":
                lr_hint = (f"The growth began during warm-up at a learning rate of {self.lr_at_start:.3g}: lower the peak "
                           f"learning rate below that (it is {self.lr:.3g} now and still rising) or lengthen the warm-up")
            else:
                lr_hint = f"Lower the learning rate (it was {self.lr_at_start:.3g} when the growth began)"
        else:
            lr_hint = "Lower the learning rate (peak LR) or lengthen the warm-up"
        clip = "clip gradients (torch.nn.utils.clip_grad_norm_"
        clip += f", max_norm around {self.norm_before:.3g}, the norm before the growth)" if self.norm_before else ")"
        if self.cause == "gradient_explosion":
            return (f"{lr_hint}; {clip}, and check the initialisation and normalisation of deep or recurrent paths: "
                    "the gradients grew before the loss did.")
        return f"{lr_hint}; {clip}."


@dataclasses.dataclass(frozen=True)
class DivergenceRanges:
    """The next step's divergence verdict as bounds on its values (:meth:`DivergenceDetector.firing_ranges`).

    A divergence is reported when the loss lies in ``loss``, or the gradient norm lies in
    ``grad`` and either the divergence is ``continuing`` or the loss is at least
    ``loss_not_falling_from`` (the gradient norm alone counts only while the loss is not falling).
    """

    loss: list[tuple[float, float]]
    grad: list[tuple[float, float]]
    continuing: bool
    loss_not_falling_from: float
    """For a loss the tracker records (finite, > 0): "not falling" from this value on."""
    loss_not_falling_unrecorded: bool
    """For a loss it does not record (none seen, <= 0): whether the history alone says "not falling"."""

    def fires(self, loss: float | None, grad_norm: float | None) -> bool:
        """The verdict for these values (the host-side twin of the device check)."""
        if _inside(loss, self.loss):
            return True
        if not _inside(grad_norm, self.grad):
            return False
        if self.continuing:
            return True
        if loss is not None and math.isfinite(loss) and loss > 0:
            return loss >= self.loss_not_falling_from
        return self.loss_not_falling_unrecorded


    def fires_on_device(self, loss: "torch.Tensor | None", grad_norm: "torch.Tensor | None") -> "torch.Tensor | bool":
        """:meth:`fires` on 0-dim device tensors, without reading them (a bool tensor; ``False``
        when nothing can fire, which is most steps: then no kernel runs at all)."""
        hit: torch.Tensor | bool = False
        if loss is not None and self.loss:
            hit = _inside_device(loss, self.loss)
        if grad_norm is None or not self.grad:
            return hit
        grad_hit = _inside_device(grad_norm, self.grad)
        if not self.continuing:
            if loss is not None:
                recorded = torch.isfinite(loss) & (loss > 0)
                not_falling = torch.where(recorded, loss >= self.loss_not_falling_from,
                                          torch.full_like(recorded, self.loss_not_falling_unrecorded))
                grad_hit = grad_hit & not_falling
            elif not self.loss_not_falling_unrecorded:
                return hit
        return hit | grad_hit


def _inside_device(v: "torch.Tensor", ranges: list[tuple[float, float]]) -> "torch.Tensor":
    out = None
    for lo, hi in ranges:
        hit = (v >= lo) & (v <= hi) if math.isfinite(hi) else v >= lo
        out = hit if out is None else out | hit
    assert out is not None
    return out


def _inside(v: float | None, ranges: list[tuple[float, float]]) -> bool:
    return v is not None and math.isfinite(v) and v > 0 and any(lo <= v <= hi for lo, hi in ranges)


class DivergenceDetector:
    """Loss and gradient-norm growth, judged together, with the learning rate as evidence."""

    def __init__(self, *, min_steps: int, min_factor: float) -> None:
        self.loss = GrowthTracker("loss", min_steps=min_steps, min_factor=min_factor)
        self.grad = GrowthTracker("grad_norm", min_steps=min_steps, min_factor=min_factor)
        self._lrs: deque[tuple[int, float]] = deque(maxlen=256)
        self._cause: str | None = None

    @property
    def diverged(self) -> bool:
        """A divergence was flagged and has not settled back."""
        return self._cause is not None

    def update(self, step: int, loss: float | None, grad_norm: float | None, lr: float | None) -> Divergence | None:
        """Judge this step; a :class:`Divergence` when the run diverges (again at every step it persists)."""
        if lr is not None and math.isfinite(lr):
            self._lrs.append((step, lr))
        lg = self.loss.update(step, loss)
        gg = self.grad.update(step, grad_norm)
        if lg is None and gg is None:
            if not (self.loss.diverged or self.grad.diverged):  # a non-finite step does not end it
                self._cause = None
            return None
        continuing = self._cause is not None
        if not continuing:
            if lg is not None:
                grads_first = gg is not None and gg.since_step < lg.since_step
                self._cause = "gradient_explosion" if grads_first else "loss_divergence"
            elif gg is not None and self._loss_not_falling():
                self._cause = "gradient_explosion"
            else:
                self.grad._flagged_from = None  # the loss falls: an early-phase rise of the norm, not a divergence
                return None
        lead, other = (lg, gg) if (lg is not None and (self._cause == "loss_divergence" or gg is None)) else (gg, lg)
        assert lead is not None
        return Divergence(cause=self._cause or "loss_divergence", growth=lead, other=other, continuing=continuing,
                          lr=lr if lr is not None and math.isfinite(lr) else None,
                          lr_at_start=self._lr_at(lead.since_step), lr_trend=self._lr_trend(),
                          norm_before=self.grad.value_at(lead.since_step))

    def firing_ranges(self) -> "DivergenceRanges":
        """Where the next :meth:`update` reports a divergence, as bounds on its loss and
        gradient norm (see :class:`DivergenceRanges`), from the state alone."""
        if self.loss.diverged:  # the history without the diverged run
            prior = [v for _, v in self.loss._past][-8:]
            count = len(self.loss._past)
        else:
            prior, count = self.loss.recent(8)
        unrecorded = False  # a loss the tracker does not record (None, <= 0): judged on the history as it is
        if count >= _NOISE_MIN_DIFFS:
            recent = sorted(prior[-8:])
            unrecorded = prior[-1] >= recent[len(recent) // 2]
        # a recorded loss v: v >= upper median of (last 7 ∪ {v}) ⟺ v >= the 4th smallest of the last 7
        recorded = sorted(prior[-7:])[3] if count + 1 >= _NOISE_MIN_DIFFS else math.inf
        return DivergenceRanges(loss=self.loss.firing_ranges(), grad=self.grad.firing_ranges(),
                                continuing=self._cause is not None, loss_not_falling_from=recorded,
                                loss_not_falling_unrecorded=unrecorded)

    def evidence(self) -> dict[str, object] | None:
        """While diverged: what a later incident (the overflow it ends in) should know about it."""
        if self._cause is None:
            return None
        tracker = self.loss if self._cause == "loss_divergence" else self.grad
        run = tracker._run
        if not run:
            return {"cause": self._cause}
        return {"cause": self._cause, "series": tracker.series, "since_step": run[0][0], "start_value": run[0][1],
                "last_value": run[-1][1], "factor": run[-1][1] / run[0][1]}

    def _loss_not_falling(self) -> bool:
        """The gradient norm alone counts once the loss has a history (early in training the norm
        legitimately grows for many steps) and when the loss is at or above its recent median."""
        past, count = self.loss.recent(8)
        if count < _NOISE_MIN_DIFFS:
            return False
        recent = sorted(past[-8:])
        return past[-1] >= recent[len(recent) // 2]

    def _lr_at(self, step: int) -> float | None:
        for s, lr in reversed(self._lrs):
            if s <= step:
                return lr
        return self._lrs[0][1] if self._lrs else None

    def _lr_trend(self) -> str:
        recent = [lr for _, lr in list(self._lrs)[-8:]]
        if len(recent) < 2:
            return "unknown"
        if recent[-1] > recent[0] * (1 + 1e-6):
            return "rising"
        if recent[-1] < recent[0] * (1 - 1e-6):
            return "decaying"
        return "constant"

    def state_dict(self) -> dict[str, object]:
        return {"loss": self.loss.state_dict(), "grad": self.grad.state_dict(), "lrs": list(self._lrs), "cause": self._cause}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.loss.load_state_dict(state["loss"])  # type: ignore[arg-type]
        self.grad.load_state_dict(state["grad"])  # type: ignore[arg-type]
        self._lrs = deque((tuple(p) for p in state["lrs"]), maxlen=self._lrs.maxlen)  # type: ignore[misc, union-attr]
        self._cause = state["cause"]  # type: ignore[assignment]
