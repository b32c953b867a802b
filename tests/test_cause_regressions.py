"""One regression test per cause miss listed in issue 9, each a small real program trained
under ``nantrace.watch`` (zero-intrusive), asserting the exact diagnosis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.storage.runstore import RunStore
from origin_markers import origin_line

pytestmark = pytest.mark.usefixtures("one_thread")


def train(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: list[Any], *,
          lr: float = 1e-2, optimizer: type = torch.optim.SGD, **watch: Any) -> list[nantrace.Incident]:
    opt = optimizer(model.parameters(), lr=lr)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False), **watch)
    with guard:
        for batch in batches:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    return [i for i in guard.incidents if i.action != "logged"]


def where(incident: nantrace.Incident) -> tuple[Any, ...]:
    line = int(incident.source.rpartition(":")[2]) if incident.source else None
    return incident.kind, incident.phase, incident.op, incident.module, incident.cause, line


# ---------------------------------------------------------------- a LayerNorm at the end of a divergence
class PreNormRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.deep = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.deep(torch.tanh(self.proj(x)))
        return self.head(self.norm(h)) + h.mean(-1, keepdim=True)  # <origin:diverging_norm>


def test_layernorm_overflow_at_the_end_of_a_divergence_names_the_divergence():
    """A learning rate far too high: the loss grows step after step until the LayerNorm's
    variance (or the loss) overflows float32. Not ``zero_variance_norm`` (eps is 1e-5 and the input
    is anything but constant): an ``overflow`` at the op where it broke, the summary naming the
    divergence with its growth (API.md: the overflow's diagnosis says what made the values huge)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(40):
        x = torch.randn(32, 16, generator=gen)
        batches.append((x, x.sum(-1, keepdim=True)))
    model = PreNormRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.6)
    # finite warnings only logged, so the run goes on to the overflow (the early warning is issue 12's)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, finite_anomaly_action="log"))
    with pytest.raises(nantrace.NonFiniteError), guard:  # the ladder pauses the dead run in the end
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    first = next(i for i in guard.incidents if i.kind.startswith("nonfinite"))
    assert first.cause in ("overflow", "gradient_explosion"), first.summary
    assert "diverging" in first.summary, first.summary
    assert first.cause != "zero_variance_norm"
    trend = first.details["evidence"]["divergence"]
    assert float(trend["end"]) / float(trend["start"]) >= 10
    assert "grew" in first.summary and "→" in first.summary and "over" in first.summary
    assert first.op is not None and first.transient is False


def test_layernorm_of_huge_values_without_history_is_an_overflow_not_zero_variance():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.fc(x))  # <origin:huge_norm>

    torch.manual_seed(0)
    batches = [torch.randn(4, 8)] * 3 + [torch.randn(4, 8) * 1e26]  # an unnormalised batch
    [inc] = train(Net(), lambda m, x: m(x).pow(2).mean(), batches)
    assert where(inc) == ("nonfinite_loss", "forward", "aten.native_layer_norm.default", "norm", "overflow",
                          origin_line(__file__, "huge_norm"))
    assert inc.details["evidence"]["eps"] == 1e-5 and "not constant" in inc.summary


# ------------------------------------------------- statistics over too few elements or a constant slice
class StdScaler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h - h.mean(0)) / h.std(0)  # <origin:batch_std>


class ManualLayerNorm(nn.Module):
    """A norm written by hand, eps = 0: padding rows (all zeros) have a zero spread."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        mu = h.mean(-1, keepdim=True)
        sd = ((h - mu) ** 2).mean(-1, keepdim=True).sqrt()
        return (h - mu) / sd  # <origin:manual_norm>


def _padded(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[2] = 0
    return x


@pytest.mark.parametrize("model, bad, op, tag", [
    (StdScaler, lambda: torch.randn(1, 8), "aten.std.correction", "batch_std"),  # a one-sample batch
    (ManualLayerNorm, lambda: _padded(torch.randn(4, 8)), "aten.div.Tensor", "manual_norm"),
], ids=["std_of_one_sample", "manual_norm_padding_row"])
def test_a_statistic_over_a_constant_or_one_element_slice_is_zero_variance(model, bad, op, tag):
    torch.manual_seed(0)
    [inc] = train(model(), lambda m, x: m(x).pow(2).mean(), [torch.randn(4, 8)] * 3 + [bad()])
    assert where(inc) == ("nonfinite_loss", "forward", op, "", "zero_variance_norm", origin_line(__file__, tag))


# ----------------------------------------------------------------------- ops beyond hand-written lists
class Angle(nn.Module):
    """An angle from a "cosine" that is not one: a gate times the input's scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos = torch.sigmoid(self.a(x)).mean(-1) * x.abs().amax(-1)
        return torch.acos(cos)  # <origin:acos_domain>


class Compound(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rate = nn.Linear(8, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        growth = 1 + torch.sigmoid(self.rate(x)) * x.abs().mean()
        return torch.cumprod(growth, dim=-1)  # <origin:cumprod_overflow>


@pytest.mark.parametrize("model, bad, op, cause, tag", [
    (Angle, lambda: torch.randn(4, 8) * 100, "aten.acos.default", "domain_error", "acos_domain"),
    (Compound, lambda: torch.randn(4, 8) * 1e4, "aten.cumprod.default", "overflow", "cumprod_overflow"),
], ids=["acos_beyond_one", "cumprod_float32_overflow"])
def test_ops_outside_any_list_get_a_cause_from_evidence(model, bad, op, cause, tag):
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) * 0.01] * 3 + [bad()]
    inc = train(model(), lambda m, x: m(x).mean(), batches)[0]
    assert where(inc)[2:] == (op, "", cause, origin_line(__file__, tag))


# --------------------------------------------------------------------- class weights zero for every target
def test_cross_entropy_with_zero_weight_for_every_target_is_a_division_not_a_label_error():
    weight = torch.tensor([0.0, 1.0, 1.0, 1.0])  # class 0 is "background", weighted out

    def loss(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(m(x), y, weight=weight)  # <origin:weighted_ce>

    torch.manual_seed(0)
    ok = (torch.randn(4, 8), torch.tensor([1, 2, 3, 0]))
    only_background = (torch.randn(4, 8), torch.zeros(4, dtype=torch.long))  # every label valid
    [inc] = train(nn.Linear(8, 4), loss, [ok] * 3 + [only_background])
    assert where(inc) == ("nonfinite_loss", "forward", "aten.nll_loss_forward.default", None, "div_by_zero",
                          origin_line(__file__, "weighted_ce"))
    assert "class weights" in inc.summary and inc.details["evidence"]["target_weight_sum"] == 0.0


# ------------------------------------------------------------------ two infinities that meet: the first one
class TwoExps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.exp(self.a(x))  # <origin:first_exp>
        second = torch.exp(self.b(x))
        return second - first  # inf - inf


def test_two_overflows_that_combine_name_the_first_that_broke():
    torch.manual_seed(0)
    model = TwoExps()
    with torch.no_grad():
        model.a.weight.fill_(1.0)
        model.b.weight.fill_(1.0)
    [inc] = train(model, lambda m, x: m(x).mean(), [torch.randn(4, 8) * 0.1] * 3 + [torch.full((4, 8), 20.0)])
    assert where(inc) == ("nonfinite_loss", "forward", "aten.exp.default", "", "exp_overflow", origin_line(__file__, "first_exp"))
    assert [c["op"] for c in inc.chain if c.get("origin")] == ["aten.exp.default"]


# ----------------------------------------------------------------------- localisation never fails silently
def test_an_error_inside_localisation_is_shown_stored_and_counted(tmp_path, monkeypatch):
    import nantrace.localisation.localiser as localiser

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("classifier exploded")

    monkeypatch.setattr(localiser, "classify", broken)
    torch.manual_seed(0)
    model = TwoExps()
    with torch.no_grad():
        model.a.weight.fill_(1.0)
    [inc] = train(model, lambda m, x: m(x).mean(), [torch.full((4, 8), 20.0)], run_dir=tmp_path / "run")
    assert inc.action == "skipped" and inc.cause == "unknown"
    assert inc.details["localisation_error"].startswith("RuntimeError: classifier exploded (at ")
    assert "nantrace's own localisation failed" in inc.summary
    with RunStore(tmp_path / "run", readonly=True) as store:  # logged in the run store with the incident
        [stored] = store.incidents()
    assert stored.details["localisation_error"] == inc.details["localisation_error"]


# ------------------------------------------------------------------- an exception, replayed from its bundle
class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))  # <origin:token_embed>


def test_an_exception_incident_replays_from_its_bundle_to_the_same_diagnosis(tmp_path):
    torch.manual_seed(0)
    model = TokenNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randint(0, 16, (2, 5)) for _ in range(3)] + [torch.tensor([[3, 4, 99, 1, 2]])]
    guard = nantrace.watch(model, opt, run_dir=tmp_path / "run", config=nantrace.Config(print_incidents=False))
    with pytest.raises(IndexError) as raised, guard:
        for tokens in batches:
            opt.zero_grad()
            model(tokens).logsumexp(-1).mean().backward()
            opt.step()
    assert "index out of range" in str(raised.value)  # the user's exception, unchanged
    [inc] = guard.incidents
    assert where(inc) == ("exception", "forward", "aten.embedding.default", "embed", "label_out_of_range",
                          origin_line(__file__, "token_embed"))
    again = nantrace.replay(inc.bundle, model=TokenNet())
    assert where(again) == where(inc) and again.transient is False


# -------------------------------------------- a finite value outside a distribution's support (Python check)
class GaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(4, 2)
        self.sd = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(x), torch.relu(self.sd(x))  # a standard deviation that can be exactly 0


def test_a_scale_of_zero_rejected_by_torch_distributions_is_an_exception_incident():
    torch.manual_seed(0)
    model = GaussianPolicy()
    with torch.no_grad():
        model.sd.bias.fill_(1.0)  # positive scales on ordinary batches
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    with pytest.raises(ValueError, match="to satisfy the constraint") as raised, guard:
        for step in range(5):
            x = torch.rand(8, 4) * 0.1 if step != 3 else torch.full((8, 4), -1e3)  # relu(·) = 0 at step 3
            mu, sd = model(x)
            dist = torch.distributions.Normal(mu, sd, validate_args=True)  # (another library may turn the default off)
            loss = -dist.log_prob(torch.zeros_like(mu)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.cause, inc.action) == (3, "exception", "domain_error", "raised")
    assert "scale of Normal" in inc.summary and str(raised.value).splitlines()[0] in inc.details["exception"]
