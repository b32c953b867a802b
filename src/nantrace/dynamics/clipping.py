"""Gradient clipping efficacy: how often ``clip_grad_norm_`` fires, the distribution of the
pre-clip norms, and a ``max_norm`` suggested by the run's own healthy norms.

While a guard is open, ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grads_with_norm_``,
the two-call form) are wrapped process-wide (declared in ``nantrace.patches``), restored when
the last guard closes. ``clip_grad_norm_`` returns the total norm *before*
clipping, so the wrapper gets it for free: a device scalar, kept as is and read in batches
(every ``flush_every`` steps, without a synchronisation of its own). A call made with a
name imported before the guard opened (``from torch.nn.utils import clip_grad_norm_`` at
module import) cannot be seen.

Reported as figures (:meth:`ClipMonitor.summary`, run-store meta ``clipping``) and as a
``clipping`` signal when

- clipping fires on almost every step (>= 95% of the last 200): ``max_norm`` is too low and
  every update is rescaled (the effective learning rate is ``lr * max_norm / ‖g‖``);
- it never fires over a long run (2000 steps) while every norm stays 10× below ``max_norm``:
  it would not catch a spike either;
- it is called on gradients still scaled by a GradScaler (``scaler.unscale_`` missing).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..localisation.tracer import user_source
from ..loss_tape import recording_gradient_tapes, untaped
from ..patches import CLIP_FUNCTIONS
from ._common import SafeMonitor
from ._readback import DeferredRead, stack_on
from .base import Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["ClipMonitor", "clipping_wrapper", "suggest_max_norm"]

ClipListener = Callable[[list[torch.Tensor], float, float, torch.Tensor], None]

_ALWAYS_WINDOW = 200
_ALWAYS_FRACTION = 0.95
_NEVER_STEPS = 2000
_NEVER_MARGIN = 10.0
_SUGGEST_QUANTILE = 0.95
_KEEP = 8192
"""Pre-clip norms kept for the distribution (the most recent ones)."""
_META_EVERY = 512
"""Steps between refreshes of the run-store meta ``clipping`` (and at close)."""


def suggest_max_norm(pre_clip_norms: Any, quantile: float = _SUGGEST_QUANTILE) -> float | None:
    """A ``max_norm`` that clips only the largest ``1 - quantile`` of a run's finite pre-clip norms."""
    values = np.asarray(pre_clip_norms, dtype=np.float64)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return None
    return float(np.quantile(values, quantile))


def clipping_wrapper(original: Callable[..., Any], patch: Any, kind: str) -> Callable[..., Any]:
    """The wrapper ``nantrace.patches`` installs over a clipping function of ``torch.nn.utils``:
    ``kind`` ``"norm"`` for ``clip_grad_norm_`` (it returns the pre-clip norm), ``"with_norm"`` for
    ``clip_grads_with_norm_`` (the two-call form, given the norm)."""
    names = tuple(inspect.signature(original).parameters)  # parameters, max_norm, norm_type | total_norm, ...

    @functools.wraps(original)
    def clip(*args: Any, **kwargs: Any) -> Any:
        patch.enter()
        try:
            listeners = patch.listeners()
            if not listeners:
                patch.tidy()
                return original(*args, **kwargs)
            args, params = _materialise(args, kwargs)
            tapes = recording_gradient_tapes()
            try:
                if tapes:  # one call on the gradient tape, not the clip's own ops
                    with untaped():
                        out = original(*args, **kwargs)
                    source = user_source(2)
                    for tape in tapes:
                        tape.keep_call(original, args, kwargs, out, source)
                else:
                    out = original(*args, **kwargs)
            except Exception as exc:  # error_if_nonfinite=True on a non-finite norm: a value check that raised
                _note_raised(exc)
                raise
            max_norm = _arg(args, kwargs, names, "max_norm", None)
            if kind == "norm":
                norm_type, total = _arg(args, kwargs, names, "norm_type", 2.0), out
            else:
                norm_type, total = 2.0, _arg(args, kwargs, names, "total_norm", None)
            if isinstance(total, torch.Tensor) and max_norm is not None:
                with untaped():  # nantrace's own work, not the step's
                    for listener in listeners:
                        listener(params, float(max_norm), float(norm_type), total)
            return out
        finally:
            patch.leave()

    return clip


def _note_raised(exc: BaseException) -> None:
    """Hand an exception a clipping call raised (``error_if_nonfinite=True`` on a NaN gradient) to the guards
    that note a value check's exception (``patches.VALUE_CHECK_FUNCTIONS``' listeners, ``Guard.note_exception``):
    it is raised after ``backward()``, outside every other hook, and a loop that catches it zeroes the
    gradients that show why. Never raises."""
    from ..patches import VALUE_CHECK_FUNCTIONS

    listeners: dict[Any, Callable[[BaseException], None]] = {}
    for patch in VALUE_CHECK_FUNCTIONS:
        for listener in patch.listeners():
            listeners.setdefault(listener, listener)
    for listener in listeners.values():
        try:
            listener(exc)
        except Exception:  # noqa: BLE001 - the user's exception goes on unchanged
            pass


def _materialise(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """Turn the ``parameters`` argument (often a generator) into a list both the original and we can read."""
    params = args[0] if args else kwargs.get("parameters", ())
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if args:
        return (params, *args[1:]), params
    kwargs["parameters"] = params
    return args, params


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    position = names.index(name) if name in names else len(args)
    return args[position] if position < len(args) else default


class ClipMonitor(SafeMonitor):
    """Observes the clipping calls that touch the watched parameters."""

    name = "clipping statistics"
    summary_key = "clipping"

    def __init__(self, *, warmup: int, flush_every: int = 32, warn: bool = True) -> None:
        super().__init__()
        self.warmup = warmup
        self.warn = warn
        self.flush_every = flush_every
        self.calls = 0
        self.clip_steps = 0
        self.clipped_steps = 0
        self.max_norm: float | None = None
        self.pre_norms: deque[float] = deque(maxlen=_KEEP)
        self._healthy: deque[float] = deque(maxlen=_KEEP)
        self._recent: deque[bool] = deque(maxlen=_ALWAYS_WINDOW)
        self._judged_from = False
        """The last step read was past the warm-up: the clipping rate is judged."""
        self._max_seen = 0.0
        self._ids: set[int] = set()
        self._step_calls: list[tuple[torch.Tensor, float]] = []
        self._unread: list[tuple[int, bool, list[float], list[torch.Tensor]]] = []
        self._reading: tuple[list[tuple[int, bool, list[float]]], DeferredRead] | None = None
        self._fired: set[str] = set()
        self._scaled_call: bool = False
        self._registered = False
        self._meta_at = -_META_EVERY

    def _attach(self, watched: "Watched") -> None:
        self._ids = {id(p) for p in watched.params}
        for patch in CLIP_FUNCTIONS:
            patch.add(id(self), self._on_clip)
        self._registered = True

    def _uninstall(self) -> None:
        if self._registered:
            for patch in CLIP_FUNCTIONS:
                patch.remove(id(self))
            self._registered = False

    def _on_clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float, total: torch.Tensor) -> None:
        try:
            self._record_clip(params, max_norm, total)
        except Exception as exc:  # noqa: BLE001 - never break the user's clipping call
            self._fail(exc)

    def _record_clip(self, params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
        if not self.active or not params or not any(id(p) in self._ids for p in params[:4]):
            return
        watched = self._watched
        if watched is None or watched.closed:
            return
        scaler = watched.scaler
        if scaler is not None and scaler.is_enabled() and not watched.unscaled:
            self._scaled_call = True
        self._step_calls.append((total.detach().reshape(()), max_norm))

    def _on_step(self, ctx: StepContext) -> list[Signal]:
        signals: list[Signal] = []
        if self._scaled_call and "scaled" not in self._fired and self.warn:
            self._fired.add("scaled")
            signals.append(self._scaled_signal())
        self._scaled_call = False
        if self._reading is not None:
            signals += self._finish(*self._reading)
            self._reading = None
        if self._step_calls:
            calls, self._step_calls = self._step_calls, []
            self._unread.append((ctx.step, ctx.applied, [m for _, m in calls], [t for t, _ in calls]))
        if self._unread and (len(self._unread) >= self.flush_every or ctx.step % self.flush_every == 0):
            self._start_read()
        return signals

    def _start_read(self) -> None:
        unread, self._unread = self._unread, []
        tensors = [t for _, _, _, ts in unread for t in ts]
        device = tensors[0].device
        self._reading = ([(s, a, m) for s, a, m, _ in unread], DeferredRead(stack_on(tensors, device)))

    def _finish(self, steps: list[tuple[int, bool, list[float]]], read: DeferredRead) -> list[Signal]:
        values = read.get()
        k = 0
        for step, applied, max_norms in steps:
            clipped = False
            for max_norm in max_norms:
                pre = values[k]
                k += 1
                self.calls += 1
                self.max_norm = max_norm
                self.pre_norms.append(pre)
                clipped = clipped or (math.isfinite(pre) and pre > max_norm)
                if math.isfinite(pre):
                    self._max_seen = max(self._max_seen, pre)
                    if applied and step >= self.warmup:
                        self._healthy.append(pre)
            self.clip_steps += 1
            self.clipped_steps += clipped
            self._recent.append(clipped)  # every step is evidence; the judging waits for the warm-up to end
            self._judged_from = step >= self.warmup
        signals = self._judge()
        if self.clip_steps - self._meta_at >= _META_EVERY or signals:
            self._write_meta()
        return signals

    def _write_meta(self) -> None:
        store = self._store()
        if store is not None:
            store.set_meta("clipping", self.summary())
        self._meta_at = self.clip_steps

    def _store(self) -> Any:
        return self._watched.store if self._watched is not None else None

    # -------------------------------------------------------------- judgements
    def _judge(self) -> list[Signal]:
        signals: list[Signal] = []
        if not self.warn:
            return signals
        if ("always" not in self._fired and self._judged_from and len(self._recent) >= _ALWAYS_WINDOW
                and sum(self._recent) >= _ALWAYS_FRACTION * len(self._recent)):
            self._fired.add("always")
            s = self.summary()
            q = s["pre_clip_norm"]
            signals.append(Signal(
                kind="clipping", cause="clip_threshold", phase="optimizer", module=None,
                summary=(f"Gradient clipping fired on {sum(self._recent) / len(self._recent):.0%} of the last "
                         f"{len(self._recent)} steps (max_norm={self.max_norm:g}, median pre-clip norm {q['p50']:.3g}): "
                         f"every update is rescaled, so the effective learning rate is lr·max_norm/‖g‖, not lr."),
                fix=(f"Raise max_norm to about {s['suggested_max_norm']:.3g} (the {_SUGGEST_QUANTILE:.0%} quantile of this "
                     f"run's healthy pre-clip norms) so that clipping catches spikes only, or lower the learning rate if "
                     f"the large norms are the problem."),
                details=s,
            ))
        if ("never" not in self._fired and self.clip_steps >= _NEVER_STEPS and self.clipped_steps == 0
                and self.max_norm is not None and 0 < self._max_seen < self.max_norm / _NEVER_MARGIN):
            self._fired.add("never")
            s = self.summary()
            signals.append(Signal(
                kind="clipping", cause="clip_threshold", phase="optimizer", module=None,
                summary=(f"Gradient clipping never fired in {self.clip_steps} steps: the largest pre-clip norm was "
                         f"{self._max_seen:.3g}, more than {_NEVER_MARGIN:g}× below max_norm={self.max_norm:g}, so it would "
                         f"not stop a spike either."),
                fix=(f"Set max_norm near {s['suggested_max_norm']:.3g} (the {_SUGGEST_QUANTILE:.0%} quantile of this run's "
                     f"healthy pre-clip norms), or drop clipping if you rely on nantrace's guard for spikes."),
                details=s,
            ))
        return signals

    def _scaled_signal(self) -> Signal:
        return Signal(
            kind="clipping", cause="clip_threshold", phase="optimizer", module=None,
            summary=("clip_grad_norm_ was called on gradients still multiplied by the GradScaler's scale: max_norm is "
                     "compared with scaled norms, so clipping fires almost always and shrinks every update."),
            fix="Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_(...), then scaler.step(optimizer).",
            details={},
        )

    def _detach(self) -> None:
        try:
            if self._step_calls:  # clipped after the last step: counted, not judged healthy
                calls, self._step_calls = self._step_calls, []
                self._unread.append((self.watched.step, False, [m for _, m in calls], [t for t, _ in calls]))
            if self._reading is not None:
                self._finish(*self._reading)
                self._reading = None
            if self._unread:
                self._start_read()
                assert self._reading is not None
                self._finish(*self._reading)
                self._reading = None
            self._write_meta()
        finally:
            self._uninstall()

    def summary(self) -> dict[str, Any]:
        """Clipping figures so far: calls, steps clipped and their fraction, max_norm, pre-clip
        norm quantiles (finite values; ``nonfinite`` counts the others) and a suggested max_norm."""
        values = np.asarray(self.pre_norms, dtype=np.float64)
        finite = values[np.isfinite(values)]
        quantiles = {}
        if len(finite):
            for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                quantiles[name] = float(np.quantile(finite, q))
            quantiles["max"] = float(finite.max())
        healthy = self._healthy if len(self._healthy) >= 50 else [v for v in values if math.isfinite(v)]
        return {
            "calls": self.calls,
            "steps": self.clip_steps,
            "steps_clipped": self.clipped_steps,
            "fraction_clipped": self.clipped_steps / self.clip_steps if self.clip_steps else None,
            "max_norm": self.max_norm,
            "pre_clip_norm": quantiles,
            "nonfinite": int(len(values) - len(finite)),
            "suggested_max_norm": suggest_max_norm(list(healthy)),
        }
