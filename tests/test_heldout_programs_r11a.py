"""Held-out failures, round 11a: LONG AND STATEFUL STEP CODE, shaped like public training scripts.

Covered: loss code that is a dynamic program or a loop (a BiLSTM-CRF's gold-path score and forward
algorithm, a beam search inside a minimum-risk-training loss, a GRU decoder unrolled by hand in the
loss code, a Dreamer-style imagination rollout with lambda-returns, DDIM sampler steps unrolled inside
a denoising loss, GAE and n-step returns written as Python loops, an IMU pose integration loop with
Rodrigues' formula); code BEFORE the model's forward that fails or raises (a reward normaliser switched
on after a warm-up, an n-step index past the replay buffer's end, MLM span masking drawn with
``torch.multinomial``, a Gaussian-blur augmentation whose sigma is annealed to zero); loops that SKIP
(``if not torch.isfinite(loss): continue``) or CATCH (``try/except``) a bad batch and train on; gradient
accumulation where one micro-batch is bad; and three QUIET programs whose long loss code carries
infinities on purpose (a CRF with ``-inf`` transition constraints under ``logsumexp``, soft-DTW with
``+inf`` borders, V-trace's clipped importance weights of an action the behaviour policy never takes):
they must stay silent and train bit-identically to the plain program.

How expectations were derived: each ``Want`` was written from the construction before nantrace ran,
from shared/API.md's fields and cause table and docs/diagnosis.md's rules (the origin is the op that
made the first non-finite value from finite inputs, a ``-inf`` fill or constant being intentional; a
backward origin is the forward op whose derivative made the first non-finite gradient; an advanced
index outside its dimension is ``label_out_of_range``; a model input made non-finite by the step's own
code is kind ``nonfinite_input`` traced into that code, as in tests/test_prelude_inputs.py).
``test_cases_fail_without_nantrace`` checks every construction with plain torch and an oracle written
here (``FirstBad``, a TorchDispatchMode naming the first op that made a non-finite value from finite
inputs and this file's innermost line that issued it; ``node_oracle``, hooks on every autograd node
naming the first node whose output gradient is non-finite while its input gradient is finite).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import Judge, Program, assert_diagnosis, case_params, describe, run_step, same, sgd, snapshot, train
from origin_markers import origin_line
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3
STEPS = 5

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
RAISES: dict[str, type[BaseException]] = {}
"""name -> the exception type the plain program raises at FAIL_STEP."""
CONTINUE: dict[str, str] = {}
"""name -> how the loop trains on past the bad batch: ``skip_nonfinite`` or ``catch``."""
QUIET: dict[str, Callable[[], Program]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
QUIET_XFAIL: dict[str, str] = {}


def case(name: str, want: Want, raises: type[BaseException] | None = None, go_on: str | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if raises is not None:
            RAISES[name] = raises
        if go_on is not None:
            CONTINUE[name] = go_on
        return build

    return register


def quiet(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        return build

    return register


def raised(*args: Any) -> Want:
    return Want("exception", *args, action="raised")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ========================================================== 1. BiLSTM-CRF: dynamic programs in the loss
K_TAGS = 5  # O, B-PER, I-PER, B-LOC, I-LOC


class BiLSTMTagger(nn.Module):
    def __init__(self, vocab: int = 60) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True, bidirectional=True)
        self.hidden2tag = nn.Linear(32, K_TAGS)
        self.transitions = nn.Parameter(0.1 * torch.randn(K_TAGS, K_TAGS))
        self.start = nn.Parameter(torch.zeros(K_TAGS))
        self.end = nn.Parameter(torch.zeros(K_TAGS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hidden2tag(self.lstm(self.emb(tokens))[0])


def _sentences(g: torch.Generator, batch: int, length: int, pad_from: int | None = None) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(1, 60, (batch, length), generator=g)
    tags = torch.randint(0, K_TAGS, (batch, length), generator=g)
    mask = torch.ones(batch, length)
    if pad_from is not None:  # the collator pads the shortest sentence; HF-style labels mark padding with -100
        tokens[-1, pad_from:], tags[-1, pad_from:], mask[-1, pad_from:] = 0, -100, 0.0
    return tokens, tags, mask


# 1a. A CRF ported from a tutorial into an HF token-classification script: the data collator pads labels
#     with -100 (the ignore index of cross_entropy), and the CRF's gold-path score indexes the transition
#     matrix with them. Every earlier batch had sentences of one length; at FAIL_STEP one is padded.
def crf_gold_then_partition(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, tags, mask = batch
    em = model(tokens)
    B, T, _ = em.shape
    score = model.start[tags[:, 0]] + em[:, 0].gather(1, tags[:, :1]).squeeze(1)
    for t in range(1, T):
        trans = model.transitions[tags[:, t - 1], tags[:, t]]  # <origin:crf_gold_index>
        emit = em[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
        score = score + (trans + emit) * mask[:, t]
    alpha = model.start + em[:, 0]
    for t in range(1, T):
        nxt = torch.logsumexp(alpha[:, :, None] + model.transitions + em[:, t, None, :], dim=1)
        alpha = torch.where(mask[:, t, None] > 0, nxt, alpha)
    log_z = torch.logsumexp(alpha + model.end, dim=1)
    return (log_z - score).mean()


@case("bilstm_crf_gold_path_score_hf_padding_label_minus_100_indexes_transitions",
      raised("forward", "aten.index.Tensor", None, "crf_gold_index", "label_out_of_range"), raises=IndexError)
def _crf_index() -> Program:
    torch.manual_seed(0)
    model = BiLSTMTagger()
    g = _gen(1101)
    batches = [_sentences(g, 6, 10, pad_from=6 if s == FAIL_STEP else None) for s in range(STEPS)]
    return Program(model, sgd(model, 0.05), batches, crf_gold_then_partition)


# 1b. The same tagger with the textbook forward algorithm written without the log-sum-exp trick
#     (log(sum(exp(.)))): alpha grows by about log(K) + the emission per token, and exp overflows float32
#     once alpha passes ~88. Batches are bucketed by length; the bucket at FAIL_STEP holds 90-token
#     sentences (a document split on missing full stops), the others 10-token ones. Written first as
#     exp_overflow in aten.exp; the oracle showed that the sum over the K predecessors overflows first (each
#     exp(score) is still below 3.4e38 when their sum is not, score ~ 88.7 - log K): by the contract that
#     is aten.sum with cause ``overflow`` (finite inputs, a result beyond float32 in an op that is not an
#     exponent), and the origin line is the same.
def crf_naive_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, tags, mask = batch
    em = model(tokens)
    B, T, _ = em.shape
    score = model.start[tags[:, 0]] + em[:, 0].gather(1, tags[:, :1]).squeeze(1)
    for t in range(1, T):
        score = score + model.transitions[tags[:, t - 1], tags[:, t]] + em[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
    alpha = model.start + em[:, 0]
    for t in range(1, T):
        scores = alpha[:, :, None] + model.transitions + em[:, t, None, :]
        alpha = torch.log(torch.exp(scores).sum(1))  # <origin:crf_naive_exp>
    log_z = torch.log(torch.exp(alpha + model.end).sum(1))
    return (log_z - score).mean()


def _crf_naive_program() -> Program:
    torch.manual_seed(0)
    model = BiLSTMTagger()
    g = _gen(1102)
    batches = [_sentences(g, 4, 90 if s == FAIL_STEP else 10) for s in range(STEPS)]
    return Program(model, sgd(model, 0.05), batches, crf_naive_nll)


@case("bilstm_crf_forward_algorithm_without_logsumexp_long_sentence_bucket",
      Want("nonfinite_loss", "forward", "aten.sum.dim_IntList", None, "crf_naive_exp", "overflow"))
def _crf_naive() -> Program:
    return _crf_naive_program()


# 1c. The same script with Lightning-style "skip a non-finite loss" in the loop (no backward, no step).
@case("bilstm_crf_forward_algorithm_without_logsumexp_loop_skips_nonfinite_loss",
      Want("nonfinite_loss", "forward", "aten.sum.dim_IntList", None, "crf_naive_exp", "overflow"),
      go_on="skip_nonfinite")
def _crf_naive_skipped() -> Program:
    return _crf_naive_program()


# ========================================================= 2. RL: returns computed with Python loops
class ActorCritic(nn.Module):
    def __init__(self, obs: int = 6, actions: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, 32), nn.Tanh())
        self.pi = nn.Linear(32, actions)
        self.v = nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


class RewardNormaliser:
    """Running variance of the rewards seen so far (Welford, SB3's RunningMeanStd without its epsilon);
    applied only once enough rollouts were seen."""

    def __init__(self, warmup: int) -> None:
        self.count, self.mean, self.var, self.warmup = 0, torch.zeros(()), torch.zeros(()), warmup

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        delta = x.mean() - self.mean
        total = self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + x.var(unbiased=False) * n + delta ** 2 * self.count * n / total) / total
        self.count = total


# 2a. PPO on a sparse-reward task: the reward normaliser is switched on after three rollouts, and no
#     reward has been seen yet at FAIL_STEP (var = 0): rewards / std = 0 / 0. GAE in a Python loop over
#     the rollout, critic values from a no-grad forward before the policy's forward. Cause: the divisor is
#     the std of every reward seen (all 0), made in this step from x.var() of a constant batch and the
#     running state: docs/diagnosis.md's provenance rule makes a std of a constant slice zero_variance_norm.
def ppo_gae_loss(model: nn.Module, batch: Any, step: int, norm: RewardNormaliser = None) -> torch.Tensor:
    obs, actions, rewards, dones, old_logp = batch
    with torch.no_grad():
        _, values = model(obs)
    norm.update(rewards)
    if norm.count >= norm.warmup:
        rewards = rewards / norm.var.sqrt()  # <origin:ppo_reward_norm>
    gamma, lam = 0.99, 0.95
    adv, last = [], torch.zeros(())
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * values[t + 1] * (1 - dones[t]) - values[t]
        last = delta + gamma * lam * (1 - dones[t]) * last
        adv.insert(0, last)
    adv = torch.stack(adv)
    returns = adv + values[:-1]
    logits, v = model(obs[:-1])
    logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    return pg + 0.5 * F.mse_loss(v, returns)


@case("ppo_gae_python_loop_reward_normaliser_switched_on_before_first_reward",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "ppo_reward_norm", "zero_variance_norm"))
def _ppo_gae() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(1103)
    norm = RewardNormaliser(warmup=(FAIL_STEP + 1) * 16)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        rewards = torch.zeros(16)
        if step > FAIL_STEP:
            rewards[7] = 1.0  # the first goal reached
        return (torch.randn(17, 6, generator=g), torch.randint(0, 3, (16,), generator=g), rewards,
                (torch.rand(16, generator=g) < 0.1).float(), torch.full((16,), -math.log(3.0)))

    return Program(model, sgd(model, 0.01), [batch(s) for s in range(STEPS)],
                   lambda m, b, s: ppo_gae_loss(m, b, s, norm))


# 2b. DQN with n-step returns read from a circular replay buffer: the sampler draws start indices up to
#     len - 1, and the n-step loop reads idx + k without wrapping. At FAIL_STEP a start index within
#     N_STEP of the end is drawn: buffer.rewards[idx + 2] is out of range before any forward runs.
N_STEP, BUF = 3, 64


class QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def dqn_nstep_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    buf, idx = batch
    ret, disc = torch.zeros(len(idx)), 1.0
    alive = torch.ones(len(idx))
    for k in range(N_STEP):
        ret = ret + disc * alive * buf["rewards"][idx + k]  # <origin:nstep_index>
        alive = alive * (1 - buf["dones"][idx + k])
        disc *= 0.99
    with torch.no_grad():
        bootstrap = model(buf["obs"][(idx + N_STEP) % BUF]).max(1).values
    target = ret + disc * alive * bootstrap
    q = model(buf["obs"][idx]).gather(1, buf["actions"][idx][:, None]).squeeze(1)
    return F.smooth_l1_loss(q, target)


def _dqn_program() -> Program:
    torch.manual_seed(0)
    model = QNet()
    g = _gen(1104)
    buf = dict(obs=torch.randn(BUF, 8, generator=g), actions=torch.randint(0, 4, (BUF,), generator=g),
               rewards=torch.randn(BUF, generator=g), dones=(torch.rand(BUF, generator=g) < 0.05).float())

    def batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        idx = torch.randint(0, BUF - N_STEP, (16,), generator=g)
        if step == FAIL_STEP:
            idx[5] = BUF - 2
        return buf, idx

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), [batch(s) for s in range(STEPS)], dqn_nstep_loss)


@case("dqn_nstep_returns_loop_index_past_replay_buffer_end",
      raised("forward", "aten.index.Tensor", None, "nstep_index", "label_out_of_range"), raises=IndexError)
def _dqn() -> Program:
    return _dqn_program()


@case("dqn_nstep_returns_loop_index_past_replay_buffer_end_caught_and_skipped",
      raised("forward", "aten.index.Tensor", None, "nstep_index", "label_out_of_range"), raises=IndexError,
      go_on="catch")
def _dqn_caught() -> Program:
    return _dqn_program()


# 2c. A Dreamer-style agent: the world model observes the sequence (posterior states), the actor imagines
#     H steps from them through the GRU and the prior, rewards are predicted in symlog space and decoded
#     with symexp, and lambda-returns are computed backwards in a Python loop. At FAIL_STEP the batch comes
#     from a replay shard recorded with the camera's raw 12-bit values (0..4095, not divided by 4095): the
#     posterior latents are in the thousands and symexp's exp overflows on the first imagined reward.
class WorldModel(nn.Module):
    def __init__(self, obs: int = 16, act: int = 2, deter: int = 24, stoch: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(obs, 32), nn.ReLU())
        self.cell = nn.GRUCell(stoch + act, deter)
        self.post = nn.Linear(deter + 32, 2 * stoch)
        self.prior = nn.Linear(deter, 2 * stoch)
        self.decoder = nn.Linear(deter + stoch, obs)
        self.reward = nn.Linear(deter + stoch, 1)
        self.actor = nn.Linear(deter + stoch, act)
        self.critic = nn.Linear(deter + stoch, 1)
        self.deter, self.stoch = deter, stoch

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = obs.shape
        h, z = obs.new_zeros(B, self.deter), obs.new_zeros(B, self.stoch)
        embed = self.encoder(obs)
        hs, zs, kls = [], [], []
        for t in range(T):
            h = self.cell(torch.cat([z, actions[:, t]], -1), h)
            pm, ps = self.post(torch.cat([h, embed[:, t]], -1)).chunk(2, -1)
            qm, qs = self.prior(h).chunk(2, -1)
            ps, qs = F.softplus(ps) + 0.1, F.softplus(qs) + 0.1
            z = pm + ps * torch.randn_like(ps)
            kls.append((torch.log(qs / ps) + (ps ** 2 + (pm - qm) ** 2) / (2 * qs ** 2) - 0.5).sum(-1))
            hs.append(h)
            zs.append(z)
        return torch.stack(hs, 1), torch.stack(zs, 1), torch.stack(kls, 1)


def symexp(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * (torch.exp(torch.abs(x)) - 1)  # <origin:dreamer_symexp>


def dreamer_loss(model: WorldModel, batch: Any, step: int, horizon: int = 5) -> torch.Tensor:
    obs, actions, rewards = batch
    hs, zs, kl = model(obs, actions)
    feat = torch.cat([hs, zs], -1)
    wm_loss = F.mse_loss(model.decoder(feat), obs) + kl.clamp(min=1.0).mean()
    wm_loss = wm_loss + F.mse_loss(model.reward(feat).squeeze(-1), torch.sign(rewards) * torch.log1p(rewards.abs()))
    h, z = hs.reshape(-1, model.deter).detach(), zs.reshape(-1, model.stoch).detach()
    imagined_r, values = [], []
    for _ in range(horizon):  # imagination: actor -> GRU -> prior sample
        f = torch.cat([h, z], -1)
        imagined_r.append(symexp(model.reward(f).squeeze(-1)))
        values.append(model.critic(f).squeeze(-1))
        a = torch.tanh(model.actor(f))
        h = model.cell(torch.cat([z, a], -1), h)
        qm, qs = model.prior(h).chunk(2, -1)
        z = qm + (F.softplus(qs) + 0.1) * torch.randn_like(qm)
    last = model.critic(torch.cat([h, z], -1)).squeeze(-1)
    returns, lam, gamma = [], 0.95, 0.99
    for t in reversed(range(horizon)):
        nxt = values[t + 1] if t + 1 < horizon else last
        last = imagined_r[t] + gamma * ((1 - lam) * nxt + lam * last)
        returns.insert(0, last)
    returns = torch.stack(returns)
    actor_loss = -returns.mean()
    critic_loss = F.mse_loss(torch.stack(values), returns.detach())
    return wm_loss + actor_loss + critic_loss


@case("dreamer_imagination_symexp_reward_replay_shard_in_raw_12_bit_values",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "dreamer_symexp", "exp_overflow"))
def _dreamer() -> Program:
    torch.manual_seed(0)
    model = WorldModel()
    g = _gen(1105)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        frames = torch.randint(0, 4096, (4, 6, 16), generator=g).float()
        obs = frames if step == FAIL_STEP else frames / 4095.0
        return obs, torch.rand(4, 6, 2, generator=g) * 2 - 1, torch.randn(4, 6, generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), lr=3e-4), [batch(s) for s in range(STEPS)], dreamer_loss)


# ======================================================= 3. sampler steps and decoders inside the loss
# 3a. An unrolled denoising loss (three DDIM steps from t, then an x0 loss) on a noise schedule rescaled to
#     zero terminal SNR ("Common Diffusion Noise Schedules are Flawed"): alphas_cumprod[T-1] is exactly 0,
#     and the epsilon-parameterised x0 estimate divides by its square root. At FAIL_STEP the curriculum
#     starts at the last timestep; x0_pred is inf and feeds the model's next call.
T_DIFF, STRIDE = 50, 5


def _zero_terminal_snr() -> torch.Tensor:
    betas = torch.linspace(1e-4, 0.02, T_DIFF, dtype=torch.float64)
    root = torch.cumprod(1 - betas, 0).sqrt()
    root = (root - root[-1]) * root[0] / (root[0] - root[-1])
    return (root ** 2).float()


AB = _zero_terminal_snr()


class EpsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 64), nn.SiLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        return self.net(torch.cat([x, x.new_full((len(x), 1), t / T_DIFF)], -1))


def unrolled_ddim_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, noise, t = batch
    x = AB[t].sqrt() * x0 + (1 - AB[t]).sqrt() * noise
    for k in range(3):
        tk, tprev = t - k * STRIDE, t - (k + 1) * STRIDE
        eps = model(x, tk)
        x0_pred = (x - (1 - AB[tk]).sqrt() * eps) / AB[tk].sqrt()  # <origin:ddim_x0>
        x = AB[tprev].sqrt() * x0_pred + (1 - AB[tprev]).sqrt() * eps
    return F.mse_loss(x0_pred, x0)


@case("unrolled_ddim_steps_in_loss_zero_terminal_snr_schedule_last_timestep",
      Want("nonfinite_input", "forward", "aten.div.Tensor", None, "ddim_x0", "div_by_zero"))
def _ddim() -> Program:
    torch.manual_seed(0)
    model = EpsNet()
    g = _gen(1106)
    starts = [40, 25, 33, T_DIFF - 1, 30]
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g), starts[s]) for s in range(STEPS)]
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, unrolled_ddim_loss)


# 3b. Minimum risk training: a beam search (no-grad forwards, no-repeat blocking by -inf) produces
#     hypotheses, their risk is weighted by softmax(beam score / length). The decode length is the batch's
#     target length; at FAIL_STEP it is 5 over a 4-token vocabulary, so at the last step every token of
#     every beam is blocked: all beam scores are -inf and the weights' softmax is over a fully masked row.
V_TOK, BEAM = 4, 2


class NextToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.src = nn.Linear(6, 16)
        self.emb = nn.Embedding(V_TOK + 1, 16)  # + BOS
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, V_TOK)

    def forward(self, src: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.src(src))[None]
        return self.out(self.gru(self.emb(prefix), h0)[0])


def mrt_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    src, tgt = batch
    B, L = tgt.shape
    bos = torch.full((B * BEAM, 1), V_TOK)
    src_k = src.repeat_interleave(BEAM, 0)
    hyps = bos
    scores = torch.zeros(B, BEAM)
    scores[:, 1:] = float("-inf")  # only the first beam is live at the start
    with torch.no_grad():
        for _ in range(L):
            logp = torch.log_softmax(model(src_k, hyps)[:, -1], -1)
            used = F.one_hot(hyps[:, 1:], V_TOK).sum(1).bool()
            logp = logp.masked_fill(used, float("-inf"))  # no repeated token
            cand = (scores.reshape(-1, 1) + logp).reshape(B, BEAM * V_TOK)
            scores, flat = cand.topk(BEAM, -1)
            beam, tok = flat // V_TOK, flat % V_TOK
            rows = (torch.arange(B)[:, None] * BEAM + beam).reshape(-1)
            hyps = torch.cat([hyps[rows], tok.reshape(-1, 1)], 1)
    weights = torch.softmax(scores / L, -1)  # <origin:mrt_softmax>
    logits = model(src_k, hyps[:, :-1])
    nll = F.cross_entropy(logits.reshape(-1, V_TOK), hyps[:, 1:].reshape(-1), reduction="none").reshape(B, BEAM, L)
    cost = (hyps[:, 1:].reshape(B, BEAM, L) != tgt[:, None]).float().mean(-1)
    mle = F.cross_entropy(model(src, torch.cat([bos[:B], tgt[:, :-1]], 1)).reshape(-1, V_TOK), tgt.reshape(-1))
    return mle + (weights * cost * nll.mean(-1)).sum(1).mean()


@case("mrt_beam_search_no_repeat_blocking_decode_longer_than_vocabulary",
      Want("nonfinite_loss", "forward", "aten._softmax.default", None, "mrt_softmax", "masked_softmax_all"))
def _mrt() -> Program:
    torch.manual_seed(0)
    model = NextToken()
    g = _gen(1107)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = 5 if step == FAIL_STEP else 3
        return torch.randn(4, 6, generator=g), torch.stack([torch.randperm(V_TOK, generator=g)[:min(length, V_TOK)]
                                                            .repeat(2)[:length] for _ in range(4)])

    return Program(model, sgd(model, 0.05), [batch(s) for s in range(STEPS)], mrt_loss)


# 3c. Trajectory forecasting: the encoder summarises the past, the decoder is a GRU written by hand in the
#     loss code (the model's GRUCell weights, gates spelled out), and the ADE is sqrt of the squared error
#     per step, with padded future steps masked by zeroing both prediction and target. Gradient
#     accumulation over four scenes; at FAIL_STEP the second scene has an agent that leaves the map after
#     4 of 8 future steps: sqrt(0) at its padded steps, finite forward, NaN gradient.
class TrajectoryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.GRU(2, 32, batch_first=True)
        self.dec = nn.GRUCell(2, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, past: torch.Tensor) -> torch.Tensor:
        return self.encoder(past)[1][0]


def unrolled_decoder_ade(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    past, future, valid = batch
    h = model(past)
    w_ih, w_hh, b_ih, b_hh = model.dec.weight_ih, model.dec.weight_hh, model.dec.bias_ih, model.dec.bias_hh
    pos, total = past[:, -1], 0.0
    for t in range(future.shape[1]):
        gi, gh = F.linear(pos, w_ih, b_ih), F.linear(h, w_hh, b_hh)
        r = torch.sigmoid(gi[:, :32] + gh[:, :32])
        z = torch.sigmoid(gi[:, 32:64] + gh[:, 32:64])
        n = torch.tanh(gi[:, 64:] + r * gh[:, 64:])
        h = (1 - z) * n + z * h
        pos = pos + model.head(h)
        m = valid[:, t, None]
        err = torch.sqrt(((pos * m - future[:, t] * m) ** 2).sum(-1))  # <origin:ade_sqrt>
        total = total + err.sum()
    return total / valid.sum()


@case("trajectory_hand_unrolled_gru_decoder_accumulation_agent_leaves_map_sqrt",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "ade_sqrt", "grad_singularity"))
def _trajectory() -> Program:
    torch.manual_seed(0)
    model = TrajectoryModel()
    g = _gen(1108)

    def scene(bad: bool) -> tuple[torch.Tensor, ...]:
        past = torch.cumsum(0.1 * torch.randn(6, 5, 2, generator=g), 1)
        future = past[:, -1:] + torch.cumsum(0.1 * torch.randn(6, 8, 2, generator=g), 1)
        valid = torch.ones(6, 8)
        if bad:
            future[2, 4:], valid[2, 4:] = 0.0, 0.0
        return past, future, valid

    batches = [[scene(s == FAIL_STEP and i == 1) for i in range(4)] for s in range(STEPS)]
    return Program(model, sgd(model, 0.02), batches, unrolled_decoder_ade, accum=True)


# 3d. Visual-inertial odometry: a bias-free network turns IMU windows into angular-velocity corrections, and
#     the loss integrates the orientation over the window with Rodrigues' formula, axis = w / |w|. A clip
#     recorded while the rig stood still (all IMU readings 0) gives w exactly 0 at FAIL_STEP: 0 / 0. Written
#     first as div_by_zero; corrected to zero_variance_norm by docs/diagnosis.md's provenance rule (a divisor
#     that is a norm of a constant, here all-zero, slice), as r7's hand-normalised embedding case.
class ImuNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32, bias=False), nn.Tanh(), nn.Linear(32, 3, bias=False))

    def forward(self, imu: torch.Tensor) -> torch.Tensor:
        return self.net(imu)


def _skew(k: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros_like(k[:, 0])
    return torch.stack([torch.stack([zero, -k[:, 2], k[:, 1]], -1), torch.stack([k[:, 2], zero, -k[:, 0]], -1),
                        torch.stack([-k[:, 1], k[:, 0], zero], -1)], 1)


def rotation_rollout_loss(model: nn.Module, batch: Any, step: int, dt: float = 0.01) -> torch.Tensor:
    imu, r_gt = batch
    omega = model(imu)
    B, T, _ = omega.shape
    R = torch.eye(3).expand(B, 3, 3)
    for t in range(T):
        w = omega[:, t] * dt
        theta = w.norm(dim=-1, keepdim=True)
        k = w / theta  # <origin:rodrigues_axis>
        K = _skew(k)
        s, c = torch.sin(theta)[..., None], torch.cos(theta)[..., None]
        R = R @ (torch.eye(3) + s * K + (1 - c) * (K @ K))
    return ((R - r_gt) ** 2).sum((1, 2)).mean()


@case("imu_rotation_rollout_rodrigues_axis_stationary_clip",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "rodrigues_axis", "zero_variance_norm"))
def _imu() -> Program:
    torch.manual_seed(0)
    model = ImuNet()
    g = _gen(1109)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        imu = torch.randn(4, 10, 6, generator=g)
        if step == FAIL_STEP:
            imu[1] = 0.0  # the rig stood still
        return imu, torch.eye(3).expand(4, 3, 3).clone()

    return Program(model, sgd(model, 0.01), [batch(s) for s in range(STEPS)], rotation_rollout_loss)


# ====================================================== 4. code before the model's forward
# 4a. BERT-style MLM with masked positions drawn by torch.multinomial over the attention mask (so padding
#     is never masked). A document emptied by the cleaning filter has an all-zero attention mask at
#     FAIL_STEP: multinomial raises on a distribution that sums to 0, before the forward.
class TinyMLM(nn.Module):
    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.mix = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.lm_head = nn.Linear(32, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mix(self.emb(ids)))


MASK_ID = 1


def mlm_loss(model: nn.Module, batch: Any, step: int, g: torch.Generator = None) -> torch.Tensor:
    ids, attn = batch
    n_mask = max(1, int(0.15 * ids.shape[1]))
    positions = torch.multinomial(attn.float(), n_mask, generator=g)  # <origin:mlm_multinomial>
    masked = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, positions, True)
    inputs = ids.masked_fill(masked, MASK_ID)
    labels = ids.masked_fill(~masked, -100)
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


@case("mlm_masked_positions_multinomial_over_attention_mask_empty_document",
      raised("forward", "aten.multinomial.default", None, "mlm_multinomial", "domain_error"), raises=RuntimeError)
def _mlm() -> Program:
    torch.manual_seed(0)
    model = TinyMLM()
    g = _gen(1110)
    mask_gen = _gen(11100)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(2, 40, (6, 20), generator=g)
        attn = torch.ones(6, 20, dtype=torch.long)
        attn[:, 15:] = 0
        if step == FAIL_STEP:
            ids[4], attn[4] = 0, 0  # every sentence of the document was dropped by the filter
        return ids, attn

    return Program(model, sgd(model, 0.05), [batch(s) for s in range(STEPS)], lambda m, b, s: mlm_loss(m, b, s, mask_gen))


# 4b. SimCLR with a hand-written Gaussian-blur augmentation whose strength is annealed by a curriculum
#     sigma = 2 (1 - step / 3): at FAIL_STEP sigma is 0 and the kernel exponent -r^2 / (2 sigma^2) is
#     0 / 0 at the centre tap, -inf elsewhere. The blurred view is the model's input.
class SmallEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.proj = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.conv(x))


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    r = torch.arange(-2, 3, dtype=x.dtype)
    k1 = torch.exp(-r ** 2 / (2 * sigma ** 2))  # <origin:blur_div>
    k1 = k1 / k1.sum()
    k2 = (k1[:, None] * k1[None, :]).expand(x.shape[1], 1, 5, 5)
    return F.conv2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), k2, groups=x.shape[1])


def simclr_loss(model: nn.Module, batch: Any, step: int, tau: float = 0.5) -> torch.Tensor:
    x = batch
    sigma = torch.tensor(2.0 * (1 - step / FAIL_STEP))
    v1, v2 = gaussian_blur(x, sigma), torch.flip(x, dims=(3,))
    z = F.normalize(torch.cat([model(v1), model(v2)]), dim=1)
    sim = z @ z.t() / tau
    sim = sim.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
    n = len(x)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, targets)


@case("simclr_hand_written_blur_sigma_annealed_to_zero_before_forward",
      Want("nonfinite_input", "forward", "aten.div.Tensor", None, "blur_div", "div_by_zero"))
def _simclr() -> Program:
    torch.manual_seed(0)
    model = SmallEncoder()
    g = _gen(1111)
    return Program(model, sgd(model, 0.05), [torch.rand(6, 3, 12, 12, generator=g) for _ in range(STEPS)], simclr_loss)


# ============================================================================ 5. quiet programs
# 5a. The CRF of 1a done right: BIO constraints as -inf transitions (I-X only after B-X or I-X, never at the
#     start) under torch.logsumexp. alpha holds -inf for I-tags at t = 0 and for forbidden paths; the
#     partition, the loss and every gradient are finite.
def crf_constrained_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, tags, mask = batch
    em = model(tokens)
    B, T, _ = em.shape
    allowed = torch.ones(K_TAGS, K_TAGS, dtype=torch.bool)
    allowed[:, 2], allowed[:, 4] = False, False
    allowed[1, 2] = allowed[2, 2] = allowed[3, 4] = allowed[4, 4] = True
    trans = model.transitions.masked_fill(~allowed, float("-inf"))
    start = model.start.masked_fill(torch.tensor([False, False, True, False, True]), float("-inf"))
    score = start[tags[:, 0]] + em[:, 0].gather(1, tags[:, :1]).squeeze(1)
    for t in range(1, T):
        score = score + trans[tags[:, t - 1], tags[:, t]] + em[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
    alpha = start + em[:, 0]
    for t in range(1, T):
        alpha = torch.logsumexp(alpha[:, :, None] + trans + em[:, t, None, :], dim=1)
    return (torch.logsumexp(alpha + model.end, 1) - score).mean()


def _valid_bio(g: torch.Generator, batch: int, length: int) -> torch.Tensor:
    tags = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        for t in range(length):
            prev = int(tags[b, t - 1]) if t else 0
            choices = [0, 1, 3] + ([prev + 1] if prev in (1, 3) else [prev] if prev in (2, 4) else [])
            tags[b, t] = choices[int(torch.randint(0, len(choices), (1,), generator=g))]
    return tags


@quiet("bilstm_crf_bio_constraints_minus_inf_transitions_logsumexp")
def _crf_quiet() -> Program:
    torch.manual_seed(0)
    model = BiLSTMTagger()
    g = _gen(1112)
    batches = [(torch.randint(1, 60, (4, 12), generator=g), _valid_bio(g, 4, 12), torch.ones(4, 12)) for _ in range(STEPS)]
    return Program(model, sgd(model, 0.05), batches, crf_constrained_nll)


# 5b. Soft-DTW between a predicted and a target series (a DP table with +inf borders, softmin by
#     -gamma logsumexp(-x / gamma)): the borders give -inf terms whose softmax weights are exactly 0.
class Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def soft_dtw_loss(model: nn.Module, batch: Any, step: int, gamma: float = 0.1) -> torch.Tensor:
    x, y = batch
    pred = model(x)
    D = (pred[:, :, None] - y[:, None, :]) ** 2
    B, N, M = D.shape
    R = [[torch.full((B,), float("inf")) for _ in range(M + 1)] for _ in range(N + 1)]
    R[0][0] = torch.zeros(B)
    for i in range(1, N + 1):
        for j in range(1, M + 1):
            prev = torch.stack([R[i - 1][j - 1], R[i - 1][j], R[i][j - 1]], -1)
            R[i][j] = D[:, i - 1, j - 1] - gamma * torch.logsumexp(-prev / gamma, -1)
    return R[N][M].mean()


@quiet("soft_dtw_dp_table_plus_inf_borders")
def _soft_dtw() -> Program:
    torch.manual_seed(0)
    model = Forecaster()
    g = _gen(1113)
    batches = [(torch.randn(8, 12, generator=g), torch.sin(torch.linspace(0, 3, 10) + torch.rand(8, 1, generator=g)))
               for _ in range(STEPS)]
    return Program(model, sgd(model, 0.01), batches, soft_dtw_loss)


# 5c. IMPALA's V-trace with truncated importance weights rho = min(1, pi / mu) computed as
#     exp(log pi - log mu): the behaviour policy was greedy (log mu = -inf for the actions it never
#     takes), and at FAIL_STEP the batch holds one such action (a replay from an epsilon-greedy actor).
#     exp(+inf) = inf, min(1, inf) = 1: the truncation makes it exact, and rho is computed without grad.
def vtrace_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, rewards, behaviour_logp = batch
    logits, values = model(obs)
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all[:-1].gather(1, actions[:, None]).squeeze(1)
    with torch.no_grad():
        rho = torch.exp(logp - behaviour_logp).clamp(max=1.0)
        v = values.detach()
        vs, acc = [], v[-1]
        for t in reversed(range(len(rewards))):
            delta = rho[t] * (rewards[t] + 0.99 * v[t + 1] - v[t])
            acc = v[t] + delta + 0.99 * rho[t] * (acc - v[t + 1])
            vs.insert(0, acc)
        vs = torch.stack(vs)
        pg_adv = rho * (rewards + 0.99 * torch.cat([vs[1:], v[-1:]]) - v[:-1])
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    return -(logp * pg_adv).mean() + 0.5 * F.mse_loss(values[:-1], vs) - 0.01 * entropy


@quiet("vtrace_truncated_importance_weight_action_greedy_behaviour_never_takes")
def _vtrace() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(1114)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        actions = torch.randint(0, 3, (16,), generator=g)
        behaviour = torch.zeros(16)
        if step == FAIL_STEP:
            behaviour[9] = float("-inf")
        return torch.randn(17, 6, generator=g), actions, torch.randn(16, generator=g), behaviour

    return Program(model, sgd(model, 0.01), [batch(s) for s in range(STEPS)], vtrace_loss)


# ================================================================== the plain runs and the oracle
FILLS = {"aten.masked_fill.Scalar", "aten.masked_fill_.Scalar", "aten.fill_.Scalar", "aten.full.default",
         "aten.scalar_tensor.default", "aten.lift_fresh.default", "aten.masked_fill.Tensor", "aten.copy_.default",
         "aten._to_copy.default", "aten.clone.default"}


def _here_line() -> int | None:
    for frame in inspect.stack()[2:]:
        if os.path.abspath(frame.filename) == HERE and frame.function not in ("__torch_dispatch__", "_here_line"):
            return frame.lineno
    return None


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


class FirstBad(TorchDispatchMode):
    """The first op that made a non-finite floating value from finite inputs (no infinite scalar argument,
    not a fill or copy), with this file's innermost line that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[str, int | None] | None = None
        self.first_nan: tuple[str, int | None] | None = None
        """The first op that made a NaN from NaN-free inputs (a fully masked softmax: its -inf are a fill's)."""
        self.on = True
        """Off during backward(): the backward origin is ``node_oracle``'s."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on and str(func) not in FILLS:
            leaves = tree_leaves((args, kwargs))
            ins = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
            scalars_ok = all(math.isfinite(v) for v in leaves if isinstance(v, float))
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if self.first is None and scalars_ok and _finite(ins) and not _finite(outs):
                self.first = (str(func), _here_line())
            if (self.first_nan is None and not any(bool(t.isnan().any()) for t in ins)
                    and any(bool(t.isnan().any()) for t in outs)):
                self.first_nan = (str(func), _here_line())
        return out


NODES = {"aten.sqrt.default": "SqrtBackward0"}


def node_oracle(loss: torch.Tensor) -> list[str]:
    """Hooks on every autograd node of ``loss``'s graph: the names of the nodes whose gradient output is
    non-finite while the gradient they received is finite, in the order the engine ran them."""
    seen, stack, order = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)

        def hook(grad_inputs: Any, grad_outputs: Any, node: Any = node) -> None:
            if _finite(g for g in grad_outputs if g is not None) and not _finite(g for g in grad_inputs if g is not None):
                order.append(node.name())

        node.register_hook(hook)
        stack.extend(n for n, _ in node.next_functions)
    return order


def plain_run(program: Program, go_on: str | None = None) -> dict[str, Any]:
    """The program without nantrace, each step under FirstBad: the first failing step, how, the oracle's
    forward origin, the first node with a non-finite gradient, and whether a model input was non-finite."""
    model, opt = program.model, program.optimizer
    bad_inputs: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda m, args: bad_inputs.append(1) if not _finite(a for a in tree_leaves(args)
                                                            if isinstance(a, torch.Tensor) and a.is_floating_point()) else None)
    failures, result = [], dict(step=None, what=None)
    try:
        for step, batch in enumerate(program.batches):
            oracle = FirstBad()
            opt.zero_grad()
            nodes: list[list[str]] = []
            try:
                with oracle:
                    micro = batch if program.accum else [batch]
                    for mb in micro:
                        loss = program.loss(model, mb, step)
                        if go_on == "skip_nonfinite" and not bool(torch.isfinite(loss).all()):
                            break
                        if bool(torch.isfinite(loss).all()):
                            nodes.append(node_oracle(loss))
                        oracle.on = False
                        (loss / len(micro)).backward()
                        oracle.on = True
                        if not bool(torch.isfinite(loss).all()) or not _finite(p.grad for p in model.parameters()):
                            break
            except Exception as exc:  # noqa: BLE001 - the construction's own failure
                tb = exc.__traceback__
                line = None
                while tb is not None:
                    code = tb.tb_frame.f_code
                    if os.path.abspath(code.co_filename) == HERE and code.co_name != "__torch_dispatch__":
                        line = tb.tb_lineno
                    tb = tb.tb_next
                failures.append(step)
                if result["step"] is None:
                    result = dict(step=step, what="raised", error=exc, line=line, origin=oracle.first)
                if go_on == "catch":
                    opt.zero_grad()
                    continue
                break
            loss_ok = bool(torch.isfinite(loss).all())
            grads_ok = _finite(p.grad for p in model.parameters())
            if not (loss_ok and grads_ok):
                failures.append(step)
                if result["step"] is None:
                    result = dict(step=step, what="loss" if not loss_ok else "grads", origin=oracle.first, nodes=sum(nodes, []),
                                  origin_nan=oracle.first_nan,
                                  input=bool(bad_inputs))
                if go_on == "skip_nonfinite":
                    continue
                break
            opt.step()
            assert _finite(model.parameters()), step
    finally:
        hook.remove()
    result["failures"] = failures
    result["params"] = snapshot(model)
    return result


# ======================================================================= the loop that trains on
@dataclasses.dataclass
class OnRun:
    incidents: list[Any]
    failures: list[tuple[int, BaseException | None]]
    changed: list[bool]


def train_on(program: Program, *, replayable: bool, go_on: str) -> OnRun:
    """``skip_nonfinite``: no backward for a non-finite loss (Lightning's ``return None``); ``catch``: the
    exception is caught, the gradients zeroed, the batch skipped."""
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


# ======================================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised", "nonfinite_input": "loss"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace every step before FAIL_STEP is finite, FAIL_STEP fails as the
    expected kind says (a loop that trains on: only FAIL_STEP fails), and the oracle names the expected
    op and line (forward), node (backward) or the raising line."""
    build, want = CASES[name]
    run = plain_run(build(), CONTINUE.get(name))
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    if name in CONTINUE:
        assert run["failures"] == [FAIL_STEP], run["failures"]
    line = origin_line(HERE, want.tag)
    if want.kind == "exception":
        assert type(run["error"]) is RAISES[name] and run["line"] == line, run
        assert run["origin"] is None, run  # raised on finite values
    elif want.phase == "backward":
        assert run["origin"] is None and run["nodes"][:1] == [NODES[want.op]], run
    elif want.cause == "masked_softmax_all":  # the -inf are fills: the origin is the op that made the NaN
        assert run["origin"] is None and run["origin_nan"] == (want.op, line), run
    else:
        assert run["origin"] == (want.op, line), run
        assert run["input"] is (want.kind == "nonfinite_input"), run


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n not in CONTINUE}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n in CONTINUE}, XFAIL))
def test_heldout_trains_on(name: str, mode: str) -> None:
    """The loop goes on past the bad batch: one incident naming the origin at FAIL_STEP (the step index
    the next ``optimizer.step()`` takes), the bad batch changed nothing, every other batch's update landed."""
    build, want = CASES[name]
    run = train_on(build(), replayable=mode == "replayable", go_on=CONTINUE[name])
    assert [i for i, _ in run.failures] == [FAIL_STEP], run.failures
    assert run.incidents, "no incident"
    inc = run.incidents[0]
    got = dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
               line=JUDGE.line(inc.source))
    assert got == {k: v for k, v in JUDGE.want(want).items() if k != "action"}, [describe(i) + " | " + i.summary
                                                                                 for i in run.incidents]
    assert len(run.incidents) == 1, [describe(i) for i in run.incidents]
    assert run.changed == [i != FAIL_STEP for i in range(STEPS)], run.changed


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    """The construction: every loss and gradient stays finite."""
    run = plain_run(QUIET[name]())
    assert run["step"] is None, run


@pytest.mark.parametrize("name,mode", case_params(QUIET, QUIET_XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No blocking incident, no error, and the weights are bit-identical to the plain program's."""
    program = QUIET[name]()
    run = train(program, replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert run.error is None, repr(run.error)
    reference = plain_run(QUIET[name]())["params"]
    assert all(torch.equal(a, b) for a, b in zip(snapshot(program.model), reference, strict=True))
