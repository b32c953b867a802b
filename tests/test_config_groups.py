"""nantrace.Config grouped by concern: group construction, presets, the deprecated flat names of
0.1 (they warn and still work), and the errors for an unknown or misplaced field."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import nantrace
from nantrace.config import DetectionConfig, DynamicsConfig, LocalisationConfig, OutputsConfig, ResponseConfig

GROUPS = {"detection": DetectionConfig, "response": ResponseConfig, "localisation": LocalisationConfig,
          "dynamics": DynamicsConfig, "outputs": OutputsConfig}


def test_groups_and_their_defaults() -> None:
    cfg = nantrace.Config()
    assert [f.name for f in dataclasses.fields(cfg)] == list(GROUPS)
    for name, cls in GROUPS.items():
        assert getattr(cfg, name) == cls()
    assert cfg.detection.spike_sigma == 6.0 and cfg.response.skip_budget == 5 and cfg.outputs.print_incidents


def test_every_field_lives_in_exactly_one_group() -> None:
    names = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == 55


def test_group_objects_and_dicts_are_the_same() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = nantrace.Config(detection=DetectionConfig(spike_sigma=8.0), outputs=OutputsConfig(print_incidents=False))
        b = nantrace.Config(detection={"spike_sigma": 8.0}, outputs={"print_incidents": False})
        assert a == b and a.detection.spike_sigma == 8.0
        assert a.replace(detection={"spike_window": 200}).detection == DetectionConfig(spike_sigma=8.0, spike_window=200)
        quiet = nantrace.Config.preset("minimal", outputs={"print_incidents": False})
        assert quiet.outputs.flight_recorder == 8 and not quiet.outputs.print_incidents  # merged into the preset
        assert not quiet.dynamics.early_warnings


def test_flat_names_warn_and_still_work() -> None:
    with pytest.warns(DeprecationWarning, match=r"nantrace.Config\(detection=\{'spike_sigma': ...\}"):
        cfg = nantrace.Config(spike_sigma=8.0)
    assert cfg.detection.spike_sigma == 8.0
    with pytest.warns(DeprecationWarning, match="use Config.detection.spike_sigma"):
        assert cfg.spike_sigma == 8.0
    with pytest.warns(DeprecationWarning):
        minimal = nantrace.Config.preset("minimal", print_incidents=False)
    assert not minimal.outputs.print_incidents and minimal.outputs.flight_recorder == 8
    with pytest.warns(DeprecationWarning):
        assert cfg.replace(rollback_keep=4).response.rollback_keep == 4
    with pytest.warns(DeprecationWarning):
        assert nantrace.Config(print_incidents=False) == nantrace.Config(outputs={"print_incidents": False})


def test_unknown_field_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"Config has no field 'spike_sigmaa'; did you mean 'spike_sigma'"):
        nantrace.Config(spike_sigmaa=1.0)
    with pytest.raises(TypeError, match=r"Config.detection has no field 'nonsense'"):
        nantrace.Config(detection={"nonsense": 1})
    with pytest.raises(AttributeError, match="Config has no field 'nonsense'"):
        nantrace.Config().nonsense  # noqa: B018


def test_misplaced_field_names_its_group() -> None:
    with pytest.raises(TypeError, match=r"Config.detection has no field 'rollback_keep': it belongs to Config.response"):
        nantrace.Config(detection={"rollback_keep": 2})
    with pytest.raises(TypeError, match="it belongs to Config.outputs"):
        DynamicsConfig(print_incidents=False)
    with pytest.raises(TypeError, match="Config.detection must be a DetectionConfig or a dict"):
        nantrace.Config(detection=3)


def test_each_group_validates_its_own_fields() -> None:
    with pytest.raises(ValueError, match=r"Config.detection.spike_window must be an integer >= 24, got 2"):
        DetectionConfig(spike_window=2)
    with pytest.raises(ValueError, match=r"Config.response.rollback_where must be 'memory' or 'disk'"):
        ResponseConfig(rollback_where="tape")
    with pytest.raises(TypeError, match=r"Config.localisation.localise must be a bool, got 1"):
        LocalisationConfig(localise=1)
    with pytest.raises(ValueError, match=r"Config.dynamics.lr_tolerance must be a number in \(0, 1\)"):
        DynamicsConfig(lr_tolerance=2.0)
    with pytest.raises(ValueError, match=r"Config.outputs.model_factory must be 'module:callable'"):
        OutputsConfig(model_factory="nocolon")


def test_to_dict_is_grouped_and_round_trips() -> None:
    cfg = nantrace.Config(detection={"spike_sigma": 7.0})
    data = cfg.to_dict()
    assert set(data) == set(GROUPS) and data["detection"]["spike_sigma"] == 7.0
    assert nantrace.Config(**data) == cfg
