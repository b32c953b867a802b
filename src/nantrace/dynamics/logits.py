"""Logit saturation of a classification output, on sampled steps.

The model's output is taken as logits when it is (or holds, under ``logits`` / first) a
floating tensor of shape ``(batch, classes)`` or ``(batch, time, classes)`` with at least two
classes. On a sampled step a forward hook on the watched model (installed for that step
only) reduces it on the device, in row chunks so a large vocabulary costs no large
temporary, to:

- ``large_fraction``: the fraction of logits with ``|z| > 30`` (softmax and low-precision
  arithmetic are long past their useful range there);
- ``mean_max_prob``: the mean over rows of the largest softmax probability;
- ``saturated_rows``: the fraction of rows whose largest probability rounds to 1
  (``> 1 - 1e-6``): the loss gradient of those rows has vanished, and a wrong label there
  produces a huge one.

Label smoothing ε over K classes bounds the optimal largest probability at
``1 - ε + ε/K``; declared in ``Config.label_smoothing``, a mean above it (halfway to 1) says
the smoothing does not reach this output. A ``logit_saturation`` signal (once) reports
most rows saturated, most logits huge, or the smoothing bound exceeded, on two sampled
steps in a row after the warmup.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from ..loss_tape import in_transform, untaped
from ._common import SafeMonitor, is_sampled
from ._readback import DeferredRead
from .base import Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["LogitFigures", "LogitSaturationMonitor", "find_logits", "logit_stats"]

LARGE_LOGIT = 30.0
SATURATED_PROB = 1.0 - 1e-6
_CHUNK_ROWS = 4096
_MOST = 0.9


def find_logits(output: Any) -> torch.Tensor | None:
    """The classification logits in a model output, or ``None`` if it does not look like any."""
    candidate = output
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            candidate = output["logits"] if "logits" in output else None
        except (KeyError, TypeError):
            candidate = None
    elif isinstance(output, (list, tuple)) and output:
        candidate = output[0]
    if not isinstance(candidate, torch.Tensor) or not candidate.is_floating_point() or candidate.is_nested:
        return None  # (a nested tensor's rows have no common class dimension to read)
    if candidate.dim() not in (2, 3) or candidate.shape[-1] < 2 or candidate.numel() == 0:
        return None
    return candidate


def logit_stats(logits: torch.Tensor, *, large: float = LARGE_LOGIT, saturated: float = SATURATED_PROB) -> torch.Tensor:
    """``[#|z| > large, sum of max probabilities, rows, #rows with max prob > saturated, #logits]`` (float64, on device)."""
    z = logits.detach().reshape(-1, logits.shape[-1])
    parts = []
    for start in range(0, z.shape[0], _CHUNK_ROWS):
        chunk = z[start:start + _CHUNK_ROWS].float()
        pmax = torch.exp(chunk.amax(-1) - torch.logsumexp(chunk, -1))
        parts.append(torch.stack([
            (chunk.abs() > large).sum().to(torch.float64),
            pmax.sum(dtype=torch.float64),
            (pmax > saturated).sum().to(torch.float64),
        ]))
    total = torch.stack(parts).sum(0)
    rows, count = float(z.shape[0]), float(z.numel())
    return torch.stack([total[0], total[1], torch.full_like(total[0], rows), total[2], torch.full_like(total[0], count)])


@dataclasses.dataclass
class LogitFigures:
    """One sampled step's saturation figures of the model's logits."""

    step: int
    classes: int
    large_fraction: float
    mean_max_prob: float
    saturated_rows: float


class LogitSaturationMonitor(SafeMonitor):
    """Logit saturation every ``every`` steps (first training forward of the step)."""

    name = "logit saturation"
    summary_key = "logits"

    def __init__(self, *, every: int, warmup: int, label_smoothing: float, warn: bool = True) -> None:
        super().__init__()
        self.every = every
        self.warn = warn
        self.warmup = warmup
        self.label_smoothing = label_smoothing
        self.latest: LogitFigures | None = None
        self.history: list[LogitFigures] = []
        self._handle: Any = None
        self._captured: tuple[torch.Tensor, int] | None = None
        self._pending: tuple[int, int, DeferredRead] | None = None
        self._run = 0
        self._fired = False

    def _attach(self, watched: "Watched") -> None:
        if is_sampled(watched.step, self.every):
            self._install()

    def _install(self) -> None:
        if self._handle is None:
            self._captured = None
            self._handle = self.watched.model.register_forward_hook(self._hook)

    def _uninstall(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if self._captured is not None or not torch.is_grad_enabled() or in_transform():
            return  # under a torch.func transform the logits are wrapped tensors that must not escape it
        watched = self._watched
        if watched is None or watched.replaying:
            return
        try:
            logits = find_logits(output)
            if logits is not None:
                with untaped(), torch.no_grad():  # runs after the guard's own hook has resumed the loss tape
                    self._captured = (logit_stats(logits), int(logits.shape[-1]))
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            self._fail(exc)

    def _on_step(self, ctx: StepContext) -> list[Signal]:
        signals: list[Signal] = []
        if self._pending is not None:
            signals += self._finish(*self._pending)
            self._pending = None
        if self._handle is not None:
            self._uninstall()
            if self._captured is not None:
                stats, classes = self._captured
                self._pending = (ctx.step, classes, DeferredRead(stats))
            self._captured = None
        if is_sampled(ctx.step + 1, self.every):
            self._install()
        return signals

    def _finish(self, step: int, classes: int, read: DeferredRead) -> list[Signal]:
        large, pmax_sum, rows, saturated, count = read.get()
        figures = LogitFigures(step, classes, large / count if count else math.nan,
                               pmax_sum / rows if rows else math.nan, saturated / rows if rows else math.nan)
        self.latest = figures
        self.history.append(figures)
        del self.history[:-64]
        return self._judge(figures)

    def smoothing_bound(self, classes: int) -> float | None:
        """The largest probability label smoothing allows at its optimum, if smoothing is declared."""
        eps = self.label_smoothing
        return 1.0 - eps + eps / classes if eps > 0 else None

    def _reason(self, f: LogitFigures) -> str | None:
        if not all(math.isfinite(v) for v in (f.large_fraction, f.mean_max_prob, f.saturated_rows)):
            return None
        if f.saturated_rows >= _MOST:
            return f"{f.saturated_rows:.0%} of the rows have a largest probability that rounds to 1"
        if f.large_fraction >= _MOST:
            return f"{f.large_fraction:.0%} of the logits are beyond ±{LARGE_LOGIT:g}"
        bound = self.smoothing_bound(f.classes)
        if bound is not None and f.mean_max_prob > bound + (1.0 - bound) / 2:
            return (f"the mean largest probability {f.mean_max_prob:.4f} exceeds the {bound:.4f} that the declared "
                    f"label smoothing {self.label_smoothing:g} allows")
        return None

    def _judge(self, f: LogitFigures) -> list[Signal]:
        if self._fired or f.step < self.warmup or not self.warn:
            return []
        reason = self._reason(f)
        self._run = self._run + 1 if reason else 0
        if reason is None or self._run < 2:
            return []
        self._fired = True
        bound = self.smoothing_bound(f.classes)
        if bound is not None:
            fix = ("The declared label smoothing does not seem to reach this output: check that the loss applying it "
                   "(F.cross_entropy(..., label_smoothing=...)) is the one trained on these logits; add a z-loss or logit "
                   "soft-capping, weight decay on the head, or lower the learning rate.")
        else:
            fix = ("Use label smoothing (F.cross_entropy(logits, y, label_smoothing=0.1) bounds the largest probability at "
                   "1 - 0.1 + 0.1/K), weight decay on the output layer, a z-loss or logit soft-capping, or a lower "
                   "learning rate; then declare it in Config.label_smoothing.")
        return [Signal(
            kind="logit_saturation", cause="logit_saturation", phase="forward", module="",
            summary=(f"The model's logits ({f.classes} classes) saturate: {reason} (mean largest probability "
                     f"{f.mean_max_prob:.6f}, {f.large_fraction:.1%} of logits beyond ±{LARGE_LOGIT:g}); confident rows "
                     f"get no gradient and a wrong label there a huge one."),
            fix=fix,
            details=dataclasses.asdict(f) | {"smoothing_bound": bound},
        )]

    def _detach(self) -> None:
        self._uninstall()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(*pending)

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self.latest) if self.latest is not None else {}
