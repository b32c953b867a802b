"""Where an incident goes: built in one place (:func:`new_incident`), then, by the
:class:`Reporter`, localised, counted on its episode, bundled, acted on (rollback), kept, stored
and printed, and raised as ``NonFiniteError`` when the policy stops the run.

Usage (inside the guard)::

    reporter = Reporter(watched, ladder=ladder, precision=precision, rollback=rollback,
                        capture=lambda: guard_capture)
    reporter.report(decision.incident, decision, on_stop=finish_step_raised)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import console
from .capture import StepCapture
from .diagnosis.triage import PARAMS_WRITTEN_UNSEEN
from .distributed import localisable
from .errors import NonFiniteError
from .incident import Incident
from .taxonomy import DATA_INCIDENT_CAUSES, STOPPING_ACTIONS, Action, Cause, Kind, Phase
from .watched import Watched

if TYPE_CHECKING:
    from .decision import Decision
    from .dynamics.base import Signal
    from .response.escalation import EscalationLadder
    from .response.precision import PrecisionFallback
    from .response.rollback_policy import RollbackPolicy

__all__ = ["Reporter", "new_incident"]


def new_incident(watched: Watched, *, kind: Kind, cause: Cause, summary: str, fix: str, action: Action | str,
                 history: Sequence[dict[str, Any]], step: int | None = None, phase: Phase | None = None,
                 module: str | None = None, details: dict[str, Any] | None = None) -> Incident:
    """An incident of this guard's run: at the current step unless told, on this rank, with the
    flight recorder's history; ``op`` and ``source`` are the localiser's to fill in."""
    return Incident(step=watched.step if step is None else step, kind=kind, phase=phase, op=None, module=module,
                    source=None, rank=watched.rank, cause=cause, summary=summary, fix=fix, action=action,
                    details=details if details is not None else {}, history=list(history))


class Reporter:
    """Takes each incident of one guard where it goes."""

    def __init__(self, watched: Watched, *, ladder: "EscalationLadder", precision: "PrecisionFallback",
                 rollback: "RollbackPolicy | None", capture: Callable[[], StepCapture],
                 history: "deque[dict[str, Any]]") -> None:
        self.watched = watched
        self.ladder = ladder
        self.precision = precision
        self.rollback = rollback
        self.history = history
        """The flight recorder: the last steps' figures, attached to each incident."""
        self.incidents: list[Incident] = []
        self._capture = capture
        self._bundles_written = 0
        self._pointers_written = 0
        self._data_inbox: deque[Any] = deque()
        self._owner_thread = threading.get_ident()

    def new(self, **fields: Any) -> Incident:
        """:func:`new_incident` with this guard's view and history."""
        return new_incident(self.watched, history=self.history, **fields)

    # ------------------------------------------------------------ the step check's incidents
    def report(self, incident: Incident, decision: "Decision", *, on_stop: Callable[[], None]) -> None:
        """Localise (when enabled), count on its episode, bundle, roll back, keep, store and print
        the incident; when the policy stops the run, call ``on_stop`` and raise ``NonFiniteError``."""
        watched, cfg = self.watched, self.watched.config
        if self.ladder.absorb(incident, decision):  # a repeat of the open episode, counted on its incident
            return
        origins = incident.details.get("origin_ranks")
        here = origins is None or watched.rank in origins
        wanted = here and (localisable(incident.kind) or (  # parameters the step's own code may have written
            not watched.sharded and bool(incident.details.get(PARAMS_WRITTEN_UNSEEN)))) and "peer_rank" not in incident.details
        agreement = decision.agreement
        if watched.sharded and agreement is not None:
            if cfg.localisation.localise and agreement.replay_together:  # the same verdict on every rank
                from .localisation.lockstep import localise_together

                localise_together(watched, incident, self._capture(), diagnose=wanted,
                                  origin_rank=origins[0] if origins else agreement.peer_rank)
        elif cfg.localisation.localise and wanted:
            from .localisation.localiser import localise_incident

            localise_incident(watched, incident, self._capture())
        if incident.cause == "precision_overflow" and incident.module is not None:
            note = self.precision.record(incident.module)
            if note:
                incident.details["precision_fallback"] = note
                incident.fix = f"{incident.fix} (Done: {note}.)"
        if self.ladder.settle(incident, decision):  # localised: the same origin as the episode's incident
            return
        if not watched.sharded and (incident.action in (Action.PAUSED, Action.ROLLED_BACK) or (
                cfg.outputs.save_bundle and watched.store is not None and incident.kind.startswith("nonfinite"))):
            self.write_bundle(incident)  # before any rollback: the bundle holds the failing step's own state
        self._act(incident)
        if incident.action in STOPPING_ACTIONS:
            on_stop()
            raise NonFiniteError(incident)

    def report_collapse(self, collapse: Any, decision: "Decision") -> None:
        """A GradScaler collapse (``detection.scaler``): an episode of its own, localised on a scale-1 replay."""
        from .detection.scaler import collapse_fields, name_collapse_origin
        from .diagnosis.patterns import explain
        from .response.policies import action_for

        watched = self.watched
        stop = watched.policy != "skip" and watched.config.response.finite_anomaly_action != "log"
        incident = self.new(kind="scaler_collapse", phase="backward", cause="scaler_collapse",
                            summary=f"The GradScaler is collapsing: {collapse.reason}.", fix=explain("scaler_collapse")[1],
                            action=action_for(watched.policy, None, finite_trouble=True, config=watched.config)
                            if stop else Action.SKIPPED,
                            details=collapse_fields(collapse))
        if self.ladder.absorb(incident, decision):  # the collapse goes on: counted on its incident
            return
        decision.incident = decision.incident or incident
        if not collapse.continuing:
            name_collapse_origin(watched, incident, self._capture(), decision.health.scale)
        self.ladder.settle(incident, decision)  # a collapse is never a repeat here: it opens or heads its episode
        if incident.action in (Action.PAUSED, Action.ROLLED_BACK):
            self.write_bundle(incident)
        self._act(incident)
        if incident.action in STOPPING_ACTIONS:
            raise NonFiniteError(incident)

    def _act(self, incident: Incident) -> None:
        if incident.action == Action.ROLLED_BACK and not (self.rollback is not None and self.rollback.roll_back(incident)):
            incident.action = Action.PAUSED
        self.ladder.annotate(incident)
        self.record(incident)

    # ------------------------------------------------------------ the other sources
    def report_signal(self, signal: "Signal") -> None:
        """An early warning of a training-dynamics monitor (the update was applied)."""
        self.record(self.new(kind=signal.kind, phase=signal.phase, module=signal.module, cause=signal.cause,
                             summary=signal.summary, fix=signal.fix, action=Action.LOGGED, details=dict(signal.details)))

    def queue_data_issue(self, issue: Any) -> None:
        """A finding of the data layer; recorded now on the training thread, at the next step from any other."""
        self._data_inbox.append(issue)
        if threading.get_ident() == self._owner_thread:
            self.flush_data_issues()

    def flush_data_issues(self) -> None:
        while self._data_inbox:
            issue = self._data_inbox.popleft()
            action = issue.details.get("action", Action.LOGGED)
            self.record(self.new(
                kind="nonfinite_input", phase="data", cause=issue.cause if issue.cause in DATA_INCIDENT_CAUSES else "unknown",
                summary=issue.summary, fix=issue.fix,
                action=action if action in (Action.SKIPPED, Action.RAISED, Action.LOGGED) else Action.LOGGED,
                details={"path": issue.path, "sample_indices": list(issue.sample_indices), **issue.details}))

    @property
    def data_pending(self) -> bool:
        return bool(self._data_inbox)

    # ------------------------------------------------------------ keeping
    def record(self, incident: Incident, *, announce: bool = True) -> None:
        """Keep, store and print one incident."""
        self.incidents.append(incident)
        if self.watched.store is not None:
            self.watched.store.log_incident(incident)
        if self.watched.config.outputs.print_incidents and announce:
            console.print_incident(incident)

    def write_bundle(self, incident: Incident) -> None:
        """Write the incident's reproduction bundle, or, under data parallelism when another rank holds
        it (``Config.outputs.bundle_ranks``, ``storage/bundle_policy.py``), a pointer to that rank's.
        At most ``Config.outputs.max_bundles`` of each per run."""
        watched = self.watched
        if watched.store is None:
            return
        from .storage.bundle_policy import bundle_holders

        holders = bundle_holders(incident, rank=watched.rank, world_size=watched.world_size,
                                 setting=watched.config.outputs.bundle_ranks)
        if holders is not None:
            if self._pointers_written < watched.config.outputs.max_bundles:
                from .storage.pointer import write_pointer

                write_pointer(watched, incident, holders)
                self._pointers_written += 1
            return
        if self._bundles_written >= watched.config.outputs.max_bundles:
            return
        from .storage.bundle import write_bundle

        incident.bundle = write_bundle(watched, incident, self._capture())
        self._bundles_written += 1
