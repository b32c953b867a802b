"""The ``rollback`` policy: last-good snapshots taken before healthy updates, restored on an
incident, with a bounded number of retries before escalating to ``pause`` (PaLM / OLMo practice:
the batches consumed since the snapshot are skipped, because the data loader moves on)."""

from __future__ import annotations

import gc
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .rollback import SnapshotManager

if TYPE_CHECKING:
    from ..guard import Guard
    from ..incident import Incident


def discover_schedulers(optimizer: torch.optim.Optimizer) -> list[Any]:
    """LR schedulers that drive ``optimizer`` (found by reference; no change to the user's code)."""
    found = []
    for obj in gc.get_referrers(optimizer):
        if getattr(obj, "optimizer", None) is optimizer and hasattr(obj, "get_last_lr") and hasattr(obj, "state_dict"):
            found.append(obj)
    return found


class RollbackPolicy:
    """Snapshots before healthy steps; restores the newest one when an incident calls for it."""

    def __init__(self, guard: "Guard") -> None:
        self._guard_ref = weakref.ref(guard)  # the guard owns this policy: no cycle, so snapshots go with it
        cfg = guard.config
        self.interval = cfg.response.rollback_interval
        self.max_retries = cfg.response.rollback_max_retries
        self.manager: SnapshotManager | None = None
        self.retries = 0
        self.last_rollback: int | None = None
        self._extra_schedulers: list[Any] = []

    @property
    def guard(self) -> "Guard":
        guard = self._guard_ref()
        if guard is None:
            raise RuntimeError("nantrace: the rollback policy outlived its guard")
        return guard

    def add_scheduler(self, scheduler: Any) -> None:
        self._extra_schedulers.append(scheduler)
        if self.manager is not None:
            self.manager.add_scheduler(scheduler)

    def _start(self) -> SnapshotManager:
        guard, cfg = self.guard, self.guard.config
        schedulers = discover_schedulers(guard.optimizer) if guard.optimizer is not None else []
        for s in self._extra_schedulers:
            if s not in schedulers:
                schedulers.append(s)
        directory = None
        if cfg.response.rollback_where == "disk" and guard.run_dir is not None:
            directory = os.path.join(guard.run_dir, "snapshots")
        return SnapshotManager(guard.root, guard.optimizer, scaler=guard.scaler, schedulers=schedulers,
                               interval=self.interval, where=cfg.response.rollback_where, directory=directory,
                               keep=cfg.response.rollback_keep)

    def before_healthy_update(self, step: int) -> None:
        """Called at a step whose check found nothing, before its update: a last-good point."""
        if self.manager is None:
            self.manager = self._start()  # at the first step, so schedulers made after watch() are found
        if self.manager.maybe_snapshot(step) and self.last_rollback is not None and step > self.last_rollback:
            self.retries = 0

    def roll_back(self, incident: "Incident") -> bool:
        """Restore the newest snapshot; False when there is none or the retries are spent."""
        if self.manager is None or self.manager.last_step is None:
            incident.details["rollback"] = "no snapshot had been taken yet"
            return False
        recent = self.last_rollback is not None and incident.step - self.last_rollback <= self.interval
        self.retries = self.retries + 1 if recent else 1
        if self.retries > self.max_retries:
            incident.details["rollback"] = (f"{self.retries - 1} rollbacks in a row did not get past the failure; "
                                            "escalated to pause")
            return False
        restored = self.manager.restore(clear_grads=False)  # the guard blocks this step's update itself
        self.last_rollback = incident.step
        incident.details.update(restored_to_step=restored, skipped_steps=[restored, incident.step],
                                rollback_retry=self.retries)
        return True

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
