"""Held-out failures, round 15b: failures whose cause shows only ACROSS STEPS or in the OPTIMIZER /
PRECISION machinery, in programs shaped like public training code (a Flamingo-style VLM, a nanoGPT, an
RGB-D CNN, a tf-idf text classifier, a ResNet-style MLP with stochastic depth, a resumed tabular model,
a float16 CNN with progressive resizing, an AMP regression, an IRNN language model, a learned Kalman
filter, an RLHF-style sampler, a BERT-style classifier with an extended tokenizer).

1. THE OPTIMIZER MAKES THE FIRST NON-FINITE VALUE (finite loss and gradients, non-finite parameters
   after the update): AdamW with ``eps=0`` on Flamingo's gated cross-attention whose tanh gates start at
   0 (every parameter behind a gate gets an exactly zero gradient: 0 / (sqrt(0) + 0)); RMSprop with
   ``eps=0`` on an RGB-D CNN fed an RGB-only data set (the depth map zero-filled: the depth filters'
   gradient is 0); Adagrad with ``eps=0`` on a sparse ``EmbeddingBag`` weighted by hand-written tf-idf,
   where a token present in every document has idf = log(N / N) = 0 (its row is IN the sparse gradient,
   with value 0); NAdam(W) with ``eps=0`` on a nanoGPT trained on half its context (the position rows
   beyond it never get a gradient); torch's own ``torch.optim.Adafactor`` given Hugging Face's
   ``eps=(1e-30, 1e-3)`` (torch squares eps1: 1e-60 is 0 in float32, and the unused rows of a padded
   vocabulary get rsqrt(0) * 0); a LARS written from the paper (no weight decay at fine-tuning) on a
   residual MLP with batch-mode stochastic depth (a dropped block's gradient is exactly 0, and the
   trust ratio ||w|| / ||g|| is ||w|| / 0); TransE entity embeddings renormalised to unit length by a
   STEP POST-HOOK (``register_step_post_hook``), whose ``<pad>`` row (padding_idx=0) is 0 / 0 -- code
   of ``optimizer.step()``, so phase ``optimizer``, the hook's op and line, and ``zero_variance_norm``
   (docs/diagnosis.md: a row divided by its own norm).
   Expected (docs/diagnosis.md "The optimizer's update", rounds 5a/8b): kind ``nonfinite_param``, phase
   ``optimizer``, op = the update op that made the first non-finite value, module = the module holding
   the first parameter that went non-finite (in the optimizer's order), source = the user's
   ``optimizer.step()`` line for torch's optimizers, the optimizer's own line for a Python one; cause
   ``optimizer_state`` when the zero divisor is an element-wise function of the running state
   (Adam's/NAdam's ``sqrt(v) + 0``, RMSprop's ``sqrt(square_avg) + 0``, Adagrad's
   ``sqrt(state_sum) + 0``, Adafactor's clamped variance estimate), ``div_by_zero`` when it is a norm of
   this step's gradient (the LARS trust ratio).
2. THE OPTIMIZER STATE ALREADY NON-FINITE: a run resumed from a checkpoint whose Adam ``exp_avg_sq``
   holds one NaN for one parameter (and the same with a hand-written LAMB's ``exp_avg``). The first update
   makes that parameter NaN. Kind ``nonfinite_param``
   (what the step's check sees), phase ``optimizer``, cause ``optimizer_state`` (API.md: "optimizer state
   turned non-finite"), module the parameter's holder; op and source ``None``: the origin rule names the
   op that CREATED the NaN, and no op of the run did (it came in with the loaded state, as a NaN loaded
   into a parameter has op ``None``).
3. LOW PRECISION ON THE CPU: a ``.half()`` CNN trained with progressive resizing on pixels left in 0..255,
   whose hand-written global pooling ``f.sum((2, 3)) / (H * W)`` overflows float16 at the 64 px stage
   (finite in float32: ``precision_overflow``, the ``sum``, the model's own forward, module ``""``); an
   fp16-autocast regression with ``torch.amp.GradScaler("cpu")`` and a ``reduction="sum"`` loss whose
   listing feed switches from thousands to dollars at step 3: the head's weight gradient (a sum over
   the batch) overflows float16 at every scale >= 1, so every step skips and the scale collapses
   (docs/escalation.md: replayed at scale 1, still non-finite: ``scaler_collapse`` at the first skip,
   phase ``backward``, the head's ``addmm``); a pure-float16 model (no master weights) with a sum-reduced
   loss: SGD's momentum buffer sums finite gradients past 65504 after ten steps (``nonfinite_param``), and
   Adam with LLM-style ``betas=(0.9, 0.95)`` overflows its second moment at the third step while every
   parameter stays finite (kind ``optimizer_state``); both finite when the update is replayed in float32:
   ``precision_overflow`` (the float32 analogue, r8b's Adam second moment, is ``overflow``).
   SPARSE GRADIENTS: a two-tower recommender trained the fastText way (``EmbeddingBag(sparse=True)``,
   ``Embedding(sparse=True)``, plain SGD) whose user tower normalises its projected history by a
   hand-written ``sqrt(sum(u^2))`` plus an eps: a cold-start user (empty history) makes the sqrt's
   derivative infinite at 0 (``grad_singularity``, phase ``backward``, module ``user_tower``).
4. A DIVERGENCE THAT ENDS IN NaN: an IRNN language model (Le et al. 2015: ReLU RNN, identity recurrent
   init), no clipping, a linear warm-up to a peak LR 10x too high. The brief's LSTM LM was tried first:
   an LSTM LM without clipping at lr 20, 200, 2e3 or 2e4 never goes non-finite (its gates saturate, so
   activations and gradients stay bounded: the loss just grows), so it is a QUIET program here (5.). The
   IRNN's loss rises three steps in a row by >> 64x, then its forward overflows. Under the default config
   the first blocking incident is the finite divergence (docs/escalation.md), between the documented
   rule's step and the first non-finite step; with ``finite_anomaly_action="log"`` the divergence is
   logged and the first blocking incident is the forward overflow: ``nonfinite_loss``, the op the oracle
   finds, cause ``overflow`` (API.md: a symptom; docs/diagnosis.md "history": an overflow at the end of a
   multiplicative growth keeps the op's cause). And the brief's GAN, with two guards in its own loop: a
   discriminator SGD LR of 3.0 (an exponent lost from "3e-4"); BCE-with-logits does not overflow by itself, but
   D's loss grows super-exponentially and the values go non-finite at step 6: the first blocking incident is D's
   guard's finite divergence (``loss_spike``/``loss_divergence``) in the documented rule's window.
5. PARAMETERS / BUFFERS ALREADY NON-FINITE BEFORE THE STEP: a classifier fine-tuned from a checkpoint
   with one NaN in a FROZEN backbone layer (not in the optimizer); a running input normaliser whose
   ``running_var`` is updated by hand in the loss code after the forward, with the unbiased variance of
   the epoch's last batch of ONE sample (NaN): the next step's forward reads it. Kind and cause
   ``nonfinite_param``, phase / op / source ``None``, module the holder, action ``raised`` (API.md: a
   parameter already non-finite cannot be repaired by skipping).
6. FAILURES THAT RAISE (kind ``exception``, action ``raised``, the user's own exception propagates):
   RLHF-style sampling with a hand-written nucleus filter without the shift that keeps the first token
   and ``top_p=0.0`` ("0 = off"): every token is filtered, softmax over -inf rows is NaN and
   ``torch.multinomial`` raises (origin: the softmax, ``masked_softmax_all``); a learned Kalman filter
   whose measurement noise comes from a recording's calibration frames, noise-free in a simulated
   recording, with a known start state: the innovation covariance is 0 and ``torch.linalg.cholesky``
   raises (``domain_error``); a relevance probability summed from a softmax over topics that rounds above
   1 and is clamped only from below before ``F.binary_cross_entropy`` (``domain_error``); a pad token
   added to the tokenizer without resizing the embedding, met by the first batch that needs padding
   (``label_out_of_range``).
7. QUIET programs (no incident at all): the Flamingo gate with AdamW's default eps, a Barlow Twins-style
   LARS (its ``torch.where`` guards) on the same stochastic-depth model, a bfloat16-autocast GPT, the
   AMP regression in thousands with a mean loss, the nucleus sampler with the shift, and the LSTM LM at
   the word_language_model example's lr=20 without clipping.

How expectations were derived: each from the construction and the documents above, before nantrace ran.
``test_cases_fail_without_nantrace`` checks each construction in plain torch: the step and the stage
(loss, gradients, parameters or state after the update, or the exception and its message) of the first
failure; the first op whose inputs were finite and whose output (or an argument it wrote: in-place,
fused and sparse kernels) was not (``FirstBad``, a TorchDispatchMode written here, which also tracks the
module that issued a forward op and the autograd node of a backward one), its line in this file and its
module; for optimizer cases the first parameter (in the optimizer's order) that went non-finite; for
the scaler case that the step's gradients are non-finite at scale 1 too and that the plain scaler skips
every step from 3; for divergence the documented rules; for the quiet programs that nothing is
non-finite and no documented rule holds.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import (MODES, Judge, Program, Run, _blocking, assert_diagnosis, case_params, describe, run_step,
                             same, snapshot, train)
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
"""Cases whose expected step is a documented rule's step on the plain run (a window, checked there)."""
CONFIGS: dict[str, dict[str, Any]] = {}
"""Config groups a case runs under (besides ``print_incidents=False``)."""
AMP: set[str] = set()
"""Cases trained with fp16 autocast and a GradScaler (``train_amp``)."""
RAISES: dict[str, tuple[type, str]] = {}
"""Exception cases: the exception type and a piece of its message (checked in the construction)."""
QUIET: dict[str, Callable[[], Program]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
_WHY: dict[str, str] = {}
XFAIL.update({f"{name}[{mode}]": why for name, why in _WHY.items() for mode in MODES})


def case(name: str, want: Want, *, diverging: bool = False, config: dict[str, Any] | None = None,
         amp: bool = False, raises: tuple[type, str] | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if diverging:
            DIVERGING.add(name)
        if config:
            CONFIGS[name] = config
        if amp:
            AMP.add(name)
        if raises:
            RAISES[name] = raises
        return build

    return register


def quiet(name: str, *, amp: bool = False) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in QUIET, name
        QUIET[name] = build
        if amp:
            AMP.add(name)
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def raised(phase: str, op: str | None, module: str | None, tag: str | None, cause: str) -> Want:
    return Want("exception", phase, op, module, tag, cause, action="raised")


# ================================================================= 1. the optimizer makes the NaN
# 1a. A Flamingo-style VLM (Alayrac et al. 2022): a frozen vision encoder and a frozen LM, trained through a
#     perceiver-like resampler and GATED XATTN-DENSE layers whose tanh gates are initialised at 0 so that the
#     LM starts unchanged. Behind a gate at 0 every parameter (the resampler included: the media reach the
#     LM only through the gated cross-attention) gets an exactly zero gradient at step 0; only the gates
#     learn. The AdamW config has eps=0.0. First parameter in the optimizer's order: resampler.weight.
class GatedXAttnDense(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ff_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, media: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + torch.tanh(self.attn_gate) * self.attn(h, media, media, need_weights=False)[0]
        return x + torch.tanh(self.ff_gate) * self.ff(self.norm2(x))


class TinyFlamingo(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 32, patch: int = 48) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(patch, d), nn.GELU())  # "pretrained", frozen
        self.resampler = nn.Linear(d, d)
        self.tok_emb = nn.Embedding(vocab, d)  # the frozen LM
        self.gated = GatedXAttnDense(d)
        self.lm_block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.lm_head = nn.Linear(d, vocab)
        for frozen in (self.vision, self.tok_emb, self.lm_block, self.lm_head):
            frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        media = self.resampler(self.vision(patches))
        x = self.gated(self.tok_emb(tokens), media)
        return self.lm_head(x + self.lm_block(x))


def caption_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    tokens, patches = b
    logits = m(tokens[:, :-1], patches)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _flamingo(eps: float) -> Program:
    torch.manual_seed(0)
    model = TinyFlamingo()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.05, eps=eps)
    g = _gen(1501)
    batches = [(torch.randint(0, 40, (4, 9), generator=g), torch.randn(4, 6, 48, generator=g)) for _ in range(5)]
    return Program(model, opt, batches, caption_loss)


case("flamingo_gated_xattn_tanh_gates_at_zero_adamw_eps0",
     Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "resampler", "opt_step", "optimizer_state",
          step=0))(lambda: _flamingo(0.0))
quiet("quiet_flamingo_gated_xattn_tanh_gates_at_zero_adamw_default_eps")(lambda: _flamingo(1e-8))


# 1b. An RGB-D scene classifier (4 input channels) fine-tuned first on an RGB-only data set whose loader fills
#     the missing depth map with zeros. The stem's depth filters see only zeros: their gradient is exactly 0,
#     RMSprop's square average stays 0, and with eps=0.0 (a Caffe solver's "delta: 0" ported as is) the update
#     grad / (sqrt(0) + 0) is 0 / 0 at step 0.
class RGBDSceneNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 8, 3, padding=1)
        self.block = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, rgbd: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(rgbd)).mean((2, 3)))


@case("rgbd_cnn_rgb_only_dataset_zero_depth_rmsprop_eps0",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "stem", "opt_step", "optimizer_state", step=0))
def _rgbd() -> Program:
    torch.manual_seed(0)
    model = RGBDSceneNet()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.99, eps=0.0)
    g = _gen(1502)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rgb = torch.rand(4, 3, 12, 12, generator=g)
        depth = torch.zeros(4, 1, 12, 12)  # no depth sensor in this data set
        return torch.cat([rgb, depth], 1), torch.randint(0, 5, (4,), generator=g)

    return Program(model, opt, [batch(s) for s in range(5)], lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1c. A tf-idf weighted bag-of-words classifier: nn.EmbeddingBag(mode="sum", sparse=True) with per-sample
#     weights tf * idf, idf = log(N / df) written by hand (no smoothing). Token 1 (a boilerplate header word)
#     occurs in every document: idf = 0, so its row is in every sparse gradient with value 0. Adagrad (sparse
#     path) with eps=0.0 and no initial accumulator (TensorFlow's Adagrad has no epsilon; its accumulator's
#     0.1 was not ported): grad_values / (sqrt(state_sum) + 0) = 0 / 0 for that row at step 0.
class TfidfBagClassifier(nn.Module):
    def __init__(self, vocab: int = 60, d: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, d, mode="sum", sparse=True)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens, offsets, per_sample_weights=weights)))


def _tfidf_corpus(g: torch.Generator, n_docs: int = 40, vocab: int = 60) -> list[torch.Tensor]:
    docs = []
    for _ in range(n_docs):
        body = torch.randint(2, vocab, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
        docs.append(torch.cat([torch.tensor([1]), body]))  # every document starts with the header word
    return docs


@case("tfidf_bag_sparse_embeddingbag_adagrad_eps0_idf_zero_header_token",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "embed", "opt_step", "optimizer_state", step=0))
def _tfidf() -> Program:
    torch.manual_seed(0)
    model = TfidfBagClassifier()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05, eps=0.0)
    g = _gen(1503)
    docs = _tfidf_corpus(g)
    df = torch.zeros(60)
    for d in docs:
        df[d.unique()] += 1
    idf = torch.log(len(docs) / df.clamp(min=1))
    labels = torch.randint(0, 4, (len(docs),), generator=g)

    def batch(i: int) -> tuple[torch.Tensor, ...]:
        chunk = docs[8 * i: 8 * i + 8]
        tokens = torch.cat(chunk)
        offsets = torch.tensor([0] + [len(d) for d in chunk[:-1]]).cumsum(0)
        tf = torch.cat([torch.ones(len(d)) / len(d) for d in chunk])
        return tokens, offsets, tf * idf[tokens], labels[8 * i: 8 * i + 8]

    return Program(model, opt, [batch(i) for i in range(5)],
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1], b[2]), b[3]))


# 1d. nanoGPT (wte/wpe/h/ln_f in a ModuleDict, lm_head tied to wte) with block_size 16, trained on
#     sequences of 8 tokens in a first phase: the position rows 8..15 never get a gradient. NAdam with
#     decoupled weight decay ("NAdamW") and eps=0.0: those rows' update is 0 / (sqrt(0) + 0) at step 0. The
#     tied wte gets gradient through the head in every row, so transformer.wpe is the first to go NaN.
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), CausalSelfAttention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 24, block_size: int = 16, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block_size, d),
                                              h=nn.ModuleList([GPTBlock(d, heads)]), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_loss(m: nn.Module, b: torch.Tensor, step: int) -> torch.Tensor:
    logits = m(b[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))


def _periodic(g: torch.Generator, batch: int, t: int, vocab: int) -> torch.Tensor:
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + 5 * torch.arange(t)) % vocab


@case("nanogpt_nadamw_eps0_first_phase_half_context_position_rows",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "transformer.wpe", "opt_step", "optimizer_state",
           step=0))
def _nanogpt_nadam() -> Program:
    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.NAdam(model.parameters(), lr=6e-4, weight_decay=0.1, decoupled_weight_decay=True, eps=0.0)
    g = _gen(1504)
    return Program(model, opt, [_periodic(g, 8, 9, 24) for _ in range(5)], gpt_loss)


# 1d'. torch's own Adafactor (torch.optim.Adafactor, torch >= 2.5) given the Hugging Face config's
#     eps=(1e-30, 1e-3). torch squares eps1 before clamping the variance estimate: 1e-60, which is 0 in float32, so
#     for the embedding rows of a vocabulary padded to 64 whose ids never occur (zero gradient, zero row statistic)
#     the update is rsqrt(0) * 0 = inf * 0 = NaN at step 0. The zero is the state's (the factored second moment),
#     clamped by a setting that rounds to 0: optimizer_state.
class T5StyleClassifier(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head((h + self.encoder(h)).mean(1))


@case("torch_adafactor_hf_eps_1e30_squared_underflows_padded_vocabulary_rows",
      Want("nonfinite_param", "optimizer", "aten.rsqrt_.default", "embed", "opt_step", "optimizer_state", step=0))
def _torch_adafactor() -> Program:
    torch.manual_seed(0)
    model = T5StyleClassifier()
    hf_config = {"learning_rate": 1e-2, "adafactor_eps": (1e-30, 1e-3)}
    opt = torch.optim.Adafactor(model.parameters(), lr=hf_config["learning_rate"], eps=hf_config["adafactor_eps"])
    g = _gen(1520)
    batches = [(torch.randint(0, 50, (8, 10), generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    return Program(model, opt, batches, lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1e. A residual MLP with stochastic depth in torchvision's "batch" mode (one Bernoulli draw per block and
#     batch; the block is computed and multiplied by 0 when dropped: every parameter of a dropped block gets
#     an exactly zero gradient), fine-tuned with LARS written from the paper's Algorithm 1 and no weight decay
#     at this stage: local_lr = eta * ||w|| / ||g|| = ||w|| / 0 = inf for the dropped block, and the momentum
#     update g * inf = 0 * inf = NaN. Block 1 (p = 0.25) is the first dropped, at step 1 (global RNG, seed 0).
def stochastic_depth(x: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """torchvision.ops.stochastic_depth, ported."""
    if not training or p == 0.0:
        return x
    survival_rate = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return x * noise


class ResBlock(nn.Module):
    def __init__(self, d: int, drop: float) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d), drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + stochastic_depth(self.fc2(F.gelu(self.fc1(self.norm(x)))), self.drop, "batch", self.training)


class ResMLP(nn.Module):
    def __init__(self, d_in: int = 12, d: int = 32, classes: int = 6,
                 drops: tuple[float, ...] = (0.0, 0.25, 0.5)) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([ResBlock(d, p) for p in drops])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LARS(torch.optim.Optimizer):
    """LARS (You et al. 2017, Algorithm 1) as written in the paper: no guard for a zero gradient."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, eta: float = 1e-3,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                local_lr = group["eta"] * p.norm() / d_p.norm()  # <origin:lars_local_lr>
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(d_p * local_lr, alpha=group["lr"])
                p.sub_(buf)


class BarlowLARS(torch.optim.Optimizer):
    """The LARS of Barlow Twins / VICReg (facebookresearch): the trust ratio only where both norms are > 0."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, eta: float = 1e-3,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                dp = p.grad.add(p, alpha=g["weight_decay"]) if g["weight_decay"] else p.grad
                param_norm, update_norm = torch.norm(p), torch.norm(dp)
                one = torch.ones_like(param_norm)
                trust = torch.where(update_norm > 0, g["eta"] * param_norm / update_norm, one)
                q = torch.where(param_norm > 0.0, trust, one)
                dp = dp.mul(q)
                mu = self.state[p].setdefault("mu", torch.zeros_like(p))
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def _resmlp(opt_cls: type, n: int) -> Program:
    torch.manual_seed(0)
    model = ResMLP()
    g = _gen(1505)
    batches = [(torch.randn(16, 12, generator=g), torch.randint(0, 6, (16,), generator=g)) for _ in range(n)]
    return Program(model, opt_cls(model.parameters(), lr=0.5), batches, lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


LARS_DROP_STEP = 1
"""The first step whose batch-mode draw drops a block (block 1; found with plain torch, seed 0)."""
case("resmlp_batch_stochastic_depth_paper_lars_no_weight_decay_dropped_block",
     Want("nonfinite_param", "optimizer", "aten.div.Tensor", "blocks.1.norm", "lars_local_lr", "div_by_zero",
          step=LARS_DROP_STEP))(lambda: _resmlp(LARS, 5))
quiet("quiet_resmlp_batch_stochastic_depth_barlow_twins_lars_where_guard")(lambda: _resmlp(BarlowLARS, 8))


# ================================================================= 2. the optimizer state already NaN
# A churn model resumed from a checkpoint ({"model", "optimizer"}, torch.save / torch.load) written by a run
# whose last bad batch left one NaN in Adam's exp_avg_sq of encoder.2.weight (the model's weights were saved
# finite). The resumed run's first update: denom = sqrt(NaN) + eps = NaN -> that weight element is NaN.
class ChurnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _churn_batches(g: torch.Generator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(n):
        x = torch.randn(16, 10, generator=g)
        out.append((x, (x[:, 0] + x[:, 1] > 0).long()))
    return out


@case("resumed_adam_checkpoint_nan_in_one_exp_avg_sq",
      Want("nonfinite_param", "optimizer", None, "encoder.2", None, "optimizer_state", step=0))
def _resumed_state() -> Program:
    torch.manual_seed(0)
    g = _gen(1506)
    old = ChurnModel()
    old_opt = torch.optim.Adam(old.parameters(), lr=1e-3)
    for x, y in _churn_batches(g, 3):  # the previous run
        old_opt.zero_grad()
        F.cross_entropy(old(x), y).backward()
        old_opt.step()
    state = old_opt.state_dict()
    state["state"][2]["exp_avg_sq"][5, 7] = float("nan")  # what the old run's bad last batch left
    buf = io.BytesIO()
    torch.save({"model": old.state_dict(), "optimizer": state}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    model = ChurnModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return Program(model, opt, _churn_batches(g, 4), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 2b. The same resume with a hand-written LAMB (a Python optimizer; its trust ratio guarded by torch.where): one NaN
#     in exp_avg of head.weight makes that element of the update NaN, the update's norm NaN (the guard then takes
#     a trust ratio of 1) and the element lands in head.weight. No op creates the NaN here either: op and source
#     None, cause optimizer_state.
class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01) -> None:
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
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (st["exp_avg"] / (1 - b1 ** st["step"])) / (
                    (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(group["lr"] * trust * update)


@case("resumed_hand_written_lamb_checkpoint_nan_in_one_exp_avg",
      Want("nonfinite_param", "optimizer", None, "head", None, "optimizer_state", step=0))
def _resumed_lamb() -> Program:
    torch.manual_seed(0)
    g = _gen(1517)
    old = ChurnModel()
    old_opt = Lamb(old.parameters())
    for x, y in _churn_batches(g, 3):
        old_opt.zero_grad()
        F.cross_entropy(old(x), y).backward()
        old_opt.step()
    state = old_opt.state_dict()
    state["state"][4]["exp_avg"][1, 3] = float("nan")
    model = ChurnModel()
    opt = Lamb(model.parameters())
    model.load_state_dict(old.state_dict())
    opt.load_state_dict(state)
    return Program(model, opt, _churn_batches(g, 4), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 2c. TransE-style knowledge-graph embeddings, whose entity vectors are kept on the unit sphere after every update
#     by a step post-hook (opt.register_step_post_hook, as "after optimizer.step(): normalise"). The entity
#     vocabulary reserves id 0 for <pad> with padding_idx=0: that row is zero from the start and never gets a
#     gradient, and the hook's w / ||w|| is 0 / 0 there at the first step. The hook is code of optimizer.step()
#     (torch runs it inside step's wrapper): phase optimizer, the hook's op and line, the module holding the
#     parameter; a row divided by its own norm is zero_variance_norm (docs/diagnosis.md, parameter writes).
class TransE(nn.Module):
    def __init__(self, entities: int = 30, relations: int = 4, d: int = 16) -> None:
        super().__init__()
        self.entity = nn.Embedding(entities, d, padding_idx=0)
        self.relation = nn.Embedding(relations, d)

    def forward(self, h: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (self.entity(h) + self.relation(r) - self.entity(t)).norm(p=1, dim=-1)


def transe_loss(m: nn.Module, b: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    h, r, t, t_neg = b
    return F.relu(1.0 + m(h, r, t) - m(h, r, t_neg)).mean()


@case("transe_unit_norm_step_post_hook_padding_entity_row_zero",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "entity", "unit_norm", "zero_variance_norm", step=0))
def _transe() -> Program:
    torch.manual_seed(0)
    model = TransE()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def normalise_entities(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            w = model.entity.weight
            w.div_(w.norm(dim=1, keepdim=True))  # <origin:unit_norm>

    opt.register_step_post_hook(normalise_entities)
    g = _gen(1518)
    batches = [(torch.randint(1, 30, (16,), generator=g), torch.randint(0, 4, (16,), generator=g),
                torch.randint(1, 30, (16,), generator=g), torch.randint(1, 30, (16,), generator=g)) for _ in range(4)]
    return Program(model, opt, batches, transe_loss)


# 2d. A two-tower recommender trained the fastText / word2vec way: sparse embeddings (EmbeddingBag(sparse=True),
#     Embedding(sparse=True)) and plain SGD, which takes sparse gradients. The user tower normalises the summed
#     history by its length with an eps (forward finite for an empty history), the length written by hand as
#     sqrt(sum(u^2)) of the projected history. Step 3's batch holds a cold-start user (empty history): u = 0, the
#     forward is finite, and the derivative of the sqrt at 0 is infinite (times a zero gradient: NaN), which reaches
#     the projection's weight -- grad_singularity, backward. (Without the projection the NaN would fall on the empty
#     bag, which holds no item: no parameter would see it. Found with plain torch.)
class UserTower(nn.Module):
    def __init__(self, items: int, d: int) -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(items, d, mode="sum", sparse=True)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d)

    def forward(self, hist: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        u = self.proj(self.history(hist, offsets))
        length = u.pow(2).sum(1, keepdim=True).sqrt()  # <origin:history_length>
        return self.mlp(u / (length + 1e-6))


class TwoTower(nn.Module):
    def __init__(self, items: int = 80, d: int = 16) -> None:
        super().__init__()
        self.user_tower = UserTower(items, d)
        self.item_emb = nn.Embedding(items, d, sparse=True)

    def forward(self, hist: torch.Tensor, offsets: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        return (self.user_tower(hist, offsets) * self.item_emb(cand)).sum(-1)


@case("two_tower_sparse_embeddings_sgd_cold_start_user_hand_written_length_sqrt_backward",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "user_tower", "history_length", "grad_singularity"))
def _two_tower_sparse() -> Program:
    torch.manual_seed(0)
    model = TwoTower()
    g = _gen(1519)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        lengths = torch.randint(1, 6, (8,), generator=g)
        if step == 3:
            lengths[4] = 0  # a cold-start user
        hist = torch.randint(0, 80, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        return hist, offsets, torch.randint(0, 80, (8,), generator=g), torch.randint(0, 2, (8,), generator=g).float()

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch(s) for s in range(5)],
                   lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0], b[1], b[2]), b[3]))


# ================================================================= 3. low precision on the CPU
# 3a. A float16 CNN (model.half(), no autocast, no scaler) trained with progressive resizing (fast.ai style:
#     16 px for the first epoch, then 64 px) on pixels left in 0..255 (the ToTensor scaling was dropped when the
#     loader was rewritten for uint8 speed). The head pools by hand: f.sum((2, 3)) / (H * W). At 16 px the
#     channel sums are below 65504; at 64 px (step 3) some exceed it: inf in float16, finite in float32.
class HalfCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                      nn.ReLU())
        self.classifier = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)
        pooled = f.sum(dim=(2, 3)) / (f.shape[2] * f.shape[3])  # <origin:gap_sum>
        return self.classifier(pooled)


@case("half_cnn_progressive_resizing_hand_written_sum_pool_overflows_fp16",
      Want("nonfinite_loss", "forward", "aten.sum.dim_IntList", "", "gap_sum", "precision_overflow"))
def _half_cnn() -> Program:
    torch.manual_seed(0)
    model = HalfCNN().half()
    g = _gen(1507)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = 16 if step < 3 else 64
        img = torch.randint(0, 256, (4, 3, size, size), generator=g).half()
        return img, torch.randint(0, 10, (4,), generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-4), [batch(s) for s in range(5)],
                   lambda m, b, s: F.cross_entropy(m(b[0]).float(), b[1]))


# 3b. fp16 autocast + torch.amp.GradScaler("cpu") (init_scale 16, the loss being a sum), a house-price
#     regressor with reduction="sum". From step 3 the listing feed reports prices in dollars instead of
#     thousands: the gradient at the prediction (2 (pred - y) ~ 4e4) still fits float16, but the head's weight
#     and bias gradients, sums over the batch of 32, are ~1e6: inf in float16 at every scale >= 1. The scaler
#     skips step after step and halves its scale (a collapse, not a calibration: the scale-1 replay is
#     non-finite too).
AMP_INIT_SCALE = 16.0


class PriceRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).float().squeeze(-1)  # <origin:price_head>


def _prices(dollars_from: int | None, reduction: str, n: int) -> Program:
    torch.manual_seed(0)
    model = PriceRegressor()
    g = _gen(1508)
    w = torch.rand(12, generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(32, 12, generator=g)
        price_k = 10.0 + 4.0 * (x @ w)  # thousands
        return x, price_k * (1000.0 if dollars_from is not None and step >= dollars_from else 1.0)

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-5), [batch(s) for s in range(n)],
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1], reduction=reduction))


case("amp_fp16_gradscaler_sum_loss_prices_switch_to_dollars_weight_gradient_overflows",
     Want("scaler_collapse", "backward", "aten.addmm.default", "head", "price_head", "scaler_collapse"),
     amp=True)(lambda: _prices(3, "sum", 6))
quiet("quiet_amp_fp16_gradscaler_mean_loss_prices_in_thousands", amp=True)(lambda: _prices(None, "mean", 8))


# 3c. A float16 model (model.half(), no master weights) fitted with a sum-reduced loss over batches of 1024 (the
#     "per-batch sum" of an old Lua/Caffe recipe) and SGD with momentum 0.9 at a tiny LR: every gradient is finite
#     in float16 (the head's bias gradient is ~1e4), but the momentum buffer sums them, sum_k 0.9^k g, and passes
#     65504 at step 10: inf in the buffer, then in the bias. In float32 the same update is finite.
class HalfRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def _half_regression(opt_factory: Callable[[Any], torch.optim.Optimizer], batch: int, offset: float,
                     n: int) -> Program:
    torch.manual_seed(0)
    model = HalfRegressor().half()
    g = _gen(1516)

    def make(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 8, generator=g)
        return x.half(), offset + 0.5 * x[:, 0]  # targets not centred: the bias gradient is a large sum

    return Program(model, opt_factory(model.parameters()), [make(s) for s in range(n)],
                   lambda m, b, s: F.mse_loss(m(b[0]).float(), b[1], reduction="sum"))


HALF_MOMENTUM_STEP = 10
"""The step whose momentum update overflows float16 (found with plain torch)."""
case("half_model_sum_loss_sgd_momentum_buffer_overflows_fp16_over_steps",
     Want("nonfinite_param", "optimizer", "aten.add_.Tensor", "head", "opt_step", "precision_overflow",
          step=HALF_MOMENTUM_STEP))(
    lambda: _half_regression(lambda ps: torch.optim.SGD(ps, lr=1e-6, momentum=0.9), 1024, 5.0, HALF_MOMENTUM_STEP + 2))


# 3d. The same float16 model with Adam at an LLM-style betas=(0.9, 0.95), batches of 256 and targets offset by
#     1.5: the head's bias gradient (~770) is finite, its square is not needed in float16 until the second
#     moment v = sum (1 - beta2) beta2^k g^2 passes 65504, at the third update (step 2). v = inf gives an update
#     m / inf = 0: every parameter stays finite, only the state is non-finite (kind optimizer_state).
HALF_ADAM_STEP = 2
case("pure_fp16_adam_llm_betas_second_moment_overflows_bias_gradient",
     Want("optimizer_state", "optimizer", "aten.addcmul_.default", "head", "opt_step", "precision_overflow",
          step=HALF_ADAM_STEP))(
    lambda: _half_regression(lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.9, 0.95)), 256, 1.5, HALF_ADAM_STEP + 3))


# ================================================================= 4. a divergence that ends in NaN
# An IRNN language model (Le, Jaitly & Hinton 2015: ReLU RNN, recurrent weights initialised to the identity),
# SGD without gradient clipping and a linear warm-up over 40 steps to a peak LR of 2.0 (10x what trains). The
# loss falls for 7 steps, then rises 3 steps in a row by >> 64x as the LR passes the stability limit; the
# forward overflows at step 11, in the RNN's own addmm (found with plain torch; the decoder was the first guess).
class IRNNLM(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, d)
        self.rnn = nn.RNN(d, hidden, nonlinearity="relu", batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(hidden))
            self.rnn.bias_hh_l0.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.encoder(x))  # <origin:irnn_rnn>
        return self.decoder(h)


def lm_loss(m: nn.Module, b: torch.Tensor, step: int) -> torch.Tensor:
    out = m(b[:, :-1])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), b[:, 1:].reshape(-1))


def _noisy_periodic(g: torch.Generator, n: int, b: int = 8, t: int = 21, vocab: int = 30) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (b, 1), generator=g)
        seq = (start * 7 + torch.arange(t) * 3) % vocab
        flip = torch.rand(b, t, generator=g) < 0.1
        out.append(torch.where(flip, torch.randint(0, vocab, (b, t), generator=g), seq))
    return out


IRNN_END = 11
"""The first non-finite step of the plain run (checked in the construction)."""


def _irnn() -> Program:
    torch.manual_seed(0)
    model = IRNNLM()
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 40))
    return Program(model, opt, _noisy_periodic(_gen(1), IRNN_END + 3), lm_loss, scheduler=sched)


case("irnn_lm_warmup_to_peak_lr_10x_no_clipping_diverges", Want(*SPIKE, step=-1), diverging=True)(_irnn)
case("irnn_lm_divergence_logged_until_forward_overflows",
     Want("nonfinite_loss", "forward", "aten.addmm.default", "rnn", "irnn_rnn", "overflow", step=IRNN_END),
     config={"response": {"finite_anomaly_action": "log"}})(lambda: _irnn())


# The brief's GAN (two models, two optimizers, two guards; its own loop, ``gan_run``): a DCGAN-style loop whose
# discriminator SGD learning rate reads 3.0 (the config's "3e-4" lost its exponent). D's loss grows
# super-exponentially from step 1 (1.31, 1.40, 48.7, 1.7e4, 3.9e8, 2.7e17) and the step-6 values are non-finite
# (found with plain torch: GAN_END). The first blocking incident is D's guard's finite divergence: loss_spike /
# loss_divergence (D's loss and gradient norm begin to rise at the same step: the loss leads), at or after the
# documented rule's step (3) and before the first non-finite step; G's guard reports nothing before it.
class GanGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class GanDiscriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                                 nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def gan_run(watch: bool, steps: int = 10) -> dict[str, Any]:
    """The GAN loop, plain or under two guards (D's first); stops at a non-finite loss or gradient (plain) or at
    nantrace's NonFiniteError (an escalation)."""
    torch.manual_seed(0)
    G, D = GanGenerator(), GanDiscriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.SGD(D.parameters(), lr=3.0)
    cfg = nantrace.Config(outputs={"print_incidents": False})
    guards = {"D": nantrace.watch(D, opt_d, config=cfg), "G": nantrace.watch(G, opt_g, config=cfg)} if watch else {}
    g = _gen(1521)
    out: dict[str, Any] = dict(d=[], d_norm=[], g=[], end=None, error=None)
    try:
        for step in range(steps):
            real = 0.5 * torch.randn(64, 2, generator=g) + 2.0
            fake = G(torch.randn(64, 4, generator=g))
            opt_d.zero_grad()
            d_loss = (F.binary_cross_entropy_with_logits(D(real), torch.ones(64, 1))
                      + F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(64, 1)))
            d_loss.backward()
            d_grads = [p.grad for p in D.parameters()]
            opt_d.step()
            opt_g.zero_grad()
            g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(64, 1))
            g_loss.backward()
            g_grads = [p.grad for p in G.parameters()]
            opt_g.step()
            out["d"].append(float(d_loss))
            out["d_norm"].append(_grad_norm(d_grads))
            out["g"].append(float(g_loss))
            if not watch and not (_finite([d_loss, g_loss]) and _finite(d_grads) and _finite(g_grads)):
                out["end"] = step
                break
    except nantrace.NonFiniteError as exc:
        out["error"] = exc
    finally:
        for guard in guards.values():
            guard.close()
    out["incidents"] = sorted(((i.step, name, i) for name, guard in guards.items() for i in guard.incidents),
                              key=lambda t: t[0])
    return out


GAN_END = 6
"""The first step of the plain GAN run with a non-finite loss or gradient."""


def test_gan_discriminator_lr_typo_construction() -> None:
    """Plain torch: D's loss diverges by the documented rule (loss leading) before the first non-finite value."""
    run = gan_run(watch=False)
    end = run["end"]
    rl, rn = _rule_step(run["d"][:end]), _rule_step(run["d_norm"][:end])
    assert end == GAN_END and rl == 3, (end, rl, run["d"])
    assert rn is None or _rise_start(run["d_norm"], rn) >= _rise_start(run["d"], rl), run["d_norm"]


def test_gan_discriminator_lr_typo_two_guards() -> None:
    """Zero-intrusive (its loop has two loss computations): the first blocking incident is D's divergence."""
    run = gan_run(watch=True)
    blocking = [(step, name, i) for step, name, i in run["incidents"] if i.action != "logged"]
    assert blocking, "no incident"
    step, name, inc = blocking[0]
    assert (name, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == ("D", *SPIKE[:2], None, None, SPIKE[5]), \
        [(n, describe(i)) for _, n, i in run["incidents"]]
    assert 3 <= step < GAN_END, [(n, describe(i)) for _, n, i in run["incidents"]]
    assert run["error"] is None or isinstance(run["error"], nantrace.NonFiniteError), repr(run["error"])


# The brief's LSTM LM: PyTorch's word_language_model example (lr=20) with its clipping (0.25) removed. Its gates
# saturate, so activations and gradients stay bounded: it trains (quiet). Higher LRs (200 .. 2e4) were tried:
# the loss grows but nothing goes non-finite in 200 steps.
class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.encoder(x))
        return self.decoder(h)


@quiet("quiet_lstm_lm_word_language_model_lr20_without_clipping")
def _lstm_lm() -> Program:
    torch.manual_seed(0)
    model = LSTMLM()
    return Program(model, torch.optim.SGD(model.parameters(), lr=20.0), _noisy_periodic(_gen(1), 60), lm_loss)


# ================================================================= 5. state already non-finite
# 5a. Fine-tuning a classifier head on a frozen "pretrained" backbone loaded from a checkpoint written at the
#     step its previous run diverged: one NaN in backbone.2.weight (a frozen layer, not in the optimizer).
class PetClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2),
                                      nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean((2, 3)))


@case("frozen_backbone_checkpoint_with_one_nan_weight",
      Want("nonfinite_param", None, None, "backbone.2", None, "nonfinite_param", step=0, action="raised"))
def _frozen_nan() -> Program:
    torch.manual_seed(0)
    pretrained = PetClassifier().state_dict()
    pretrained["backbone.2.weight"][3, 1, 0, 2] = float("nan")
    buf = io.BytesIO()
    torch.save(pretrained, buf)
    buf.seek(0)
    model = PetClassifier()
    model.load_state_dict(torch.load(buf))
    model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    g = _gen(1509)
    batches = [(torch.rand(4, 3, 12, 12, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    return Program(model, opt, batches, lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 5b. A tabular regressor with a running input normaliser (buffers running_mean / running_var, as an RL
#     observation normaliser), updated by the step's code after the forward with the batch's statistics. The
#     epoch's last batch (drop_last=False) holds ONE row: its unbiased variance is NaN and running_var becomes
#     NaN at step 3 (that step's loss was computed before, finite). Step 4's forward divides by sqrt(NaN).
class RunningNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("running_var", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.running_mean) / torch.sqrt(self.running_var + 1e-5)

    @torch.no_grad()
    def update(self, x: torch.Tensor, momentum: float = 0.1) -> None:
        self.running_mean.mul_(1 - momentum).add_(x.mean(0), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(x.var(0), alpha=momentum)


class NormalisedRegressor(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.norm = RunningNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x)).squeeze(-1)


def normalised_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    x, y = b
    loss = F.mse_loss(m(x), y)
    m.norm.update(x)  # the normaliser follows the data
    return loss


@case("running_normaliser_var_of_last_batch_of_one_updated_in_step_code",
      Want("nonfinite_param", None, None, "norm", None, "nonfinite_param", step=4, action="raised"))
def _running_norm() -> Program:
    torch.manual_seed(0)
    model = NormalisedRegressor()
    g = _gen(1510)
    batches = []
    for size in (16, 16, 16, 1, 16, 16):  # 49 rows, batch 16, drop_last=False; then the next epoch
        x = 3.0 + 2.0 * torch.randn(size, 6, generator=g)
        batches.append((x, x[:, 0] - 0.5 * x[:, 1]))
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, normalised_loss)


# ================================================================= 6. failures that raise
# 6a. RLHF-style fine-tuning of a small policy LM: 3 steps of supervised warm-up, then REINFORCE on samples
#     drawn through a hand-written nucleus filter (the first-token shift of HF's old top_k_top_p_filtering left
#     out). The RL config says top_p=0.0, meaning "off" in the config's own convention: cum_probs > 0 removes
#     every token, each row is all -inf, softmax makes NaN and torch.multinomial raises.
class PolicyLM(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(tokens))
        return self.head(h)


def nucleus_filter(logits: torch.Tensor, top_p: float, keep_first: bool) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
    cum_probs = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    remove_sorted = cum_probs > top_p
    if keep_first:  # HF: shift right, so the token that crosses the threshold is kept
        remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
        remove_sorted[..., 0] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _rl_program(top_p: float, keep_first: bool, n: int) -> Program:
    torch.manual_seed(0)
    model = PolicyLM()
    g = _gen(1511)
    batches = [torch.randint(0, 20, (8, 7), generator=g) for _ in range(n)]

    def loss(m: nn.Module, prompts: torch.Tensor, step: int) -> torch.Tensor:
        logits = m(prompts[:, :-1])
        if step < 3:  # supervised warm-up
            return F.cross_entropy(logits.reshape(-1, 20), prompts[:, 1:].reshape(-1))
        last = logits[:, -1]
        probs = torch.softmax(nucleus_filter(last, top_p, keep_first), dim=-1)  # <origin:nucleus_softmax>
        actions = torch.multinomial(probs, 1).squeeze(1)
        reward = (actions == prompts[:, -1]).float()
        logp = F.log_softmax(last, -1).gather(1, actions[:, None]).squeeze(1)
        return -((reward - reward.mean()) * logp).mean()

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, loss)


case("rlhf_hand_written_nucleus_filter_without_shift_top_p_zero_multinomial_raises",
     raised("forward", "aten._softmax.default", None, "nucleus_softmax", "masked_softmax_all"),
     raises=(RuntimeError, "probability tensor contains"))(lambda: _rl_program(0.0, False, 5))
quiet("quiet_rlhf_nucleus_filter_with_shift_top_p_09")(lambda: _rl_program(0.9, True, 6))


# 6b. Learning a Kalman filter's process noise by maximum likelihood (constant-velocity model, 2-D position
#     measurements). Each recording's measurement noise R is the variance of its calibration frames (a
#     stationary segment); the start state is known (P0 = 0) and the process noise enters through the velocity
#     only, so at the first update the innovation covariance is S = H P H^T + R = R. Step 3's batch holds a
#     recording from the simulator: its calibration frames are noise-free, R = 0, S = 0 and Cholesky raises.
class KalmanFilterLayer(nn.Module):
    def __init__(self, dt: float = 0.1) -> None:
        super().__init__()
        self.log_q = nn.Parameter(torch.tensor(-2.0))
        self.register_buffer("F", torch.tensor([[1, 0, dt, 0], [0, 1, 0, dt], [0, 0, 1, 0], [0, 0, 0, 1.0]]))
        self.register_buffer("H", torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0.0]]))
        self.register_buffer("G", torch.diag(torch.tensor([0, 0, 1, 1.0])))

    def forward(self, z: torch.Tensor, r: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        b, t, _ = z.shape
        x, P = x0, torch.zeros(b, 4, 4)
        Q, R = torch.exp(self.log_q) * self.G, torch.diag_embed(r)
        nll = z.new_zeros(b)
        for k in range(t):
            x = x @ self.F.T
            P = self.F @ P @ self.F.T + Q
            S = self.H @ P @ self.H.T + R
            L = torch.linalg.cholesky(S)  # <origin:kalman_cholesky>
            v = z[:, k] - x @ self.H.T
            w = torch.linalg.solve_triangular(L, v[..., None], upper=False)
            nll = nll + 0.5 * w.pow(2).sum((1, 2)) + torch.diagonal(L, dim1=1, dim2=2).log().sum(1)
            K = torch.cholesky_solve(self.H @ P, L).transpose(1, 2)
            x = x + (K @ v[..., None]).squeeze(-1)
            P = (torch.eye(4) - K @ self.H) @ P
        return nll / t


class Tracker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kf = KalmanFilterLayer()

    def forward(self, z: torch.Tensor, r: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return self.kf(z, r, x0).mean()


@case("learned_kalman_filter_simulated_recording_noise_free_calibration_cholesky_raises",
      raised("forward", "aten.linalg_cholesky_ex.default", "kf", "kalman_cholesky", "domain_error"),
      raises=(torch.linalg.LinAlgError, "positive-definite"))
def _kalman() -> Program:
    torch.manual_seed(0)
    model = Tracker()
    g = _gen(1512)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        b, t = 6, 8
        x0 = torch.cat([torch.randn(b, 2, generator=g), 0.5 * torch.randn(b, 2, generator=g)], 1)
        vel = x0[:, 2:, None] + 0.05 * torch.randn(b, 2, t, generator=g).cumsum(-1)
        truth = x0[:, :2, None] + 0.1 * vel.cumsum(-1)
        noise_sd = torch.full((b, 1, 1), 0.05)
        calib = noise_sd * torch.randn(b, 2, 5, generator=g)  # 5 stationary calibration frames
        if step == 3:
            noise_sd[2], calib[2] = 0.0, 0.0  # a simulated recording: no sensor noise at all
        z = (truth + noise_sd * torch.randn(b, 2, t, generator=g)).transpose(1, 2)
        return z, calib.var(-1), x0

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-2), [batch(s) for s in range(5)],
                   lambda m, b, s: m(*b))


# 6c. A topic classifier (10 topics, topic 0 = "other") with an auxiliary relevance loss: P(relevant) is the
#     summed softmax over topics 1..9, clamped by hand only from below (the max=1-eps was left out). Step 3's
#     batch comes from a crawler that forgot to length-normalise the term counts: its logits are large, the
#     softmax is peaked, P(other) underflows below float32's resolution at 1 and the float32 sum of the other
#     nine rounds to 1.0000001 for some rows: binary_cross_entropy checks its input and raises.
class TopicClassifier(nn.Module):
    def __init__(self, terms: int = 20, topics: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(terms, 64), nn.ReLU(), nn.Linear(64, topics))

    def forward(self, tf: torch.Tensor) -> torch.Tensor:
        return self.net(tf)


def relevance_loss(m: nn.Module, b: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    tf, topic, relevant = b
    logits = m(tf)
    p_relevant = torch.softmax(logits, -1)[:, 1:].sum(1).clamp(min=1e-7)
    return F.cross_entropy(logits, topic) + F.binary_cross_entropy(p_relevant, relevant)  # <origin:relevance_bce>


@case("topic_classifier_relevance_summed_softmax_clamped_below_only_bce_raises",
      raised("forward", "aten.binary_cross_entropy.default", None, "relevance_bce", "domain_error"),
      raises=(RuntimeError, "between 0 and 1"))
def _relevance() -> Program:
    torch.manual_seed(0)
    model = TopicClassifier()
    g = _gen(1513)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        counts = torch.poisson(torch.full((16, 20), 3.0), generator=g) * (torch.rand(16, 20, generator=g) < 0.5)
        length = counts.sum(1, keepdim=True).clamp(min=1)
        tf = counts if step == 3 else counts / length  # the crawler's shard: raw counts of long documents
        if step == 3:
            tf = tf * 40
        topic = torch.randint(0, 10, (16,), generator=g)
        return tf, topic, (topic != 0).float()

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), [batch(s) for s in range(5)], relevance_loss)


# 6d. A GPT-2-style tokenizer has no pad token; the fine-tuning script adds one ("[PAD]", id = len(vocab) = 50)
#     and forgets model.resize_token_embeddings. A length-grouped sampler serves equal-length batches for three
#     steps (no padding); step 3's batch mixes lengths, is padded with id 50, and the embedding raises.
class WordTokenizer:
    """A word-level tokenizer with the Hugging Face calls the script uses."""

    def __init__(self, words: list[str]) -> None:
        self.vocab = {w: i for i, w in enumerate(words)}
        self.pad_token: str | None = None

    def __len__(self) -> int:
        return len(self.vocab)

    def add_special_tokens(self, tokens: dict[str, str]) -> int:
        for attr, tok in tokens.items():
            self.vocab.setdefault(tok, len(self.vocab))
            setattr(self, attr, tok)
        return len(tokens)

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        ids = [[self.vocab[w] for w in t.split()] for t in texts]
        longest = max(len(i) for i in ids)
        pad = self.vocab[self.pad_token]
        return dict(input_ids=torch.tensor([i + [pad] * (longest - len(i)) for i in ids]),
                    attention_mask=torch.tensor([[1] * len(i) + [0] * (longest - len(i)) for i in ids]))


class ReviewClassifier(nn.Module):
    def __init__(self, vocab: int, d: int = 32) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.encoder = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
        self.classifier = nn.Linear(d, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.tok_emb(input_ids))  # <origin:tok_emb>
        mask = attention_mask[..., None].float()
        return self.classifier((h * mask).sum(1) / mask.sum(1))


@case("pad_token_added_to_tokenizer_without_resizing_embedding_first_padded_batch",
      raised("forward", "aten.embedding.default", "tok_emb", "tok_emb", "label_out_of_range"),
      raises=(IndexError, "index out of range"))
def _pad_token() -> Program:
    torch.manual_seed(0)
    words = [f"w{i}" for i in range(50)]
    tokenizer = WordTokenizer(words)
    model = ReviewClassifier(len(tokenizer))  # built from the pretrained config, before the pad token
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    g = _gen(1514)

    def batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        lengths = [6] * 4 if step < 3 else [6, 4, 6, 3]
        texts = [" ".join(words[int(i)] for i in torch.randint(0, 50, (n,), generator=g)) for n in lengths]
        return tokenizer(texts), torch.randint(0, 2, (4,), generator=g)

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), [batch(s) for s in range(5)],
                   lambda m, b, s: F.cross_entropy(m(**b[0]), b[1]))


# ================================================================= 7. quiet programs (see also above)
@quiet("quiet_nanogpt_bf16_autocast_causal_softmax")
def _bf16_gpt() -> Program:
    torch.manual_seed(0)
    model = NanoGPT()
    g = _gen(1515)

    def loss(m: nn.Module, b: torch.Tensor, step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(b[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), [_periodic(g, 8, 17, 24) for _ in range(8)],
                   loss)


# ======================================================================= the oracle (plain torch)
def _values(t: torch.Tensor) -> torch.Tensor:
    return t._values() if t.is_sparse else t


def _bad(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
            and not bool(torch.isfinite(_values(t)).all()))


def _nan(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
            and bool(torch.isnan(_values(t)).any()))


class FirstBad(TorchDispatchMode):
    """Every op whose tensor inputs were all finite and after which an output, or an argument it wrote (in-place,
    ``_foreach_*_``, fused and sparse kernels), holds a non-finite value, and every op that made a NaN from inputs
    holding infinities but no NaN (a softmax over a -inf row): the step, the op, the stage
    (``forward`` = any op outside autograd and the optimizer, ``backward`` with the autograd node it ran for,
    ``optimizer``), the innermost module of ``model`` running, and the innermost line of this file."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.step, self.in_optimizer = 0, False
        self.made: list[dict[str, Any]] = []
        self._names = {id(m): n for n, m in model.named_modules()}
        self._stack: list[str] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> FirstBad:
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module)
        post = torch.nn.modules.module.register_module_forward_hook(self._leave_module)
        self._hooks = [pre, post]
        self._nodes = _NodeOwners(self)
        self._nodes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        super().__exit__(*exc)
        self._nodes.__exit__(*exc)

    def module_now(self) -> str | None:
        return next((n for n in reversed(self._stack) if n is not None), None)

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self._stack.append(self._names.get(id(module)))

    def _leave_module(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        finite_in = not any(_bad(t) for t in ins)
        nan_in = not finite_in and any(_nan(t) for t in ins)
        out = func(*args, **kwargs)
        made_nan = not nan_in and not finite_in and any(_nan(t) for t in [*tree_leaves(out), *ins])
        if made_nan or finite_in and (any(_bad(t) for t in tree_leaves(out)) or any(_bad(t) for t in ins)):
            node = torch._C._current_autograd_node()
            line = _line_here()
            module = self.module_now()
            if node is not None:  # a backward op: the module and line of the forward call that made its node
                module, line = self._nodes.owner.get(id(node), (None, None))
            bad = [_values(t) for t in [*tree_leaves(out), *ins] if _bad(t)]
            op = f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}"
            stage = "optimizer" if self.in_optimizer else "backward" if node is not None else "forward"
            self.made.append(dict(step=self.step, op=op, stage=stage, node=None if node is None else node.name(),
                                  node_id=None if node is None else id(node),
                                  module=module, line=line, nan=any(bool(torch.isnan(t).any()) for t in bad)))
        return out

    def first(self, step: int, nan: bool = False) -> dict[str, Any] | None:
        """The first op of ``step`` that made a non-finite value (``nan``: a NaN)."""
        return next((m for m in self.made if m["step"] == step and (m["nan"] or not nan)), None)


def _line_here() -> int | None:
    """The innermost line of this file running, outside the oracle's own frames."""
    f = inspect.currentframe().f_back
    while f is not None:
        if os.path.abspath(f.f_code.co_filename) == HERE and f.f_code.co_name not in ("__torch_function__",
                                                                                       "__torch_dispatch__"):
            return f.f_lineno
        f = f.f_back
    return None


class _NodeOwners(TorchFunctionMode):
    """For each autograd node a torch call made in the forward: the module running and the line of this file."""

    def __init__(self, rec: FirstBad) -> None:
        super().__init__()
        self.rec = rec
        self.owner: dict[int, tuple[str | None, int | None]] = {}
        self._alive: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in self.owner:
                self.owner[id(fn)] = (self.rec.module_now(), _line_here())
                self._alive.append(fn)
        return out


def _finite(ts: Any) -> bool:
    return not any(_bad(t) for t in ts if t is not None)


def _grad_norm(grads: list[torch.Tensor]) -> float:
    return float(torch.stack([_values(g.coalesce() if g.is_sparse else g).double().norm() for g in grads]).norm())


def _holder(model: nn.Module, param: torch.Tensor) -> str:
    name = next(n for n, p in model.named_parameters() if p is param)
    return name.rpartition(".")[0]


def plain_run(program: Program, *, amp: bool = False, oracle: bool = True) -> dict[str, Any]:
    """The program without nantrace (under the oracle): per step loss and gradient norm, and the first step
    whose loss, gradients or (after the update) parameters / optimizer state are non-finite, or that raised
    (``first_bad_param``: the module holding the first parameter, in the optimizer's order, that went
    non-finite, or whose state did).
    ``amp``: fp16 autocast and a GradScaler; scaled gradients that overflow are the scaler's to skip, so the
    run goes on and records each step's scale and whether it skipped."""
    model, opt = program.model, program.optimizer
    rec: Any = FirstBad(model) if oracle else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_INIT_SCALE) if amp else None
    out: dict[str, Any] = dict(losses=[], norms=[], scales=[], skipped=[], step=None, what=None, error=None,
                               first_bad_param=None, made=rec if oracle else None)
    with rec:
        for step, batch in enumerate(program.batches):
            if oracle:
                rec.step, rec.in_optimizer = step, False
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            opt.zero_grad()
            try:
                if amp:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = program.loss(model, batch, step)
                    scaler.scale(loss).backward()
                else:
                    loss = run_step(program, program.loss, batch, step)
            except Exception as exc:  # the script dies here
                out.update(step=step, what="raised", error=exc)
                break
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out["losses"].append(float(loss.detach().sum()))
            out["norms"].append(_grad_norm(grads))
            if not math.isfinite(out["losses"][-1]):
                out.update(step=step, what="loss")
                break
            if not amp and not _finite(grads):
                out.update(step=step, what="grads")
                break
            if oracle:
                rec.in_optimizer = True
            if amp:
                scale = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                out["scales"].append(scale)
                out["skipped"].append(scaler.get_scale() < scale)
            else:
                opt.step()
            if program.scheduler is not None:
                program.scheduler.step()
            params = [p for group in opt.param_groups for p in group["params"]]
            bad = [p for p in params if _bad(p.detach())]
            if bad or not _finite(model.parameters()):
                out.update(step=step, what="params", first_bad_param=_holder(model, bad[0]) if bad else None)
                break
            bad_state = [p for p in params
                         if not _finite(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))]
            if bad_state:
                out.update(step=step, what="state", first_bad_param=_holder(model, bad_state[0]))
                break
    return out


_PLAIN: dict[str, dict[str, Any]] = {}


def plain(name: str) -> dict[str, Any]:
    if name not in _PLAIN:
        build = CASES[name][0] if name in CASES else QUIET[name]
        _PLAIN[name] = plain_run(build(), amp=name in AMP, oracle=name in CASES)
    return _PLAIN[name]


# ======================================================================= the documented rules
def _rule_step(series: list[float], steps: int = 4, factor: float = 4.0) -> int | None:
    """docs/escalation.md's divergence rule, the counting part: the first step at which the series has risen
    ``steps`` times in a row by at least ``factor`` in all (``steps - 1`` times when by ``factor**3``), to a
    new high. (Its R^2 / speed-up and noise conditions may only delay it.)"""
    for s in range(1, len(series)):
        if not all(math.isfinite(v) for v in series[: s + 1]):
            return None
        rises = 0
        while rises < s and series[s - rises] > series[s - rises - 1]:
            rises += 1
        if series[s] <= max(series[:s]):
            continue
        for k in range(1, rises + 1):
            total = series[s] / series[s - k]
            if (k >= steps and total >= factor) or (k >= steps - 1 and total >= factor ** 3):
                return s
    return None


def _rise_start(series: list[float], at: int) -> int:
    s = at
    while s > 0 and series[s] > series[s - 1]:
        s -= 1
    return s


def _spike_step(series: list[float], ratio: float, warmup: int = 32, window: int = 128,
                sigma: float = 6.0) -> int | None:
    """docs/api.md's spike rule (robust log-space z-score > sigma against the last ``window`` values, from
    ``warmup`` values of history, and > ``ratio`` x their median), with the raw MAD (the earliest it can hold)."""
    for s in range(warmup, len(series)):
        hist = np.log(np.asarray(series[max(0, s - window):s]))
        if not (math.isfinite(series[s]) and series[s] > 0) or not np.all(np.isfinite(hist)):
            return None
        med = float(np.median(hist))
        mad = float(np.median(np.abs(hist - med)))
        if series[s] > ratio * math.exp(med) and (mad == 0 or (math.log(series[s]) - med) / mad > sigma):
            return s
    return None


# ======================================================================= the loops under nantrace
def train_cfg(program: Program, *, replayable: bool, config: dict[str, Any] | None = None, amp: bool = False) -> Run:
    """heldout_harness.train with a case's config groups, or with fp16 autocast and a GradScaler handed to watch
    (``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()``)."""
    model, opt = program.model, program.optimizer
    groups = {k: dict(v) for k, v in (config or {}).items()}
    groups.setdefault("outputs", {})["print_incidents"] = False
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_INIT_SCALE) if amp else None
    guard = nantrace.watch(model, opt, scaler=scaler, config=nantrace.Config(**groups))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            before, seen = snapshot(model), _blocking(guard.incidents)
            try:
                opt.zero_grad()
                if amp:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = loss_fn(model, batch, step)
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    run_step(program, loss_fn, batch, step)
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


def run_case(name: str, mode: str) -> Run:
    build = CASES[name][0] if name in CASES else QUIET[name]
    if name in AMP or name in CONFIGS:
        return train_cfg(build(), replayable=mode == "replayable", config=CONFIGS.get(name), amp=name in AMP)
    return train(build(), replayable=mode == "replayable")


# ======================================================================= the tests
BACKWARD_NODES = {"aten.sqrt.default": "SqrtBackward0"}
WHAT = {"nonfinite_param": ("params", "loss"), "nonfinite_loss": ("loss",), "nonfinite_grad": ("grads",),
        "optimizer_state": ("state",), "exception": ("raised",)}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction, in plain torch (see the module docstring for what each kind of case checks)."""
    _, want = CASES[name]
    run = plain(name)
    rec: FirstBad = run["made"]
    if name in DIVERGING:
        end = run["step"]
        rl, rn = _rule_step(run["losses"][:end]), _rule_step(run["norms"][:end])
        assert rl is not None and rl < end, (rl, end, run["losses"])
        leads = "grad_explosion" if rn is not None and _rise_start(run["norms"], rn) < _rise_start(run["losses"], rl) \
            else "loss_spike"
        assert leads == want.kind, (run["losses"], run["norms"])
        return
    if name in AMP:  # the scaler skips every step from the switch on; the gradients are non-finite at scale 1 too
        assert run["skipped"] == [s >= want.step for s in range(len(run["skipped"]))], run["skipped"]
        assert all(math.isfinite(v) for v in run["losses"]), run["losses"]
        probe = _amp_scale_one(CASES[name][0](), want.step)
        assert probe["op_node"] == "AddmmBackward0" and probe["module"] == want.module, probe
        return
    assert run["step"] == want.step and run["what"] in WHAT[want.kind], \
        {k: v for k, v in run.items() if k not in ("made", "losses", "norms")}
    earlier = [m for m in rec.made if m["step"] < want.step]
    if want.cause == "nonfinite_param" and want.step > 0:  # made by the step code of an earlier step, after its forward
        assert earlier and earlier[0]["op"] == "aten.var.correction" and earlier[0]["step"] == want.step - 1, rec.made
    else:
        assert not earlier, earlier
    first = rec.first(want.step)
    if want.cause == "masked_softmax_all":  # the -inf mask is filled on purpose; the NaN is the softmax's
        assert first is not None and first["op"] == "aten.masked_fill.Scalar" and not first["nan"], first
        first = rec.first(want.step, nan=True)
    if name in RAISES:
        exc_type, message = RAISES[name]
        assert isinstance(run["error"], exc_type) and message in str(run["error"]), repr(run["error"])
    if want.op is None or want.cause in ("domain_error", "label_out_of_range"):  # nothing made non-finite
        assert first is None, first
    elif want.phase == "optimizer":
        assert first is not None and (first["stage"], first["op"]) == ("optimizer", want.op), rec.made[:4]
        assert run["first_bad_param"] == want.module, run["first_bad_param"]
        if want.tag != "opt_step":
            assert first["line"] == JUDGE.marked(want.tag)[1], first
    elif want.phase == "backward":  # the node of the forward op, made in the module and at the line expected
        assert first is not None and (first["stage"], first["node"], first["module"], first["line"]) == \
            ("backward", BACKWARD_NODES[want.op], want.module, JUDGE.marked(want.tag)[1]), first
    else:
        assert first is not None and (first["stage"], first["op"], first["module"], first["line"]) == \
            (want.phase, want.op, want.module, JUDGE.marked(want.tag)[1]), first
    if want.phase == "optimizer" and want.op is None:  # the loaded state: loss and gradients finite, the update NaN
        assert all(math.isfinite(v) for v in run["losses"]) and all(math.isfinite(v) for v in run["norms"])
        assert run["first_bad_param"] == want.module
    if want.cause == "precision_overflow":  # the same step (its forward, or its update) in float32 is finite
        check = _float32_update_finite if want.phase == "optimizer" else _float32_step_finite
        assert check(CASES[name][0](), want.step)
    if want.cause == "overflow":  # the end of a divergence: the documented rule held before it
        assert _rule_step(run["losses"]) is not None and _rule_step(run["losses"]) < want.step


def _float32_step_finite(program: Program, step: int) -> bool:
    """Train the float16 program to ``step`` (plain), then compute that step's loss on a float32 copy."""
    model, opt = program.model, program.optimizer
    for s, batch in enumerate(program.batches[:step]):
        opt.zero_grad()
        run_step(program, program.loss, batch, s)
        opt.step()
    x, y = program.batches[step]
    with torch.no_grad():
        loss = program.loss(_to_float(model), (x.float(), y), step)
    return bool(torch.isfinite(loss))


def _float32_update_finite(program: Program, step: int) -> bool:
    """Train the float16 program to ``step`` (plain) and compute that step's gradients, then apply its update to
    float32 copies of the parameters, gradients and optimizer state: finite?"""
    model, opt = program.model, program.optimizer
    for s, batch in enumerate(program.batches[: step + 1]):
        opt.zero_grad()
        run_step(program, program.loss, batch, s)
        if s < step:
            opt.step()
    model32 = _to_float(model)
    for p16, p32 in zip(model.parameters(), model32.parameters()):
        p32.grad = None if p16.grad is None else p16.grad.float()
    opt32 = type(opt)(model32.parameters(), **{k: v for k, v in opt.param_groups[0].items() if k != "params"})
    opt32.load_state_dict(opt.state_dict())  # floating-point state is cast to the parameters' dtype
    opt32.step()
    return _finite(model32.parameters()) and all(
        _finite(v for v in st.values() if isinstance(v, torch.Tensor)) for st in opt32.state.values())


def _to_float(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).float()


def _amp_scale_one(program: Program, step: int) -> dict[str, Any]:
    """Train the AMP program to ``step`` (plain, with its scaler), then back-propagate that step's loss at scale 1
    under the oracle: which backward node first made a non-finite value, for which module's forward."""
    model, opt = program.model, program.optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_INIT_SCALE)
    for s, batch in enumerate(program.batches[:step]):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = program.loss(model, batch, s)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
    owner: dict[int, str] = {}

    def note(module: nn.Module, args: Any, out: Any) -> None:  # which module's forward made each autograd node
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            owner[id(out.grad_fn)] = next(n for n, m in model.named_modules() if m is module)

    hooks = [m.register_forward_hook(note) for m in (model.head, model.body[0])]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = program.loss(model, program.batches[step], step)
    for h in hooks:
        h.remove()
    rec = FirstBad(model)
    with rec:
        loss.backward()
    grads_bad = not _finite(p.grad for p in model.parameters())
    first = rec.made[0] if rec.made else {}
    return dict(grads_bad=grads_bad, op_node=first.get("node") if grads_bad else None,
                module=owner.get(first.get("node_id")) if grads_bad else None)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n not in DIVERGING}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    _, want = CASES[name]
    run = run_case(name, mode)
    if want.action == "raised" and want.kind != "exception":  # weights non-finite before step(): no skip can help
        got = JUDGE.got(run.incidents)
        assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
        assert isinstance(run.error, nantrace.NonFiniteError) and run.error_step == want.step, repr(run.error)
        return
    assert_diagnosis(run, want, JUDGE)
    if name in RAISES:
        exc_type, message = RAISES[name]
        assert isinstance(run.error, exc_type) and message in str(run.error), repr(run.error)
    if want.cause == "overflow":  # the logged divergence came first; the overflow says what made the values huge
        first = run.incidents[0]
        logged = {(SPIKE[0], SPIKE[5], "logged"), (GRAD[0], GRAD[5], "logged")}
        assert (first.kind, first.cause, first.action) in logged, \
            [describe(i) for i in run.incidents]


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n in DIVERGING}, XFAIL))
def test_heldout_divergence(name: str, mode: str) -> None:
    """The first blocking incident is the divergence, at or after the documented rule's step and before the
    first non-finite value; the blocked update did not land."""
    _, want = CASES[name]
    reference = plain(name)
    end = reference["step"]
    rules = [r for r in (_rule_step(reference["losses"][:end]), _rule_step(reference["norms"][:end])) if r is not None]
    run = run_case(name, mode)
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    expected = {k: v for k, v in JUDGE.want(want).items() if k != "step"}
    assert {k: v for k, v in got.items() if k != "step"} == expected, \
        [describe(i) for i in run.incidents]
    assert rules and min(rules) <= got["step"] < end, (got["step"], rules, end)
    assert run.error is None or isinstance(run.error, nantrace.NonFiniteError), repr(run.error)
    assert run.unchanged_at_incident is True


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_constructions(name: str) -> None:
    """The quiet programs stay finite (the AMP one never skips) and no documented rule holds on them."""
    run = plain(name)
    assert run["step"] is None, (name, run["step"], run["what"])
    assert _rule_step(run["losses"]) is None and _spike_step(run["losses"], 1.5) is None, run["losses"]
    assert _rule_step(run["norms"]) is None or run["losses"][-1] < run["losses"][0], run["norms"]
    assert _spike_step(run["norms"], 5.0) is None, run["norms"]
    if name in AMP:
        assert not any(run["skipped"]), run["skipped"]


def test_quiet_controls_take_the_failing_paths() -> None:
    """The controls exercise what fails in their cases: the gates are at 0 (zero gradients behind them) in the
    Flamingo control, blocks are dropped in the Barlow LARS control, the nucleus filter runs from step 3."""
    p = QUIET["quiet_flamingo_gated_xattn_tanh_gates_at_zero_adamw_default_eps"]()
    caption_loss(p.model, p.batches[0], 0).backward()
    assert float(p.model.resampler.weight.grad.abs().max()) == 0.0 and float(p.model.gated.attn_gate.grad.abs()) > 0
    torch.manual_seed(0)
    ResMLP()
    drops = [float(torch.empty([1]).bernoulli_(1 - p)) == 0 for _ in range(8) for p in (0.25, 0.5)]
    assert any(drops), drops


@pytest.mark.parametrize("name,mode", case_params(QUIET, XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident at all (no blocking one, no early warning), and the program trains to its end."""
    run = run_case(name, mode)
    assert not run.incidents, [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.error is None, repr(run.error)
