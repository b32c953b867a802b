"""Per-layer statistics (nantrace.dynamics.layers): the fast per-layer norms and update
ratios, read from the sentinel's figures and foreach reductions, against a slow,
obviously-correct reference computed from the model in float64; cadence; the run store."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import nantrace
from conftest import assert_unhooked
from dynamics_helpers import _one_thread, classification_batches, quiet, relu_mlp, train  # noqa: F401
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics._layers import LayerIndex
from nantrace.dynamics.layers import LayerStatsMonitor
from nantrace.storage.runstore import RunStore

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")


class Net(nn.Module):
    """Layers of several shapes, a root-level parameter and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(5))
        self.body = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 5, bias=False))
        self.norm = nn.LayerNorm(5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.norm(self.body(x))) * self.scale


def _reference_norms(model: nn.Module, which: str) -> dict[str, float]:
    """Per-layer L2 norms of the parameters ('param') or their gradients ('grad'), float64, one tensor at a time."""
    sums: dict[str, float] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p if which == "param" else p.grad
        if t is None:
            continue
        layer = name.rpartition(".")[0]
        sums[layer] = sums.get(layer, 0.0) + float((t.detach().double() ** 2).sum())
    return {k: math.sqrt(v) for k, v in sums.items()}


def test_layer_index_groups_by_owning_module() -> None:
    index = LayerIndex(["scale", "body.0.weight", "body.0.bias", "body.2.weight", "norm.weight", "norm.bias"])
    assert index.names == ["", "body.0", "body.2", "norm"]
    assert index.layer_of.tolist() == [0, 1, 1, 2, 3, 3]
    np.testing.assert_allclose(index.combine([2.0, 3.0, 4.0, 1.0, 0.0, 0.0]), [2.0, 5.0, 1.0, 0.0])
    partial = index.combine([3.0, 4.0], which=[1, 2])
    assert partial[1] == 5.0 and np.isnan(partial[[0, 2, 3]]).all()
    assert index.present([1, 2]).tolist() == [False, True, False, False]
    bad = index.combine([math.inf, 1.0, 1.0, math.nan, 1.0, 1.0])
    assert bad[0] == math.inf and np.isnan(bad[2]) and bad[1] == math.sqrt(2)  # never hidden


@pytest.mark.parametrize("param_check_every", [1, 16])
def test_layer_norms_and_update_ratios_match_a_float64_reference(tmp_path, param_check_every) -> None:
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batches = classification_batches(0)
    expected: dict[int, dict[str, tuple[float, float, float | None]]] = {}
    before: dict[str, torch.Tensor] = {}

    def pre_hook(optimizer, args, kwargs):
        before.clear()
        before.update({n: p.detach().clone().double() for n, p in model.named_parameters() if p.requires_grad})
        expected[len(expected)] = {k: (g, _reference_norms(model, "param")[k], None)
                                   for k, g in _reference_norms(model, "grad").items()}

    def post_hook(optimizer, args, kwargs):
        step = len(expected) - 1
        delta: dict[str, float] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                layer = name.rpartition(".")[0]
                delta[layer] = delta.get(layer, 0.0) + float(((p.detach().double() - before[name]) ** 2).sum())
        if step % 3 == 0:
            expected[step] = {k: (g, w, math.sqrt(delta[k]) / w) for k, (g, w, _) in expected[step].items()}

    cfg = quiet(layer_stats_every=1, update_stats_every=3).replace(detection={"param_check_every": param_check_every})
    guard = nantrace.watch(model, opt, run_dir=tmp_path, config=cfg)
    handles = [opt.register_step_pre_hook(pre_hook),  # after the guard's own hook: sees the same gradients
               opt.register_step_post_hook(post_hook)]
    import torch.nn.functional as F
    for step in range(10):
        x, y = batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    guard.close()
    for handle in handles:
        handle.remove()

    with RunStore(tmp_path, readonly=True) as store:
        names = store.get_meta("layer_names")
        rows = store.layer_stats()
    assert names == ["", "body.0", "body.2", "norm"]  # the frozen layer is not watched
    assert len(rows) == 10 * 4
    for step, layer, grad, param, ratio in rows:
        want_grad, want_param, want_ratio = expected[step][names[layer]]
        assert grad == pytest.approx(want_grad, rel=1e-5)
        # the parameters are read every step, or every 16th (step 0) and on the update-ratio steps (their own norms)
        read = param_check_every == 1 or step % param_check_every == 0 or step % 3 == 0
        assert param == (pytest.approx(want_param, rel=1e-5) if read else None)
        if want_ratio is None:
            assert ratio is None
        else:
            assert ratio == pytest.approx(want_ratio, rel=1e-4)
    assert_unhooked(model, opt)


def test_update_ratio_without_parameter_check_uses_its_own_norms(tmp_path) -> None:
    model = relu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = train(model, opt, classification_batches(), 4, quiet(check_params=False, update_stats_every=2), run_dir=tmp_path)
    monitor = next(m for m in guard.monitors if isinstance(m, LayerStatsMonitor))
    assert monitor.latest_update is not None and monitor.latest_update.step == 2
    with RunStore(tmp_path, readonly=True) as store:
        rows = store.layer_stats()
    ratios = {(s, layer): u for s, layer, g, p, u in rows}
    assert all(ratios[(s, layer)] is not None for s in (0, 2) for layer in range(4))
    assert all(ratios[(s, layer)] is None for s in (1, 3) for layer in range(4))
    assert all(0 < ratios[(0, layer)] < 1 for layer in range(4))


def test_layer_rows_follow_the_cadence_and_nothing_without_a_store(tmp_path) -> None:
    model = relu_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, opt, classification_batches(), 9, quiet(layer_stats_every=4, update_stats_every=0), run_dir=tmp_path)
    with RunStore(tmp_path, readonly=True) as store:
        assert sorted({r[0] for r in store.layer_stats()}) == [0, 4, 8]
    model = relu_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = train(model, opt, classification_batches(), 3, quiet())
    assert guard.store is None and not guard.incidents


def test_nonfinite_layer_norms_are_stored_not_hidden(tmp_path) -> None:
    model = relu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[2].weight.register_hook(lambda g: g * float("nan") if hook_step[0] == 2 else g)
    hook_step = [0]
    guard = train(model, opt, classification_batches(), 4, quiet(), run_dir=tmp_path,
                  before_step=lambda s: hook_step.__setitem__(0, s))
    assert [(i.step, i.kind) for i in guard.incidents] == [(2, "nonfinite_grad")]
    with RunStore(tmp_path, readonly=True) as store:
        rows = {(s, layer): g for s, layer, g, p, u in store.layer_stats()}
    assert math.isnan(rows[(2, 1)])  # the layer whose weight gradient was NaN
    assert math.isfinite(rows[(2, 0)]) and math.isfinite(rows[(2, 3)]) and math.isfinite(rows[(1, 1)])


def test_a_failing_monitor_is_turned_off_with_a_warning_and_training_goes_on(monkeypatch) -> None:
    model = relu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(self, ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(LayerStatsMonitor, "_on_step", broken)
    with pytest.warns(MonitorFailedWarning, match="layer statistics monitor failed.*boom"):
        guard = train(model, opt, classification_batches(), 3, quiet())
    monitor = next(m for m in guard.monitors if isinstance(m, LayerStatsMonitor))
    assert not monitor.active and isinstance(monitor.failed, RuntimeError)
    assert guard.step == 3


def test_monitors_read_device_values_only_around_sampled_steps(monkeypatch) -> None:
    """No host read (item/tolist/float/bool) in any monitor on a step that nothing samples; on the
    step after a sampled one, the figures enqueued then are read (no sync on a GPU: already copied)."""
    model = relu_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = quiet(update_stats_every=5, activation_stats_every=5, optimizer_stats_every=5, logit_stats_every=5)
    guard = nantrace.watch(model, opt, config=cfg)
    inside: list[int] = []
    reads: list[tuple[int, str]] = []
    for monitor in guard.monitors:
        def on_step(ctx, _original=monitor.on_step):
            inside.append(ctx.step)
            try:
                return _original(ctx)
            finally:
                inside.pop()
        monitor.on_step = on_step  # type: ignore[method-assign]
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        def read(self, *args, _name=name, _original=getattr(torch.Tensor, name), **kwargs):
            if inside:
                reads.append((inside[-1], _name))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    import torch.nn.functional as F
    batches = classification_batches()
    for step in range(12):
        x, y = batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    monkeypatch.undo()
    guard.close()
    assert reads, "the sampled figures were never read"
    assert {step for step, _ in reads} <= {0, 1, 5, 6, 10, 11}
