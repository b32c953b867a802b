"""What every built-in monitor shares: a statistic must never break training.

:class:`SafeMonitor` runs a monitor's step work inside ``try``: the first exception turns
that monitor off with a :class:`MonitorFailedWarning` (naming the monitor and the error),
removes what it installed, and training goes on. ``attach`` is not protected: a bad
setting (e.g. TensorBoard not installed) must fail at ``watch()`` with a clear message.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from .base import Monitor, Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["MonitorFailedWarning", "SafeMonitor", "is_sampled"]


class MonitorFailedWarning(RuntimeWarning):
    """A training-dynamics monitor raised and was turned off; training went on."""


def is_sampled(step: int, every: int) -> bool:
    """True when ``step`` is one of the steps a statistic taken ``every`` steps samples (0 = never)."""
    return every > 0 and step % every == 0


class SafeMonitor(Monitor):
    """Base of the built-in monitors: override the ``_``-prefixed hooks.

    Receives the guard's read-only view of what is watched (``self.watched``), never the guard.
    """

    name = "monitor"

    def __init__(self) -> None:
        self._watched: "Watched | None" = None
        self.failed: BaseException | None = None
        self.active = False

    @property
    def watched(self) -> "Watched":
        if self._watched is None:
            raise RuntimeError(f"nantrace: the {self.name} monitor is not attached to a guard")
        return self._watched

    def attach(self, watched: "Watched") -> None:
        self._watched = watched
        self.active = watched.optimizer is not None  # without an optimizer there are no steps
        if self.active:
            self._attach(watched)

    def before_update(self, step: int, params: list[torch.Tensor]) -> None:
        if not self.active or type(self)._before_update is SafeMonitor._before_update:
            return  # nothing to do before the update: no grad-mode switch, no call, every step
        try:
            with torch.no_grad():
                self._before_update(step, params)
        except Exception as exc:  # noqa: BLE001 - a statistic must not stop training
            self._fail(exc)

    def on_step(self, ctx: StepContext) -> list[Signal]:
        if not self.active:
            return []
        try:
            with torch.no_grad():
                return self._on_step(ctx)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return []

    def detach(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            with torch.no_grad():
                self._detach()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"nantrace: the {self.name} monitor failed while closing: {exc!r}", MonitorFailedWarning,
                          stacklevel=2)

    def _fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.active = False
        try:
            self._uninstall()
        finally:
            warnings.warn(f"nantrace: the {self.name} monitor failed and is turned off (training goes on): {exc!r}",
                          MonitorFailedWarning, stacklevel=3)

    # ------------------------------------------------------------ to override
    def _attach(self, watched: "Watched") -> None:
        """Set up (only called when the guard has an optimizer)."""

    def _before_update(self, step: int, params: list[torch.Tensor]) -> None:
        """Just before an update that will be applied (under ``torch.no_grad``)."""

    def _on_step(self, ctx: StepContext) -> list[Signal]:
        """After every finished step (under ``torch.no_grad``)."""
        return []

    def _detach(self) -> None:
        """Flush what is pending and remove what was installed (default: :meth:`_uninstall`)."""
        self._uninstall()

    def _uninstall(self) -> None:
        """Remove hooks and patches; must be safe to call twice."""

    def summary(self) -> dict[str, Any]:
        """Figures of the run so far, for :func:`nantrace.dynamics.summary` (plain data)."""
        return {}
