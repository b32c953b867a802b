"""GradScaler awareness: calibration skips are normal, a collapsing scale is not."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ScalerCollapse:
    consecutive_skips: int
    scale: float
    reason: str


class ScalerMonitor:
    """Counts consecutive scaler-skipped steps and watches the scale for a collapse.

    A step the scaler skips because the *scaled* gradients overflowed while the loss was
    finite is calibration. It becomes ``scaler_collapse`` when skips run past
    ``max_skips`` in a row or the scale falls below ``min_scale``; reported once per
    collapse episode.
    """

    def __init__(self, *, max_skips: int, min_scale: float) -> None:
        self.max_skips = max_skips
        self.min_scale = min_scale
        self.consecutive_skips = 0
        self.total_skips = 0
        self._reported = False

    def update(self, *, skipped: bool, scale: float | None) -> ScalerCollapse | None:
        if skipped:
            self.consecutive_skips += 1
            self.total_skips += 1
        else:
            self.consecutive_skips = 0
            self._reported = False
        reason = None
        if self.consecutive_skips > self.max_skips:
            reason = f"the scaler skipped {self.consecutive_skips} consecutive steps"
        elif scale is not None and scale < self.min_scale and skipped:
            reason = f"the loss scale fell to {scale:g}, below the floor {self.min_scale:g}"
        if reason is None or self._reported:
            return None
        self._reported = True
        return ScalerCollapse(self.consecutive_skips, float(scale) if scale is not None else float("nan"), reason)

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive_skips": self.consecutive_skips, "total_skips": self.total_skips, "reported": self._reported}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
        self._reported = bool(state["reported"])
