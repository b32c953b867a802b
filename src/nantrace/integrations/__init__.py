"""Glue between nantrace's guard and the training frameworks that drive the optimizer.

The integrations live in their own modules, imported explicitly (``import nantrace``
never imports Lightning or transformers):

- :mod:`nantrace.integrations.lightning`: ``NanTraceCallback`` for ``lightning.pytorch``;
- :mod:`nantrace.integrations.hf`: ``NanTraceCallback`` for ``transformers.Trainer``;
- ``nantrace run SCRIPT`` (:mod:`nantrace.autowatch`) for unmodified scripts.

This package module holds the little they share: finding the ``torch.optim.Optimizer``
inside a framework's wrapper, making steps driven through ``optimizer.step(closure)``
checkable (:class:`GuardSession`), and the health figures to send to a logger
(:func:`step_metrics`). These are internal helpers; the callbacks are the public surface.

Usage::

    from nantrace.integrations.lightning import NanTraceCallback
    trainer = lightning.Trainer(callbacks=[NanTraceCallback(run_dir="runs/nantrace")])
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__: list[str] = []  # the public names live in the submodules (lightning, hf)

WATCH_KEYWORDS = ("run_dir", "on_anomaly", "config")
"""The keyword arguments of ``nantrace.watch`` a callback passes through."""

_NO_RESULT = object()


def check_watch_kwargs(watch_kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate a callback's ``**watch_kwargs`` at construction (not at fit time).

    Raises ``TypeError``/``ValueError`` naming the bad option and the valid choices.
    """
    from ..config import Config
    from ..response.policies import POLICIES

    unknown = sorted(set(watch_kwargs) - set(WATCH_KEYWORDS))
    if unknown:
        raise TypeError(f"{where}: unknown argument(s) {', '.join(map(repr, unknown))}; "
                        f"expected any of {', '.join(WATCH_KEYWORDS)} (the model and optimizer come from the trainer)")
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


def _multi_evaluation(optimizer: torch.optim.Optimizer) -> bool:
    """Optimizers that evaluate the closure several times per step (line searches)."""
    return isinstance(optimizer, torch.optim.LBFGS)


class GuardSession:
    """``nantrace.watch`` plus two optimizer pre-hooks around the guard's own, so that steps
    taken as ``optimizer.step(closure)`` are checked like plain ``optimizer.step()`` calls.

    Lightning (and accelerate, with a positional ``None``) step through a closure that runs
    ``training_step`` and ``backward`` *inside* ``optimizer.step``, after the optimizer's
    pre-hooks. The first hook here runs that closure before the guard's pre-hook (so the
    guard sees the gradients and can block the update) and takes it out of the call; the
    second hands the optimizer a closure that returns the result already computed.
    Multi-evaluation optimizers (LBFGS) are left alone.

    Usage::

        session = GuardSession(model, trainer.optimizers[0], run_dir="runs/x")
        ...
        session.close()        # closes the guard and removes the two hooks
    """

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any = None, **watch_kwargs: Any) -> None:
        import nantrace

        self.optimizer = torch_optimizer(optimizer)
        self._result: Any = _NO_RESULT
        self._handles = [self.optimizer.register_step_pre_hook(self._run_closure_first)]
        try:
            self.guard = nantrace.watch(model, self.optimizer, scaler, **watch_kwargs)
        except BaseException:
            self._handles[0].remove()
            raise
        self._handles.append(self.optimizer.register_step_pre_hook(self._hand_back_result))

    def _run_closure_first(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._result = _NO_RESULT
        positional = len(args) > 1  # args[0] is the optimizer itself
        closure = args[1] if positional else kwargs.get("closure")
        rest = {k: v for k, v in kwargs.items() if k != "closure"}
        if closure is None:
            return (args[:1], rest) if positional or "closure" in kwargs else None
        if self.guard.closed or _multi_evaluation(optimizer):
            return None
        with torch.enable_grad():
            self._result = closure()
        return args[:1] + args[2:], rest

    def _hand_back_result(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._result is _NO_RESULT:
            return None
        result, self._result = self._result, _NO_RESULT
        return args, {**kwargs, "closure": _Cached(result)}

    @property
    def closed(self) -> bool:
        return self.guard.closed

    def close(self) -> None:
        """Close the guard and remove the hooks; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._result = _NO_RESULT
        self.guard.close()


class _Cached:
    """A closure that returns a result computed before the optimizer's step began."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def __call__(self) -> Any:
        return self.result


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

