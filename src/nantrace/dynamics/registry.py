"""Which monitors a configuration turns on."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config
    from .base import Monitor


def build_monitors(config: "Config") -> list["Monitor"]:
    """The monitors for this configuration, in the order they run (none yet by default)."""
    return []
