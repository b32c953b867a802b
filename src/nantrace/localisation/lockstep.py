"""Localisation under FSDP2: every rank replays the failing step together.

An FSDP2 model's forward all-gathers each parameter group and its backward gathers them again
(and would reduce-scatter), so a replay on the failing rank alone would wait forever for its
peers. Instead, when the step's agreed facts call for localisation (the same verdict on every
rank, :attr:`nantrace.decision.Decision.replay_together`), every rank replays the step, and the
sequence of forwards and backwards is the same on every rank whatever each one finds:

- every captured unit is replayed, forward and backward, even after this rank has found the
  origin in an earlier one, and even when its values are already non-finite;
- the backward differentiates the unsharded parameters the replayed graph used
  (``torch.autograd.grad``): this rank's own gradients, before any reduction; no ``.grad`` is
  written, so no reduce-scatter runs; the sharded ``.grad`` are set aside meanwhile anyway;
- a choice that depends on what one rank found (replay the loss code as well?) is settled by
  one small all-reduce (:meth:`Lockstep.any`), which every rank reaches at the same point.

The ranks the failure came from write the diagnosis into their incident; the others discard
what their replay found and say where the failure came from.

Usage (inside the reporter)::

    localise_together(watched, incident, capture, origin_rank=1, diagnose=watched.rank == 1)
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..capture import StepCapture
    from ..incident import Incident
    from ..watched import Watched

__all__ = ["Lockstep", "localise_together"]


class Lockstep:
    """Collective choices of a replay that every rank runs together (one all-reduce each)."""

    def __init__(self, device: torch.device, *, diagnose: bool) -> None:
        self.device = device
        self.diagnose = diagnose
        """This rank's replay names the origin (otherwise it only keeps the others company and
        asks for nothing more to be replayed)."""
        self.rounds = 0
        """All-reduces issued (each is a host read, on an incident step only)."""

    def _max(self, values: list[float]) -> list[float]:
        vec = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.MAX)
        self.rounds += 1
        return vec.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank's ``flag`` is set (every rank must call it at the same point)."""
        return self._max([float(flag)])[0] > 0

    def same(self, count: int) -> bool:
        """Whether every rank passed the same ``count``."""
        high, neg_low = self._max([float(count), -float(count)])
        return high == -neg_low


def localise_together(watched: "Watched", incident: "Incident", capture: "StepCapture", *, origin_rank: int | None,
                      diagnose: bool) -> None:
    """Replay the step on every rank at once (call it on every rank, at the same step).

    ``diagnose``: this rank's own data or backward produced the failure; its incident receives
    the diagnosis. Otherwise the replay only keeps the other ranks company, and the incident
    says where the failure came from. Never raises into the training loop.
    """
    from .localiser import localise_incident

    units = list(capture.calls) or list(capture.forwards)
    device = watched.params[0].device if watched.params else torch.device("cpu")
    lockstep = Lockstep(device if device.type != "meta" else torch.device("cpu"), diagnose=diagnose)
    if not lockstep.same(len(units)) or not units:
        incident.details["localisation"] = ("not replayed: the ranks captured different numbers of forward calls "
                                            "in this step, so a replay together could not stay in step")
        return
    target = incident if diagnose else copy.copy(incident)
    if not diagnose:
        target.details = dict(incident.details)
    stashed = [(p, p.grad) for p in watched.params]
    for p in watched.params:  # FSDP2 accumulates reduced gradients into .grad in place: keep the real ones apart
        p.grad = None
    try:
        localise_incident(watched, target, capture, lockstep=lockstep)
    finally:
        for p, g in stashed:
            p.grad = g
    incident.details["localisation_rounds"] = lockstep.rounds
    if not diagnose:
        source = f"rank {origin_rank}" if origin_rank is not None else "another rank"
        incident.details["localisation"] = (f"replayed together with the other ranks (FSDP2); the failure came from "
                                            f"{source}, whose incident names the op")
        incident.details["localisation_seconds"] = target.details.get("localisation_seconds")
