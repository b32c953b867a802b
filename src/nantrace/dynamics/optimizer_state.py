"""Adam-family optimizer state: ``exp_avg`` drift and ``exp_avg_sq`` underflow.

Adam divides the first moment by ``sqrt(v̂) + eps``. It degenerates in three ways that come
before a NaN or a silent stall:

- **eps unusable for the state's dtype** (checked once, at the first step): ``eps <= 0``, or
  below ``torch.finfo(dtype).tiny`` (``1e-8`` in float16 state rounds to 0, and then a
  parameter whose ``v`` underflowed is divided by zero);
- **``exp_avg_sq`` underflow**: most entries of a layer have ``m != 0`` but ``sqrt(v̂) < eps``,
  so the update is ``m / eps`` (huge) instead of ``m / sqrt(v̂)`` (typical in float16 state,
  where ``v = g²`` flushes to zero for ``|g| < 2.4e-4``);
- **``exp_avg`` drift**: a layer's ‖m‖ jumps an order of magnitude above its own history
  (robust z-score over the sampled history, in log space); non-finite state.

Checked every ``optimizer_stats_every`` steps after the update: per-tensor norms (foreach),
minima and counts are reduced on the device into one vector and read at the next step
without a synchronisation of their own. Optimizers without ``exp_avg``/``exp_avg_sq`` state
(SGD, Adafactor, ...) are left alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..detection.sentinel import local as local_of
from ._common import SafeMonitor, is_sampled
from ._layers import LayerIndex
from ._readback import DeferredRead, accumulation_dtype, host_value, stack_on
from .base import Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["AdamFigures", "OptimizerStateMonitor", "eps_problem", "tensor_state_stats"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_UNDERFLOW_FRACTION = 0.5
"""A layer is degenerate when more than this fraction of its entries are divided by eps."""
_DRIFT_SIGMA = 8.0
_DRIFT_DECADES = 1.0
_DRIFT_MIN_HISTORY = 8


def eps_problem(eps: float, dtype: torch.dtype) -> str | None:
    """Why ``eps`` cannot work for optimizer state of ``dtype`` that divides by a second moment (Adam's
    ``exp_avg_sq``, RMSProp's, Sophia's Hessian estimate); ``None`` when it can."""
    if not dtype.is_floating_point:
        return None
    if eps <= 0:
        return f"eps={eps:g} is not positive: an entry whose second moment (exp_avg_sq in Adam) is 0 is divided by zero"
    tiny = torch.finfo(dtype).tiny
    dtype_name = str(dtype).removeprefix("torch.")
    if host_value(torch.tensor(eps, dtype=dtype)) == 0:
        return f"eps={eps:g} rounds to 0 in {dtype_name} (the optimizer state's dtype), so it protects nothing"
    if eps < tiny:
        return (f"eps={eps:g} is below the smallest normal {dtype_name} ({tiny:.3g}): it is stored as a subnormal "
                f"with almost no precision, and the second moment underflows long before it")
    return None


UNDERFLOW_SAMPLE = 1 << 16
"""The underflow count of a state tensor with more entries than this is estimated from an evenly strided
sample of about this many (an odd stride, so a power-of-two row length is visited column by column, not
one column over and over): the fraction is what is judged (against 0.5), and a binomial estimate from 65,536
entries is within ±0.6 % of it (3 sigma), while the exact count of a 1M-entry state costs two comparisons
and a mask product over every entry, ~2 ms on two CPU threads (docs/benchmarks.md, session 11)."""


def _strided_sample(t: torch.Tensor, stride: int) -> torch.Tensor:
    flat = t.reshape(-1)  # a view of a contiguous tensor; a copy otherwise (rare: state tensors are made dense)
    return flat[::stride]


def tensor_state_stats(m: torch.Tensor, v: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[‖m‖, max v, min v, #entries with m != 0 and v < threshold, non-finite]`` for one tensor's
    state, on its device.

    ``threshold`` is ``eps² · (1 - β₂ᵗ)``: ``v`` below it means ``sqrt(v̂) < eps``. ``‖m‖`` is accumulated
    in float64, so it is finite exactly when ``m`` is (a float32 ``dot`` would be cheaper, but a finite sum beyond
    float32's range then needs a second pass decided on the host: a host read the step's budget has no room for); ``v``'s extremes come from
    one ``aminmax`` pass, finite exactly when ``v`` is (a NaN propagates to both). The last figure is 1.0 when
    ``m`` or ``v`` holds a non-finite value. The count is exact up to :data:`UNDERFLOW_SAMPLE` entries and
    estimated from a strided sample above (scaled to the tensor's size). A DTensor (FSDP2) is reduced as its
    local shard (:func:`shard_state_stats`, combined across ranks by the monitor).
    """
    if hasattr(m, "to_local"):
        figures = shard_state_stats(m.to_local(), v.to_local(), threshold)
        figures[0] = figures[0].sqrt()
        return figures
    acc = accumulation_dtype(m.device)
    ms, vs, scale = _sampled(m, v)
    vf = vs.float() if vs.dtype in _LOW_PRECISION else vs
    bad = torch.count_nonzero((vf < threshold).logical_and_(ms != 0))
    m_norm = torch.linalg.vector_norm(m, dtype=acc)
    v_min, v_max = torch.aminmax(v)
    if torch.float64 in (m.dtype, v.dtype) or acc != torch.float64:
        nonfinite = (m.numel() - torch.isfinite(m).sum()) + (v.numel() - torch.isfinite(v).sum())
    else:
        nonfinite = ~(torch.isfinite(m_norm) & torch.isfinite(v_min) & torch.isfinite(v_max))
    return torch.stack([m_norm, v_max.to(acc), v_min.to(acc), bad.to(acc) * scale, nonfinite.to(acc)])


def _sampled(m: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``m`` and ``v`` as the underflow count reads them: whole, or an evenly strided sample of a large tensor
    (:data:`UNDERFLOW_SAMPLE`), with the factor that scales a count of the sample to the tensor."""
    n = m.numel()
    if n <= UNDERFLOW_SAMPLE:
        return m, v, 1.0
    stride = -(-n // UNDERFLOW_SAMPLE) | 1
    ms, vs = _strided_sample(m, stride), _strided_sample(v, stride)
    return ms, vs, n / ms.numel()


def shard_state_stats(m: torch.Tensor, v: torch.Tensor, threshold: float) -> torch.Tensor:
    """One rank's shard of a tensor's state (plain local tensors, possibly empty: FSDP2 gives a rank nothing of a
    small tensor): ``[Σm², max v, min v, underflow count, non-finite count]`` in float64, with no collective, so
    that no rank can fail alone inside one. An empty shard gives ``[0, -inf, inf, 0, 0]``, which the combination
    across ranks (:func:`combine_shard_stats`) ignores."""
    if not m.numel():
        return torch.tensor([0.0, -math.inf, math.inf, 0.0, 0.0], dtype=torch.float64, device=m.device)
    ms, vs, scale = _sampled(m, v)
    vf = vs.float() if vs.dtype in _LOW_PRECISION else vs
    bad = torch.count_nonzero((vf < threshold).logical_and_(ms != 0)).to(torch.float64) * scale
    square = torch.linalg.vector_norm(m, dtype=torch.float64).square()
    v_min, v_max = torch.aminmax(v)
    nonfinite = (m.numel() - torch.isfinite(m).sum()) + (v.numel() - torch.isfinite(v).sum())
    return torch.stack([square, v_max.to(torch.float64), v_min.to(torch.float64), bad, nonfinite.to(torch.float64)])


def combine_shard_stats(local: torch.Tensor) -> torch.Tensor:
    """Rows of :func:`shard_state_stats` (one per tensor) combined over the default process group (two
    all-reduces, every rank at the same sampled step): sums of squares, counts and non-finite counts add up,
    the extremes are the ranks' extremes; returned in :func:`tensor_state_stats`' layout (the norm's root taken)."""
    summed = local[:, [0, 3, 4]].contiguous()
    extremes = torch.stack([local[:, 1], -local[:, 2]], 1).contiguous()
    torch.distributed.all_reduce(summed)
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
    return torch.stack([summed[:, 0].sqrt(), extremes[:, 0], -extremes[:, 1], summed[:, 1], summed[:, 2]], 1)


@dataclasses.dataclass
class AdamFigures:
    """One sampled step's per-layer Adam state figures (NaN where a layer has no state)."""

    step: int
    exp_avg_norm: np.ndarray
    exp_avg_sq_min: np.ndarray
    underflow_fraction: np.ndarray
    nonfinite: np.ndarray
    present: np.ndarray


class OptimizerStateMonitor(SafeMonitor):
    """Adam-family state check every ``every`` steps, plus a one-off eps/dtype check."""

    name = "optimizer state"
    summary_key = "optimizer_state"

    def __init__(self, *, every: int, warmup: int, warn: bool = True) -> None:
        super().__init__()
        self.every = every
        self.warn = warn
        self.warmup = warmup
        self.index = LayerIndex([])
        self.latest: AdamFigures | None = None
        self._position: dict[int, int] = {}
        self._static_done = False
        self._pending: tuple[int, list[int], DeferredRead] | None = None
        self._history: list[deque[float]] = []
        self._underflow_run: np.ndarray = np.zeros(0, dtype=np.int64)
        self._fired: set[tuple[str, Any]] = set()
        self._applied = 0

    def _attach(self, watched: "Watched") -> None:
        self.index = LayerIndex(watched.param_names)
        self._position = {id(p): i for i, p in enumerate(watched.params)}
        self._history = [deque(maxlen=64) for _ in self.index.names]
        self._underflow_run = np.zeros(len(self.index), dtype=np.int64)

    # ------------------------------------------------------------------ steps
    def _on_step(self, ctx: StepContext) -> list[Signal]:
        signals: list[Signal] = []
        if ctx.applied:
            self._applied += 1
        if not self._static_done and self._applied:
            self._static_done = True
            if self.warn:
                signals += self._check_eps()
        if self._pending is not None:
            signals += self._finish(*self._pending)
            self._pending = None
        if ctx.applied and is_sampled(ctx.step, self.every):
            self._pending = self._start(ctx.step)
        return signals

    def _adam_entries(self) -> list[tuple[int, torch.Tensor, torch.Tensor, float]]:
        """(tensor index, exp_avg, exp_avg_sq, threshold) of every watched tensor with Adam state."""
        optimizer = self.watched.optimizer
        assert optimizer is not None
        out = []
        for group in optimizer.param_groups:
            if "eps" not in group or "betas" not in group:
                continue
            eps = float(group["eps"])
            beta2 = float(group["betas"][1])
            for p in group["params"]:
                i = self._position.get(id(p))
                state = optimizer.state.get(p)
                if i is None or not state or "exp_avg" not in state or "exp_avg_sq" not in state:
                    continue
                t = self._state_step(state)
                correction = 1.0 - beta2 ** t if t > 0 else 1.0
                out.append((i, state["exp_avg"], state["exp_avg_sq"], eps * eps * correction))
        return out

    def _state_step(self, state: dict[str, Any]) -> float:
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if step.device.type == "cpu":
                return host_value(step)
            return float(self._applied)  # reading a device counter would synchronise
        if isinstance(step, (int, float)):
            return float(step)
        return float(self._applied)

    def _start(self, step: int) -> tuple[int, list[int], DeferredRead] | None:
        entries = self._adam_entries()
        if not entries:
            return None
        if self.watched.sharded and self.watched.world_size > 1:  # FSDP2: each rank its shards, then combined
            local = torch.stack([shard_state_stats(local_of(m.detach()), local_of(v.detach()), thr)
                                 for _, m, v, thr in entries])
            return step, [e[0] for e in entries], DeferredRead(combine_shard_stats(local))
        device = entries[0][1].device
        stats = [tensor_state_stats(m.detach(), v.detach(), thr) for _, m, v, thr in entries]
        return step, [e[0] for e in entries], DeferredRead(stack_on(stats, device, accumulation_dtype(device)))

    def _finish(self, step: int, which: list[int], read: DeferredRead) -> list[Signal]:
        values = np.asarray(read.get(), dtype=np.float64).reshape(-1, 5)
        m_norm = self.index.combine(values[:, 0], which)
        v_min = self.index.minimum(values[:, 2], which)
        numel = self.index.sum([self._numel(i) for i in which], which)
        with np.errstate(divide="ignore", invalid="ignore"):
            underflow = self.index.sum(values[:, 3], which) / numel
        present = self.index.present(which)
        nonfinite = present & (self.index.sum(values[:, 4], which) > 0)  # exact: see tensor_state_stats
        self.latest = AdamFigures(step, m_norm, v_min, np.where(present, underflow, np.nan), nonfinite, present)
        if not self.warn:
            return []
        return self._judge(step, m_norm, underflow, nonfinite, present)

    def _numel(self, i: int) -> int:
        return self.watched.params[i].numel()

    # -------------------------------------------------------------- judgements
    def _check_eps(self) -> list[Signal]:
        optimizer = self.watched.optimizer
        assert optimizer is not None
        signals = []
        for g, group in enumerate(optimizer.param_groups):
            if "eps" not in group or "betas" not in group:
                continue
            eps = float(group["eps"])
            dtypes: dict[torch.dtype, list[str]] = {}
            for p in group["params"]:
                state = optimizer.state.get(p) or {}
                v = state.get("exp_avg_sq")
                dtype = v.dtype if isinstance(v, torch.Tensor) else p.dtype
                i = self._position.get(id(p))
                dtypes.setdefault(dtype, []).append(self.watched.param_names[i] if i is not None else "?")
            for dtype, names in dtypes.items():
                problem = eps_problem(eps, dtype)
                if problem is None or ("eps", (g, dtype)) in self._fired:
                    continue
                self._fired.add(("eps", (g, dtype)))
                tiny = torch.finfo(dtype).tiny
                layer = names[0].rpartition(".")[0]
                signals.append(Signal(
                    kind="optimizer_state", cause="optimizer_state", phase="optimizer", module=layer,
                    summary=(f"Adam's {problem} (param group {g}, {len(names)} tensor(s) with "
                             f"{str(dtype).removeprefix('torch.')} state)."),
                    fix=(f"Keep the optimizer state in float32 (train with torch.autocast and float32 weights instead of "
                         f"model.half(), or use fp32 master weights), or raise eps to at least {max(tiny, 1e-8):.2g} "
                         f"for this dtype (e.g. eps=1e-4 in float16)."),
                    details={"param_group": g, "eps": eps, "dtype": str(dtype), "tensors": names[:16]},
                ))
        return signals

    def _judge(self, step: int, m_norm: np.ndarray, underflow: np.ndarray, nonfinite: np.ndarray,
               present: np.ndarray) -> list[Signal]:
        signals = []
        names = self.index.names
        bad = [i for i in np.flatnonzero(nonfinite) if ("nonfinite", int(i)) not in self._fired]
        if bad:
            for i in bad:
                self._fired.add(("nonfinite", int(i)))
            signals.append(Signal(
                kind="optimizer_state", cause="optimizer_state", phase="optimizer", module=names[bad[0]],
                summary=(f"Adam's state (exp_avg / exp_avg_sq) holds non-finite values in "
                         f"{', '.join(repr(names[i]) for i in bad[:4])}{' and more' if len(bad) > 4 else ''}: every "
                         f"later update of these layers is NaN."),
                fix=("Reset the optimizer state of these parameters (or roll back to a checkpoint), and find the step that "
                     "wrote it: nantrace's nonfinite_grad incident of that step, or an eps too small for the state's dtype."),
                details={"layers": [names[i] for i in bad]},
            ))
        with np.errstate(invalid="ignore"):
            high = present & (underflow > _UNDERFLOW_FRACTION)
        self._underflow_run = np.where(high, self._underflow_run + 1, 0)
        hits = [int(i) for i in np.flatnonzero(self._underflow_run >= 2) if ("underflow", int(i)) not in self._fired]
        if hits:
            for i in hits:
                self._fired.add(("underflow", i))
            worst = max(hits, key=lambda i: float(underflow[i]))
            signals.append(Signal(
                kind="optimizer_state", cause="optimizer_state", phase="optimizer", module=names[worst],
                summary=(f"Adam's exp_avg_sq has underflowed in layer {names[worst]!r}: for {underflow[worst]:.0%} of its "
                         f"entries sqrt(v̂) < eps while exp_avg is not 0, so those updates are m/eps instead of m/sqrt(v̂)"
                         f"{' (also ' + ', '.join(repr(names[i]) for i in hits if i != worst)[:200] + ')' if len(hits) > 1 else ''}."),
                fix=("Keep the optimizer state in float32 (fp32 master weights, torch.autocast instead of model.half()), "
                     "raise eps, or find why this layer's gradients are so small (vanishing gradient, too small a loss "
                     "scale)."),
                details={"layers": [names[i] for i in hits], "underflow_fraction": {names[i]: float(underflow[i]) for i in hits}},
            ))
        if step >= self.warmup:
            signals += self._judge_drift(step, m_norm)
        return signals

    def _judge_drift(self, step: int, m_norm: np.ndarray) -> list[Signal]:
        hits: list[tuple[int, float, float]] = []
        for i, value in enumerate(m_norm):
            if not (math.isfinite(value) and value > 0):
                continue
            x = math.log10(value)
            history = self._history[i]
            if len(history) >= _DRIFT_MIN_HISTORY:
                h = np.fromiter(history, dtype=np.float64, count=len(history))
                median = float(np.median(h))
                mad = float(np.median(np.abs(h - median))) * 1.4826
                z = (x - median) / max(mad, 1e-6)
                if z > _DRIFT_SIGMA and x - median > _DRIFT_DECADES:
                    if ("drift", i) not in self._fired:
                        self._fired.add(("drift", i))
                        hits.append((i, 10 ** (x - median), 10 ** median))
                    continue  # a flagged value stays out of the history
            history.append(x)
        if not hits:
            return []
        i, factor, before = max(hits, key=lambda h: h[1])
        names = self.index.names
        return [Signal(
            kind="optimizer_state", cause="optimizer_state", phase="optimizer", module=names[i],
            summary=(f"Adam's exp_avg of layer {names[i]!r} jumped {factor:.3g}× above its own history "
                     f"(‖m‖ {before * factor:.3g}, median before {before:.3g}): the gradient it averages has blown up "
                     f"and the next updates will be large."),
            fix=("Look at the gradients of this layer over the last steps (loss spike, bad batch), clip gradients, or lower "
                 "the learning rate; if the moment stays high, reset this layer's optimizer state."),
            details={"layers": [names[h[0]] for h in hits], "factor": {names[h[0]]: h[1] for h in hits}},
        )]

    def _detach(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(*pending)  # figures only: signals after the last step are not reported

    def summary(self) -> dict[str, Any]:
        if self.latest is None:
            return {}
        f = self.latest
        names = self.index.names
        keep = [i for i in range(len(names)) if f.present[i]]  # layers with state; NaN values are kept
        return {
            "step": f.step,
            "exp_avg_norm": {names[i]: float(f.exp_avg_norm[i]) for i in keep},
            "exp_avg_sq_min": {names[i]: float(f.exp_avg_sq_min[i]) for i in keep},
            "underflow_fraction": {names[i]: float(f.underflow_fraction[i]) for i in keep},
            "nonfinite_layers": [names[i] for i in keep if f.nonfinite[i]],
        }
