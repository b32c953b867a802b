"""The ``Config.dynamics`` settings group: training-dynamics statistics and early warnings (``nantrace.dynamics``; docs/dynamics.md); 0 turns a statistic off.

Usage::

    nantrace.Config(dynamics=nantrace.config.DynamicsConfig(...))
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .._settings import SettingsGroup, check_bools, check_int, check_number

__all__ = ["DynamicsConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class DynamicsConfig(SettingsGroup):
    """Training-dynamics statistics and early warnings (``nantrace.dynamics``; docs/dynamics.md); 0 turns a statistic off."""

    group: ClassVar[str] = "dynamics"

    layer_stats_every: int = 1
    """Per-layer gradient and parameter norms (tensors grouped by owning module, read from the
    step's one check, no extra work on the device) every this many steps; 0 = off."""

    update_stats_every: int = 25
    """Per-layer update/parameter ratio ‖Δθ‖/‖θ‖ every this many steps (the parameters are
    copied before the update of those steps only); 0 = off."""

    activation_stats_every: int = 50
    """Every module's output abs-max and non-finite count every this many steps (forward hooks
    installed for those steps only; needs a run directory or TensorBoard); 0 = off."""

    optimizer_stats_every: int = 25
    """Adam-family state check (``exp_avg`` drift, ``exp_avg_sq`` underflow against eps) every
    this many steps; 0 = off. A static eps/dtype check runs once whenever this is on."""

    logit_stats_every: int = 50
    """Logit saturation of the model's classification output every this many steps; 0 = off."""

    early_warnings: bool = True
    """Report what the statistics show coming before a NaN, as incidents with action ``logged``:
    growing gradient/weight ratios, update ratios too large for long, a vanishing layer, degenerate
    Adam state, saturated logits, miscalibrated clipping. Off: the statistics are still kept
    (run store, TensorBoard, ``nantrace.dynamics.summary``) but nothing is reported. The
    ``lr_schedule`` check reports whenever a schedule is declared."""

    dynamics_warmup: int = 100
    """Steps before early warnings start judging: the first steps of a run are legitimately wild."""

    update_ratio_max: float = 0.1
    """A layer whose update/parameter ratio stays above this for 50+ steps is reported (``update_ratio``)."""

    clip_stats: bool = True
    """Observe ``torch.nn.utils.clip_grad_norm_`` while the guard is open: how often clipping
    fires, the pre-clip norm distribution and a suggested ``max_norm``."""

    lr_schedule: Any = None
    """The learning-rate schedule you meant, checked against the one that runs: a dict
    (``peak_lr``, ``warmup_steps``, ``decay`` = ``"cosine"``/``"linear"``/``"constant"``,
    ``total_steps``, ``min_lr``, ``warmup_init_lr``, ``offset``), a callable ``step -> lr`` (or
    a list of lrs, one per param group), or the ``torch.optim.lr_scheduler`` object itself
    (then one scheduler step per optimizer step is what is checked); ``None`` = no check."""

    lr_tolerance: float = 0.01
    """Relative tolerance of the schedule check (``|lr_ran - lr_meant| / lr_meant``)."""

    label_smoothing: float = 0.0
    """The label smoothing your loss applies, declared for the logit-saturation check."""

    def __post_init__(self) -> None:
        check_bools(self)
        for name in ("layer_stats_every", "update_stats_every", "activation_stats_every", "optimizer_stats_every",
                     "logit_stats_every", "dynamics_warmup"):
            check_int(self, name, minimum=0)
        check_number(self, "update_ratio_max", low=0.0, low_inclusive=False, expected="a number > 0")
        check_number(self, "lr_tolerance", low=0.0, high=1.0, low_inclusive=False, expected="a number in (0, 1)")
        check_number(self, "label_smoothing", low=0.0, high=1.0, expected="a number in [0, 1)")
        if self.lr_schedule is not None:
            from .lr_schedule import validate_schedule

            validate_schedule(self.lr_schedule)
