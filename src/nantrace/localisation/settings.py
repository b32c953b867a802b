"""The ``Config.localisation`` settings group: what is kept of each step so that a failing one can be replayed, and whether it is (``nantrace.localisation``; docs/diagnosis.md).

Usage::

    nantrace.Config(localisation=nantrace.config.LocalisationConfig(...))
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._settings import SettingsGroup, check_bools

__all__ = ["LocalisationConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class LocalisationConfig(SettingsGroup):
    """What is kept of each step so that a failing one can be replayed, and whether it is (``nantrace.localisation``; docs/diagnosis.md)."""

    group: ClassVar[str] = "localisation"

    localise: bool = True
    """Replay the failing step under op-level instrumentation to find the origin op."""

    precision_check: bool = True
    """On a low-precision failure, re-run the step in float32 to tell overflow from a math error."""

    snapshot_buffers: bool = True
    """Copy buffers before each forward so that a replay starts from the same state: every buffer, whatever its dtype,
    on the first forward, then those the first forward changed (a step counter, an initialisation flag; not the
    running statistics a training-mode BatchNorm only writes): ``capture.BufferPlan``."""

    keep_output_grads: bool = True
    """Keep the gradient arriving at the model's outputs so backward origins can be replayed without the loss."""

    record_loss_code: bool = True
    """Keep a tape of the torch calls between the model's forward and ``backward()`` (the loss code), and of the
    step's code before the forward (the prelude), so an origin there is localised without ``guard.replayable``."""

    def __post_init__(self) -> None:
        check_bools(self)
