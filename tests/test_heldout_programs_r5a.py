"""Held-out failures, round 5a: the two classes where nantrace was weakest.

1. Failures born in the OPTIMIZER STEP: finite loss, finite gradients, and a parameter (or the
   optimizer's state) that the update makes non-finite. Hand-written optimizers in Python (LAMB's
   trust ratio on a LoRA adapter, fairseq's Adafactor with ``eps=(0, ...)``, SophiaG with eps 0),
   torch's Adam/AdamW with eps 0 along each of its code paths (single tensor, ``foreach=True``,
   ``fused=True``, ``amsgrad``), Adam with beta2 too low whose second moment underflows, a NaN
   learning rate from ``OneCycleLR``, a NaN weight decay from a DINO-style schedule, and a
   parameter group added mid-run with an infinite learning rate.

   What docs/api.md asks for here (and tests/test_optimizer_phase.py / tests/scenarios.py already
   established): kind ``nonfinite_param`` (``optimizer_state`` only when the parameters stay
   finite), phase ``optimizer``, op = the update op that made the first non-finite value,
   module = the module that holds the parameter, source = the optimizer's own line for a Python
   optimizer, else the user's ``optimizer.step()`` line; cause ``div_by_zero`` when the divisor
   is a quantity of this step (a trust ratio's norm), ``optimizer_state`` when it is the
   optimizer's state or a hyper-parameter (lr, weight decay, eps) that went degenerate.

2. DIVERGENCE and EXPLOSION without a domain error: a learning rate 100x too high, SGD with a
   ``momentum=9.0`` typo, a tanh RNN without clipping, an exponential LR-range test left running,
   inputs whose scale drifts step after step, and a deep post-norm MLP whose gradients grow to inf
   through the chain of LayerNorms. The divergence detector (docs/escalation.md) reports a
   finite divergence as ``loss_spike``/``loss_divergence`` (phase ``forward``) or
   ``grad_explosion``/``gradient_explosion`` (phase ``backward``), op and module ``None``, at the
   step its documented rule first holds; that step is computed here, independently, from the
   plain run's loss series (``_rule_step``: ``divergence_steps`` rises in a row by at least
   ``divergence_factor``, one fewer at ``divergence_factor**3``, a new high). The detector's
   extra conditions (R², noise) may only delay it, never past the first non-finite step.

Every expectation was written from the construction before nantrace ran; constructions were
checked with plain torch (``test_cases_fail_without_nantrace``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from heldout_harness import MODES, Judge, Program, assert_diagnosis, case_params, describe, run_step, sgd, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

JUDGE = Judge(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
DIVERGING: set[str] = set()
"""Cases whose expected step is the divergence rule's step (computed from the plain run)."""
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail). Fixed since they were written (tests in
test_optimizer_phase.py, test_unfrozen_params.py): a failed update is undone whole, across parameter groups; the
update replay sees the arguments foreach and fused kernels write, and counts a denominator's zeros before an
in-place op; frozen parameters are watched; a group holding parameters added after watch() is never proven."""


def case(name: str, want: Want, diverging: bool = False) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if diverging:
            DIVERGING.add(name)
        return build

    return register


def _steps(batch: Callable[[int], Any], n: int) -> list[Any]:
    return [batch(s) for s in range(n)]


# ================================================================= 1. the optimizer step
# 1a. LoRA fine-tuning with a hand-written LAMB (no guard on the norms). LoRA initialises B = 0,
#     so A's gradient (B^T ...) is exactly 0 at the first step: Adam's moments are 0, the update
#     is 0, its norm 0, and the trust ratio ||A|| / 0 = inf; lr * inf * 0 = NaN in A.
class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
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
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["exp_avg"] / (1 - b1 ** st["step"])
                v_hat = st["exp_avg_sq"] / (1 - b2 ** st["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                trust_ratio = p.norm() / update.norm()  # <origin:lamb_trust>
                p.sub_(group["lr"] * trust_ratio * update)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class LoRAClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = LoRALinear(nn.Linear(16, 32))
        self.fc2 = LoRALinear(nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


@case("lora_lamb_trust_ratio_zero_update_norm",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "fc1", "lamb_trust", "div_by_zero", step=0))
def _lora_lamb() -> Program:
    torch.manual_seed(0)
    model = LoRAClassifier()
    opt = Lamb([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(501)
    return Program(model, opt, _steps(lambda s: (torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1b. fairseq's Adafactor, written out, with eps=(0, 1e-3) ("eps1 only guards fp16"); the token
#     embedding is frozen for the first 3 steps and then unfrozen. Its vocabulary is padded to a
#     multiple of 16: the padding rows never occur, their gradient rows are 0, the factored
#     row statistic is 0 and its rsqrt is inf; inf * 0 (the gradient) = NaN.
class Adafactor(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate))

    @staticmethod
    def _rms(t: torch.Tensor) -> torch.Tensor:
        return t.norm(2) / (t.numel() ** 0.5)

    @staticmethod
    def _approx_sq_grad(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)  # <origin:adafactor_rsqrt>
        c_factor = col.unsqueeze(-2).rsqrt()
        return torch.mul(r_factor, c_factor)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, st = p.grad, self.state[p]
                factored = grad.dim() >= 2
                if not st:
                    st["step"] = 0
                    if factored:
                        st["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1])
                        st["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:])
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(grad)
                st["step"] += 1
                beta2t = 1.0 - math.pow(st["step"], group["decay_rate"])
                update = grad ** 2 + group["eps"][0]
                if factored:
                    st["exp_avg_sq_row"].mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    st["exp_avg_sq_col"].mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    update = self._approx_sq_grad(st["exp_avg_sq_row"], st["exp_avg_sq_col"])
                    update.mul_(grad)
                else:
                    st["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = st["exp_avg_sq"].rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                p.add_(-update * group["lr"])


class BagOfWordsLM(nn.Module):
    def __init__(self, vocab: int = 48, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.proj(self.embed(tokens).mean(1))))


@case("adafactor_eps0_unfrozen_embedding_padding_rows",
      Want("nonfinite_param", "optimizer", "aten.rsqrt_.default", "embed", "adafactor_rsqrt", "optimizer_state"))
def _adafactor() -> Program:
    torch.manual_seed(0)
    model = BagOfWordsLM()
    model.embed.weight.requires_grad_(False)
    opt = Adafactor(model.parameters(), lr=1e-2, eps=(0.0, 1e-3))
    g = torch.Generator().manual_seed(502)

    def before(m: nn.Module, step: int) -> None:
        if step == 3:
            m.embed.weight.requires_grad_(True)  # the unfreezing schedule

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, 40, (8, 6), generator=g)  # 40 real tokens, 8 padding rows of the table
        return t, torch.randint(0, 40, (8,), generator=g)

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=before)


# 1c. SophiaG (Liu et al. 2023) with its 1e-15 replaced by a configurable eps = 0, in a
#     mixture-of-experts whose second expert first gets tokens at step 3 (one sample). Its state
#     (exp_avg, hessian) starts at 0; the ReLU units that sample does not activate give exactly
#     zero gradient rows, so exp_avg.abs() / (rho * bs * hessian + eps) = 0 / 0 there.
class SophiaG(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.965, 0.99), rho: float = 0.04,
                 weight_decay: float = 0.1, eps: float = 1e-15, bs: int = 8) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, rho=rho, weight_decay=weight_decay, eps=eps, bs=bs))

    @torch.no_grad()
    def update_hessian(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and "hessian" in self.state[p]:
                    self.state[p]["hessian"].mul_(group["betas"][1]).addcmul_(p.grad, p.grad, value=1 - group["betas"][1])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["hessian"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                ratio = (st["exp_avg"].abs() / (group["rho"] * group["bs"] * st["hessian"] + group["eps"])).clamp(None, 1)  # <origin:sophia_ratio>
                p.addcmul_(st["exp_avg"].sign(), ratio, value=-group["lr"])


class DomainMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(12, 16), nn.Tanh())
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)])
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = domain == e
            if bool(idx.any()):
                out[idx] = expert(h[idx])
        return self.head(h + out)


@case("sophia_eps0_expert_first_routed_dead_units",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "experts.1.0", "sophia_ratio", "optimizer_state"))
def _sophia() -> Program:
    torch.manual_seed(0)
    model = DomainMoE()
    opt = SophiaG(model.parameters(), lr=1e-3, eps=0.0)
    g = torch.Generator().manual_seed(503)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        domain = torch.zeros(8, dtype=torch.long)
        if step >= 3:
            domain[5] = 1  # the new domain's first sample
        return torch.randn(8, 12, generator=g), domain, torch.randint(0, 3, (8,), generator=g)

    def between(m: nn.Module, o: Any, step: int) -> None:
        if step % 10 == 9:
            o.update_hessian()

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]), between=between)


# 1d-1f. torch's Adam/AdamW with eps=0 along its three code paths. A parameter that has never
#     had a gradient element gets m = v = 0 and the update m / (sqrt(v) + 0) = 0 / 0.
class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, block: int = 8) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(block, dim) * 0.02)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((block, block), float("-inf")), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.mask, -1)
        x = x + self.proj(att @ v)
        x = x + self.mlp(self.ln2(x))
        return self.lm_head(self.ln_f(x))


def lm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


@case("gpt_adamw_eps0_foreach_unfrozen_token_embedding",
      Want("nonfinite_param", "optimizer", "aten._foreach_addcdiv_.ScalarList", "tok_emb", "opt_step", "optimizer_state"))
def _gpt_foreach() -> Program:
    """A GPT whose pretrained token embedding is frozen for a 3-step head warm-up; the vocabulary
    has 64 rows, the corpus uses 50 of them: the unused rows' gradients are 0 when it is unfrozen."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.tok_emb.weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0, foreach=True)
    g = torch.Generator().manual_seed(504)

    def before(m: nn.Module, step: int) -> None:
        if step == 3:
            m.tok_emb.weight.requires_grad_(True)

    return Program(model, opt, _steps(lambda s: torch.randint(0, 50, (4, 9), generator=g), 5), lm_loss, before_step=before)


class TextClassifier(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict(dict(embed=nn.Embedding(vocab, dim, padding_idx=0), proj=nn.Linear(dim, dim)))
        self.head = nn.Linear(dim, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder["embed"](tokens)
        mask = (tokens != 0).float().unsqueeze(-1)
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(torch.tanh(self.encoder["proj"](pooled)))


def _padded_tokens(g: torch.Generator) -> torch.Tensor:
    t = torch.randint(1, 40, (8, 10), generator=g)
    lengths = torch.randint(4, 11, (8,), generator=g)
    t[torch.arange(10)[None] >= lengths[:, None]] = 0
    return t


@case("text_classifier_fused_adam_eps0_unfrozen_encoder_padding_idx",
      Want("nonfinite_param", "optimizer", "aten._fused_adam_.default", "encoder.embed", "opt_step", "optimizer_state"))
def _fused_adam() -> Program:
    """Two-stage fine-tuning: the head alone for 3 steps, then the encoder unfrozen. The embedding's
    padding row (padding_idx=0) never gets a gradient; fused Adam with eps=0 divides 0 by 0 there."""
    torch.manual_seed(0)
    model = TextClassifier()
    model.encoder.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, fused=True)
    g = torch.Generator().manual_seed(505)

    def before(m: nn.Module, step: int) -> None:
        if step == 3:
            m.encoder.requires_grad_(True)

    return Program(model, opt, _steps(lambda s: (_padded_tokens(g), torch.randint(0, 3, (8,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=before)


@case("text_classifier_amsgrad_eps0_padding_row_first_step",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "encoder.embed", "opt_step", "optimizer_state", step=0))
def _amsgrad() -> Program:
    """AMSGrad (single-tensor path) with eps=0 from the start: the padding row fails at step 0."""
    torch.manual_seed(0)
    model = TextClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, amsgrad=True, foreach=False)
    g = torch.Generator().manual_seed(506)
    return Program(model, opt, _steps(lambda s: (_padded_tokens(g), torch.randint(0, 3, (8,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1g. Adam with beta2 = 0.5 ("lower beta2 for stability", as in some GAN recipes) and eps = 0 on
#     sensor data whose channel 3 went dead after the first step (the sensor unplugged): the
#     weights reading it get exactly zero gradients; v halves each step and underflows to 0 in
#     float32 while m (beta1 = 0.9) is still tiny but non-zero: m / 0 = inf.
BETA2_UNDERFLOW_STEP = 135
"""The step at which v underflows (found with plain torch: test_cases_fail_without_nantrace)."""


@case("adam_beta2_low_eps0_dead_sensor_second_moment_underflows",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "0", "opt_step", "optimizer_state",
           step=BETA2_UNDERFLOW_STEP))
def _beta2_underflow() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.5), eps=0.0)
    g = torch.Generator().manual_seed(507)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 6, generator=g)
        if step > 0:
            x[:, 3] = 0.0
        return x, x[:, :2].sum(1, keepdim=True)

    return Program(model, opt, _steps(batch, BETA2_UNDERFLOW_STEP + 2), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 1h. OneCycleLR with final_div_factor read from a sweep grid as numpy's 0.0: min_lr =
#     initial_lr / 0 = inf (numpy warns, does not raise), and the annealing phase interpolates
#     towards inf: lr = NaN from step 3 (pct_start 0.3 of 10 steps). AdamW's decoupled weight
#     decay p *= 1 - lr * wd is the first op that meets it.
@case("onecycle_final_div_factor_zero_nan_lr_adamw",
      Want("nonfinite_param", "optimizer", "aten.mul_.Tensor", "0", "opt_step", "optimizer_state"))
def _onecycle() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    grid = np.array([[3e-3, 25.0, 0.0]])  # max_lr, div_factor, final_div_factor
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=float(grid[0, 0]), total_steps=10, div_factor=grid[0, 1],
                                                final_div_factor=grid[0, 2])
    g = torch.Generator().manual_seed(508)
    return Program(model, opt, _steps(lambda s: (torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), scheduler=sched)


# 1i. DINO-style parameter groups (weights regularised, biases and norms not) with a cosine
#     weight-decay schedule computed in numpy; warm-up and total are both 3 steps, so the cosine
#     part's progress is 0 / 0 = NaN from step 3 on. SGD nesterov, foreach=True: the first op
#     that meets it is the weight-decay add over the regularised group.
@case("dino_weight_decay_schedule_nan_sgd_nesterov_foreach",
      Want("nonfinite_param", "optimizer", "aten._foreach_add.List", "backbone.0", "opt_step", "optimizer_state"))
def _dino_wd() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("backbone", nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32)))
    model.add_module("head", nn.Linear(32, 8))
    regularized = [p for n, p in model.named_parameters() if not n.endswith(".bias") and p.dim() > 1]
    not_regularized = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.SGD([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}], lr=0.03,
                          momentum=0.9, nesterov=True, weight_decay=0.04, foreach=True)
    warmup, total, wd_base, wd_end = 3, 3, 0.04, 0.4
    it = np.arange(5, dtype=np.float64)
    progress = (it - warmup) / np.float64(total - warmup)
    wd_schedule = np.where(it < warmup, wd_base, wd_end + 0.5 * (wd_base - wd_end) * (1 + np.cos(np.pi * progress)))

    def between(m: nn.Module, o: torch.optim.Optimizer, step: int) -> None:
        o.param_groups[0]["weight_decay"] = float(wd_schedule[step])

    g = torch.Generator().manual_seed(509)
    return Program(model, opt, _steps(lambda s: (torch.randn(16, 12, generator=g), torch.randint(0, 8, (16,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), between=between)


# 1j. Continual learning: a second task's head is added to the optimizer at step 3 with its own
#     learning rate scaled by the share of old-task data to keep, read as numpy 0.0:
#     lr = base_lr / 0 = inf. SGD's p += -inf * g: inf where g != 0, NaN where g == 0.
class MultiHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 24), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(24, 3), nn.Linear(24, 3)])

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


@case("continual_learning_param_group_added_with_inf_lr",
      Want("nonfinite_param", "optimizer", "aten.add_.Tensor", "heads.1", "opt_step", "optimizer_state"))
def _new_group() -> Program:
    torch.manual_seed(0)
    model = MultiHead()
    opt = torch.optim.SGD([*model.trunk.parameters(), *model.heads[0].parameters()], lr=0.05, foreach=False)
    keep_share = np.float64(0.0)

    def before(m: nn.Module, step: int) -> None:
        if step == 3:
            opt.add_param_group({"params": list(m.heads[1].parameters()), "lr": 0.05 / keep_share})

    g = torch.Generator().manual_seed(510)
    return Program(model, opt, _steps(lambda s: (torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0], int(s >= 3)), b[1]), before_step=before)


# ============================================================ 2. divergence and explosion
SPIKE = ("loss_spike", "forward", None, None, None, "loss_divergence")
GRAD = ("grad_explosion", "backward", None, None, None, "gradient_explosion")


# 2a. An MLP regression at 100x its learning rate: loss and gradient norm grow super-exponentially
#     (x60, x4e6, x2.5e20). First expectation: loss_spike at the rule's step 4; but the documented
#     rule then also asked the log-growth to be a straight line (R^2 >= 0.8), and here it is 0.797
#     (loss) and 0.736 (gradient norm), so no finite divergence was due and the first incident was
#     the overflow at step 5 (the last Linear's addmm, gradient_explosion by its history). Round 6d
#     added the rule's other branch, a growth that speeds up (its last three log-increases do not
#     shrink, 4x reached before its last value): the gradient norm (3.4, 10, 1005, 2e7, 2.7e24: log-
#     increases 1.1, 4.6, 9.9, 39.5) qualifies at step 4 while the loss (1.5e28) is still finite, and
#     as the norm began to rise first (from step 0; the loss from step 1), the gradients lead.


@case("mlp_regression_sgd_lr_100x", Want(*GRAD, step=-1), diverging=True)
def _mlp_lr() -> Program:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    w = torch.randn(16, 1, generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 16, generator=g)
        return x, x @ w

    return Program(model, sgd(model, 0.5), _steps(batch, 12), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))  # <origin:mlp_call>


# 2b. SGD nesterov with momentum=9.0 (a typo of 0.9). Expected first: loss_spike. Corrected: the
#     gradient norm rises from step 0 while the loss falls at step 2 and rises from step 3: both
#     grow and the norm began first, so by docs/escalation.md "the gradients lead".
@case("sgd_nesterov_momentum_typo_9", Want(*GRAD, step=-1), diverging=True)
def _nesterov() -> Program:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 16, generator=g)
        return x, x.sum(1, keepdim=True) / 4

    return Program(model, sgd(model, 0.01, momentum=9.0, nesterov=True), _steps(batch, 26),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


@case("sensor_scale_drift_doubling_each_step", Want(*SPIKE, step=-1), diverging=True)
def _drift() -> Program:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=g) * (2.0 ** step)  # a cumulative counter read as a feature
        return x, x[:, :1] * 0.5

    return Program(model, sgd(model, 1e-3), _steps(batch, 14), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


class SeqRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 32, batch_first=True)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


@case("tanh_rnn_40_steps_no_clipping_lr_too_high", Want(*SPIKE, step=-1), diverging=True)
def _rnn() -> Program:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    model = SeqRegressor()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 40, 4, generator=g)
        return x, x[:, :5, 0].sum(1, keepdim=True)

    return Program(model, sgd(model, 2.0), _steps(batch, 16), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 2e. An LR-range test (ExponentialLR x1.6 per step) left running. Expected first: loss_spike.
#     Corrected as 2b: the gradient norm's rise (from step 15) began before the loss's (step 16).
@case("lr_range_test_exponential_lr_left_running", Want(*GRAD, step=-1), diverging=True)
def _lr_finder() -> Program:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = sgd(model, 1e-3, momentum=0.9)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 16, generator=g)
        return x, x[:, :4].argmax(1)

    return Program(model, opt, _steps(batch, 36), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]),
                   scheduler=torch.optim.lr_scheduler.ExponentialLR(opt, 1.6))


# ======================================================================= the plain runs
def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def plain_run(program: Program) -> dict[str, Any]:
    """The program without nantrace: per step loss, gradient norm, and the first step whose loss,
    gradients or (after the update) parameters / optimizer state are non-finite, and what."""
    model, opt = program.model, program.optimizer
    losses, norms = [], []
    for step, batch in enumerate(program.batches):
        if program.before_step is not None:
            with torch.no_grad():
                program.before_step(model, step)
        opt.zero_grad()
        loss = run_step(program, program.loss, batch, step)
        if program.between is not None:
            program.between(model, opt, step)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        losses.append(float(loss.detach().sum()))
        norms.append(float(torch.stack([g.double().norm() for g in grads]).norm()))
        if not math.isfinite(losses[-1]):
            return dict(losses=losses, norms=norms, step=step, what="loss")
        if not _finite(grads):
            return dict(losses=losses, norms=norms, step=step, what="grads")
        opt.step()
        if program.scheduler is not None:
            program.scheduler.step()
        if not _finite(model.parameters()):
            return dict(losses=losses, norms=norms, step=step, what="params")
        if not _state_finite(opt):
            return dict(losses=losses, norms=norms, step=step, what="state")
    return dict(losses=losses, norms=norms, step=None, what=None)


def _rule_step(series: list[float], steps: int = 4, factor: float = 4.0) -> int | None:
    """docs/escalation.md's rule, written independently: the first step at which the series has
    risen ``steps`` times in a row by at least ``factor`` in all (``steps - 1`` times when by
    ``factor**3``), to a new high."""
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


_PLAIN: dict[str, dict[str, Any]] = {}


def plain(name: str) -> dict[str, Any]:
    if name not in _PLAIN:
        _PLAIN[name] = plain_run(CASES[name][0]())
    return _PLAIN[name]


# ======================================================================= the tests
WHAT = {"nonfinite_param": "params", "optimizer_state": "state", "nonfinite_grad": "grads", "nonfinite_loss": "loss"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails at the expected step in the expected
    way (optimizer cases: finite loss and gradients, non-finite parameters after the update);
    diverging ones rise by the documented rule at a step before the first non-finite value."""
    _, want = CASES[name]
    run = plain(name)
    assert run["step"] is not None, (name, run["losses"])
    if name in DIVERGING:
        rule = _rule_step(run["losses"])
        assert rule is not None and rule < run["step"] or want.step == run["step"], (rule, run["step"], run["losses"])
    else:
        assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run


def _want(name: str) -> Want:
    return CASES[name][1]


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n not in DIVERGING}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, _ = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), _want(name), JUDGE)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n in DIVERGING}, XFAIL))
def test_heldout_divergence(name: str, mode: str) -> None:
    """The first blocking incident is the divergence, at or after the rule's step and before the
    first non-finite value; the update it blocked did not happen; the run ends (at most) paused."""
    build, want = CASES[name]
    reference = plain(name)
    rules = [r for r in (_rule_step(reference["losses"]), _rule_step(reference["norms"])) if r is not None]
    rule = min(rules) if rules else None
    run = train(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    fields = {k: v for k, v in got.items() if k != "step"}
    assert fields == {k: v for k, v in JUDGE.want(want).items() if k != "step"}, [describe(i) for i in run.incidents]
    if want.step == -1:  # at or after the rule's first step (on either series), before the first non-finite value
        assert rule is not None and rule <= got["step"] < reference["step"], (got["step"], rule, reference["step"])
    else:
        assert got["step"] == want.step, [describe(i) for i in run.incidents]
    assert run.error is None or isinstance(run.error, nantrace.NonFiniteError), repr(run.error)
    assert run.unchanged_at_incident is True
