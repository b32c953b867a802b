"""Held-out failures, round 15a: the CAUSE of failures born in (or triggered by) the LOSS CODE and the
DATA of real-program-shaped scripts, above all zero-intrusive (no ``guard.replayable``: nantrace sees the
loss code only through its loss tape and prelude).

Families (each case a stand-alone script: model class, loss, loop data):

1. a small GPT (token embedding, causal attention with a ``-inf`` mask, tied LM head) whose loss code adds
   something of its own: a z-loss written as ``log(sum(exp(logits)))``, label smoothing by hand over a
   vocabulary padded to a multiple of 64 whose padded entries are masked with ``-inf`` (by the model, or by the
   loss code's in-place slice assignment), a per-sequence masked mean with an all-padding sequence, per-token
   loss weights from the batch, and a hand-written NLL ``gather`` fed Hugging-Face ``-100`` labels;
2. a VAE: a Gaussian decoder NLL written with the precision ``exp(-logvar)``, a KL with ``log(sigma**2)`` of a
   ``sigma`` produced by ReLU, a Bernoulli decoder (``nn.Sigmoid`` last) with BCE written as
   ``y*log(p) + (1-y)*log(1-p)``;
3. contrastive / metric learning: InfoNCE with a learnable temperature clamped at 0 in the loss, a cosine
   similarity matrix written as ``z @ z.T / (|z| |z|^T)`` with an all-zero embedding, a batch-hard triplet
   loss taking ``sqrt`` of the selected squared distances at a duplicate;
4. diffusion: v-prediction's SNR weight with ``alphas_cumprod`` prepended by 1 (t = 0 is clean data), the same
   schedule under a ``torch.where`` that picks the reconstruction term at t = 0 (the unselected term infinite),
   a cosine log-SNR schedule evaluated at t = 1 exactly in float32;
5. RL: an A2C policy returning ``log(softmax)`` from its forward (underflow, then an entropy bonus), a PPO
   ratio ``exp(logp - old_logp)`` with the logged log-probability of an epsilon-greedy action, GRPO's
   group-relative advantage over a group whose rewards are all equal (out of place, and in place on the
   batch's rewards), REINFORCE standardising by a std read with ``.item()``, GAE in the step with a NaN
   bootstrap observation;
6. data: a NaN feature (as it comes, and spread by an in-step standardisation), a stuck sensor standardised
   in place, an Ethereum balance in wei (1e20) making a feature-tokenizer transformer's attention scores
   overflow, a target in wei overflowing a summed MSE, a weighted mean over a batch whose sample weights are
   all 0;
7. QUIET programs of the same families, written the safe way, hitting the same data (all-padding rows, blank
   images, raw-unit records, t at the schedule's ends, constant reward groups): no incident at all.

How expectations were derived: each expectation (kind, phase, ATen op, module, ``# <origin:TAG>`` line,
cause, step) was written from the construction before nantrace ran, following /work/shared/API.md and
docs/diagnosis.md (origin rule: the op that created the first non-finite value, or the op that created the
infinity it received, an explicit ``-inf`` fill being intentional; module ``None`` for ops outside the
watched model; a batch carrying NaN is ``nonfinite_input`` with phase ``data``; a model input made
non-finite by the step's own code before the forward is ``nonfinite_input`` at that op; an empty count is
``div_by_zero``, a zero norm or std ``zero_variance_norm``; a log of a softmax that underflowed is
``log_nonpositive``; ``0 * -inf`` of a mask is ``inf_arithmetic``; an index outside the classes is
``label_out_of_range``). The constructions were checked WITHOUT nantrace by
``test_cases_fail_without_nantrace``: the plain loop fails first at the expected step in the expected way
(loss / gradients / raise), and, for forward origins, an independent ``TorchDispatchMode`` written here
(``FirstNonFinite``: the first op whose output holds NaN that its inputs did not, or an infinity made from
finite inputs and finite scalars; the innermost module of the model running, from torch's global module
hooks; the deepest line of this file on the stack; inputs read before the op runs, as an in-place op writes
them) names the expected op, module and line; the backward origin (3b) is the first autograd node whose
outputs turn non-finite from finite incoming gradients (``first_nonfinite_node``: a post-hook on every node),
``SqrtBackward0`` (its -inf; ``torch.autograd.detect_anomaly``, which looks for NaN only, names the
``PowBackward0`` after it).

Mismatches are strict xfails (``XFAIL``: what nantrace said, what is right, the src location and mechanism).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from heldout_harness import MODES, Judge, Program, assert_diagnosis, case_params, describe, run_step, sgd, steps, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

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


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return steps(normal, bad, FAIL, STEPS)


# ======================================================================= 1. a small GPT
VOCAB, BLOCK = 64, 12


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads
        self.register_buffer("future", torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, 2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(self.future[:T, :T], float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT-shaped: token + position embeddings, pre-norm blocks, a final LayerNorm, the LM head tied to
    the token embedding. ``real_vocab`` < VOCAB: the vocabulary is padded to a multiple of 64 and the padded
    entries are masked with -inf so that they are never predicted. ``emb_std`` / ``head_mult``: see 1a."""

    def __init__(self, d: int = 32, heads: int = 2, layers: int = 1, real_vocab: int = VOCAB, emb_std: float = 0.02,
                 head_mult: float = 1.0) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(BLOCK, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head_mult = head_mult
        self.register_buffer("padded_vocab", torch.arange(VOCAB) >= real_vocab)
        nn.init.normal_(self.tok.weight, std=emb_std)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight) * self.head_mult
        return logits.masked_fill(self.padded_vocab, float("-inf"))


def _tokens(g: torch.Generator, b: int = 4, hi: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(1, hi, (b, BLOCK + 1), generator=g)
    return seq[:, :-1].clone(), seq[:, 1:].clone()


# 1a. A z-loss (PaLM) switched on after a 3-step warm-up, written by hand as log(sum(exp(logits))) instead of
#     torch.logsumexp. The model keeps nn.Embedding's default N(0, 1) init and its tied head multiplies by
#     sqrt(d) (the input-embedding scale copied onto the output): logits have a std of ~60, the largest
#     near 400, so exp overflows in float32 the first time the z-loss runs. cross_entropy alone is stable.
def z_loss_lm(model: nn.Module, batch: Any, step: int, z_weight: float = 1e-4, z_start: int = FAIL) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if step >= z_start:
        log_z = torch.log(torch.exp(logits).sum(-1))  # <origin:z_exp>
        loss = loss + z_weight * (log_z ** 2).mean()
    return loss


@case("gpt_hand_written_z_loss_after_warmup_tied_head_scaled_by_sqrt_d",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "z_exp", "exp_overflow"))
def _z_loss() -> Program:
    torch.manual_seed(0)
    model = TinyGPT(d=48, emb_std=1.0, head_mult=48 ** 0.5)
    g = _gen(1501)
    return Program(model, sgd(model, 1e-4), [_tokens(g) for _ in range(STEPS)], z_loss_lm)


# 1b. Label smoothing written by hand, switched on by a schedule after 3 steps (eps = 0 until then, and the
#     code skips the smoothing term when eps == 0). The smoothing distribution puts eps / real_vocab on the 60
#     real tokens and 0 on the 4 padding entries of the vocabulary; the model masks those with -inf, so
#     log_softmax is -inf there and q * log p is 0 * -inf = NaN: a -inf mask combined arithmetically.
def smoothed_lm_loss(model: nn.Module, batch: Any, step: int, real_vocab: int = 60) -> torch.Tensor:
    idx, targets = batch
    eps = 0.1 * min(1.0, max(0.0, (step - 2) / 2))
    logp = F.log_softmax(model(idx), -1)
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    if eps == 0:
        return nll.mean()
    q = torch.zeros_like(logp)
    q[..., :real_vocab] = 1.0 / real_vocab
    smooth = -(q * logp).sum(-1)  # <origin:ls_mul>
    return ((1 - eps) * nll + eps * smooth).mean()


@case("gpt_label_smoothing_by_hand_zero_weight_times_padded_vocab_minus_inf",
      Want("nonfinite_loss", "forward", "aten.mul.Tensor", None, "ls_mul", "inf_arithmetic"))
def _label_smoothing() -> Program:
    torch.manual_seed(0)
    model = TinyGPT(real_vocab=60)
    g = _gen(1502)
    return Program(model, sgd(model, 0.1), [_tokens(g, hi=60) for _ in range(STEPS)], smoothed_lm_loss)


# 1b'. The same smoothing in a script whose model returns the padded logits as they are and whose loss code
#     masks the padded vocabulary itself, by slice assignment in place (logits[..., 60:] = -inf): the -inf is
#     still a fill the user meant, and q * log p = 0 * -inf is the first NaN.
def smoothed_lm_loss_masking_in_place(model: nn.Module, batch: Any, step: int, real_vocab: int = 60,
                                      eps: float = 0.1) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    if step >= FAIL:  # the vocabulary was padded from 60 to 64 entries at step 3 (a resumed run's new config)
        logits[..., real_vocab:] = float("-inf")
    logp = F.log_softmax(logits, -1)
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    q = torch.zeros_like(logp)
    q[..., :real_vocab] = 1.0 / real_vocab
    smooth = -(q * logp).sum(-1)  # <origin:ls_mul_in_place>
    return ((1 - eps) * nll + eps * smooth).mean()


@case("gpt_label_smoothing_loss_masks_padded_vocab_by_in_place_slice_assignment",
      Want("nonfinite_loss", "forward", "aten.mul.Tensor", None, "ls_mul_in_place", "inf_arithmetic"))
def _label_smoothing_in_place() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    g = _gen(1528)
    return Program(model, sgd(model, 0.1), [_tokens(g, hi=60) for _ in range(STEPS)], smoothed_lm_loss_masking_in_place)


# 1c. Sequence-level mean (each document weighs the same, as in some RLHF / SFT ports): token losses are
#     averaged per sequence over its real tokens. The batch of step 3 holds a document that was emptied by
#     the length filter (all padding): 0 / 0 for that row. The model has no key-padding mask (the causal
#     mask only), so the forward stays finite.
def per_sequence_mean(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    idx, targets, mask = batch
    tok = F.cross_entropy(model(idx).transpose(1, 2), targets, reduction="none")
    per_seq = (tok * mask).sum(1) / mask.sum(1)  # <origin:seq_mean>
    return per_seq.mean()


@case("gpt_per_sequence_mean_document_emptied_by_length_filter",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "seq_mean", "div_by_zero"))
def _seq_mean() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    g = _gen(1503)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, ...]:
        idx, targets = _tokens(g)
        lengths = torch.randint(4, BLOCK + 1, (4,), generator=g)
        if empty:
            lengths[2] = 0
        mask = (torch.arange(BLOCK)[None] < lengths[:, None]).float()
        return idx * mask.long(), targets, mask

    return Program(model, sgd(model, 0.1), _steps(batch, lambda s: batch(s, True)), per_sequence_mean)


# 1d. Per-token loss weights shipped with the batch (a data-quality score per document, broadcast over its
#     tokens); one document of the batch of step 3 has no score (NaN in the export). The weights never enter
#     the model: the batch itself carries the NaN.
def weighted_tokens(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    idx, targets, weights = batch
    tok = F.cross_entropy(model(idx).transpose(1, 2), targets, reduction="none")
    return (tok * weights).sum() / weights.sum()


@case("gpt_per_token_quality_weights_missing_score_in_batch",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input"))
def _token_weights() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    g = _gen(1504)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, ...]:
        idx, targets = _tokens(g)
        score = torch.rand(4, generator=g) + 0.5
        if missing:
            score[1] = float("nan")
        return idx, targets, score[:, None].expand(4, BLOCK).clone()

    return Program(model, sgd(model, 0.1), _steps(batch, lambda s: batch(s, True)), weighted_tokens)


# 1e. A hand-written token NLL (log_softmax + gather) on labels from a Hugging-Face collator, which pads
#     labels with -100 for F.cross_entropy's ignore_index. The mask is applied after the gather, too late:
#     the first batch with a short sequence (step 3) gathers index -100 and the step raises.
def gather_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    idx, labels = batch
    logp = F.log_softmax(model(idx), -1)
    nll = -logp.gather(-1, labels[..., None]).squeeze(-1)  # <origin:nll_gather>
    keep = (labels != -100).float()
    return (nll * keep).sum() / keep.sum()


@case("gpt_hand_written_gather_nll_hf_minus_100_padding_labels",
      Want("exception", "forward", "aten.gather.default", None, "nll_gather", "label_out_of_range", action="raised"))
def _gather_nll() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    g = _gen(1505)

    def batch(step: int, short: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        idx, labels = _tokens(g)
        if short:
            idx[3, 7:] = 0
            labels[3, 6:] = -100
        return idx, labels

    return Program(model, sgd(model, 0.1), _steps(batch, lambda s: batch(s, True)), gather_nll)


# ======================================================================= 2. VAE
class GaussianVAE(nn.Module):
    """An MLP VAE over standardised tabular records with a Gaussian decoder (mean and log-variance per
    feature); the encoder's log-variance is clamped (diffusers' DiagonalGaussianDistribution does the same)."""

    def __init__(self, d: int = 12, z: int = 4, h: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.to_mu, self.to_logvar = nn.Linear(h, z), nn.Linear(h, z)
        self.decoder = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, 2 * d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.encoder(x)
        mu, logvar = self.to_mu(h), self.to_logvar(h).clamp(-30.0, 20.0)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        x_mu, x_logvar = self.decoder(z).chunk(2, -1)
        return x_mu, x_logvar, mu, logvar


# 2a. The decoder's Gaussian NLL written with the precision exp(-logvar) (0.5 * (logvar + (x - mu)^2 * exp(-logvar))).
#     A record of step 3 in raw units (x 500: an unstandardised export) drives a decoder log-variance below
#     -88.7: exp(-logvar) overflows float32 (the clamped encoder and every op of the forward stay finite).
def gaussian_vae_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x = batch
    x_mu, x_logvar, mu, logvar = model(x)
    precision = torch.exp(-x_logvar)  # <origin:nll_precision>
    nll = 0.5 * (x_logvar + (x - x_mu) ** 2 * precision).sum(1)
    kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(1)
    return (nll + kl).mean()


def _raw_record(model: GaussianVAE, d: int, scale: float, seed: int) -> torch.Tensor:
    """A raw-unit record whose decoder log-variance (at init, the encoder's mean as z) goes below -120."""
    g = _gen(seed)
    with torch.no_grad():
        for _ in range(500):
            v = scale * torch.randn(d, generator=g)
            h = model.encoder(v[None])
            if float(model.decoder(model.to_mu(h)).chunk(2, -1)[1].min()) < -120:
                return v
    raise AssertionError("no such record")


@case("vae_gaussian_decoder_nll_precision_exp_raw_unit_record",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "nll_precision", "exp_overflow"))
def _vae_precision() -> Program:
    torch.manual_seed(0)
    model = GaussianVAE()
    raw = _raw_record(model, 12, 500.0, 2501)
    g = _gen(1506)

    def batch(step: int, bad: bool = False) -> torch.Tensor:
        x = torch.randn(16, 12, generator=g)
        if bad:
            x[5] = raw
        return x

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), gaussian_vae_loss)


# 2b. A VAE whose encoder outputs sigma through a ReLU ("sigma must be non-negative"), with the KL written as
#     0.5 * (sigma^2 + mu^2 - 1 - log(sigma^2)). The sigma head's bias starts at 1, so sigma > 0 on the
#     standardised data; a record of step 3 with a sensor reading 40 sigma out switches one unit's
#     pre-activation below 0: sigma = 0 exactly, log(0) = -inf, KL = +inf.
class ReluSigmaVAE(nn.Module):
    def __init__(self, d: int = 12, z: int = 4, h: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.to_mu, self.to_sigma = nn.Linear(h, z), nn.Linear(h, z)
        self.decoder = nn.Sequential(nn.Linear(z, h), nn.Tanh(), nn.Linear(h, d))
        nn.init.constant_(self.to_sigma.bias, 1.0)
        nn.init.normal_(self.to_sigma.weight, std=0.05)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.encoder(x)
        mu, sigma = self.to_mu(h), F.relu(self.to_sigma(h))
        return self.decoder(mu + sigma * torch.randn_like(sigma)), mu, sigma


def relu_sigma_vae_loss(model: nn.Module, batch: Any, step: int, beta: float = 0.5) -> torch.Tensor:
    recon, mu, sigma = model(batch)
    kl = 0.5 * (sigma ** 2 + mu ** 2 - 1 - torch.log(sigma ** 2)).sum(1)  # <origin:kl_log>
    return F.mse_loss(recon, batch, reduction="none").sum(1).mean() + beta * kl.mean()


def _outlier(model: ReluSigmaVAE, seed: int) -> torch.Tensor:
    """A record with one sensor 40 sigma out for which one sigma unit's pre-activation is below 0."""
    g = _gen(seed)
    with torch.no_grad():
        for _ in range(500):
            v = torch.randn(12, generator=g)
            v[int(torch.randint(0, 12, (1,), generator=g))] = 40.0 * (1 if torch.rand(1, generator=g) < 0.5 else -1)
            if float(model.to_sigma(model.encoder(v[None])).min()) < -0.05:
                return v
    raise AssertionError("no such record")


@case("vae_kl_log_sigma_squared_relu_sigma_head_sensor_outlier",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "kl_log", "log_nonpositive"))
def _vae_relu_sigma() -> Program:
    torch.manual_seed(0)
    model = ReluSigmaVAE()
    out = _outlier(model, 2502)
    g = _gen(1507)

    def batch(step: int, bad: bool = False) -> torch.Tensor:
        x = torch.randn(16, 12, generator=g)
        if bad:
            x[9] = out
        return x

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), relu_sigma_vae_loss)


# 2c. The pytorch/examples VAE shape: a Bernoulli decoder ending in nn.Sigmoid, the reconstruction term
#     written by hand as y*log(p) + (1-y)*log(1-p) against the binarised image. The images of step 3 come
#     from a second loader that forgot ToTensor's /255 (values 0..255): decoder logits pass 17, sigmoid
#     rounds to exactly 1 (and to exactly 0 below -104), and a log of 0 is -inf.
class BernoulliVAE(nn.Module):
    def __init__(self, d: int = 16, z: int = 4, h: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.to_mu, self.to_logvar = nn.Linear(h, z), nn.Linear(h, z)
        self.decoder = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.encoder(x)
        mu, logvar = self.to_mu(h), self.to_logvar(h).clamp(-30.0, 20.0)
        return self.decoder(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)), mu, logvar


def bernoulli_vae_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x = batch
    p, mu, logvar = model(x)
    y = (x > 0.5).float()
    loglik = y * torch.log(p) + (1 - y) * torch.log(1 - p)  # <origin:bce_log>
    kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(1)
    return (-loglik.sum(1) + kl).mean()


@case("vae_bernoulli_hand_written_bce_sigmoid_decoder_images_not_divided_by_255",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "bce_log", "log_nonpositive"))
def _vae_bernoulli() -> Program:
    torch.manual_seed(0)
    model = BernoulliVAE()
    g = _gen(1508)

    def batch(step: int, raw: bool = False) -> torch.Tensor:
        x = torch.randint(0, 256, (16, 16), generator=g).float()
        return x if raw else x / 255.0

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), bernoulli_vae_loss)


# ======================================================================= 3. contrastive / metric learning
class Encoder(nn.Module):
    def __init__(self, d: int = 16, out: int = 8, bias: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 32, bias=bias), nn.ReLU(), nn.Linear(32, out, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# 3a. SimCLR's NT-Xent with the cosine similarity matrix written as z @ z.T / (|z| |z|^T) and a bias-free
#     backbone whose embedding is the ReLU'd pooled feature (torchvision-style, no projection after the
#     last ReLU). A letterboxed frame of step 3 is entirely black, and so is its augmented view: its
#     embedding is the zero vector, and its row and column of the matrix are 0 / 0.
class PooledBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def nt_xent(model: nn.Module, batch: Any, step: int, tau: float = 0.2) -> torch.Tensor:
    v1, v2 = batch
    z = torch.cat([model(v1), model(v2)])
    n = z.norm(dim=1)
    sim = z @ z.T / (n[:, None] * n[None, :])  # <origin:cos_div>
    sim = sim.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf")) / tau
    half = len(z) // 2
    targets = torch.cat([torch.arange(half, len(z)), torch.arange(half)])
    return F.cross_entropy(sim, targets)


@case("simclr_cosine_matrix_by_norm_outer_product_black_letterbox_frame",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "cos_div", "zero_variance_norm"))
def _simclr() -> Program:
    torch.manual_seed(0)
    model = PooledBackbone()
    g = _gen(1509)

    def batch(step: int, black: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(8, 16, generator=g)
        v1, v2 = x + 0.05 * torch.randn(8, 16, generator=g), x + 0.05 * torch.randn(8, 16, generator=g)
        if black:
            v1[6], v2[6] = 0.0, 0.0
        return v1, v2

    return Program(model, sgd(model, 0.05), _steps(batch, lambda s: batch(s, True)), nt_xent)


# 3b. Batch-hard triplet loss (Hermans et al.) with P x K sampling: mining on squared distances, then sqrt of
#     the two selected distances only (to save sqrt calls). The gallery of step 3 holds the same photo filed
#     under two identities (a labelling duplicate): its hardest negative is its twin at squared distance 0,
#     the margin is violated, and sqrt's derivative at 0 is infinite: 0 * inf in the gradient.
def batch_hard_triplet(model: nn.Module, batch: Any, step: int, margin: float = 0.3) -> torch.Tensor:
    x, ids = batch
    emb = model(x)
    sq = ((emb[:, None] - emb[None]) ** 2).sum(-1)
    same = ids[:, None] == ids[None]
    hardest_pos = sq.masked_fill(~same, 0.0).max(1).values
    hardest_neg = sq.masked_fill(same, float("inf")).min(1).values
    return F.relu(hardest_pos.sqrt() - hardest_neg.sqrt() + margin).mean()  # <origin:triplet_sqrt>


@case("reid_batch_hard_triplet_sqrt_of_selected_distance_duplicate_photo_two_identities",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "triplet_sqrt", "grad_singularity"))
def _triplet() -> Program:
    torch.manual_seed(0)
    model = Encoder()
    g = _gen(1510)
    centres = torch.randn(10, 16, generator=g)

    def batch(step: int, dup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randperm(10, generator=g)[:4].repeat_interleave(2)
        x = centres[ids] + 0.3 * torch.randn(8, 16, generator=g)
        if dup:
            x[5] = x[2]  # identity ids[2] != ids[5]
        return x, ids

    return Program(model, sgd(model, 0.05), _steps(batch, lambda s: batch(s, True)), batch_hard_triplet)


# 3c. InfoNCE between two views with a learnable temperature kept by the loss object and clamped at 0 in the
#     loss ("a temperature must not be negative"), trained by SGD with the model (the temperature's group with
#     momentum 0.9). Positives are near-copies, so the loss falls as the temperature falls: the momentum
#     carries tau from 0.1 to 0.075, 0.029 and then below 0 at the update of step 2 (-0.024); the clamp makes
#     it 0 at step 3: the logits are divided by 0.
class LearnedTemperatureNCE(nn.Module):
    def __init__(self, tau: float = 0.1) -> None:
        super().__init__()
        self.tau = nn.Parameter(torch.tensor(tau))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        logits = (q @ k.T) / self.tau.clamp(min=0.0)  # <origin:nce_div>
        return F.cross_entropy(logits, torch.arange(len(q)))


@case("infonce_temperature_clamped_at_zero_in_loss_object_sgd_drives_it_negative",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "nce_div", "div_by_zero"))
def _nce() -> Program:
    torch.manual_seed(0)
    model = Encoder()
    criterion = LearnedTemperatureNCE()
    opt = torch.optim.SGD([{"params": model.parameters()},
                           {"params": criterion.parameters(), "lr": 4e-3, "momentum": 0.9}], lr=1e-3)
    g = _gen(1511)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 16, generator=g)
        return x + 0.01 * torch.randn(16, 16, generator=g), x + 0.01 * torch.randn(16, 16, generator=g)

    def loss(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        return criterion(F.normalize(m(b[0]), dim=1), F.normalize(m(b[1]), dim=1))

    return Program(model, opt, [batch(s) for s in range(STEPS)], loss)


# ======================================================================= 4. diffusion
T_DIFF = 50


class Denoiser(nn.Module):
    def __init__(self, d: int = 8, h: int = 64) -> None:
        super().__init__()
        self.t_embed = nn.Embedding(T_DIFF + 1, h)
        self.inp = nn.Linear(d, h)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x) + self.t_embed(t))


# 4a. v-prediction with the loss weighted by snr / (snr + 1). The schedule is prepended with
#     alphas_cumprod = 1 so that index 0 is the clean data, and the sampler draws t in [0, T] (randint(0,
#     T + 1)). The batch of step 3 draws t = 0: snr = 1 / (1 - 1) = 1 / 0 = inf, and the weight inf / inf.
BETAS = torch.linspace(1e-4, 0.02, T_DIFF)
ALPHAS_CUMPROD = torch.cat([torch.ones(1), torch.cumprod(1 - BETAS, 0)])


def vpred_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, t, noise = batch
    ab = ALPHAS_CUMPROD[t][:, None]
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    v = ab.sqrt() * noise - (1 - ab).sqrt() * x0
    pred = model(x_t, t)
    snr = ab / (1 - ab)  # <origin:snr_div>
    weight = snr / (snr + 1)
    return (weight * (pred - v) ** 2).mean()


@case("diffusion_vpred_snr_weight_schedule_prepended_with_one_t_zero_sampled",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "snr_div", "div_by_zero"))
def _vpred() -> Program:
    torch.manual_seed(0)
    model = Denoiser()
    g = _gen(1512)

    def batch(step: int, t0: bool = False) -> tuple[torch.Tensor, ...]:
        t = torch.randint(1, T_DIFF + 1, (16,), generator=g)
        if t0:
            t[4] = 0
        return torch.randn(16, 8, generator=g), t, torch.randn(16, 8, generator=g)

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)), vpred_loss)


# 4b. Continuous-time diffusion with the cosine log-SNR schedule lambda(t) = -2 log tan(pi t / 2), without the
#     shifted bounds (logsnr_min / logsnr_max). Times are drawn as randint(0, 1001) / 1000, so t = 1.0 exactly
#     can occur (step 3). In float32 pi * 1 / 2 rounds above pi / 2: tan is -2.3e7 and its log is NaN. The
#     NaN log-SNR makes the model's inputs (z_t and the conditioning) NaN before the forward.
class LogSNRDenoiser(nn.Module):
    def __init__(self, d: int = 8, h: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, d))

    def forward(self, z: torch.Tensor, logsnr: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, logsnr[:, None] / 10], 1))


def cosine_logsnr(t: torch.Tensor) -> torch.Tensor:
    return -2 * torch.log(torch.tan(math.pi * t / 2))  # <origin:logsnr_log>


def continuous_eps_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, t, noise = batch
    lam = cosine_logsnr(t)
    alpha, sigma = torch.sigmoid(lam).sqrt()[:, None], torch.sigmoid(-lam).sqrt()[:, None]
    eps_hat = model(alpha * x0 + sigma * noise, lam)
    return F.mse_loss(eps_hat, noise)


@case("continuous_time_diffusion_cosine_logsnr_at_t_exactly_one_float32",
      Want("nonfinite_input", "forward", "aten.log.default", None, "logsnr_log", "log_nonpositive"))
def _logsnr() -> Program:
    torch.manual_seed(0)
    model = LogSNRDenoiser()
    g = _gen(1513)

    def batch(step: int, end: bool = False) -> tuple[torch.Tensor, ...]:
        t = torch.randint(1, 1000, (16,), generator=g) / 1000
        if end:
            t[11] = torch.tensor(1000) / 1000
        return torch.randn(16, 8, generator=g), t, torch.randn(16, 8, generator=g)

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)), continuous_eps_loss)


# 4c. An epsilon-prediction loss in the variational bound's form: L_t for t > 0 weighted by snr(t) = ab / (1 - ab),
#     L_0 the reconstruction of x0, chosen per sample by torch.where. The schedule is prepended with 1 as in 4a
#     and the batch of step 3 draws t = 0: the unselected L_t is (mse * 1) / 0 = inf, where() picks L_0 and
#     the loss is finite, but the division's derivative there is 0 / 0: NaN in the gradients.
def vlb_style_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, t, noise = batch
    ab = ALPHAS_CUMPROD[t]
    x_t = ab.sqrt()[:, None] * x0 + (1 - ab).sqrt()[:, None] * noise
    eps_hat = model(x_t, t)
    mse = ((eps_hat - noise) ** 2).mean(1)
    l_t = mse * ab / (1 - ab)  # <origin:vlb_div>
    x0_hat = (x_t - (1 - ab).sqrt()[:, None] * eps_hat) / ab.sqrt()[:, None]
    l_0 = ((x0_hat - x0) ** 2).mean(1)
    return torch.where(t == 0, l_0, l_t).mean()


@case("diffusion_vlb_where_picks_reconstruction_at_t_zero_snr_weighted_term_inf",
      Want("nonfinite_grad", "forward", "aten.div.Tensor", None, "vlb_div", "where_gradient_trap"))
def _vlb_where() -> Program:
    torch.manual_seed(0)
    model = Denoiser()
    g = _gen(1525)

    def batch(step: int, t0: bool = False) -> tuple[torch.Tensor, ...]:
        t = torch.randint(1, T_DIFF + 1, (16,), generator=g)
        if t0:
            t[9] = 0
        return torch.randn(16, 8, generator=g), t, torch.randn(16, 8, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), vlb_style_loss)


# ======================================================================= 5. RL
class ActorCritic(nn.Module):
    def __init__(self, obs: int = 8, actions: int = 4, h: int = 32, log_probs: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.pi, self.v = nn.Linear(h, actions), nn.Linear(h, 1)
        self.log_probs = log_probs

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        if self.log_probs:
            return torch.log(F.softmax(self.pi(h), -1)), self.v(h).squeeze(-1)  # <origin:policy_log>
        return self.pi(h), self.v(h).squeeze(-1)


# 5a. A2C whose policy returns log-probabilities computed as log(softmax(logits)) in its forward, with an
#     entropy bonus -(p * log p). The rollout of step 3 includes observations from an environment wrapper
#     that stopped normalising (raw sensor units, x 300): logit gaps pass 104, softmax underflows to exactly
#     0, log gives -inf in the model's output (made by an op, not a mask), and the entropy's 0 * -inf is NaN.
def a2c_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, returns = batch
    logp, value = model(obs)
    adv = returns - value.detach()
    policy_loss = -(logp.gather(1, actions[:, None]).squeeze(1) * adv).mean()
    entropy = -(logp.exp() * logp).sum(1).mean()
    return policy_loss + 0.5 * F.mse_loss(value, returns) - 0.01 * entropy


@case("a2c_policy_forward_log_of_softmax_raw_sensor_rollout_entropy_bonus",
      Want("nonfinite_loss", "forward", "aten.log.default", "", "policy_log", "log_nonpositive"))
def _a2c() -> Program:
    torch.manual_seed(0)
    model = ActorCritic(log_probs=True)
    g = _gen(1514)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(16, 8, generator=g)
        if raw:
            obs[:4] *= 300.0
        return obs, torch.randint(0, 4, (16,), generator=g), torch.randn(16, generator=g)

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)), a2c_loss)


# 5b. PPO's ratio exp(logp - old_logp). The collector explores epsilon-greedily but logs the log-probability
#     of the action under its own low-temperature (tau = 0.01) softmax, not under the epsilon mixture: for a
#     random action it logs about -150. At the update (step 3) the new log-probability is about -1.2, the
#     ratio exp(149) overflows float32, and with a negative advantage min(ratio * A, clip(ratio) * A) = -inf.
def ppo_loss(model: nn.Module, batch: Any, step: int, clip: float = 0.2) -> torch.Tensor:
    obs, actions, old_logp, adv, returns = batch
    logits, value = model(obs)
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(logp - old_logp)  # <origin:ppo_ratio>
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return -surrogate.mean() + 0.5 * F.mse_loss(value, returns)


@case("ppo_epsilon_greedy_collector_logs_low_temperature_logprob_ratio_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "ppo_ratio", "exp_overflow"))
def _ppo() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(1515)

    def batch(step: int, explored: bool = False) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(16, 8, generator=g)
        actions = torch.randint(0, 4, (16,), generator=g)
        with torch.no_grad():
            old_logp = F.log_softmax(model(obs)[0], -1).gather(1, actions[:, None]).squeeze(1)
        adv = torch.randn(16, generator=g)
        if explored:
            old_logp[7], adv[7] = -150.0, -0.8
        return obs, actions, old_logp, adv, torch.randn(16, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), ppo_loss)


# 5c. GRPO on a tiny GPT: G = 4 completions per prompt, advantages normalised within each prompt's group
#     (r - mean) / std, ported without TRL's "+ 1e-4". In the batch of step 3 every completion of one prompt
#     got the same reward (all wrong: 0): std = 0 and its advantages are 0 / 0. The advantages are computed
#     before the policy's forward; the NaN meets the log-probabilities in the loss.
def grpo_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    seqs, completion_mask, rewards = batch  # rewards: (prompts, G)
    adv = (rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)  # <origin:grpo_adv>
    logits = model(seqs[:, :-1])
    logp = F.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    seq_logp = (logp * completion_mask).sum(1) / completion_mask.sum(1)
    return -(adv.flatten() * seq_logp).mean()


@case("grpo_group_normalised_advantage_without_eps_all_completions_same_reward",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "grpo_adv", "zero_variance_norm"))
def _grpo() -> Program:
    torch.manual_seed(0)
    model = TinyGPT()
    g = _gen(1516)

    def batch(step: int, solved_by_none: bool = False) -> tuple[torch.Tensor, ...]:
        seqs = torch.randint(1, VOCAB, (8, BLOCK + 1), generator=g)
        mask = (torch.arange(BLOCK) >= 4).float().expand(8, BLOCK).clone()  # the completion after a 5-token prompt
        rewards = torch.randint(0, 2, (2, 4), generator=g).float()
        rewards[:, 0], rewards[:, 1] = 1.0, 0.0
        if solved_by_none:
            rewards[1] = 0.0
        return seqs, mask, rewards

    return Program(model, sgd(model, 0.05), _steps(batch, lambda s: batch(s, True)), grpo_loss)


# 5d. A2C with GAE computed in the step: the critic's values of the rollout and of the bootstrap observation are
#     read under no_grad, then the GAE loop runs, then the update's forward. The episode of step 3 ended when
#     the simulator diverged: its final observation (the bootstrap) is NaN, and the loop's mask (1 - done) is
#     0 * NaN = NaN, not 0. The batch carries the NaN; the loop and the critic only pass it on.
def a2c_gae_loss(model: nn.Module, batch: Any, step: int, gamma: float = 0.99, lam: float = 0.95) -> torch.Tensor:
    obs, actions, rewards, dones, last_obs = batch
    with torch.no_grad():
        values = model(torch.cat([obs, last_obs[None]]))[1]
        adv, gae = torch.zeros_like(rewards), torch.zeros(())
        for t in reversed(range(len(rewards))):
            delta = rewards[t] + gamma * values[t + 1] * (1 - dones[t]) - values[t]
            gae = delta + gamma * lam * (1 - dones[t]) * gae
            adv[t] = gae
        returns = adv + values[:-1]
    logits, value = model(obs)
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * adv).mean() + 0.5 * F.mse_loss(value, returns)


@case("a2c_gae_in_step_bootstrap_observation_nan_after_simulator_diverged",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input"))
def _gae_nan_obs() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(1526)

    def batch(step: int, diverged: bool = False) -> tuple[torch.Tensor, ...]:
        obs, dones = torch.randn(16, 8, generator=g), torch.zeros(16)
        last_obs = torch.randn(8, generator=g)
        if diverged:
            dones[-1], last_obs[:] = 1.0, float("nan")
        return obs, torch.randint(0, 4, (16,), generator=g), torch.randn(16, generator=g), dones, last_obs

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)), a2c_gae_loss)


# 5e. GRPO as 5c, but the group normalisation is written in place on the rewards tensor the batch brought
#     (rewards.sub_(mean).div_(std)): the division by the zero std of the all-wrong group is still the origin;
#     the batch's tensor holds NaN afterwards only because the step wrote it.
def grpo_loss_in_place(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    seqs, completion_mask, rewards = batch
    rewards.sub_(rewards.mean(1, keepdim=True)).div_(rewards.std(1, keepdim=True))  # <origin:grpo_div_>
    logits = model(seqs[:, :-1])
    logp = F.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    seq_logp = (logp * completion_mask).sum(1) / completion_mask.sum(1)
    return -(rewards.flatten() * seq_logp).mean()


@case("grpo_in_place_group_normalisation_of_batch_rewards_all_completions_same_reward",
      Want("nonfinite_loss", "forward", "aten.div_.Tensor", None, "grpo_div_", "zero_variance_norm"))
def _grpo_in_place() -> Program:
    program = _grpo()
    program.loss = grpo_loss_in_place
    return program


# 5f. REINFORCE with a mean baseline; the advantages' mean and std are read to Python for the logger and then
#     used to standardise (adv - mean) / std. The episode of step 3 earned no reward at all: every return is
#     0, the advantages are constant, their std is 0.0 and the division is 0 / 0. That the zero std went
#     through .item() does not change what it is.
def reinforce_loss(model: nn.Module, batch: Any, step: int, log: dict[str, float] | None = None) -> torch.Tensor:
    obs, actions, returns = batch
    adv = returns - returns.mean()
    adv_mean, adv_std = adv.mean().item(), adv.std().item()
    if log is not None:
        log.update(adv_mean=adv_mean, adv_std=adv_std)
    adv = (adv - adv_mean) / adv_std  # <origin:item_std_div>
    logits, _ = model(obs)
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * adv).mean()


@case("reinforce_advantage_std_read_with_item_for_logging_episode_without_reward",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "item_std_div", "zero_variance_norm"))
def _reinforce_item() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(1529)

    def batch(step: int, no_reward: bool = False) -> tuple[torch.Tensor, ...]:
        rewards = torch.zeros(16) if no_reward else (torch.rand(16, generator=g) < 0.3).float()
        returns = torch.flip(torch.cumsum(torch.flip(rewards, [0]), 0), [0])
        return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g), returns

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)), reinforce_loss)


# ======================================================================= 6. data
# 6a. Tabular regression with numeric and categorical inputs; a numeric cell of step 3 is missing (NaN in
#     the parquet) and enters the numeric projection.
class TabularNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.numeric = nn.Linear(6, 16)
        self.category = nn.Embedding(10, 16)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        return self.head(self.numeric(x_num) + self.category(x_cat)).squeeze(-1)


@case("tabular_numeric_and_categorical_missing_numeric_cell",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input"))
def _tabular_nan() -> Program:
    torch.manual_seed(0)
    model = TabularNet()
    g = _gen(1517)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, ...]:
        x_num = torch.randn(16, 6, generator=g)
        if missing:
            x_num[3, 4] = float("nan")
        return x_num, torch.randint(0, 10, (16,), generator=g), torch.randn(16, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0], b[1]), b[2]))


# 6b'. A regression script that standardises each batch in the step (x - mean) / (std + eps) before the model;
#     a cell of the batch of step 3 is missing (NaN): the column's mean and std are NaN, and the whole column
#     entering the model is NaN. The NaN came with the batch; the standardisation only spread it.
def standardised_regression(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return F.mse_loss(model(x).squeeze(-1), y)


@case("regression_standardises_batch_in_step_missing_cell_spreads_over_column",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input"))
def _standardised_nan() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    g = _gen(1527)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = 3.0 + 2.0 * torch.randn(16, 6, generator=g)
        if missing:
            x[12, 2] = float("nan")
        return x, torch.randn(16, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), standardised_regression)


# 6b''. The same script with the standardisation written in place on the batch tensor (x.sub_(mean).div_(std)),
#     and a batch of step 3 in which one sensor column is constant (a stuck sensor): std = 0 and the column is
#     0 / 0. The batch was finite when the step received it; the model's input is made non-finite by the step's
#     own division.
def standardised_in_place(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    x.sub_(x.mean(0)).div_(x.std(0))  # <origin:std_div_>
    return F.mse_loss(model(x).squeeze(-1), y)


@case("regression_standardises_batch_in_place_stuck_sensor_constant_column",
      Want("nonfinite_input", "forward", "aten.div_.Tensor", None, "std_div_", "zero_variance_norm"))
def _standardised_in_place() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    g = _gen(1531)

    def batch(step: int, stuck: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = 3.0 + 2.0 * torch.randn(16, 6, generator=g)
        if stuck:
            x[:, 4] = 21.5
        return x, torch.randn(16, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), standardised_in_place)


# 6b. A feature-tokenizer transformer (FT-Transformer's tokenizer: token_j = x_j * W_j + b_j; one block whose
#     first attention has no pre-norm, as in the paper; the tokens mean-pooled) over wallet features. The batch
#     of step 3 holds a balance exported in wei instead of ether (x 1e18: ~1e20). Every op up to the attention
#     scores is finite (~1e19-1e20); the balance token's score with itself, q . k = 8.0e38 (in float64), is beyond float32:
#     the score matmul overflows (+inf; softmax then makes NaN of its row).
class FeatureTokenizer(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(n, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., None] * self.weight + self.bias


class FTAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)  # <origin:ft_scores>
        return self.o((scores * self.scale).softmax(-1) @ self.v(x))


class FTTransformer(nn.Module):
    def __init__(self, n: int = 6, d: int = 16) -> None:
        super().__init__()
        self.tokenizer = FeatureTokenizer(n, d)
        self.attn = FTAttention(d)
        self.ffn = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokenizer(x)
        h = h + self.attn(h)
        h = h + self.ffn(h)
        return self.head(h.mean(1)).squeeze(-1)


@case("ft_transformer_wallet_balance_in_wei_attention_scores_overflow",
      Want("nonfinite_loss", "forward", "aten.bmm.default", "attn", "ft_scores", "overflow"))
def _ft_wei() -> Program:
    torch.manual_seed(1)  # the balance token scores itself positively: q . k = +inf (-inf alone is a masked key)
    model = FTTransformer()
    g = _gen(1518)

    def batch(step: int, wei: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 6, generator=g)
        if wei:
            x[2, 0] = 1e18 * 95.0  # 95 ETH, in wei
        return x, (x[:, 1] > 0).float()

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0]), b[1]))


# 6b''. A house-price regressor whose targets of step 3 come from an on-chain sale priced in wei (1.2e20): the
#     model's output is finite (the features are normalised), but the summed squared error (pred - y)^2 ~ 1.4e40
#     is beyond float32 inside mse_loss: an overflow of a finite computation on unnormalised data.
@case("price_regression_target_in_wei_mse_sum_overflow",
      Want("nonfinite_loss", "forward", "aten.mse_loss.default", None, "mse_wei", "overflow"))
def _mse_wei() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    g = _gen(1530)

    def batch(step: int, wei: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(16, 8, generator=g), 3.0 + torch.rand(16, generator=g)
        if wei:
            y[6] = 1.2e20
        return x, y

    def loss(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        return F.mse_loss(m(b[0]).squeeze(-1), b[1], reduction="sum")  # <origin:mse_wei>

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), loss)


# 6c. Regression over several data sources with per-sample weights from the source table (weight 0: the
#     synthetic source, excluded in this phase) and the weighted mean written as sum(w l) / sum(w). The
#     sampler of step 3 drew a batch from the synthetic source only: every weight is 0, 0 / 0.
def weighted_regression(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, w = batch
    per_sample = F.mse_loss(model(x).squeeze(-1), y, reduction="none")
    return (w * per_sample).sum() / w.sum()  # <origin:wmean_div>


@case("multi_source_regression_weighted_mean_batch_from_zero_weight_source",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "wmean_div", "div_by_zero"))
def _weighted_mean() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    g = _gen(1519)
    source_weight = torch.tensor([1.0, 0.5, 0.0])

    def batch(step: int, synthetic_only: bool = False) -> tuple[torch.Tensor, ...]:
        src = torch.full((16,), 2) if synthetic_only else torch.randint(0, 2, (16,), generator=g)
        return torch.randn(16, 8, generator=g), torch.randn(16, generator=g), source_weight[src]

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), weighted_regression)


# ======================================================================= 7. quiet programs
# 7a. The GPT of 1b-1c written the safe way: F.cross_entropy over the -inf-masked padded vocabulary, a z-loss
#     with torch.logsumexp, the per-sequence mean over clamp(min=1) counts; batches with an all-padding row.
def safe_lm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    idx, targets, mask = batch
    logits = model(idx)
    tok = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    per_seq = (tok * mask).sum(1) / mask.sum(1).clamp(min=1)
    z = torch.logsumexp(logits, -1)
    return per_seq.mean() + 1e-4 * ((z ** 2) * mask).sum() / mask.sum().clamp(min=1)


@quiet("gpt_padded_vocab_logsumexp_z_loss_clamped_counts_empty_document")
def _gpt_quiet() -> Program:
    torch.manual_seed(0)
    model = TinyGPT(real_vocab=60)
    g = _gen(1520)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        idx, targets = _tokens(g, hi=60)
        lengths = torch.randint(4, BLOCK + 1, (4,), generator=g)
        lengths[step % 4] = 0
        mask = (torch.arange(BLOCK)[None] < lengths[:, None]).float()
        return idx * mask.long(), targets, mask

    return Program(model, sgd(model, 0.1), [batch(s) for s in range(STEPS)], safe_lm_loss)


# 7b. The VAEs written the safe way: F.gaussian_nll_loss (variance floor eps), a softplus sigma + 1e-4 for the
#     KL, and BCE with logits; raw-unit records included.
class SafeVAE(nn.Module):
    def __init__(self, d: int = 12, z: int = 4, h: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.Tanh())
        self.to_mu, self.to_sigma = nn.Linear(h, z), nn.Linear(h, z)
        self.decoder = nn.Sequential(nn.Linear(z, h), nn.Tanh(), nn.Linear(h, 2 * d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.encoder(x)
        mu, sigma = self.to_mu(h), F.softplus(self.to_sigma(h)) + 1e-4
        x_mu, x_logit_var = self.decoder(mu + sigma * torch.randn_like(sigma)).chunk(2, -1)
        return x_mu, F.softplus(x_logit_var), mu, sigma


def safe_vae_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x = batch
    x_mu, x_var, mu, sigma = model(x)
    nll = F.gaussian_nll_loss(x_mu, x, x_var, reduction="sum") / len(x)
    kl = 0.5 * (sigma ** 2 + mu ** 2 - 1 - 2 * torch.log(sigma)).sum(1).mean()
    binary = F.binary_cross_entropy_with_logits(x_mu, (x > 0).float())
    return nll + kl + binary


@quiet("vae_gaussian_nll_module_softplus_sigma_bce_with_logits_raw_records")
def _vae_quiet() -> Program:
    torch.manual_seed(0)
    model = SafeVAE()
    g = _gen(1521)

    def batch(step: int) -> torch.Tensor:
        x = torch.randn(16, 12, generator=g)
        x[step] *= 50.0
        return x

    return Program(model, sgd(model, 1e-4), [batch(s) for s in range(STEPS)], safe_vae_loss)


# 7c. SimCLR written the safe way (F.normalize, eps) with black frames, and a CLIP-style learned log-scale
#     clamped at 100.
class ClipStyleNCE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = PooledBackbone()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        z1, z2 = F.normalize(self.encoder(v1), dim=1), F.normalize(self.encoder(v2), dim=1)
        logits = self.logit_scale.exp().clamp(max=100) * z1 @ z2.T
        labels = torch.arange(len(z1))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


@quiet("clip_style_contrastive_normalize_eps_black_frames")
def _nce_quiet() -> Program:
    torch.manual_seed(0)
    model = ClipStyleNCE()
    g = _gen(1522)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(8, 16, generator=g)
        v1, v2 = x + 0.05 * torch.randn(8, 16, generator=g), x + 0.05 * torch.randn(8, 16, generator=g)
        v1[step], v2[step] = 0.0, 0.0
        return v1, v2

    return Program(model, sgd(model, 0.05), [batch(s) for s in range(STEPS)], lambda m, b, s: m(*b))


# 7d. GRPO and PPO written the safe way: std + 1e-4 over a group with equal rewards, the PPO log-ratio clamped
#     before exp, the log-probabilities from log_softmax on raw-unit observations.
def safe_rl_loss(model: nn.Module, batch: Any, step: int, clip: float = 0.2) -> torch.Tensor:
    obs, actions, old_logp, rewards = batch
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    logits, value = model(obs)
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return -surrogate.mean() + 0.5 * F.mse_loss(value, rewards.flatten())


@quiet("grpo_ppo_eps_std_clamped_log_ratio_raw_observations")
def _rl_quiet() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(1523)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(16, 8, generator=g)
        obs[step] *= 300.0
        old_logp = torch.full((16,), -1.4)
        old_logp[step + 1] = -150.0
        rewards = torch.randint(0, 2, (4, 4), generator=g).float()
        rewards[step % 4] = 0.0
        return obs, torch.randint(0, 4, (16,), generator=g), old_logp, rewards

    return Program(model, sgd(model, 1e-3), [batch(s) for s in range(STEPS)], safe_rl_loss)


# 7e. The v-prediction of 4a with the schedule not prepended (t in [1, T]) and the min-SNR-5 weight, and the
#     continuous-time loss of 4b with t drawn in (0, 1) and log-SNR clipped to [-20, 20].
def safe_diffusion_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, t, noise = batch
    ab = ALPHAS_CUMPROD[t][:, None]
    x_t, v = ab.sqrt() * x0 + (1 - ab).sqrt() * noise, ab.sqrt() * noise - (1 - ab).sqrt() * x0
    snr = ab / (1 - ab)
    weight = snr.clamp(max=5.0) / (snr + 1)
    return (weight * (model(x_t, t) - v) ** 2).mean()


@quiet("diffusion_vpred_min_snr_weight_t_from_one")
def _diffusion_quiet() -> Program:
    torch.manual_seed(0)
    model = Denoiser()
    g = _gen(1524)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        t = torch.randint(1, T_DIFF + 1, (16,), generator=g)
        t[0], t[1] = 1, T_DIFF
        return torch.randn(16, 8, generator=g), t, torch.randn(16, 8, generator=g)

    return Program(model, sgd(model, 1e-2), [batch(s) for s in range(STEPS)], safe_diffusion_loss)


# ======================================================================= the independent oracle
class FirstNonFinite(TorchDispatchMode):
    """The first dispatched op that made a non-finite value: its output holds NaN while no input did, or an
    infinity while every input and scalar argument was finite (an explicit -inf fill is not a creation).
    Notes the innermost module of ``model`` running (torch's global module hooks) and the deepest line of
    this file on the Python stack; also the op that raised, if one did."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.found: tuple[str, str | None, int | None] | None = None
        self.raised: tuple[str, str | None, int | None] | None = None

    def __enter__(self) -> FirstNonFinite:
        pre = nn.modules.module.register_module_forward_pre_hook(self._push)
        post = nn.modules.module.register_module_forward_hook(self._pop)
        self._hooks = (pre, post)
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
        if self.found is None:  # read before the op runs: an in-place op writes its input
            flat_in = tree_flatten((args, kwargs))[0]
            ins = [t for t in flat_in if isinstance(t, torch.Tensor) and t.is_floating_point()]
            nums = [x for x in flat_in if isinstance(x, float)]
            in_nan = any(bool(t.isnan().any()) for t in ins)
            in_bad = in_nan or any(not bool(t.isfinite().all()) for t in ins) or any(not math.isfinite(x) for x in nums)
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.raised is None:
                self.raised = (str(func), *self._where())
            raise
        if self.found is None:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            out_nan = any(bool(t.isnan().any()) for t in outs)
            out_inf = any(bool(t.isinf().any()) for t in outs)
            if (out_nan and not in_nan) or (out_inf and not in_bad):
                self.found = (str(func), *self._where())
        return out


def first_nonfinite_node(loss: torch.Tensor) -> str | None:
    """The first autograd node, in the order the backward ran them, whose outputs (the gradients it passes on)
    hold a non-finite value while the gradients it received were finite (a post-hook on every node)."""
    found: list[str] = []
    seen, todo, hooks = set(), [loss.grad_fn], []

    def hook(node: Any) -> Callable:
        def check(grad_inputs: Any, grad_outputs: Any) -> None:
            ok_in = _finite(g for g in grad_outputs if isinstance(g, torch.Tensor))
            ok_out = _finite(g for g in grad_inputs if isinstance(g, torch.Tensor))
            if ok_in and not ok_out and not found:
                found.append(node.name())
        return check

    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        hooks.append(node.register_hook(hook(node)))
        todo.extend(n for n, _ in node.next_functions)
    loss.backward()
    for h in hooks:
        h.remove()
    return found[0] if found else None


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _batch_finite(batch: Any) -> bool:
    return _finite(t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())


def plain_run(program: Program) -> dict[str, Any]:
    """The loop without nantrace: the first step whose loss or gradients are non-finite or that raises, and
    what (``raised`` / ``loss`` / ``grads``), plus the batch's finiteness there; the origin at that step from
    FirstNonFinite (a forward re-run of that step's loss code from the same state and RNG) and, for a
    gradient, from anomaly mode."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        received = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)  # loss code may write it
        batch_ok = _batch_finite(received)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        try:
            loss = run_step(program, program.loss, batch, step)
        except Exception as exc:
            torch.set_rng_state(rng)
            mode = FirstNonFinite(model)
            with pytest.raises(type(exc)), mode:
                program.loss(model, received, step)
            return dict(step=step, what="raised", error=exc, origin=mode.raised, batch_ok=batch_ok)
        grads_ok = _finite(p.grad for p in model.parameters())
        loss_ok = bool(torch.isfinite(loss).all())
        if not (loss_ok and grads_ok):
            model.load_state_dict(state)
            torch.set_rng_state(rng)
            mode = FirstNonFinite(model)
            copy = lambda: tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, received)  # noqa: E731
            with mode:
                program.loss(model, copy(), step)
            anomaly = node = None
            if loss_ok:
                torch.set_rng_state(rng)
                with torch.autograd.detect_anomaly(check_nan=True):
                    try:
                        program.loss(model, copy(), step).backward()
                    except RuntimeError as exc:
                        anomaly = str(exc)
                torch.set_rng_state(rng)
                model.zero_grad()
                node = first_nonfinite_node(program.loss(model, copy(), step))
            return dict(step=step, what="loss" if not loss_ok else "grads", origin=mode.found, anomaly=anomaly,
                        node=node, batch_ok=batch_ok)
        opt.step()
        if not _finite(model.parameters()):
            return dict(step=step, what="params", origin=None, batch_ok=batch_ok)
    return dict(step=None, what=None, origin=None)


# ======================================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_input": "loss", "nonfinite_grad": "grads", "exception": "raised"}
BACKWARD_NODE = {"aten.sqrt.default": "SqrtBackward0"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails first at the expected step in the expected way;
    a data case's batch carries the non-finite value, any other case's batch is finite; the first op that
    made a non-finite value (or raised) is the expected op, in the expected module, on the marked line; a
    backward origin is the expected node under anomaly mode."""
    build, want = CASES[name]
    run = plain_run(build())
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    assert run["batch_ok"] is (want.phase != "data"), run
    if want.phase == "data":
        return
    if want.phase == "backward":
        assert run["node"] == BACKWARD_NODE[want.op] and run["origin"] is None, run  # the forward is finite
    else:
        op, module, line = run["origin"]
        assert op == want.op, run
        assert module == want.module, run
        assert line == JUDGE.marked(want.tag)[1], (run, JUDGE.marked(want.tag))


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
