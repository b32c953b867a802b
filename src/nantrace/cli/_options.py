"""Options shared by several subcommands, named and described once."""

from __future__ import annotations

import typer

from ..response.policies import POLICIES

ON_ANOMALY_HELP = (
    "What to do on an incident: skip (drop the corrupted update, go on; the default), "
    "raise (stop with the diagnosis before anything changes), rollback (restore the last "
    "good state, go on) or pause (write the incident bundle, then stop)."
)
"""The help of ``--on-anomaly``: the four policies of ``nantrace.watch(on_anomaly=...)``."""


def check_on_anomaly(value: str) -> str:
    """``value`` if it is one of the four policies, else a usage error naming them (exit 2)."""
    if value not in POLICIES:
        raise typer.BadParameter(f"unknown policy {value!r}; expected one of {', '.join(POLICIES)}",
                                 param_hint="'--on-anomaly'")
    return value
