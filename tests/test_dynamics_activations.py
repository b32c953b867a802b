"""Activation statistics and logit saturation (nantrace.dynamics.activations / .logits):
device reductions against plain references, hooks only on sampled steps, non-finite values
counted, saturation reported."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks

import nantrace
from conftest import assert_unhooked
from dynamics_helpers import _one_thread, classification_batches, monitor_hooks, quiet, relu_mlp, train  # noqa: F401
from nantrace.dynamics._common import MonitorFailedWarning
from nantrace.dynamics.activations import ActivationMonitor, output_stats
from nantrace.dynamics.logits import LogitSaturationMonitor, find_logits, logit_stats
from nantrace.storage.runstore import RunStore

pytestmark = pytest.mark.filterwarnings(f"error::{MonitorFailedWarning.__module__}.{MonitorFailedWarning.__name__}")


def test_output_stats_match_a_reference() -> None:
    a = torch.tensor([[1.0, -7.5, float("nan")], [float("inf"), 2.0, -float("inf")]])
    b = torch.tensor([3.0, -9.0]).half()
    absmax, nonfinite = output_stats([a, b]).tolist()
    finite = [abs(float(x)) for x in list(a.flatten()) + list(b.float()) if math.isfinite(float(x))]
    assert absmax == max(finite) == 9.0 and nonfinite == 3
    assert output_stats([torch.zeros(0)]) is None


def _monitor_hook(guard: Any) -> Any:
    return next(m for m in guard.monitors if isinstance(m, ActivationMonitor))._hook


def test_activation_rows_on_sampled_steps_match_hooks_by_hand(tmp_path) -> None:
    model = relu_mlp(0, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[tuple[int, str], tuple[float, int]] = {}
    step_of = [0]

    def record(name):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            t = output.detach()
            finite = t[torch.isfinite(t)]
            seen[(step_of[0], name)] = (float(finite.abs().max()), int((~torch.isfinite(t)).sum()))
        return hook

    guard = nantrace.watch(model, opt, run_dir=tmp_path, config=quiet(activation_stats_every=3))
    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules()]
    batches = classification_batches()
    for step in range(7):
        step_of[0] = step
        sampled = step % 3 == 0
        hooks = {monitor_hooks(m, guard) for m in model}  # the layers: only our own hook, every step
        assert hooks == {1}
        # nantrace's is one process-wide forward hook, on sampled steps only (a hook on a module would take
        # torch's TransformerEncoderLayer off its fused path: test_no_hook_changes_a_fused_encoder_layer)
        assert (_monitor_hook(guard) in _global_forward_hooks.values()) == sampled
        x, y = batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        with torch.no_grad():  # an evaluation inside the loop is not counted
            model(x * 1000)
    for handle in handles:
        handle.remove()
    guard.close()
    assert_unhooked(model, opt)
    with RunStore(tmp_path, readonly=True) as store:
        names = store.get_meta("activation_names")
        rows = store.activation_stats()
    assert names == [n for n, _ in model.named_modules()]
    assert sorted({r[0] for r in rows}) == [0, 3, 6]
    for step, index, absmax, nonfinite in rows:
        want_absmax, want_nonfinite = seen[(step, names[index])]  # the training forward came first
        assert absmax == pytest.approx(want_absmax) and nonfinite == want_nonfinite


def test_nonfinite_activations_are_counted(tmp_path) -> None:
    class Blowup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(self.lin(x) * 200.0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Blowup())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = train(model, opt, classification_batches(), 1, quiet(activation_stats_every=1), run_dir=tmp_path)
    assert guard.incidents and guard.incidents[0].kind.startswith("nonfinite")
    with RunStore(tmp_path, readonly=True) as store:
        names = store.get_meta("activation_names")
        rows = {names[i]: (a, n) for s, i, a, n in store.activation_stats()}
    assert rows["1"][1] > 0 and math.isfinite(rows["1"][0])  # inf counted, abs-max over the finite values
    assert rows["1.lin"][1] == 0 and rows[""][1] == rows["1"][1]


def test_activation_statistics_cost_nothing_without_a_store() -> None:
    model = relu_mlp(0, width=8)
    guard = nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=quiet(activation_stats_every=1))
    monitor = next(m for m in guard.monitors if isinstance(m, ActivationMonitor))
    assert not monitor.active and all(monitor_hooks(m, guard) == 0 for m in model[1:])
    guard.close()


# ----------------------------------------------------------------- logits
def test_find_logits() -> None:
    assert find_logits(torch.zeros(4, 3)) is not None
    assert find_logits(torch.zeros(2, 5, 7)) is not None
    assert find_logits({"logits": torch.zeros(4, 3), "loss": torch.zeros(())}) is not None
    assert find_logits((torch.zeros(4, 3), torch.zeros(4))) is not None
    for not_logits in (torch.zeros(4), torch.zeros(4, 1), torch.zeros(2, 3, 4, 5), torch.zeros(4, 3, dtype=torch.long),
                       {"hidden": torch.zeros(4, 3)}, None):
        assert find_logits(not_logits) is None


def test_logit_stats_match_a_reference() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 700, 6, generator=g) * 12  # more rows than one chunk
    z[0, 0] = torch.tensor([100.0, 0, 0, 0, 0, 0])
    large, pmax_sum, rows, saturated, count = logit_stats(z).tolist()
    p = torch.softmax(z.double().reshape(-1, 6), -1).max(-1).values
    assert rows == 2100 and count == 2100 * 6
    assert large == float((z.abs() > 30).sum())
    assert pmax_sum == pytest.approx(float(p.sum()), rel=1e-5)
    edge = float(((p > 1 - 1.5e-6) & (p < 1 - 0.5e-6)).sum())  # float32 cannot tell these apart from the threshold
    assert abs(saturated - float((p > 1 - 1e-6).sum())) <= edge


class Scale(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def _classifier(k: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5), Scale(k))


@pytest.mark.parametrize(("k", "smoothing", "needle"), [
    (1.0, 0.0, None),
    (1000.0, 0.0, "The model's logits (5 classes) saturate: "),
    (1.0, 0.1, None),
])
def test_logit_saturation(k: float, smoothing: float, needle: str | None) -> None:
    model = _classifier(k)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = train(model, opt, classification_batches(), 60,
                  quiet(logit_stats_every=5, dynamics_warmup=20, label_smoothing=smoothing))
    found = [i for i in guard.incidents if i.kind == "logit_saturation"]
    summary = nantrace.dynamics.summary(guard)["logits"]
    assert summary["classes"] == 5 and 0.2 <= summary["mean_max_prob"] <= 1.0
    if needle is None:
        assert found == []
        return
    assert len(found) == 1 and needle in found[0].summary and found[0].step == 26  # samples 20 and 25, read at 26
    assert max(found[0].details["saturated_rows"], found[0].details["large_fraction"]) >= 0.9
    assert "label_smoothing=0.1" in found[0].fix and found[0].module == ""


def test_declared_smoothing_that_does_not_reach_the_output_is_reported() -> None:
    monitor = LogitSaturationMonitor(every=1, warmup=0, label_smoothing=0.1)
    assert monitor.smoothing_bound(5) == pytest.approx(0.92)
    from nantrace.dynamics.logits import LogitFigures

    figures = LogitFigures(step=3, classes=5, large_fraction=0.0, mean_max_prob=0.99, saturated_rows=0.1)
    assert monitor._judge(figures) == []  # once is not enough
    signal = monitor._judge(LogitFigures(step=4, classes=5, large_fraction=0.0, mean_max_prob=0.99, saturated_rows=0.1))
    assert len(signal) == 1 and "exceeds the 0.9200 that the declared label smoothing 0.1 allows" in signal[0].summary


class _FrozenTextProbe(nn.Module):
    """A frozen, eval-mode transformer encoder (torch's fused inference path) under a trained probe."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval().requires_grad_(False)
        self.probe = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.encoder(x, src_key_padding_mask=pad)
        return self.probe(h.mean(1))


@pytest.mark.parametrize("run_dir", [False, True])
def test_no_hook_changes_a_fused_encoder_layer(tmp_path, run_dir) -> None:
    """nantrace never hooks a module of the user's model on its own (the part calls of the first step, the
    activation statistics of sampled steps): torch's TransformerEncoderLayer takes another path when it or a
    sublayer is hooked, and an all-padding row is NaN on the fused path and 0 on the other. The logits of
    every step, sampled or not, are bit for bit those of the same model unwatched."""
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(6, 5, dtype=torch.bool)
    pad[:, 3:] = True
    plain_model = _FrozenTextProbe()
    with torch.no_grad():
        plain = plain_model(x, pad)
    model = _FrozenTextProbe()
    opt = torch.optim.SGD(model.probe.parameters(), lr=0.0)
    guard = nantrace.watch(model, opt, run_dir=tmp_path if run_dir else None,
                           config=quiet(activation_stats_every=1))
    try:
        for step in range(3):
            opt.zero_grad()
            out = model(x, pad)
            assert torch.equal(out.detach(), plain), step
            out.sum().backward()
            opt.step()
    finally:
        guard.close()
