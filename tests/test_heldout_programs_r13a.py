"""Held-out failures, round 13a: DIVERGENCE and its symptoms, and the EARLY WARNINGS, in programs
shaped like public training code (a small GPT with a warm-up schedule, a DQN, a char-RNN language
model without clipping, a WGAN critic, count and linear regressions at too high a learning rate, a
fine-tuned classifier head, a Hugging Face-style linear-decay schedule, a GAN).

The harness's ``Judge`` (tests/heldout_harness.py) compares only the FIRST BLOCKING incident
(``action != "logged"``); early warnings are logged and let the update land, so ``Judge.got``
skips them and ``assert_diagnosis`` fails a run that has only warnings. The early-warning and
quiet programs of this round are therefore judged by their own tests below
(``test_early_warnings``, ``test_quiet_programs``), over every incident, logged ones included.

1. FINITE LOSS SPIKES (kind ``loss_spike``, phase ``forward``, op/module ``None``, cause
   ``loss_divergence``, action ``skipped``): a regressor whose ``MultiStepLR`` was given ``gamma=100`` (a
   "divide by 100" config read as a factor) so the LR jumps 100x at step 100 (the loss of step 101 is the
   first to show it; the gradient norm jumps at the same step, less); a DQN whose replay batch holds one
   transition with an unclipped game score as reward; a small GPT (AdamW, linear warm-up) fed one batch
   from a corrupted shard of random tokens. Expected step: the first step at which docs/api.md's spike
   rule holds on the plain run's loss (>= ``spike_warmup`` = 32 steps of history, robust log-space
   z-score > 6 against the last 128 steps and > 1.5x their median): computed here (``_spike_step``) with
   and without the MAD's normal-consistency factor; the constructions make both the same step.
2. GRADIENTS EXPLODING WITHOUT NaN (``grad_explosion``, phase ``backward``, ``gradient_explosion``): a
   tanh char-RNN in the chaotic regime trained on 12-token windows whose bucketed sampler serves one
   batch of 200-token sequences (bounded forward, finite loss, gradient norm ~1e9); a WGAN critic trained
   without weight clipping or gradient penalty (its loss falls without bound, the gradient norm grows
   super-exponentially). Step: the spike rule on the gradient norm (> 6 robust sigmas and >
   ``explosion_min_ratio`` = 5x the median), or the divergence rule where it applies, before the first
   non-finite value.
3. A DIVERGENCE THAT ENDS NON-FINITE: linear regression with SGD above its stability limit; the loss
   grows ~1.1-2x per step for ~115 steps until the hand-written ``(pred - y).pow(2).mean()`` overflows in
   the ``mean`` (each square finite). Under the default config the first blocking incident is the finite
   divergence (docs/escalation.md: ``loss_spike``/``loss_divergence`` at or after the step where round
   5a's ``_rule_step`` holds). With ``finite_anomaly_action="log"`` the divergence is logged and the
   first blocking incident is the overflow: ``nonfinite_loss``, ``aten.mean.default``, module ``None``,
   the loss line, cause ``overflow`` (API.md: "finite inputs, a result beyond the range ... in an op that
   is not an exponent ... almost always a symptom, so the diagnosis says what made the values huge
   (divergence ...)"): its summary or fix must name the divergence. Versus a Poisson GLM at too high a
   learning rate whose log-rate runs away within a few steps (the divergence rule holds on the gradient
   norm 3 steps before), run the same way: ``aten.exp.default`` inside ``F.poisson_nll_loss``,
   ``exp_overflow`` (API.md: an exponent overflowing in its dtype). A logged divergence before it is not
   required: docs/escalation.md lets the gradient norm alone count only "once the loss has a history", a
   length it does not give (nantrace: 16 steps; the growth is at steps 9-13).
4. EARLY WARNINGS (``action="logged"``, nothing blocked, training goes on), windows from docs/dynamics.md
   (``dynamics_warmup`` 100, ``update_stats_every`` 25, ``logit_stats_every`` 50, clipping judged on 200
   steps read in batches of 32, the schedule check reports within 50 steps): a BatchNorm MLP at a
   linear-scaled LR of 1.0 with weight decay 2e-2 (``update_ratio``/``update_too_large``), a gated
   residual MLP whose gate bias is initialised to +20 (sigmoid rounds to exactly 1: the gate layer's
   gradient is exactly 0 while the others learn: ``vanishing_gradient``), an HF-style linear
   warm-up/decay scheduler stepped once per epoch while the config declares it per step
   (``lr_schedule``/``lr_schedule_mismatch``), a token-sum seq2seq loss clipped at ``max_norm=1.0`` every
   step (``clipping``/``clip_threshold``), and a new head fine-tuned on a frozen "pretrained" backbone
   whose features are un-normalised (logits beyond +-30: ``logit_saturation``).
5. QUIET programs, which must produce NO incident at all (no blocking one, no warning): a noisy loss
   under cosine annealing, a curriculum whose harder data raise the loss once by ~1.3x (below the
   documented 1.5x floor of a spike), a loss on its noise plateau, a small GPT's linear LR warm-up, and a
   GAN (two optimizers, two guards) whose losses oscillate; plus 4c's control (the HF linear schedule
   stepped per step, as declared).

How expectations were derived: each from the construction and the documents above, before nantrace
ran. ``test_cases_fail_without_nantrace`` checks each construction in plain torch: the loss and
gradient-norm series and the first non-finite step; for non-finite cases the first op whose inputs
were finite and whose output was not (a TorchDispatchMode written here) and the line that issued it;
for early warnings the statistic itself (update ratios, an exactly-zero gradient, the LR that ran,
pre-clip norms, logits); for quiet programs that neither documented rule holds on their series.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import (MODES, Judge, Program, Run, _blocking, assert_diagnosis, case_params, describe, run_step,
                             same, snapshot)
from test_heldout_programs_r5a import _rule_step
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

JUDGE = Judge(__file__)
HERE = os.path.abspath(__file__)

SPIKE = ("loss_spike", "forward", None, None, None, "loss_divergence")
GRAD = ("grad_explosion", "backward", None, None, None, "gradient_explosion")

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
DIVERGING: set[str] = set()
"""Cases whose expected step is a documented rule's step on the plain run (a range, checked there)."""
CONFIGS: dict[str, dict[str, Any]] = {}
"""Config groups a case runs under (besides the harness's ``print_incidents=False``)."""
EARLY: dict[str, tuple[Callable[[], Program], tuple[str, str, int, int]]] = {}
"""Early-warning cases: (kind, cause, first step, last step) of the first incident, logged; nothing blocked."""
QUIET: dict[str, Callable[[], Program]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
_WHY = {
}
XFAIL.update({f"{name}[{mode}]": why for name, why in _WHY.items() for mode in MODES})


def case(name: str, want: Want, diverging: bool = False, config: dict[str, Any] | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if diverging:
            DIVERGING.add(name)
        if config:
            CONFIGS[name] = config
        return build

    return register


def early(name: str, kind: str, cause: str, lo: int, hi: int, config: dict[str, Any] | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        EARLY[name] = (build, (kind, cause, lo, hi))
        if config:
            CONFIGS[name] = config
        return build

    return register


def quiet(name: str, config: dict[str, Any] | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        if config:
            CONFIGS[name] = config
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ================================================================= 1. finite loss spikes
# 1a. A tabular regressor whose config says "lr_decay: 100" (meaning: divide by 100 at epoch 40), passed as
#     MultiStepLR's gamma: the LR is multiplied by 100 at step 100. The update of step 100 overshoots; the loss
#     of step 101 is ~100x the run's median (the gradient norm ~25x; then the run diverges).
class TabularRegressor(nn.Module):
    def __init__(self, d_in: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 32), nn.Tanh())
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


@case("regressor_multisteplr_gamma_100_typo_lr_jumps_100x", Want(*SPIKE, step=101))
def _multistep_typo() -> Program:
    torch.manual_seed(0)
    model = TabularRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"lr_decay": 100.0, "decay_epochs": [100]}
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=config["decay_epochs"], gamma=config["lr_decay"])
    g = _gen(1)
    w = torch.randn(8, 1, generator=g) * 0.5

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=g)
        return x, x @ w + 0.1 * torch.randn(32, 1, generator=g)

    return Program(model, opt, [batch(s) for s in range(106)], lambda m, b, s: F.mse_loss(m(b[0]), b[1]),
                   scheduler=sched)


# 1b. DQN (CleanRL-style: Q-network, target network synced every 10 steps, Huber TD loss). Rewards are
#     clipped to {-1, 0, 1} by the env wrapper, except that one replay batch (step 40) holds a transition
#     recorded by a second env without the wrapper: reward 500 (a bonus-level score). TD loss ~16 vs ~0.35.
class QNetwork(nn.Module):
    def __init__(self, obs: int = 6, actions: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 64), nn.ReLU(), nn.Linear(64, actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _replay_batches(seed: int, n: int, bad_step: int) -> list[tuple[torch.Tensor, ...]]:
    g = _gen(seed)
    out = []
    for s in range(n):
        obs, act = torch.randn(32, 6, generator=g), torch.randint(0, 4, (32,), generator=g)
        rew = torch.randint(-1, 2, (32,), generator=g).float()
        nxt, done = torch.randn(32, 6, generator=g), (torch.rand(32, generator=g) < 0.1).float()
        if s == bad_step:
            rew[5] = 500.0  # unclipped score from the env without ClipRewardEnv
        out.append((obs, act, rew, nxt, done))
    return out


@case("dqn_replay_batch_with_one_unclipped_reward", Want(*SPIKE, step=40))
def _dqn_reward() -> Program:
    torch.manual_seed(0)
    q, target = QNetwork(), QNetwork()
    target.load_state_dict(q.state_dict())

    def td_loss(m: nn.Module, b: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
        obs, act, rew, nxt, done = b
        with torch.no_grad():
            y = rew + 0.99 * (1 - done) * target(nxt).max(1).values
        q_a = m(obs).gather(1, act[:, None]).squeeze(1)
        return F.smooth_l1_loss(q_a, y)

    def sync(m: nn.Module, step: int) -> None:
        if step % 10 == 0:
            target.load_state_dict(m.state_dict())

    return Program(q, torch.optim.Adam(q.parameters(), lr=1e-3), _replay_batches(2, 44, 40), td_loss,
                   before_step=sync)


# 1c. A nanoGPT-style character model (one pre-LN block, causal attention) with AdamW and a linear warm-up,
#     trained on a periodic token stream it learns in a few dozen steps; batch 200 comes from a corrupted shard
#     (uniformly random token ids): cross-entropy ~log(V) and more, against a learnt ~0.1.
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, ctx: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.block = Block(d, 2)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.block(x)))


def lm_loss(m: nn.Module, b: torch.Tensor, step: int) -> torch.Tensor:
    logits = m(b[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))


def _periodic_tokens(g: torch.Generator, batch: int = 16, t: int = 17, vocab: int = 32,
                     noise: float = 0.0) -> torch.Tensor:
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    seq = (start + 3 * torch.arange(t)) % vocab
    if noise:
        flip = torch.rand(batch, t, generator=g) < noise
        seq = torch.where(flip, torch.randint(0, vocab, (batch, t), generator=g), seq)
    return seq


CORRUPT_STEP = 200


def _warmup(warmup: int) -> Callable[[int], float]:
    return lambda s: min(1.0, (s + 1) / warmup)


@case("tiny_gpt_warmup_one_batch_from_corrupted_shard", Want(*SPIKE, step=CORRUPT_STEP))
def _gpt_corrupt() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup(10))
    g = _gen(3)
    batches = [_periodic_tokens(g) if s != CORRUPT_STEP else torch.randint(0, 32, (16, 17), generator=g)
               for s in range(CORRUPT_STEP + 3)]
    return Program(model, opt, batches, lm_loss, scheduler=sched)


# ================================================================= 2. gradients exploding, finite
# 2a. A char-RNN (nn.RNN, tanh) initialised with a recurrent gain of 2 (chaotic regime: bounded states,
#     positive Lyapunov exponent), no gradient clipping, trained on 12-token windows; the bucketed sampler
#     serves one batch of 200-token sequences at step 40: the loss per token is as before, the gradient norm
#     grows e^(lambda T) through the long chain (~1e9, finite).
class CharRNN(nn.Module):
    def __init__(self, vocab: int = 16, hidden: int = 64, gain: float = 2.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.rnn = nn.RNN(16, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():
            nn.init.normal_(self.rnn.weight_hh_l0, std=gain / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.head(h)


def char_loss(m: nn.Module, b: torch.Tensor, step: int) -> torch.Tensor:
    out = m(b[:, :-1])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), b[:, 1:].reshape(-1))


@case("char_rnn_no_clipping_bucketed_long_batch", Want(*GRAD, step=40))
def _char_rnn() -> Program:
    torch.manual_seed(0)
    model = CharRNN()
    g = _gen(3)
    batches = [torch.randint(0, 16, (8, (200 if s == 40 else 12) + 1), generator=g) for s in range(44)]
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, char_loss)


# 2b. WGAN critic pre-training (the generator frozen, as in the first critic iterations of WGAN) written
#     without the Lipschitz constraint (no weight clipping, no gradient penalty): loss = D(fake) - D(real)
#     is unbounded below; the 3-layer LeakyReLU critic is positively homogeneous, so SGD grows its weights
#     super-exponentially. The loss falls (more and more negative); the gradient norm explodes (~2 -> inf at
#     step ~131).
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                                 nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@case("wgan_critic_without_weight_clipping_or_gradient_penalty", Want(*GRAD, step=-1), diverging=True)
def _wgan() -> Program:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2)).requires_grad_(False)
    critic = Critic()
    g = _gen(4)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        real = torch.randn(64, 2, generator=g) * 0.5 + torch.tensor([2.0, 0.0])
        return real, torch.randn(64, 4, generator=g)

    def critic_loss(d: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        real, z = b
        with torch.no_grad():
            fake = gen(z)
        return d(fake).mean() - d(real).mean()

    return Program(critic, torch.optim.SGD(critic.parameters(), lr=5e-3), [batch(s) for s in range(140)],
                   critic_loss)


# ================================================================= 3. a divergence that ends non-finite
# 3a. Linear regression with SGD at lr 1.1 (above 2 / lambda_max of the batches' Hessian): the residual
#     grows ~1.2x per step; the hand-written MSE's mean overflows at step 115 (each square < 3.4e38, their
#     float32 sum not).
def linreg_batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(seed)
    w = torch.randn(10, 1, generator=g) * 0.3
    out = []
    for _ in range(n):
        x = torch.randn(64, 10, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(64, 1, generator=g)))
    return out


def handwritten_mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    x, y = b
    pred = m(x)
    return (pred - y).pow(2).mean()  # <origin:mse_mean>


def _linreg() -> Program:
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    return Program(model, torch.optim.SGD(model.parameters(), lr=1.1), linreg_batches(6, 120), handwritten_mse)


case("linear_regression_lr_above_stability_diverges", Want(*SPIKE, step=-1), diverging=True)(_linreg)
case("linear_regression_divergence_logged_until_mean_overflows",
     Want("nonfinite_loss", "forward", "aten.mean.default", None, "mse_mean", "overflow", step=115),
     config={"response": {"finite_anomaly_action": "log"}})(lambda: _linreg())


# 3b. A Poisson GLM for counts (log link, F.poisson_nll_loss) with SGD at lr 1.0: the log-rate runs away
#     within a few steps: the gradient norm rises 4 times in a row by ~400x (steps 10-13: the divergence rule
#     holds on it while the loss rises), the loss goes 1.1, 1.3, 1.8, 2.4, 1.7, 65 and exp() overflows at
#     step 16. Run with finite_anomaly_action="log" as 3a: the divergence is logged, the overflow blocks.
class CountModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def poisson_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    log_rate = m(b[0])
    return F.poisson_nll_loss(log_rate, b[1], log_input=True)  # <origin:poisson_exp>


@case("poisson_glm_lr_too_high_log_rate_exp_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "poisson_exp", "exp_overflow", step=16),
      config={"response": {"finite_anomaly_action": "log"}})
def _poisson() -> Program:
    torch.manual_seed(0)
    model = CountModel()
    g = _gen(8)
    w = torch.randn(10, 1, generator=g) * 0.1
    batches = []
    for _ in range(20):
        x = torch.randn(64, 10, generator=g)
        batches.append((x, torch.poisson((x @ w).exp(), generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1.0), batches, poisson_loss)


# ================================================================= 4. early warnings
def _blobs(g: torch.Generator, n: int = 32, d: int = 16, classes: int = 4,
           noise: float = 1.0) -> tuple[torch.Tensor, ...]:
    y = torch.randint(0, classes, (n,), generator=g)
    centres = torch.eye(classes, d) * 2.0
    return centres[y] + noise * torch.randn(n, d, generator=g), y


def ce_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


# 4a. A BatchNorm MLP trained with a large-batch recipe's linear-scaled LR (SGD, lr 1.0, momentum 0.9) and a
#     weight decay of 2e-2 from a sweep: the BN-preceded weights are scale-invariant, and weight decay holds their
#     norm where each update moves them by ||dW|| / ||W|| ~ 0.13-0.3 (the "angular update" sqrt(2 lr wd / (1 - m))
#     regime), for the whole run; the loss stays bounded and noisy (no spike by the documented rule).
class BNMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden)
        self.fc2, self.bn2 = nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn2(self.fc2(F.relu(self.bn1(self.fc1(x)))))))


@early("bn_mlp_linear_scaled_lr_update_ratio_too_large", "update_ratio", "update_too_large", 100, 176)
def _update_ratio() -> Program:
    torch.manual_seed(0)
    model = BNMLP()
    g = _gen(11)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9, weight_decay=2e-2)
    return Program(model, opt, [_blobs(g, n=64) for _ in range(220)], ce_loss)


# 4b. A gated residual MLP (highway-style, y = x + gate * f(x)) whose author initialised the gate bias to +20
#     "so the gates start open": sigmoid(~20) rounds to exactly 1.0 in float32, its derivative y (1 - y) is
#     exactly 0, and the gate layer's weight and bias gradients are exactly 0 on every step while the other
#     layers learn.
class GatedResidualMLP(nn.Module):
    def __init__(self, d: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.gate = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)
        with torch.no_grad():
            self.gate.weight.mul_(0.1)
            self.gate.bias.fill_(20.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + torch.sigmoid(self.gate(x)) * self.f(x))


@early("highway_gate_bias_init_20_sigmoid_saturated_zero_gradient", "vanishing_gradient", "vanishing_gradient", 100,
       176)
def _vanishing() -> Program:
    torch.manual_seed(0)
    model = GatedResidualMLP()
    g = _gen(12)
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                   [_blobs(g) for _ in range(220)], ce_loss)


# 4c. Hugging Face's get_linear_schedule_with_warmup (written out as its LambdaLR) with num_warmup_steps=50 and
#     num_training_steps=300 counted in optimizer steps, but scheduler.step() is called at the end of each
#     epoch (10 steps) as in a torchvision recipe. Declared schedule: the HF dict. The LR that runs is 0 for
#     steps 0..9 (meant: 2e-5 at step 1): a mismatch from step 1.
def hf_linear_schedule(warmup: int, total: int) -> Callable[[int], float]:
    def lr_lambda(current_step: int) -> float:
        if current_step < warmup:
            return float(current_step) / float(max(1, warmup))
        return max(0.0, float(total - current_step) / float(max(1, total - warmup)))

    return lr_lambda


HF_SCHEDULE = {"peak_lr": 1e-3, "warmup_steps": 50, "decay": "linear", "total_steps": 300}


@early("hf_linear_schedule_stepped_per_epoch_declared_per_step", "lr_schedule", "lr_schedule_mismatch", 1, 52,
       config={"dynamics": {"lr_schedule": HF_SCHEDULE}})
def _per_epoch() -> Program:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, hf_linear_schedule(50, 300))
    g = _gen(13)

    def end_of_epoch(m: nn.Module, step: int) -> None:
        if step > 0 and step % 10 == 0:
            sched.step()

    return Program(model, opt, [_blobs(g) for _ in range(120)], ce_loss, before_step=end_of_epoch)


# 4d. A GRU seq2seq-style tagger whose loss is summed over tokens (reduction="sum", as in old fairseq/OpenNMT
#     code) with the HF default max_grad_norm=1.0 copied in; 30% of the tags are noise, so the pre-clip norm stays
#     far above 1 (> 10 on every step) and
#     every update is rescaled (clipping fires on 100% of steps).
class Tagger(nn.Module):
    def __init__(self, vocab: int = 20, tags: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.out = nn.Linear(32, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(self.emb(x))[0])


def tagger_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    logits = m(b[0])
    return F.cross_entropy(logits.reshape(-1, 5), b[1].reshape(-1), reduction="sum")


def clip_one(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)


@early("token_sum_loss_clipped_at_hf_default_every_step", "clipping", "clip_threshold", 199, 240)
def _clipping() -> Program:
    torch.manual_seed(0)
    model = Tagger()
    g = _gen(14)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 20, (16, 12), generator=g)
        noisy = torch.rand(16, 12, generator=g) < 0.3  # annotator disagreement: 30% of tags are noise
        return x, torch.where(noisy, torch.randint(0, 5, (16, 12), generator=g), x % 5)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(250)],
                   tagger_loss, between=clip_one)


# 4e. Fine-tuning a new classification head on a frozen "pretrained" backbone whose penultimate features are
#     un-normalised (post-ReLU activations in the thousands, no final norm layer; the head's LR was scaled down
#     to 1e-8 until the loss stopped jumping): the head at PyTorch's default init gives logits in the hundreds,
#     so >= 90% of rows have a largest softmax probability that rounds to 1, or >= 90% of logits lie beyond
#     +-30, at every sampled step; the loss (~500) stays steady.
class PretrainedBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 128)
        with torch.no_grad():
            self.stem.weight.mul_(4000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.stem(x))


class FineTuned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = PretrainedBackbone().requires_grad_(False)
        self.classifier = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))


@early("finetune_head_on_unnormalised_pretrained_features_saturated_logits", "logit_saturation", "logit_saturation",
       100, 201)
def _saturated() -> Program:
    torch.manual_seed(0)
    model = FineTuned()
    g = _gen(15)
    opt = torch.optim.SGD(model.classifier.parameters(), lr=1e-8)
    return Program(model, opt, [_blobs(g, noise=0.3) for _ in range(210)], ce_loss)


# ================================================================= 5. quiet programs
# 5a. An MLP on noisy blobs, SGD with momentum and CosineAnnealingLR over the whole run: a noisy loss.
@quiet("mlp_noisy_loss_cosine_annealing")
def _q_cosine() -> Program:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = _gen(21)
    return Program(model, opt, [_blobs(g, n=16, noise=1.5) for _ in range(220)], ce_loss,
                   scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=220))


# 5b. Curriculum learning: easy samples (noise 0.5) for 100 steps, then harder ones (noise 0.9) are mixed in
#     at the documented rate of 50%: the loss rises once by ~1.3x (below the 1.5x floor of a spike).
@quiet("curriculum_harder_data_at_step_100_loss_rises_once")
def _q_curriculum() -> Program:
    torch.manual_seed(0)
    model = MLP()
    g = _gen(22)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        easy = _blobs(g, n=32, noise=0.8)
        if step < 100:
            return easy
        hard = _blobs(g, n=32, noise=1.2)
        keep = torch.rand(32, generator=g) < 0.5
        return torch.where(keep[:, None], hard[0], easy[0]), torch.where(keep, hard[1], easy[1])

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(220)], ce_loss)


# 5c. A regression that reaches its noise floor (targets with irreducible noise 0.5) and plateaus there.
@quiet("regression_plateau_at_noise_floor")
def _q_plateau() -> Program:
    torch.manual_seed(0)
    model = TabularRegressor()
    g = _gen(23)
    w = torch.randn(8, 1, generator=g) * 0.5

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 8, generator=g)
        return x, torch.tanh(x @ w) + 0.5 * torch.randn(64, 1, generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=3e-3), [batch(s) for s in range(220)],
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 5d. The tiny GPT with a linear LR warm-up over 60 steps to 1e-3 (then constant) on a noisy token stream
#     (15% of tokens random): the gradient norm grows while the LR ramps; the loss falls then flattens.
@quiet("tiny_gpt_linear_warmup_noisy_tokens")
def _q_gpt_warmup() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = _gen(24)
    return Program(model, opt, [_periodic_tokens(g, noise=0.15) for _ in range(200)], lm_loss,
                   scheduler=torch.optim.lr_scheduler.LambdaLR(opt, _warmup(60)))


# 4c's control (not a case): the same HF linear warm-up/decay schedule stepped once per optimizer step, as
# declared (``test_hf_schedule_control_stepped_per_step``).
def _hf_schedule_control() -> Program:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = _gen(25)
    return Program(model, opt, [_blobs(g) for _ in range(220)], ce_loss,
                   scheduler=torch.optim.lr_scheduler.LambdaLR(opt, hf_linear_schedule(50, 300)))


# 5e. A GAN on a 2-D ring of Gaussians (non-saturating loss, Adam(2e-4, betas=(0.5, 0.999)) for both nets, one
#     D step then one G step per iteration): the two losses oscillate around log 4 / log 2 levels. Run by its
#     own loop (two optimizers, two guards): ``gan_run``.
class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                                 nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def ring_batch(g: torch.Generator, n: int = 64) -> torch.Tensor:
    k = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    return torch.stack([2 * torch.cos(k), 2 * torch.sin(k)], 1) + 0.05 * torch.randn(n, 2, generator=g)


def gan_run(watch: bool, steps: int = 220) -> dict[str, Any]:
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    cfg = nantrace.Config(outputs={"print_incidents": False})
    guards = [nantrace.watch(D, opt_d, config=cfg), nantrace.watch(G, opt_g, config=cfg)] if watch else []
    g = _gen(26)
    d_losses, g_losses = [], []
    try:
        for _ in range(steps):
            real, z = ring_batch(g), torch.randn(64, 8, generator=g)
            fake = G(z)
            opt_d.zero_grad()
            d_loss = (F.binary_cross_entropy_with_logits(D(real), torch.ones(64, 1))
                      + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(64, 1)))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(64, 1))
            g_loss.backward()
            opt_g.step()
            d_losses.append(float(d_loss))
            g_losses.append(float(g_loss))
    finally:
        for guard in guards:
            guard.close()
    return dict(d=d_losses, g=g_losses, incidents=[i for guard in guards for i in guard.incidents])


# ======================================================================= the loops
def train_cfg(program: Program, *, replayable: bool, config: dict[str, Any] | None = None) -> Run:
    """heldout_harness.train with a case's config groups (the same loop, line for line)."""
    model, opt = program.model, program.optimizer
    groups = {k: dict(v) for k, v in (config or {}).items()}
    groups.setdefault("outputs", {})["print_incidents"] = False
    guard = nantrace.watch(model, opt, config=nantrace.Config(**groups))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            before, seen = snapshot(model), _blocking(guard.incidents)
            try:
                opt.zero_grad()
                run_step(program, loss_fn, batch, step)
                if program.between is not None:
                    program.between(model, opt, step)
                opt.step()
                if program.scheduler is not None:
                    program.scheduler.step()
            except Exception as exc:
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if _blocking(guard.incidents) > seen and unchanged is None:
                unchanged = same(before, snapshot(model))
    finally:
        guard.close()
    return Run(list(guard.incidents), error, error_step, unchanged)


def _bad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).all())


class FirstBad(TorchDispatchMode):
    """The oracle: the first op whose floating inputs were all finite and whose output was not, with the line
    of this file that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.origin: dict[str, Any] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        finite_in = not any(_bad(t) for t in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if self.origin is None and finite_in and any(_bad(t) for t in tree_leaves(out)):
            f, line = inspect.currentframe(), None
            while f is not None:
                if os.path.abspath(f.f_code.co_filename) == HERE and f.f_code.co_name != "__torch_dispatch__":
                    line = f.f_lineno
                    break
                f = f.f_back
            self.origin = dict(step=self.step, line=line,
                               op=f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}")
        return out


def plain_run(program: Program, stats: Callable[[Program, int, torch.Tensor], Any] | None = None,
              oracle: bool = False) -> dict[str, Any]:
    """Without nantrace, under the oracle: per step loss and gradient norm (before any clipping), the LR that
    ran, the first step whose loss or gradients are non-finite, and ``stats(program, step, loss)`` per step
    (called after backward, before the update). The oracle (slow) only where a non-finite value is expected."""
    model, opt = program.model, program.optimizer
    mode: Any = FirstBad() if oracle else contextlib.nullcontext()
    losses, norms, lrs, extra = [], [], [], []
    out: dict[str, Any] = dict(losses=losses, norms=norms, lrs=lrs, extra=extra, step=None)
    with mode:
        for step, batch in enumerate(program.batches):
            if oracle:
                mode.step = step
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            opt.zero_grad()
            loss = run_step(program, program.loss, batch, step)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            losses.append(float(loss.detach().sum()))
            norms.append(float(torch.stack([g.double().norm() for g in grads]).norm()))
            lrs.append(opt.param_groups[0]["lr"])
            if stats is not None:
                extra.append(stats(program, step, loss))
            if program.between is not None:
                program.between(model, opt, step)
            opt.step()
            if program.scheduler is not None:
                program.scheduler.step()
            if not (math.isfinite(losses[-1]) and math.isfinite(norms[-1])):
                out["step"] = step
                break
    out["origin"] = mode.origin if oracle else None
    return out


# ======================================================================= the documented rules
def _spike_step(series: list[float], ratio: float, mad_scale: float, warmup: int = 32, window: int = 128,
                sigma: float = 6.0) -> int | None:
    """docs/api.md's spike / explosion rule, written here: from ``warmup`` steps of history on, the first value
    whose log is more than ``sigma`` robust deviations (median / ``mad_scale`` x MAD of the logs of the last
    ``window`` values) above the median and more than ``ratio`` times the median value."""
    for s in range(warmup, len(series)):
        x = series[s]
        hist = np.log(np.asarray(series[max(0, s - window):s]))
        if not (math.isfinite(x) and x > 0) or not np.all(np.isfinite(hist)):
            return None
        med = float(np.median(hist))
        mad = mad_scale * float(np.median(np.abs(hist - med)))
        if x > ratio * math.exp(med) and (mad == 0 or (math.log(x) - med) / mad > sigma):
            return s
    return None


def _spike_range(series: list[float], ratio: float) -> tuple[int | None, int | None]:
    """The rule's step with the raw MAD (the earliest) and with the normal-consistent 1.4826 x MAD (the latest)."""
    return _spike_step(series, ratio, 1.0), _spike_step(series, ratio, 1.4826)


_PLAIN: dict[str, dict[str, Any]] = {}


def plain(name: str) -> dict[str, Any]:
    if name not in _PLAIN:
        build = CASES[name][0] if name in CASES else EARLY[name][0] if name in EARLY else QUIET[name]
        oracle = name in CASES and CASES[name][1].kind.startswith("nonfinite")
        _PLAIN[name] = plain_run(build(), stats=STATS.get(name), oracle=oracle)
    return _PLAIN[name]


# statistics the early-warning constructions are checked on (computed after backward, before the update)
def _layer_ratio_stats(program: Program, step: int, loss: torch.Tensor) -> Any:
    lr = program.optimizer.param_groups[0]["lr"]
    return {n: (lr, p.detach().norm().item()) for n, p in program.model.named_parameters()}


def _grad_zero_stats(program: Program, step: int, loss: torch.Tensor) -> Any:
    return {n: float(p.grad.abs().max()) for n, p in program.model.named_parameters() if p.grad is not None}


def _logit_stats(program: Program, step: int, loss: torch.Tensor) -> Any:
    with torch.no_grad():
        logits = program.model(program.batches[step][0])
        top = torch.softmax(logits, -1).max(-1).values
    return dict(rounds_to_one=float((top == 1.0).float().mean()), beyond_30=float((logits.abs() > 30).float().mean()))


STATS: dict[str, Callable[[Program, int, torch.Tensor], Any]] = {
    "highway_gate_bias_init_20_sigmoid_saturated_zero_gradient": _grad_zero_stats,
    "finetune_head_on_unnormalised_pretrained_features_saturated_logits": _logit_stats,
}


def _update_ratios(program: Program) -> list[dict[str, float]]:
    """Per-layer ||dW|| / ||W|| of each step, plain torch."""
    model, opt = program.model, program.optimizer
    out = []
    for step, batch in enumerate(program.batches):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        run_step(program, program.loss, batch, step)
        opt.step()
        layers: dict[str, list[float]] = {}
        for n, p in model.named_parameters():
            d, w = (p.detach() - before[n]).norm().item(), before[n].norm().item()
            layers.setdefault(n.rpartition(".")[0], [0.0, 0.0])
            layers[n.rpartition(".")[0]][0] += d * d
            layers[n.rpartition(".")[0]][1] += w * w
        out.append({k: math.sqrt(a / b) for k, (a, b) in layers.items()})
    return out


# ======================================================================= the tests
@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction. Spikes: the loss is steady up to the expected step and the spike rule first holds
    there (both MAD conventions), before any non-finite value. Explosions: the loss stays finite and within
    1.5x of its median while the gradient norm rule holds. Divergences: the divergence or spike rule holds
    before the first non-finite value. Non-finite ends: the oracle's first non-finite op, at the marked line,
    at the expected step."""
    _, want = CASES[name]
    run = plain(name)
    losses, norms = run["losses"], run["norms"]
    if want.kind == "loss_spike" and name not in DIVERGING:
        assert _spike_range(losses, 1.5) == (want.step, want.step), (_spike_range(losses, 1.5), losses)
        assert run["step"] is None or run["step"] > want.step, run["step"]
        assert _rule_step(losses[:want.step]) is None, losses
    elif want.kind == "grad_explosion" and name not in DIVERGING:
        assert _spike_range(norms, 5.0) == (want.step, want.step), (_spike_range(norms, 5.0), norms)
        assert _spike_range(losses, 1.5) == (None, None), losses
        assert run["step"] is None, run["step"]
    elif name in DIVERGING:
        lo, hi, end = _divergence_window(name)
        assert lo is not None and lo <= hi < end, (lo, hi, end, losses, norms)
        if want.kind == "grad_explosion":
            assert losses[hi] < losses[0], "the critic's loss falls while its gradients explode"
    else:
        origin = run["origin"]
        assert run["step"] == want.step and origin is not None, (run["step"], losses[-5:])
        assert (origin["step"], origin["op"], origin["line"]) == (want.step, want.op, JUDGE.marked(want.tag)[1]), origin
        if want.cause == "overflow":  # the end of a divergence: the documented rule held long before
            rule = _rule_step(losses)
            assert rule is not None and rule < want.step - 50, rule
        if want.cause == "exp_overflow":  # the divergence rule held on the gradient norm a few steps before
            rule = _rule_step(norms)
            assert rule is not None and rule < want.step and losses[rule] > losses[rule - 3], (rule, norms)


def _divergence_window(name: str) -> tuple[int | None, int, int]:
    """(earliest, latest, end): the earliest step a documented rule holds on the plain run (the divergence rule
    on the loss or the norm, the spike rule on either); the latest: for an explosion whose loss falls (the
    divergence rule on the norm does not count then) the spike rule's step on the norm with the
    normal-consistent MAD, else the step before the first non-finite value (the divergence detector's R^2 and
    noise conditions may delay it: round 6d); and the first non-finite step."""
    run = plain(name)
    losses, norms = run["losses"], run["norms"]
    end = run["step"] if run["step"] is not None else len(losses)
    want = CASES[name][1]
    pos = [v if v > 0 else float("nan") for v in losses]
    candidates = [r for r in (_rule_step(pos[:end]), _rule_step(norms[:end]), *_spike_range(pos[:end], 1.5),
                              *_spike_range(norms[:end], 5.0)) if r is not None]
    late = _spike_range(norms[:end], 5.0)[1] if want.kind == "grad_explosion" else None
    return (min(candidates) if candidates else None), (late if late is not None else end - 1), end


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n not in DIVERGING}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train_cfg(build(), replayable=mode == "replayable", config=CONFIGS.get(name))
    assert_diagnosis(run, want, JUDGE)
    if want.cause == "overflow":  # the logged divergence came first; the overflow says what made the values huge
        first = run.incidents[0]
        assert (first.kind, first.cause, first.action) in {SPIKE[::5] + ("logged",), GRAD[::5] + ("logged",)}, \
            [describe(i) for i in run.incidents]
        main = next(i for i in run.incidents if i.action != "logged")
        text = (main.summary + " " + main.fix).lower()
        assert "diverg" in text or "grew" in text, main.summary + " | " + main.fix


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n in DIVERGING}, XFAIL))
def test_heldout_divergence(name: str, mode: str) -> None:
    """The first blocking incident is the expected divergence/explosion, between the earliest step a
    documented rule holds and the latest, before the first non-finite value; the blocked update did not land."""
    build, want = CASES[name]
    lo, hi, end = _divergence_window(name)
    run = train_cfg(build(), replayable=mode == "replayable", config=CONFIGS.get(name))
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    fields = {k: v for k, v in got.items() if k != "step"}
    assert fields == {k: v for k, v in JUDGE.want(want).items() if k != "step"}, [describe(i) for i in run.incidents]
    assert lo is not None and lo <= got["step"] <= hi and got["step"] < end, (got["step"], lo, hi, end)
    assert run.error is None or isinstance(run.error, nantrace.NonFiniteError), repr(run.error)
    assert run.unchanged_at_incident is True


def test_early_warning_constructions() -> None:
    """Each early-warning program trains on (finite, no spike or divergence by the documented rules) and shows
    the statistic its warning is about."""
    for name in EARLY:
        run = plain(name)
        assert run["step"] is None, (name, run["step"])
        assert _rule_step(run["losses"]) is None and _spike_range(run["losses"], 1.5) == (None, None), name
        assert _spike_range(run["norms"], 5.0) == (None, None), name
    # 4a: some layer's ||dW|| / ||W|| > 0.1 on every step from 25 to 175 (every sample of update_stats_every)
    ratios = _update_ratios(EARLY["bn_mlp_linear_scaled_lr_update_ratio_too_large"][0]())
    assert all(max(r.values()) > 0.1 for r in ratios[25:176]), [max(r.values()) for r in ratios[25:176:25]]
    # 4b: the gate's gradients are exactly 0 on every step; every other layer's are not
    grads = plain("highway_gate_bias_init_20_sigmoid_saturated_zero_gradient")["extra"]
    assert all(s["gate.weight"] == 0.0 and s["gate.bias"] == 0.0 for s in grads)
    assert all(s["f.0.weight"] > 0 and s["head.weight"] > 0 for s in grads)
    # 4c: the LR that ran at step 1 is 0, the declared schedule's is 2e-5 (tolerance 1%)
    lrs = plain("hf_linear_schedule_stepped_per_epoch_declared_per_step")["lrs"]
    assert lrs[1] == 0.0 and lrs[10] == pytest.approx(1e-3 * 1 / 50), lrs[:12]
    # 4d: clipping at 1.0 fires on every step (the pre-clip norm is far above it)
    norms = plain("token_sum_loss_clipped_at_hf_default_every_step")["norms"]
    assert min(norms) > 10.0, min(norms)
    # 4e: >= 90% of rows with a largest probability that rounds to 1, or of logits beyond +-30, at steps 50..200
    sat = plain("finetune_head_on_unnormalised_pretrained_features_saturated_logits")["extra"]
    assert all(s["rounds_to_one"] >= 0.9 or s["beyond_30"] >= 0.9 for s in sat[50::50]), sat[::50]


@pytest.mark.parametrize("name,mode", case_params({n: None for n in EARLY}, XFAIL))
def test_early_warnings(name: str, mode: str) -> None:
    """The first incident is the early warning, logged (the update applied), in its documented window, and
    nothing is blocked: training goes on to the end."""
    build, (kind, cause, lo, hi) = EARLY[name]
    run = train_cfg(build(), replayable=mode == "replayable", config=CONFIGS.get(name))
    assert run.incidents, "no incident"
    first = run.incidents[0]
    assert (first.kind, first.cause, first.action) == (kind, cause, "logged") and lo <= first.step <= hi, \
        [describe(i) + " | " + i.summary for i in run.incidents]
    assert not [i for i in run.incidents if i.action != "logged"], [describe(i) for i in run.incidents]
    assert run.error is None, repr(run.error)


SHAPE = ["hf_linear_schedule_stepped_per_epoch_declared_per_step"]
"""Early-warning cases whose summary must say how the LR that ran differs from the declared schedule."""


@pytest.mark.parametrize("name", SHAPE)
def test_lr_schedule_warning_says_its_shape(name: str) -> None:
    """4c: the warning says how the LR that ran differs (stepped less often / a longer warm-up), as documented."""
    run = train_cfg(EARLY[name][0](), replayable=False, config=CONFIGS.get(name))
    text = run.incidents[0].summary.lower()
    assert any(k in text for k in ("less often", "per epoch", "warmup lasts", "every 10")), run.incidents[0].summary


def test_quiet_constructions() -> None:
    """The quiet programs stay finite and no documented rule (spike, explosion, divergence) holds on them."""
    for name in QUIET:
        run = plain(name)
        assert run["step"] is None, (name, run["step"])
        assert _rule_step(run["losses"]) is None and _spike_range(run["losses"], 1.5) == (None, None), name
        assert _rule_step(run["norms"]) is None or run["losses"][-1] < run["losses"][0], name
        assert _spike_range(run["norms"], 5.0) == (None, None), name
    cur = plain("curriculum_harder_data_at_step_100_loss_rises_once")["losses"]
    jump = np.median(cur[100:120]) / np.median(cur[80:100])
    assert 1.1 < jump < 1.5, jump
    gan = gan_run(watch=False)
    for series in (gan["d"], gan["g"]):
        assert all(math.isfinite(v) for v in series)
        assert _rule_step(series) is None and _spike_range(series, 1.5) == (None, None)


@pytest.mark.parametrize("mode", MODES)
def test_hf_schedule_control_stepped_per_step(mode: str) -> None:
    """4c's control: the declared schedule, stepped per step, trains with no incident (no lr_schedule warning)."""
    program = _hf_schedule_control()
    lrs = plain_run(_hf_schedule_control())["lrs"]
    assert lrs[1] == pytest.approx(1e-3 / 50) and lrs[100] == pytest.approx(1e-3 * 200 / 250), (lrs[1], lrs[100])
    run = train_cfg(program, replayable=mode == "replayable", config={"dynamics": {"lr_schedule": HF_SCHEDULE}})
    assert not run.incidents, [describe(i) + " | " + i.summary for i in run.incidents]


@pytest.mark.parametrize("name,mode", case_params(QUIET, XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident at all (no blocking one, no early warning), and the program trains to its end."""
    run = train_cfg(QUIET[name](), replayable=mode == "replayable", config=CONFIGS.get(name))
    assert not run.incidents, [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.error is None, repr(run.error)


def test_quiet_gan_two_guards() -> None:
    """5e, zero-intrusive only (its loop has two loss computations and no loss callable to wrap): no incident
    from either guard."""
    incidents = gan_run(watch=True)["incidents"]
    assert not incidents, [describe(i) + " | " + i.summary for i in incidents]
