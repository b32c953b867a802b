"""Held-out failures, round 10b: the classes of failure nantrace has been weakest on, in complete small
programs of families not used by earlier rounds.

1. LOSS CODE, zero-intrusive, in RL and generative training: CleanRL-style PPO whose last minibatch holds
   one transition (``mb_adv.std()`` over one element: 0 / 0 degrees of freedom); rectified-flow training
   with an x1-predicting network converted to a velocity by ``/ (1 - t)`` on a time grid built with an
   off-by-one (``randint(0, K + 1) / K`` reaches t = 1).
2. Failures that RAISE inside the step: a sequence policy sampled with ``torch.multinomial`` at a
   temperature annealed to 0 (``logits / 0``); Deep CCA whose Cholesky whitening meets the NaN of a log
   spectrum of a silent clip; a policy-gradient loss with a hand-written entropy of a collapsed policy and
   the user's own ``assert torch.isfinite(loss)``; DDPM timesteps drawn with an off-by-one
   (``alphas_cumprod[t]`` with t = T: an index out of range before the model's forward); a Lightning
   Gaussian policy whose variance head has no softplus (``sqrt`` of a negative variance rejected by
   ``torch.distributions.Normal``); an HF ``Trainer`` whose ``compute_loss`` whitens with ``torch.cov`` and
   ``torch.linalg.cholesky`` on the last batch of one example.
3. The OPTIMIZER STEP: ``torch.optim.Adadelta(eps=0)`` on a store embedding whose unseen stores get zero
   gradient (``delta.div_(std)``: 0 / 0); a hand-written NovoGrad (layer-wise second moment, ``eps=0``) on a
   ReZero transformer-style MLP whose residual gate starts at 0 (the block's gradient is exactly 0); an HF
   ``Trainer`` given ``optimizers=(Adamax(eps=0), None)`` with categories absent from the data.
4. DIVERGENCE and finite anomalies: one batch of targets in millimetres in a regression trained in metres
   (a loss spike against the run's own history, after ``spike_warmup``); a Lightning module whose
   log-spaced LR warm-up has no cap (lr x1.58 per step for ever).
5. QUIET programs that must not fire: PPO minibatches whose advantages are all equal (std 0 plus 1e-8),
   Adadelta with its default eps on the same unseen stores, rectified flow on the correct grid [0, 1).

How expectations were derived (before nantrace ran): from /work/shared/API.md and docs/diagnosis.md. The
origin is the first op that made a non-finite value from finite inputs, or, when that op received an
infinity, the op that made the infinity (``log`` of an underflowed probability, ``logits / 0``); module =
the innermost module running the op (``None`` in loss code); source = the marked line of this file (the
loop's ``optimizer.step()`` for a torch optimizer, the optimizer's own line for a Python one, the framework's
``optimizer.step`` line under a Trainer). Causes: a division by a zero count or zero degrees of freedom is
``div_by_zero``; a zero divisor made of the optimizer's running state is ``optimizer_state``; a step that
raises because of a value is kind ``exception``, action ``raised``, with that value's origin and cause (an
index outside the dimension: ``label_out_of_range``); a finite spike after the warm-up of the spike
detector is ``loss_spike`` / ``loss_divergence``; divergence follows round 5a's ``_rule_step`` and round 8b's
``leader``. Every construction is checked with plain torch and a TorchDispatchMode (round 8b's ``Made``):
``test_cases_fail_without_nantrace`` / ``test_framework_construction`` assert the step, the stage (loss,
gradient, parameter after the update, or the exception's type) and the first op that made a non-finite value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from heldout_harness import Judge, Program, aligned, case_params, describe, run_step, sgd, train
from origin_markers import origin_line
from test_heldout_programs_r5a import _rule_step
from test_heldout_programs_r8b import FWant, Made, Outcome, Rows, _finite, _first_bad, _series, hf_args, hf_fit, leader, \
    pl_fit
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread", "distributions_validate")]  # an earlier torch.compile turns validation off

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
RAISES: dict[str, type] = {}
"""Exception cases -> the type of the user's exception."""
DIVERGING: set[str] = set()
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want, raises: type | None = None, diverging: bool = False) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if raises is not None:
            RAISES[name] = raises
        if diverging:
            DIVERGING.add(name)
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ================================================================= 1. loss code (RL, generative)
# 1a. CleanRL-style PPO: 2 envs x 8 steps = 16 transitions, minibatch size 5 -> minibatches of 5, 5, 5, 1.
#     The per-minibatch advantage normalisation ``(a - a.mean()) / (a.std() + 1e-8)`` over ONE transition:
#     std with Bessel's correction divides by n - 1 = 0 -> NaN (the 1e-8 does not help). Loss code.
class ActorCritic(nn.Module):
    def __init__(self, obs: int = 6, actions: int = 3) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(obs, 32), nn.Tanh(), nn.Linear(32, actions))
        self.critic = nn.Sequential(nn.Linear(obs, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


def ppo_loss(agent: nn.Module, mb: Any, step: int) -> torch.Tensor:
    obs, actions, old_logp, adv, returns = mb
    logits, value = agent(obs)
    dist = torch.distributions.Categorical(logits=logits)
    new_logp = dist.log_prob(actions)
    ratio = (new_logp - old_logp).exp()
    mb_adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # <origin:ppo_std>
    pg = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(0.8, 1.2)).mean()
    v_loss = 0.5 * ((value - returns) ** 2).mean()
    return pg + 0.5 * v_loss - 0.01 * dist.entropy().mean()


def _ppo_minibatches(sizes: list[int], seed: int, equal_adv: bool = False) -> list[Any]:
    g = _gen(seed)
    out = []
    for n in sizes:
        adv = torch.full((n,), 0.7) if equal_adv else torch.randn(n, generator=g)
        out.append((torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g),
                    -torch.rand(n, generator=g) - 0.5, adv, torch.randn(n, generator=g)))
    return out


# The helper who wrote this round expected div_by_zero (std divides by n - 1 = 0, and the user's eps is not 0).
# The project's contract (docs/diagnosis.md, "Statistics of too few elements"; r3a's REINFORCE case, the cause
# matrix's std_one_sample, tests/cause_oracle.py's degrees-of-freedom rule) calls a std/var whose n - correction
# is <= 0 zero_variance_norm: a batch too small for the statistic it is normalised by. Reviewed, kept.
@case("cleanrl_ppo_last_minibatch_of_one_advantage_std",
      Want("nonfinite_loss", "forward", "aten.std.correction", None, "ppo_std", "zero_variance_norm"))
def _ppo_one() -> Program:
    torch.manual_seed(0)
    agent = ActorCritic()
    opt = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    return Program(agent, opt, _ppo_minibatches([5, 5, 5, 1, 5], 1001), ppo_loss)


# 1b. Rectified flow with an x1-predicting network (it predicts the clean sample; the loss is taken on the
#     velocity): v_pred = (x1_pred - x_t) / (1 - t). The time grid is ``randint(0, K + 1) / K`` (off by one),
#     so t = 1 occurs: x_t = x1 and the division by 1 - t = 0 gives +-inf. Batch 3 draws t = 1.
class FlowNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None]], -1))


def flow_x1_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x1, x0, t = batch
    x_t = t[:, None] * x1 + (1 - t[:, None]) * x0
    x1_pred = model(x_t, t)
    v_pred = (x1_pred - x_t) / (1 - t[:, None])  # <origin:flow_div>
    return F.mse_loss(v_pred, x1 - x0)


def _flow_batches(seed: int, off_by_one: bool) -> list[Any]:
    g, K = _gen(seed), 10
    out = []
    for s in range(5):
        x1 = torch.randn(16, 8, generator=g) * 0.5 + 1.0
        t = torch.randint(0, K, (16,), generator=g).float() / K
        if off_by_one and s == FAIL_STEP:
            t[4] = K / K  # randint(0, K + 1) drew K at this step
        out.append((x1, torch.randn(16, 8, generator=g), t))
    return out


@case("rectified_flow_x1_prediction_to_velocity_time_grid_off_by_one",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "flow_div", "div_by_zero"))
def _flow() -> Program:
    torch.manual_seed(0)
    model = FlowNet()
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _flow_batches(1002, True), flow_x1_loss)


# ================================================================= 2. failures that raise
# 2a. A REINFORCE text generator sampled with a temperature annealed linearly to 0 ("greedy at the end"):
#     at step 3 the temperature is 0.0, logits / 0 = +-inf, softmax NaN, and torch.multinomial raises
#     "probability tensor contains either inf, nan or element < 0".
class TokenPolicy(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, vocab))

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(prev))


def reinforce_sampled(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    prev, reward_table = batch
    logits = policy(prev)
    temperature = max(0.0, 1.0 - step / 3)  # annealed to greedy
    probs = F.softmax(logits / temperature, dim=-1)  # <origin:temp_div>
    tokens = torch.multinomial(probs, 1).squeeze(-1)
    logp = F.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    return -(logp * reward_table[tokens]).mean()


@case("reinforce_text_sampler_temperature_annealed_to_zero_multinomial_raises",
      Want("exception", "forward", "aten.div.Tensor", None, "temp_div", "div_by_zero", action="raised"),
      raises=RuntimeError)
def _temperature() -> Program:
    torch.manual_seed(0)
    policy = TokenPolicy()
    g = _gen(1003)
    batches = [(torch.randint(0, 20, (12,), generator=g), torch.randn(20, generator=g)) for _ in range(5)]
    return Program(policy, sgd(policy, 1e-2), batches, reinforce_sampled)


# 2b. Deep CCA on audio/text pairs. The audio tower takes the log of the mean power of each band (no floor);
#     a silent clip in batch 3 has zero power: log(0) = -inf, and the next Linear mixes -inf of both signs
#     into NaN. The loss whitens each view with torch.linalg.cholesky of its covariance, which raises on NaN.
class LogPowerAudio(nn.Module):
    def __init__(self, bands: int = 8, d: int = 4) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(bands, 16), nn.Tanh(), nn.Linear(16, d))

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        log_power = torch.log(spec.pow(2).mean(-1))  # <origin:cca_log>
        return self.proj(log_power)


class DeepCCA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.audio = LogPowerAudio()
        self.text = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, spec: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.audio(spec), self.text(text)


def _whiten(h: torch.Tensor, r: float = 1e-3) -> torch.Tensor:
    hc = h - h.mean(0)
    cov = hc.T @ hc / (h.shape[0] - 1) + r * torch.eye(h.shape[1])
    chol = torch.linalg.cholesky(cov)
    return torch.linalg.solve_triangular(chol, hc.T, upper=False).T


def dcca_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    spec, text = batch
    a, t = model(spec, text)
    wa, wt = _whiten(a), _whiten(t)
    return -(wa * wt).sum(1).mean() / a.shape[1]


@case("deep_cca_log_power_silent_clip_cholesky_whitening_raises",
      Want("exception", "forward", "aten.log.default", "audio", "cca_log", "log_nonpositive", action="raised"),
      raises=torch.linalg.LinAlgError)
def _dcca() -> Program:
    torch.manual_seed(0)
    model = DeepCCA()
    g = _gen(1004)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = torch.randn(32, 8, 20, generator=g)
        if step == FAIL_STEP:
            spec[7] = 0.0  # a silent clip
        return spec, torch.randn(32, 10, generator=g)

    return Program(model, sgd(model, 1e-3), [batch(s) for s in range(5)], dcca_loss)


# 2c. Policy gradient with a hand-written entropy bonus and the user's own NaN check. Batch 3 carries an
#     observation in millimetres instead of metres (x1000): the ReLU policy's logits differ by hundreds, the
#     softmax underflows to exactly 0, log(0) = -inf, 0 * -inf = NaN in the entropy, and the assert fires.
def pg_entropy_assert(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, adv = batch
    logits = policy(obs)
    probs = F.softmax(logits, dim=-1)
    entropy = -(probs * torch.log(probs)).sum(-1)  # <origin:entropy_log>
    logp = torch.log(probs.gather(1, actions[:, None]).squeeze(1) + 1e-8)
    loss = -(logp * adv).mean() - 0.01 * entropy.mean()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    return loss


@case("policy_gradient_handwritten_entropy_collapsed_policy_user_assert",
      Want("exception", "forward", "aten.log.default", None, "entropy_log", "log_nonpositive", action="raised"),
      raises=AssertionError)
def _entropy_assert() -> Program:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    g = _gen(1005)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(8, 4, generator=g)
        if step == FAIL_STEP:
            obs[2] *= 1000.0  # this episode's sensor logged millimetres
        return obs, torch.randint(0, 5, (8,), generator=g), torch.randn(8, generator=g)

    return Program(policy, sgd(policy, 1e-3), [batch(s) for s in range(5)], pg_entropy_assert)


# 2d. DDPM with T = 50 and timesteps drawn with ``randint(0, T + 1)`` (off by one): the q_sample before the
#     model's forward indexes alphas_cumprod[50] -> IndexError, in the step's code before the forward.
T_DIFF = 50
BETAS = torch.linspace(1e-4, 0.02, T_DIFF)
ALPHAS_CUMPROD = torch.cumprod(1 - BETAS, 0)


class Denoiser(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.t_emb = nn.Embedding(T_DIFF, 16)
        self.net = nn.Sequential(nn.Linear(d + 16, 64), nn.SiLU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, self.t_emb(t.clamp(max=T_DIFF - 1))], -1))


def ddpm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, noise, t = batch
    ab = ALPHAS_CUMPROD[t][:, None]  # <origin:ddpm_index>
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    return F.mse_loss(model(x_t, t), noise)


@case("ddpm_timesteps_randint_off_by_one_alphas_cumprod_index",
      Want("exception", "forward", "aten.index.Tensor", None, "ddpm_index", "label_out_of_range", action="raised"),
      raises=IndexError)
def _ddpm_index() -> Program:
    torch.manual_seed(0)
    model = Denoiser()
    g = _gen(1006)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        t = torch.randint(0, T_DIFF, (16,), generator=g)
        if step == FAIL_STEP:
            t[9] = T_DIFF  # randint(0, T + 1) finally drew T
        return torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g), t

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(5)], ddpm_loss)


# ================================================================= 3. the optimizer step
# 3a. Demand forecasting with a store embedding; stores 40..49 opened recently and are not in the training
#     data yet, so their rows get exactly zero gradient. Adadelta ("no learning rate to tune") with eps=0:
#     std = sqrt(square_avg) = 0 and delta = sqrt(acc_delta) = 0 at step 0: delta.div_(std) = 0 / 0.
class DemandModel(nn.Module):
    def __init__(self, stores: int = 50) -> None:
        super().__init__()
        self.store = nn.Embedding(stores, 8)
        self.mlp = nn.Sequential(nn.Linear(8 + 5, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, store: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.store(store), x], -1)).squeeze(-1)


def _demand_batches(seed: int) -> list[Any]:
    g = _gen(seed)
    return [(torch.randint(0, 40, (32,), generator=g), torch.randn(32, 5, generator=g), torch.randn(32, generator=g))
            for _ in range(4)]


def demand_loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
    return F.mse_loss(m(b[0], b[1]), b[2])


@case("demand_forecast_adadelta_eps0_unseen_store_rows",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "store", "opt_step", "optimizer_state", step=0))
def _adadelta() -> Program:
    torch.manual_seed(0)
    model = DemandModel()
    return Program(model, torch.optim.Adadelta(model.parameters(), lr=1.0, eps=0.0), _demand_batches(1007), demand_loss)


# 3b. A hand-written NovoGrad (layer-wise second moment: v = b2 v + (1 - b2) ||g||^2, update g / (sqrt(v) + eps))
#     with eps=0, on a ReZero residual MLP (x + alpha * f(x), alpha = 0 at init). At step 0 every parameter of
#     the residual branches gets exactly zero gradient (d/df = alpha = 0): v = 0, and g / sqrt(0) = 0 / 0.
class NovoGrad(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.95, 0.98), eps: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros((), dtype=p.dtype)
                st["exp_avg_sq"].mul_(b2).add_(p.grad.pow(2).sum(), alpha=1 - b2)
                g = p.grad / (st["exp_avg_sq"].sqrt() + group["eps"])  # <origin:novograd_div>
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                st["exp_avg"].mul_(b1).add_(g)
                p.add_(st["exp_avg"], alpha=-group["lr"])


class ReZeroBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * self.fn(x)


class ReZeroNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(10, d)
        self.blocks = nn.Sequential(ReZeroBlock(d), ReZeroBlock(d))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


@case("rezero_mlp_handwritten_novograd_eps0_zero_branch_gradient",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "blocks.0.fn.0", "novograd_div", "optimizer_state", step=0))
def _novograd() -> Program:
    torch.manual_seed(0)
    model = ReZeroNet()
    g = _gen(1008)
    batches = [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    return Program(model, NovoGrad(model.parameters(), lr=1e-2), batches,
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ================================================================= 4. a finite anomaly
# 4a. A house-price regressor trained in metres (targets ~1) for 40 steps; batch 40 comes from a source that
#     logs millimetres (targets x1000): the loss jumps ~1e6-fold, finite. After spike_warmup (32) steps of
#     history, a finite loss spike against the run's own statistics: loss_spike / loss_divergence, blocked.
SPIKE_STEP = 40


@case("regression_one_batch_of_targets_in_millimetres_loss_spike",
      Want("loss_spike", "forward", None, None, None, "loss_divergence", step=SPIKE_STEP))
def _spike() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    g = _gen(1009)
    w = torch.randn(6, 1, generator=g) * 0.3

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 6, generator=g)
        y = x @ w + 0.05 * torch.randn(32, 1, generator=g)
        return x, y * (1000.0 if step == SPIKE_STEP else 1.0)

    return Program(model, sgd(model, 1e-2), [batch(s) for s in range(SPIKE_STEP + 3)],
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# ================================================================= 5. quiet programs
QUIET: dict[str, Callable[[], Program]] = {}


def quiet_case(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        return build

    return register


@quiet_case("ppo_minibatch_all_equal_advantages_std_zero_plus_eps")
def _q_ppo() -> Program:
    torch.manual_seed(0)
    agent = ActorCritic()
    return Program(agent, torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5),
                   _ppo_minibatches([5, 5, 5, 4, 5], 1011, equal_adv=True), ppo_loss)


@quiet_case("adadelta_default_eps_unseen_store_rows")
def _q_adadelta() -> Program:
    torch.manual_seed(0)
    model = DemandModel()
    return Program(model, torch.optim.Adadelta(model.parameters(), lr=1.0), _demand_batches(1012), demand_loss)


@quiet_case("rectified_flow_correct_time_grid")
def _q_flow() -> Program:
    torch.manual_seed(0)
    model = FlowNet()
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _flow_batches(1013, False), flow_x1_loss)


# ======================================================================= the plain runs
def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def plain_run(program: Program) -> dict[str, Any]:
    """Without nantrace, under the op recorder: per step loss and gradient norm; the first step whose loss,
    gradients or (after the update) parameters / state are non-finite, or that raised."""
    model, opt = program.model, program.optimizer
    rec = Made()
    losses: list[float] = []
    norms: list[float] = []
    out = dict(losses=losses, norms=norms, step=None, what=None, error=None, rec=rec)
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            opt.zero_grad()
            try:
                loss = run_step(program, program.loss, batch, step)
            except Exception as exc:  # noqa: BLE001
                out.update(step=step, what="raised", error=exc)
                return out
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            losses.append(float(loss.detach().sum()))
            norms.append(float(torch.stack([g.double().norm() for g in grads]).norm()))
            if not math.isfinite(losses[-1]):
                out.update(step=step, what="loss")
                return out
            if not _finite(grads):
                out.update(step=step, what="grads")
                return out
            opt.step()
            if not _finite(model.parameters()):
                out.update(step=step, what="params")
                return out
            if not _state_finite(opt):
                out.update(step=step, what="state")
                return out
    return out


WHAT = {"nonfinite_param": "params", "optimizer_state": "state", "nonfinite_grad": "grads", "nonfinite_loss": "loss",
        "exception": "raised"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails at the expected step, in the expected stage (or
    raises the expected exception there), and the first op that made a non-finite value from finite inputs
    at that step is the expected origin (none before that step)."""
    build, want = CASES[name]
    run = plain_run(build())
    rec = run["rec"]
    if want.kind == "loss_spike":  # finite throughout; the spike step stands out of the history by far
        losses = run["losses"]
        assert run["step"] is None and len(losses) > want.step, run["what"]
        history = sorted(losses[want.step - 32: want.step])
        assert losses[want.step] > 1e4 * history[len(history) // 2] and max(losses[:want.step]) * 100 < losses[want.step]
        assert not rec.made, rec.made[:4]
        return
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), (run["step"], run["what"], run["error"])
    assert not [m for m in rec.made if m[0] < want.step], rec.made[:4]
    if want.kind == "exception":
        assert type(run["error"]) is RAISES[name], repr(run["error"])
        if want.cause == "label_out_of_range":
            assert "out of bounds" in str(run["error"]) and not rec.made, (run["error"], rec.made)
            return
    assert rec.first(want.step, want.phase == "optimizer") == want.op, rec.made[:6]


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
    if want.kind == "exception":  # the user's own exception, unchanged
        assert type(run.error) is RAISES[name] and run.error_step == want.step, (repr(run.error), run.error_step)
    else:
        assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    run = plain_run(QUIET[name]())
    assert run["step"] is None and not run["rec"].made, (run["step"], run["what"], run["error"])


@pytest.mark.parametrize("name,mode", case_params(QUIET, {}))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident that blocks an update, and the program trains to its end."""
    run = train(QUIET[name](), replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert run.error is None, repr(run.error)


# ======================================================================= 6. real framework trainers
# Wired as round 8b wires them (its ``hf_fit`` / ``pl_fit``, nantrace's callbacks, a recorder without them).
FW: dict[str, tuple[Callable[..., Outcome], FWant]] = {}
FW_RAISES: dict[str, type] = {}
FW_DIVERGING: set[str] = set()
FW_XFAIL: dict[str, str] = {}
"""name -> why nantrace is still wrong on it (a strict xfail)."""


def fw_case(name: str, want: FWant, raises: type | None = None, diverging: bool = False) -> Callable:
    def register(run: Callable[..., Outcome]) -> Callable[..., Outcome]:
        assert name not in FW, name
        FW[name] = (run, want)
        if raises is not None:
            FW_RAISES[name] = raises
        if diverging:
            FW_DIVERGING.add(name)
        return run

    return register


def _lib(key: str) -> tuple[str, int]:
    from test_heldout_frameworks_r5b import lib_line

    return lib_line(key)


def _fw_where(source: str | None) -> Any:
    from test_heldout_frameworks_r5b import LIB_LINES, _lib_file

    if source is None:
        return None
    path, _, line = source.rpartition(":")
    full = os.path.abspath(path)
    if os.path.exists(full) and os.path.samefile(full, HERE):
        return os.path.basename(HERE), int(line)
    for package, rel, _ in LIB_LINES.values():
        if os.path.exists(full) and os.path.samefile(full, _lib_file(package, rel)):
            return f"{package}/{rel}", int(line)
    return source


def fw_want(want: FWant) -> dict[str, Any]:
    line = None
    if want.tag is not None:
        line = _lib(want.tag[4:]) if want.tag.startswith("lib:") else (os.path.basename(HERE), origin_line(HERE, want.tag))
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=line)


def fw_got(incidents: list[Any]) -> dict[str, Any] | None:
    main = [i for i in incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=_fw_where(inc.source))


def _pl_module() -> Any:
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'nantrace[lightning]')")
    import lightning as L

    return L.LightningModule


def _hf_trainer() -> Any:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nantrace[hf]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'nantrace[hf]')")
    from transformers import Trainer

    return Trainer


# PL 1. A continuous-control policy (Lightning) whose variance head was written without a softplus ("it is
#       initialised positive"); its std is sqrt(var). Batch 3 holds a glitched observation (x40) along which
#       the head's output is negative: sqrt(-) = NaN, and torch.distributions.Normal's validation raises
#       ValueError inside training_step.
class GaussianHead(nn.Module):
    def __init__(self, d: int = 32, act: int = 2) -> None:
        super().__init__()
        self.mu = nn.Linear(d, act)
        self.var = nn.Linear(d, act)
        nn.init.constant_(self.var.bias, 1.0)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(h), torch.sqrt(self.var(h))  # <origin:pl_sqrt_var>


def _pl_policy_model() -> Any:
    class GaussianPolicy(_pl_module()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
            self.head = GaussianHead()

        def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.head(self.body(obs))

        def training_step(self, batch, batch_idx):
            obs, actions, adv = batch
            mu, std = self(obs)
            dist = torch.distributions.Normal(mu, std)
            return -(dist.log_prob(actions).sum(-1) * adv).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return GaussianPolicy()


@fw_case("pl_gaussian_policy_variance_head_without_softplus_normal_validation_raises",
         FWant("exception", "forward", "aten.sqrt.default", "head", "pl_sqrt_var", "sqrt_negative", action="raised"),
         raises=ValueError)
def _pl_policy(tmp: Path, watch: bool) -> Outcome:
    model = _pl_policy_model()
    glitch = aligned(lambda v: model.head.var(model.body(v))[:, 0] + 0.5, 6, -1.0, 40.0, 1101)
    g = _gen(1102)
    batches = []
    for step in range(5):
        obs = torch.randn(8, 6, generator=g)
        if step == FAIL_STEP:
            obs[3] = glitch
        batches.append((obs, torch.randn(8, 2, generator=g), torch.randn(8, generator=g)))
    return pl_fit(model, batches, tmp, watch, FAIL_STEP)


# PL 2. A log-spaced LR warm-up from base/100 to base over 10 steps, written without its cap:
#       lr = base * 0.01 * 100 ** (step / 10), so after the warm-up the lr keeps growing x1.58 per step; the
#       regression loses stability once lr passes 2 / curvature and the loss grows geometrically, finite for
#       many steps. Expected: a finite divergence (leader of the plain run's series), before any non-finite value.
def _pl_warmup_model() -> Any:
    class Regressor(_pl_module()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.01 * 100 ** (s / 10))  # no min(1, ...)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Regressor()


@fw_case("pl_log_spaced_warmup_without_cap_lr_grows_for_ever", FWant("loss_spike", "forward", None, None, None,
                                                                     "loss_divergence", step=-1), diverging=True)
def _pl_warmup(tmp: Path, watch: bool) -> Outcome:
    g = _gen(1103)
    w = torch.randn(6, 1, generator=g)
    batches = []
    for _ in range(40):
        x = torch.randn(32, 6, generator=g)
        batches.append((x, x @ w))
    return pl_fit(_pl_warmup_model(), batches, tmp, watch, 0, max_steps=40)


# HF 1. A product classifier handed to transformers.Trainer with its own optimizer,
#       optimizers=(Adamax(eps=0), None). Categories 20..29 are absent from the training data, so their embedding
#       rows get exactly zero gradient: exp_inf = max(0, |0| + 0) = 0 and param.addcdiv_(exp_avg, exp_inf) = 0 / 0
#       at step 0, in the first parameter of the model (the category embedding).
class ProductClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.category = nn.Embedding(30, 8)
        self.head = nn.Sequential(nn.Linear(8 + 4, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, category: torch.Tensor, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.head(torch.cat([self.category(category), x], -1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


@fw_case("hf_trainer_own_adamax_eps0_absent_category_rows",
         FWant("nonfinite_param", "optimizer", "aten.addcdiv_.default", "category", "lib:accelerate_step",
               "optimizer_state", step=0))
def _hf_adamax(tmp: Path, watch: bool) -> Outcome:
    trainer = _hf_trainer()

    def row(i: int) -> dict[str, Any]:
        g = _gen(1200 + i)
        return {"category": torch.randint(0, 20, (), generator=g), "x": torch.randn(4, generator=g),
                "labels": torch.tensor(i % 3)}

    model = ProductClassifier()
    opt = torch.optim.Adamax(model.parameters(), lr=2e-3, eps=0.0)
    args = hf_args(tmp, max_steps=3)
    return hf_fit(trainer, model, args, Rows(row, 12), watch, 0, optimizers=(opt, None))


# HF 2. A compute_loss that adds a decorrelation term on the pooled features: torch.cov of the batch, whitened
#       by torch.linalg.cholesky. 13 examples in batches of 4: the last batch (step 3) holds one example;
#       torch.cov over one observation divides by n - 1 = 0 (NaN), and cholesky raises on the NaN matrix.
class FeatureClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        feats = self.encoder(x)
        return {"logits": self.head(feats), "features": feats}


def _decorrelation_trainer() -> Any:
    class DecorrelatedTrainer(_hf_trainer()):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            cov = torch.cov(outputs["features"].T)  # <origin:hf_cov>
            chol = torch.linalg.cholesky(cov + 1e-4 * torch.eye(cov.shape[0]))
            loss = F.cross_entropy(outputs["logits"], labels) + 0.01 * (chol.diagonal().log().sum() ** 2)
            return (loss, outputs) if return_outputs else loss

    return DecorrelatedTrainer


@fw_case("hf_compute_loss_cov_cholesky_decorrelation_last_batch_of_one",
         FWant("exception", "forward", "aten.div.Tensor", None, "hf_cov", "div_by_zero", action="raised"),
         raises=torch.linalg.LinAlgError)
def _hf_cov(tmp: Path, watch: bool) -> Outcome:
    trainer = _decorrelation_trainer()

    def row(i: int) -> dict[str, Any]:
        g = _gen(1300 + i)
        return {"x": torch.randn(6, generator=g), "labels": torch.tensor(i % 3)}

    args = hf_args(tmp, max_steps=-1, num_train_epochs=1)
    return hf_fit(trainer, FeatureClassifier(), args, Rows(row, 13), watch, FAIL_STEP)


# ======================================================================= the tests (frameworks)
def _fw_params(names: list[str]) -> list[Any]:
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=FW_XFAIL[n])] if n in FW_XFAIL else [], id=n)
            for n in names]


@pytest.mark.parametrize("name", list(FW))
def test_framework_construction(name: str, tmp_path: Path) -> None:
    """Without nantrace: the failing step raises the expected exception (nothing non-finite before it, the
    expected first op at it), or the first non-finite value appears at the expected step in the expected stage,
    made by the expected op; the diverging run stays finite and rises by the documented rule."""
    run, want = FW[name]
    out = run(tmp_path, False)
    log = out.log
    if name in FW_DIVERGING:
        losses, norms = _series(log)
        end = _first_bad(log)
        assert out.error is None and len(losses) >= 20, (out.error, losses)
        rules = [r for r in (_rule_step(losses[:end]), _rule_step(norms[:end])) if r is not None]
        assert rules and min(rules) < (end if end is not None else len(losses)), (losses, norms, end)
        assert leader(losses[:end], norms[:end]) == want.kind, (losses, norms)
        return
    if want.kind == "exception":
        assert type(out.error) is FW_RAISES[name], repr(out.error)
        assert log.step == want.step and _first_bad(log) is None, (log.step, _first_bad(log))
        assert not [m for m in log.rec.made if m[0] < want.step], log.rec.made
        assert log.rec.first(want.step, False) == want.op, log.rec.made[:6]
        return
    assert out.error is None, repr(out.error)
    assert _first_bad(log) == want.step, {k: v for k, v in log.__dict__.items() if k != "rec"}
    if want.kind == "nonfinite_param":
        assert not log.loss_bad.get(want.step) and not log.grad_bad.get(want.step) and log.param_bad.get(want.step)
    assert log.rec.first(want.step, want.phase == "optimizer") == want.op, log.rec.made[:6]


@pytest.mark.parametrize("name", _fw_params([n for n in FW if n not in FW_DIVERGING]))
def test_framework_diagnosis(name: str, tmp_path: Path) -> None:
    run, want = FW[name]
    out = run(tmp_path, True)
    got = fw_got(out.incidents)
    assert got is not None, ("no incident", repr(out.error))
    assert got == fw_want(want), [describe(i) + " | " + i.summary for i in out.incidents]
    if want.kind == "exception":  # the user's own error propagates, unchanged
        assert type(out.error) is FW_RAISES[name], repr(out.error)
        return
    assert out.error is None, repr(out.error)
    assert out.unchanged is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name", _fw_params([n for n in FW if n in FW_DIVERGING]))
def test_framework_divergence(name: str, tmp_path: Path) -> None:
    """The divergence is the first blocking incident, at or after the rule's step and before the first
    non-finite value, and nothing non-finite was reached."""
    run, want = FW[name]
    reference = run(tmp_path / "plain", False)
    losses, norms = _series(reference.log)
    rules = [r for r in (_rule_step(losses), _rule_step(norms)) if r is not None]
    end = _first_bad(reference.log)
    out = run(tmp_path / "watched", True)
    got = fw_got(out.incidents)
    assert got is not None, ("no incident", repr(out.error))
    assert {k: v for k, v in got.items() if k != "step"} == {k: v for k, v in fw_want(want).items() if k != "step"}, \
        [describe(i) for i in out.incidents]
    assert rules and min(rules) <= got["step"] < (end if end is not None else len(losses)), (got["step"], rules, end)
    assert out.error is None or isinstance(out.error, nantrace.NonFiniteError), repr(out.error)
