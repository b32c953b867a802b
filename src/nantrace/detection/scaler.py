"""GradScaler awareness: calibration skips are normal, a collapsing scale is not.

A GradScaler starts from ``init_scale`` (2**16 by default, 2**24 or more in some recipes)
and halves it at every step whose *scaled* gradients overflow, until they fit: from 2**40
that is some twenty skipped steps, all healthy. Counting skips alone therefore either cries
wolf at calibration or waits twenty steps to see a real collapse. So:

- **Calibration is never a collapse.** Until the scaler has found its level (a step it did
  not skip), a run of skips is judged only by a replay at scale 1 and by the scale floor.
- **A collapse is called at its first skip** when a replay of the step at scale 1 (the
  loss unscaled, the same autocast precision) still gives non-finite gradients: lowering the
  scale cannot help. The replay is cheap to afford because it runs only on a skip, and on a
  run of skips only at its 1st, 2nd, 4th, 8th, ... skip.
- **After the level was found**, more than ``max_skips`` consecutive skips, or a scale
  ``max_drop`` times below that level, is a collapse too (for when no replay is possible).
- A scale below ``min_scale`` (the scaler now shrinks the gradients) is a collapse, judged at
  every step whose scale the step's check read: on a skipped step with the skip, on a step the
  scaler would apply before its update (:meth:`ScalerMonitor.before_update`), which it blocks.
- A scale the gradients cannot be unscaled from (:func:`unusable_scale`: 0, whose scaled gradients
  are all 0 and whose reciprocal is inf, so that ``unscale_`` makes ``0 × inf = NaN`` which the
  scaler's own overflow check, made on the scaled values, never sees; one whose float32 reciprocal
  overflows; an infinite one) is a collapse before the update whatever the scaler would do, and
  whatever ``min_scale`` says: the step's unscaled gradients are unknown.

While a collapse lasts, every further skipped step is reported again (``continuing``) so
that the escalation ladder counts it; the first applied step ends it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..capture import StepCapture
    from ..watched import Watched

__all__ = ["ScalerCollapse", "ScalerMonitor", "replay_at_scale_one", "unusable_scale"]

_F32_MAX = float(torch.finfo(torch.float32).max)


def unusable_scale(scale: float | None) -> str | None:
    """Why a loss scale makes the unscaled gradients unknown (a sentence), ``None`` when they can be
    recovered from it (or no scale was read). ``GradScaler.unscale_`` multiplies by the float32
    reciprocal of the scale: at 0 (or below ~3e-39) that reciprocal is inf and every zero gradient
    turns NaN; at inf it is 0 and every gradient turns 0 or NaN."""
    if scale is None or math.isnan(scale):
        return None
    if scale == 0.0:
        return ("the loss scale is 0: the scaled loss and gradients are all 0, and unscaling them multiplies "
                "by 1/0 = inf (0 × inf = NaN), which the scaler's overflow check, made on the scaled values, "
                "does not see")
    if math.isinf(scale):
        return f"the loss scale is {scale:g}: every scaled gradient overflows and no update can be unscaled"
    if abs(1.0 / scale) > _F32_MAX:
        return (f"the loss scale {scale:g} is so small that its float32 reciprocal is inf: unscaling turns every "
                "zero gradient into NaN")
    return None


@dataclasses.dataclass(frozen=True)
class ScalerCollapse:
    consecutive_skips: int
    scale: float
    reason: str
    continuing: bool = False
    replayed: bool | None = None
    """True when a replay at scale 1 proved it (non-finite there too); None when no replay ran."""
    level: float | None = None
    """The scale the scaler had trained at before (None: it never found one)."""


class ScalerMonitor:
    """Watches the GradScaler's skips and scale, telling calibration from a collapse."""

    def __init__(self, *, max_skips: int, min_scale: float, max_drop: float = 1024.0) -> None:
        self.max_skips = max_skips
        self.min_scale = min_scale
        self.max_drop = max_drop
        self.consecutive_skips = 0
        self.total_skips = 0
        self.probes = 0
        self.level: float | None = None
        """The highest scale at which the scaler applied an update (its level, once found)."""
        self._collapsed = False
        self._undecided = False
        self._judged = False
        """:meth:`before_update` called this step a collapse (and the update was withheld): :meth:`update`
        only books it as a skip."""

    @property
    def collapsed(self) -> bool:
        return self._collapsed

    def before_update(self, *, scale: float | None, skipping: bool) -> ScalerCollapse | None:
        """Judge the scale before the scaler steps, from the step's own read (no host read of its own).

        A collapse (the caller withholds the update) when the scale is unusable (:func:`unusable_scale`:
        the scaler's skip cannot be trusted, it misses the NaN its own unscaling makes), or below
        ``min_scale`` on a step the scaler would apply (``skipping``: the step's gradients are
        non-finite, the scaler skips it and :meth:`update` judges the floor with the skip)."""
        unusable = unusable_scale(scale)
        below = scale is not None and not skipping and scale < self.min_scale
        self._judged = unusable is not None or below
        if not self._judged:
            return None
        n = self.consecutive_skips + 1
        if self._collapsed:
            return ScalerCollapse(n, _f(scale), f"the loss scale is still {_f(scale):g}", continuing=True,
                                  level=self.level)
        self._collapsed = True
        reason = unusable or (f"the loss scale is {scale:g}, below the floor {self.min_scale:g}: the scaler now "
                              "shrinks the gradients instead of protecting them from underflow")
        return ScalerCollapse(n, _f(scale), reason, level=self.level)

    def update(self, *, skipped: bool, scale: float | None,
               probe: Callable[[], bool | None] | None = None) -> ScalerCollapse | None:
        """Judge one finished step. ``probe`` replays it at scale 1: True when the gradients are
        finite there, False when not, None when it could not tell; called only when due. A step
        :meth:`before_update` already called a collapse is booked as a skipped one (its update was
        withheld), and not judged again."""
        if self._judged:
            self._judged = False
            self.consecutive_skips += 1
            self.total_skips += 1
            return None
        if not skipped:
            self.consecutive_skips = 0
            self._collapsed = False
            if scale is not None and (self.level is None or scale > self.level):
                self.level = scale
            return None
        self.consecutive_skips += 1
        self.total_skips += 1
        n = self.consecutive_skips
        if self._collapsed:
            return ScalerCollapse(n, _f(scale), "the scaler still skips every step", continuing=True, level=self.level)
        reason = None
        replayed: bool | None = None
        if scale is not None and scale < self.min_scale:
            reason = f"the loss scale fell to {scale:g}, below the floor {self.min_scale:g}, and the gradients still overflow"
        elif probe is not None and (n & (n - 1) == 0 or self._undecided):  # 1st, 2nd, 4th, 8th ... skip of a run
            self.probes += 1
            finite = probe()
            self._undecided = finite is None  # could not tell (e.g. an overflowed output gradient): ask again next skip
            if finite is False:
                replayed = True
                reason = (f"the step's gradients are non-finite even when it is replayed at scale 1 (the scale is "
                          f"{_f(scale):g}): lowering the scale cannot help")
        if reason is None and self.level is not None:
            if n > self.max_skips:
                reason = f"the scaler skipped {n} consecutive steps after training at a scale of {self.level:g}"
            elif scale is not None and scale * self.max_drop <= self.level:
                reason = f"the loss scale fell to {scale:g}, {self.level / scale:g}× below the level {self.level:g} it had found"
        if reason is None:
            return None
        self._collapsed = True
        return ScalerCollapse(n, _f(scale), reason, replayed=replayed, level=self.level)

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive_skips": self.consecutive_skips, "total_skips": self.total_skips, "level": self.level,
                "collapsed": self._collapsed, "probes": self.probes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
        self.level = state["level"]
        self._collapsed = bool(state["collapsed"])
        self.probes = int(state["probes"])


def _f(x: float | None) -> float:
    return float(x) if x is not None else float("nan")


def replay_at_scale_one(watched: "Watched", capture: "StepCapture", scale: float | None) -> bool | None:
    """Replay the step's captured units at loss scale 1 in their own precision: are the
    gradients finite there? ``None`` when the step cannot be replayed (nothing captured, a
    gradient at the model's outputs that had already overflowed, an error).

    A ``replayable`` unit recomputes its (unscaled) loss; a plain forward is back-propagated
    from the gradient recorded at its outputs divided by the scale.
    """
    from ..localisation.rerun import rerun_scope, run_unit

    units = list(capture.calls) or list(capture.forwards)
    if not units or watched.sharded:
        return None
    try:
        with rerun_scope(watched):
            for unit in units:
                if _output_grads_nan(unit):
                    return False  # a NaN reached the model's outputs from the loss: no scale undoes a NaN
                unit = _at_scale_one(unit, scale)
                if unit is None:
                    return None
                result = run_unit(watched, unit)
                if not result.forward_finite or result.grads_finite is False:
                    return False
                if result.grads_finite is None:
                    return None
        return True
    except Exception:  # a probe that fails must not take the run down: no verdict
        return None


def _output_grads_nan(unit: Any) -> bool:
    return any(bool(torch.isnan(g).any()) for _, g in getattr(unit, "output_grads", ()))


def _at_scale_one(unit: Any, scale: float | None) -> Any:
    """``unit`` with its recorded output gradients divided by ``scale`` (None: they had overflowed)."""
    from ..capture import CallRecord

    if isinstance(unit, CallRecord) or not scale:
        return unit
    grads = []
    for i, g in unit.output_grads:
        if not bool(torch.isfinite(g).all()):
            return None  # the scaled gradient overflowed before reaching the model: its true value is lost
        grads.append((i, (g.double() / scale).to(g.dtype)))
    return dataclasses.replace(unit, output_grads=grads)


def collapse_fields(collapse: ScalerCollapse) -> dict[str, Any]:
    """The incident ``details`` of a collapse."""
    out: dict[str, Any] = {"consecutive_skips": collapse.consecutive_skips, "scale": collapse.scale}
    if collapse.level is not None:
        out["level"] = collapse.level
    if collapse.replayed is not None:
        out["replayed_at_scale_one"] = "non-finite"
    if not math.isfinite(collapse.scale):
        out.pop("scale")
    return out


def name_collapse_origin(watched: "Watched", incident: Any, capture: "StepCapture", scale: float | None) -> None:
    """Name the tensors and the op whose gradient overflowed in a collapse.

    The tensors come from the step's own gradients; the op, module and source line from the
    localiser, run on the step replayed at scale 1 (the overflow that the scale cannot fix).
    The incident keeps its kind and cause (``scaler_collapse``); the localised cause is kept
    as ``details["origin_cause"]``.
    """
    from ..detection.sentinel import nonfinite_tensors

    grads = [(name, p.grad) for name, p in zip(watched.param_names, watched.params) if p.grad is not None]
    bad = nonfinite_tensors(grads)
    if bad:
        incident.details["nonfinite_grads"] = bad
        incident.module = str(bad[0]["name"]).rpartition(".")[0]
    if not watched.config.localisation.localise or watched.sharded:
        return
    from ..localisation.localiser import localise_incident

    rescaled = capture.with_forwards([_at_scale_one(u, scale) or u for u in capture.forwards])
    summary, fix, cause = incident.summary, incident.fix, incident.cause
    localise_incident(watched, incident, rescaled)
    tensors = f" Non-finite gradients: {', '.join(str(b['name']) for b in bad[:4])}{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}." if bad else ""
    if incident.summary != summary:  # the replay found where: say it after the collapse itself
        incident.details["origin_cause"] = incident.cause
        origin = f"The first non-finite gradient comes from {incident.op}: " if incident.op else ""
        summary = f"{summary}{tensors} {origin}{incident.summary}"
        fix = f"{incident.fix} {fix}"
    else:
        summary += tensors
    incident.summary, incident.fix, incident.cause = summary, fix, cause
    incident.phase = "backward"
