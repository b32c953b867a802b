"""The ``Config.outputs`` settings group: what the guard keeps and shows: the console, the flight recorder, bundles, TensorBoard (``nantrace.storage``).

Usage::

    nantrace.Config(outputs=nantrace.config.OutputsConfig(...))
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

from .._settings import SettingsGroup, check_bools, check_int

__all__ = ["BUNDLE_RANKS", "OutputsConfig"]

BUNDLE_RANKS = ("auto", "origin", "all")
"""The choices of ``Config.outputs.bundle_ranks`` (``storage/bundle_policy.py`` applies them)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class OutputsConfig(SettingsGroup):
    """What the guard keeps and shows: the console, the flight recorder, bundles, TensorBoard (``nantrace.storage``)."""

    group: ClassVar[str] = "outputs"

    print_incidents: bool = True
    """Print each incident once to the console (rich)."""

    flight_recorder: int = 32
    """How many recent steps' health figures are kept in memory and attached to an incident."""

    save_bundle: bool = True
    """With a run directory, write a reproduction bundle for each non-finite incident."""

    max_bundles: int = 10
    """At most this many bundles per run (the first ones are the informative ones)."""

    bundle_ranks: str = "auto"
    """Under data parallelism, which ranks write a full bundle of an incident step: ``"origin"``
    (the ranks whose own data or gradients were non-finite, or rank 0 when none was; every other
    rank writes a small pointer to theirs), ``"all"`` (every rank its own full bundle) or
    ``"auto"`` (``"all"`` up to 8 ranks, ``"origin"`` above)."""

    model_factory: str | None = None
    """``"module:callable"`` that rebuilds the model in a fresh process for ``nantrace replay``
    (default: the model's class, when it is importable and takes no arguments)."""

    tensorboard: bool | str = False
    """Export the trajectory to TensorBoard: a log directory, or ``True`` for ``RUN_DIR/tensorboard``
    (needs ``pip install 'nantrace[tensorboard]'``)."""

    def __post_init__(self) -> None:
        check_bools(self)
        check_int(self, "flight_recorder", minimum=0)
        check_int(self, "max_bundles", minimum=0)
        if self.bundle_ranks not in BUNDLE_RANKS:
            raise ValueError(f"Config.outputs.bundle_ranks must be one of {', '.join(map(repr, BUNDLE_RANKS))}, "
                             f"got {self.bundle_ranks!r}")
        if self.model_factory is not None and (not isinstance(self.model_factory, str) or ":" not in self.model_factory):
            raise ValueError(f"Config.outputs.model_factory must be 'module:callable', got {self.model_factory!r}")
        if not isinstance(self.tensorboard, (bool, str, os.PathLike)) or self.tensorboard == "":
            raise ValueError("Config.outputs.tensorboard must be False, True (RUN_DIR/tensorboard) or a log directory, "
                             f"got {self.tensorboard!r}")
