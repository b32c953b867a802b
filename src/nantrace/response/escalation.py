"""The escalation ladder: repeated incidents of one episode are one incident, and skipping
has a budget.

Skipping a corrupted update is the right answer to one bad batch and the wrong answer to a
run that diverges: every later step fails too, and a guard that skips forever hides a dead
run behind a healthy-looking loop (torchtitan #916). So incidents are grouped into
*episodes*, and each episode climbs a ladder::

    skip  ──(skip budget spent)──▶  roll back  ──(rollbacks repeat)──▶  pause
      └──────────(no snapshot)──────────────────────────────────────────▲

- An episode opens with the first incident of the guard's step check (a blocked update, a
  finite anomaly that was only logged, a ``scaler_collapse``) and ends after
  ``Config.episode_gap`` consecutive steps without one.
- A later incident of the open episode *joins* it when it blocks an update right after a
  blocked one (consecutive skipped updates), when it is a finite anomaly or collapse of the
  episode's own kind, or, once localised, when it has the same origin (kind, cause, op and
  module) as the episode's latest recorded incident, and nothing new came of it (a precision
  fallback is recorded). A joining incident is not printed or stored as a new one; the recorded one is updated
  (``details["count"]``, ``details["steps"]``, ``details["last_step"]``) in place and in the
  run store. Its update is blocked all the same.
- The skip budget: ``skip_budget`` consecutive skipped updates, or ``skip_window_budget``
  skipped updates within ``skip_window`` steps. When the next incident would exceed it, the
  guard escalates: ``rolled_back`` when the guard keeps snapshots (``on_anomaly="rollback"``,
  or ``Config.skip_snapshots``) and one exists, ``paused`` (bundle, then ``NonFiniteError``)
  otherwise; repeated rollbacks that do not get past the failure end in ``paused`` too
  (``Config.rollback_max_retries``). An escalation is a new incident, with the episode's
  figures in ``details["escalation"]``.

Every rank of a data-parallel run blocks the same steps (the guard's agreement), so every
rank's ladder counts the same skips and escalates at the same step.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from ..taxonomy import Action

if TYPE_CHECKING:
    from ..guard import Guard
    from ..incident import Incident

__all__ = ["Episode", "EscalationLadder"]

_FAMILY = {"loss_spike": "divergence", "grad_explosion": "divergence"}
"""Kinds that are one origin for grouping: a divergence shows as either, often both in turn."""


_UNLOCALISED = ("loss_spike", "grad_explosion", "scaler_collapse")
"""Kinds whose origin is known before localisation (finite anomalies, a collapse continuing)."""


def _origin(incident: "Incident") -> str:
    return _FAMILY.get(incident.kind, incident.kind)


def _unexplained(incident: "Incident") -> bool:
    """An incident whose origin is unknown: no op and cause ``unknown``."""
    return incident.op is None and incident.cause == "unknown"


def _same_origin(a: "Incident", b: "Incident") -> bool:
    """Same kind (family), cause, op and module: after localisation, the same failure again."""
    return _origin(a) == _origin(b) and (a.cause, a.op, a.module) == (b.cause, b.op, b.module)

_MAX_STEPS_KEPT = 256
"""An episode's incident lists at most this many steps (``details["steps"]``); the count goes on."""


@dataclasses.dataclass
class Episode:
    """One stretch of trouble: its first incident and the one it currently updates."""

    first: "Incident"
    latest: "Incident"
    """The recorded incident that repeats are counted on (a new kind records a new one)."""
    start: int
    last_step: int
    count: int = 1
    """Incidents in the episode, the recorded ones included."""
    skipped: int = 0
    rollbacks: int = 0
    retried: bool = False
    """A blocked repeat was localised once because the recorded incident had no origin (:func:`_unexplained`)."""

    def summary(self) -> dict[str, Any]:
        return {"episode": self.first.id, "since_step": self.start, "last_step": self.last_step,
                "incidents": self.count, "skipped_updates": self.skipped, "rollbacks": self.rollbacks}


class EscalationLadder:
    """Groups incidents into episodes and decides when skipping must escalate."""

    def __init__(self, guard: "Guard") -> None:
        self._guard_ref = weakref.ref(guard)
        cfg = guard.config
        self.budget = cfg.response.skip_budget
        self.window = cfg.response.skip_window
        self.window_budget = cfg.response.skip_window_budget
        self.gap = cfg.response.episode_gap
        self.episode: Episode | None = None
        self.consecutive_skips = 0
        """Skipped updates in a row (the step being decided not counted yet)."""
        self.max_consecutive_skips = 0
        self._skipped_steps: deque[int] = deque()
        self._healthy_run = 0
        self._blocked_last = False
        if self.budget == 0 and guard.policy == "skip":
            warnings.warn("nantrace: Config.skip_budget=0 turns the escalation ladder off: under on_anomaly='skip' a run "
                          "that fails at every step is skipped forever (each episode is still one incident, updated)",
                          UserWarning, stacklevel=4)

    @property
    def guard(self) -> "Guard":
        guard = self._guard_ref()
        if guard is None:
            raise RuntimeError("nantrace: the escalation ladder outlived its guard")
        return guard

    @property
    def open(self) -> bool:
        """An episode is unresolved (fewer than ``episode_gap`` healthy steps since its last incident)."""
        return self.episode is not None

    # ------------------------------------------------------------ decisions
    def absorb(self, incident: "Incident", decision: Any) -> bool:
        """First look at ``incident`` (not recorded, not localised yet).

        Returns True when it joined the open episode already: it blocks an update right after a
        blocked one, or it is a finite anomaly (or a collapse) of the episode's own kind. The
        recorded incident was updated (and, under rollback, the state restored again); nothing
        else is to be done with this one (its update stays blocked). Otherwise returns False;
        the incident's ``action`` may have been raised to ``rolled_back`` or ``paused`` (an
        escalation), and the caller localises it and then calls :meth:`settle`.
        """
        if incident.action in (Action.RAISED, Action.PAUSED):
            return False  # the policy stops the run at once: nothing to group or escalate
        episode = self.episode
        joins = episode is not None and (
            (self._blocked_last and incident.action != Action.LOGGED) or
            (_origin(incident) == _origin(episode.latest) and incident.kind in _UNLOCALISED))
        if joins and episode is not None and not episode.retried and _unexplained(episode.latest) \
                and incident.kind not in _UNLOCALISED:
            # the recorded incident could not be localised (its step was not captured: the first step of a
            # zero-code run, a step the guard met half-way): the repeat is localised once, and recorded if it
            # says more (settle)
            episode.retried = True
            joins = False
        if incident.action == Action.SKIPPED and self._budget_spent():
            reason = self._reason()
            if self._can_roll_back(episode):
                if joins and episode is not None and episode.latest.action == Action.ROLLED_BACK:
                    incident.action = Action.ROLLED_BACK
                    return self._rejoin_with_rollback(episode, incident, decision, reason)
                self._escalate(incident, Action.ROLLED_BACK, reason)
            else:
                self._escalate(incident, Action.PAUSED, reason)
            return False
        if episode is None or not joins:
            return False
        if incident.action == Action.ROLLED_BACK:
            return self._rejoin_with_rollback(episode, incident, decision, "the episode recurred")
        self._count(episode, incident)
        decision.incident = episode.latest
        return True

    def settle(self, incident: "Incident", decision: Any) -> bool:
        """After localisation: a repeat of the episode's latest incident (same kind, cause, op and
        module) joins it; anything else becomes the episode's new recorded incident. True when joined.

        A repeat that made something new happen (a precision fallback) is recorded, not joined.
        """
        episode = self.episode
        if incident.action == Action.RAISED or (incident.action == Action.PAUSED and "escalation" not in incident.details):
            return False
        if episode is not None and incident is episode.latest:
            return False  # an escalation: already the episode's head
        if (episode is not None and "escalation" not in incident.details and "precision_fallback" not in incident.details
                and _same_origin(incident, episode.latest)):
            if incident.action == Action.ROLLED_BACK:
                return self._rejoin_with_rollback(episode, incident, decision, "the episode recurred")
            self._count(episode, incident)
            decision.incident = episode.latest
            return True
        self._open(incident)
        return False

    def _open(self, incident: "Incident") -> None:
        """Record ``incident`` as the episode's new head (opening the episode if none is open)."""
        if self.episode is None:
            self.episode = Episode(first=incident, latest=incident, start=incident.step, last_step=incident.step)
        else:
            self.episode.latest = incident
            self.episode.count += 1
            self.episode.last_step = incident.step
        if incident.action == Action.ROLLED_BACK:
            self._rolled_back()
        self._mark(incident)

    def _budget_spent(self) -> bool:
        if self.budget <= 0:
            return False
        return self.consecutive_skips >= self.budget or len(self._skipped_steps) >= self.window_budget

    def _reason(self) -> str:
        if self.consecutive_skips >= self.budget:
            return f"{self.consecutive_skips} consecutive skipped updates (Config.skip_budget = {self.budget})"
        return (f"{len(self._skipped_steps)} skipped updates in the last {self.window} steps "
                f"(Config.skip_window_budget = {self.window_budget})")

    def _can_roll_back(self, episode: Episode | None) -> bool:
        rollback = self.guard.rollback
        has_snapshot = rollback is not None and rollback.manager is not None and rollback.manager.last_step is not None
        return has_snapshot and (episode is None or episode.rollbacks < self.max_rollbacks)

    @property
    def max_rollbacks(self) -> int:
        return self.guard.config.response.rollback_max_retries

    def _escalate(self, incident: "Incident", action: str, reason: str) -> None:
        """Raise the incident's action a rung (``rolled_back`` or ``paused``); it becomes the episode's head."""
        episode = self.episode
        incident.action = action
        info: dict[str, Any] = {"from": Action.SKIPPED, "to": action, "reason": reason}
        if episode is not None:
            info.update(episode.summary())
        if action == Action.PAUSED:
            info["why_pause"] = (f"{episode.rollbacks} rollback(s) of this episode did not get past it "
                                 f"(Config.rollback_max_retries = {self.max_rollbacks})" if episode is not None and episode.rollbacks
                                 else "no last-good snapshot to roll back to (on_anomaly='rollback' or Config.skip_snapshots keeps them)")
        verb = "rolled back to the last good snapshot" if action == Action.ROLLED_BACK else "paused"
        since = f" of the episode that began at step {episode.start}" if episode is not None else ""
        info["note"] = f"Escalated after {reason}{since}: nantrace {verb}."
        incident.details["escalation"] = info
        self._open(incident)

    @staticmethod
    def annotate(incident: "Incident") -> None:
        """Put an escalation's note in front of the summary (after localisation has written it)."""
        note = incident.details.get("escalation", {}).get("note")
        if note and not incident.summary.startswith(note):
            incident.summary = f"{note} {incident.summary}"

    def _rolled_back(self) -> None:
        """A restored state starts a fresh skip count; the episode remembers the rollback."""
        assert self.episode is not None
        self.episode.rollbacks += 1
        self.consecutive_skips = 0
        self._skipped_steps.clear()

    def _rejoin_with_rollback(self, episode: Episode, incident: "Incident", decision: Any, reason: str) -> bool:
        """Roll back again, counted on the episode's rollback incident; pause when the rollbacks are spent."""
        guard = self.guard
        if episode.rollbacks < self.max_rollbacks and guard.rollback is not None and guard.rollback.roll_back(incident):
            self._rolled_back()
            self._count(episode, incident)
            head = episode.latest
            head.details["rollbacks"] = episode.rollbacks
            head.details["restored_to_step"] = incident.details.get("restored_to_step")
            self._store(head)
            decision.incident = head
            return True
        why = incident.details.get("rollback") or (f"{episode.rollbacks} rollback(s) of this episode did not get past it "
                                                   f"(Config.rollback_max_retries = {self.max_rollbacks})")
        incident.details.setdefault("rollback", f"{episode.rollbacks} rollbacks in a row did not get past the failure; "
                                                "escalated to pause")
        incident.action = Action.PAUSED
        info: dict[str, Any] = {"from": Action.ROLLED_BACK, "to": Action.PAUSED, "reason": reason, "why_pause": why}
        info.update(episode.summary())
        info["note"] = (f"Escalated after {episode.rollbacks} rollback(s) of the episode that began at step "
                        f"{episode.start}: nantrace paused.")
        incident.details["escalation"] = info
        self._open(incident)
        return False

    def _count(self, episode: Episode, incident: "Incident") -> None:
        episode.count += 1
        episode.last_step = incident.step
        head = episode.latest
        steps = head.details.setdefault("steps", [head.step])
        if len(steps) < _MAX_STEPS_KEPT:
            steps.append(incident.step)
        head.details["count"] = head.details.get("count", 1) + 1
        head.details["last_step"] = incident.step
        for key in ("loss", "grad_norm", "loss_scale"):
            if key in incident.details:
                head.details[f"last_{key}"] = incident.details[key]
        self._store(head)

    def _mark(self, incident: "Incident") -> None:
        incident.details.setdefault("count", 1)
        incident.details.setdefault("steps", [incident.step])
        if self.episode is not None and incident is not self.episode.first:
            incident.details.setdefault("episode", self.episode.first.id)

    def _store(self, incident: "Incident") -> None:
        store = self.guard.store
        if store is not None:
            store.log_incident(incident)  # INSERT OR REPLACE: the stored row follows the count

    # ------------------------------------------------------------ bookkeeping
    def end_step(self, step: int, *, blocked: bool, troubled: bool) -> None:
        """Called once per finished step: ``blocked`` when its update did not land because of an
        incident, ``troubled`` when it had an incident at all (a logged one included)."""
        self._blocked_last = blocked
        while self._skipped_steps and self._skipped_steps[0] <= step - self.window:
            self._skipped_steps.popleft()
        if blocked:
            self.consecutive_skips += 1
            self.max_consecutive_skips = max(self.max_consecutive_skips, self.consecutive_skips)
            self._skipped_steps.append(step)
            if self.episode is not None:
                self.episode.skipped += 1
        else:
            self.consecutive_skips = 0
        if troubled or blocked:
            self._healthy_run = 0
            return
        self._healthy_run += 1
        if self.episode is not None and self._healthy_run >= self.gap:
            self.episode = None

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive_skips": self.consecutive_skips, "skipped_steps": list(self._skipped_steps),
                "healthy_run": self._healthy_run, "max_consecutive_skips": self.max_consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self._skipped_steps = deque(int(s) for s in state["skipped_steps"])
        self._healthy_run = int(state["healthy_run"])
        self.max_consecutive_skips = int(state["max_consecutive_skips"])
