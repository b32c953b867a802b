"""The ``Config.response`` settings group: what the guard does about an incident: finite anomalies, the escalation ladder, rollback snapshots, precision fallback (``nantrace.response``; docs/escalation.md).

Usage::

    nantrace.Config(response=nantrace.config.ResponseConfig(...))
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._settings import SettingsGroup, check_bools, check_int

__all__ = ["ResponseConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class ResponseConfig(SettingsGroup):
    """What the guard does about an incident: finite anomalies, the escalation ladder, rollback snapshots, precision fallback (``nantrace.response``; docs/escalation.md)."""

    group: ClassVar[str] = "response"

    finite_anomaly_action: str = "policy"
    """``"policy"``: finite anomalies (spikes, explosions) follow ``on_anomaly``; ``"log"``: only report them."""

    skip_budget: int = 5
    """The escalation ladder (docs/escalation.md): after this many consecutive skipped updates of one
    episode the guard escalates: it rolls back to the last good snapshot when there is one, and
    pauses (bundle, then ``NonFiniteError``) when there is none or rollbacks repeat. 0 = never
    escalate (skip forever; a warning says so at ``watch()``)."""

    skip_window: int = 100
    """The window of steps over which ``skip_window_budget`` counts skipped updates."""

    skip_window_budget: int = 10
    """At most this many skipped updates in any ``skip_window`` steps before the guard escalates
    (catches an episode whose skips are not consecutive)."""

    episode_gap: int = 20
    """An episode ends after this many consecutive healthy steps; until then repeated incidents
    update its one incident (``details["count"]``, ``details["steps"]``) instead of adding new ones,
    and a checkpoint is not safe (``guard.checkpoint_ok()``)."""

    skip_snapshots: bool = False
    """With ``on_anomaly="skip"``, also keep last-good snapshots (as ``rollback`` does, every
    ``rollback_interval`` healthy steps) so that an exhausted skip budget rolls back before it pauses."""

    rollback_interval: int = 100
    """With ``on_anomaly="rollback"``: take a last-good snapshot every this many healthy steps."""

    rollback_where: str = "memory"
    """Where snapshots live: ``"memory"`` (CPU RAM) or ``"disk"`` (``run_dir/snapshots``, or a temp dir)."""

    rollback_keep: int = 2
    """How many snapshots to keep (the newest is restored)."""

    rollback_max_retries: int = 3
    """Rollbacks in a row (each within ``rollback_interval`` steps of the last) before escalating to ``pause``."""

    precision_fallback_after: int = 3
    """After this many ``precision_overflow`` incidents in one module, run it in float32 outside
    autocast for the rest of the run (0 = never)."""

    def __post_init__(self) -> None:
        check_bools(self)
        if self.finite_anomaly_action not in ("policy", "log"):
            raise ValueError(f"Config.response.finite_anomaly_action must be 'policy' or 'log', "
                             f"got {self.finite_anomaly_action!r}")
        check_int(self, "skip_budget", minimum=0)
        check_int(self, "skip_window", minimum=1)
        check_int(self, "skip_window_budget", minimum=1)
        check_int(self, "episode_gap", minimum=1)
        check_int(self, "rollback_interval", minimum=1)
        check_int(self, "rollback_keep", minimum=1)
        check_int(self, "rollback_max_retries", minimum=0)
        check_int(self, "precision_fallback_after", minimum=0)
        if self.rollback_where not in ("memory", "disk"):
            raise ValueError(f"Config.response.rollback_where must be 'memory' or 'disk', got {self.rollback_where!r}")
        if self.skip_window_budget > self.skip_window:
            raise ValueError(f"Config.response.skip_window_budget ({self.skip_window_budget}) must not exceed "
                             f"Config.response.skip_window ({self.skip_window})")
