"""Held-out failures, round 3a: more programs shaped like public training code, written without
looking at what nantrace says about them.

Focus: loss code outside the model run zero-intrusive (hand-written label smoothing, SimCLR with a
hand-written L2 normalisation, a hand-written BCE, CTC, PPO ratios, REINFORCE return
normalisation, triplet distances, ``torch.where`` traps, masked entropies, a hand-written
softmax, a Gaussian NLL), failures that raise because of a bad value (Categorical, multinomial,
embedding and cross-entropy indices, a covariance that is not positive-definite, BCE on NaN),
the optimizer's own update (Adagrad eps=0, a warmup-cosine schedule with no decay steps, a
normalised-gradient update of an all-zero gradient), and two real framework trainers
(``transformers.Trainer`` with a ``compute_loss`` override, ``lightning.Trainer``).

The expected diagnosis (kind, phase, ATen op, module, cause and the ``# <origin:TAG>`` line) of
each case was written from how the failure was constructed, following docs/api.md's rules,
before nantrace ran on it. Every plain-loop case runs zero-intrusive and with ``replayable``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from heldout_harness import Judge, Program, aligned, assert_diagnosis, case_params, describe, same, sgd, snapshot, steps, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(autouse=True)
def _distributions_validate(distributions_validate: None) -> None:
    """The programs that raise here rely on torch.distributions' default validation (conftest)."""


FAIL_STEP = 3
STEPS = 5


JUDGE = Judge(__file__)
got_of, want_of = JUDGE.got, JUDGE.want


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return steps(normal, bad, FAIL_STEP, STEPS)


CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
XFAIL: dict[str, str] = {
}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        return build

    return register


class Classifier(nn.Module):
    def __init__(self, d: int = 10, classes: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


# ===================================================== 1. loss code outside the model
# 1a. An HF-style compute_loss override with label smoothing written by hand as log(softmax):
#     one record in raw units makes the logit gaps exceed ~104, softmax underflows to 0.
def smoothed_ce(model: nn.Module, batch: Any, step: int, eps: float = 0.1) -> torch.Tensor:
    x, y = batch
    probs = F.softmax(model(x), dim=-1)
    log_probs = torch.log(probs)  # <origin:ls_log>
    nll = -log_probs.gather(1, y[:, None]).squeeze(1)
    return ((1 - eps) * nll - eps * log_probs.mean(-1)).mean()


@case("compute_loss_label_smoothing_log_softmax_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "ls_log", "log_nonpositive"))
def _label_smoothing() -> Program:
    torch.manual_seed(0)
    model = Classifier()
    g = torch.Generator().manual_seed(101)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 10, generator=g)
        if raw:
            x[2] *= 2e3  # a record in raw units
        return x, torch.randint(0, 4, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), smoothed_ce)


# 1b. SimCLR with the projection normalised by hand (z / |z|) and a bias-free encoder: a blank
#     image (and its augmented view, also blank) is the zero vector: 0 / 0.
class BiasFreeEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def l2n(z: torch.Tensor) -> torch.Tensor:
    return z / z.norm(dim=1, keepdim=True)  # <origin:simclr_l2>


def simclr_loss(model: nn.Module, batch: Any, step: int, tau: float = 0.2) -> torch.Tensor:
    x1, x2 = batch
    z1, z2 = l2n(model(x1)), l2n(model(x2))
    logits = z1 @ z2.t() / tau
    return F.cross_entropy(logits, torch.arange(x1.shape[0]))


@case("simclr_manual_l2_normalise_blank_image",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "simclr_l2", "zero_variance_norm"))
def _simclr() -> Program:
    torch.manual_seed(0)
    model = BiasFreeEncoder()
    g = torch.Generator().manual_seed(102)

    def batch(step: int, blank: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 12, generator=g)
        x2 = x + 0.1 * torch.randn(6, 12, generator=g)
        if blank:
            x[4], x2[4] = 0.0, 0.0  # a blank frame; brightness/contrast jitter keeps it blank
        return x, x2

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), simclr_loss)


# 1c. A Lightning-style training_step with binary cross-entropy written by hand: a record in raw
#     units saturates the sigmoid to exactly 1.0 and log(1 - p) = log(0).
def manual_bce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    p = torch.sigmoid(model(x).squeeze(-1))
    log_p = torch.log(p)
    log_not_p = torch.log(1 - p)  # <origin:bce_log1m>
    return -(y * log_p + (1 - y) * log_not_p).mean()


@case("training_step_manual_bce_saturated_sigmoid",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "bce_log1m", "log_nonpositive"))
def _manual_bce() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    raw = aligned(model, 10, +1.0, 1e3, 103)
    g = torch.Generator().manual_seed(103)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(8, 10, generator=g), (torch.rand(8, generator=g) > 0.5).float()
        if bad:
            x[5], y[5] = raw, 1.0
        return x, y

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), manual_bce)


# 1d. A CTC acoustic model: one utterance of the batch was truncated by the audio loader to 3
#     frames while its transcript has 5 labels: no alignment exists, the loss is inf.
def ctc_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    feats, targets, in_lens, tgt_lens = batch
    log_probs = F.log_softmax(model(feats), dim=-1)  # (T, N, C)
    return F.ctc_loss(log_probs, targets, in_lens, tgt_lens)  # <origin:ctc>


@case("ctc_truncated_utterance_shorter_than_transcript",
      Want("nonfinite_loss", "forward", "aten._ctc_loss.Tensor", None, "ctc", "domain_error"))
def _ctc() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 6))
    g = torch.Generator().manual_seed(104)

    def batch(step: int, short: bool = False) -> tuple[torch.Tensor, ...]:
        feats = torch.randn(14, 3, 8, generator=g)
        targets = torch.randint(1, 6, (3, 5), generator=g)
        in_lens, tgt_lens = torch.tensor([14, 12, 13]), torch.tensor([4, 5, 3])
        if short:
            in_lens[1] = 3
        return feats, targets, in_lens, tgt_lens

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), ctc_step)


# 1e. PPO whose rollout buffer holds log-probabilities from a stale policy checkpoint (-150 for
#     one transition): exp(logp - old_logp) overflows float32.
def ppo_clip_loss(policy: nn.Module, batch: Any, step: int, clip: float = 0.2) -> torch.Tensor:
    obs, actions, old_logp, adv = batch
    logp = F.log_softmax(policy(obs), dim=-1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(logp - old_logp)  # <origin:ppo_ratio>
    return -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()


@case("ppo_ratio_stale_old_logprob_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "ppo_ratio", "exp_overflow"))
def _ppo_ratio() -> Program:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(105)

    def batch(step: int, stale: bool = False) -> tuple[torch.Tensor, ...]:
        old_logp = torch.full((8,), math.log(0.25)) + 0.1 * torch.randn(8, generator=g)
        adv = torch.randn(8, generator=g)
        adv[1] = -1.0
        if stale:
            old_logp[1] = -150.0
        return torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g), old_logp, adv

    return Program(policy, sgd(policy), _steps(batch, lambda s: batch(s, True)), ppo_clip_loss)


# 1f. REINFORCE with per-episode return normalisation before the policy's forward: an episode
#     that terminates after one step has one return, and its (unbiased) std is 0 / 0.
def reinforce_loss(policy: nn.Module, batch: Any, step: int, gamma: float = 0.99) -> torch.Tensor:
    obs, actions, rewards = batch
    discount = gamma ** torch.arange(rewards.shape[0], dtype=torch.float32)
    returns = torch.flip(torch.cumsum(torch.flip(rewards * discount, [0]), 0), [0]) / discount
    returns = (returns - returns.mean()) / returns.std()  # <origin:return_std>
    logp = F.log_softmax(policy(obs), dim=-1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * returns).sum()


@case("reinforce_return_std_one_step_episode",
      Want("nonfinite_loss", "forward", "aten.std.correction", None, "return_std", "zero_variance_norm"))
def _reinforce() -> Program:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
    g = torch.Generator().manual_seed(106)

    def batch(step: int, short: bool = False) -> tuple[torch.Tensor, ...]:
        n = 1 if short else 6 + step
        return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g), torch.rand(n, generator=g)

    return Program(policy, sgd(policy), _steps(batch, lambda s: batch(s, True)), reinforce_loss)


# 1g. Triplet loss with a hand-written Euclidean distance: the sampler returned the anchor itself
#     as its positive (augmentation off for one batch): sqrt(0) has an infinite derivative.
def pdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).pow(2).sum(1).sqrt()  # <origin:triplet_sqrt>


def triplet_loss(model: nn.Module, batch: Any, step: int, margin: float = 1.0) -> torch.Tensor:
    a, p, n = batch
    ea, ep, en = model(a), model(p), model(n)
    return F.relu(pdist(ea, ep) - pdist(ea, en) + margin).mean()


@case("triplet_manual_distance_anchor_is_positive",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "triplet_sqrt", "grad_singularity"))
def _triplet() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))
    g = torch.Generator().manual_seed(107)

    def batch(step: int, same: bool = False) -> tuple[torch.Tensor, ...]:
        a = torch.randn(6, 10, generator=g)
        p = a + 0.1 * torch.randn(6, 10, generator=g)
        if same:
            p[3] = a[3]
        return a, p, torch.randn(6, 10, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), triplet_loss)


# 1h. A binary loss written with torch.where over -log(p) and -log(1 - p): a negative example in
#     raw units gives p = 0, the unselected branch is inf and its gradient 0 * inf = NaN.
def where_bce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    p = torch.sigmoid(model(x).squeeze(-1))
    pos = -torch.log(p)  # <origin:where_log>
    neg = -torch.log1p(-p)
    return torch.where(y > 0.5, pos, neg).mean()


@case("where_bce_unselected_log_of_zero",
      Want("nonfinite_grad", "forward", "aten.log.default", None, "where_log", "where_gradient_trap"))
def _where() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    raw = aligned(model, 10, -1.0, 1e4, 108)
    g = torch.Generator().manual_seed(108)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(8, 10, generator=g), (torch.rand(8, generator=g) > 0.5).float()
        if bad:
            x[6], y[6] = raw, 0.0
        return x, y

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), where_bce)


# 1i. Policy-gradient with an entropy bonus and invalid-action masking by -inf: the first state
#     with an illegal action gives p = 0, log p = -inf, and p * log p = 0 * -inf.
def masked_pg_loss(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, actions, adv = batch
    logits = policy(obs).masked_fill(~legal, float("-inf"))
    logp = F.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # <origin:masked_entropy>
    pg = -logp.gather(1, actions[:, None]).squeeze(1) * adv
    return (pg - 0.01 * entropy).mean()


@case("masked_policy_entropy_zero_times_minus_inf",
      Want("nonfinite_loss", "forward", "aten.mul.Tensor", None, "masked_entropy", "inf_arithmetic"))
def _masked_entropy() -> Program:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(109)

    def batch(step: int, masked: bool = False) -> tuple[torch.Tensor, ...]:
        legal = torch.ones(6, 5, dtype=torch.bool)
        actions = torch.randint(0, 4, (6,), generator=g)
        if masked:
            legal[2, 4] = False  # the first state where action 4 is illegal
        return torch.randn(6, 6, generator=g), legal, actions, torch.randn(6, generator=g)

    return Program(policy, sgd(policy), _steps(batch, lambda s: batch(s, True)), masked_pg_loss)


# 1j. A CLIP-style loss with a hand-written softmax over unnormalised embeddings: a batch of
#     raw-unit features makes the similarities exceed 88.7 and exp overflows float32.
def manual_softmax_contrastive(model: nn.Module, batch: Any, step: int, tau: float = 0.5) -> torch.Tensor:
    xa, xb = batch
    logits = model(xa) @ model(xb).t() / tau
    e = torch.exp(logits)  # <origin:manual_softmax_exp>
    p = e / e.sum(1, keepdim=True)
    return -torch.log(p.diagonal()).mean()


@case("contrastive_manual_softmax_exp_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "manual_softmax_exp", "exp_overflow"))
def _manual_softmax() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 8))
    g = torch.Generator().manual_seed(110)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        xa = torch.randn(6, 12, generator=g)
        xb = xa + 0.1 * torch.randn(6, 12, generator=g)
        if raw:
            xa, xb = xa * 1e3, xb * 1e3  # a batch of raw-unit features
        return xa, xb

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), manual_softmax_contrastive)


# 1k. A heteroscedastic regressor with variance = softplus(raw): a record in raw units drives raw
#     to -1e3, softplus underflows to exactly 0 and log(var) = log(0).
def gaussian_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    mu, raw = model(x).unbind(-1)
    var = F.softplus(raw)
    log_var = torch.log(var)  # <origin:nll_logvar>
    return (0.5 * (log_var + (y - mu) ** 2 / var)).mean()


@case("gaussian_nll_softplus_variance_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "nll_logvar", "log_nonpositive"))
def _gauss() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 2))
    raw = aligned(lambda v: model(v)[:, 1], 6, -1.0, 1e3, 111)
    g = torch.Generator().manual_seed(111)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 6, generator=g)
        if bad:
            x[0] = raw
        return x, torch.randn(8, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), gaussian_nll)


# ===================================================== 2. failures that raise on a bad value
# 2a. A policy that standardises its observations per batch inside the model (no eps): all
#     environments were reset to the same start state, a feature is constant: 0 / 0, and
#     Categorical(logits=NaN) refuses the logits.
class BatchObsNorm(nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs - obs.mean(0)) / obs.std(0)  # <origin:obs_norm>


class NormPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.obs_norm = BatchObsNorm()
        self.net = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.obs_norm(obs))


def categorical_pg(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, adv = batch
    dist = torch.distributions.Categorical(logits=policy(obs))
    return -(dist.log_prob(actions) * adv).mean() - 0.01 * dist.entropy().mean()


@case("categorical_nan_logits_from_batch_obs_norm",
      Want("exception", "forward", "aten.div.Tensor", "obs_norm", "obs_norm", "zero_variance_norm", action="raised"))
def _categorical() -> Program:
    torch.manual_seed(0)
    policy = NormPolicy()
    g = torch.Generator().manual_seed(201)

    def batch(step: int, reset: bool = False) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(8, 5, generator=g)
        if reset:
            obs = obs[:1].expand(8, 5).clone()  # every env at the same start state
            obs[:, 0] += torch.randn(8, generator=g)  # only the noise feature differs
        return obs, torch.randint(0, 3, (8,), generator=g), torch.randn(8, generator=g)

    return Program(policy, sgd(policy), _steps(batch, lambda s: batch(s, True)), categorical_pg)


# 2b. Sampling with action masking applied to probabilities and renormalised in the loss code:
#     a terminal state without any legal action renormalises 0 / 0, multinomial refuses NaN.
def masked_sample_reinforce(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, reward = batch
    probs = F.softmax(policy(obs), dim=-1) * legal
    probs = probs / probs.sum(-1, keepdim=True)  # <origin:renorm_div>
    action = torch.multinomial(probs, 1)
    return -(torch.log(probs.gather(1, action).squeeze(1)) * reward).mean()


@case("multinomial_renormalised_no_legal_action",
      Want("exception", "forward", "aten.div.Tensor", None, "renorm_div", "div_by_zero", action="raised"))
def _renorm() -> Program:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(202)

    def batch(step: int, terminal: bool = False) -> tuple[torch.Tensor, ...]:
        legal = torch.ones(5, 4)
        legal[:, 0] = 0.0
        if terminal:
            legal[3] = 0.0
        return torch.randn(5, 6, generator=g), legal, torch.randn(5, generator=g)

    return Program(policy, sgd(policy), _steps(batch, lambda s: batch(s, True)), masked_sample_reinforce)


# 2c. A BERT-style encoder with token-type embeddings for 2 segments: the tokenizer was given a
#     3-segment input once and produced token_type_id 2.
class SegmentEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(40, 16)
        self.type_emb = nn.Embedding(2, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(ids) + self.type_emb(types)  # <origin:type_emb>
        return self.head(h.mean(1))


@case("token_type_id_out_of_range",
      Want("exception", "forward", "aten.embedding.default", "type_emb", "type_emb", "label_out_of_range",
           action="raised"))
def _token_type() -> Program:
    torch.manual_seed(0)
    model = SegmentEncoder()
    g = torch.Generator().manual_seed(203)

    def batch(step: int, three: bool = False) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, 40, (4, 8), generator=g)
        types = torch.zeros(4, 8, dtype=torch.long)
        types[:, 4:] = 1
        if three:
            types[2, 6:] = 2
        return ids, types, torch.randint(0, 3, (4,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# 2d. Token classification (NER) whose collator pads labels with -1 instead of -100: the first
#     batch with padding makes cross_entropy index class -1.
def token_ce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, labels = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))  # <origin:ner_ce>


@case("ner_labels_padded_with_minus_one",
      Want("exception", "forward", "aten.nll_loss_forward.default", None, "ner_ce", "label_out_of_range",
           action="raised"))
def _ner() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(204)

    def batch(step: int, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 5, (3, 7), generator=g)
        if padded:
            labels[1, 5:] = -1  # a shorter sentence, padded by the collator
        return torch.randn(3, 7, 8, generator=g), labels

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), token_ce)


# 2e. A density model scoring embeddings under a Gaussian fitted to the batch (covariance of the
#     batch's features): the last, partial batch has fewer samples than dimensions, so the
#     covariance is singular and MultivariateNormal refuses it.
def batch_gaussian_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    z = model(batch)
    cov = torch.cov(z.t())
    mvn = torch.distributions.MultivariateNormal(z.mean(0), covariance_matrix=cov)  # <origin:mvn_cov>
    return -mvn.log_prob(z).mean()


@case("batch_covariance_singular_partial_batch",
      Want("exception", "forward", "aten.linalg_cholesky_ex.default", None, "mvn_cov", "domain_error",
           action="raised"))
def _mvn() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(205)
    return Program(model, sgd(model, 1e-3), _steps(lambda s: torch.randn(32, 6, generator=g),
                                                    lambda s: torch.randn(3, 6, generator=g)), batch_gaussian_nll)


# 2f. A count model that applies a variance-stabilising sqrt to its count features; the export
#     marks a missing count with -1: sqrt(-1) = NaN reaches binary_cross_entropy, which raises.
class SqrtCounts(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(counts)  # <origin:sqrt_counts>


class ClickModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = SqrtCounts()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(self.features(counts))).squeeze(-1)


@case("bce_on_nan_from_sqrt_of_missing_sentinel",
      Want("exception", "forward", "aten.sqrt.default", "features", "sqrt_counts", "sqrt_negative", action="raised"))
def _sqrt_bce() -> Program:
    torch.manual_seed(0)
    model = ClickModel()
    g = torch.Generator().manual_seed(206)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.randint(0, 30, (6, 6), generator=g).float()
        if missing:
            counts[4, 2] = -1.0
        return counts, (torch.rand(6, generator=g) > 0.5).float()

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.binary_cross_entropy(m(b[0]), b[1]))


# ============================================================ 3. the optimizer's update
# 3a. Adagrad with eps=0 (ported from a config that relied on initial_accumulator_value) and an
#     auxiliary head that joins the model at FAIL_STEP (a curriculum adds a task); one of its
#     input features is absent (all zero) in that batch: its weight column gets gradient 0 and
#     its first update is 0 / (sqrt(0) + 0).
class CurriculumModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.aux = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        out = self.main(x)
        return out if aux is None else out + self.aux(aux)


@case("adagrad_eps0_new_head_zero_gradient_column",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "aux", "opt_step", "optimizer_state"))
def _adagrad() -> Program:
    torch.manual_seed(0)
    model = CurriculumModel()
    g = torch.Generator().manual_seed(301)

    def batch(step: int, with_aux: bool = False) -> tuple[Any, ...]:
        aux = None
        if with_aux:
            aux = torch.randn(6, 4, generator=g)
            aux[:, 1] = 0.0  # a feature absent from this batch
        return torch.randn(6, 8, generator=g), aux, torch.randint(0, 2, (6,), generator=g)

    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2, eps=0.0)
    return Program(model, opt, _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]))


# 3b. A warmup + cosine schedule (numpy, in a LambdaLR) with total_steps == warmup_steps: the
#     first step after warmup computes progress = 0 / 0 = nan, so lr = nan.
WARMUP, TOTAL = FAIL_STEP, FAIL_STEP


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = np.float64(step - WARMUP) / np.float64(TOTAL - WARMUP)
    return 0.5 * (1.0 + np.cos(np.pi * progress))


@case("lambdalr_warmup_cosine_no_decay_steps_nan_lr",
      Want("nonfinite_param", "optimizer", "aten.add_.Tensor", "0", "opt_step", "optimizer_state"))
def _nan_lr() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = sgd(model, 1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    g = torch.Generator().manual_seed(302)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]
    return Program(model, opt, batches, lambda m, b, s: F.mse_loss(m(b[0]), b[1]), scheduler=sched)


# 3c. Normalised-gradient descent (gradients divided by their global norm before the step) with
#     a masked-LM loss: a batch where no token was masked has loss 0 and every gradient exactly
#     0, so the global norm is 0 and the division is 0 / 0.
def masked_lm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, labels, mask = batch
    logits = model(tokens)
    per_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (per_tok * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)


def normalise_grads(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    with torch.no_grad():
        total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        for p in model.parameters():
            p.grad.div_(total)  # <origin:grad_normalise>


@case("normalised_gradient_all_zero_gradients",
      Want("nonfinite_grad", "backward", "aten.div_.Tensor", None, "grad_normalise", "zero_variance_norm"))
def _normgrad() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 16), nn.ReLU(), nn.Linear(16, 30))
    g = torch.Generator().manual_seed(303)

    def batch(step: int, none: bool = False) -> tuple[torch.Tensor, ...]:
        tokens = torch.randint(0, 30, (4, 6), generator=g)
        mask = (torch.rand(4, 6, generator=g) < 0.3).float()
        mask[0, 0] = 1.0
        if none:
            mask.zero_()  # short sequences: the masking drew no position
        return tokens, torch.randint(0, 30, (4, 6), generator=g), mask

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), masked_lm_loss, between=normalise_grads)


# ======================================================== 4. real framework trainers
class FrameworkRun(dict):
    pass


def _hf_trainer_run(tmp: Path) -> tuple[list[Any], BaseException | None, bool | None]:
    """A transformers.Trainer whose compute_loss override weighs classes by their inverse frequency in
    the batch (counts.sum() / counts): the first batch in which a class is absent divides by 0."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nantrace.integrations.hf import NanTraceCallback

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * STEPS

        def __getitem__(self, i: int) -> dict[str, Any]:
            g = torch.Generator().manual_seed(1000 + i)
            label = [0, 1, 2, i // 4 % 3][i % 4] if i // 4 != FAIL_STEP else [0, 0, 1, 1][i % 4]
            return {"x": torch.randn(6, generator=g), "labels": torch.tensor(label)}

    class TinyClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
            self.classifier = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            return {"logits": self.classifier(self.body(x))}

    class BalancedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            counts = torch.bincount(labels, minlength=3).float()
            weights = counts.sum() / counts  # <origin:hf_class_weights>
            weights = weights / weights.sum()
            loss = F.cross_entropy(outputs["logits"], labels, weight=weights)
            return (loss, outputs) if return_outputs else loss

    class ParamRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.after: list[list[torch.Tensor]] = []

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.after.append(snapshot(model))

    model = TinyClassifier()
    args = TrainingArguments(output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
                             train_sampling_strategy="sequential", learning_rate=1e-2, remove_unused_columns=False)
    cb = NanTraceCallback(config=nantrace.Config(outputs={"print_incidents": False}))
    recorder = ParamRecorder()
    trainer = BalancedTrainer(model=model, args=args, train_dataset=Rows(), callbacks=[cb, recorder])
    error = None
    try:
        trainer.train()
    except Exception as exc:
        error = exc
    finally:
        cb.close()
    unchanged = same(recorder.after[FAIL_STEP], recorder.after[FAIL_STEP - 1]) if len(recorder.after) > FAIL_STEP else None
    return list(cb.incidents), error, unchanged


class MaskedMeanPool(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1)  # <origin:pool_div>


def _lightning_run(tmp: Path) -> tuple[list[Any], BaseException | None, bool | None]:
    """A lightning.Trainer fitting a token classifier that mean-pools over the attention mask: the
    data module emits an empty document (mask all 0) at FAIL_STEP: 0 / 0 in the pooling module."""
    pytest.importorskip("lightning")
    import lightning as L

    from nantrace.integrations.lightning import NanTraceCallback

    class DocClassifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(50, 16)
            self.pool = MaskedMeanPool()
            self.head = nn.Linear(16, 2)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.head(self.pool(self.emb(ids), mask))

        def training_step(self, batch, batch_idx):
            ids, mask, y = batch
            return F.cross_entropy(self(ids, mask), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class ParamRecorder(L.Callback):
        def __init__(self) -> None:
            self.after: dict[int, list[torch.Tensor]] = {}

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.after[trainer.global_step] = snapshot(pl_module)

    g = torch.Generator().manual_seed(401)
    batches = []
    for step in range(STEPS):
        ids = torch.randint(1, 50, (4, 7), generator=g)
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[1, 5:] = 0
        if step == FAIL_STEP:
            mask[2] = 0  # an empty document after cleaning
        batches.append((ids, mask, torch.randint(0, 2, (4,), generator=g)))
    model = DocClassifier()
    cb = NanTraceCallback(config=nantrace.Config(outputs={"print_incidents": False}))
    recorder = ParamRecorder()
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, recorder],
                        default_root_dir=str(tmp))
    error = None
    try:
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    except Exception as exc:
        error = exc
    at = recorder.after
    unchanged = same(at[FAIL_STEP + 1], at[FAIL_STEP]) if FAIL_STEP + 1 in at and FAIL_STEP in at else None
    return list(cb.incidents), error, unchanged


FRAMEWORK_CASES: dict[str, tuple[Callable[[Path], Any], Want]] = {
    "hf_trainer_compute_loss_inverse_frequency_weights":
        (_hf_trainer_run, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "hf_class_weights", "div_by_zero")),
    "lightning_masked_mean_pool_empty_document":
        (_lightning_run, Want("nonfinite_loss", "forward", "aten.div.Tensor", "pool", "pool_div", "div_by_zero")),
}
FRAMEWORK_XFAIL: dict[str, str] = {}
"""name -> why nantrace is still wrong on it (a strict xfail)."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=FRAMEWORK_XFAIL[n])]
                                                if n in FRAMEWORK_XFAIL else []) for n in FRAMEWORK_CASES])
def test_framework_diagnosis(name: str, tmp_path: Path) -> None:
    run, want = FRAMEWORK_CASES[name]
    incidents, error, unchanged = run(tmp_path)
    got = got_of(incidents)
    assert got is not None, ("no incident", repr(error))
    assert got == want_of(want), [describe(i) + " | " + i.summary for i in incidents]
    assert error is None, repr(error)
    assert unchanged is True, "the blocked step changed the weights"


# ======================================================================= the tests
@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction itself: without nantrace, the program fails at FAIL_STEP and not before,
    in the way the expectation says (raises / non-finite loss / finite loss and non-finite
    gradient / finite gradient and a non-finite parameter after the update)."""
    build, want = CASES[name]
    program = build()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        try:
            loss = program.loss(model, batch, step)
            loss.backward()
        except Exception:
            assert want.kind == "exception" and step == want.step, (name, step)
            return
        if program.between is not None:
            program.between(model, opt, step)
        loss_ok = bool(torch.isfinite(loss).all())
        grads_ok = _finite(p.grad for p in model.parameters())
        opt.step()
        params_ok = _finite(model.parameters())
        if program.scheduler is not None:
            program.scheduler.step()
        if step != want.step:
            assert loss_ok and grads_ok and params_ok, (name, step)
            continue
        if want.kind in ("nonfinite_loss", "nonfinite_input"):
            assert not loss_ok, name
        elif want.kind == "nonfinite_grad":
            assert loss_ok and not grads_ok, name
        elif want.kind == "nonfinite_param":
            assert loss_ok and grads_ok and not params_ok, name
        else:
            raise AssertionError(f"{name} did not raise at step {step}")
        return
    raise AssertionError(f"{name} never failed")
