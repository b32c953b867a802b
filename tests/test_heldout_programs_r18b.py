"""Held-out failures, round 18b: PROBABILISTIC MODELS and RL losses built on ``torch.distributions``
and on hand-written log-densities, as real training code writes them.

Covered: a SAC actor with ``TransformedDistribution(Normal, TanhTransform())`` (no cache: the log-prob
inverts a saturated action); Gaussian policies whose scale ``exp(log_std)`` underflows to 0, with
``validate_args=False`` (``Normal.log_prob`` takes ``log(0)``) and with torch's default validation (the
constructor raises); ``Categorical(logits=...)`` over a state whose action mask hides every action (torch
2.13 normalises ``logits - logsumexp`` to NaN and its validation raises ``ValueError``); a Dirichlet VAE whose
softplus concentration underflows to 0 and a Beta actor likewise (validation raises); an MDN (``MixtureSameFamily``) whose component
scale collapses to 0; ``kl_divergence`` of two Normals with a zero prior scale; a triangular flow's hand-written
log-det with a zero diagonal entry; Poisson and NegativeBinomial count models with a zero rate / total count;
REINFORCE on the product of per-step action probabilities (underflow to 0, then log). QUIET programs: the
standard fixes (``TanhTransform(cache_size=1)``, ``finfo.min`` masks, ``softplus + eps`` heads,
``Categorical(probs=...)`` which clamps, a log-space trajectory likelihood).

Expectations were written from the construction and API.md before nantrace ran: the origin is the first op
that makes a non-finite value (for a torch.distributions method, the line of this file that called it); a
validation error of a distribution is kind ``exception`` with the op that made the invalid value. Each program
was checked with plain torch (``test_cases_fail_without_nantrace``: the step, the way it fails, and for
non-finite values the first op / module / line via a dispatch mode of this file; for a validation error on a
finite value, the exp/softplus that underflowed to the rejected 0).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import distributions as D
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from heldout_harness import Judge, Program, assert_diagnosis, case_params, describe, run_step, sgd, steps, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread", "distributions_validate")]  # an earlier torch.compile turns it off

FAIL = 3
STEPS = 5
JUDGE = Judge(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
QUIET: dict[str, Callable[[], Program]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES and name not in QUIET, name
        CASES[name] = (build, want)
        return build

    return register


def quiet(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES and name not in QUIET, name
        QUIET[name] = build
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any], fail: int = FAIL) -> list[Any]:
    return steps(normal, bad, fail, STEPS)


def _raised(phase: str, op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want("exception", phase, op, module, tag, cause, step=FAIL, action="raised")


def _loss(phase: str, op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want("nonfinite_loss", phase, op, module, tag, cause, step=FAIL)


# ====================================================================== 1. SAC, tanh-squashed Gaussian
class SquashedActor(nn.Module):
    def __init__(self, obs: int = 8, act: int = 2) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(obs, 32), nn.ReLU())
        self.mu = nn.Linear(32, act)
        self.log_std = nn.Linear(32, act)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)
        return self.mu(h), self.log_std(h).clamp(-5, 2)


def _sac_batches(seed: int) -> list[Any]:
    g = _gen(seed)
    normal = lambda s: torch.randn(32, 8, generator=g)
    bad = lambda s: torch.randn(32, 8, generator=g) * torch.tensor([400.0] + [1.0] * 7)  # an unscaled sensor column
    return _steps(normal, bad)


def sac_actor_loss_no_cache(model: nn.Module, obs: torch.Tensor, step: int) -> torch.Tensor:
    mu, log_std = model(obs)
    pi = D.TransformedDistribution(D.Normal(mu, log_std.exp()), [D.TanhTransform()])
    action = pi.rsample()
    log_prob = pi.log_prob(action).sum(-1)  # <origin:sac_td_logp>
    q = -(action - 0.3).pow(2).sum(-1)  # a stand-in critic
    return (0.2 * log_prob - q).mean()


def sac_actor_loss_cached(model: nn.Module, obs: torch.Tensor, step: int) -> torch.Tensor:
    mu, log_std = model(obs)
    pi = D.TransformedDistribution(D.Normal(mu, log_std.exp()), [D.TanhTransform(cache_size=1)])
    action = pi.rsample()
    log_prob = pi.log_prob(action).sum(-1)
    q = -(action - 0.3).pow(2).sum(-1)
    return (0.2 * log_prob - q).mean()


# torch's TanhTransform inverts tanh with atanh; a float32 tanh of a pre-activation > ~9 is exactly 1.0 and
# atanh(1) = inf (the base log-prob of inf is then -inf and the log-det -inf: NaN).
@case("sac_transformed_distribution_tanh_transform_without_cache_saturated_action",
      _loss("forward", "aten.atanh.default", None, "sac_td_logp", "domain_error"))
def _sac_nocache() -> Program:
    torch.manual_seed(0)
    model = SquashedActor()
    with torch.no_grad():
        model.mu.weight[:, 0] = 1.0
    return Program(model, sgd(model, 1e-3), _sac_batches(1801), sac_actor_loss_no_cache)


@quiet("sac_transformed_distribution_tanh_transform_cache_size_1_saturated_action")
def _sac_cache() -> Program:
    torch.manual_seed(0)
    model = SquashedActor()
    with torch.no_grad():
        model.mu.weight[:, 0] = 1.0
    return Program(model, sgd(model, 1e-3), _sac_batches(1801), sac_actor_loss_cached)


# ====================================================================== 2. Gaussian policy, exp(log_std) underflow
class GaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.mu = nn.Linear(32, 2)
        self.log_std = nn.Linear(6, 2)  # state-dependent log-std read straight from the observation

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(self.body(obs)), self.log_std(obs)


def _policy_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g), torch.randn(16, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, act, adv = normal(s)
        obs[5, 2] = -5000.0  # a raw encoder count on one row
        return obs, act, adv

    return _steps(normal, bad)


def _policy_model() -> GaussianPolicy:
    torch.manual_seed(0)
    model = GaussianPolicy()
    with torch.no_grad():
        model.log_std.weight.fill_(0.05)
        model.log_std.bias.fill_(-0.5)
    return model


def pg_loss_validation_off(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, adv = batch
    mu, log_std = model(obs)
    dist = D.Normal(mu, log_std.exp(), validate_args=False)
    logp = dist.log_prob(act).sum(-1)  # <origin:pg_normal_logp>
    return -(logp * adv).mean()


def pg_loss_validation_on(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, adv = batch
    mu, log_std = model(obs)
    std = log_std.exp()  # <origin:pg_std_exp>
    dist = D.Normal(mu, std)
    return -(dist.log_prob(act).sum(-1) * adv).mean()


def pg_loss_clamped(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, adv = batch
    mu, log_std = model(obs)
    dist = D.Normal(mu, log_std.clamp(-20.0, 2.0).exp())
    return -(dist.log_prob(act).sum(-1) * adv).mean()


# exp(-250) = 0 in float32; Normal.log_prob computes scale.log() before the quadratic term: log(0) = -inf.
@case("gaussian_policy_exp_log_std_underflow_normal_log_prob_validation_off",
      _loss("forward", "aten.log.default", None, "pg_normal_logp", "log_nonpositive"))
def _pg_off() -> Program:
    model = _policy_model()
    return Program(model, sgd(model, 1e-3), _policy_batches(1802), pg_loss_validation_off)


# with torch's default validation the constructor refuses the 0 scale (ValueError): the op that made it is exp.
@case("gaussian_policy_exp_log_std_underflow_normal_constructor_raises",
      _raised("forward", "aten.exp.default", None, "pg_std_exp", "domain_error"))
def _pg_on() -> Program:
    model = _policy_model()
    return Program(model, sgd(model, 1e-3), _policy_batches(1802), pg_loss_validation_on)


@quiet("gaussian_policy_log_std_clamped_before_exp")
def _pg_clamped() -> Program:
    model = _policy_model()
    return Program(model, sgd(model, 1e-3), _policy_batches(1802), pg_loss_clamped)


# ====================================================================== 3. Categorical over a fully masked state
class MaskedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def _mask_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = torch.rand(12, 5, generator=g) > 0.4
        mask[:, 0] = True  # "no-op" is always legal ...
        act = torch.zeros(12, dtype=torch.long)
        return torch.randn(12, 10, generator=g), mask, act, torch.randn(12, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, mask, act, adv = normal(s)
        mask[7] = False  # ... except in a terminal state the env reports with an all-False mask
        return obs, mask, act, adv

    return _steps(normal, bad)


def masked_pg_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, mask, act, adv = batch
    logits = model(obs).masked_fill(~mask, float("-inf"))
    dist = D.Categorical(logits=logits)  # <origin:cat_masked>
    return -(dist.log_prob(act) * adv).mean() - 0.01 * dist.entropy().mean()


def masked_pg_loss_finfo_min(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, mask, act, adv = batch
    logits = model(obs).masked_fill(~mask, torch.finfo(torch.float32).min)
    dist = D.Categorical(logits=logits)
    return -(dist.log_prob(act) * adv).mean() - 0.01 * dist.entropy().mean()


# Categorical normalises logits - logsumexp(logits): -inf - (-inf) = NaN on the masked row, then its
# validation raises ValueError. That is a log-softmax over an entirely -inf row.
@case("categorical_logits_action_mask_all_false_terminal_state_raises",
      _raised("forward", "aten.sub.Tensor", None, "cat_masked", "masked_softmax_all"))
def _cat_masked() -> Program:
    torch.manual_seed(0)
    model = MaskedPolicy()
    return Program(model, sgd(model, 1e-2), _mask_batches(1803), masked_pg_loss)


@quiet("categorical_logits_action_mask_finfo_min_terminal_state")
def _cat_min() -> Program:
    torch.manual_seed(0)
    model = MaskedPolicy()
    return Program(model, sgd(model, 1e-2), _mask_batches(1803), masked_pg_loss_finfo_min)


def masked_pg_loss_validation_off(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, mask, act, adv = batch
    logits = model(obs).masked_fill(~mask, float("-inf"))
    dist = D.Categorical(logits=logits, validate_args=False)  # <origin:cat_masked_noval>
    return -(dist.log_prob(act) * adv).mean()


# the same row without validation: the NaN of logits - logsumexp reaches the loss.
@case("categorical_logits_action_mask_all_false_terminal_state_validation_off",
      _loss("forward", "aten.sub.Tensor", None, "cat_masked_noval", "masked_softmax_all"))
def _cat_masked_noval() -> Program:
    torch.manual_seed(0)
    model = MaskedPolicy()
    return Program(model, sgd(model, 1e-2), _mask_batches(1803), masked_pg_loss_validation_off)


# ====================================================================== 4. Dirichlet VAE
class DirichletVAE(nn.Module):
    def __init__(self, d: int = 20, k: int = 4, eps: float = 0.0) -> None:
        super().__init__()
        self.encoder = nn.Linear(d, k)
        self.decoder = nn.Linear(k, d)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = F.softplus(self.encoder(x)) + self.eps  # <origin:dir_softplus>
        q = D.Dirichlet(alpha)
        z = q.rsample()
        return self.decoder(z), alpha


def _dirichlet_batches(seed: int) -> list[Any]:
    g = _gen(seed)
    normal = lambda s: torch.rand(16, 20, generator=g)
    def bad(s: int) -> torch.Tensor:
        x = torch.rand(16, 20, generator=g)
        x[3] = 1e4  # a document of raw counts instead of frequencies
        return x
    return _steps(normal, bad)


def dirichlet_vae_loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    recon, alpha = model(x)
    prior = D.Dirichlet(torch.ones_like(alpha))
    kl = D.kl_divergence(D.Dirichlet(alpha), prior)
    return F.mse_loss(recon, x) + 0.1 * kl.mean()


def _dirichlet(eps: float) -> Program:
    torch.manual_seed(0)
    model = DirichletVAE(eps=eps)
    with torch.no_grad():
        model.encoder.weight.fill_(-0.02)
        model.encoder.bias.fill_(0.5)
    return Program(model, sgd(model, 1e-3), _dirichlet_batches(1804), dirichlet_vae_loss)


# softplus(-4000) = 0: Dirichlet(alpha) refuses a zero concentration (ValueError) in the encoder's forward.
@case("dirichlet_vae_softplus_concentration_underflow_raises",
      _raised("forward", "aten.softplus.default", "", "dir_softplus", "domain_error"))
def _dir_bad() -> Program:
    return _dirichlet(0.0)


@quiet("dirichlet_vae_softplus_concentration_plus_eps")
def _dir_ok() -> Program:
    return _dirichlet(1e-3)


class BetaActor(nn.Module):
    """A bounded-action actor (Chou et al. 2017): Beta(alpha, beta) with softplus heads, action in [0, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.conc = nn.Linear(6, 2)

    def forward(self, obs: torch.Tensor) -> D.Beta:
        c = F.softplus(self.conc(obs))  # <origin:beta_softplus>
        return D.Beta(c[:, 0], c[:, 1])


def beta_actor_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, adv = batch
    dist = model(obs)
    return -(dist.log_prob(act[:, 0].sigmoid()) * adv).mean()


# softplus(-250) = 0; Beta builds Dirichlet(stack([alpha, beta])), whose validation refuses the 0 (ValueError).
@case("beta_actor_softplus_concentration_underflow_raises",
      _raised("forward", "aten.softplus.default", "", "beta_softplus", "domain_error"))
def _beta_actor() -> Program:
    torch.manual_seed(0)
    model = BetaActor()
    with torch.no_grad():
        model.conc.weight.fill_(0.05)
        model.conc.bias.fill_(1.0)
    return Program(model, sgd(model, 1e-3), _policy_batches(1811), beta_actor_loss)


# ====================================================================== 5. MDN with MixtureSameFamily
class MDN(nn.Module):
    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(4, 32), nn.Tanh())
        self.pi = nn.Linear(32, k)
        self.mu = nn.Linear(32, k)
        self.log_sigma = nn.Linear(4, k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.hidden(x)
        return self.pi(h), self.mu(h), self.log_sigma(x).exp()


def mdn_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    logits, mu, sigma = model(x)
    mix = D.MixtureSameFamily(D.Categorical(logits=logits), D.Normal(mu, sigma, validate_args=False),
                              validate_args=False)
    return -mix.log_prob(y).mean()  # <origin:mdn_mix_logp>


# the sigma head reads an input column that is 3000 on one sample of the bad batch: exp(-150) = 0 for every
# component, and Normal.log_prob's scale.log() is the first -inf.
@case("mdn_mixture_same_family_component_scale_collapse_validation_off",
      _loss("forward", "aten.log.default", None, "mdn_mix_logp", "log_nonpositive"))
def _mdn() -> Program:
    torch.manual_seed(0)
    model = MDN()
    with torch.no_grad():
        model.log_sigma.weight.fill_(-0.05)
    g = _gen(1805)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 4, generator=g), torch.randn(16, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = normal(s)
        x[9] = 750.0  # a duplicated-target cluster recorded in raw units
        return x, y

    return Program(model, sgd(model, 1e-3), _steps(normal, bad), mdn_loss)


# ====================================================================== 6. KL to a learned prior with zero scale
class PriorVAE(nn.Module):
    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.enc = nn.Linear(12, 8)
        self.dec = nn.Linear(4, 12)
        self.prior = nn.Linear(3, 8)  # a conditional prior from the context (class / time features)
        self.eps = eps

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
        mu_q, s_q = self.enc(x).chunk(2, -1)
        mu_p, s_p = self.prior(ctx).chunk(2, -1)
        q = D.Normal(mu_q, F.softplus(s_q) + 1e-4, validate_args=False)
        p = D.Normal(mu_p, F.relu(s_p) + self.eps, validate_args=False)
        z = q.rsample()
        return q, p, self.dec(z)


def prior_vae_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, ctx = batch
    q, p, recon = model(x, ctx)
    kl = D.kl_divergence(q, p).sum(-1)  # <origin:kl_zero_prior>
    return F.mse_loss(recon, x) + kl.mean()


def _prior_vae(eps: float) -> Program:
    torch.manual_seed(0)
    model = PriorVAE(eps)
    with torch.no_grad():
        model.prior.weight.fill_(0.1)
        model.prior.bias.fill_(1.0)
    g = _gen(1806)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 12, generator=g), torch.rand(8, 3, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, ctx = normal(s)
        ctx[2] = -50.0  # a context feature logged with a sentinel
        return x, ctx

    return Program(model, sgd(model, 1e-3), _steps(normal, bad), prior_vae_loss)


# relu(s_p) = 0: _kl_normal_normal computes (q.scale / p.scale).pow(2) first: a division by zero.
@case("vae_conditional_prior_relu_scale_zero_kl_divergence",
      _loss("forward", "aten.div.Tensor", None, "kl_zero_prior", "div_by_zero"))
def _kl_bad() -> Program:
    return _prior_vae(0.0)


@quiet("vae_conditional_prior_relu_scale_plus_eps_kl_divergence")
def _kl_ok() -> Program:
    return _prior_vae(1e-3)


# ====================================================================== 7. triangular flow, hand-written log-det
class ConditionalTriangularFlow(nn.Module):
    """z = L(c) x with L lower triangular; the diagonal is scaled by a gate computed from the context."""

    def __init__(self, d: int = 4, c: int = 2) -> None:
        super().__init__()
        self.lower = nn.Parameter(torch.randn(d, d) * 0.1)
        self.diag = nn.Parameter(torch.ones(d))
        self.gate = nn.Linear(c, d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        diag = self.diag * F.relu(self.gate(ctx))
        L = torch.tril(self.lower, -1) + torch.diag_embed(diag)
        z = (L @ x.unsqueeze(-1)).squeeze(-1)
        log_det = torch.log(torch.diagonal(L, dim1=-2, dim2=-1).abs()).sum(-1)  # <origin:flow_logdet>
        return z, log_det


def flow_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, ctx = batch
    z, log_det = model(x, ctx)
    base = D.Normal(0.0, 1.0).log_prob(z).sum(-1)
    return -(base + log_det).mean()


@case("conditional_triangular_flow_hand_written_logdet_zero_diagonal",
      _loss("forward", "aten.log.default", "", "flow_logdet", "log_nonpositive"))
def _flow() -> Program:
    torch.manual_seed(0)
    model = ConditionalTriangularFlow()
    with torch.no_grad():
        model.gate.weight.fill_(0.2)
        model.gate.bias.fill_(1.0)
    g = _gen(1807)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 4, generator=g), torch.rand(16, 2, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, ctx = normal(s)
        ctx[4] = -10.0  # context missing: the loader's fill value
        return x, ctx

    return Program(model, sgd(model, 1e-3), _steps(normal, bad), flow_nll)


# ====================================================================== 8. count models
class CountRegressor(nn.Module):
    def __init__(self, link: str) -> None:
        super().__init__()
        self.body = nn.Linear(5, 1)
        self.link = link

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eta = self.body(x).squeeze(-1)
        return F.relu(eta) if self.link == "relu" else F.softplus(eta) + 1e-4


def _count_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(16, 5, generator=g), torch.randint(0, 6, (16,), generator=g).float()

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = normal(s)
        x[11, 1] = -40.0  # a store closed for the season, logged as negative sales days
        y[11] = 3.0
        return x, y

    return _steps(normal, bad)


def _count_model(link: str) -> CountRegressor:
    torch.manual_seed(0)
    model = CountRegressor(link)
    with torch.no_grad():
        model.body.weight.fill_(0.2)
        model.body.bias.fill_(1.5)
    return model


def poisson_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    rate = model(x)
    return -D.Poisson(rate).log_prob(y).mean()  # <origin:poisson_logp>


# rate 0 with a count 3: Poisson.log_prob's xlogy(3, 0) = -inf.
@case("poisson_count_model_relu_rate_zero_observed_count",
      _loss("forward", "aten.xlogy.Tensor", None, "poisson_logp", "log_nonpositive"))
def _poisson_bad() -> Program:
    model = _count_model("relu")
    return Program(model, sgd(model, 1e-3), _count_batches(1808), poisson_nll)


@quiet("poisson_count_model_softplus_rate_plus_eps")
def _poisson_ok() -> Program:
    model = _count_model("softplus")
    return Program(model, sgd(model, 1e-3), _count_batches(1808), poisson_nll)


class NegBinRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(5, 1)
        self.dispersion = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.relu(self.dispersion(x)).squeeze(-1), self.logits(x).squeeze(-1)


def negbin_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    total_count, logits = model(x)
    return -D.NegativeBinomial(total_count, logits=logits).log_prob(y).mean()  # <origin:negbin_logp>


# total_count relu(...) = 0 is allowed by the constraint (nonnegative); log_prob's lgamma(0) = inf.
@case("negative_binomial_relu_total_count_zero_lgamma",
      _loss("forward", "aten.lgamma.default", None, "negbin_logp", "log_nonpositive"))
def _negbin() -> Program:
    torch.manual_seed(0)
    model = NegBinRegressor()
    with torch.no_grad():
        model.dispersion.weight.fill_(0.2)
        model.dispersion.bias.fill_(2.0)
    return Program(model, sgd(model, 1e-3), _count_batches(1809), negbin_nll)


# ====================================================================== 9. REINFORCE, trajectory likelihood
class StepPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def _traj_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.randn(8, 20, 6, generator=g), torch.randint(0, 3, (8, 20), generator=g), torch.randn(8, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, act, ret = normal(s)
        act[1] = 3  # an exploration episode (epsilon-greedy) that took the policy's least likely action throughout
        return obs, act, ret

    return _steps(normal, bad)


def traj_reinforce_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, ret = batch
    probs = F.softmax(model(obs), -1)
    p_traj = probs.gather(-1, act.unsqueeze(-1)).squeeze(-1).prod(-1)  # probability of each episode
    return -(torch.log(p_traj) * ret).mean()  # <origin:traj_log>


def traj_reinforce_loss_logspace(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, ret = batch
    dist = D.Categorical(logits=model(obs))
    return -(dist.log_prob(act).sum(-1) * ret).mean()


def _traj_model() -> StepPolicy:
    torch.manual_seed(0)
    model = StepPolicy()
    with torch.no_grad():
        model.net[2].bias[3] = -10.0  # action 3 ("abort") made unlikely by a warm start
    return model


# 20 steps of probability ~5e-5 each: the product underflows to 0 (finite), log(0) = -inf.
@case("reinforce_trajectory_probability_product_underflow_log",
      _loss("forward", "aten.log.default", None, "traj_log", "log_nonpositive"))
def _traj_bad() -> Program:
    model = _traj_model()
    return Program(model, sgd(model, 1e-3), _traj_batches(1810), traj_reinforce_loss)


@quiet("reinforce_trajectory_log_probability_summed_in_log_space")
def _traj_ok() -> Program:
    model = _traj_model()
    return Program(model, sgd(model, 1e-3), _traj_batches(1810), traj_reinforce_loss_logspace)


def categorical_probs_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act, ret = batch
    dist = D.Categorical(probs=F.softmax(model(obs), -1))  # probs_to_logits clamps to [eps, 1 - eps]
    return -(dist.log_prob(act).sum(-1) * ret).mean()


@quiet("reinforce_categorical_probs_from_softmax_clamped_logits")
def _traj_probs() -> Program:
    model = _traj_model()
    return Program(model, sgd(model, 1e-3), _traj_batches(1810), categorical_probs_loss)


# ======================================================================= the construction checks
class FirstNonFinite(TorchDispatchMode):
    """The first op whose output holds a NaN its inputs did not, or an infinity while every input and scalar
    argument was finite; the innermost module of ``model`` running and the deepest line of this file."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.found: tuple[str, str | None, int | None] | None = None

    def __enter__(self) -> FirstNonFinite:
        self._hooks = (nn.modules.module.register_module_forward_pre_hook(self._push),
                       nn.modules.module.register_module_forward_hook(self._pop))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _push(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), "?"))

    def _pop(self, module: nn.Module, args: Any, out: Any) -> None:
        self.stack.pop()

    def _where(self) -> tuple[str | None, int | None]:
        mods = [n for n in self.stack if n != "?"]
        frame, line = sys._getframe(), None
        while frame is not None:
            own = frame.f_code.co_name in ("_where", "__torch_dispatch__")
            if frame.f_code.co_filename == __file__ and not own and line is None:
                line = frame.f_lineno
            frame = frame.f_back
        return (mods[-1] if mods else None), line

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.found is None and func._schema.name.split("::")[-1].startswith(("empty", "new_empty")):
            return func(*args, **kwargs)  # uninitialised memory, overwritten by the next op
        if self.found is None:
            flat = tree_flatten((args, kwargs))[0]
            ins = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
            nums = [x for x in flat if isinstance(x, float)]
            in_nan = any(bool(t.isnan().any()) for t in ins)
            in_bad = in_nan or any(not bool(t.isfinite().all()) for t in ins) or any(not math.isfinite(x) for x in nums)
        out = func(*args, **kwargs)
        if self.found is None:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if (any(bool(t.isnan().any()) for t in outs) and not in_nan) or \
                    (any(bool(t.isinf().any()) for t in outs) and not in_bad):
                self.found = (str(func), *self._where())
        return out


class FirstZero(FirstNonFinite):
    """For a validation error on a finite value (a scale or concentration of 0): the first op whose output holds
    an exact zero where none of its floating inputs had one (an underflow to 0)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None and func._schema.name.split("::")[-1] in ("exp", "softplus"):
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if any(bool((t == 0).any()) for t in outs):
                self.found = (str(func), *self._where())
        return out


def _finite(ts: Any) -> bool:
    return all(t is None or not isinstance(t, torch.Tensor) or bool(torch.isfinite(t).all()) for t in ts)


def plain_run(program: Program) -> dict[str, Any]:
    """The loop without nantrace: the first step whose loss or gradients are non-finite (or that raised), and
    the origin at that step from a re-run of the step's loss code from the same state."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        received = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            loss = run_step(program, program.loss, batch, step)
        except (RuntimeError, ValueError) as exc:
            model.load_state_dict(state)
            mode = FirstNonFinite(model)
            with pytest.raises((RuntimeError, ValueError)), mode:
                program.loss(model, received, step)
            found = mode.found
            if found is None:  # a finite invalid value: the op that underflowed to it
                zero = FirstZero(model)
                with pytest.raises((RuntimeError, ValueError)), zero:
                    program.loss(model, received, step)
                found = zero.found
            return dict(step=step, what="raised", origin=found, error=type(exc).__name__)
        loss_ok = bool(torch.isfinite(loss).all())
        if not (loss_ok and _finite(p.grad for p in model.parameters())):
            model.load_state_dict(state)
            mode = FirstNonFinite(model)
            with mode:
                program.loss(model, received, step)
            return dict(step=step, what="loss" if not loss_ok else "grads", origin=mode.found)
        opt.step()
        if not _finite(model.parameters()):
            return dict(step=step, what="params", origin=None)
    return dict(step=None, what=None, origin=None)


WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """Without nantrace the program fails first at the expected step in the expected way, at the expected op,
    module and line (plain torch)."""
    build, want = CASES[name]
    run = plain_run(build())
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    op, module, line = run["origin"]
    assert (op, module, line) == (want.op, want.module, JUDGE.marked(want.tag)[1]), run


def test_quiet_constructions() -> None:
    """The quiet programs train to their end with finite losses, gradients and parameters."""
    for name, build in QUIET.items():
        run = plain_run(build())
        assert run["step"] is None, (name, run)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params(QUIET, XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident at all (no blocking one, no early warning), and the program trains to its end."""
    run = train(QUIET[name](), replayable=mode == "replayable")
    assert not run.incidents, [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.error is None, repr(run.error)
