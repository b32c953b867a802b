"""Glue between nantrace's guard and the training frameworks that drive the optimizer.

The integrations live in their own modules, imported explicitly (``import nantrace``
never imports Lightning or transformers):

- :mod:`nantrace.integrations.lightning`: ``NanTraceCallback`` for ``lightning.pytorch``;
- :mod:`nantrace.integrations.hf`: ``NanTraceCallback`` for ``transformers.Trainer``;
- ``nantrace run SCRIPT`` (:mod:`nantrace.autowatch`) for unmodified scripts.

This package module holds the little they share: finding the ``torch.optim.Optimizer``
inside a framework's wrapper (:class:`GuardSession`), and the health figures to send to a logger
(:func:`step_metrics`). These are internal helpers; the callbacks are the public surface.

Usage::

    from nantrace.integrations.lightning import NanTraceCallback
    trainer = lightning.Trainer(callbacks=[NanTraceCallback(run_dir="runs/nantrace")])
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn

__all__: list[str] = []  # the public names live in the submodules (lightning, hf)

def watch_keywords() -> tuple[str, ...]:
    """The keyword-only arguments of ``nantrace.watch`` a callback passes through."""
    from .._watch import watch

    return tuple(n for n, p in inspect.signature(watch).parameters.items() if p.kind is p.KEYWORD_ONLY)


def check_watch_kwargs(watch_kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate a callback's ``**watch_kwargs`` at construction (not at fit time).

    Raises ``TypeError``/``ValueError`` naming the bad option and the valid choices.
    """
    from ..config import Config
    from ..response.policies import POLICIES

    allowed = watch_keywords()
    unknown = sorted(set(watch_kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"{where}: unknown argument(s) {', '.join(map(repr, unknown))}; "
                        f"expected any of {', '.join(allowed)} (the model and optimizer come from the trainer)")
    policy = watch_kwargs.get("on_anomaly", "skip")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"{where}: unknown on_anomaly {policy!r}; expected one of {', '.join(map(repr, POLICIES))}")
    config = watch_kwargs.get("config")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"{where}: config must be a nantrace.Config, got {type(config).__name__}")
    run_dir = watch_kwargs.get("run_dir")
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"{where}: run_dir must be a path (str or os.PathLike) or None, got {type(run_dir).__name__}")
    return dict(watch_kwargs)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside a framework's wrapper (Lightning's
    ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``), or ``optimizer`` itself."""
    inner = optimizer
    for _ in range(4):  # accelerate's wrapper subclasses Optimizer itself: prefer what it wraps
        nxt = getattr(inner, "optimizer", None)
        if nxt is None or nxt is inner or not (isinstance(nxt, torch.optim.Optimizer) or hasattr(nxt, "optimizer")):
            break
        inner = nxt
    if isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "_optimizer_step_pre_hooks"):
        return inner
    raise TypeError(f"nantrace: expected a torch.optim.Optimizer (or a wrapper holding one in .optimizer), "
                    f"got {type(optimizer).__name__}")


class GuardSession:
    """``nantrace.watch`` on the torch optimizer inside a framework's wrapper.

    Steps driven as ``optimizer.step(closure)`` (Lightning) or ``optimizer.step(None)``
    (accelerate) are checked by the guard itself, right after the closure has produced the
    gradients; this class only finds the optimizer and keeps the guard.

    Usage::

        session = GuardSession(model, trainer.optimizers[0], run_dir="runs/x")
        ...
        session.close()
    """

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any = None, **watch_kwargs: Any) -> None:
        import nantrace

        self.optimizer = torch_optimizer(optimizer)
        self.guard = nantrace.watch(model, self.optimizer, scaler, **watch_kwargs)

    @property
    def closed(self) -> bool:
        return self.guard.closed

    def close(self) -> None:
        """Close the guard; idempotent."""
        self.guard.close()


class SessionCallback:
    """What both framework callbacks expose: the guard of the current (or last) run and its incidents."""

    session: GuardSession | None = None

    @property
    def guard(self) -> Any:
        """The :class:`nantrace.Guard` of the current (or last) run, or ``None`` before one."""
        return self.session.guard if self.session is not None else None

    @property
    def incidents(self) -> list[Any]:
        """The guard's incidents so far, oldest first (empty before a run)."""
        return list(self.guard.incidents) if self.guard is not None else []


def step_metrics(guard: Any, prefix: str = "nantrace/") -> dict[str, float]:
    """The guard's last finished step as logger metrics: ``nantrace/loss``, ``grad_norm``,
    ``param_norm``, ``scale`` (with a GradScaler), ``skipped`` (0/1) and ``incidents``
    (the count so far). Empty before the first step."""
    row = guard.last_step
    if row is None:
        return {}
    out: dict[str, float] = {}
    for key in ("loss", "grad_norm", "param_norm", "scale"):
        value = row.get(key)
        if value is not None:
            out[prefix + key] = float(value)
    out[prefix + "skipped"] = float(bool(row.get("skipped")))
    out[prefix + "incidents"] = float(len(guard.incidents))
    return out

