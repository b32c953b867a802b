"""A generated matrix of numerical-failure cases for the cause oracle (issue 9, item 5).

Each case is one op family (a failing snippet below) x dtype (float32 / float16 / bfloat16)
x place (inside a module of the model / in the user's loss function) x execution (eager /
``torch.compile(backend="aot_eager")``). The origin is a forward op or, for the gradient
families, the backward of a forward op. Every case trains a tiny real model (named
submodules: an encoder with a learned gain, a block or a latent layer holding the snippet, a
head) for ``STEPS`` steps with SGD; the batches are healthy except the one at ``FAIL_STEP``.

The line of each snippet that issues the origin op carries ``# <origin:TAG>``;
:func:`origin_line` finds it, so the expected ``source`` never depends on line numbers.
Nothing here imports nantrace: the same programs feed the oracle (``cause_oracle.decide``)
and, in tests/test_cause_matrix.py, ``nantrace.watch``.

Usage::

    from cause_matrix import CASES, build
    case = CASES["log.float16.module"]
    program = build(case)            # model, optimizer, batches, loss_fn
    case.cause                       # the hand-computed cause: 'log_nonpositive'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

B, D, C = 4, 8, 4
FAIL_STEP, STEPS = 3, 5
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ALL = (F32, F16, BF16)
NEG_INF = float("-inf")
CTC_T = 4  # time steps of the CTC families (D = CTC_T * 2 classes)


# ============================================================== the failing snippets
# Each takes the features h (B x D, the encoder's output) and the batch's aux tensor and
# returns either features (B x D) or a scalar loss term. One tagged line issues the origin op.
def s_log(h, aux):
    return torch.log(h)  # <origin:log>


def s_log2(h, aux):
    return torch.log2(h)  # <origin:log2>


def s_log1p(h, aux):
    return torch.log1p(h)  # <origin:log1p>


def s_lgamma(h, aux):
    return torch.lgamma(h)  # <origin:lgamma>


def s_digamma(h, aux):
    return torch.digamma(h)  # <origin:digamma>


def s_div_count(h, aux):
    return h / (h > 0).sum(-1, keepdim=True)  # <origin:div_count>


def s_reciprocal(h, aux):
    return torch.reciprocal(h)  # <origin:reciprocal>


def s_rms_manual(h, aux):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))  # <origin:rms_manual>


def s_rms_norm(h, aux):
    return F.rms_norm(h, (h.shape[-1],), eps=0.0)  # <origin:rms_norm>


def s_sqrt(h, aux):
    return torch.sqrt(h)  # <origin:sqrt>


def s_pow_frac(h, aux):
    return h ** 1.5  # <origin:pow_frac>


def s_exp(h, aux):
    return torch.exp(h)  # <origin:exp>


def s_expm1(h, aux):
    return torch.expm1(h)  # <origin:expm1>


def s_sinh(h, aux):
    return torch.sinh(h)  # <origin:sinh>


def s_cosh(h, aux):
    return torch.cosh(h)  # <origin:cosh>


def s_pow_overflow(h, aux):
    return h ** 8  # <origin:pow_overflow>


def s_naive_softmax(h, aux):
    e = torch.exp(h)  # <origin:naive_softmax>
    return e / e.sum(-1, keepdim=True)


def s_acos(h, aux):
    return torch.acos(h)  # <origin:acos>


def s_asin(h, aux):
    return torch.asin(h)  # <origin:asin>


def s_atanh(h, aux):
    return torch.atanh(h)  # <origin:atanh>


def s_mul_overflow(h, aux):
    return h * h  # <origin:mul_overflow>


def s_matmul_overflow(h, aux):
    gram = h @ h.transpose(0, 1)  # <origin:matmul_overflow>
    return gram @ h / h.shape[0]


def s_sum_overflow(h, aux):
    return h - h.sum(-1, keepdim=True)  # <origin:sum_overflow>


def s_cumprod(h, aux):
    return torch.cumprod(h, -1)  # <origin:cumprod>


def s_layer_norm_eps0(h, aux):
    return F.layer_norm(h, (h.shape[-1],), eps=0.0)  # <origin:layer_norm_eps0>


def s_group_norm_eps0(h, aux):
    return F.group_norm(h, 2, eps=0.0)  # <origin:group_norm_eps0>


def s_batch_standardise(h, aux):
    return (h - h.mean(0)) / h.std(0)  # <origin:batch_standardise>


def s_std_one_sample(h, aux):
    std = h.std(0, keepdim=True)  # <origin:std_one_sample>
    return (h - h.mean(0, keepdim=True)) / (std + 1e-3)


def s_layer_norm_huge(h, aux):
    return F.layer_norm(h, (h.shape[-1],))  # <origin:layer_norm_huge>


def s_masked_softmax(h, aux):
    return F.softmax(h.masked_fill(aux, NEG_INF), dim=-1)  # <origin:masked_softmax>


def s_inf_minus_inf(h, aux):
    s = h.masked_fill(aux, NEG_INF)
    return torch.exp(s - s.amax(-1, keepdim=True))  # <origin:inf_minus_inf>


def s_mask_times_inf(h, aux):
    if aux.any():
        h = h + aux.to(h.dtype) * NEG_INF  # <origin:mask_times_inf>
    return F.softmax(h, dim=-1)


def s_where_sqrt(h, aux):
    return torch.where(h > 0, torch.sqrt(h), 0.0)  # <origin:where_sqrt>


def s_where_log(h, aux):
    return torch.where(h > 0, torch.log(h), 0.0)  # <origin:where_log>


def s_pair_distance(h, aux):
    d = torch.sqrt(((h - h.roll(1, 0)) ** 2).sum(-1, keepdim=True))  # <origin:pair_distance>
    return h * d


def s_norm_pow(h, aux):
    norm = h.pow(2).sum(-1, keepdim=True) ** 0.5  # <origin:norm_pow>
    return h + norm


def s_acos_tanh(h, aux):
    return torch.acos(torch.tanh(h))  # <origin:acos_tanh>


def s_abs_pow(h, aux):
    return h.abs() ** 0.3  # <origin:abs_pow>


# ----------------------------------------------------------- loss terms (scalar)
def s_bce(h, aux):
    p = h[:, 0]
    return F.binary_cross_entropy(p, torch.ones_like(p))  # <origin:bce>


def s_poisson(h, aux):
    return F.poisson_nll_loss(h, torch.ones_like(h), log_input=False)  # <origin:poisson>


def s_kl_div(h, aux):
    logq = F.log_softmax(torch.ones_like(h), -1)
    return F.kl_div(logq, h, reduction="batchmean")  # <origin:kl_div>


def s_ctc(h, aux):
    logp = h.view(h.shape[0], CTC_T, 2).transpose(0, 1).log_softmax(-1)
    targets = torch.ones(h.shape[0], CTC_T, dtype=torch.long)
    lengths = torch.full((h.shape[0],), CTC_T, dtype=torch.long)
    return F.ctc_loss(logp, targets, lengths, aux)  # <origin:ctc>


def s_ce_zero_weight(h, aux):
    weight = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=h.dtype)
    return F.cross_entropy(h[:, :C], aux, weight=weight)  # <origin:ce_zero_weight>


def s_ce_all_ignored(h, aux):
    return F.cross_entropy(h[:, :C], aux, ignore_index=-100)  # <origin:ce_all_ignored>


def s_ce_label_oob(h, aux):
    return F.cross_entropy(h[:, :C], aux)  # <origin:ce_label_oob>


def s_cholesky(h, aux):
    g = h[:, :2].transpose(0, 1) @ h[:, :2]
    return torch.linalg.cholesky(g).sum()  # <origin:cholesky>


# ======================================================================= the families
def _pos(dt):
    return torch.rand(B, D) + 0.5


def _unit(dt):
    return torch.rand(B, D) * 0.8 - 0.4


def _normal(dt):
    return torch.randn(B, D) * 0.5


def _set(value: float, *where: Any) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    def poke(x, dt):
        x[where] = value
        return x
    return poke


def _by(table: dict[torch.dtype, float], *where: Any) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    def poke(x, dt):
        x[where] = table[dt]
        return x
    return poke


def _row(value: Any, row: int = 2) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    def poke(x, dt):
        x[row] = value if not callable(value) else value(dt)
        return x
    return poke


def _mask_none(dt):
    return torch.zeros(B, D, dtype=torch.bool)


def _mask_pad(dt):
    m = torch.zeros(B, D, dtype=torch.bool)
    m[:, -2:] = True
    return m


def _mask_full_row(dt):
    m = _mask_pad(dt)
    m[1] = True
    return m


def _labels(dt):
    return torch.randint(0, C, (B,))


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    snippet: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    op: str
    """The hand-expected origin op."""
    cause: str | dict[torch.dtype, str]
    """The hand-computed cause (by dtype where it differs)."""
    healthy: Callable[[torch.dtype], torch.Tensor]
    poke: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None
    """Makes the failing batch's features from a healthy one."""
    aux: Callable[[torch.dtype], torch.Tensor] = _mask_none
    bad_aux: Callable[[torch.dtype], torch.Tensor] | None = None
    dtypes: tuple[torch.dtype, ...] = ALL
    phase: str = "forward"
    loss_term: bool = False
    """The snippet returns a scalar loss term (a loss function) instead of features."""
    bad_rows: int = B
    story: str = ""

    @property
    def tag(self) -> str:
        return self.snippet.__name__[2:]

    def cause_for(self, dt: torch.dtype) -> str:
        return self.cause if isinstance(self.cause, str) else self.cause[dt]


_FAMILIES = [
    # ---- logarithms
    Family("log", s_log, "aten.log.default", "log_nonpositive", _pos, _set(0.0, 1, 2), story="log(0)"),
    Family("log2", s_log2, "aten.log2.default", "log_nonpositive", _pos, _set(-1.0, 0, 3), story="log2 of a negative"),
    Family("log1p", s_log1p, "aten.log1p.default", "log_nonpositive", _pos, _set(-1.0, 2, 0), story="log1p(-1)"),
    Family("lgamma", s_lgamma, "aten.lgamma.default", "log_nonpositive", _pos, _set(0.0, 3, 1), story="lgamma pole at 0"),
    Family("digamma", s_digamma, "aten.digamma.default", "log_nonpositive", _pos, _set(-1.0, 1, 1),
           story="digamma pole at -1"),
    # ---- division
    Family("div_count", s_div_count, "aten.div.Tensor", "div_by_zero", _pos, _row(0.0),
           story="a mean over the positive entries of an all-zero row: 0/0"),
    Family("reciprocal", s_reciprocal, "aten.reciprocal.default", "div_by_zero", _pos, _set(0.0, 0, 5)),
    Family("rms_manual", s_rms_manual, "aten.rsqrt.default", "zero_variance_norm", _normal, _row(0.0),
           story="RMSNorm by hand without eps on a zero row"),
    Family("rms_norm", s_rms_norm, "aten.rsqrt.default", "zero_variance_norm", _normal, _row(0.0),
           story="F.rms_norm(eps=0) on a zero row (decomposes to rsqrt)"),
    # ---- roots
    Family("sqrt", s_sqrt, "aten.sqrt.default", "sqrt_negative", _pos, _set(-2.0, 1, 1)),
    Family("pow_frac", s_pow_frac, "aten.pow.Tensor_Scalar", "sqrt_negative", _pos, _set(-0.5, 2, 6)),
    # ---- exponent family: float16 overflows at 65504 (finite in float32), the others beyond float32
    Family("exp", s_exp, "aten.exp.default", {F32: "exp_overflow", F16: "precision_overflow", BF16: "exp_overflow"},
           _normal, _by({F32: 100.0, F16: 12.0, BF16: 100.0}, 0, 0)),
    Family("expm1", s_expm1, "aten.expm1.default", {F32: "exp_overflow", F16: "precision_overflow", BF16: "exp_overflow"},
           _normal, _by({F32: 100.0, F16: 12.0, BF16: 100.0}, 1, 2)),
    Family("sinh", s_sinh, "aten.sinh.default", {F32: "exp_overflow", F16: "precision_overflow", BF16: "exp_overflow"},
           _normal, _by({F32: -100.0, F16: -12.0, BF16: -100.0}, 2, 2)),
    Family("cosh", s_cosh, "aten.cosh.default", {F32: "exp_overflow", F16: "precision_overflow", BF16: "exp_overflow"},
           _normal, _by({F32: 100.0, F16: 12.0, BF16: 100.0}, 3, 7)),
    Family("pow_overflow", s_pow_overflow, "aten.pow.Tensor_Scalar",
           {F32: "exp_overflow", F16: "precision_overflow", BF16: "exp_overflow"},
           _normal, _by({F32: 1e6, F16: 10.0, BF16: 1e6}, 0, 4)),
    Family("naive_softmax", s_naive_softmax, "aten.exp.default",
           {F32: "exp_overflow", F16: "precision_overflow", BF16: "exp_overflow"},
           _normal, _by({F32: 100.0, F16: 12.0, BF16: 100.0}, 1, 0), story="exp then e / e.sum(): inf / inf"),
    # ---- inverse trigonometric domains
    Family("acos", s_acos, "aten.acos.default", "domain_error", _unit, _set(1.5, 0, 1)),
    Family("asin", s_asin, "aten.asin.default", "domain_error", _unit, _set(-2.0, 3, 3)),
    Family("atanh", s_atanh, "aten.atanh.default", "domain_error", _unit, _set(1.25, 2, 5)),
    # ---- overflow of non-exponent ops (float16: finite in float32)
    Family("mul_overflow", s_mul_overflow, "aten.mul.Tensor", {F32: "overflow", F16: "precision_overflow", BF16: "overflow"},
           _normal, _by({F32: 1e20, F16: 300.0, BF16: 1e20}, 1, 3)),
    Family("matmul_overflow", s_matmul_overflow, "aten.mm.default",
           {F32: "overflow", F16: "precision_overflow", BF16: "overflow"},
           _normal, _row(lambda dt: {F32: 1e19, F16: 100.0, BF16: 1e19}[dt], 0)),
    Family("sum_overflow", s_sum_overflow, "aten.sum.dim_IntList",
           {F32: "overflow", F16: "precision_overflow", BF16: "overflow"},
           _normal, _row(lambda dt: {F32: 1e38, F16: 1e4, BF16: 1e38}[dt], 1)),
    Family("cumprod", s_cumprod, "aten.cumprod.default", {F32: "overflow", F16: "precision_overflow", BF16: "overflow"},
           _pos, _row(lambda dt: {F32: 1e6, F16: 10.0, BF16: 1e6}[dt], 3)),
    # ---- normalisations
    Family("layer_norm_eps0", s_layer_norm_eps0, "aten.native_layer_norm.default", "zero_variance_norm", _normal,
           _row(0.5), story="LayerNorm(eps=0) of a constant row"),
    Family("group_norm_eps0", s_group_norm_eps0, "aten.native_group_norm.default", "zero_variance_norm", _normal,
           _row(-0.25, 1), story="GroupNorm(eps=0) of a constant sample"),
    Family("batch_standardise", s_batch_standardise, "aten.div.Tensor", "zero_variance_norm", _normal,
           _set(1.0, slice(None), 3), story="(x - mean) / std over the batch: a constant feature column"),
    Family("std_one_sample", s_std_one_sample, "aten.std.correction", "zero_variance_norm", _normal, None,
           bad_rows=1, story="std over a batch of one sample"),
    Family("layer_norm_huge", s_layer_norm_huge, "aten.native_layer_norm.default", "overflow", _normal,
           _row(lambda dt: 1e26 * (1 + torch.arange(D) * 0.1), 0), dtypes=(F32, BF16),
           story="LayerNorm(eps=1e-5) of ~1e26 activations: the variance overflows (not zero variance)"),
    # ---- masks and infinities
    Family("masked_softmax", s_masked_softmax, "aten._softmax.default", "masked_softmax_all", _normal, None,
           aux=_mask_pad, bad_aux=_mask_full_row),
    Family("inf_minus_inf", s_inf_minus_inf, "aten.sub.Tensor", "inf_arithmetic", _normal, None,
           aux=_mask_pad, bad_aux=_mask_full_row),
    Family("mask_times_inf", s_mask_times_inf, "aten.mul.Tensor", "inf_arithmetic", _normal, None,
           aux=_mask_none, bad_aux=_mask_pad),
    # ---- gradients
    Family("where_sqrt", s_where_sqrt, "aten.sqrt.default", "where_gradient_trap", _pos, _set(-1.0, 1, 2)),
    Family("where_log", s_where_log, "aten.log.default", "where_gradient_trap", _pos, _set(0.0, 2, 4)),
    Family("pair_distance", s_pair_distance, "aten.sqrt.default", "grad_singularity", _normal,
           lambda x, dt: torch.cat([x[:1], x[:1], x[2:]]), phase="backward",
           story="distance of a duplicated pair, by hand (sqrt of the squared sum)"),
    Family("norm_pow", s_norm_pow, "aten.pow.Tensor_Scalar", "grad_singularity", _normal, _row(0.0), phase="backward",
           story="a norm as sum(x^2) ** 0.5 of a zero row"),
    Family("acos_tanh", s_acos_tanh, "aten.acos.default", "grad_singularity", _normal, _set(100.0, 0, 0),
           phase="backward", story="acos of a saturated tanh (exactly 1)"),
    Family("abs_pow", s_abs_pow, "aten.pow.Tensor_Scalar", "grad_singularity", _pos, _set(0.0, 3, 3), phase="backward"),
    # ---- losses with a domain (scalar terms)
    Family("bce", s_bce, "aten.binary_cross_entropy.default", "domain_error", lambda dt: torch.rand(B, D) * 0.8 + 0.1,
           _set(1.5, 1, 0), loss_term=True, story="binary_cross_entropy of a probability above 1 (raises)"),
    Family("poisson", s_poisson, "aten.log.default", "log_nonpositive", _pos, _set(-1.0, 0, 2), loss_term=True,
           story="poisson_nll_loss(log_input=False) of a negative rate"),
    Family("kl_div", s_kl_div, "aten.xlogy.Tensor", "log_nonpositive", _pos, _set(-0.5, 1, 1), loss_term=True,
           story="kl_div with a negative target probability: xlogy(t, t)"),
    Family("ctc", s_ctc, "aten._ctc_loss.Tensor", "domain_error", _normal, None, loss_term=True, dtypes=(F32,),
           aux=lambda dt: torch.full((B,), 2, dtype=torch.long),
           bad_aux=lambda dt: torch.tensor([2, 4, 2, 2]), story="a target of 4 repeated labels in 4 frames"),
    Family("ce_zero_weight", s_ce_zero_weight, "aten.nll_loss_forward.default", "div_by_zero", _normal, None,
           loss_term=True, aux=lambda dt: torch.tensor([0, 2, 3, 1]), bad_aux=lambda dt: torch.tensor([0, 1, 1, 0]),
           story="class weights 0 for every target of the batch: 0/0, every label valid"),
    Family("ce_all_ignored", s_ce_all_ignored, "aten.nll_loss_forward.default", "label_out_of_range", _normal, None,
           loss_term=True, dtypes=(F32,), aux=lambda dt: torch.tensor([0, -100, 3, 1]),
           bad_aux=lambda dt: torch.full((B,), -100)),
    Family("ce_label_oob", s_ce_label_oob, "aten.nll_loss_forward.default", "label_out_of_range", _normal, None,
           loss_term=True, dtypes=(F32,), aux=_labels, bad_aux=lambda dt: torch.tensor([0, 1, 7, 2]),
           story="a class index of 7 with 4 classes (raises)"),
    Family("cholesky", s_cholesky, "aten.linalg_cholesky_ex.default", "domain_error", _normal, _set(0.0, slice(None), 1),
           loss_term=True, dtypes=(F32,), story="Cholesky of a singular Gram matrix (raises)"),
]
FAMILIES = {f.name: f for f in _FAMILIES}


# ========================================================================== the models
class Encoder(nn.Module):
    """The features: the input times a learned scalar gain (1 at init), so values stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class SnippetOp(nn.Module):
    def __init__(self, snippet: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.snippet = snippet

    def forward(self, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return self.snippet(h, aux)


class Block(nn.Module):
    def __init__(self, snippet: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.op = SnippetOp(snippet)

    def forward(self, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return self.op(h, aux)


class Classifier(nn.Module):
    """encoder -> block.op (the snippet) -> head. Module path of the origin: ``block.op``."""

    module_path = "block.op"

    def __init__(self, snippet: Callable[..., torch.Tensor] | None, loss_term: bool) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.block = Block(snippet) if snippet is not None else None
        self.head = nn.Linear(D, C)
        self.loss_term = loss_term

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> Any:
        h = self.encoder(x)
        if self.block is None:
            return h, self.head(h)
        if self.loss_term:   # the model computes its own loss term (Hugging Face style)
            return self.block(h, aux) + self.head(h).square().mean()
        return self.head(self.block(h, aux))


class TinyGPT(nn.Module):
    """embed -> layers.0.op (the snippet) -> lm_head. Module path of the origin: ``layers.0.op``."""

    module_path = "layers.0.op"

    def __init__(self, snippet: Callable[..., torch.Tensor] | None, loss_term: bool) -> None:
        super().__init__()
        self.embed = Encoder()
        self.layers = nn.ModuleList([Block(snippet)]) if snippet is not None else nn.ModuleList()
        self.lm_head = nn.Linear(D, C)
        self.loss_term = loss_term

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> Any:
        h = self.embed(x)
        if not len(self.layers):
            return h, self.lm_head(h)
        out = self.layers[0](h, aux)
        return out + self.lm_head(h).square().mean() if self.loss_term else self.lm_head(out)


class VAEEncoder(nn.Module):
    """encoder -> latent (the snippet) -> decoder. Module path of the origin: ``latent``."""

    module_path = "latent"

    def __init__(self, snippet: Callable[..., torch.Tensor] | None, loss_term: bool) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.latent = SnippetOp(snippet) if snippet is not None else None
        self.decoder = nn.Linear(D, C)
        self.loss_term = loss_term

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> Any:
        h = self.encoder(x)
        if self.latent is None:
            return h, self.decoder(h)
        out = self.latent(h, aux)
        return out + self.decoder(h).square().mean() if self.loss_term else self.decoder(out)


MODELS = (Classifier, TinyGPT, VAEEncoder)


# ========================================================================== the cases
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: Family
    dtype: torch.dtype
    place: str
    """``module``: the snippet runs inside the model; ``loss``: in the user's loss function."""
    compiled: bool
    model_cls: type

    @property
    def cause(self) -> str:
        return self.family.cause_for(self.dtype)

    @property
    def module(self) -> str | None:
        return self.model_cls.module_path if self.place == "module" else None

    @property
    def op(self) -> str:
        return self.family.op

    @property
    def phase(self) -> str:
        return self.family.phase


@dataclasses.dataclass
class Program:
    """What one case trains (the attributes ``cause_oracle.decide`` reads)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    autocast: torch.dtype | None = None
    scaler: Any = None


def module_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, aux = batch
    out = model(x, aux)
    return out if out.dim() == 0 else F.mse_loss(out, y)


def make_loss_fn(snippet: Callable[..., torch.Tensor], loss_term: bool) -> Callable[[nn.Module, Any], torch.Tensor]:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y, aux = batch
        h, out = model(x, aux)
        term = snippet(h, aux)
        return F.mse_loss(out, y) + (term if loss_term else term.mean())

    return loss_fn


def _batch(fam: Family, dt: torch.dtype, bad: bool) -> tuple[torch.Tensor, ...]:
    x = fam.healthy(dt)
    aux = fam.aux(dt)
    if bad:
        if fam.poke is not None:
            x = fam.poke(x.clone(), dt)
        if fam.bad_aux is not None:
            aux = fam.bad_aux(dt)
        if fam.bad_rows != B:
            x, aux = x[: fam.bad_rows], aux[: fam.bad_rows]
    y = torch.randn(x.shape[0], C) * 0.5
    return x.to(dt), y.to(dt), aux


def build(case: Case, seed: int = 0) -> Program:
    torch.manual_seed(seed)
    fam = case.family
    snippet = fam.snippet if case.place == "module" else None
    model = case.model_cls(snippet, fam.loss_term).to(case.dtype)
    # The encoder's gain is frozen (lr 0) so the failing batch reaches the snippet exactly as made.
    gains = [p for n, p in model.named_parameters() if n.endswith("gain")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("gain")]
    optimizer = torch.optim.SGD([{"params": gains, "lr": 0.0}, {"params": rest}], lr=1e-3)
    batches = [_batch(fam, case.dtype, i == FAIL_STEP) for i in range(STEPS)]
    loss_fn = module_loss if case.place == "module" else make_loss_fn(fam.snippet, fam.loss_term)
    watched = torch.compile(model, backend="aot_eager") if case.compiled else model
    return Program(watched, optimizer, batches, loss_fn)


def _dt_name(dt: torch.dtype) -> str:
    return str(dt).rpartition(".")[2]


# Compiled cases (aot_eager): module cases of these families, float32.
COMPILED = ("log", "div_count", "sqrt", "exp", "acos", "mul_overflow", "layer_norm_eps0", "masked_softmax",
            "where_sqrt", "pair_distance", "acos_tanh", "cumprod")


def _generate() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for i, fam in enumerate(_FAMILIES):
        for j, dt in enumerate(fam.dtypes):
            for place in ("module", "loss"):
                model_cls = MODELS[(i + j) % len(MODELS)]
                name = f"{fam.name}.{_dt_name(dt)}.{place}"
                cases[name] = Case(name, fam, dt, place, False, model_cls)
        if fam.name in COMPILED:
            name = f"{fam.name}.float32.module.compiled"
            cases[name] = Case(name, fam, F32, "module", True, MODELS[i % len(MODELS)])
    return cases


CASES: dict[str, Case] = _generate()

_TAG = re.compile(r"#\s*<origin:([\w-]+)>")


def origin_line(tag: str) -> int:
    """The 1-based line number of the ``# <origin:tag>`` comment in this file."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) for m in _TAG.finditer(line) if m.group(1) == tag]
    if len(hits) != 1:
        raise LookupError(f"origin tag {tag!r} found {len(hits)} times in {__file__}")
    return hits[0]
