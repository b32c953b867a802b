"""Which monitors a configuration turns on, in the order they run.

``Config.preset("minimal")`` turns every one off; ``"default"`` keeps the cheap ones on every
step (per-layer norms from the sentinel's figures, the clipping observer, the LR check) and
samples the costly ones (update ratios and Adam state every 25 steps, activations and
logits every 50); ``"thorough"`` samples everything every step. TensorBoard runs last, so
that it sees what the others measured at the same step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .activations import ActivationMonitor
from .clipping import ClipMonitor
from .early_warnings import WarningSettings
from .layers import LayerStatsMonitor
from .logits import LogitSaturationMonitor
from .lr_schedule import LRScheduleMonitor
from .optimizer_state import OptimizerStateMonitor

if TYPE_CHECKING:
    from ..config import Config
    from .base import Monitor

__all__ = ["build_monitors"]

_TENSORBOARD_EVERY = 25
"""Histogram cadence of the TensorBoard export when update statistics are off."""


def build_monitors(config: "Config") -> list["Monitor"]:
    """The monitors for this configuration, in the order they run."""
    monitors: list[Monitor] = []
    peers: dict[str, Monitor] = {}
    warnings = None
    if config.dynamics.early_warnings:
        warnings = WarningSettings(warmup=config.dynamics.dynamics_warmup, update_ratio_max=float(config.dynamics.update_ratio_max))
    if config.dynamics.layer_stats_every or config.dynamics.update_stats_every:
        peers["layers"] = LayerStatsMonitor(every=config.dynamics.layer_stats_every, update_every=config.dynamics.update_stats_every,
                                            warnings=warnings)
    if config.dynamics.activation_stats_every:
        peers["activations"] = ActivationMonitor(every=config.dynamics.activation_stats_every)
    if config.dynamics.optimizer_stats_every:
        peers["optimizer_state"] = OptimizerStateMonitor(every=config.dynamics.optimizer_stats_every, warmup=config.dynamics.dynamics_warmup,
                                                         warn=config.dynamics.early_warnings)
    if config.dynamics.logit_stats_every:
        peers["logits"] = LogitSaturationMonitor(every=config.dynamics.logit_stats_every, warmup=config.dynamics.dynamics_warmup,
                                                 label_smoothing=float(config.dynamics.label_smoothing), warn=config.dynamics.early_warnings)
    if config.dynamics.clip_stats:
        peers["clipping"] = ClipMonitor(warmup=config.dynamics.dynamics_warmup, warn=config.dynamics.early_warnings)
    monitors.extend(peers.values())
    if config.dynamics.lr_schedule is not None:
        monitors.append(LRScheduleMonitor(schedule=config.dynamics.lr_schedule, tolerance=float(config.dynamics.lr_tolerance)))
    if config.outputs.tensorboard is not False:
        from ..storage.tensorboard import TensorBoardMonitor

        monitors.append(TensorBoardMonitor(logdir=config.outputs.tensorboard, every=config.dynamics.update_stats_every or _TENSORBOARD_EVERY,
                                           peers=peers))
    return monitors
