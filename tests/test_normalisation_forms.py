"""A normalisation is one whatever way its divisor is written, and a number read to the host keeps its provenance
(docs/diagnosis.md, provenance).

1. The same cosine similarity of an embedding that is all zeros (a black frame through a bias-free backbone)
   written six ways: ``z @ z.T / (|z| |z|^T)`` (broadcast, ``torch.outer``, a column-by-row ``@``),
   ``(z / |z|) @ (z / |z|).T``, ``z @ z.T / |z|`` and ``z @ z.T / (2 |z|)``: the divisor is a product, power or
   positive multiple of norms of the data it normalises, so each is ``zero_variance_norm``
   (``family_rules._StatWalk._scaled``). A batch norm written by hand (``(x - mean) / sqrt(mean((x - mean)^2))``)
   over a dead feature is one too: a deviation from a mean is no distance.
2. A norm of a DIFFERENCE of two values is a distance: dividing something else by it (a mode-seeking ratio
   ``|G(z1) - G(z2)| / |z1 - z2|``, an inverse-distance weight ``1 / cdist(q, k)``) at two points that coincide
   is ``div_by_zero``; dividing that very difference by it (the unit direction ``d / |d|``) is a normalisation,
   ``zero_variance_norm`` (``family_rules._is_distance``, ``_reaches``).
3. A number read off a tensor with ``.item()`` / ``float()`` / ``int()`` / ``tolist()`` (for a logger) and then
   divided by: the loss tape notes each host read (``LossTape._note_read``) and each kept call taking such a
   number (``Entry.host``); the replay links the call's ops to the replayed tensor (``loss_replay._host_numbers``)
   and ``family_rules._div_rule`` follows the zero divisor to the op that made it: an advantage std of constant
   returns (the mean read too, also 0.0; both read in one ``tolist()`` of the two stacked), read before the
   forward or after it, or made a tensor again, is ``zero_variance_norm``; a count of an all-false mask read with
   ``.item()`` is ``div_by_zero``; and an ``int()`` of a std of 0.3 is 0 without the std being 0: ``div_by_zero``
   (must not fire). A ``replayable`` call's re-run links them the same way (``rerun._HostReads``).

Each construction is checked with plain torch first: the first op that makes a non-finite value from finite inputs
is the marked one, on the marked line, and the value it divides by is recomputed directly (a zero norm, std, count
or distance)."""

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


# ============================================================ 1. the same cosine similarity, six ways
class Backbone(nn.Module):
    """Bias-free: a black (all-zero) frame embeds to exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _contrastive(sim: torch.Tensor) -> torch.Tensor:
    half = len(sim) // 2
    sim = sim.masked_fill(torch.eye(len(sim), dtype=torch.bool), float("-inf")) / 0.2
    return F.cross_entropy(sim, torch.cat([torch.arange(half, len(sim)), torch.arange(half)]))


def _embed(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    v1, v2 = batch
    z = torch.cat([model(v1), model(v2)])
    return z, z.norm(dim=1)


def cos_broadcast(model: nn.Module, batch: Any) -> torch.Tensor:
    z, n = _embed(model, batch)
    return _contrastive(z @ z.T / (n[:, None] * n[None, :]))  # <origin:cos_broadcast>


def cos_outer(model: nn.Module, batch: Any) -> torch.Tensor:
    z, n = _embed(model, batch)
    return _contrastive(z @ z.T / torch.outer(n, n))  # <origin:cos_outer>


def cos_column_row(model: nn.Module, batch: Any) -> torch.Tensor:
    z, n = _embed(model, batch)
    return _contrastive(z @ z.T / (n[:, None] @ n[None, :]))  # <origin:cos_column_row>


def cos_normalised_first(model: nn.Module, batch: Any) -> torch.Tensor:
    z, n = _embed(model, batch)
    u = z / n[:, None]  # <origin:cos_normalised_first>
    return _contrastive(u @ u.T)


def cos_over_norm(model: nn.Module, batch: Any) -> torch.Tensor:
    z, n = _embed(model, batch)
    return _contrastive(z @ z.T / n[:, None])  # <origin:cos_over_norm>


def cos_twice_norm(model: nn.Module, batch: Any) -> torch.Tensor:
    z, n = _embed(model, batch)
    return _contrastive(z @ z.T / (2.0 * n[:, None]))  # <origin:cos_twice_norm>


def _views_batches() -> list[Any]:
    g = _gen(11)
    out = []
    for step in range(STEPS):
        x = torch.rand(6, 16, generator=g)
        v1, v2 = x + 0.05 * torch.randn(6, 16, generator=g), x + 0.05 * torch.randn(6, 16, generator=g)
        if step == FAIL:
            v1[4], v2[4] = 0.0, 0.0  # a black letterbox frame, in both views
        out.append((v1, v2))
    return out


def _views_check(model: nn.Module, batches: list[Any]) -> None:
    with torch.no_grad():
        norms = torch.cat([model(batches[FAIL][0]), model(batches[FAIL][1])]).norm(dim=1)
        assert int((norms == 0).sum()) == 2  # the frame's embedding is all zeros in both views
        assert all(bool((torch.cat([model(b[0]), model(b[1])]).norm(dim=1) > 0).all()) for b in batches[:FAIL])


# ------------------------------------------------------------ a batch norm written by hand, dead feature
class HandBatchNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(0)
        var = ((x - mu) ** 2).mean(0)
        return (x - mu) / var.sqrt()  # <origin:hand_bn>


class Tabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.bn = HandBatchNorm()
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(x)).squeeze(-1)


def tabular_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _tabular_batches() -> list[Any]:
    g = _gen(12)
    out = []
    for step in range(STEPS):
        x = torch.randn(8, 5, generator=g)
        if step == FAIL:
            x[:, 2] = 3.0  # a stuck sensor: a constant column
        out.append((x, torch.randn(8, generator=g)))
    return out


def _tabular_check(model: nn.Module, batches: list[Any]) -> None:
    assert float(batches[FAIL][0][:, 2].var(unbiased=False)) == 0
    assert all(bool((b[0].var(0) > 0).all()) for b in batches[:FAIL])


# ============================================================ 2. distances
class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def mode_seeking(model: nn.Module, batch: Any) -> torch.Tensor:
    """MSGAN's mode-seeking term per pair: the images' distance over the latents' distance."""
    z1, z2, target = batch
    a, b = model(z1), model(z2)
    ratio = (a - b).abs().mean(1) / (z1 - z2).norm(dim=1)  # <origin:ms_ratio>
    return F.mse_loss(a, target) - 0.1 * ratio.mean()


def unit_direction(model: nn.Module, batch: Any) -> torch.Tensor:
    """Aligns the direction between the two outputs with a target direction."""
    z1, z2, target = batch
    d = model(z1) - model(z2)
    u = d / d.norm(dim=1, keepdim=True)  # <origin:unit_dir>
    return (1 - (u * target).sum(1)).mean()


def _latent_batches() -> list[Any]:
    g = _gen(13)
    out = []
    for step in range(STEPS):
        z1, z2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
        if step == FAIL:
            z2[3] = z1[3]  # the sampler drew the same latent twice
        out.append((z1, z2, F.normalize(torch.randn(5, 6, generator=g), dim=1)))
    return out


def _latent_check(model: nn.Module, batches: list[Any]) -> None:
    z1, z2, _ = batches[FAIL]
    assert int(((z1 - z2).norm(dim=1) == 0).sum()) == 1
    with torch.no_grad():
        assert int(((model(z1) - model(z2)).norm(dim=1) == 0).sum()) == 1
    assert all(bool(((b[0] - b[1]).norm(dim=1) > 0).all()) for b in batches[:FAIL])


class Keys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def inverse_distance(model: nn.Module, batch: Any) -> torch.Tensor:
    """Inverse-distance weighting: the model's values at the sample points ``x`` interpolated at the queries ``q``."""
    q, x, target = batch
    w = 1.0 / torch.cdist(q, x)  # <origin:idw>
    pred = (w / w.sum(1, keepdim=True)) @ model(x)
    return F.mse_loss(pred, target)


def _idw_batches() -> list[Any]:
    g = _gen(14)
    out = []
    for step in range(STEPS):
        q, x = torch.randn(3, 4, generator=g), torch.randn(6, 4, generator=g)
        if step == FAIL:
            q[1] = x[2]  # a query at a sample point
        out.append((q, x, torch.randn(3, 4, generator=g)))
    return out


def _idw_check(model: nn.Module, batches: list[Any]) -> None:
    q, x, _ = batches[FAIL]
    assert int((torch.cdist(q, x) == 0).sum()) == 1
    assert all(bool((torch.cdist(b[0], b[1]) > 0).all()) for b in batches[:FAIL])


# ============================================================ 3. numbers read to the host
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


LOG: dict[str, float] = {}


def reinforce_item(model: nn.Module, batch: Any) -> torch.Tensor:
    """REINFORCE: the advantages' mean and std read for the logger, then used to standardise them."""
    obs, actions, returns = batch
    adv = returns - returns.mean()
    LOG["adv_mean"], LOG["adv_std"] = adv.mean().item(), adv.std().item()
    adv = (adv - LOG["adv_mean"]) / LOG["adv_std"]  # <origin:item_std>
    logp = F.log_softmax(model(obs), -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * adv).mean()


def reinforce_tolist(model: nn.Module, batch: Any) -> torch.Tensor:
    """The advantages' mean and std read in one host read (``tolist()`` of the two stacked), then used."""
    obs, actions, returns = batch
    adv = returns - returns.mean()
    mean, std = torch.stack([adv.mean(), adv.std()]).tolist()
    adv = (adv - mean) / std  # <origin:tolist_std>
    logp = F.log_softmax(model(obs), -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * adv).mean()


def reinforce_item_after_forward(model: nn.Module, batch: Any) -> torch.Tensor:
    """As above, the std read before the policy's forward and divided by after it."""
    obs, actions, returns = batch
    std = float(returns.std())
    logp = F.log_softmax(model(obs), -1).gather(1, actions[:, None]).squeeze(1)
    adv = (returns - returns.mean()) / std  # <origin:float_std_after>
    return -(logp * adv).mean()


def reinforce_tensor_again(model: nn.Module, batch: Any) -> torch.Tensor:
    """The std read for the logger, then made a tensor again."""
    obs, actions, returns = batch
    LOG["ret_std"] = returns.std().item()
    scale = torch.tensor(LOG["ret_std"])
    logp = F.log_softmax(model(obs), -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * returns / scale).mean()  # <origin:tensor_again>


def _returns_batches() -> list[Any]:
    g = _gen(15)
    out = []
    for step in range(STEPS):
        rewards = torch.zeros(16) if step == FAIL else (torch.rand(16, generator=g) < 0.3).float()
        if step < FAIL:
            rewards[0] = 1.0  # every episode before FAIL earned something
        returns = torch.flip(torch.cumsum(torch.flip(rewards, [0]), 0), [0])
        out.append((torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g), returns))
    return out


def _returns_check(model: nn.Module, batches: list[Any]) -> None:
    assert batches[FAIL][2].std().item() == 0.0 and (batches[FAIL][2] - batches[FAIL][2].mean()).mean().item() == 0.0
    assert all(b[2].std().item() > 0 for b in batches[:FAIL])


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(12, 8)
        self.out = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def masked_token_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A token loss over the labelled tokens; their number is read for the logger and divided by."""
    tokens, labels = batch
    valid = labels != -100
    LOG["tokens"] = valid.sum().item()
    nll = F.cross_entropy(model(tokens).flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    return (nll * valid.flatten()).sum() / LOG["tokens"]  # <origin:item_count>


def _token_batches() -> list[Any]:
    g = _gen(16)
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, 12, (3, 5), generator=g)
        labels = torch.randint(0, 5, (3, 5), generator=g)
        labels[torch.rand(3, 5, generator=g) < 0.3] = -100
        if step == FAIL:
            labels[:] = -100  # a batch of prompts only: no labelled token
        out.append((tokens, labels))
    return out


def _token_check(model: nn.Module, batches: list[Any]) -> None:
    assert int((batches[FAIL][1] != -100).sum()) == 0
    assert all(int((b[1] != -100).sum()) > 0 for b in batches[:FAIL])


def quantised_by_int_std(model: nn.Module, batch: Any) -> torch.Tensor:
    """Targets quantised to ``int(std)`` levels: below 1 the int is 0 although the std is not (must not fire)."""
    obs, actions, returns = batch
    levels = int(returns.std())
    logp = F.log_softmax(model(obs), -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * torch.round(returns * 4) / levels).mean()  # <origin:int_std>


def _small_returns_batches() -> list[Any]:
    g = _gen(17)
    out = []
    for step in range(STEPS):
        scale = 0.25 if step == FAIL else 8.0
        out.append((torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g),
                    scale * torch.rand(16, generator=g)))
    return out


def _small_returns_check(model: nn.Module, batches: list[Any]) -> None:
    std = float(batches[FAIL][2].std())
    assert 0 < std < 1 and int(batches[FAIL][2].std()) == 0
    assert all(int(b[2].std()) >= 1 for b in batches[:FAIL])


# ============================================================ the cases
@dataclasses.dataclass
class Case:
    model: Callable[[], nn.Module]
    batches: Callable[[], list[Any]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    op: str
    module: str | None
    tag: str
    cause: str
    check: Callable[[nn.Module, list[Any]], None]
    replayable: str | None = ""
    """"" : diagnosed the same under ``guard.replayable``; None: not a loss-function case; a text: why the
    ``replayable`` mode is still wrong (a strict xfail)."""
    summary: str = ""
    """A phrase the summary must hold (the provenance that decided the cause; for a number read to the host, only
    where the tape's link is replayed: zero-intrusive)."""
    reads: bool = False
    """The divisor is a number the step's code read to the host."""


DIV, RECIP = "aten.div.Tensor", "aten.reciprocal.default"
CASES: dict[str, Case] = {
    "cosine_norm_outer_product_broadcast": Case(Backbone, _views_batches, cos_broadcast, DIV, None, "cos_broadcast",
                                                "zero_variance_norm", _views_check, summary="product or multiple of norms"),
    "cosine_torch_outer_of_norms": Case(Backbone, _views_batches, cos_outer, DIV, None, "cos_outer",
                                        "zero_variance_norm", _views_check),
    "cosine_column_times_row_matmul": Case(Backbone, _views_batches, cos_column_row, DIV, None, "cos_column_row",
                                           "zero_variance_norm", _views_check),
    "cosine_normalised_first": Case(Backbone, _views_batches, cos_normalised_first, DIV, None, "cos_normalised_first",
                                    "zero_variance_norm", _views_check),
    "cosine_gram_over_one_norm": Case(Backbone, _views_batches, cos_over_norm, DIV, None, "cos_over_norm",
                                      "zero_variance_norm", _views_check),
    "cosine_gram_over_twice_the_norm": Case(Backbone, _views_batches, cos_twice_norm, DIV, None, "cos_twice_norm",
                                            "zero_variance_norm", _views_check),
    "batch_norm_by_hand_stuck_sensor": Case(Tabular, _tabular_batches, tabular_loss, DIV, "bn", "hand_bn",
                                            "zero_variance_norm", _tabular_check, replayable=None),
    "mode_seeking_ratio_same_latent_twice": Case(Generator, _latent_batches, mode_seeking, DIV, None, "ms_ratio",
                                                 "div_by_zero", _latent_check, summary="distance"),
    "unit_direction_of_difference_same_latent_twice": Case(Generator, _latent_batches, unit_direction, DIV, None,
                                                           "unit_dir", "zero_variance_norm", _latent_check,
                                                           summary="of the difference it divides"),
    "inverse_distance_weight_query_on_a_key": Case(Keys, _idw_batches, inverse_distance, RECIP, None, "idw",
                                                   "div_by_zero", _idw_check, summary="distance"),
    "advantage_mean_and_std_read_with_item": Case(Policy, _returns_batches, reinforce_item, DIV, None, "item_std",
                                                  "zero_variance_norm", _returns_check,
                                                  summary="read to the host", reads=True),
    "advantage_mean_and_std_read_with_one_tolist": Case(Policy, _returns_batches, reinforce_tolist, DIV, None,
                                                        "tolist_std", "zero_variance_norm", _returns_check,
                                                        summary="standard deviation", reads=True),
    "return_std_read_with_float_before_forward_divided_after": Case(
        Policy, _returns_batches, reinforce_item_after_forward, DIV, None, "float_std_after", "zero_variance_norm",
        _returns_check, summary="read to the host", reads=True),
    "return_std_read_then_made_a_tensor_again": Case(Policy, _returns_batches, reinforce_tensor_again, DIV, None,
                                                     "tensor_again", "zero_variance_norm", _returns_check,
                                                     reads=True),
    "labelled_token_count_read_with_item_prompt_only_batch": Case(Tagger, _token_batches, masked_token_loss, DIV, None,
                                                                  "item_count", "div_by_zero", _token_check,
                                                                  summary="count", reads=True),
    "int_of_a_nonzero_std_is_no_zero_std": Case(Policy, _small_returns_batches, quantised_by_int_std, DIV, None,
                                                "int_std", "div_by_zero", _small_returns_check,
                                                summary="divided by the scalar 0", reads=True),
}


def _params() -> list[Any]:
    out = []
    for name, case in sorted(CASES.items()):
        out.append(pytest.param(name, "zero_intrusive", id=f"{name}-zero_intrusive"))
        if case.replayable is None:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=case.replayable)] if case.replayable else []
        out.append(pytest.param(name, "replayable", marks=marks, id=f"{name}-replayable"))
    return out


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
    case.check(model, batches)
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
        assert (first.op, first.line) == (case.op, origin_line(__file__, case.tag))


@pytest.mark.parametrize("name,mode", _params())
def test_the_diagnosis_does_not_depend_on_how_the_divisor_is_written(name: str, mode: str) -> None:
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
        (FAIL, "nonfinite_loss", "forward", case.op, case.module, case.cause), first.to_dict()
    assert points_at(first.source, __file__, case.tag), first.source
    if mode == "zero_intrusive" or not case.reads:
        assert case.summary in first.summary, first.summary


def test_a_healthy_step_keeps_nothing_of_its_host_reads_past_the_step() -> None:
    """The tape's table of numbers read to the host is the step's: a healthy step leaves it empty at the next one."""
    model, batches = Policy(), _returns_batches()[:FAIL]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for batch in batches:
            opt.zero_grad()
            reinforce_item(model, batch).backward()
            opt.step()
            tapes = [t for t in (guard.recorder.tape, guard.recorder.prelude) if t is not None]
            assert tapes and all(len(t._numbers) <= 2 for t in tapes)  # this step's mean and std at most
        assert not guard.incidents
