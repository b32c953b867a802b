"""Learning-rate schedule check: the schedule the user meant against the one that ran.

The user declares the schedule (``Config.lr_schedule``) as

- a dict: ``{"peak_lr": 1e-3, "warmup_steps": 100, "decay": "cosine", "total_steps": 1000,
  "min_lr": 0.0}`` (optional ``warmup_init_lr``, default 0, and ``offset``: the schedule step
  of the guard's step 0 when resuming). Step ``s`` (the ``s``-th ``optimizer.step()``) is
  meant to run at::

      s < warmup_steps:   warmup_init_lr + (peak_lr - warmup_init_lr) * s / warmup_steps
      "constant":         peak_lr
      "linear":           min_lr + (peak_lr - min_lr) * (total_steps - s) / (total_steps - warmup_steps)
      "cosine":           min_lr + (peak_lr - min_lr) * (1 + cos(pi * (s - warmup_steps) / (total_steps - warmup_steps))) / 2
      s >= total_steps:   min_lr

  (the convention of Hugging Face's ``get_{linear,cosine}_schedule_with_warmup``). ``peak_lr``
  may be a list (one per param group) or omitted (each group's ``initial_lr``, else its lr);
- a callable ``step -> lr`` (or a list of lrs, one per param group);
- the ``torch.optim.lr_scheduler`` object itself: a private copy of it is stepped once per
  optimizer step, so what is checked is that the real one is stepped exactly that way
  (not per epoch, not per micro-batch, not twice).

Each step costs one comparison per param group on the host. The first divergence (beyond
``Config.lr_tolerance``, relative) is reported once, as an ``lr_schedule`` signal naming
the step, the group, the LR that ran and the LR meant, with what the divergence looks like:
a schedule running late or early (warmup ending k steps late/early), an LR stuck at its
peak (never decaying), or a peak off by a factor.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._common import SafeMonitor
from .base import Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["LRScheduleMonitor", "ScheduleSpec", "validate_schedule"]

_DECAYS = ("cosine", "linear", "constant")
_KEYS = ("peak_lr", "warmup_steps", "decay", "total_steps", "min_lr", "warmup_init_lr", "offset")
_SEARCH_CAP = 20_000


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """A declared warmup + decay schedule (see the module docstring for the formula)."""

    peak_lr: float | tuple[float, ...] | None = None
    warmup_steps: int = 0
    decay: str = "constant"
    total_steps: int | None = None
    min_lr: float = 0.0
    warmup_init_lr: float = 0.0
    offset: int = 0

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> "ScheduleSpec":
        """Validate a ``Config.lr_schedule`` dict (``ValueError``/``TypeError`` naming the bad key)."""
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise ValueError(f"Config.lr_schedule: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"expected some of {', '.join(_KEYS)}")
        peak = spec.get("peak_lr")
        if isinstance(peak, (list, tuple)):
            if not peak or not all(_is_number(p) and p > 0 for p in peak):
                raise ValueError(f"Config.lr_schedule['peak_lr'] must be a positive number or a list of them, got {peak!r}")
            peak = tuple(float(p) for p in peak)
        elif peak is not None:
            if not _is_number(peak) or not peak > 0:
                raise ValueError(f"Config.lr_schedule['peak_lr'] must be a positive number or a list of them, got {peak!r}")
            peak = float(peak)
        decay = spec.get("decay", "constant")
        if decay not in _DECAYS:
            raise ValueError(f"Config.lr_schedule['decay'] must be one of {', '.join(map(repr, _DECAYS))}, got {decay!r}")
        for key in ("warmup_steps", "offset"):
            value = spec.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Config.lr_schedule[{key!r}] must be an integer >= 0, got {value!r}")
        warmup = spec.get("warmup_steps", 0)
        total = spec.get("total_steps")
        if decay != "constant" and total is None:
            raise ValueError(f"Config.lr_schedule: decay {decay!r} needs 'total_steps'")
        if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total <= warmup):
            raise ValueError(f"Config.lr_schedule['total_steps'] must be an integer > warmup_steps ({warmup}), got {total!r}")
        for key in ("min_lr", "warmup_init_lr"):
            value = spec.get(key, 0.0)
            if not _is_number(value) or value < 0:
                raise ValueError(f"Config.lr_schedule[{key!r}] must be a number >= 0, got {value!r}")
        return cls(peak_lr=peak, warmup_steps=warmup, decay=decay, total_steps=total,
                   min_lr=float(spec.get("min_lr", 0.0)), warmup_init_lr=float(spec.get("warmup_init_lr", 0.0)),
                   offset=spec.get("offset", 0))

    def lr(self, step: int, peak: float) -> float:
        """The LR meant at (guard) step ``step`` for a group whose peak is ``peak``."""
        s = step + self.offset
        w = self.warmup_steps
        if s < w:
            return self.warmup_init_lr + (peak - self.warmup_init_lr) * s / w
        if self.decay == "constant":
            return peak
        assert self.total_steps is not None
        if s >= self.total_steps:
            return self.min_lr
        progress = (s - w) / (self.total_steps - w)
        if self.decay == "linear":
            return self.min_lr + (peak - self.min_lr) * (1.0 - progress)
        return self.min_lr + (peak - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "optimizer") and callable(getattr(obj, "step", None)) and (
        callable(getattr(obj, "get_last_lr", None)) or isinstance(obj, torch.optim.lr_scheduler.ReduceLROnPlateau))


def validate_schedule(schedule: Any) -> None:
    """Check a ``Config.lr_schedule`` value; raises ``TypeError``/``ValueError`` saying what is expected."""
    if isinstance(schedule, dict):
        ScheduleSpec.from_dict(schedule)
    elif isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("Config.lr_schedule: ReduceLROnPlateau depends on the metric it is given and cannot be "
                         "checked; declare the schedule you mean as a dict or a callable instead")
    elif _is_scheduler(schedule) or callable(schedule):
        return
    else:
        raise TypeError("Config.lr_schedule must be a dict (peak_lr, warmup_steps, decay, total_steps, min_lr), a "
                        f"callable step -> lr, or a torch.optim.lr_scheduler object, got {type(schedule).__name__}")


class _ShadowOptimizer:
    """Stands in for the real optimizer inside a private copy of its LR scheduler."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} | {"params": []}
                             for g in optimizer.param_groups]
        self.defaults = dict(optimizer.defaults)
        self.state: dict[Any, Any] = {}
        self._opt_called = True

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


def _clone_scheduler(scheduler: Any) -> Any:
    shadow_opt = _ShadowOptimizer(scheduler.optimizer)
    clone = copy.deepcopy(scheduler, memo={id(scheduler.optimizer): shadow_opt})
    return clone


def _group_lrs(groups: Sequence[dict[str, Any]]) -> list[float]:
    out = []
    for g in groups:
        lr = g.get("lr")
        out.append(float(lr) if lr is not None else float("nan"))
    return out


class _SchedulerTrack:
    """The LRs a scheduler gives when stepped once per optimizer step, from a private copy of it."""

    def __init__(self, scheduler: Any) -> None:
        self._pristine = _clone_scheduler(scheduler)
        self._shadow = _clone_scheduler(scheduler)
        self.values: list[list[float]] = [_group_lrs(self._shadow.optimizer.param_groups)]

    def at(self, k: int) -> list[float]:
        """LRs after ``k`` scheduler steps from the attach-time state."""
        while len(self.values) <= k:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._shadow.step()
            self.values.append(_group_lrs(self._shadow.optimizer.param_groups))
        return self.values[k]


class LRScheduleMonitor(SafeMonitor):
    """Compares every step's learning rates with the declared schedule; reports the first divergence once."""

    name = "learning-rate schedule check"
    summary_key = "lr_schedule"

    def __init__(self, *, schedule: Any, tolerance: float) -> None:
        super().__init__()
        validate_schedule(schedule)
        self.schedule = schedule
        self.tolerance = tolerance
        self.spec: ScheduleSpec | None = ScheduleSpec.from_dict(schedule) if isinstance(schedule, dict) else None
        self.track: _SchedulerTrack | None = None
        self.peaks: list[float] = []
        self.first_step = 0
        self.divergence: dict[str, Any] | None = None
        self.checked = 0
        self._first: tuple[int, int, float, float] | None = None
        self._observed: list[tuple[int, float]] = []
        self._report_at = 0

    def _attach(self, watched: "Watched") -> None:
        optimizer = watched.optimizer
        assert optimizer is not None
        self.first_step = watched.step
        groups = optimizer.param_groups
        self.peaks = [float(g.get("initial_lr", g.get("lr", float("nan")))) for g in groups]
        if self.spec is not None and self.spec.peak_lr is not None:
            peak = self.spec.peak_lr
            if isinstance(peak, tuple):
                if len(peak) != len(groups):
                    raise ValueError(f"Config.lr_schedule['peak_lr'] lists {len(peak)} LRs for "
                                     f"{len(groups)} param group(s)")
                self.peaks = list(peak)
            else:
                self.peaks = [peak] * len(groups)
        if self.spec is None and _is_scheduler(self.schedule):
            if self.schedule.optimizer is not optimizer:
                raise ValueError("Config.lr_schedule: the LR scheduler given drives another optimizer than the one watched")
            try:
                self.track = _SchedulerTrack(self.schedule)
            except Exception as exc:  # noqa: BLE001 - e.g. a lambda bound to an object that cannot be copied
                warnings.warn(f"nantrace: Config.lr_schedule: the scheduler cannot be copied to follow it ({exc!r}); the "
                              f"schedule check is off. Declare the schedule as a dict or a callable step -> lr instead.",
                              RuntimeWarning, stacklevel=4)
                self.active = False

    # ------------------------------------------------------------------ meant
    def meant(self, step: int) -> list[float]:
        """The LR of each param group meant at (guard) step ``step``."""
        n = len(self.peaks)
        if self.spec is not None:
            return [self.spec.lr(step, peak) for peak in self.peaks]
        if self.track is not None:
            return self.track.at(step - self.first_step)
        value = self.schedule(step)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"Config.lr_schedule returned {len(value)} LRs for {n} param group(s)")
            return [float(v) for v in value]
        return [float(value)] * n

    def _close(self, ran: float, meant: float, peak: float) -> bool:
        diff = abs(ran - meant)
        scale = peak if math.isfinite(peak) and peak > 0 else max(abs(meant), abs(ran))
        return diff <= self.tolerance * max(abs(meant), abs(ran)) or diff <= self.tolerance * 1e-3 * scale

    # ------------------------------------------------------------------ steps
    def _on_step(self, ctx: StepContext) -> list[Signal]:
        if self.divergence is not None or not ctx.lrs:
            return []
        self.checked += 1
        if self._first is None:
            meant = self.meant(ctx.step)
            for group, (ran, want) in enumerate(zip(ctx.lrs, meant)):
                if math.isnan(ran):
                    continue  # an LR tensor on the device: not read (it would synchronise)
                if not self._close(ran, want, self._peak(group)):
                    self._first = (ctx.step, group, ran, want)
                    self._report_at = self._report_step(ctx.step)
                    break
        if self._first is None:
            return []
        self._observed.append((ctx.step, ctx.lrs[self._first[1]]))
        if ctx.step >= self._report_at:
            return [self._report()]
        return []

    def _peak(self, group: int) -> float:
        return self.peaks[group] if group < len(self.peaks) else float("nan")

    def _report_step(self, first: int) -> int:
        """When to report a divergence first seen at ``first``: a few steps later, so that its shape is known
        (through the end of the declared warmup when that is near), at most 50 steps later."""
        if self.track is not None:
            return first  # the scheduler copy explains itself at once
        end = first + 4
        if self.spec is not None:
            end = max(end, self.spec.warmup_steps - self.spec.offset + 2)
        return min(end, first + 50)

    def _report(self) -> Signal:
        assert self._first is not None
        step, group, ran, want = self._first
        shape = self._describe()
        self.divergence = {"step": step, "param_group": group, "lr_ran": ran, "lr_meant": want, "explanation": shape,
                           "observed": [{"step": t, "lr_ran": lr, "lr_meant": self.meant(t)[group]} for t, lr in self._observed[:8]]}
        declared = ("the scheduler stepped once per optimizer step" if self.track is not None
                    else "the declared schedule")
        return Signal(
            kind="lr_schedule", cause="lr_schedule_mismatch", phase="optimizer", module=None,
            summary=(f"The learning rate diverged from {declared} at step {step}: {ran:.6g} ran instead of {want:.6g} "
                     f"(param group {group}); {shape}."),
            fix=("Step the scheduler exactly once per optimizer step, after optimizer.step() (not per epoch, not per "
                 "micro-batch under gradient accumulation), and check warmup_steps/total_steps and the peak LR given to "
                 "it against the schedule you meant."),
            details=dict(self.divergence),
        )

    # -------------------------------------------------------------- diagnosis
    def _describe(self) -> str:
        assert self._first is not None
        step, group, ran, want = self._first
        peak = self._peak(group)
        observed = self._observed
        meant = [self.meant(t)[group] for t, _ in observed]
        if self.track is not None:
            return self._describe_track(step, group, ran)
        spec = self.spec
        warmup_end = spec.warmup_steps - spec.offset if spec is not None else None
        if (spec is not None and spec.decay != "constant" and warmup_end is not None and step >= warmup_end
                and all(self._close(lr, peak, peak) for _, lr in observed)):
            return f"the LR stayed at its peak {ran:.6g}: it never started to decay after warmup (step {warmup_end})"
        shift = self._shift(group)
        if shift:
            where = "warmup ends" if warmup_end is not None and step < warmup_end else "the schedule runs"
            return (f"the LR that ran is the one meant {abs(shift)} step(s) {'later' if shift > 0 else 'earlier'}: "
                    f"{where} {abs(shift)} step(s) {'early' if shift > 0 else 'late'}")
        ratios = [lr / m for (_, lr), m in zip(observed, meant) if m > 0]
        scaled = bool(ratios) and all(self._close(r, ratios[0], 1.0) for r in ratios)
        implied = self._implied_warmup(group) if spec is not None and warmup_end is not None and step < warmup_end else None
        if scaled and implied is not None and observed[-1][0] < (warmup_end or 0):
            return (f"during warmup the LR is {ratios[0]:.3g}× the one meant: a peak LR of {ratios[0] * peak:.6g} instead of "
                    f"{peak:.6g}, or a warmup of about {implied} steps instead of {spec.warmup_steps}")  # type: ignore[union-attr]
        if scaled:
            return f"the LR is {ratios[0]:.3g}× the one meant all along: a peak (base) LR of {ratios[0] * peak:.6g} instead of {peak:.6g}"
        if implied is not None:
            lag = implied - spec.warmup_steps  # type: ignore[union-attr]
            return (f"warmup lasts about {implied} steps instead of {spec.warmup_steps}: it ends {abs(lag)} step(s) "  # type: ignore[union-attr]
                    f"{'late' if lag > 0 else 'early'}")
        every = self._stepped_every(group)
        if every:
            return (f"the LR that ran is the declared schedule advanced once every {every} optimizer steps (a staircase): "
                    f"it is stepped less often than the optimizer (per epoch?)")
        return "no shift or scaling of the declared schedule explains the LR that ran"

    def _stepped_every(self, group: int) -> int:
        """``k >= 2`` such that the LR that ran at every observed step ``t`` is the one meant at ``first + (t - first) // k``
        (a schedule declared per step, stepped once every ``k`` steps: per epoch), 0 if none."""
        first, peak = self.first_step, self._peak(group)
        last = self._observed[-1][0]
        try:
            for k in range(2, min(last - first, _SEARCH_CAP) + 1):
                if all(self._close(lr, self.meant(first + (t - first) // k)[group], peak) for t, lr in self._observed):
                    return k
        except Exception:  # noqa: BLE001 - a user's schedule callable may not accept every step
            return 0
        return 0

    def _shift(self, group: int) -> int:
        """``k`` such that the LR that ran at every observed step ``t`` is the one meant at ``t + k`` (0 if none)."""
        last = self._observed[-1][0]
        limit = min(4 * (last - self.first_step) + 8, _SEARCH_CAP)
        try:
            for distance in range(1, limit + 1):
                for k in (distance, -distance):
                    if all(t + k >= self.first_step and self._close(lr, self.meant(t + k)[group], self._peak(group))
                           for t, lr in self._observed):
                        return k
        except Exception:  # noqa: BLE001 - a user's schedule callable may not accept every step
            return 0
        return 0

    def _implied_warmup(self, group: int) -> int | None:
        """The warmup length that a linear warmup through the observed LRs would have (None if not consistent)."""
        spec = self.spec
        assert spec is not None
        peak, init = self._peak(group), spec.warmup_init_lr
        values = []
        for t, lr in self._observed:
            s = t + spec.offset
            if s > 0 and init < lr < peak * (1 - self.tolerance):
                values.append(s * (peak - init) / (lr - init))
        if not values or max(values) - min(values) > 1.0:
            return None
        return round(sum(values) / len(values))

    def _describe_track(self, step: int, group: int, ran: float) -> str:
        match = self._find_step(step, group, ran)
        if match is None or match == step:
            return "no step of the scheduler's own schedule has this LR (was the LR changed by hand?)"
        if step > self.first_step and match > step:
            return (f"the LR that ran is the scheduler's value for step {match}: it is stepped about "
                    f"{max(round((match - self.first_step) / (step - self.first_step)), 2)} times per optimizer step")
        return (f"the LR that ran is the scheduler's value for step {match}: it is stepped less often than the optimizer "
                f"(per epoch?)")

    def _find_step(self, step: int, group: int, ran: float) -> int | None:
        """The step of the scheduler's schedule whose LR is ``ran`` (nearest to ``step``), if any."""
        start = self.first_step
        end = min(start + 4 * (step - start) + 8, start + _SEARCH_CAP)
        best: tuple[int, int] | None = None
        for j in range(start, end + 1):
            if self._close(ran, self.meant(j)[group], self._peak(group)):
                distance = abs(j - step)
                if best is None or distance < best[0]:
                    best = (distance, j)
                if j > step and j - step > best[0]:
                    break
        return best[1] if best is not None else None

    def _detach(self) -> None:
        if self._first is not None and self.divergence is None:
            self._report()  # the run ended before the report was due: keep the figures (summary), nothing printed

    def summary(self) -> dict[str, Any]:
        return {"checked_steps": self.checked, "divergence": self.divergence}
