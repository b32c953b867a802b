"""Large finite values are data, not failures (issue 12): nantrace's own statistics (norms, squares,
ratios) must not overflow where the user's values are finite. Healthy runs whose activations,
parameters, gradients and optimizer state reach 1e30 in float32 (6e4 in float16) give 0 incidents,
under every statistic the ``thorough`` preset turns on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace


class Big(nn.Module):
    """A small regression with three large but finite side parts: a parameter of magnitude ``big``
    multiplying an activation (activations and parameters of that size), and a tiny parameter
    scaled up by ``gain`` (its gradient is ``gain``: large gradients and optimizer state)."""

    def __init__(self, big: float, gain: float, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.big = nn.Parameter(torch.full((64,), big))
        self.tiny = nn.Parameter(torch.full((64,), 1.0 / gain))
        self.gain = gain
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        act = torch.sigmoid(h[:, :1]) * self.big  # activations as large as ``big``
        return h, act


def _run(dtype, optimizer, *, big, gain, act_scale, steps=12):
    model = Big(big, gain, dtype)
    # ``tiny`` learns with a learning rate scaled to its gradient, so that ``tiny * gain`` stays of order 1:
    # the run is healthy, its numbers merely large
    groups = [{"params": [model.lin.weight, model.lin.bias, model.big]},
              {"params": [model.tiny], "lr": (1e-3 / gain if optimizer == "adam" else 1e-3 / gain**2)}]
    if optimizer == "adam":
        opt = torch.optim.Adam(groups, lr=1e-3, eps=1e-4 if dtype == torch.float16 else 1e-8)
    else:
        opt = torch.optim.SGD(groups, lr=1e-3, momentum=0.9)
    config = nantrace.Config.preset("thorough", print_incidents=False, dynamics_warmup=0)
    guard = nantrace.watch(model, opt, config=config)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(dtype)
        opt.zero_grad()
        h, act = model(x)
        loss = F.mse_loss(h.float(), x.float()) + (act.float() * act_scale).mean() + (model.tiny.float() * gain).sum() * 1e-3
        loss.backward()
        opt.step()
    guard.close()
    return guard, model, opt


CASES = {
    # float32: values up to 1e30; gradients 1e30 with SGD (momentum buffer 1e30), Adam state exp_avg_sq ~1e30
    "float32-sgd": (torch.float32, "sgd", dict(big=1e30, gain=1e33, act_scale=1e-30)),
    "float32-adam": (torch.float32, "adam", dict(big=1e30, gain=3e19, act_scale=1e-30)),
    # float16: values up to 6e4 (the range's top is 65504)
    "float16-sgd": (torch.float16, "sgd", dict(big=6e4, gain=6e6, act_scale=1e-4)),    # momentum buffer -> 4e4
    "float16-adam": (torch.float16, "adam", dict(big=6e4, gain=2e6, act_scale=1e-4)),  # exp_avg_sq -> 5e4
}


@pytest.mark.parametrize("case", list(CASES))
def test_healthy_runs_with_huge_finite_values_have_zero_incidents(case, one_thread):
    dtype, optimizer, kw = CASES[case]
    guard, model, opt = _run(dtype, optimizer, **kw)
    # the run really holds such values, all finite
    top = 1e30 if dtype == torch.float32 else 6e4
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    values = list(model.parameters()) + [p.grad for p in model.parameters()] + state
    assert all(bool(torch.isfinite(t).all()) for t in values)
    assert max(float(t.detach().abs().max()) for t in values) >= top * 0.9
    assert max(float(t.detach().abs().max()) for t in state) >= top / 2 ** 1.5
    assert [(i.step, i.kind, i.summary) for i in guard.incidents] == []
    rows = list(guard.reporter.history)
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["param_norm"]) for r in rows)


@pytest.mark.parametrize("dtype, top", [(torch.float32, 1e30), (torch.bfloat16, 1e30), (torch.float16, 6e4)])
def test_state_and_update_norms_match_a_float64_reference_at_the_top_of_the_range(dtype, top):
    from nantrace.dynamics.layers import update_norms
    from nantrace.dynamics.optimizer_state import tensor_state_stats

    g = torch.Generator().manual_seed(0)
    m = (torch.rand(64, 33, generator=g) * top).to(dtype)
    v = (torch.rand(64, 33, generator=g) * top).to(dtype)
    got = tensor_state_stats(m, v, 1e-16).tolist()
    assert got[0] == pytest.approx(float(m.double().norm()), rel=1e-6)
    assert got[1] == float(v.double().max())
    assert got[4] == 0 and all(math.isfinite(x) for x in got)
    v[3, 4] = float("inf")
    m[0, 0] = float("nan")
    assert tensor_state_stats(m, v, 1e-16).tolist()[4] > 0  # a real non-finite value is found exactly
    m[0, 0] = 3.0
    assert tensor_state_stats(m, v, 1e-16).tolist()[4] > 0  # the inf in v alone
    before = [(torch.rand(64, 33, generator=g) * top).to(dtype)]
    after = [(torch.rand(64, 33, generator=g) * -top).to(dtype)]
    want = float((before[0].double() - after[0].double()).norm())
    if dtype == torch.float16:  # the difference itself exceeds float16: the user's own arithmetic, not ours
        return
    [delta] = update_norms(before, after)
    assert float(delta) == pytest.approx(want, rel=1e-2)
