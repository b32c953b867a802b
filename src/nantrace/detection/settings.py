"""The ``Config.detection`` settings group: what the step check looks at and what counts as an anomaly (``nantrace.detection``).

Usage::

    nantrace.Config(detection=nantrace.config.DetectionConfig(...))
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._settings import SettingsGroup, check_bools, check_int, check_number

__all__ = ["DetectionConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class DetectionConfig(SettingsGroup):
    """What the step check looks at and what counts as an anomaly (``nantrace.detection``)."""

    group: ClassVar[str] = "detection"

    check_loss: bool = True
    """Check the loss every step (seen through ``backward()``; no change to the loop)."""

    check_params: bool = True
    """Check the parameters that the previous update produced (fused into the step's one check,
    or known finite from their provenance: ``param_check_every``)."""

    param_check_every: int = 16
    """Read every parameter's norm at least every this many steps (the run store's ``param_norm``
    and per-layer parameter norms come from these steps). Between them the parameters are known
    finite from where their values came from: the last read, then only updates proven or checked
    finite; a parameter written outside the optimizer (``load_state_dict``, an in-place op, a new
    ``.data``, an in-place write through ``p.data`` that one of the step's tapes saw taken: the alias's
    own version moved) is read at the next step, and any non-finite value in a step has every parameter
    read before the diagnosis (``detection/param_provenance.py``; a ``.data`` write no tape saw, with
    ``record_loss_code=False`` or inside the model's own forward, waits for the next full read unless the
    step's figures show it). 1: every parameter every step."""

    check_updates: bool = True
    """Check the optimizer's own update: an update that makes a parameter or the optimizer state
    non-finite is caught at its step (phase ``optimizer``) and undone. Updates of SGD/Adam/AdamW in
    float32/float64 are proven finite from the step's gradient and parameter norms at no cost (with
    ``check_params=False`` there is no parameter norm, so they are checked too); any other update
    costs one copy of its parameters and state before it and one fused check after it
    (docs/benchmarks.md); when one group cannot be proven, every group is copied, so a failed update
    is undone whole."""

    check_inputs: bool = True
    """Check floating-point tensors passed to the watched model's ``forward``."""

    check_outputs: bool = True
    """Check floating-point tensors returned by the watched model's ``forward``."""

    detect_loss_spikes: bool = True
    """Report finite loss spikes against the run's own history (``loss_spike``)."""

    detect_grad_explosion: bool = True
    """Report gradient-norm explosions against the run's own history (``grad_explosion``)."""

    spike_window: int = 128
    """Number of recent healthy steps the robust statistics are computed over."""

    spike_warmup: int = 32
    """Steps of history needed before spikes and explosions can be reported."""

    spike_sigma: float = 6.0
    """Robust z-score (median/MAD, in log space) above which a value counts as a spike."""

    loss_spike_min_ratio: float = 1.5
    """A loss spike must also exceed the rolling median by this factor (guards a flat MAD)."""

    explosion_min_ratio: float = 5.0
    """A gradient explosion must also exceed the rolling median norm by this factor."""

    detect_divergence: bool = True
    """Report a diverging run from its first steps, judged by the *rate* at which the loss (or the
    gradient norm, when the loss is not falling) grows: consecutive multiplicative growth fitted by
    an exponential, with no history needed (``loss_spike``/``grad_explosion`` with cause
    ``loss_divergence``/``gradient_explosion``); see docs/escalation.md."""

    divergence_steps: int = 4
    """Increases in a row that make a divergence (one fewer when the growth is ``divergence_factor**3`` or more)."""

    divergence_factor: float = 4.0
    """A divergence must have grown at least this factor over those steps."""

    sync_free: bool | str = "auto"
    """Decide each step on the device, with no host read (docs/sync_free.md): the verdict goes to a
    fused optimizer as ``found_inf`` (the way ``GradScaler`` skips a step) and the host reads the
    step's figures at the next step, then reports and localises it. The weights are those of the
    synchronous mode, bit for bit. ``"auto"`` (default): on wherever it is exact (a fused
    optimizer, no GradScaler, no rollback) and a read would wait for an accelerator (parameters
    not on the CPU, where a read drains no queue and the device-side verdict costs more than it
    saves); ``True``: required (an error says why a set-up cannot have it); ``False``: always the
    synchronous read."""

    scaler_max_skips: int = 20
    """Consecutive GradScaler-skipped steps, *after* the scaler has found its level (trained at some
    scale), after which ``scaler_collapse`` is reported. The calibration from any ``init_scale``
    never counts; a skip whose gradients overflow even when the step is replayed at scale 1 is a
    collapse at once."""

    scaler_min_scale: float = 1.0
    """A GradScaler scale below this floor is reported as ``scaler_collapse``: on a step the scaler
    skips, with the skip; on a step it would apply, before the update, which is withheld. A scale the
    gradients cannot be unscaled from (0, infinite, or one whose float32 reciprocal overflows) is a
    collapse before the update whatever this floor is."""

    scaler_max_drop: float = 1024.0
    """A scale this many times below the level the scaler had found is reported as ``scaler_collapse``."""

    def __post_init__(self) -> None:
        check_bools(self)
        if self.sync_free not in (True, False, "auto") or isinstance(self.sync_free, int) and not isinstance(self.sync_free, bool):
            raise ValueError(f"Config.detection.sync_free must be True, False or 'auto', got {self.sync_free!r}")
        check_int(self, "spike_window", minimum=24)
        check_int(self, "spike_warmup", minimum=24)
        check_int(self, "scaler_max_skips", minimum=1)
        check_int(self, "divergence_steps", minimum=2)
        check_int(self, "param_check_every", minimum=1)
        if self.spike_warmup > self.spike_window:
            raise ValueError(f"Config.detection.spike_warmup ({self.spike_warmup}) must not exceed "
                             f"Config.detection.spike_window ({self.spike_window})")
        for name in ("spike_sigma", "loss_spike_min_ratio", "explosion_min_ratio", "divergence_factor", "scaler_max_drop"):
            check_number(self, name, low=1.0 - 1e-12, expected="a number >= 1")
        check_number(self, "scaler_min_scale", low=0.0, expected="a number >= 0")
