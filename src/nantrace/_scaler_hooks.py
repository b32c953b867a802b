"""GradScaler instrumentation: the guard wraps a scaler's ``scale``, ``unscale_`` and
``step`` on the instance (there is no hook API; declared in ``nantrace.patches``), and puts
them back on close. Each wrapper passes calls through once its guard is closed."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .patches import PatchUnit

if TYPE_CHECKING:
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
        guard.in_scaler_step = True
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            guard.in_scaler_step = False
            guard.restore_grads(decision)
        guard.finish_step(decision)
        return result

    return step
