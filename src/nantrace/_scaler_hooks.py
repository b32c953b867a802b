"""GradScaler instrumentation: the guard wraps a scaler's ``scale``, ``unscale_`` and
``step`` on the instance (there is no hook API), and puts them back on close."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .guard import Guard

_NAMES = ("scale", "unscale_", "step")


def patch_scaler(guard: "Guard") -> dict[str, Any]:
    """Wrap the scaler's methods; returns what to restore (``None`` = no instance attribute before)."""
    scaler = guard.scaler
    guard_ref = weakref.ref(guard)
    originals: dict[str, Any] = {}
    builders = {"scale": _scale, "unscale_": _unscale, "step": _step}
    for name in _NAMES:
        originals[name] = scaler.__dict__.get(name)
        wrapper = builders[name](getattr(scaler, name), guard_ref)
        wrapper._nantrace_guard = True
        setattr(scaler, name, wrapper)
    return originals


def unpatch_scaler(scaler: Any, originals: dict[str, Any]) -> None:
    """Put back what :func:`patch_scaler` replaced, if it is still ours."""
    for name, original in originals.items():
        current = scaler.__dict__.get(name)
        if current is not None and getattr(current, "_nantrace_guard", False):
            if original is None:
                del scaler.__dict__[name]
            else:
                setattr(scaler, name, original)


def _scale(original: Callable[..., Any], guard_ref: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(outputs: Any) -> Any:
        scaled = original(outputs)
        guard = guard_ref()
        if guard is not None and not guard.closed and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            guard._record_loss(outputs)
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
            guard._unscaled = True
        return out

    return unscale_


def _step(original: Callable[..., Any], guard_ref: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        guard = guard_ref()
        if guard is None or guard.closed or optimizer is not guard.optimizer or not guard.scaler.is_enabled():
            return original(optimizer, *args, **kwargs)
        decision = guard._decide(grads_scaled=not guard._unscaled, via_scaler=True)
        guard._in_scaler_step = True
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            guard._in_scaler_step = False
            guard._restore_grads(decision)
        guard._finish_step(decision)
        return result

    return step
