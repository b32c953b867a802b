"""What nantrace does about an incident under each ``on_anomaly`` policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..taxonomy import POLICIES, Action, Policy

if TYPE_CHECKING:
    from ..config import Config
    from ..diagnosis.triage import Finding

__all__ = ["POLICIES", "action_for"]

_STOPPING = {Policy.RAISE: Action.RAISED, Policy.PAUSE: Action.PAUSED, Policy.ROLLBACK: Action.ROLLED_BACK}


def action_for(policy: str, finding: "Finding | None", *, finite_trouble: bool, config: "Config") -> Action:
    """The incident's ``action`` field for this policy and finding."""
    if finding is not None and finding.benign:
        return Action.LOGGED
    if finite_trouble and config.response.finite_anomaly_action == "log":
        return Action.LOGGED
    if policy in _STOPPING:
        return _STOPPING[Policy(policy)]
    if finding is not None and finding.kind == "nonfinite_param" and finding.phase != "optimizer":
        # The parameters are already non-finite: dropping this update cannot repair them (an update
        # that made them so is undone by the update check, so skipping it does).
        return Action.RAISED
    return Action.SKIPPED
