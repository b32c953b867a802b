"""TensorBoard export of the run's trajectory (``Config.tensorboard``).

Every step: scalars ``loss``, ``grad_norm``, ``param_norm``, ``lr/group<i>``, ``scale`` (with a
GradScaler), ``skipped`` and ``nonfinite/health`` (how many of loss / grad norm / param norm
were NaN or Inf at that step: TensorBoard's charts do not draw NaN points, so the count
makes them visible).

On sampled steps (``update_stats_every``, default 25): per-layer histograms of the gradient
*values* under ``grad/<layer>``, computed on the device over fixed symmetric log-spaced
buckets, of the finite values only, with the non-finite ones counted beside them in
``nonfinite/<layer>`` (never dropped silently); per-layer ``layer_grad_norm/<layer>`` and
``update_ratio/<layer>``; and what the other dynamics monitors measured since the last
sample (activation abs-max and non-finite counts, Adam state, logit saturation, clipping).

TensorBoard is optional: ``pip install 'nantrace[tensorboard]'``; it is imported when a
guard with ``Config.tensorboard`` is created, and a missing install fails then, saying so.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..dynamics._common import SafeMonitor, is_sampled
from ..dynamics._layers import LayerIndex
from ..dynamics._readback import DeferredRead, stack_on
from ..dynamics.base import Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["BUCKET_LIMITS", "TensorBoardMonitor", "gradient_histogram", "open_writer"]

_DECADES = np.arange(-12.0, 4.0 + 1e-9, 0.25)
_POSITIVE = 10.0 ** _DECADES
BUCKET_LIMITS = np.concatenate([-_POSITIVE[::-1], [0.0], _POSITIVE, [np.finfo(np.float64).max]])
"""Upper limits of the histogram buckets: ±1e-12 … ±1e4 in quarter decades, 0, and a last open bucket."""
_NB = len(BUCKET_LIMITS)


def open_writer(logdir: str) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``logdir``; ``ImportError`` with the pip command if missing."""
    from .._imports import require

    require("tensorboard", feature="Config.tensorboard (nantrace's TensorBoard export)")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(f"Config.tensorboard (nantrace's TensorBoard export) needs TensorBoard: run "
                          f"`pip install 'nantrace[tensorboard]'` ({exc})") from exc
    return SummaryWriter(log_dir=logdir)


def gradient_histogram(grad: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Histogram of one tensor's finite values plus its statistics, on the device, no sync.

    ``limits`` are the ascending upper limits of all buckets but the last, open one, so there
    are ``len(limits) + 1`` counts. Returns ``[count per bucket..., non-finite count, finite
    count, min, max, sum, sum of squares]`` (float64); ``min``/``max`` are ±inf when no value is finite.
    """
    g = grad.detach().reshape(-1)
    if g.is_sparse:
        g = g.coalesce().values().reshape(-1)
    finite = g.abs() < math.inf  # NaN < inf is False; torch.isfinite is much slower on the CPU
    values = torch.where(finite, g, 0).to(torch.float64)
    weight = finite.to(torch.float64)
    bucket = torch.bucketize(values, limits)
    counts = torch.zeros(len(limits) + 1, dtype=torch.float64, device=g.device).index_add_(0, bucket, weight)
    inf = torch.full((), math.inf, dtype=torch.float64, device=g.device)
    n_finite = weight.sum()
    stats = torch.stack([
        g.numel() - n_finite,
        n_finite,
        torch.where(finite, values, inf).amin() if g.numel() else inf,
        torch.where(finite, values, -inf).amax() if g.numel() else -inf,
        values.sum(),
        (values * values).sum(),
    ])
    return torch.cat([counts, stats])


class TensorBoardMonitor(SafeMonitor):
    """Writes the trajectory to a TensorBoard event file; see the module docstring for the tags."""

    name = "TensorBoard export"

    def __init__(self, *, logdir: bool | str | os.PathLike[str], every: int, peers: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.logdir_setting = logdir
        self.every = every
        self.peers = dict(peers or {})
        self.logdir: str | None = None
        self.writer: Any = None
        self.index = LayerIndex([])
        self._limits: torch.Tensor | None = None
        self._pending: tuple[int, list[int], DeferredRead] | None = None
        self._seen: dict[str, int] = {}

    def _attach(self, watched: "Watched") -> None:
        setting = self.logdir_setting
        if setting is True:
            if watched.run_dir is None:
                raise ValueError("Config.tensorboard=True writes to RUN_DIR/tensorboard, but watch() got no run_dir; "
                                 "pass run_dir=... or give Config.tensorboard a log directory")
            self.logdir = os.path.join(watched.run_dir, "tensorboard")
        else:
            self.logdir = os.fspath(setting)  # type: ignore[arg-type]
        self.writer = open_writer(self.logdir)
        self.index = LayerIndex(watched.param_names)
        if watched.store is not None:
            watched.store.set_meta("tensorboard", self.logdir)

    # ------------------------------------------------------------------ steps
    def _on_step(self, ctx: StepContext) -> list[Signal]:
        w = self.writer
        s = ctx.step
        h = ctx.health
        nonfinite = 0
        for tag, value in (("loss", h.loss), ("grad_norm", h.grad_norm), ("param_norm", h.param_norm)):
            if value is None:
                continue
            w.add_scalar(tag, value, s)
            nonfinite += not math.isfinite(value)
        w.add_scalar("nonfinite/health", nonfinite, s)
        for g, lr in enumerate(ctx.lrs):
            w.add_scalar(f"lr/group{g}", lr, s)
        if h.scale is not None:
            w.add_scalar("scale", h.scale, s)
        w.add_scalar("skipped", int(not ctx.applied), s)
        if self._pending is not None:
            self._finish(*self._pending)
            self._pending = None
        if is_sampled(s, self.every):
            self._start_histograms(s, ctx)
            self._layer_scalars(s)
        self._peer_scalars()
        return []

    def _start_histograms(self, step: int, ctx: StepContext) -> None:
        params = self.watched.params
        which = [i for i in ctx.grad_index if params[i].grad is not None]
        if not which:
            return
        device = params[which[0]].grad.device  # type: ignore[union-attr]
        if self._limits is None or self._limits.device != device:
            self._limits = torch.as_tensor(BUCKET_LIMITS[:-1], dtype=torch.float64, device=device)
        parts = [gradient_histogram(params[i].grad, self._limits) for i in which]  # type: ignore[arg-type]
        self._pending = (step, which, DeferredRead(stack_on(parts, device, dtype=torch.float64)))

    def _finish(self, step: int, which: list[int], read: DeferredRead) -> None:
        values = np.asarray(read.get(), dtype=np.float64).reshape(len(which), _NB + 6)
        layers = self.index.layer_of[np.asarray(which)]
        for layer in np.unique(layers):
            rows = values[layers == layer]
            counts = rows[:, :_NB].sum(0)
            nonfinite, n, lo, hi, total, squares = (rows[:, _NB + k] for k in range(6))
            name = self.index.names[layer] or "(root)"
            self.writer.add_scalar(f"nonfinite/{name}", float(nonfinite.sum()), step)
            if n.sum() <= 0:
                continue
            used = np.flatnonzero(counts)
            first, last = max(int(used[0]) - 1, 0), min(int(used[-1]) + 1, _NB - 1)
            limits = BUCKET_LIMITS[first:last + 1].copy()
            if last == _NB - 1:  # the open last bucket ends at the largest value
                limits[-1] = max(float(hi.max()), float(BUCKET_LIMITS[-2]))
            self.writer.add_histogram_raw(
                f"grad/{name}", min=float(lo.min()), max=float(hi.max()), num=int(n.sum()), sum=float(total.sum()),
                sum_squares=float(squares.sum()), bucket_limits=limits.tolist(),
                bucket_counts=counts[first:last + 1].tolist(), global_step=step)

    def _layer_scalars(self, step: int) -> None:
        layers = self.peers.get("layers")
        if layers is None:
            return
        latest = layers.latest
        if latest is not None and latest.step == step:
            finite = []
            for i, name in enumerate(layers.index.names):
                if latest.grad_present[i]:
                    value = float(latest.grad_norm[i])
                    self.writer.add_scalar(f"layer_grad_norm/{name or '(root)'}", value, step)
                    if math.isfinite(value):
                        finite.append(value)
            if finite:
                self.writer.add_histogram("layer_grad_norms", np.asarray(finite), step)

    def _peer_scalars(self) -> None:
        w = self.writer
        layers = self.peers.get("layers")
        if layers is not None and layers.latest_update is not None and self._fresh("update", layers.latest_update.step):
            f = layers.latest_update
            for name, ratio, present in zip(layers.index.names, f.update_ratio, f.param_present):
                if present:
                    w.add_scalar(f"update_ratio/{name or '(root)'}", float(ratio), f.step)
        activations = self.peers.get("activations")
        if activations is not None and activations.latest is not None and self._fresh("act", activations.latest.step):
            f = activations.latest
            for i, absmax, nonfinite in f.rows:
                name = activations.names[i] or "(root)"
                w.add_scalar(f"activation_absmax/{name}", absmax, f.step)
                w.add_scalar(f"activation_nonfinite/{name}", nonfinite, f.step)
        adam = self.peers.get("optimizer_state")
        if adam is not None and adam.latest is not None and self._fresh("adam", adam.latest.step):
            f = adam.latest
            for i, name in enumerate(adam.index.names):
                if f.present[i]:
                    w.add_scalar(f"adam_exp_avg_norm/{name or '(root)'}", float(f.exp_avg_norm[i]), f.step)
                    w.add_scalar(f"adam_underflow/{name or '(root)'}", float(f.underflow_fraction[i]), f.step)
        logits = self.peers.get("logits")
        if logits is not None and logits.latest is not None and self._fresh("logits", logits.latest.step):
            f = logits.latest
            w.add_scalar("logits/mean_max_prob", f.mean_max_prob, f.step)
            w.add_scalar("logits/saturated_rows", f.saturated_rows, f.step)
            w.add_scalar("logits/large_fraction", f.large_fraction, f.step)
        clipping = self.peers.get("clipping")
        if clipping is not None and clipping.clip_steps and self._fresh("clip", clipping.clip_steps):
            summary = clipping.summary()
            step = self.watched.step
            if summary["fraction_clipped"] is not None:
                w.add_scalar("clip/fraction_clipped", summary["fraction_clipped"], step)
            for key, value in summary["pre_clip_norm"].items():
                w.add_scalar(f"clip/pre_clip_norm_{key}", value, step)
            if summary["suggested_max_norm"] is not None:
                w.add_scalar("clip/suggested_max_norm", summary["suggested_max_norm"], step)

    def _fresh(self, key: str, marker: int) -> bool:
        if self._seen.get(key) == marker:
            return False
        self._seen[key] = marker
        return True

    def _detach(self) -> None:
        if self.writer is None:
            return
        try:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._finish(*pending)
            self._peer_scalars()
        finally:
            self.writer.close()
            self.writer = None

    def _uninstall(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
