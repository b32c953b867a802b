"""Checkpoints that stay healthy: never save corrupted weights over good ones, and say at
once when a run starts from corrupted ones.

- :meth:`CheckpointGate.verdict` answers whether now is a safe moment to save: every
  parameter and buffer of the watched model is finite (one fused check, one host read) and
  no incident episode is unresolved (the escalation ladder's ``episode_gap``). The guard
  exposes it as ``guard.checkpoint_ok()``; the Lightning and Hugging Face callbacks ask it
  before every save and refuse a bad one with a :class:`CheckpointRefusedWarning` and an
  incident (``details["checkpoint"] = "refused"``), so a checkpoint rotation never deletes a
  good file to make room for a bad one (Megatron-LM #5281).
- :meth:`CheckpointGate.loaded_state_finding` runs once, at the first step: a model loaded
  with non-finite tensors (parameters, frozen ones included, and buffers holding NaN: a buffer's
  infinities may be a mask; looked at when
  ``watch()`` is called, before a forward can spread them into other buffers) is reported
  naming them, and the checkpoint file when an integration knows it (``loaded_from``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..taxonomy import Action
from ..capture import all_finite
from ..detection.sentinel import nonfinite_tensors

if TYPE_CHECKING:
    from ..diagnosis.triage import Finding
    from ..guard import Guard
    from ..incident import Incident

__all__ = ["CheckpointGate", "CheckpointRefusedWarning", "nonfinite_state"]


class CheckpointRefusedWarning(UserWarning):
    """nantrace refused to save a checkpoint (non-finite weights or an unresolved episode)."""


def nonfinite_state(root: torch.nn.Module) -> list[dict[str, object]]:
    """Every parameter of ``root`` holding NaN/Inf, and every buffer holding NaN, with counts
    (empty when there is none). Buffers may hold infinities on purpose (a ``-inf`` causal mask),
    so only a NaN in a buffer counts.

    One fused flag and one host read; the per-tensor counts only when it fails.
    """
    params = [(n, p.detach()) for n, p in root.named_parameters() if p.is_floating_point()]
    buffers = [(n, b.detach()) for n, b in root.named_buffers() if b.is_floating_point()]
    flags = [all_finite([_local(p) for _, p in params])] if params else []
    flags += [~torch.isnan(_local(b)).any() for _, b in buffers if b.numel()]
    flags = [f for f in flags if f is not None]
    if not flags or bool(torch.stack([f.to(flags[0].device) for f in flags]).all()):
        return []
    return nonfinite_tensors(params) + [b for b in nonfinite_tensors(buffers) if b["nan"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _describe(bad: list[dict[str, object]], limit: int = 4) -> str:
    parts = [f"{b['name']} ({b['nan']} NaN, {b['inf']} Inf of {b['numel']})" for b in bad[:limit]]
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return ", ".join(parts) + more


class CheckpointGate:
    """Whether the watched model may be saved now; refusals become warnings and incidents."""

    def __init__(self, guard: "Guard") -> None:
        self._guard_ref = weakref.ref(guard)
        self.loaded_from: str | None = None
        """The checkpoint file the model was loaded from, when an integration knows it."""
        self.reason: str | None = None
        """Why the last :meth:`verdict` said no (``None`` when it said yes)."""
        self._checked_load = False
        self._at_watch = nonfinite_state(guard.root)
        """Tensors already non-finite when ``watch()`` was called (before any forward could spread them)."""
        self._cache: tuple[int, bool, str | None, list[dict[str, object]]] | None = None
        self._refused_at: set[int] = set()

    @property
    def guard(self) -> "Guard":
        guard = self._guard_ref()
        if guard is None:
            raise RuntimeError("nantrace: the checkpoint gate outlived its guard")
        return guard

    # ------------------------------------------------------------ saving
    def verdict(self) -> bool:
        """True when a checkpoint saved now would hold finite weights from a settled run.

        In sync-free mode the host first reads the step the device decided last (saving a
        checkpoint reads every weight anyway): its incident counts (a stopping action raises at the
        next ``optimizer.step()``, before its update)."""
        guard = self.guard
        if guard.sync_free is not None:
            guard.settle_device_step(stop=False)
        if self._cache is not None and self._cache[0] == guard.step:
            self.reason = self._cache[2]
            return self._cache[1]
        bad = nonfinite_state(guard.root)
        reason = None
        if bad:
            reason = f"the model holds non-finite values: {_describe(bad)}"
        elif guard.ladder.open:
            episode = guard.ladder.episode
            assert episode is not None
            reason = (f"an incident episode is unresolved ({episode.latest.kind}, since step {episode.start}, "
                      f"{episode.count} incident(s), last at step {episode.last_step}); it ends after "
                      f"{guard.config.response.episode_gap} healthy steps (Config.episode_gap)")
        ok = reason is None
        self._cache = (guard.step, ok, reason, bad)
        self.reason = reason
        return ok

    def refuse_if_unsafe(self, where: str, path: str | None = None) -> bool:
        """Ask :meth:`verdict`; when it says no, warn and record an incident. True when refused."""
        if self.verdict():
            return False
        guard = self.guard
        assert self._cache is not None and self.reason is not None
        if guard.step not in self._refused_at:  # one warning and one incident per step (topk and last alike)
            self._refused_at.add(guard.step)
            message = f"nantrace refused to save a checkpoint{f' to {path}' if path else ''} ({where}): {self.reason}."
            warnings.warn(message, CheckpointRefusedWarning, stacklevel=3)
            guard.reporter.record(self._incident(where, path, self._cache[3]))
        return True

    def _incident(self, where: str, path: str | None, bad: list[dict[str, object]]) -> "Incident":
        from ..incident import Incident

        guard = self.guard
        step = max(guard.step - 1, 0)  # the last finished step: the state that would have been saved
        details: dict[str, Any] = {"checkpoint": "refused", "where": where, "path": path, "reason": self.reason}
        if bad:
            details["nonfinite_params"] = bad
            kind, cause, module = "nonfinite_param", "nonfinite_param", str(bad[0]["name"]).rpartition(".")[0]
            fix = ("Keep the last good checkpoint: find the step that made the weights non-finite (the incidents before "
                   "this one) and resume from the checkpoint before it, with the fix that incident names.")
        else:
            episode = guard.ladder.episode
            assert episode is not None
            kind, cause, module = episode.latest.kind, episode.latest.cause, episode.latest.module
            details["episode"] = episode.summary()
            fix = ("Save again once the episode has ended (Config.episode_gap healthy steps); if it does not end, "
                   "resume from the last good checkpoint with the fix the episode's incident names.")
        return guard.reporter.new(step=step, kind=kind, module=module, cause=cause,
                                  summary=f"Checkpoint refused ({where}): {self.reason}.", fix=fix, action=Action.LOGGED,
                                  details=details)

    # ------------------------------------------------------------ loading
    def loaded_state_finding(self, step: int, params_finite: bool = False) -> "Finding | None":
        """Once, at the first step: the model's tensors that were already non-finite, named (as found
        at ``watch()``, or at this step when the framework loaded the weights after it).

        Only a state the run is known to have started from: tensors non-finite at ``watch()``, or, when an
        integration says weights were loaded after it (``loaded_from``), non-finite now. Parameters read
        finite at ``watch()`` with no load recorded may have been written by the first step's own code (a
        data-dependent initialisation in the forward): the step check's triage and its replay judge them
        (``triage.PARAMS_WITHOUT_UPDATE``), and a replay that finds them non-finite before the step reports
        them as ``nonfinite_param`` then. The model is read again only when an integration recorded a load,
        so a healthy first step keeps its one host read. ``params_finite`` (the step check's reading)
        decides nothing here any more: non-finite parameters at the check are the triage's."""
        if self._checked_load:
            return None
        self._checked_load = True
        recheck = not self._at_watch and self.loaded_from is not None
        bad = self._at_watch or (nonfinite_state(self.guard.root) if recheck else [])
        if not bad:
            return None
        from ..diagnosis.triage import Finding

        origin = f" loaded from {self.loaded_from}" if self.loaded_from else ""
        summary = (f"The model{origin} already holds non-finite values at step {step}, before any update: "
                   f"{_describe(bad)}.")
        fix = ("Do not train from this state: reload a good checkpoint"
               f"{' (this file is corrupted)' if self.loaded_from else ''}, or re-initialise these tensors; check "
               "how they were created (torch.empty without initialisation) or saved.")
        return Finding(step, "nonfinite_param", None, "nonfinite_param", str(bad[0]["name"]).rpartition(".")[0],
                       summary, fix, details={"nonfinite_state": bad, "checkpoint_file": self.loaded_from})
