"""GradScaler instrumentation: the guard wraps a scaler's ``scale``, ``unscale_`` and
``step`` on the instance (there is no hook API; declared in ``nantrace.patches``), and puts
them back on close. Each wrapper passes calls through once its guard is closed.

``scaler.step(optimizer)`` decides the step before the scaler's own skip logic runs, and then
judges the loss scale the decision read (:meth:`~nantrace.detection.scaler.ScalerMonitor.before_update`):
a scale the scaler cannot unscale from (0: its overflow check, made on the scaled values, misses
the NaN that unscaling by 1/0 makes) or below the floor on a step it would apply is a
``scaler_collapse`` at this step, and the update is withheld as for any blocking incident."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .errors import NonFiniteError
from .patches import PatchUnit

if TYPE_CHECKING:
    from .decision import Decision
    from .guard import Guard

_NAMES = ("scale", "unscale_", "step")


def patch_scaler(guard: "Guard", unit: PatchUnit) -> None:
    """Wrap the scaler's methods on the instance, as part of the guard's patch unit (removed with it)."""
    scaler = guard.scaler
    guard_ref = weakref.ref(guard)
    builders = {"scale": _scale, "unscale_": _unscale, "step": _step}
    for name in _NAMES:
        wrapper = builders[name](getattr(scaler, name), guard_ref)
        wrapper._nantrace_guard = True  # type: ignore[attr-defined]
        unit.attribute(scaler, name, wrapper, purpose="the guard's GradScaler instrumentation")


def _scale(original: Callable[..., Any], guard_ref: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(outputs: Any) -> Any:
        scaled = original(outputs)
        guard = guard_ref()
        if guard is not None and not guard.closed and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            guard.recorder.record_loss(outputs)
            try:
                scaled._nantrace_scaled = True  # the backward interceptor then ignores the scaled copy
            except AttributeError:
                pass
        return scaled

    return scale


def _unscale(original: Callable[..., Any], guard_ref: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(optimizer: Any) -> Any:
        out = original(optimizer)
        guard = guard_ref()
        if guard is not None and optimizer is guard.optimizer:
            guard.state.unscaled = True
        return out

    return unscale_


def _step(original: Callable[..., Any], guard_ref: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        guard = guard_ref()
        if guard is None or guard.closed or optimizer is not guard.optimizer or not guard.scaler.is_enabled():
            return original(optimizer, *args, **kwargs)
        decision = guard.decide(grads_scaled=not guard.state.unscaled, via_scaler=True)
        _judge_scale(guard, decision)
        guard.in_scaler_step = True
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            guard.in_scaler_step = False
            guard.restore_grads(decision)
        guard.finish_step(decision)
        return result

    return step


def _judge_scale(guard: "Guard", decision: "Decision") -> None:
    """Before the scaler steps: a loss scale the step's figures cannot be trusted at (an unusable one,
    or one below the floor on a step the scaler would apply) is reported as a collapse of this step and
    its update withheld (``decision.block``: the gradients are set aside before the optimizer runs).
    A collapse whose action stops the run books the step and raises from ``scaler.step()``, before any
    parameter changed."""
    if decision.incident is not None or decision.block:
        return
    collapse = guard.scaler_monitor.before_update(scale=decision.health.scale, skipping=decision.scaler_skip)
    if collapse is None:
        return
    decision.block = True
    try:
        guard.reporter.report_collapse(collapse, decision)
    except NonFiniteError:  # raise / pause (or an escalation to it): the step is booked, nothing was changed
        guard.finish_step(decision, raised=True)
        raise
