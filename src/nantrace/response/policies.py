"""What nantrace does about an incident under each ``on_anomaly`` policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config
    from ..diagnosis.triage import Finding

POLICIES = ("skip", "raise", "rollback", "pause")
"""``skip``: drop the update and go on; ``raise``: raise NonFiniteError before any change;
``rollback``: restore the last good snapshot and go on; ``pause``: write the incident bundle, then raise."""


def action_for(policy: str, finding: "Finding | None", *, finite_trouble: bool, config: "Config") -> str:
    """The incident's ``action`` field for this policy and finding."""
    if finding is not None and finding.benign:
        return "logged"
    if finite_trouble and config.finite_anomaly_action == "log":
        return "logged"
    if policy == "raise":
        return "raised"
    if policy == "pause":
        return "paused"
    if policy == "rollback":
        return "rolled_back"
    if finding is not None and finding.kind == "nonfinite_param" and finding.phase != "optimizer":
        # The parameters are already non-finite: dropping this update cannot repair them (an update
        # that made them so is undone by the update check, so skipping it does).
        return "raised"
    return "skipped"
