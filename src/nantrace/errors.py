"""Exceptions raised by nantrace."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .incident import Incident


class NonFiniteError(RuntimeError):
    """Raised under ``on_anomaly="raise"`` or ``"pause"`` before any parameter changes.

    ``.incident`` holds the full diagnosis.
    """

    def __init__(self, incident: "Incident") -> None:
        self.incident = incident
        where = f" in {incident.op}" if incident.op else ""
        module = f" (module {incident.module!r})" if incident.module else ""
        super().__init__(
            f"nantrace: {incident.kind} at step {incident.step}{where}{module}: "
            f"{incident.summary} Fix: {incident.fix}"
        )
