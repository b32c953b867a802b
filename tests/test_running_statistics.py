"""A divisor that is a pooled or running statistic is still a statistic (docs/diagnosis.md, provenance):
a running variance updated with Chan's parallel formula (``(var * count + batch_var * n + delta**2 *
count * n / total) / total``, SB3's RunningMeanStd / VecNormalize without its epsilon), Welford's
per-sample update ``M2 + delta * (x - mean)`` then ``M2 / (n - 1)``, and a pooled within-class
variance ``sum(n_c * var_c) / n``: 0 because every value pooled is the same, so dividing by its root
is ``zero_variance_norm`` (``family_rules._statistic``: through scaling by a positive count or
constant and sums of non-negative terms one of which is a statistic). A count of an empty selection
pooled the same way (``mask_a.sum() + mask_b.sum()``) stays a division by a zero count, and a
difference (a min-max range ``hi - lo``) stays ``div_by_zero``: never a statistic.

Each construction is checked with plain torch first: the first op that makes a non-finite value from
finite inputs is the marked division, and the statistic (or count, or range) is recomputed directly
from the values it was pooled over."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from origin_markers import origin_line, points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 3
STEPS = FAIL + 1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------- 1. a running observation normaliser
class RunningObsNorm(nn.Module):
    """VecNormalize-style observation normalisation with running statistics (Chan's parallel update,
    no epsilon), switched on once ``warmup`` observations were seen. One observation feature is a
    dead sensor that always reads 0.0: its running variance is 0."""

    def __init__(self, dim: int, warmup: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.zeros(dim))
        self.count, self.warmup = 0, warmup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                n = x.shape[0]
                delta = x.mean(0) - self.mean
                total = self.count + n
                var = (self.var * self.count + x.var(0, unbiased=False) * n + delta ** 2 * self.count * n / total) / total
                self.mean.copy_(self.mean + delta * n / total)
                self.var.copy_(var)
                self.count = total
        if self.count < self.warmup:
            return x
        return (x - self.mean) / self.var.sqrt()  # <origin:running_obs_norm>


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.obs_norm = RunningObsNorm(5, warmup=(FAIL + 1) * 8)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.obs_norm(obs))


def _obs_batches() -> list[Any]:
    g = _gen(11)
    out = []
    for _ in range(STEPS):
        obs = torch.randn(8, 5, generator=g)
        obs[:, 2] = 0.0  # the dead sensor
        out.append((obs, torch.randint(0, 3, (8,), generator=g)))
    return out


def _policy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, actions = batch
    return F.cross_entropy(model(obs), actions)


def _obs_check(batches: list[Any]) -> None:
    seen = torch.cat([b[0] for b in batches[: FAIL + 1]]).double()
    pooled = seen.var(0, unbiased=False)
    assert pooled[2] == 0 and bool((pooled[[0, 1, 3, 4]] > 0).all())  # only the dead sensor's variance is 0


# ----------------------------------------------------------------- 2. Welford's loop in the loss code
class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.pi = nn.Linear(16, 3)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.pi(self.body(obs))


def _welford_std(values: torch.Tensor) -> torch.Tensor:
    """The sample std of a rollout's rewards, streamed one reward at a time (Welford)."""
    n, mean, m2 = 0, torch.zeros(()), torch.zeros(())
    for r in values:
        n += 1
        delta = r - mean
        mean = mean + delta / n
        m2 = m2 + delta * (r - mean)
    return (m2 / (n - 1)).sqrt()


def _scaled_reward_pg(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, actions, rewards = batch
    logp = torch.log_softmax(model(obs), -1).gather(1, actions[:, None]).squeeze(1)
    adv = (rewards - rewards.mean()) / _welford_std(rewards)  # <origin:welford_scale>
    return -(logp * adv).mean()


def _pg_batches() -> list[Any]:
    g = _gen(22)
    out = []
    for step in range(STEPS):
        rewards = torch.randn(12, generator=g)
        if step == FAIL:
            rewards = torch.full((12,), -1.0)  # a living penalty every step: no goal reached in this rollout
        out.append((torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g), rewards))
    return out


def _pg_check(batches: list[Any]) -> None:
    r = batches[FAIL][2].double()
    assert r.std() == 0
    assert all(float(b[2].double().std()) > 0 for b in batches[:FAIL])


# ----------------------------------------------------------------- 3. a pooled within-class variance
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _within_class_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Whiten embeddings by the pooled within-class variance (an LDA-style centre loss)."""
    x, y = batch
    emb = model(x)
    pooled, centres = 0, []
    for c in range(3):
        members = emb[y == c]
        pooled = pooled + members.var(0, unbiased=False) * members.shape[0]
        centres.append(members.mean(0))
    pooled = pooled / emb.shape[0]
    z = (emb - torch.stack(centres)[y]) / pooled.sqrt()  # <origin:pooled_within_class>
    return z.pow(2).mean() + F.cross_entropy(emb[:, :3], y)


def _class_batches() -> list[Any]:
    g = _gen(33)
    out = []
    y = torch.arange(12) % 3
    for step in range(STEPS):
        x = torch.randn(12, 4, generator=g)
        if step == FAIL:
            x = torch.randn(3, 4, generator=g)[y]  # a batch of duplicates: every class holds one sample, repeated
        out.append((x, y))
    return out


def _class_check(batches: list[Any]) -> None:
    x, y = batches[FAIL]
    for c in range(3):
        assert bool((x[y == c] == x[y == c][0]).all())  # identical inputs: identical embeddings, variance 0
    x0, y0 = batches[0]
    assert float(x0[y0 == 0].double().var(0).min()) > 0


# ----------------------------------------------------------------- 4. negative: a pooled count of nothing
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def _two_segment_token_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A token loss averaged over the valid tokens of the source and target segments together."""
    src, tgt, src_mask, tgt_mask = batch
    nll_src = F.cross_entropy(model(src).flatten(0, 1), src.flatten(), reduction="none") * src_mask.flatten()
    nll_tgt = F.cross_entropy(model(tgt).flatten(0, 1), tgt.flatten(), reduction="none") * tgt_mask.flatten()
    valid = src_mask.sum() + tgt_mask.sum()
    return (nll_src.sum() + nll_tgt.sum()) / valid  # <origin:pooled_token_count>


def _token_batches() -> list[Any]:
    g = _gen(44)
    out = []
    for step in range(STEPS):
        src, tgt = torch.randint(0, 10, (4, 6), generator=g), torch.randint(0, 10, (4, 6), generator=g)
        src_mask = (torch.rand(4, 6, generator=g) < 0.8).float()
        tgt_mask = (torch.rand(4, 6, generator=g) < 0.8).float()
        if step == FAIL:
            src_mask.zero_()
            tgt_mask.zero_()  # a batch of padding only
        out.append((src, tgt, src_mask, tgt_mask))
    return out


def _token_check(batches: list[Any]) -> None:
    b = batches[FAIL]
    assert float(b[2].sum() + b[3].sum()) == 0
    assert all(float(x[2].sum() + x[3].sum()) > 0 for x in batches[:FAIL])


# ----------------------------------------------------------------- 5. negative: a range (a difference)
class MinMaxScale(nn.Module):
    """Per-sample min-max scaling of a spectrum: divides by the range ``hi - lo``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        return (x - lo) / (hi - lo)  # <origin:minmax_range>


class SpectrumNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.scale = MinMaxScale()
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(x))


def _spectrum_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _spectrum_batches() -> list[Any]:
    g = _gen(55)
    out = []
    for step in range(STEPS):
        x = torch.rand(6, 16, generator=g)
        if step == FAIL:
            x[4] = 0.5  # a saturated detector: a flat spectrum
        out.append((x, torch.randint(0, 2, (6,), generator=g)))
    return out


def _spectrum_check(batches: list[Any]) -> None:
    x = batches[FAIL][0]
    rng = x.amax(1) - x.amin(1)
    assert int((rng == 0).sum()) == 1


# ----------------------------------------------------------------- 6. per-group variances stacked, then pooled
def _stacked_group_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Group-normalised embeddings, the groups' variances gathered with ``torch.stack`` and averaged."""
    x, y = batch
    emb = model(x)
    per_group = torch.stack([emb[y == c].var(0, unbiased=False) for c in range(3)])
    z = emb / per_group.mean(0).sqrt()  # <origin:stacked_group_var>
    return z.pow(2).mean() + F.cross_entropy(emb[:, :3], y)


# ----------------------------------------------------------------- 7. negative: per-segment counts stacked
def _stacked_count_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    src, tgt, src_mask, tgt_mask = batch
    nll = F.cross_entropy(model(src).flatten(0, 1), src.flatten(), reduction="none") * src_mask.flatten()
    valid = torch.stack([src_mask.sum(), tgt_mask.sum()]).sum()
    return nll.sum() / valid  # <origin:stacked_count>


# ----------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    model: Callable[[], nn.Module]
    batches: Callable[[], list[Any]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    module: str | None
    tag: str
    cause: str
    check: Callable[[list[Any]], None]


CASES: dict[str, Case] = {
    "running_obs_normaliser_dead_sensor": Case(Policy, _obs_batches, _policy_loss, "obs_norm", "running_obs_norm",
                                               "zero_variance_norm", _obs_check),
    "welford_reward_scaling_constant_rollout": Case(ActorCritic, _pg_batches, _scaled_reward_pg, None, "welford_scale",
                                                    "zero_variance_norm", _pg_check),
    "pooled_within_class_variance_duplicated_batch": Case(Encoder, _class_batches, _within_class_loss, None,
                                                          "pooled_within_class", "zero_variance_norm", _class_check),
    "pooled_token_count_all_padding": Case(TinyLM, _token_batches, _two_segment_token_loss, None, "pooled_token_count",
                                           "div_by_zero", _token_check),
    "minmax_range_flat_spectrum": Case(SpectrumNet, _spectrum_batches, _spectrum_loss, "scale", "minmax_range",
                                       "div_by_zero", _spectrum_check),
    "stacked_group_variances_duplicated_batch": Case(Encoder, _class_batches, _stacked_group_loss, None,
                                                     "stacked_group_var", "zero_variance_norm", _class_check),
    "stacked_segment_counts_all_padding": Case(TinyLM, _token_batches, _stacked_count_loss, None, "stacked_count",
                                               "div_by_zero", _token_check),
}


def _modes(case: Case) -> tuple[str, ...]:
    return ("zero_intrusive",) if case.module is not None else ("zero_intrusive", "replayable")


class FirstBad(TorchDispatchMode):
    """The first op that makes a non-finite value from finite inputs, and this file's line that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None
        self.line: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.op is None:
            fl = lambda t: isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0  # noqa: E731
            ins = [t for t in tree_leaves((args, kwargs)) if fl(t)]
            outs = [t for t in tree_leaves(out) if fl(t)]
            if all(bool(torch.isfinite(t).all()) for t in ins) and any(not bool(torch.isfinite(t).all()) for t in outs):
                self.op = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename != __file__:
                    frame = frame.f_back
                self.line = frame.f_lineno if frame is not None else None
        return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_construction_fails_as_described_without_nantrace(name: str) -> None:
    case = CASES[name]
    model, batches = case.model(), case.batches()
    case.check(batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(batches):
        opt.zero_grad()
        if step < FAIL:
            loss = case.loss(model, batch)
            assert bool(torch.isfinite(loss)), (name, step)
            loss.backward()
            opt.step()
            continue
        with FirstBad() as first:
            loss = case.loss(model, batch)
        assert not bool(torch.isfinite(loss))
        assert (first.op, first.line) == ("aten.div.Tensor", origin_line(__file__, case.tag))


@pytest.mark.parametrize("name,mode", [(n, m) for n, c in sorted(CASES.items()) for m in _modes(c)])
def test_a_pooled_or_running_statistic_is_still_a_statistic(name: str, mode: str) -> None:
    case = CASES[name]
    model, batches = case.model(), case.batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(case.loss) if mode == "replayable" else case.loss
        for batch in batches:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    assert guard.incidents, "no incident"
    first = guard.incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause) == \
        (FAIL, "nonfinite_loss", "forward", "aten.div.Tensor", case.module, case.cause), first.to_dict()
    assert points_at(first.source, __file__, case.tag), first.source


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_independent_oracle_agrees(name: str) -> None:
    import types

    import cause_oracle

    case = CASES[name]
    model = case.model()
    program = types.SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                    batches=case.batches(), loss_fn=case.loss, autocast=None, scaler=None)
    verdict = cause_oracle.decide(program)
    assert (verdict.step, verdict.phase, verdict.op, verdict.module, verdict.cause) == \
        (FAIL, "forward", "aten.div.Tensor", case.module, case.cause), verdict
    assert points_at(verdict.source, __file__, case.tag), verdict.source
