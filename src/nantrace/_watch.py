"""``nantrace.watch``: validate the arguments, then build the :class:`~nantrace.guard.Guard`."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ._user_traceback import install_excepthook
from .config import Config
from .guard import Guard
from .response.policies import POLICIES


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Lightning's ``LightningOptimizer``,
    accelerate's ``AcceleratedOptimizer``, which subclasses Optimizer without its hooks)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    *,
    run_dir: str | os.PathLike[str] | None = None,
    on_anomaly: str = "skip",
    config: Config | None = None,
) -> Guard:
    """Watch ``model`` (and ``optimizer``/``scaler``) for numerical failures; see :class:`Guard`.

    Arguments are validated before anything is hooked: a bad one raises ``TypeError`` or
    ``ValueError`` naming what was expected, and leaves nothing behind.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"nantrace.watch: model must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = _unwrap_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"nantrace.watch: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if scaler is not None:
        if not all(callable(getattr(scaler, n, None)) for n in ("scale", "step", "update", "unscale_", "is_enabled")):
            raise TypeError(f"nantrace.watch: scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        if optimizer is None:
            raise ValueError("nantrace.watch: a scaler was given without an optimizer; pass the optimizer the scaler steps")
    if not isinstance(on_anomaly, str) or on_anomaly not in POLICIES:
        raise ValueError(f"nantrace.watch: unknown on_anomaly {on_anomaly!r}; expected one of {', '.join(map(repr, POLICIES))}")
    if config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise TypeError(f"nantrace.watch: config must be a nantrace.Config, got {type(config).__name__}")
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"nantrace.watch: run_dir must be a path (str or os.PathLike) or None, got {type(run_dir).__name__}")
    if run_dir is not None and os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"nantrace.watch: run_dir {os.fspath(run_dir)!r} exists and is not a directory")
    if on_anomaly in ("raise", "pause"):
        install_excepthook()  # an uncaught NonFiniteError is shown ending in the user's frames
    return Guard(model, optimizer, scaler, run_dir=run_dir, on_anomaly=on_anomaly, config=config)
