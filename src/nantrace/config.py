"""All of nantrace's tunables in one typed, validated dataclass, with presets."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

_PRESETS = ("minimal", "default", "thorough")


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    """Tunables for :func:`nantrace.watch`. Defaults are what ``Config.preset("default")`` gives.

    Usage::

        cfg = nantrace.Config(spike_sigma=8.0)
        cfg = nantrace.Config.preset("thorough", print_incidents=False)
    """

    check_loss: bool = True
    """Check the loss every step (seen through ``backward()``; no change to the loop)."""

    check_params: bool = True
    """Check the parameters that the previous update produced (fused into the step's one check)."""

    check_updates: bool = True
    """Check the optimizer's own update: an update that makes a parameter or the optimizer state
    non-finite is caught at its step (phase ``optimizer``) and undone. Updates of SGD/Adam/AdamW in
    float32/float64 are proven finite from the step's gradient and parameter norms at no cost (with
    ``check_params=False`` there is no parameter norm, so they are checked too); any other update
    costs one copy of its parameters and state before it and one fused check after it
    (docs/benchmarks.md)."""

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

    finite_anomaly_action: str = "policy"
    """``"policy"``: finite anomalies (spikes, explosions) follow ``on_anomaly``; ``"log"``: only report them."""

    scaler_max_skips: int = 20
    """Consecutive GradScaler-skipped steps, *after* the scaler has found its level (trained at some
    scale), after which ``scaler_collapse`` is reported. The calibration from any ``init_scale``
    never counts; a skip whose gradients overflow even when the step is replayed at scale 1 is a
    collapse at once."""

    scaler_min_scale: float = 1.0
    """A GradScaler scale below this floor is reported as ``scaler_collapse``."""

    scaler_max_drop: float = 1024.0
    """A scale this many times below the level the scaler had found is reported as ``scaler_collapse``."""

    localise: bool = True
    """Replay the failing step under op-level instrumentation to find the origin op."""

    precision_check: bool = True
    """On a low-precision failure, re-run the step in float32 to tell overflow from a math error."""

    snapshot_buffers: bool = True
    """Copy floating buffers (e.g. BatchNorm statistics) before each forward so that a replay starts from the same state."""

    keep_output_grads: bool = True
    """Keep the gradient arriving at the model's outputs so backward origins can be replayed without the loss."""

    record_loss_code: bool = True
    """Keep a tape of the torch calls between the model's forward and ``backward()`` (the loss code), so an origin
    there is localised without ``guard.replayable``."""

    flight_recorder: int = 32
    """How many recent steps' health figures are kept in memory and attached to an incident."""

    print_incidents: bool = True
    """Print each incident once to the console (rich)."""

    save_bundle: bool = True
    """With a run directory, write a reproduction bundle for each non-finite incident."""

    max_bundles: int = 10
    """At most this many bundles per run (the first ones are the informative ones)."""

    rollback_interval: int = 100
    """With ``on_anomaly="rollback"``: take a last-good snapshot every this many healthy steps."""

    rollback_where: str = "memory"
    """Where snapshots live: ``"memory"`` (CPU RAM) or ``"disk"`` (``run_dir/snapshots``, or a temp dir)."""

    rollback_keep: int = 2
    """How many snapshots to keep (the newest is restored)."""

    rollback_max_retries: int = 3
    """Rollbacks in a row (each within ``rollback_interval`` steps of the last) before escalating to ``pause``."""

    skip_budget: int = 5
    """The escalation ladder (docs/escalation.md): after this many consecutive skipped updates of one
    episode the guard escalates: it rolls back to the last good snapshot when there is one, and
    pauses (bundle, then ``NonFiniteError``) when there is none or rollbacks repeat. 0 = never
    escalate (skip forever; a warning says so at ``watch()``)."""

    skip_window: int = 100
    """The window of steps over which ``skip_window_budget`` counts skipped updates."""

    skip_window_budget: int = 10
    """At most this many skipped updates in any ``skip_window`` steps before the guard escalates
    (catches an episode whose skips are not consecutive)."""

    episode_gap: int = 20
    """An episode ends after this many consecutive healthy steps; until then repeated incidents
    update its one incident (``details["count"]``, ``details["steps"]``) instead of adding new ones,
    and a checkpoint is not safe (``guard.checkpoint_ok()``)."""

    skip_snapshots: bool = False
    """With ``on_anomaly="skip"``, also keep last-good snapshots (as ``rollback`` does, every
    ``rollback_interval`` healthy steps) so that an exhausted skip budget rolls back before it pauses."""

    precision_fallback_after: int = 3
    """After this many ``precision_overflow`` incidents in one module, run it in float32 outside
    autocast for the rest of the run (0 = never)."""

    model_factory: str | None = None
    """``"module:callable"`` that rebuilds the model in a fresh process for ``nantrace replay``
    (default: the model's class, when it is importable and takes no arguments)."""

    # ---- training dynamics (nantrace.dynamics, docs/dynamics.md); 0 turns a statistic off
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

    tensorboard: bool | str = False
    """Export the trajectory to TensorBoard: a log directory, or ``True`` for ``RUN_DIR/tensorboard``
    (needs ``pip install 'nantrace[tensorboard]'``)."""

    def __post_init__(self) -> None:
        _positive_int(self, "spike_window", minimum=24)
        _positive_int(self, "spike_warmup", minimum=24)
        _positive_int(self, "scaler_max_skips", minimum=1)
        _positive_int(self, "flight_recorder", minimum=0)
        _positive_int(self, "max_bundles", minimum=0)
        _positive_int(self, "precision_fallback_after", minimum=0)
        _positive_int(self, "rollback_interval", minimum=1)
        _positive_int(self, "rollback_keep", minimum=1)
        _positive_int(self, "rollback_max_retries", minimum=0)
        _positive_int(self, "divergence_steps", minimum=2)
        _positive_int(self, "skip_budget", minimum=0)
        _positive_int(self, "skip_window", minimum=1)
        _positive_int(self, "skip_window_budget", minimum=1)
        _positive_int(self, "episode_gap", minimum=1)
        if self.rollback_where not in ("memory", "disk"):
            raise ValueError(f"Config.rollback_where must be 'memory' or 'disk', got {self.rollback_where!r}")
        if self.spike_warmup > self.spike_window:
            raise ValueError(
                f"Config.spike_warmup ({self.spike_warmup}) must not exceed "
                f"Config.spike_window ({self.spike_window})"
            )
        if self.skip_window_budget > self.skip_window:
            raise ValueError(f"Config.skip_window_budget ({self.skip_window_budget}) must not exceed "
                             f"Config.skip_window ({self.skip_window})")
        for name in ("spike_sigma", "loss_spike_min_ratio", "explosion_min_ratio", "divergence_factor", "scaler_max_drop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 1.0 - 1e-12:
                raise ValueError(f"Config.{name} must be a number >= 1, got {value!r}")
        if not isinstance(self.scaler_min_scale, (int, float)) or self.scaler_min_scale < 0:
            raise ValueError(f"Config.scaler_min_scale must be a number >= 0, got {self.scaler_min_scale!r}")
        if self.finite_anomaly_action not in ("policy", "log"):
            raise ValueError(
                f"Config.finite_anomaly_action must be 'policy' or 'log', got {self.finite_anomaly_action!r}"
            )
        if self.model_factory is not None and (not isinstance(self.model_factory, str) or ":" not in self.model_factory):
            raise ValueError(f"Config.model_factory must be 'module:callable', got {self.model_factory!r}")
        for name in ("layer_stats_every", "update_stats_every", "activation_stats_every", "optimizer_stats_every",
                     "logit_stats_every", "dynamics_warmup"):
            _positive_int(self, name, minimum=0)
        if not isinstance(self.update_ratio_max, (int, float)) or isinstance(self.update_ratio_max, bool) or not (
                self.update_ratio_max > 0):
            raise ValueError(f"Config.update_ratio_max must be a number > 0, got {self.update_ratio_max!r}")
        if not isinstance(self.lr_tolerance, (int, float)) or isinstance(self.lr_tolerance, bool) or not (
                0 < self.lr_tolerance < 1):
            raise ValueError(f"Config.lr_tolerance must be a number in (0, 1), got {self.lr_tolerance!r}")
        if not isinstance(self.label_smoothing, (int, float)) or isinstance(self.label_smoothing, bool) or not (
                0 <= self.label_smoothing < 1):
            raise ValueError(f"Config.label_smoothing must be a number in [0, 1), got {self.label_smoothing!r}")
        if not isinstance(self.tensorboard, (bool, str, os.PathLike)) or self.tensorboard == "":
            raise ValueError(
                f"Config.tensorboard must be False, True (RUN_DIR/tensorboard) or a log directory, got {self.tensorboard!r}"
            )
        if self.lr_schedule is not None:
            from .dynamics.lr_schedule import validate_schedule

            validate_schedule(self.lr_schedule)
        for f in dataclasses.fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"Config.{f.name} must be a bool, got {getattr(self, f.name)!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Config":
        """``"minimal"`` (non-finite checks only, no training-dynamics statistics), ``"default"``
        (cheap statistics every step, costly ones sampled) or ``"thorough"`` (every check and
        every statistic on every step, more history)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown Config preset {name!r}; expected one of {', '.join(_PRESETS)}")
        values: dict[str, Any] = {}
        if name == "minimal":
            values = dict(
                check_inputs=False,
                check_outputs=False,
                detect_loss_spikes=False,
                detect_grad_explosion=False,
                detect_divergence=False,
                snapshot_buffers=False,
                keep_output_grads=False,
                flight_recorder=8,
                layer_stats_every=0,
                update_stats_every=0,
                activation_stats_every=0,
                optimizer_stats_every=0,
                logit_stats_every=0,
                early_warnings=False,
                clip_stats=False,
            )
        elif name == "thorough":
            values = dict(
                flight_recorder=128,
                spike_window=256,
                layer_stats_every=1,
                update_stats_every=1,
                activation_stats_every=1,
                optimizer_stats_every=1,
                logit_stats_every=1,
            )
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _positive_int(cfg: Config, name: str, *, minimum: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Config.{name} must be an integer >= {minimum}, got {value!r}")
