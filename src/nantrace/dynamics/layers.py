"""Per-layer statistics: gradient norm, parameter norm and update/parameter ratio.

The gradient and parameter norms of each layer are combined on the host from the
per-tensor norms that the guard's one fused check already read (``ctx.health``): nothing
is recomputed and nothing is synchronised. The update/parameter ratio ‖Δθ‖/‖θ‖ needs the
parameters before the update, so on sampled steps (``update_stats_every``) they are
copied just before the update (one fused copy); after the update, the norms of the
difference are reduced on the device (foreach kernels) and read back at the next step
without a synchronisation of their own (:class:`~nantrace.dynamics._readback.DeferredRead`).

Rows go to the run store's ``layer_stats`` table (``meta.layer_names`` labels them); the
figures feed the early warnings (:mod:`nantrace.dynamics.early_warnings`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..detection.sentinel import local
from ._common import SafeMonitor, is_sampled
from ._layers import LayerIndex
from ._readback import DeferredRead, accumulation_dtype, safe_norms, stack_on
from .base import Signal, StepContext
from .early_warnings import LayerWarnings, WarningSettings

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["LayerFigures", "LayerStatsMonitor", "update_norms"]


@dataclasses.dataclass
class LayerFigures:
    """One step's per-layer figures (arrays aligned with ``LayerIndex.names``; NaN = absent or non-finite)."""

    step: int
    grad_norm: np.ndarray
    param_norm: np.ndarray
    grad_present: np.ndarray
    param_present: np.ndarray
    update_ratio: np.ndarray | None = None

    def rows(self) -> list[tuple[int, float | None, float | None, float | None]]:
        """Run-store rows ``(layer, grad_norm, param_norm, update_ratio)``: absent → NULL, NaN kept."""
        out = []
        for i in range(len(self.grad_norm)):
            g = float(self.grad_norm[i]) if self.grad_present[i] else None
            p = float(self.param_norm[i]) if self.param_present[i] else None
            u = None
            if self.update_ratio is not None and not (math.isnan(self.update_ratio[i]) and self.param_norm[i] == 0):
                u = float(self.update_ratio[i])
            if g is None and p is None and u is None:
                continue
            out.append((i, g, p, u))
        return out


@dataclasses.dataclass
class _Row:
    """A healthy step's figures, kept until the next flush (:attr:`LayerStatsMonitor.BATCH`)."""

    step: int
    grad_norms: list[float]
    param_norms: list[float] | None
    observe: bool


@dataclasses.dataclass
class _PendingUpdate:
    figures: LayerFigures
    read: DeferredRead
    has_param_norms: bool
    n: int


def update_norms(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    """‖after_i − before_i‖ per tensor, as 0-dim tensors accumulated in float64 (they cannot overflow where
    the weights are finite); overwrites ``before`` (foreach, no sync)."""
    try:
        torch._foreach_sub_(before, after)
    except (RuntimeError, TypeError):
        for b, a in zip(before, after):
            b.sub_(a)
    return safe_norms(before)


def _copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_mul(tensors, 1.0))
    except (RuntimeError, TypeError):
        return [t.clone() for t in tensors]


class LayerStatsMonitor(SafeMonitor):
    """Per-layer gradient/parameter norms every ``every`` steps, update ratios every ``update_every``.

    ``latest`` holds the last step's :class:`LayerFigures` and ``latest_update`` the last
    figures with an update ratio (one step late), e.g. for TensorBoard.

    The figures of healthy steps are combined in batches of up to :attr:`BATCH` steps (one pass of
    array arithmetic instead of one per step: a dozen small NumPy calls cost ~0.15 ms a step on the
    CPU, cold after the user's backward). A batch ends before any step that is not a plain healthy
    one (a blocked update, a non-finite figure, an update-ratio step) and at the sample that
    completes a block or is judged by the early warnings, so every warning is reported at the
    step of its own sample, as without batching; the run store gets the rows at the flush.
    """

    name = "layer statistics"
    summary_key = "layers"
    BATCH = 8

    def __init__(self, *, every: int, update_every: int, warnings: WarningSettings | None) -> None:
        super().__init__()
        self.every = every
        self.update_every = update_every
        self.settings = warnings
        self.index = LayerIndex([])
        self.warnings: LayerWarnings | None = None
        self.latest_update: LayerFigures | None = None
        self._params: list[torch.Tensor] = []
        self._before: list[torch.Tensor] | None = None
        self._pending: _PendingUpdate | None = None
        self._rows: list[_Row] = []
        self._counted = 0
        """Rows in ``_rows`` that the early warnings will count as samples."""
        self._latest: LayerFigures | None = None
        self._last_param: np.ndarray | None = None
        """The per-layer parameter norms of the last step that read them all: between such steps
        (``DetectionConfig.param_check_every``) the early warnings' ‖g‖/‖θ‖ divides by these (the
        weights move by a small fraction per step); the rows of those steps leave them out."""

    def _attach(self, watched: "Watched") -> None:
        self._params = watched.params
        self.index = LayerIndex(watched.param_names)
        self.index.set_numel([p.numel() for p in self._params])
        if self.settings is not None:
            self.warnings = LayerWarnings(self.index.names, self.settings)
        if watched.store is not None:
            watched.store.set_meta("layer_names", self.index.names)

    def _before_update(self, step: int, params: list[torch.Tensor]) -> None:
        self._before = None
        if is_sampled(step, self.update_every) and params:
            self._before = _copy([local(p.detach()) for p in params])

    @property
    def latest(self) -> LayerFigures | None:
        """The last step's figures (the rows still batched are combined first)."""
        self._flush()  # a batch never holds a sample that completes a block or is judged: no signal is lost
        return self._latest

    def _on_step(self, ctx: StepContext) -> list[Signal]:
        signals: list[Signal] = []
        if self._pending is not None:
            signals += self._finish_update(self._pending)
            self._pending = None
        before, self._before = self._before, None
        update_now = before is not None and ctx.applied
        sampled = is_sampled(ctx.step, self.every)
        if not (sampled or update_now):
            return signals
        health = ctx.health
        healthy = ctx.applied and health.grads_finite and health.loss_finite
        observe = self.warnings is not None and sampled and healthy
        if healthy and not update_now and len(ctx.grad_index) == len(self.index.layer_of):
            full = len(health.param_norms) == len(self.index.layer_of)
            self._rows.append(_Row(ctx.step, health.grad_norms, health.param_norms if full else None, observe))
            assert self.warnings is None or self.settings is not None
            if observe and self.settings is not None and ctx.step >= self.settings.warmup:
                self._counted += 1
            due = self.warnings is not None and self._counted >= self.warnings.samples_to_next_judgement()
            if len(self._rows) >= self.BATCH or due:
                signals += self._flush()
            return signals
        signals += self._flush()
        figures = self._figures(ctx)
        self._latest = figures
        if update_now:
            assert before is not None
            self._pending = self._start_update(figures, before)
        else:
            self._write([figures])
        if observe and self.warnings is not None:
            param = figures.param_norm if figures.param_present.all() or self._last_param is None else self._last_param
            signals += self.warnings.observe_norms(ctx.step, figures.grad_norm, param)
        return signals

    def _flush(self) -> list[Signal]:
        """Combine, store and observe the batched rows, in order."""
        rows, self._rows, self._counted = self._rows, [], 0
        if not rows:
            return []
        n = len(self.index)
        grad = self.index.combine_rows([r.grad_norms for r in rows])
        everywhere = np.ones(n, dtype=bool)
        nowhere = np.zeros(n, dtype=bool)
        absent = np.full(n, np.nan)
        figures, seen = [], []
        for row, g in zip(rows, grad):
            if row.param_norms is not None:
                param = self._last_param = self.index.combine(row.param_norms)
                figures.append(LayerFigures(row.step, g, param, everywhere, everywhere))
            else:
                param = self._last_param if self._last_param is not None else absent
                figures.append(LayerFigures(row.step, g, absent, everywhere, nowhere))
            seen.append(param)
        self._latest = figures[-1]
        self._write(figures)
        observed = [i for i, r in enumerate(rows) if r.observe]
        if self.warnings is None or not observed:
            return []
        return self.warnings.observe_many([rows[i].step for i in observed], grad[observed],
                                          np.stack([seen[i] for i in observed]))

    def _figures(self, ctx: StepContext) -> LayerFigures:
        health = ctx.health
        grad = self.index.combine(health.grad_norms, ctx.grad_index)
        grad_present = self.index.present(ctx.grad_index)
        if len(health.param_norms) == len(self.index.layer_of):
            param = self.index.combine(health.param_norms)
            param_present = np.ones(len(self.index), dtype=bool)
            self._last_param = param
        else:  # not read this step (param_check_every), or not checked at all (check_params=False)
            param = np.full(len(self.index), np.nan)
            param_present = np.zeros(len(self.index), dtype=bool)
        return LayerFigures(ctx.step, grad, param, grad_present, param_present)

    def _start_update(self, figures: LayerFigures, before: list[torch.Tensor]) -> _PendingUpdate:
        params = [local(p.detach()) for p in self._params]
        extra = [] if figures.param_present.all() else safe_norms(before)  # the step's own (pre-update) norms
        diff = update_norms(before, params)
        del before
        device = params[0].device
        values = stack_on(diff + extra, device, accumulation_dtype(device))
        if self.watched.sharded and self.watched.world_size > 1:  # shard norms -> the parameter's norm
            values = values.square()
            torch.distributed.all_reduce(values)
            values = values.sqrt()
        return _PendingUpdate(figures, DeferredRead(values), bool(extra), len(params))

    def _finish_update(self, pending: _PendingUpdate) -> list[Signal]:
        values = np.asarray(pending.read.get(), dtype=np.float64)
        figures = pending.figures
        delta = self.index.combine(values[: pending.n])
        if pending.has_param_norms:
            figures.param_norm = self.index.combine(values[pending.n:])
            figures.param_present = np.ones(len(self.index), dtype=bool)
        with np.errstate(divide="ignore", invalid="ignore"):
            figures.update_ratio = delta / figures.param_norm
        self.latest_update = figures
        self._write([figures])
        if self.warnings is not None:
            return self.warnings.observe_update_ratio(figures.step, figures.update_ratio)
        return []

    def _write(self, figures: list[LayerFigures]) -> None:
        store = self.watched.store
        if store is not None:
            with store.transaction():
                for f in figures:
                    store.log_layer_stats(f.step, f.rows())

    def _detach(self) -> None:
        self._flush()  # signals after the last step are not reported
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish_update(pending)  # signals after the last step are not reported
        self._before = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.index.names)}
        if self.latest_update is not None and self.latest_update.update_ratio is not None:
            out["update_ratio_step"] = self.latest_update.step
            out["update_ratio"] = {n: float(r) for n, r in zip(self.index.names, self.latest_update.update_ratio)}
        return out
