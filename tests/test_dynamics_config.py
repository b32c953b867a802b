"""Training-dynamics settings of nantrace.Config: validation, presets, and which monitors they build."""

from __future__ import annotations

import json

import pytest
import torch

import nantrace
from dynamics_helpers import _one_thread, classification_batches, monitor_hooks, relu_mlp, train  # noqa: F401
from nantrace.dynamics.registry import build_monitors

SAMPLED = ("update_stats_every", "activation_stats_every", "optimizer_stats_every", "logit_stats_every")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("layer_stats_every", -1, "Config.dynamics.layer_stats_every must be an integer >= 0, got -1"),
    ("update_stats_every", 2.5, "Config.dynamics.update_stats_every must be an integer >= 0, got 2.5"),
    ("dynamics_warmup", True, "Config.dynamics.dynamics_warmup must be an integer >= 0, got True"),
    ("update_ratio_max", 0, "Config.dynamics.update_ratio_max must be a number > 0, got 0"),
    ("lr_tolerance", 1.5, "Config.dynamics.lr_tolerance must be a number in (0, 1), got 1.5"),
    ("label_smoothing", 1.0, "Config.dynamics.label_smoothing must be a number in [0, 1), got 1.0"),
    ("tensorboard", 3, "Config.outputs.tensorboard must be False, True (RUN_DIR/tensorboard) or a log directory, got 3"),
    ("early_warnings", "yes", "Config.dynamics.early_warnings must be a bool, got 'yes'"),
    ("clip_stats", 1, "Config.dynamics.clip_stats must be a bool, got 1"),
])
def test_bad_values_name_the_option(field: str, value, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        nantrace.Config(**{field: value})
    assert message in str(info.value)


def _names(config: nantrace.Config) -> list[str]:
    return [type(m).__name__ for m in build_monitors(config)]


def test_presets() -> None:
    minimal = nantrace.Config.preset("minimal")
    assert all(getattr(minimal, f) == 0 for f in (*SAMPLED, "layer_stats_every"))
    assert not minimal.early_warnings and not minimal.clip_stats and _names(minimal) == []
    default = nantrace.Config.preset("default")
    assert default == nantrace.Config()
    assert default.layer_stats_every == 1 and all(getattr(default, f) > 1 for f in SAMPLED)
    assert _names(default) == ["LayerStatsMonitor", "ActivationMonitor", "OptimizerStateMonitor",
                               "LogitSaturationMonitor", "ClipMonitor"]
    thorough = nantrace.Config.preset("thorough")
    assert all(getattr(thorough, f) == 1 for f in (*SAMPLED, "layer_stats_every"))
    schedule = {"peak_lr": 1e-3}
    names = _names(nantrace.Config(lr_schedule=schedule, tensorboard="tb"))
    assert names[-2:] == ["LRScheduleMonitor", "TensorBoardMonitor"]


def test_minimal_preset_leaves_no_trace_and_costs_no_monitor(tmp_path) -> None:
    model = relu_mlp(0, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = train(model, opt, classification_batches(), 3, nantrace.Config.preset("minimal", print_incidents=False),
                  run_dir=tmp_path)
    assert guard.monitors == []
    from nantrace.storage.runstore import RunStore

    with RunStore(tmp_path, readonly=True) as store:
        assert store.layer_stats() == [] and store.activation_stats() == []
        assert store.get_meta("layer_names") is None


def test_config_with_a_callable_schedule_is_stored(tmp_path) -> None:
    model = relu_mlp(0, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = nantrace.Config(print_incidents=False, lr_schedule=lambda step: 0.1)
    train(model, opt, classification_batches(), 2, cfg, run_dir=tmp_path)
    from nantrace.storage.runstore import RunStore

    with RunStore(tmp_path, readonly=True) as store:
        stored = store.get_meta("config")
    assert "lambda" in stored["dynamics"]["lr_schedule"] and json.dumps(stored)


def test_without_an_optimizer_no_monitor_installs_anything() -> None:
    model = relu_mlp(0, width=8)
    guard = nantrace.watch(model, config=nantrace.Config.preset("thorough", print_incidents=False))
    assert all(not m.active for m in guard.monitors)
    assert all(not monitor_hooks(m, guard) for m in model)
    guard.close()
