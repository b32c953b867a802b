"""Held-out failures, round 8c: failures INSIDE torch's built-in composite modules, and failures under
non-default EXECUTION MODES, as real programs use them.

1. The origin op runs inside torch's own module code (the source is then the user's line that called
   the module, the module the torch submodule's dotted path):
   - a frozen pretrained ``nn.TransformerEncoder`` kept in eval mode under a trainable linear probe: its
     layers take the fused fast path (``aten._transformer_encoder_layer_fwd``), which returns NaN for an
     empty (fully padded) text, while the same layer in train mode (``scaled_dot_product_attention``)
     returns zeros; the same encoder with ``enable_nested_tensor=True`` (the default) goes through
     nested tensors, whose fully padded row comes back as zeros, so the 0 / 0 is the user's masked mean;
     the same probe with the empty text in its first batch (step 0: nantrace's hooks must not switch torch
     off its fast path); a frozen set encoder whose ``nn.MultiheadAttention`` takes its own fused fast path
     (``aten._native_multi_head_attention``) on an empty basket;
   - a small GPT with ``nn.MultiheadAttention`` (slow path: ``need_weights`` defaults to True) fed a
     LEFT-padded batch: causal mask and key padding mask together leave the padding queries no key;
   - ``nn.LSTM`` (the CPU's fused ``mkldnn_rnn_layer``) and ``nn.GRU`` (decomposed: ``addmm``,
     ``sigmoid_``, ``tanh_``) whose gates saturate on an infinite input feature (``log`` of a zero-volume
     day, ``reciprocal`` of a zero inter-event time): the forward stays finite and 0 * inf in the
     input weights' gradient is NaN (the absorption rule: the forward op's own cause, phase forward);
   - losses as modules: ``nn.PoissonNLLLoss(log_input=False)`` on a rate head without softplus,
     ``nn.GaussianNLLLoss(eps=0)`` on an exp-variance that underflows, ``nn.CTCLoss`` called inside the
     model's forward (HF style, the loss is the model's output), ``nn.BCELoss`` on ``sigmoid + 1e-7``
     (a probability of 1 + 1 ulp: the op raises);
   - ``nn.CosineSimilarity(eps=0)`` after ``nn.EmbeddingBag(mode="mean")``, whose empty bag (a
     cold-start user) is the zero vector;
   - ``nn.Upsample(mode="bicubic")`` and ``nn.PixelShuffle`` that do not fail themselves: bicubic rings
     below 0 at a hard edge and the user's gamma ``x ** (1/2.2)`` makes the NaN, which the convolutions
     and the pixel shuffle only carry (neither may be named).
2. Execution modes: activation checkpointing (``checkpoint(..., use_reentrant=False)``) around a block
   whose backward makes the NaN (the origin is the user's op in the block, phase backward, not the
   recomputation); Opacus-style DP-SGD with ``torch.func.functional_call`` + ``vmap(grad(...))`` between
   ``backward()`` and ``optimizer.step()``, whose per-sample clipping divides by the zero gradient norm
   of a padding sample; ``model.compile(backend="eager")`` (in place) and ``torch.compile(model,
   backend="eager")`` (a wrapper; docs/api.md accepts both, module paths relative to the module inside);
   a machine-learned potential whose forward computes forces with ``torch.autograd.grad(create_graph=
   True)``: sqrt's infinite derivative at a duplicated atom makes the forces (an output) NaN, so the
   first bad value is a gradient (phase backward) although what is observed is the loss.
3. Programs that must NOT produce an incident (``test_quiet_programs``): the same ASR model with
   ``nn.CTCLoss(zero_infinity=True)`` (the impossible sample's loss and gradient are 0), the last batch of
   an epoch holding one sample with ``nn.BatchNorm1d`` in train mode (torch raises a size error, which is
   not an incident by docs/diagnosis.md section 3, and propagates unchanged), distillation with
   ``nn.KLDivLoss`` on teacher distributions with exact zeros (torch uses ``xlogy``), and
   ``nn.InstanceNorm1d(eps=0)`` on digital silence (torch's batch-norm kernel returns invstd 0 for a zero
   variance with eps 0).

How expectations were derived: each ``Want`` was written from the construction before nantrace ran, by
docs/api.md's fields, shared/API.md's cause table and docs/diagnosis.md's origin rule (follow the NaN back
to the op that created it; if that op received an infinity, the op that created the infinity; a ``-inf``
mask is intentional; a value made non-finite and taken back to a finite value by a saturating op keeps
its forward op's cause, phase forward). ``test_cases_fail_without_nantrace`` checks every construction with
plain torch and an oracle written here (a TorchDispatchMode: the first op creating a NaN from NaN-free
inputs, or an infinity from finite inputs; the module running; for a built-in derivative, the autograd
node and the forward call that made it). The fast-path cases are checked with the dispatch mode only (a
TorchFunctionMode switches torch's fast paths off). The nested-tensor case is checked without the oracle
(torch's nested tensors refuse a Python dispatch mode): the encoder's output is finite, the pool is not.

Ideas checked with torch 2.13 and dropped: ``nn.BatchNorm1d(eps=0)`` in train mode raises "eps must be
positive" (a settings error, not a value); ``nn.InstanceNorm1d(eps=0)`` and ``nn.KLDivLoss`` with zero
targets stay finite (kept as quiet programs); ``nn.EmbeddingBag(mode="mean")`` returns zeros for an
empty bag; ``nn.LPPool1d`` at an all-zero window (threshold_backward and sign's zero derivative clean the
0 * inf); an R1 penalty through ``F.normalize`` of a zero feature (finite: 1e12-sized, not NaN);
``scaled_dot_product_attention`` with a fully masked row (zeros, forward and backward).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from heldout_harness import MODES, Judge, Program, aligned, assert_diagnosis, case_params, describe, run_step, sgd, steps, train
from origin_markers import origin_line
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 3
STEPS = 5
HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
RAISES = {"bce_module_sigmoid_plus_eps_probability_above_one": "all elements of input should be between 0 and 1"}
"""Cases that raise on finite values: the message of the op's own check (checked in the construction)."""
NO_ORACLE: set[str] = set()
"""Cases whose construction is checked without the dispatch-mode oracle (nested tensors refuse it)."""
FAST_PATH: set[str] = set()
"""Cases checked with the dispatch mode only (a TorchFunctionMode turns torch's fast paths off)."""


def case(name: str, want: Want, *, fast_path: bool = False, no_oracle: bool = False) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if fast_path:
            FAST_PATH.add(name)
        if no_oracle:
            NO_ORACLE.add(name)
        return build

    return register


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return steps(normal, bad, FAIL_STEP, STEPS)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ================================================================== 1. torch's Transformer fast paths
# 1a. Linear probing of a frozen "pretrained" Transformer encoder. The encoder (and its embedding) are
#     frozen and kept in eval mode, as probing recipes do, so every layer takes the fused fast path
#     (aten._transformer_encoder_layer_fwd: no grad is needed through it). A text emptied by the
#     cleaning step is all padding: the fused kernel's softmax over a row of -inf is NaN (checked: the
#     same layer in train mode goes through scaled_dot_product_attention and returns zeros).
class FrozenEncoderProbe(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, nested: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.head = nn.Linear(d, 3)
        self.embed.requires_grad_(False)
        self.encoder.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> FrozenEncoderProbe:
        super().train(mode)
        self.embed.eval()
        self.encoder.eval()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.encoder(self.embed(tokens), src_key_padding_mask=pad)  # <origin:probe_encoder>
        return self.head(h[:, 0])  # the first token's state, BERT-style


def _probe_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(1, 40, (4, 7), generator=g)
        tokens[0, 5:] = 0  # ordinary right padding
        tokens[2, 3:] = 0
        if empty:
            tokens[1] = 0
        return tokens, torch.randint(0, 3, (4,), generator=g)

    return _steps(batch, lambda s: batch(s, True))


@case("frozen_encoder_probe_fast_path_empty_text",
      Want("nonfinite_loss", "forward", "aten._transformer_encoder_layer_fwd.default", "encoder.layers.0",
           "probe_encoder", "masked_softmax_all"), fast_path=True)
def _frozen_probe() -> Program:
    torch.manual_seed(0)
    model = FrozenEncoderProbe()
    return Program(model, sgd(model.head, 0.05), _probe_batches(801),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1a'. The same program with the empty text in the FIRST batch (step 0): without nantrace, the same NaN.
@case("frozen_encoder_probe_fast_path_empty_text_first_batch",
      Want("nonfinite_loss", "forward", "aten._transformer_encoder_layer_fwd.default", "encoder.layers.0",
           "probe_encoder", "masked_softmax_all", step=0), fast_path=True)
def _frozen_probe_first() -> Program:
    program = _frozen_probe()
    program.batches = [program.batches[FAIL_STEP]] + program.batches[:FAIL_STEP] + program.batches[FAIL_STEP + 1:]
    return program


# 1a''. A frozen pretrained set encoder (self-attention over a basket of items, nn.MultiheadAttention kept in
#      eval mode) under a trainable head, pooled by max over the items. Frozen and in eval mode, the attention
#      takes its fused fast path (aten._native_multi_head_attention; unlike the encoder layer, it does not
#      check for hooks). An empty basket is all padding: its softmax row is all -inf and the fused op's
#      output is NaN.
class FrozenSetProbe(nn.Module):
    def __init__(self, items: int = 30, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(items, d, padding_idx=0)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 2)
        self.embed.requires_grad_(False)
        self.attn.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> FrozenSetProbe:
        super().train(mode)
        self.embed.eval()
        self.attn.eval()
        return self

    def forward(self, basket: torch.Tensor) -> torch.Tensor:
        x = self.embed(basket)
        h, _ = self.attn(x, x, x, key_padding_mask=basket == 0)  # <origin:set_attn>
        return self.head(h.amax(1))


@case("frozen_set_encoder_mha_fast_path_empty_basket",
      Want("nonfinite_loss", "forward", "aten._native_multi_head_attention.default", "attn", "set_attn",
           "masked_softmax_all"), fast_path=True)
def _frozen_set() -> Program:
    torch.manual_seed(0)
    model = FrozenSetProbe()
    g = _gen(804)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        basket = torch.randint(1, 30, (5, 6), generator=g)
        basket[1, 4:] = 0
        basket[3, 2:] = 0
        if empty:
            basket[2] = 0
        return basket, torch.randint(0, 2, (5,), generator=g)

    return Program(model, sgd(model.head, 0.05), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1b. The same probe with torch's default enable_nested_tensor=True and a masked mean pool: in eval mode
#     the encoder packs the batch into a nested tensor; the empty text has no tokens and comes back as a
#     row of zeros (finite). The masked mean divides by its token count 0: 0 / 0 in the user's pool.
class NestedEncoderMeanPool(FrozenEncoderProbe):
    def __init__(self) -> None:
        super().__init__(nested=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.encoder(self.embed(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))  # <origin:nested_pool>


@case("frozen_encoder_nested_tensor_path_empty_text_mean_pool",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "nested_pool", "div_by_zero"), no_oracle=True)
def _nested_pool() -> Program:
    torch.manual_seed(0)
    model = NestedEncoderMeanPool()
    return Program(model, sgd(model.head, 0.05), _probe_batches(802),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1c. A small GPT with nn.MultiheadAttention (need_weights left at its default True: the slow path with
#     an explicit softmax), a boolean causal mask and a key padding mask. The collator pads on the right;
#     at step 3 a batch from the generation collator (padding_side="left") is trained on: the first
#     query of a left-padded row may only see key 0, which is padding, so its row is all -inf. The loss
#     ignores padded targets, so it stays finite; the model's logits at those rows are NaN (observed as
#     the model's output: nonfinite_activation, as round 6c established).
class LeftPadGPT(nn.Module):
    def __init__(self, vocab: int = 24, d: int = 16, ctx: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t))
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=causal, key_padding_mask=pad)  # <origin:gpt_attn>
        x = x + a
        return self.head(x + self.mlp(self.ln2(x)))


def gpt_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, pad, targets = batch
    logits = model(tokens, pad)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


@case("gpt_multihead_attention_left_padded_batch",
      Want("nonfinite_activation", "forward", "aten._softmax.default", "attn", "gpt_attn", "masked_softmax_all"))
def _left_pad() -> Program:
    torch.manual_seed(0)
    model = LeftPadGPT()
    g = _gen(803)

    def batch(step: int, left: bool = False) -> tuple[torch.Tensor, ...]:
        lengths = [8, 5, 6, 3]
        seqs = [torch.randint(1, 24, (n + 1,), generator=g) for n in lengths]
        tokens = torch.zeros(4, 8, dtype=torch.long)
        targets = torch.full((4, 8), -100)
        for r, (n, s) in enumerate(zip(lengths, seqs)):
            cols = slice(8 - n, 8) if left else slice(0, n)
            tokens[r, cols], targets[r, cols] = s[:-1], s[1:]
        return tokens, tokens == 0, targets

    return Program(model, sgd(model, 0.05), _steps(batch, lambda s: batch(s, True)), gpt_loss)


# ======================================================================= 2. recurrent modules
# 2a. A stock forecaster: an nn.LSTM (on the CPU, torch's fused mkldnn_rnn_layer) over log-returns and
#     log-volume. A trading halt puts a zero volume in the data: log(0) = -inf. Every gate of that time
#     step saturates (sigmoid/tanh of +-inf), the forward stays finite, and the input weights' gradient
#     holds 0 * -inf = NaN.
class VolumeForecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(2, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, close: torch.Tensor, volume: torch.Tensor) -> torch.Tensor:
        returns = torch.log(close[:, 1:] / close[:, :-1])
        log_volume = torch.log(volume[:, 1:])  # <origin:log_volume>
        out, _ = self.lstm(torch.stack([returns, log_volume], -1))
        return self.head(out[:, -1]).squeeze(-1)


@case("lstm_log_volume_trading_halt_gates_saturate",
      Want("nonfinite_grad", "forward", "aten.log.default", "", "log_volume", "log_nonpositive"))
def _lstm_volume() -> Program:
    torch.manual_seed(0)
    model = VolumeForecaster()
    g = _gen(811)

    def batch(step: int, halt: bool = False) -> tuple[torch.Tensor, ...]:
        close = 100 * torch.exp(torch.cumsum(0.01 * torch.randn(6, 13, generator=g), 1))
        volume = torch.exp(10 + torch.randn(6, 13, generator=g))
        if halt:
            volume[4, 7] = 0.0
        return close[:, :-1], volume[:, :-1], torch.log(close[:, -1] / close[:, -2])

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0], b[1]), b[2]))


# 2b. Churn prediction from event sequences with an nn.GRU (decomposed on the CPU: addmm, sigmoid_,
#     tanh_); one feature is the event rate 1 / dt. Two events logged with the same timestamp give
#     dt = 0: reciprocal(0) = inf, the gates saturate, the input weights' gradient is 0 * inf = NaN.
class ChurnGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(2, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, dt: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
        rate = torch.reciprocal(dt)  # <origin:event_rate>
        _, h = self.gru(torch.stack([rate, torch.log1p(amount)], -1))
        return self.head(h[-1]).squeeze(-1)


@case("gru_event_rate_duplicate_timestamp_gates_saturate",
      Want("nonfinite_grad", "forward", "aten.reciprocal.default", "", "event_rate", "div_by_zero"))
def _gru_rate() -> Program:
    torch.manual_seed(0)
    model = ChurnGRU()
    g = _gen(812)

    def batch(step: int, dup: bool = False) -> tuple[torch.Tensor, ...]:
        dt = 0.2 + torch.empty(8, 10).exponential_(1.0, generator=g)
        if dup:
            dt[5, 6] = 0.0
        amount = torch.empty(8, 10).exponential_(0.05, generator=g)
        return dt, amount, torch.randint(0, 2, (8,), generator=g).float()

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2]))


# ==================================================================== 3. losses as torch modules
# 3a. A count regressor trained with nn.PoissonNLLLoss(log_input=False): the head outputs the rate
#     itself (the softplus was forgotten; the bias starts at 4 so rates are positive at first). A
#     record in raw units drives one rate negative: the loss's log(rate + eps) is NaN.
POISSON = nn.PoissonNLLLoss(log_input=False)


def poisson_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    return POISSON(model(x).squeeze(-1), y)  # <origin:poisson_crit>


@case("poisson_nll_module_rate_head_without_softplus",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "poisson_crit", "log_nonpositive"))
def _poisson() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].bias.fill_(4.0)
    raw = aligned(lambda v: model(v)[:, 0], 6, -1.0, 40.0, 821)
    g = _gen(821)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 6, generator=g)
        if bad:
            x[3] = raw
        return x, torch.poisson(torch.full((8,), 4.0), generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), poisson_loss)


# 3b. A heteroscedastic regressor trained with nn.GaussianNLLLoss(eps=0) ("the exact likelihood") on
#     var = exp(log_var). A record in raw units drives log_var below -104: exp underflows to exactly 0,
#     the loss's log(var) is -inf (made first), then (y - mu)^2 / 0 = inf, and -inf + inf = NaN.
GAUSS = nn.GaussianNLLLoss(eps=0.0)


def gauss_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    mu, log_var = model(x).unbind(-1)
    return GAUSS(mu, y, log_var.exp())  # <origin:gauss_crit>


@case("gaussian_nll_module_eps0_exp_variance_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "gauss_crit", "log_nonpositive"))
def _gauss() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 2))
    raw = aligned(lambda v: model(v)[:, 1], 5, -1.0, 1e4, 822)
    g = _gen(822)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 5, generator=g)
        if bad:
            x[6] = raw
        return x, torch.randn(8, generator=g)

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), gauss_loss)


# 3c. An HF-style acoustic model whose forward returns the loss: nn.CTCLoss is a submodule called in
#     forward. A clip truncated by the loader to 4 frames keeps its 6-letter transcript: no alignment
#     exists and CTC's loss is inf (zero_infinity defaults to False).
class CTCModel(nn.Module):
    def __init__(self, zero_infinity: bool = False, vocab: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.proj = nn.Linear(32, vocab)
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=zero_infinity)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> torch.Tensor:
        log_probs = self.proj(self.encoder(feats)).log_softmax(-1).transpose(0, 1)
        return self.ctc(log_probs, labels, feat_lens, label_lens)  # <origin:ctc_in_forward>


def _ctc_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int, cut: bool = False) -> tuple[torch.Tensor, ...]:
        feats = torch.randn(4, 16, 13, generator=g)
        feat_lens = torch.tensor([16, 14, 15, 16])
        label_lens = torch.tensor([4, 3, 5, 6])
        labels = torch.randint(1, 8, (4, 6), generator=g)
        if cut:
            feat_lens[3] = 4
        return feats, feat_lens, labels, label_lens

    return _steps(batch, lambda s: batch(s, True))


@case("ctc_loss_module_inside_forward_truncated_clip",
      Want("nonfinite_loss", "forward", "aten._ctc_loss.Tensor", "ctc", "ctc_in_forward", "domain_error"))
def _ctc_forward() -> Program:
    torch.manual_seed(0)
    model = CTCModel()
    return Program(model, sgd(model), _ctc_batches(823), lambda m, b, s: m(*b))


# 3d. A multi-label tagger: BCELoss on sigmoid(logits) + 1e-7, "to avoid log(0)" (BCELoss clamps its log
#     anyway). A logit above ~17 rounds sigmoid to exactly 1.0 and 1.0 + 1e-7 is 1 + 1 ulp: the op
#     checks its input and raises "all elements of input should be between 0 and 1".
BCE = nn.BCELoss()


def tagger_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    return BCE(torch.sigmoid(model(x)) + 1e-7, y)  # <origin:bce_eps>


@case("bce_module_sigmoid_plus_eps_probability_above_one",
      Want("exception", "forward", "aten.binary_cross_entropy.default", None, "bce_eps", "domain_error",
           action="raised"))
def _bce_eps() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
    raw = aligned(lambda v: model(v)[:, 2], 8, 1.0, 100.0, 824)
    g = _gen(824)

    def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 8, generator=g)
        if bad:
            x[1] = raw
        return x, torch.randint(0, 2, (6, 5), generator=g).float()

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), tagger_loss)


# ================================================================ 4. similarity and resampling
# 4a. A two-tower recommender: the user tower is nn.EmbeddingBag(mode="mean") over the user's history,
#     scored against candidates with nn.CosineSimilarity(eps=0) (a config set eps to 0). A cold-start
#     user has an empty history: the bag is the zero vector and its normalisation is 0 / 0.
class TwoTower(nn.Module):
    def __init__(self, items: int = 50, d: int = 16) -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(items, d, mode="mean")
        self.item = nn.Embedding(items, d)
        self.cos = nn.CosineSimilarity(dim=-1, eps=0.0)

    def forward(self, hist: torch.Tensor, offsets: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        user = self.history(hist, offsets)
        return self.cos(user[:, None], self.item(cand)) / 0.1  # <origin:tower_cos>


@case("two_tower_cosine_eps0_cold_start_empty_bag",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "cos", "tower_cos", "zero_variance_norm"))
def _two_tower() -> Program:
    torch.manual_seed(0)
    model = TwoTower()
    g = _gen(831)

    def batch(step: int, cold: bool = False) -> tuple[torch.Tensor, ...]:
        counts = torch.randint(1, 6, (6,), generator=g)
        if cold:
            counts[4] = 0
        hist = torch.randint(0, 50, (int(counts.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
        return hist, offsets, torch.randint(0, 50, (6, 5), generator=g)

    return Program(model, sgd(model, 0.05), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(*b), torch.zeros(6, dtype=torch.long)))


# 4b. A x4 super-resolution net working in gamma space: nn.Upsample(bicubic, x2) of the linear-light
#     input, the sRGB-style gamma x ** (1/2.2), convolutions, nn.PixelShuffle(2). Bicubic rings below 0
#     at a hard edge (a line-art image at step 3), the fractional power of a negative value is NaN, and
#     the convolutions and the pixel shuffle only carry it.
class GammaSR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bicubic", align_corners=False)
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, lr: torch.Tensor) -> torch.Tensor:
        srgb = self.up(lr) ** (1 / 2.2)  # <origin:gamma>
        return self.shuffle(self.conv2(F.relu(self.conv1(srgb))))


@case("super_resolution_bicubic_overshoot_gamma_pow",
      Want("nonfinite_loss", "forward", "aten.pow.Tensor_Scalar", "", "gamma", "sqrt_negative"))
def _gamma_sr() -> Program:
    torch.manual_seed(0)
    model = GammaSR()
    g = _gen(832)

    def batch(step: int, line_art: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        lr = 0.5 + 0.1 * F.avg_pool2d(torch.randn(3, 1, 12, 12, generator=g), 5, 1)
        if line_art:
            lr[1] = 0.0
            lr[1, :, :, 4:] = 1.0
        return lr, torch.rand(3, 1, 32, 32, generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# ======================================================================== 5. execution modes
# 5a. A point-cloud classifier whose block is run under activation checkpointing (non-reentrant, the
#     recommended mode). The block embeds the points (bias-free), centres them and appends each point's
#     radius sqrt(sum(rel^2)). A LiDAR frame with no returns is padded with points at the origin: every
#     radius is sqrt(0), finite, but its derivative is infinite and 0 * inf is NaN in the backward.
class RadialBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(3, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d + 1, d), nn.GELU())

    def forward(self, pts: torch.Tensor) -> torch.Tensor:
        e = self.embed(pts)
        rel = e - e.mean(1, keepdim=True)
        radius = torch.sqrt((rel ** 2).sum(-1, keepdim=True))  # <origin:radius>
        return self.mlp(torch.cat([rel, radius], -1))


class CheckpointedPointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = RadialBlock()
        self.head = nn.Linear(16, 4)

    def forward(self, pts: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, pts, use_reentrant=False)
        return self.head(h.max(1).values)


@case("checkpointed_point_block_empty_lidar_frame_radius",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "block", "radius", "grad_singularity"))
def _checkpointed_points() -> Program:
    torch.manual_seed(0)
    model = CheckpointedPointNet()
    g = _gen(841)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        pts = torch.randn(4, 12, 3, generator=g)
        if empty:
            pts[2] = 0.0
        return pts, torch.randint(0, 4, (4,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 5b. DP-SGD written with torch.func (the Opacus recipe without Opacus): between backward() and
#     optimizer.step(), per-sample gradients from vmap(grad(...)) over functional_call, each clipped to
#     norm C as g * min(norm, C) / norm, summed, noised, written to p.grad. The last batch of the epoch
#     is padded to the fixed batch size with masked samples: their per-sample gradient is exactly 0,
#     its norm 0, and min(0, C) / 0 = 0 / 0.
class DPClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_dp_sgd(clip: float = 1.0, sigma: float = 0.5) -> tuple[Callable, Callable]:
    seen: dict[str, Any] = {}
    noise = _gen(851)

    def dp_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y, mask = batch
        seen["batch"] = batch
        losses = F.cross_entropy(model(x), y, reduction="none")
        return (losses * mask).sum() / mask.sum()  # the logged loss

    def dp_clip_and_noise(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x, y, mask = seen["batch"]
        params = {k: v.detach() for k, v in model.named_parameters()}

        def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor, mi: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None]) * mi

        per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0, 0))(params, x, y, mask)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
        factor = torch.clamp(norms, max=clip) / norms  # <origin:dp_factor>
        for name, p in model.named_parameters():
            g = per_sample[name]
            clipped = (g * factor.view(-1, *([1] * (g.dim() - 1)))).sum(0)
            p.grad = (clipped + sigma * clip * torch.randn(p.shape, generator=noise)) / mask.sum()

    return dp_loss, dp_clip_and_noise


@case("dp_sgd_vmap_per_sample_clip_padded_last_batch",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", None, "dp_factor", "zero_variance_norm"))
def _dp_sgd() -> Program:
    torch.manual_seed(0)
    model = DPClassifier()
    g = _gen(852)

    def batch(step: int, short: bool = False) -> tuple[torch.Tensor, ...]:
        x, y, mask = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g), torch.ones(8)
        if short:  # 5 real samples, padded to 8
            x[5:], y[5:], mask[5:] = 0.0, 0, 0.0
        return x, y, mask

    dp_loss, dp_between = make_dp_sgd()
    return Program(model, sgd(model, 0.1), _steps(batch, lambda s: batch(s, True)), dp_loss, between=dp_between)


# 5c. An audio tagger compiled in place with model.compile(backend="eager"): a bias-free strided Conv1d
#     front end, then nn.LayerNorm with the config's layer_norm_eps = 0.0. A clip with a stretch of
#     digital silence gives all-zero frames: the layer norm of a constant row with eps 0 is 0 * inf.
class FrameTagger(nn.Module):
    def __init__(self, layer_norm_eps: float = 0.0) -> None:
        super().__init__()
        self.frontend = nn.Conv1d(1, 16, 8, stride=4, bias=False)
        self.norm = nn.LayerNorm(16, eps=layer_norm_eps)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        h = self.frontend(wave[:, None]).transpose(1, 2)
        h = self.norm(h)  # <origin:frame_norm>
        return self.head(F.gelu(self.proj(h)).mean(1))


@case("compiled_in_place_audio_tagger_layernorm_eps0_silence",
      Want("nonfinite_loss", "forward", "aten.native_layer_norm.default", "norm", "frame_norm", "zero_variance_norm"))
def _compiled_tagger() -> Program:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = FrameTagger()
    model.compile(backend="eager")
    g = _gen(853)

    def batch(step: int, silence: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        wave = 0.1 * torch.randn(4, 64, generator=g)
        if silence:
            wave[2, 16:48] = 0.0
        return wave, torch.randint(0, 2, (4, 5), generator=g).float()

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0]), b[1]))


# 5d. A bilinear CNN (Lin et al.: outer product of conv features, signed square root, L2 normalisation)
#     wrapped with torch.compile(model, backend="eager"). The convolutions are bias-free (GELU: a ReLU's
#     threshold_backward would zero the NaN at its dead units, checked); a black frame
#     gives all-zero features, a zero bilinear matrix, and sqrt(|0|) has an infinite derivative: its
#     backward is 0 / 0 (the incoming gradient is multiplied by sign(0) = 0).
class BilinearCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GELU())
        self.fc = nn.Linear(64, 5)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        f = self.features(img).flatten(2)
        bil = f @ f.transpose(1, 2) / f.shape[-1]
        bil = torch.sign(bil) * torch.sqrt(torch.abs(bil))  # <origin:signed_sqrt>
        return self.fc(F.normalize(bil.flatten(1), dim=1))


@case("compiled_eager_bilinear_cnn_black_frame_signed_sqrt",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "", "signed_sqrt", "grad_singularity"))
def _compiled_bilinear() -> Program:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BilinearCNN()
    g = _gen(854)

    def batch(step: int, black: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.randn(4, 3, 8, 8, generator=g)
        if black:
            img[0] = 0.0
        return img, torch.randint(0, 5, (4,), generator=g)

    opt = sgd(model)
    return Program(torch.compile(model, backend="eager"), opt, _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 5e. A machine-learned interatomic potential (SchNet-style, tiny): pairwise distances, a radial basis,
#     a filter network summed to the energy; the forward returns the energy and the forces
#     -dE/dpos computed with torch.autograd.grad(create_graph=True), and the loss fits both. A frame
#     written with one atom duplicated has a pair at distance sqrt(0): the forces' backward pass through
#     sqrt is inf, times diff = 0 is NaN. The first bad value is a gradient (phase backward) made inside
#     the forward of module "energy"; what is seen is the loss.
class PairEnergy(nn.Module):
    def __init__(self, n_rbf: int = 16) -> None:
        super().__init__()
        self.register_buffer("centers", torch.linspace(0.0, 4.0, n_rbf))
        self.filter = nn.Sequential(nn.Linear(n_rbf, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        i, j = torch.triu_indices(pos.shape[1], pos.shape[1], 1)
        diff = pos[:, i] - pos[:, j]
        dist = torch.sqrt((diff ** 2).sum(-1))  # <origin:pair_dist>
        rbf = torch.exp(-4.0 * (dist[..., None] - self.centers) ** 2)
        return self.filter(rbf).squeeze(-1).sum(-1)


class ForceField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.energy = PairEnergy()

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = pos.requires_grad_(True)
        energy = self.energy(pos)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
        return energy, forces


def force_matching_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    pos, e_ref, f_ref = batch
    energy, forces = model(pos)
    return F.mse_loss(energy, e_ref) + 10.0 * F.mse_loss(forces, f_ref)


@case("force_field_create_graph_duplicated_atom_distance",
      Want("nonfinite_loss", "backward", "aten.sqrt.default", "energy", "pair_dist", "grad_singularity"))
def _force_field() -> Program:
    torch.manual_seed(0)
    model = ForceField()
    g = _gen(855)

    def batch(step: int, dup: bool = False) -> tuple[torch.Tensor, ...]:
        pos = 1.5 * torch.randn(3, 6, 3, generator=g)
        if dup:
            pos[1, 4] = pos[1, 2]
        return pos, torch.randn(3, generator=g), 0.1 * torch.randn(3, 6, 3, generator=g)

    return Program(model, torch.optim.Adam(model.parameters(), 1e-3), _steps(batch, lambda s: batch(s, True)),
                   force_matching_loss)


# =========================================================================== the oracle
def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided


def _has_nan(t: Any) -> bool:
    return _floating(t) and bool(torch.isnan(t).any())


def _nonfinite(t: Any) -> bool:
    return _floating(t) and not bool(torch.isfinite(t).all())


_LOOP_FUNCTIONS = {"_construct_run", "_step_once", "__torch_dispatch__", "__torch_function__", "_module_pre",
                   "_module_post", "test_cases_fail_without_nantrace", "run_step"}
_SELF_MASKING_NODES = {"LinalgVectorNormBackward0"}
"""Built-in derivatives that compute 0 / 0 at a zero norm and mask it themselves (docs/diagnosis.md: no origin)."""
_BACKWARD_NODES = {"aten.sqrt.default": "SqrtBackward0"}
"""For a built-in derivative, the autograd node of the forward op the expectation names."""


def _my_line(frame: Any) -> int | None:
    """The innermost line of this file's program code (not the oracle's, not the loop's) on the stack."""
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == HERE and frame.f_code.co_name not in _LOOP_FUNCTIONS:
            return frame.f_lineno
        frame = frame.f_back
    return None


class Oracle(TorchDispatchMode):
    """The first op of a step that creates a NaN from NaN-free inputs, or a non-finite value from finite
    inputs (an explicit ``inf`` constant excepted): its ATen name, phase, line of this file and module (the
    innermost of the model's modules running). An op a built-in derivative ran is reported by its autograd
    node and the module and line of the forward call that made that node; an op of the code between
    ``backward()`` and ``optimizer.step()`` has phase backward (the contract's gradient code)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.nodes: dict[int, tuple[Any, str | None, int | None]] = {}
        self.first: dict[str, Any] | None = None
        self.between = False

    def module(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def _module_pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _module_post(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def reset(self) -> None:
        self.first, self.nodes, self.stack, self.between = None, {}, [], False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        ins = [t for t in leaves if isinstance(t, torch.Tensor)]
        constant_inf = any(isinstance(a, float) and math.isinf(a) for a in leaves)
        out = func(*args, **kwargs)
        if self.first is None:
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            nan_made = any(_has_nan(t) for t in outs) and not any(_has_nan(t) for t in ins)
            bad_made = any(_nonfinite(t) for t in outs) and not any(_nonfinite(t) for t in ins) and not constant_inf
            backward = torch._C._current_graph_task_id() != -1
            current = torch._C._current_autograd_node() if backward else None
            if type(current).__name__ in _SELF_MASKING_NODES:
                nan_made = bad_made = False
            if nan_made or bad_made:
                line = _my_line(inspect.currentframe())
                op = f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}"
                node, module = None, self.module()
                if current is not None and type(current).__name__ != "BackwardCFunction":
                    # a built-in derivative (run by backward() or by an autograd.grad in the user's code):
                    # the forward call that made its node
                    node = type(current).__name__
                    _, module, line = self.nodes.get(id(current), (None, None, None))
                elif self.between:
                    module = None
                self.first = dict(op=op, phase="backward" if backward or self.between else "forward", line=line,
                                  module=module, node=node)
        return out


class NodeMap(TorchFunctionMode):
    """The module and line of each torch call of the forward, by the autograd node of its output."""

    def __init__(self, oracle: Oracle) -> None:
        super().__init__()
        self.oracle = oracle

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t.grad_fn) not in self.oracle.nodes:
                self.oracle.nodes[id(t.grad_fn)] = (t.grad_fn, self.oracle.module(), _my_line(inspect.currentframe()))
        return out


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _output_finite(out: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree_leaves(out) if _floating(t))


def _step_once(program: Program, batch: Any, step: int, oracle: Oracle | None) -> dict[str, bool]:
    """Loss code, backward and the code between backward and step (no update): what was finite?"""
    program.optimizer.zero_grad()
    outputs: list[bool] = []
    handle = program.model.register_forward_hook(lambda m, a, o: outputs.append(_output_finite(o)))
    try:
        loss = run_step(program, program.loss, batch, step)
    finally:
        handle.remove()
    if program.between is not None:
        if oracle is not None:
            oracle.between = True
        program.between(program.model, program.optimizer, step)
    return dict(loss=bool(torch.isfinite(loss).all()), output=all(outputs),
                grads=_finite(p.grad for p in program.model.parameters()))


def _construct_run(name: str, program: Program) -> dict[str, Any]:
    """The program without nantrace, under the oracle: the first step that fails and how."""
    model, opt = program.model, program.optimizer
    oracle = Oracle(model)
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(oracle._module_pre),
               torch.nn.modules.module.register_module_forward_hook(oracle._module_post, always_call=True)]
    use_oracle = name not in NO_ORACLE
    node_map = name not in FAST_PATH and use_oracle
    try:
        for step, batch in enumerate(program.batches):
            oracle.reset()
            try:
                if node_map:
                    with NodeMap(oracle), oracle:
                        seen = _step_once(program, batch, step, oracle)
                elif use_oracle:
                    with oracle:
                        seen = _step_once(program, batch, step, oracle)
                else:
                    seen = _step_once(program, batch, step, None)
            except Exception as exc:  # noqa: BLE001
                return dict(step=step, what="raised", error=exc, origin=oracle.first)
            if not all(seen.values()):
                return dict(step=step, what=seen, origin=oracle.first)
            opt.step()
            if not _finite(model.parameters()):
                return dict(step=step, what="params", origin=oracle.first)
    finally:
        for h in handles:
            h.remove()
    return dict(step=None, what=None)


# ============================================================================ the tests
@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program runs finite until the expected step and fails there
    as the expectation's kind says (a non-finite loss; a finite loss with non-finite model outputs; finite
    loss and outputs with non-finite gradients; a raise), and the oracle finds the expected op, phase,
    module and line (for a built-in derivative, the node of the expected forward op)."""
    build, want = CASES[name]
    program = build()
    if isinstance(program.model, torch._dynamo.eval_frame.OptimizedModule):  # backend "eager": the same ops
        program.model = program.model._orig_mod
    run = _construct_run(name, program)
    assert run["step"] == want.step, run
    what = run["what"]
    if want.kind == "exception":
        assert what == "raised", run
    elif want.kind == "nonfinite_loss":
        assert not what["loss"], run
    elif want.kind == "nonfinite_activation":
        assert what["loss"] and not what["output"], run
    else:
        assert want.kind == "nonfinite_grad" and what["loss"] and what["output"] and not what["grads"], run
    if name in NO_ORACLE:
        return
    if want.kind == "exception":  # raised on finite values: the op that checked them, and what it saw
        assert RAISES[name] in str(run["error"]), run
        return
    origin = run["origin"]
    assert origin is not None, run
    line = origin_line(HERE, want.tag)
    if origin["node"] is not None:
        assert origin["node"] == _BACKWARD_NODES[want.op], origin
    else:
        assert origin["op"] == want.op, origin
    assert (origin["phase"], origin["line"], origin["module"]) == (want.phase, line, want.module), (origin, line)


def test_nested_case_pool_is_the_first_nan() -> None:
    """The nested-tensor case, which the oracle cannot watch: the encoder's output for the empty text is a
    finite row of zeros, and the masked mean is the first non-finite value."""
    program = _nested_pool()
    model = program.model
    tokens, _ = program.batches[FAIL_STEP]
    with torch.no_grad():
        pad = tokens == 0
        h = model.encoder(model.embed(tokens), src_key_padding_mask=pad)
        assert bool(torch.isfinite(h).all()) and bool((h[1] == 0).all())
        keep = (~pad).unsqueeze(-1).float()
        assert not bool(torch.isfinite((h * keep).sum(1) / keep.sum(1)).all())


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


# ====================================================================== quiet programs
def _quiet_ctc() -> tuple[Program, type[BaseException] | None]:
    torch.manual_seed(0)
    model = CTCModel(zero_infinity=True)
    return Program(model, sgd(model), _ctc_batches(823), lambda m, b, s: m(*b)), None


def _quiet_bn_last_batch() -> tuple[Program, type[BaseException] | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    g = _gen(861)
    sizes = [8, 8, 8, 1, 8]  # 25 samples, batch size 8, drop_last=False: the 4th batch holds one sample
    batches = [(torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g)) for n in sizes]
    return Program(model, sgd(model), batches, lambda m, b, s: F.cross_entropy(m(b[0]), b[1])), ValueError


def _quiet_kd_zero_targets() -> tuple[Program, type[BaseException] | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 6))
    kl = nn.KLDivLoss(reduction="batchmean")
    g = _gen(862)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = torch.softmax(torch.randn(5, 6, generator=g), -1)
        teacher[:, 4:] = 0.0  # classes the teacher never predicts: exact zeros
        return torch.randn(5, 8, generator=g), teacher / teacher.sum(-1, keepdim=True)

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)],
                   lambda m, b, s: kl(F.log_softmax(m(b[0]), -1), b[1])), None


def _quiet_instance_norm_silence() -> tuple[Program, type[BaseException] | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 8, 5, padding=2, bias=False), nn.InstanceNorm1d(8, eps=0.0, affine=True),
                          nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 3))
    g = _gen(863)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        wave = torch.randn(4, 1, 32, generator=g)
        if step == FAIL_STEP:
            wave[1] = 0.0  # digital silence
        return wave, torch.randint(0, 3, (4,), generator=g)

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)],
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1])), None


QUIET = {"ctc_zero_infinity_truncated_clip": _quiet_ctc,
         "batchnorm1d_last_batch_of_one_raises_size_error": _quiet_bn_last_batch,
         "kldiv_module_teacher_with_exact_zeros": _quiet_kd_zero_targets,
         "instance_norm_eps0_digital_silence": _quiet_instance_norm_silence}
QUIET_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    """The construction: every loss, gradient and parameter stays finite (the BatchNorm program raises its
    size error at the one-sample batch); the quiet programs' critical step really holds the critical data."""
    program, error = QUIET[name]()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        try:
            loss = run_step(program, program.loss, batch, step)
        except Exception as exc:  # noqa: BLE001
            assert error is not None and type(exc) is error and step == FAIL_STEP, (step, exc)
            return
        assert bool(torch.isfinite(loss)) and _finite(p.grad for p in model.parameters()), (name, step)
        opt.step()
        assert _finite(model.parameters()), (name, step)
    assert error is None, "did not raise"
    if name.startswith("ctc"):  # the impossible sample has an infinite loss without zero_infinity
        feats, feat_lens, labels, label_lens = program.batches[FAIL_STEP]
        lp = model.proj(model.encoder(feats)).log_softmax(-1).transpose(0, 1)
        assert math.isinf(float(F.ctc_loss(lp, labels, feat_lens, label_lens, reduction="none")[3]))


@pytest.mark.parametrize("name,mode", case_params(QUIET, QUIET_XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No blocking incident: the program trains on (or dies of the user's own error, unchanged)."""
    program, error = QUIET[name]()
    run = train(program, replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    if error is None:
        assert run.error is None, repr(run.error)
    else:
        assert type(run.error) is error and run.error_step == FAIL_STEP, repr(run.error)
