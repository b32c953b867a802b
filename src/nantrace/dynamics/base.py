"""The interface between the guard and a training-dynamics monitor.

A monitor is attached once, told before an update that will be applied (so a sampled step
can remember what it needs, e.g. the parameters before the update), and called after each
finished step with the step's figures. It returns early-warning signals, which the guard
turns into incidents, and rows for the run store.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..detection.sentinel import StepHealth
    from ..watched import Watched


@dataclasses.dataclass
class StepContext:
    """What a monitor sees of one finished step."""

    step: int
    health: "StepHealth"
    """The sentinel's figures: loss, global norms, ``grad_norms``/``param_norms`` per watched tensor."""
    grad_index: list[int]
    """Index into ``param_names`` of each entry of ``health.grad_norms`` (tensors without a grad are absent)."""
    param_names: list[str]
    """Names of the watched parameters, aligned with ``health.param_norms``."""
    applied: bool
    """The optimizer update of this step happened."""
    lrs: list[float]
    """Learning rate of each param group after the step."""


@dataclasses.dataclass
class Signal:
    """An early warning, turned into an :class:`~nantrace.Incident` (action ``logged``) by the guard."""

    kind: str
    cause: str
    summary: str
    fix: str
    module: str | None = None
    phase: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


class Monitor:
    """Base class: override what you need. All hooks must be cheap on non-sampled steps."""

    name: str = "monitor"

    summary_key: str | None = None
    """Where :func:`nantrace.dynamics.summary` puts this monitor's ``summary()`` (``None``: not summarised)."""

    def attach(self, watched: "Watched") -> None:
        """Called once by the guard after it has installed its own hooks."""

    def before_update(self, step: int, params: list[torch.Tensor]) -> None:
        """Called just before an update that will be applied (not for blocked steps)."""

    def on_step(self, ctx: StepContext) -> list[Signal]:
        """Called after every finished step; returns early warnings (usually none)."""
        return []

    def detach(self) -> None:
        """Remove anything installed in :meth:`attach`; called by ``guard.close()``."""
