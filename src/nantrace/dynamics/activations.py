"""Per-module activation statistics on sampled steps: abs-max of the finite values and the
number of non-finite values of every module's output.

Forward hooks exist only for a sampled step: they are installed at the end of the step
before it (or at attach for step 0) and removed when the sampled step finishes, so other
steps run with no hook at all. Each hook reduces its module's output on the device to two
numbers; they are stacked once at the end of the step and read back at the next step
without a synchronisation of their own. Rows go to the run store's ``activation_stats``
table (``meta.activation_names`` labels them).

A module called several times in a step (shared weights, gradient accumulation) keeps the
largest abs-max and the sum of non-finite counts. Forward passes without gradient (an
evaluation inside the loop) and nantrace's own replays are not counted. A
``torch.compile``d model is not hooked: hooks inside a compiled graph would recompile it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from ..capture import floating_tensors
from ..loss_tape import untaped
from ._common import SafeMonitor, is_sampled
from ._readback import DeferredRead
from .base import Signal, StepContext

if TYPE_CHECKING:
    from ..watched import Watched

__all__ = ["ActivationFigures", "ActivationMonitor", "output_stats"]


def output_stats(outputs: list[torch.Tensor]) -> torch.Tensor | None:
    """``[abs-max of the finite values, number of non-finite values]`` of some tensors, as a float64 device
    vector (float64 keeps counts exact); ``None`` when there is nothing to measure."""
    parts = []
    for t in outputs:
        if t.numel() == 0:
            continue
        magnitude = t.detach().abs()  # (torch.isfinite is many times slower than these on the CPU)
        nonfinite = (t.numel() - (magnitude < float("inf")).sum()).to(torch.float64)  # NaN < inf is False
        absmax = magnitude.nan_to_num(0.0, 0.0, 0.0).amax().to(torch.float64)
        parts.append(torch.stack([absmax, nonfinite.to(absmax.device)]))
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    device = parts[0].device
    stacked = torch.stack([p.to(device) for p in parts])
    return torch.stack([stacked[:, 0].amax(), stacked[:, 1].sum()])


@dataclasses.dataclass
class ActivationFigures:
    """One sampled step's figures: module index → (abs-max of finite values, non-finite count)."""

    step: int
    rows: list[tuple[int, float | None, int]]


class ActivationMonitor(SafeMonitor):
    """Abs-max and non-finite counts of every module's output, every ``every`` steps."""

    name = "activation statistics"
    summary_key = "activations"

    def __init__(self, *, every: int) -> None:
        super().__init__()
        self.every = every
        self.names: list[str] = []
        self.latest: ActivationFigures | None = None
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []
        self._index: dict[int, int] = {}
        self._stats: dict[int, list[torch.Tensor]] = {}
        self._pending: tuple[int, list[int], DeferredRead] | None = None

    def _attach(self, watched: "Watched") -> None:
        if watched.store is None and watched.config.outputs.tensorboard is False:
            self.active = False  # nowhere to keep the figures: cost nothing
            return
        if watched.model is not watched.root and hasattr(watched.model, "_orig_mod"):
            warnings.warn("nantrace: activation statistics are off for a torch.compile'd model (hooks would recompile it)",
                          RuntimeWarning, stacklevel=4)
            self.active = False
            return
        named = list(watched.root.named_modules())
        self.names = [n for n, _ in named]
        self._modules = [m for _, m in named]
        if watched.store is not None:
            watched.store.set_meta("activation_names", self.names)
        if is_sampled(watched.step, self.every):
            self._install()

    def _install(self) -> None:
        """Hook every module's output for this step: one process-wide forward hook that keeps the calls of
        the model's own modules (by identity), not a hook on each module. A hook on a module changes what
        some modules compute: torch's ``TransformerEncoderLayer`` leaves its fused inference path when it or
        any of its sublayers carries one (an all-padding row is NaN on one path and 0 on the other)."""
        if self._handles:
            return
        self._stats = {}
        self._index = {id(m): i for i, m in enumerate(self._modules)}
        self._handles.append(register_module_forward_hook(self._hook))

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        index = self._index.get(id(module))
        if index is None or self._modules[index] is not module or not torch.is_grad_enabled():
            return
        watched = self._watched
        if watched is None or watched.replaying:
            return
        with untaped(), torch.no_grad():
            stats = output_stats(floating_tensors(output))
        if stats is not None:
            self._stats.setdefault(index, []).append(stats)

    def _uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_step(self, ctx: StepContext) -> list[Signal]:
        if self._pending is not None:
            self._finish(*self._pending)
            self._pending = None
        if self._handles:
            self._uninstall()
            stats, self._stats = self._stats, {}
            if stats:
                index = sorted(stats)
                device = stats[index[0]][0].device
                per_module = []
                for i in index:
                    calls = torch.stack([s.to(device) for s in stats[i]])
                    per_module.append(torch.stack([calls[:, 0].amax(), calls[:, 1].sum()]))
                self._pending = (ctx.step, index, DeferredRead(torch.stack(per_module)))
        if is_sampled(ctx.step + 1, self.every):
            self._install()
        return []

    def _finish(self, step: int, index: list[int], read: DeferredRead) -> None:
        values = read.get()
        rows: list[tuple[int, float | None, int]] = []
        for k, i in enumerate(index):
            absmax, nonfinite = values[2 * k], values[2 * k + 1]
            rows.append((i, absmax, int(nonfinite)))
        self.latest = ActivationFigures(step, rows)
        store = self.watched.store
        if store is not None:
            with store.transaction():
                store.log_activation_stats(step, rows)

    def _detach(self) -> None:
        self._uninstall()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(*pending)

    def summary(self) -> dict[str, Any]:
        if self.latest is None:
            return {}
        return {"step": self.latest.step,
                "absmax": {self.names[i]: a for i, a, _ in self.latest.rows},
                "nonfinite": {self.names[i]: n for i, _, n in self.latest.rows if n}}
