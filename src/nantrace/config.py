"""All of nantrace's tunables: one :class:`Config` made of settings groups, one per concern, each
defined, documented and validated next to the code that reads it:

========================  ===========================================================
``Config.detection``      what the step check looks at, spike / divergence / scaler rules
``Config.response``       finite anomalies, the escalation ladder, rollback, precision fallback
``Config.localisation``   what is kept of each step for a replay, and whether it is replayed
``Config.dynamics``       training-dynamics statistics and early warnings
``Config.outputs``        console, flight recorder, bundles, TensorBoard, replay's model factory
========================  ===========================================================

The flat field names of nantrace 0.1 (``Config(spike_sigma=8.0)``, ``cfg.spike_sigma``) still work
for this release, with a ``DeprecationWarning`` naming the grouped spelling.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ._settings import SettingsGroup, field_group, group_classes, unknown_field_message
from .detection.settings import DetectionConfig
from .dynamics.settings import DynamicsConfig
from .localisation.settings import LocalisationConfig
from .response.settings import ResponseConfig
from .storage.settings import OutputsConfig

__all__ = ["Config", "DetectionConfig", "DynamicsConfig", "LocalisationConfig", "OutputsConfig", "ResponseConfig"]

_PRESETS = ("minimal", "default", "thorough")
_GROUP_NAMES = ("detection", "response", "localisation", "dynamics", "outputs")

_PRESET_VALUES: dict[str, dict[str, dict[str, Any]]] = {
    "default": {},
    "minimal": {
        "detection": dict(check_inputs=False, check_outputs=False, detect_loss_spikes=False,
                          detect_grad_explosion=False, detect_divergence=False),
        "localisation": dict(snapshot_buffers=False, keep_output_grads=False),
        "outputs": dict(flight_recorder=8),
        "dynamics": dict(layer_stats_every=0, update_stats_every=0, activation_stats_every=0, optimizer_stats_every=0,
                         logit_stats_every=0, early_warnings=False, clip_stats=False),
    },
    "thorough": {
        "outputs": dict(flight_recorder=128),
        "detection": dict(spike_window=256, param_check_every=1),
        "dynamics": dict(layer_stats_every=1, update_stats_every=1, activation_stats_every=1, optimizer_stats_every=1,
                         logit_stats_every=1),
    },
}

GroupArg = SettingsGroup | dict[str, Any] | None


@dataclasses.dataclass(init=False, slots=True)
class Config:
    """Tunables for :func:`nantrace.watch`. Defaults are what ``Config.preset("default")`` gives.

    Usage::

        from nantrace.config import DetectionConfig
        cfg = nantrace.Config(detection=DetectionConfig(spike_sigma=8.0))
        cfg = nantrace.Config(detection={"spike_sigma": 8.0})          # the same
        cfg = nantrace.Config.preset("thorough", outputs={"print_incidents": False})
        cfg.detection.spike_sigma                                       # 8.0
    """

    detection: DetectionConfig
    """What the step check looks at and what counts as an anomaly."""

    response: ResponseConfig
    """What the guard does about an incident: finite anomalies, escalation, rollback, precision fallback."""

    localisation: LocalisationConfig
    """What is kept of each step for a replay, and whether a failing step is replayed."""

    dynamics: DynamicsConfig
    """Training-dynamics statistics and early warnings."""

    outputs: OutputsConfig
    """Console, flight recorder, bundles, TensorBoard, the model factory for ``nantrace replay``."""

    def __init__(self, *, detection: GroupArg = None, response: GroupArg = None, localisation: GroupArg = None,
                 dynamics: GroupArg = None, outputs: GroupArg = None, **flat: Any) -> None:
        given = {"detection": detection, "response": response, "localisation": localisation, "dynamics": dynamics,
                 "outputs": outputs}
        routed = _route_flat(flat, stacklevel=2)
        for name, cls in group_classes().items():
            setattr(self, name, _build(cls, given[name], routed.get(name, {})))

    # ---------------------------------------------------------------- construction
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Config":
        """``"minimal"`` (non-finite checks only, no training-dynamics statistics), ``"default"``
        (cheap statistics every step, costly ones sampled) or ``"thorough"`` (every check and
        every statistic on every step, more history). ``overrides`` are groups (a group object
        replaces the preset's group, a dict changes some of its fields) or, deprecated, flat fields."""
        if name not in _PRESETS:
            raise ValueError(f"unknown Config preset {name!r}; expected one of {', '.join(_PRESETS)}")
        values: dict[str, Any] = {g: dict(v) for g, v in _PRESET_VALUES[name].items()}
        for key, value in _route_flat({k: v for k, v in overrides.items() if k not in _GROUP_NAMES},
                                      stacklevel=2).items():
            values.setdefault(key, {}).update(value)
        for group in _GROUP_NAMES:
            value = overrides.get(group)
            if isinstance(value, SettingsGroup):
                values[group] = value
            elif value is not None:
                values.setdefault(group, {}).update(_as_dict(group, value))
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some groups replaced (a group object) or changed (a dict of its fields)."""
        values: dict[str, Any] = {g: getattr(self, g).to_dict() for g in _GROUP_NAMES}
        for key, value in _route_flat({k: v for k, v in changes.items() if k not in _GROUP_NAMES},
                                      stacklevel=2).items():
            values[key].update(value)
        for group in _GROUP_NAMES:
            value = changes.get(group)
            if isinstance(value, SettingsGroup):
                values[group] = value
            elif value is not None:
                values[group].update(_as_dict(group, value))
        return Config(**values)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every setting, by group: ``{"detection": {"check_loss": True, ...}, ...}``."""
        return {g: getattr(self, g).to_dict() for g in _GROUP_NAMES}

    # ---------------------------------------------------------------- the flat names of 0.1, for one release
    def __getattr__(self, name: str) -> Any:
        group = field_group(name)
        if group is None:
            raise AttributeError(unknown_field_message(name, where="Config"))
        warnings.warn(f"Config.{name} is deprecated: use Config.{group}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(getattr(self, group), name)


def _route_flat(flat: dict[str, Any], *, stacklevel: int) -> dict[str, dict[str, Any]]:
    """Sort deprecated flat fields into their groups (one warning listing them), or name an unknown one."""
    routed: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        group = field_group(name)
        if group is None:
            raise TypeError(unknown_field_message(name, where="Config"))
        routed.setdefault(group, {})[name] = value
    if flat:
        spelled = ", ".join(f"{g}={{{', '.join(repr(n) + ': ...' for n in fields)}}}" for g, fields in routed.items())
        warnings.warn(f"flat Config fields are deprecated ({', '.join(flat)}): pass them by group, "
                      f"nantrace.Config({spelled})", DeprecationWarning, stacklevel=stacklevel + 1)
    return routed


def _as_dict(group: str, value: Any) -> dict[str, Any]:
    if isinstance(value, SettingsGroup):
        return value.to_dict()
    if isinstance(value, dict):
        return dict(value)
    cls = group_classes()[group]
    raise TypeError(f"Config.{group} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__}")


def _build(cls: type[SettingsGroup], given: GroupArg, flat: dict[str, Any]) -> Any:
    if isinstance(given, cls) and not flat:
        return given
    values = {} if given is None else _as_dict(cls.group, given)
    values.update(flat)
    return cls(**values)
