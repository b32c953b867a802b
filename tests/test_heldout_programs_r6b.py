"""Held-out failures, round 6b: failures that RAISE (incident kind ``exception``) and bad values that
the user's own code catches.

1. An op that validates its input raises on a value that a NaN or an infinity made: Cholesky of a
   deep-kernel GP's covariance, ``torch.bincount`` of confidence bins, ``torch.histc`` used for
   logging, ``torch.multinomial`` under ``Categorical.sample`` with validation off, the CPU
   ``binary_cross_entropy``; and the silent step in between: a NaN or ``-inf`` CAST TO ``long``
   (garbage: INT64_MIN on x86) that then indexes ``cross_entropy``'s targets or an embedding.
   What the contract asks (docs/api.md, docs/diagnosis.md §3): kind ``exception``, action
   ``raised``, and the ORIGIN OF THE BAD VALUE (op, module, line, cause), not the op that raised.
2. A check written in Python (torch.distributions' argument validation) rejects a value: a NaN
   (``acos`` beyond 1, ``sqrt`` of a negative, a 0/0 inside ``Categorical``'s own normalisation) or
   a finite value outside the support (a ReLU scale of exactly 0, an ``exp`` "probability" above 1):
   the op that made the rejected value, ``domain_error`` for a finite one.
3. Finite values outside a decomposition's domain: ``torch.linalg.solve`` of a singular Gram matrix.
4. Checks of the USER'S OWN: ``assert torch.isfinite(loss)``, detectron2's ``FloatingPointError``
   raised between ``backward()`` and ``optimizer.step()``, ``clip_grad_norm_(...,
   error_if_nonfinite=True)`` on a NaN gradient (the bad value is a gradient: phase ``backward``).
5. Loops that CATCH the failure and train on (``CONTINUE``): Lightning's "return None to skip the
   batch" (``if not torch.isfinite(loss): continue`` before backward, no exception at all), a
   ``RuntimeError`` of ``error_if_nonfinite`` caught after backward (gradients zeroed, batch
   skipped), an ``IndexError`` from a forward caught, and a torch.distributions ``ValueError``
   raised in the forward caught. Expected there: one incident at the step of the bad batch (steps
   count ``optimizer.step()`` calls, so the bad batch and the next one share a step index) naming
   the origin; the next, healthy batch's update lands (nothing of it is blocked), and the bad batch
   changed no weight. tests/test_exception_evidence.py covers a caught op raise and a caught Python
   check in the loss code (its two strict xfails); these are other shapes.

Every expectation was written from the construction before nantrace ran on it, and checked with
plain torch in ``test_cases_fail_without_nantrace``: the program fails at ``FAIL_STEP`` and not
before, raising the expected exception type (or with a non-finite loss / gradient), and, for a
value made non-finite in the forward, a dispatch mode of this file's own (``FirstNonFinite``)
names the op that first made an infinity (not a ``-inf`` fill), else the first that made a NaN,
from finite inputs: it must be the expected op. Backward origins are checked by their
construction's facts (a residual exactly 0 under ``** 0.5``, a variance exactly 0 under ``sqrt``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nantrace
from heldout_harness import (Judge, Program, aligned, assert_diagnosis, case_params, describe, same, sgd, snapshot, steps,
                             train)
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread", "distributions_validate")]

FAIL_STEP = 3
STEPS = 5

JUDGE = Judge(__file__)


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return steps(normal, bad, FAIL_STEP, STEPS)


CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
RAISES: dict[str, type[BaseException] | None] = {}
"""name -> the exception type the plain program raises at FAIL_STEP (None: it does not raise)."""
CONTINUE: dict[str, str] = {}
"""name -> how the loop goes on past the bad batch: ``skip_nonfinite`` (no backward for a
non-finite loss) or ``catch`` (the exception is caught, the gradients zeroed, the batch skipped)."""
_BOTH = ("zero_intrusive", "replayable")
XFAIL: dict[str, str] = {
}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want, raises: type[BaseException] | None, go_on: str | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        RAISES[name] = raises
        if go_on is not None:
            CONTINUE[name] = go_on
        return build

    return register


def raised(*args: Any, **kw: Any) -> Want:
    return Want("exception", *args, action="raised", step=FAIL_STEP, **kw)


# =================================================== 1. an op that validates its input raises
# 1a. Deep kernel learning (DKL): count features are log-transformed by the feature extractor, a
#     GP's exact marginal likelihood in the loss code. A count of 0 at FAIL_STEP: log(0) = -inf, the
#     linear layers turn it into inf - inf = NaN, the kernel matrix is NaN and torch.linalg.cholesky
#     raises "not positive-definite". The value it rejected is the NaN, made from the log's -inf.
class LogCounts(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.log(counts)  # <origin:gp_log>


class DeepKernel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = LogCounts()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 4))
        self.log_lengthscale = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-2.0))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.net(self.features(counts)) / self.log_lengthscale.exp()


def gp_marginal_likelihood(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    z = model(x)
    k = torch.exp(-0.5 * torch.cdist(z, z).pow(2)) + model.log_noise.exp() * torch.eye(len(z))
    chol = torch.linalg.cholesky(k)
    alpha = torch.cholesky_solve(y[:, None], chol)
    return (0.5 * (y[:, None] * alpha).sum() + chol.diagonal().log().sum()) / len(y)


@case("dkl_gp_log_count_zero_cholesky_of_nan_kernel",
      raised("forward", "aten.log.default", "features", "gp_log", "log_nonpositive"), torch.linalg.LinAlgError)
def _dkl() -> Program:
    torch.manual_seed(0)
    model = DeepKernel()
    g = torch.Generator().manual_seed(6101)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.randint(1, 50, (12, 5), generator=g).float()
        if zero:
            counts[4, 1] = 0.0  # a product never viewed
        return counts, torch.randn(12, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), gp_marginal_likelihood)


# 1b. Learning to rank with graded relevance: the grade is the click-through rate, binned, computed
#     before the forward. An item with 0 impressions: 0 / 0 = NaN, cast to long it is INT64_MIN and
#     cross_entropy raises "Target ... is out of bounds". The NaN came from the division.
def graded_relevance_ce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, clicks, impressions = batch
    ctr = clicks / impressions  # <origin:ctr_div>
    grade = (ctr * 4).round().long()
    return F.cross_entropy(model(x), grade)


@case("ltr_ctr_grade_zero_impressions_nan_cast_to_target",
      raised("forward", "aten.div.Tensor", None, "ctr_div", "div_by_zero"), IndexError)
def _ltr() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(6102)

    def batch(step: int, unseen: bool = False) -> tuple[torch.Tensor, ...]:
        impressions = torch.randint(5, 50, (16,), generator=g).float()
        clicks = torch.floor(impressions * torch.rand(16, generator=g))
        if unseen:
            impressions[6], clicks[6] = 0.0, 0.0  # a new item, never shown
        return torch.randn(16, 10, generator=g), clicks, impressions

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), graded_relevance_ce)


# 1c. An event-sequence recommender (TiSASRec-like) with log2-bucketed time gaps. Gaps are >= 1 s,
#     so the bucket is clamped from above only; two events logged in the same second (gap 0):
#     log2(0) = -inf, cast to long INT64_MIN, and the embedding raises "index out of range".
class TimeBuckets(nn.Module):
    def __init__(self, n: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.n = n
        self.emb = nn.Embedding(n, dim)

    def forward(self, gaps: torch.Tensor) -> torch.Tensor:
        bucket = torch.log2(gaps).floor().long().clamp(max=self.n - 1)  # <origin:log2_bucket>
        return self.emb(bucket)


class EventRecommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(50, 8)
        self.time = TimeBuckets()
        self.head = nn.Linear(8, 50)

    def forward(self, items: torch.Tensor, gaps: torch.Tensor) -> torch.Tensor:
        return self.head((self.item(items) + self.time(gaps)).mean(1))


def _event_batch(g: torch.Generator, same_second: bool) -> tuple[torch.Tensor, ...]:
    items = torch.randint(0, 50, (6, 7), generator=g)
    gaps = 1.0 + torch.rand(6, 7, generator=g) * 1e4
    if same_second:
        gaps[2, 3] = 0.0
    return items, gaps, torch.randint(0, 50, (6,), generator=g)


@case("event_recommender_log2_time_bucket_of_zero_gap_embedding",
      raised("forward", "aten.log2.default", "time", "log2_bucket", "log_nonpositive"), IndexError)
def _events() -> Program:
    torch.manual_seed(0)
    model = EventRecommender()
    g = torch.Generator().manual_seed(6103)
    return Program(model, sgd(model), _steps(lambda s: _event_batch(g, False), lambda s: _event_batch(g, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# 1d. A calibration-aware focal loss (AdaFocal-like): gamma per confidence bin, the bins counted by
#     torch.bincount. A tabular batch with a missing value (NaN) at FAIL_STEP: the logits of that row
#     are NaN, its confidence bin is INT64_MIN and bincount raises. The batch carried the NaN.
N_BINS = 10


def adafocal_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    probs = logits.softmax(-1)
    conf = probs.max(-1).values.detach()
    bins = (conf * N_BINS).long().clamp(max=N_BINS - 1)
    counts = torch.bincount(bins, minlength=N_BINS).clamp(min=1)
    correct = (probs.argmax(-1) == y).float()
    gap = (torch.zeros(N_BINS).index_add(0, bins, correct - conf) / counts).abs()
    gamma = 1.0 + 4.0 * gap[bins]
    pt = probs.gather(1, y[:, None]).squeeze(1)
    return (-(1 - pt) ** gamma * torch.log(pt)).mean()


@case("adafocal_bincount_of_confidence_bins_missing_value_in_batch",
      raised("data", None, None, None, "nonfinite_input"), RuntimeError)
def _adafocal() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(6104)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=g)
        if missing:
            x[5, 3] = float("nan")
        return x, torch.randint(0, 4, (16,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), adafocal_loss)


# 1e. A Poisson GLM (rate = exp(linear)) whose loss code logs a histogram of the predicted rates with
#     torch.histc. One row of the batch is in the wrong unit (x 1e3): exp overflows float32 and histc
#     raises "range of [.., inf] is not finite".
class PoissonGLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.linear(x)).squeeze(-1)  # <origin:rate_exp>


RATE_HIST: list[torch.Tensor] = []


def poisson_loss_with_histogram(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    rate = model(x)
    RATE_HIST.append(torch.histc(rate.detach(), bins=20))  # for the dashboard
    return F.poisson_nll_loss(rate, y, log_input=False)


@case("poisson_glm_exp_overflow_histc_logging",
      raised("forward", "aten.exp.default", "", "rate_exp", "exp_overflow"), RuntimeError)
def _poisson() -> Program:
    torch.manual_seed(0)
    model = PoissonGLM()
    raw = aligned(model.linear, 6, +1.0, 1e3, 6105)
    g = torch.Generator().manual_seed(6105)

    def batch(step: int, unit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = 0.3 * torch.randn(12, 6, generator=g)
        if unit:
            x[7] = raw
        return x, torch.poisson(torch.full((12,), 2.0), generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), poisson_loss_with_histogram)


# 1f. A pointer policy over visible entities (an RTS/MOBA agent): the model returns the softmax over
#     entities with the invisible ones masked -inf; the loss code samples with validation off, as RL
#     libraries set it for speed. An observation with no visible entity (fog of war): the softmax of
#     an all -inf row is NaN and Categorical.sample's multinomial raises.
class PointerPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.entity = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.query = nn.Linear(6, 16)

    def forward(self, own: torch.Tensor, entities: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        scores = (self.entity(entities) @ self.query(own)[:, :, None]).squeeze(-1)
        return F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # <origin:ptr_softmax>


def pointer_reinforce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    own, entities, visible, reward = batch
    dist = torch.distributions.Categorical(probs=model(own, entities, visible), validate_args=False)
    target = dist.sample()
    return -(dist.log_prob(target) * reward).mean()


@case("pointer_policy_no_visible_entity_categorical_sample_validation_off",
      raised("forward", "aten._softmax.default", "", "ptr_softmax", "masked_softmax_all"), RuntimeError)
def _pointer() -> Program:
    torch.manual_seed(0)
    model = PointerPolicy()
    g = torch.Generator().manual_seed(6106)

    def batch(step: int, fog: bool = False) -> tuple[torch.Tensor, ...]:
        visible = torch.rand(8, 5, generator=g) > 0.3
        visible[:, 0] = True
        if fog:
            visible[3] = False
        return (torch.randn(8, 6, generator=g), torch.randn(8, 5, 4, generator=g), visible,
                torch.randn(8, generator=g))

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), pointer_reinforce)


# 1g. Multiple-instance learning with attention pooling and a hand-written stable softmax
#     (subtract the max): a bag with no instance (all padded) has max = -inf, and -inf - (-inf) is
#     NaN; the bag's probability is NaN and binary_cross_entropy raises.
class AttentionPool(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.score(h).squeeze(-1).masked_fill(~mask, float("-inf"))
        a = a - a.max(1, keepdim=True).values  # <origin:mil_sub>
        w = a.exp() / a.exp().sum(1, keepdim=True)
        return (w[..., None] * h).sum(1)


class MILNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.pool = AttentionPool(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.pool(self.embed(x), mask))).squeeze(-1)


@case("mil_attention_pool_empty_bag_bce_raises",
      raised("forward", "aten.sub.Tensor", "pool", "mil_sub", "inf_arithmetic"), RuntimeError)
def _mil() -> Program:
    torch.manual_seed(0)
    model = MILNet()
    g = torch.Generator().manual_seed(6107)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, ...]:
        mask = torch.rand(4, 6, generator=g) > 0.4
        mask[:, 0] = True
        if empty:
            mask[2] = False  # every instance of the bag was filtered out
        return torch.randn(4, 6, 8, generator=g), mask, (torch.rand(4, generator=g) > 0.5).float()

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.binary_cross_entropy(m(b[0], b[1]), b[2]))


# ====================================================== 2. torch.distributions' checks in Python
# 2a. A Gaussian actor (SB3 style: the distribution is built in the forward) whose std head ends in a
#     ReLU. An unnormalised observation batch drives some pre-activations below 0: std = 0 exactly,
#     finite, and Normal's validation raises "GreaterThan(lower_bound=0.0)". The op whose output it
#     read: the ReLU.
class ReluStdActor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.mu = nn.Linear(32, 2)
        self.std_head = nn.Sequential(nn.Linear(32, 2), nn.ReLU())
        with torch.no_grad():
            self.std_head[0].bias.fill_(0.5)

    def forward(self, obs: torch.Tensor) -> torch.distributions.Normal:
        h = self.body(obs)
        std = self.std_head(h)  # <origin:relu_std>
        return torch.distributions.Normal(self.mu(h), std, validate_args=True)


def actor_pg(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, adv = batch
    return -(model(obs).log_prob(act).sum(-1) * adv).mean()


def _actor_batch(g: torch.Generator, raw: bool) -> tuple[torch.Tensor, ...]:
    obs = torch.randn(16, 6, generator=g) * (100.0 if raw else 0.1)
    return obs, torch.randn(16, 2, generator=g), torch.randn(16, generator=g)


@case("gaussian_actor_relu_std_exactly_zero_in_forward",
      raised("forward", "aten.relu.default", "std_head.1", "relu_std", "domain_error"), ValueError)
def _relu_std() -> Program:
    torch.manual_seed(0)
    model = ReluStdActor()
    g = torch.Generator().manual_seed(6201)
    return Program(model, torch.optim.Adam(model.parameters(), lr=3e-4),
                   _steps(lambda s: _actor_batch(g, False), lambda s: _actor_batch(g, True)), actor_pg)


# 2b. An early-exit network with a learned gate trained by REINFORCE: the gate's "probability" is
#     exp(linear) (a log-probability head without logsigmoid). A raw-unit batch makes it > 1 and
#     Bernoulli's validation in the loss code raises on finite values.
class ExpGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc.bias.fill_(-2.0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(h)).squeeze(-1)  # <origin:gate_exp>


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.gate = ExpGate()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), self.gate(h)


def gate_reinforce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    logits, p_exit = model(x)
    ce = F.cross_entropy(logits, y, reduction="none")
    gate = torch.distributions.Bernoulli(probs=p_exit, validate_args=True)
    exit_now = gate.sample()
    return ce.mean() - (gate.log_prob(exit_now) * -ce.detach()).mean()


@case("early_exit_gate_exp_probability_above_one_bernoulli_in_loss",
      raised("forward", "aten.exp.default", "gate", "gate_exp", "domain_error"), ValueError)
def _gate() -> Program:
    torch.manual_seed(0)
    model = GatedNet()
    raw = aligned(lambda v: model.gate.fc(model.body(v)), 8, +1.0, 50.0, 6202)
    g = torch.Generator().manual_seed(6202)

    def batch(step: int, unit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = 0.1 * torch.randn(12, 8, generator=g)
        if unit:
            x[3] = raw
        return x, torch.randint(0, 3, (12,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), gate_reinforce)


# 2c. A Beta policy for a robot arm (bounded actions) whose observation includes the elbow angle,
#     computed as acos of the cosine between the two links. A fully stretched arm (parallel links):
#     the cosine rounds above 1 in float32, acos is NaN and Beta's validation in the loss code
#     raises on the NaN concentration.
class ElbowAngle(nn.Module):
    def forward(self, upper: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
        cos = (upper * lower).sum(-1) / (upper.norm(dim=-1) * lower.norm(dim=-1))
        return torch.acos(cos)  # <origin:elbow_acos>


class BetaArmPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.angle = ElbowAngle()
        self.body = nn.Sequential(nn.Linear(3, 32), nn.Tanh())
        self.alpha = nn.Linear(32, 2)
        self.beta = nn.Linear(32, 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        theta = self.angle(obs[:, 0:3], obs[:, 3:6])
        h = self.body(torch.cat([theta[:, None], obs[:, 6:]], 1))
        return 1.0 + F.softplus(self.alpha(h)), 1.0 + F.softplus(self.beta(h))


def beta_pg(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, adv = batch
    a, b = model(obs)
    return -(torch.distributions.Beta(a, b).log_prob(act).sum(-1) * adv).mean()


def _stretched(g: torch.Generator) -> torch.Tensor:
    """Link directions ``v, 2v`` whose float32 cosine is above 1."""
    for _ in range(100):
        v = torch.randn(3, generator=g)
        if float((v * 2 * v).sum() / (v.norm() * (2 * v).norm())) > 1.0:
            return torch.cat([v, 2 * v])
    raise AssertionError("no stretched arm")


@case("beta_arm_policy_acos_of_parallel_links",
      raised("forward", "aten.acos.default", "angle", "elbow_acos", "domain_error"), ValueError)
def _beta_arm() -> Program:
    torch.manual_seed(0)
    model = BetaArmPolicy()
    g = torch.Generator().manual_seed(6203)

    def batch(step: int, stretched: bool = False) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(10, 8, generator=g)
        if stretched:
            obs[6, :6] = _stretched(g)
        return obs, 0.05 + 0.9 * torch.rand(10, 2, generator=g), torch.randn(10, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), beta_pg)


# 2d. A slate recommender trained by REINFORCE over the items in stock: probabilities masked by
#     availability, handed to Categorical(probs=...), which normalises them itself. A user for whom
#     nothing is in stock: Categorical's own probs / probs.sum() is 0 / 0, and its Simplex check
#     raises on the NaN. The division ran inside torch.distributions, called from the user's line.
def stock_reinforce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, in_stock, reward = batch
    probs = F.softmax(model(x), -1) * in_stock
    dist = torch.distributions.Categorical(probs=probs)  # <origin:cat_norm>
    item = dist.sample()
    return -(dist.log_prob(item) * reward).mean()


@case("slate_recommender_nothing_in_stock_categorical_normalises_zero",
      raised("forward", "aten.div.Tensor", None, "cat_norm", "div_by_zero"), ValueError)
def _stock() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6))
    g = torch.Generator().manual_seed(6204)

    def batch(step: int, sold_out: bool = False) -> tuple[torch.Tensor, ...]:
        in_stock = (torch.rand(8, 6, generator=g) > 0.3).float()
        in_stock[:, 0] = 1.0
        if sold_out:
            in_stock[5] = 0.0
        return torch.randn(8, 12, generator=g), in_stock, torch.randn(8, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), stock_reinforce)


# 2e. A full-covariance Gaussian head (a mixture density / uncertainty head) building the Cholesky
#     factor with sqrt of a raw linear diagonal inside the forward; an out-of-range batch makes a
#     diagonal entry negative, sqrt is NaN, and MultivariateNormal's LowerCholesky check raises.
class FullCovHead(nn.Module):
    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.d = d
        self.mean = nn.Linear(16, d)
        self.diag = nn.Linear(16, d)
        self.off = nn.Linear(16, d * (d - 1) // 2)
        with torch.no_grad():
            self.diag.bias.fill_(1.0)

    def forward(self, h: torch.Tensor) -> torch.distributions.MultivariateNormal:
        tril = torch.zeros(h.shape[0], self.d, self.d)
        rows, cols = torch.tril_indices(self.d, self.d, -1)
        tril[:, rows, cols] = self.off(h)
        tril = tril + torch.diag_embed(torch.sqrt(self.diag(h)))  # <origin:chol_sqrt>
        return torch.distributions.MultivariateNormal(self.mean(h), scale_tril=tril, validate_args=True)


class UncertaintyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
        self.cov_head = FullCovHead()

    def forward(self, x: torch.Tensor) -> torch.distributions.MultivariateNormal:
        return self.cov_head(self.body(x))


@case("full_covariance_head_sqrt_negative_diagonal_scale_tril_check",
      raised("forward", "aten.sqrt.default", "cov_head", "chol_sqrt", "sqrt_negative"), ValueError)
def _fullcov() -> Program:
    torch.manual_seed(0)
    model = UncertaintyRegressor()
    raw = aligned(lambda v: -model.cov_head.diag(model.body(v))[:, :1], 5, +1.0, 30.0, 6205)
    g = torch.Generator().manual_seed(6205)

    def batch(step: int, unit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = 0.1 * torch.randn(10, 5, generator=g)
        if unit:
            x[2] = raw
        return x, torch.randn(10, 3, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: -m(b[0]).log_prob(b[1]).mean())


# ================================================== 3. a decomposition of a finite, singular matrix
# 3a. A few-shot learner with a closed-form ridge-regression head in its dual form (R2D2 /
#     MetaOptNet style) with lambda = 0. An episode whose support set holds the same image twice
#     (a sampler drawing with replacement): two identical rows of the Gram matrix, and
#     torch.linalg.solve raises "the input matrix is singular".
def ridge_episode_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    xs, ys, xq, yq = batch
    zs, zq = model(xs), model(xq)
    gram = zs @ zs.t()
    alpha = torch.linalg.solve(gram, F.one_hot(ys, 5).float())  # <origin:ridge_solve>
    return F.cross_entropy((zq @ zs.t()) @ alpha, yq)


@case("ridge_head_dual_form_duplicate_support_image_singular_solve",
      raised("forward", "aten._linalg_solve_ex.default", None, "ridge_solve", "domain_error"), torch.linalg.LinAlgError)
def _ridge() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32))
    g = torch.Generator().manual_seed(6301)

    def batch(step: int, twice: bool = False) -> tuple[torch.Tensor, ...]:
        xs = torch.randn(10, 20, generator=g)
        if twice:
            xs[7] = xs[3]
        return xs, torch.arange(10) % 5, torch.randn(15, 20, generator=g), torch.arange(15) % 5

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), ridge_episode_loss)


# ======================================================================= 4. the user's own checks
# 4a. Knowledge distillation with a hand-written KL, p_t * (log p_t - log p_s), and the user's
#     `assert torch.isfinite(loss)`. The frozen teacher is very confident on a raw-unit batch: its
#     softmax underflows to exactly 0 for some classes, log(0) = -inf and 0 * -inf = NaN.
def kd_loss(model: nn.Module, batch: Any, step: int, teacher: nn.Module, tau: float = 1.0) -> torch.Tensor:
    x, y = batch
    with torch.no_grad():
        p_t = F.softmax(teacher(x) / tau, -1)
    logits = model(x)
    kl = (p_t * (torch.log(p_t) - F.log_softmax(logits / tau, -1))).sum(-1).mean()  # <origin:kd_log>
    loss = F.cross_entropy(logits, y) + kl
    assert torch.isfinite(loss), f"loss is {loss.item()}"
    return loss


@case("distillation_hand_written_kl_teacher_underflow_user_assert",
      raised("forward", "aten.log.default", None, "kd_log", "log_nonpositive"), AssertionError)
def _kd() -> Program:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 5)).requires_grad_(False)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5))
    g = torch.Generator().manual_seed(6401)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 10, generator=g) * (500.0 if raw else 1.0)
        return x, torch.randint(0, 5, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: kd_loss(m, b, s, teacher))


# 4b. Box regression with detectron2's Box2BoxTransform, log(gt_w / anchor_w), and detectron2's
#     trainer check between backward() and optimizer.step() (SimpleTrainer._write_metrics):
#     FloatingPointError when the losses are not finite. A degenerate ground-truth box of width 0:
#     log(0) = -inf, the smooth-L1 loss is inf (its gradients stay finite).
EVENT_STORAGE: dict[str, torch.Tensor] = {}


def box_regression_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, anchors, gt = batch
    deltas = model(x)
    aw, ah = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    gw, gh = gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]
    targets = torch.stack([(gt[:, 0] + 0.5 * gw - anchors[:, 0] - 0.5 * aw) / aw,
                           (gt[:, 1] + 0.5 * gh - anchors[:, 1] - 0.5 * ah) / ah,
                           torch.log(gw / aw),  # <origin:box_log>
                           torch.log(gh / ah)], 1)
    loss = F.smooth_l1_loss(deltas, targets, beta=0.1)
    EVENT_STORAGE["loss_box_reg"] = loss.detach()
    return loss


def write_metrics(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    total = sum(EVENT_STORAGE.values())
    if not torch.isfinite(total).all():
        raise FloatingPointError(f"Loss became infinite or NaN at iteration={step}!\nloss_dict = {EVENT_STORAGE}")


def _boxes(g: torch.Generator, n: int) -> torch.Tensor:
    xy = torch.rand(n, 2, generator=g) * 100
    return torch.cat([xy, xy + 10 + torch.rand(n, 2, generator=g) * 50], 1)


@case("detectron2_box_log_zero_width_floating_point_error_after_backward",
      raised("forward", "aten.log.default", None, "box_log", "log_nonpositive"), FloatingPointError)
def _detectron() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(6402)

    def batch(step: int, degenerate: bool = False) -> tuple[torch.Tensor, ...]:
        gt = _boxes(g, 8)
        if degenerate:
            gt[5, 2] = gt[5, 0]  # a vertical line annotated as a box
        return torch.randn(8, 16, generator=g), _boxes(g, 8), gt

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), box_regression_loss,
                   between=write_metrics)


# 4c. Trajectory prediction with a rotation-equivariant (bias-free) motion model and a robust
#     fractional loss, |v - v_true| ** 0.5; the training script clips with error_if_nonfinite=True.
#     A parked car (an all-zero history, target velocity 0) gets the velocity (0, 0) exactly: the
#     residual is 0, the derivative of x ** 0.5 is infinite there (times abs's 0: NaN), the gradients
#     are NaN and clip_grad_norm_ raises. (torch's atan2 backward returns 0 at (0, 0): a heading loss
#     on atan2 of the velocity, tried first, stays finite.)
class MotionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32, bias=False), nn.Tanh(), nn.Linear(32, 2, bias=False))

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        return self.net(history.flatten(1))


def fractional_velocity_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    history, v_true = batch
    residual = (model(history) - v_true).abs()
    return (residual ** 0.5).mean()  # <origin:frac_pow>


def clip_strict(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def _tracks(g: torch.Generator, parked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    history = torch.randn(6, 4, 2, generator=g)
    v_true = torch.randn(6, 2, generator=g)
    if parked:
        history[1], v_true[1] = 0.0, 0.0
    return history, v_true


@case("trajectory_fractional_loss_parked_car_clip_error_if_nonfinite",
      raised("backward", "aten.pow.Tensor_Scalar", None, "frac_pow", "grad_singularity"), RuntimeError)
def _trajectory() -> Program:
    torch.manual_seed(0)
    model = MotionModel()
    g = torch.Generator().manual_seed(6403)
    return Program(model, sgd(model), _steps(lambda s: _tracks(g, False), lambda s: _tracks(g, True)),
                   fractional_velocity_loss, between=clip_strict)


# ================================================ 5. the loop catches the failure and trains on
# 5a. Lightning's "return None to skip": the loop skips a batch whose loss is not finite (no
#     backward, no step). A bag-of-words classifier normalises term counts to frequencies inside the
#     model; an empty document (all counts 0) makes 0 / 0.
class TermFrequency(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return counts / counts.sum(1, keepdim=True)  # <origin:tf_div>


class BowClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tf = TermFrequency()
        self.mlp = nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.tf(counts))


@case("skip_nonfinite_loss_batch_empty_document_term_frequency",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "tf", "tf_div", "div_by_zero", step=FAIL_STEP),
      None, go_on="skip_nonfinite")
def _bow() -> Program:
    torch.manual_seed(0)
    model = BowClassifier()
    g = torch.Generator().manual_seed(6501)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.poisson(torch.full((8, 30), 0.8), generator=g)
        counts[:, 0] += 1
        if empty:
            counts[4] = 0.0  # a document emptied by the stop-word filter
        return counts, torch.randint(0, 4, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 5b. VICReg's variance term written with eps = 0, std = sqrt(var); the script clips with
#     error_if_nonfinite=True and, on that RuntimeError, zeroes the gradients and skips the batch. A
#     batch of identical samples (a loader that repeated one clip): every variance is exactly 0,
#     sqrt's derivative is infinite there, the gradients NaN.
def vicreg_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x1, x2 = batch
    z1, z2 = model(x1), model(x2)
    std = torch.sqrt(z1.var(dim=0))  # <origin:vicreg_sqrt>
    return F.mse_loss(z1, z2) + F.relu(1 - std).mean()


@case("vicreg_variance_eps0_identical_batch_clip_error_caught",
      raised("backward", "aten.sqrt.default", None, "vicreg_sqrt", "grad_singularity"), RuntimeError, go_on="catch")
def _vicreg() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
    g = torch.Generator().manual_seed(6502)

    def batch(step: int, repeated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 12, generator=g)
        if repeated:
            x = x[:1].expand(8, 12).clone()
        return x, x + 0.05 * torch.randn(8, 12, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), vicreg_loss, between=clip_strict)


# 5c. The event recommender of 1c, its IndexError caught by the loop ("skip bad batches").
@case("event_recommender_zero_gap_index_error_caught",
      raised("forward", "aten.log2.default", "time", "log2_bucket", "log_nonpositive"), IndexError, go_on="catch")
def _events_caught() -> Program:
    return _events()


# 5d. The Gaussian actor of 2a, its ValueError (raised in the forward) caught by the loop.
@case("gaussian_actor_relu_std_zero_value_error_caught",
      raised("forward", "aten.relu.default", "std_head.1", "relu_std", "domain_error"), ValueError, go_on="catch")
def _relu_std_caught() -> Program:
    return _relu_std()


# ============================================================ plain torch: the construction
FILLS = {"aten.masked_fill.Scalar", "aten.masked_fill_.Scalar", "aten.fill_.Scalar", "aten.full.default",
         "aten.scalar_tensor.default", "aten.masked_fill.Tensor", "aten.lift_fresh.default"}


class FirstNonFinite(TorchDispatchMode):
    """The first op that made an infinity from finite inputs (a ``-inf`` fill excepted) and the
    first that made a NaN from NaN-free inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inf_maker: str | None = None
        self.nan_maker: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket) + "." + func._overloadname
        name = f"aten.{name}" if not name.startswith("aten.") else name
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        in_nan = any(bool(torch.isnan(t).any()) for t in ins)
        in_inf = any(bool(torch.isinf(t).any()) for t in ins)
        if self.nan_maker is None and not in_nan and any(bool(torch.isnan(t).any()) for t in outs):
            self.nan_maker = name
        if (self.inf_maker is None and not in_nan and not in_inf and name not in FILLS
                and any(bool(torch.isinf(t).any()) for t in outs)):
            self.inf_maker = name
        return out

    @property
    def origin(self) -> str | None:
        return self.inf_maker or self.nan_maker


FINITE_DOMAIN = {"gaussian_actor_relu_std_exactly_zero_in_forward", "early_exit_gate_exp_probability_above_one_bernoulli_in_loss",
                 "gaussian_actor_relu_std_zero_value_error_caught"}
"""Cases whose check rejects finite values (nothing non-finite is made in the step; the singular solve
is not among them: its solution holds infinities)."""


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def plain_failure(name: str) -> dict[str, Any]:
    """The program without nantrace, stopped at its first failure: the step, the exception (or the
    non-finite loss / gradients), and the op ``FirstNonFinite`` names in that step."""
    build, _ = CASES[name]
    program = build()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        oracle = FirstNonFinite()
        loss = None
        try:
            with oracle:
                loss = program.loss(model, batch, step)
            loss.backward()
            if program.between is not None:
                program.between(model, opt, step)
        except Exception as exc:  # noqa: BLE001 - the construction's own failure
            grads_ok = _finite(p.grad for p in model.parameters())
            return dict(step=step, error=exc, origin=oracle.origin, loss=loss, grads_ok=grads_ok)
        grads_ok = _finite(p.grad for p in model.parameters())
        if not bool(torch.isfinite(loss).all()) or not grads_ok:
            return dict(step=step, error=None, origin=oracle.origin, loss=loss, grads_ok=grads_ok)
        opt.step()
    return dict(step=None, error=None, origin=None, loss=None, grads_ok=True)


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """Without nantrace the program fails at FAIL_STEP and not before: it raises the expected
    exception (or, for a skipping loop, its loss is non-finite); a value made non-finite in the
    forward was made first by the expected op; a backward origin's construction holds."""
    _, want = CASES[name]
    run = plain_failure(name)
    assert run["step"] == FAIL_STEP, run
    expected = RAISES[name]
    if expected is None:
        assert run["error"] is None and not bool(torch.isfinite(run["loss"]).all()), run
    else:
        assert type(run["error"]) is expected, repr(run["error"])
    if want.phase == "forward" and name not in FINITE_DOMAIN:
        assert run["origin"] == want.op, run
    elif want.phase == "backward":
        assert run["origin"] is None and run["loss"] is not None and bool(torch.isfinite(run["loss"]).all())
        assert not run["grads_ok"], run
    else:  # the batch carried the NaN, or finite values outside a check's domain: nothing made one
        assert run["origin"] is None, run


def test_backward_constructions() -> None:
    """The facts behind the two backward origins: the parked car's residual is exactly 0 (the
    derivative of x ** 0.5 is infinite there), and the repeated batch's embedding variances are
    exactly 0 (sqrt's derivative is infinite there)."""
    program = CASES["trajectory_fractional_loss_parked_car_clip_error_if_nonfinite"][0]()
    history, v_true = program.batches[FAIL_STEP]
    with torch.no_grad():
        assert bool((program.model(history)[1] - v_true[1] == 0).all())
    program = CASES["vicreg_variance_eps0_identical_batch_clip_error_caught"][0]()
    x1, _ = program.batches[FAIL_STEP]
    with torch.no_grad():
        assert bool((program.model(x1).var(dim=0) == 0).all())


# ======================================================================= the loop that trains on
@dataclasses.dataclass
class OnRun:
    incidents: list[Any]
    failures: list[tuple[int, BaseException | None]]
    """(batch index, exception or None for a skipped non-finite loss)."""
    changed: list[bool]
    """Per batch: did the weights change during it?"""


def train_on(program: Program, *, replayable: bool, go_on: str) -> OnRun:
    """A loop that goes on past a bad batch: ``skip_nonfinite`` skips a non-finite loss before
    backward (Lightning's ``return None``); ``catch`` catches the exception, zeroes the gradients and
    skips the batch."""
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    failures: list[tuple[int, BaseException | None]] = []
    changed: list[bool] = []
    try:
        for i, batch in enumerate(program.batches):
            before = snapshot(model)
            opt.zero_grad()
            try:
                loss = loss_fn(model, batch, i)
                if go_on == "skip_nonfinite" and not bool(torch.isfinite(loss).all()):
                    failures.append((i, None))
                    changed.append(not same(before, snapshot(model)))
                    continue
                loss.backward()
                if program.between is not None:
                    program.between(model, opt, i)
                opt.step()
            except Exception as exc:  # noqa: BLE001 - the user's "skip bad batches"
                if go_on != "catch" or isinstance(exc, nantrace.NonFiniteError):
                    raise
                failures.append((i, exc))
                opt.zero_grad()
            changed.append(not same(before, snapshot(model)))
    finally:
        guard.close()
    return OnRun(list(guard.incidents), failures, changed)


def assert_trained_on(run: OnRun, name: str, want: Want) -> None:
    """One incident, at the bad batch's step, naming the origin; the bad batch changed nothing and
    every other batch's update landed."""
    assert [i for i, _ in run.failures] == [FAIL_STEP], run.failures
    expected = RAISES[name]
    assert all((exc is None) if expected is None else type(exc) is expected for _, exc in run.failures), run.failures
    assert len(run.incidents) >= 1, "no incident"
    inc = run.incidents[0]
    got = dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
               line=JUDGE.line(inc.source))
    wanted = {k: v for k, v in JUDGE.want(want).items() if k != "action"}
    assert got == wanted, [describe(i) + " | " + i.summary for i in run.incidents]
    if want.kind == "exception":
        assert inc.action == "raised", describe(inc)
    assert len(run.incidents) == 1, [describe(i) for i in run.incidents]
    assert run.changed == [i != FAIL_STEP for i in range(STEPS)], run.changed


# ======================================================================= the tests
@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n not in CONTINUE}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n in CONTINUE}, XFAIL))
def test_heldout_diagnosis_loop_trains_on(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_trained_on(train_on(build(), replayable=mode == "replayable", go_on=CONTINUE[name]), name, want)
