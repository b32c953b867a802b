"""Held-out failures, round 11b: MODERN ARCHITECTURES AND OPTIMIZERS, each a small but faithful
transcription of public code, in a complete training script.

1. Architectures: Gemma-2 final-logit soft-capping with ``final_logit_softcapping = 0.0`` meaning "off"
   (``cap * tanh(logits / cap)``: the division by 0 is absorbed by the tanh, its derivative is 0/0); an
   ST-MoE router whose z-loss is transcribed as ``log(exp(z).sum())**2`` under CPU bfloat16 autocast, the
   router placed before the norm and a batch with a sensor in raw units (bfloat16 shares float32's range,
   so this is a real overflow, not a precision one); a ViT with patch dropout without timm's
   ``max(1, ...)`` on a multi-resolution batch of one patch (mean pooling over no token); a decoder over
   image patches (LLaMA block: RoPE, GQA, SwiGLU) whose hand-written RMSNorm puts eps outside the root
   (``x / (sqrt(mean(x^2)) + eps)``), on letterboxed images whose black padding patches are zero; a
   Griffin RG-LRU in pure bfloat16 whose ``sqrt(1 - a^2)`` meets a decay rounded to 1 (the reason Griffin
   has ``SqrtBoundDerivative``); a sliding-window GQA whose window is ``T // 8`` (0 on a short document:
   every row masked); LLaMA's dynamic-NTK RoPE ported without its ``seq_len > max_pos`` guard (a negative
   base to a fractional power on a short batch).
2. Optimizers and schedules: a CLIP-style direct temperature trained by Lion, whose sign update walks it
   to exactly 0; a tensor port of Schedule-Free AdamW under a LambdaLR warm-up that starts at lr = 0
   (``weight / weight_sum`` = 0 / 0); Lion under a warmup-stable-decay schedule whose square-root
   cool-down is evaluated (numpy) past its end; HF-style Adafactor with ``clip_threshold = 0`` ("no
   clipping") on a dense-compute MoE whose expert gets no token (``rms(update) / 0`` = 0 / 0); a Cautious
   AdamW port whose mask is rescaled by ``mask.mean()`` without the paper's clamp, on a head whose
   dataset is absent from the batch.
3. QUIET programs that must not fire: the same MoE with Grok/Gemma-style router soft-capping; Mamba-2's
   SSD ``segsum`` done right (``masked_fill(-inf)`` before ``exp``) on a long sequence; GQA with SDPA, left
   padding and a float ``-inf`` mask that keeps the diagonal; a UNet (GroupNorm, cross-attention) with
   classifier-free-guidance null captions masked by ``-finfo.max``.

How expectations were derived (before nantrace ran): from /work/shared/API.md and docs/diagnosis.md. The
origin is the first op that made a non-finite value from finite inputs, or, when it received an infinity,
the op that made the infinity; for a gradient, the forward op whose derivative made the first non-finite
gradient; module = the innermost module running the op; source = the marked line (the optimizer's own line
for a Python optimizer). A non-finite forward value absorbed by a tanh keeps its own cause, phase
``forward``. A bfloat16 failure is ``precision_overflow`` only when float32 holds the step. In the optimizer:
a zero divisor made of plain numbers (settings: lr, clip_threshold) or a NaN setting is ``optimizer_state``;
a zero divisor that is a sum/mean over this step's update and gradient is ``div_by_zero``.
Every construction is checked with plain torch (``test_cases_fail_without_nantrace``): the step and stage of
the first non-finite value, the first op that made one (round 8b's ``Made``), for backward cases the first
autograd node whose output gradient is non-finite from finite incoming gradients (``_first_bad_node``), and
for the bfloat16 case that the float32 copy of the step is finite.
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heldout_harness import Judge, Program, case_params, describe, run_step, train
from test_heldout_programs_r8b import Made, _finite
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

JUDGE = Judge(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
NODE: dict[str, str] = {}
"""Backward cases -> the autograd node that first turns finite incoming gradients non-finite."""
FP32_FINE: set[str] = set()
"""bfloat16 cases whose step is finite in float32."""
ABSORBED_INF: set[str] = set()
"""Optimizer cases whose earlier updates make an infinity that the next op absorbs (``x / inf`` = 0): checked as
the first op that made a NaN in the failing update."""
MASKED: set[str] = set()
"""Cases whose origin receives an intentional -inf (a mask): checked as the first op that made a NaN from inputs
without NaN, and that its input held a row entirely -inf."""
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want, node: str | None = None, fp32_fine: bool = False, masked: bool = False) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if node:
            NODE[name] = node
        if fp32_fine:
            FP32_FINE.add(name)
        if masked:
            MASKED.add(name)
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(batch: Callable[[int], Any], n: int) -> list[Any]:
    return [batch(s) for s in range(n)]


# ================================================================= shared LLaMA-style parts
class RMSNorm(nn.Module):
    """LLaMA's RMSNorm, as in the reference code."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def rope_tables(t: int, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE and F.scaled_dot_product_attention."""

    def __init__(self, d: int, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, heads * self.hd, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        cos, sin = rope_tables(t, self.hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(self.h // self.kv, 1), v.repeat_interleave(self.h // self.kv, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


# ================================================================= 1. architectures
# 1a. Gemma-2's final-logit soft-capping, ``logits = cap * tanh(logits / cap)``, applied whenever the config
#     value is "not None"; the fine-tuning config sets ``final_logit_softcapping = 0.0`` meaning "off". The
#     division by 0 makes +-inf, tanh takes it to +-1 and ``0 * 1`` = 0: the loss is finite (uniform logits),
#     and the derivative is 0 / 0 = NaN. Absorbed by a tanh: the forward division's own cause, phase forward.
class GemmaLM(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 32, final_logit_softcapping: float | None = 30.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn_norm, self.attn = RMSNorm(d), GQAttention(d)
        self.mlp_norm, self.mlp = RMSNorm(d), SwiGLU(d, 64)
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.final_logit_softcapping = final_logit_softcapping

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) * math.sqrt(self.embed.embedding_dim)
        x = x + self.attn(self.attn_norm(x), causal=True)
        x = x + self.mlp(self.mlp_norm(x))
        logits = self.lm_head(self.norm(x))
        if self.final_logit_softcapping is not None:
            logits = logits / self.final_logit_softcapping  # <origin:gemma_softcap>
            logits = torch.tanh(logits) * self.final_logit_softcapping
        return logits


def lm_loss(model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@case("gemma2_final_logit_softcapping_zero_meaning_off",
      Want("nonfinite_grad", "forward", "aten.div.Tensor", "", "gemma_softcap", "div_by_zero", step=0))
def _gemma_softcap() -> Program:
    torch.manual_seed(0)
    model = GemmaLM(final_logit_softcapping=0.0)
    g = _gen(1101)
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(lambda s: torch.randint(0, 48, (4, 12), generator=g), 4),
                   lm_loss)


# 1b. ST-MoE's router z-loss transcribed from the paper, ``log(sum(exp(z)))**2``, under CPU bfloat16 autocast;
#     the router reads the block's input before its norm (the experts read the normed input). At step 3 a
#     plant's flow sensor arrives in raw units (x 1e4): router logits in the thousands, exp overflows, in
#     bfloat16 as it would in float32 (same range). The quiet twin caps the router logits with 30 * tanh(z / 30).
class Top2Router(nn.Module):
    def __init__(self, d: int, experts: int, softcap: float | None) -> None:
        super().__init__()
        self.proj = nn.Linear(d, experts, bias=False)
        self.softcap = softcap

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.proj(h)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        z_loss = torch.log(torch.exp(logits).sum(-1)).pow(2).mean()  # <origin:router_exp>
        weights, idx = logits.softmax(-1).topk(2, -1)
        return weights / weights.sum(-1, keepdim=True), idx, z_loss


class ExpertFFN(nn.Sequential):
    def __init__(self, d: int) -> None:
        super().__init__(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


class SensorMoE(nn.Module):
    def __init__(self, features: int = 10, d: int = 16, experts: int = 4, softcap: float | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(features, d)
        self.router = Top2Router(d, experts, softcap)
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList([ExpertFFN(d) for _ in range(experts)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        weights, idx, z_loss = self.router(h)
        hn = self.norm(h)
        out = torch.zeros_like(hn)
        for e, expert in enumerate(self.experts):
            w = (weights * (idx == e)).sum(-1, keepdim=True)
            out = out + w * expert(hn)
        return self.head(hn + out).squeeze(-1), z_loss


def moe_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred, z_loss = model(x)
    return F.mse_loss(pred.float(), y) + 1e-3 * z_loss.float()


def _sensor_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 10, generator=g)
        y = x[:, :3].sum(-1) + 0.1 * torch.randn(32, generator=g)
        if step == 3:
            x[:, 4] = x[:, 4] * 1e4 + 2e4  # the flow sensor in l/h instead of standardised units
        return x, y

    return _steps(batch, 5)


@case("st_moe_handwritten_z_loss_bf16_autocast_router_before_norm_raw_sensor",
      Want("nonfinite_loss", "forward", "aten.exp.default", "router", "router_exp", "exp_overflow"))
def _moe_zloss() -> Program:
    torch.manual_seed(0)
    model = SensorMoE()
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _sensor_batches(1102), moe_loss)


# 1c. ViT with patch dropout (FLIP / timm's PatchDropout) written without timm's ``max(1, ...)``, trained at
#     mixed resolutions (FlexiViT-style random resolution per batch). At step 3 the batch is 8x8: one 8x8
#     patch, ``int(1 * 0.25)`` = 0 patches kept, and the global average pool averages over no token.
class PatchDropout(nn.Module):
    def __init__(self, prob: float) -> None:
        super().__init__()
        self.prob = prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.prob == 0.0:
            return x
        b, n, d = x.shape
        keep = int(n * (1.0 - self.prob))
        idx = torch.rand(b, n).argsort(-1)[:, :keep]
        return x.gather(1, idx[..., None].expand(-1, -1, d))


class ViTBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class FlexiViT(nn.Module):
    def __init__(self, d: int = 32, classes: int = 5, patch_drop: float = 0.75) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, 8, 8)
        self.pos_embed = nn.Parameter(torch.randn(1, d, 4, 4) * 0.02)
        self.patch_drop = PatchDropout(patch_drop)
        self.blocks = nn.ModuleList([ViTBlock(d)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(img)
        x = x + F.interpolate(self.pos_embed, size=x.shape[-2:], mode="bilinear", align_corners=False)
        x = self.patch_drop(x.flatten(2).transpose(1, 2))
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x).mean(1)  # <origin:vit_gap>
        return self.head(x)


@case("vit_patch_dropout_without_min_keep_random_resolution_one_patch",
      Want("nonfinite_loss", "forward", "aten.mean.dim", "", "vit_gap", "div_by_zero"))
def _vit_patch_drop() -> Program:
    torch.manual_seed(0)
    model = FlexiViT()
    g = _gen(1103)
    sizes = [32, 24, 16, 8, 32]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(6, 3, sizes[step], sizes[step], generator=g), torch.randint(0, 5, (6,), generator=g)

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1d. A decoder over image patches (LLaMA block: RoPE, no additive position, GQA, SwiGLU, bias-free linear patch
#     embedding) whose RMSNorm is written ``x / (sqrt(mean(x^2)) + eps)``: eps outside the root. Letterboxed
#     images at step 3: their black padding patches embed to exact zeros, the forward is finite (0 / eps), and
#     sqrt's derivative at 0 times the zero incoming gradient is 0 / 0 = NaN in the patch embedding's gradient.
class EpsOutsideRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # <origin:rms_sqrt>
        return self.weight * x / (rms + self.eps)


class PatchLlamaBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.attn = EpsOutsideRMSNorm(d), GQAttention(d)
        self.norm2, self.mlp = EpsOutsideRMSNorm(d), SwiGLU(d, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchLlama(nn.Module):
    def __init__(self, d: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(16, d, bias=False)
        self.blocks = nn.ModuleList([PatchLlamaBlock(d)])
        self.norm = EpsOutsideRMSNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        b = img.shape[0]
        patches = img.unfold(1, 4, 4).unfold(2, 4, 4).reshape(b, -1, 16)
        x = self.patch_embed(patches)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(1))


@case("patch_llama_rmsnorm_eps_outside_sqrt_letterboxed_black_patches",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "blocks.0.norm1", "rms_sqrt", "grad_singularity"),
      node="SqrtBackward0")
def _patch_llama() -> Program:
    torch.manual_seed(0)
    model = PatchLlama()
    g = _gen(1104)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.rand(6, 16, 16, generator=g) + 0.05
        if step == 3:
            img[:, 12:] = 0.0  # letterboxed: the bottom band of patches is black padding
        return img, torch.randint(0, 4, (6,), generator=g)

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1e. Griffin's RG-LRU (De et al. 2024) in a pure-bfloat16 model: ``a = sigma(L)``, ``log_a = -8 r softplus(-L)``,
#     ``sqrt(1 - exp(2 log_a))``, with the paper's initialisation a^8 in [0.9, 0.999]. For the slowest channels
#     exp(2 log_a) > 0.99805 rounds to 1.0 in bfloat16: sqrt(0), whose derivative is infinite (the paper's
#     SqrtBoundDerivative exists for this). In float32 1 - a^2 ~ 2e-3 r > 0: finite. Fails at the first step.
class RGLRU(nn.Module):
    def __init__(self, d: int, c: float = 8.0) -> None:
        super().__init__()
        self.c = c
        self.gate_x, self.gate_a = nn.Linear(d, d), nn.Linear(d, d)
        a = torch.linspace(0.9, 0.999, d) ** (1.0 / c)
        self.a_param = nn.Parameter(torch.log(a / (1 - a)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, i = torch.sigmoid(self.gate_a(x)), torch.sigmoid(self.gate_x(x))
        log_a = -self.c * r * F.softplus(-self.a_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        normalized_x = (i * x) * torch.sqrt(1 - a_square)  # <origin:rglru_sqrt>
        h = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + normalized_x[:, t]
            out.append(h)
        return torch.stack(out, 1)


class GriffinBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d)
        self.in_proj, self.gate_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.rglru = RGLRU(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.out_proj(self.rglru(self.in_proj(h)) * F.gelu(self.gate_proj(h)))


class GriffinLM(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([GriffinBlock(d)])
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


@case("griffin_rglru_pure_bf16_decay_rounds_to_one_sqrt_backward",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "blocks.0.rglru", "rglru_sqrt", "precision_overflow",
           step=0),
      node="SqrtBackward0", fp32_fine=True)
def _griffin() -> Program:
    torch.manual_seed(0)
    model = GriffinLM().to(torch.bfloat16)
    g = _gen(1105)
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), _steps(lambda s: torch.randint(0, 40, (4, 10), generator=g), 4),
                   lm_loss)


# 1f. Sliding-window GQA (Mistral-style local attention, hand-written softmax) whose window is configured as a
#     fraction of the batch's length, ``T // 8``. Documents are packed into length 32 (window 4); the corpus'
#     remainder at step 3 is 7 tokens long: window 0, no key allowed for any query, every row of the masked
#     scores is -inf and the softmax is NaN everywhere.
class SlidingWindowAttention(GQAttention):
    def __init__(self, d: int, window_div: int = 8) -> None:
        super().__init__(d)
        self.window_div = window_div

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
        v = self.wv(x).view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
        cos, sin = rope_tables(t, self.hd)
        scores = rope(q, cos, sin) @ rope(k, cos, sin).transpose(-1, -2) / math.sqrt(self.hd)
        window = t // self.window_div
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = (j <= i) & (i - j < window)
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # <origin:swa_softmax>
        return self.wo((attn @ v).transpose(1, 2).reshape(b, t, -1))


class LocalLM(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn_norm, self.attn = RMSNorm(d), SlidingWindowAttention(d)
        self.mlp_norm, self.mlp = RMSNorm(d), SwiGLU(d, 64)
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        return self.lm_head(self.norm(x))


@case("mistral_style_sliding_window_fraction_of_length_short_remainder",
      Want("nonfinite_loss", "forward", "aten._softmax.default", "attn", "swa_softmax", "masked_softmax_all"),
      masked=True)
def _swa() -> Program:
    torch.manual_seed(0)
    model = LocalLM()
    g = _gen(1106)
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                   _steps(lambda s: torch.randint(0, 48, (4, 8 if s == 3 else 33), generator=g), 5), lm_loss)


# 1g. LLaMA's dynamic-NTK RoPE (HF's ``LlamaDynamicNTKScalingRotaryEmbedding``) ported "branch-free" for
#     torch.compile: the ``if seq_len > max_position_embeddings`` guard dropped. For batches at least as long as
#     the original context the factor is >= 1; the short batch at step 3 (8 < 16) gives 4 * 8 / 16 - 3 = -1, and
#     (-1) ** (dim / (dim - 2)) is a fractional power of a negative number: NaN base, NaN inv_freq, NaN q and k.
#     CPU's fused SDPA kernel returns 0 for rows of NaN scores (checked: the loss stays finite), so the NaN
#     shows in the gradients; absorbed by an op that is no selection: the pow's own cause, phase forward.
class DynamicNTKRotary(nn.Module):
    def __init__(self, dim: int, max_position_embeddings: int = 16, base: float = 10000.0, scaling_factor: float = 4.0) -> None:
        super().__init__()
        self.dim, self.max_position_embeddings, self.base, self.scaling_factor = dim, max_position_embeddings, base, scaling_factor

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = torch.max(position_ids) + 1
        factor = (self.scaling_factor * seq_len / self.max_position_embeddings) - (self.scaling_factor - 1)
        base = self.base * factor ** (self.dim / (self.dim - 2))  # <origin:ntk_pow>
        inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos()[:, None], emb.sin()[:, None]


class NTKAttention(GQAttention):
    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.rotary = DynamicNTKRotary(self.hd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        cos, sin = self.rotary(torch.arange(t)[None].expand(b, -1))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class LongContextLM(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.ModuleDict(dict(attn_norm=RMSNorm(d), attn=NTKAttention(d),
                                                        mlp_norm=RMSNorm(d), mlp=SwiGLU(d, 64)))])
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer["attn"](layer["attn_norm"](x))
            x = x + layer["mlp"](layer["mlp_norm"](x))
        return self.lm_head(self.norm(x))


@case("llama_dynamic_ntk_rope_without_length_guard_short_batch",
      Want("nonfinite_grad", "forward", "aten.pow.Tensor_Scalar", "layers.0.attn.rotary", "ntk_pow", "sqrt_negative"))
def _ntk() -> Program:
    torch.manual_seed(0)
    model = LongContextLM()
    g = _gen(1107)
    lengths = [33, 25, 17, 9, 33]
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                   _steps(lambda s: torch.randint(0, 48, (4, lengths[s]), generator=g), 5), lm_loss)


# ================================================================= 2. optimizers and schedules
# 2a. A CLIP-style dual encoder whose temperature is learned directly (``logits = sim / tau``), trained by Lion
#     (lucidrains' lion-pytorch) with its own param group (lr 0.125, no weight decay). Lion's update is
#     lr * sign(...) whatever the gradient's size: tau = 0.375 -> 0.25 -> 0.125 -> 0.0 exactly, and the step-3
#     forward divides the similarities by zero.
class Lion(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in filter(lambda p: p.grad is not None, group["params"]):
                grad, lr, wd, state = p.grad, group["lr"], group["weight_decay"], self.state[p]
                beta1, beta2 = group["betas"]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.data.mul_(1.0 - lr * wd)  # <origin:lion_decay>
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


class DirectTemperatureCLIP(nn.Module):
    def __init__(self, d_in: int = 24, d: int = 16) -> None:
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(d_in, 32), nn.GELU(), nn.Linear(32, d))
        self.textual = nn.Sequential(nn.Linear(d_in, 32), nn.GELU(), nn.Linear(32, d))
        self.textual.load_state_dict(self.visual.state_dict())  # both towers start from the same checkpoint
        self.temperature = nn.Parameter(torch.tensor(0.375))

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        zi, zt = F.normalize(self.visual(img), dim=-1), F.normalize(self.textual(txt), dim=-1)
        return zi @ zt.t() / self.temperature  # <origin:clip_tau>


def clip_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    logits = model(*batch)
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@case("clip_direct_temperature_lion_sign_steps_to_exactly_zero",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "clip_tau", "div_by_zero"))
def _clip_lion() -> Program:
    torch.manual_seed(0)
    model = DirectTemperatureCLIP()
    others = [p for n, p in model.named_parameters() if n != "temperature"]
    opt = Lion([dict(params=others), dict(params=[model.temperature], lr=0.125)], lr=1e-4, weight_decay=0.1)
    opt.param_groups[1]["weight_decay"] = 0.0
    g = _gen(1108)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.randn(16, 24, generator=g)
        return img, img + 0.1 * torch.randn(16, 24, generator=g)  # paired caption features

    return Program(model, opt, _steps(batch, 5), clip_loss)


# 2b. Schedule-Free AdamW (Defazio et al. 2024) ported with its running sums as tensors (no host sync), under
#     the user's usual LambdaLR linear warm-up ``s / warmup``, which starts at lr = 0. The reference code guards
#     ``weight / weight_sum`` with ``except ZeroDivisionError``; the port divides tensors: at step 0 weight =
#     lr_max^2 = 0 and weight_sum = 0, ckp1 = 0 / 0 = NaN, and ``y.lerp_(z, ckp1)`` writes NaN into the weights.
class AdamWScheduleFreePort(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 2.5e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, r: float = 0.0, weight_lr_power: float = 2.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, r=r, k=0,
                                      weight_lr_power=weight_lr_power, lr_max=-1.0, weight_sum=torch.tensor(0.0)))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            k = group["k"]
            lr = group["lr"] * math.sqrt(1 - beta2 ** (k + 1))
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = torch.tensor(((k + 1) ** group["r"]) * (lr_max ** group["weight_lr_power"]))
            weight_sum = group["weight_sum"] = group["weight_sum"] + weight
            ckp1 = weight / weight_sum  # <origin:sf_ckp1>
            for y in group["params"]:
                if y.grad is None:
                    continue
                state = self.state[y]
                if "z" not in state:
                    state["z"], state["exp_avg_sq"] = y.detach().clone(), torch.zeros_like(y)
                z, exp_avg_sq = state["z"], state["exp_avg_sq"]
                exp_avg_sq.mul_(beta2).addcmul_(y.grad, y.grad, value=1 - beta2)
                grad_normalized = y.grad / exp_avg_sq.sqrt().add_(group["eps"])
                if group["weight_decay"] != 0:
                    grad_normalized.add_(y, alpha=group["weight_decay"])
                y.lerp_(z, ckp1)
                y.add_(grad_normalized * (lr * (beta1 * (1 - ckp1) - 1)))
                z.sub_(grad_normalized, alpha=lr)
            group["k"] = k + 1


class TabularResNet(nn.Module):
    def __init__(self, features: int = 12, d: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(features, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h + self.block(h))


def _tab_batches(seed: int, n: int) -> list[Any]:
    g = _gen(seed)
    return _steps(lambda s: (torch.randn(32, 12, generator=g), torch.randint(0, 3, (32,), generator=g)), n)


@case("schedule_free_adamw_tensor_port_lambdalr_warmup_from_zero",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "stem", "sf_ckp1", "optimizer_state", step=0))
def _schedule_free() -> Program:
    torch.manual_seed(0)
    model = TabularResNet()
    opt = AdamWScheduleFreePort(model.parameters(), lr=2.5e-3)
    warmup = 4
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup))
    return Program(model, opt, _tab_batches(1109, 4), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), scheduler=sched)


# 2c. Lion under a warmup-stable-decay schedule whose cool-down is the "sqrt" shape, evaluated with numpy:
#     ``sqrt(1 - (s - decay_start) / decay_steps)``. The run was extended past the planned 5 steps (a resumed
#     job): at step 6 the argument is -1/2, numpy returns NaN (a warning, no exception), LambdaLR sets lr = NaN
#     and Lion's decoupled weight decay ``p.mul_(1 - lr * wd)`` is the first op to write NaN.
@case("lion_wsd_sqrt_cooldown_numpy_evaluated_past_end_nan_lr",
      Want("nonfinite_param", "optimizer", "aten.mul_.Tensor", "stem", "lion_decay", "optimizer_state", step=6))
def _lion_wsd() -> Program:
    torch.manual_seed(0)
    model = TabularResNet()
    opt = Lion(model.parameters(), lr=3e-4, weight_decay=0.1)
    warmup, decay_start, decay_steps = 1, 3, 2

    def wsd(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        if s < decay_start:
            return 1.0
        return float(np.sqrt(1.0 - (s - decay_start) / decay_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, wsd)
    return Program(model, opt, _tab_batches(1110, 8), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), scheduler=sched)


# 2d. HF transformers' Adafactor (factored second moment, update clipping by RMS), given ``clip_threshold=0.0``
#     to "turn clipping off", on a dense-compute MoE (every expert runs, the top-1 gate zeroes the others). For a
#     parameter with a gradient, rms(update) / 0 = inf, clamp -> inf and update / inf = 0 (silently frozen); at
#     step 3 expert 2 gets no token: its gradient is exactly 0, rms(update) = 0, and 0 / 0 = NaN.
class HFAdafactor(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate))

    @staticmethod
    def _rms(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.norm(2) / (tensor.numel() ** 0.5)

    @staticmethod
    def _approx_sq_grad(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        return torch.mul(r_factor, col.unsqueeze(-2).rsqrt())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                factored = grad.dim() >= 2
                if len(state) == 0:
                    state["step"] = 0
                    if factored:
                        state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1])
                        state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:])
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                state["step"] += 1
                beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
                update = grad ** 2 + group["eps"][0]
                if factored:
                    state["exp_avg_sq_row"].mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    state["exp_avg_sq_col"].mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    update = self._approx_sq_grad(state["exp_avg_sq_row"], state["exp_avg_sq_col"])
                    update.mul_(grad)
                else:
                    state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = state["exp_avg_sq"].rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))  # <origin:adafactor_clip>
                p.add_(-update * group["lr"])


class DenseTop1MoE(nn.Module):
    def __init__(self, features: int = 8, d: int = 16, experts: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(features, d)
        self.gate = nn.Linear(features, experts)
        self.experts = nn.ModuleList([ExpertFFN(d) for _ in range(experts)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        probs = self.gate(x).softmax(-1)
        top = F.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype) * probs
        out = sum(top[:, e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return self.head(h + out).squeeze(-1)


@case("hf_adafactor_clip_threshold_zero_meaning_off_dense_moe_unrouted_expert",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "experts.2.0", "adafactor_clip", "optimizer_state"))
def _adafactor_clip0() -> Program:
    torch.manual_seed(0)
    model = DenseTop1MoE()
    with torch.no_grad():  # the gate routes on feature 0's band: low -> 0, middle -> 1, high -> 2
        model.gate.weight.zero_()
        model.gate.bias.copy_(torch.tensor([0.0, 1.0, 0.0]))
        model.gate.weight[:, 0] = torch.tensor([-4.0, 0.0, 4.0])
    opt = HFAdafactor(model.parameters(), lr=1e-3, clip_threshold=0.0)
    g = _gen(1111)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(24, 8, generator=g)
        x[:8, 0], x[8:16, 0], x[16:, 0] = -2.0, 0.0, 2.0
        if step == 3:
            x[16:, 0] = 0.0  # a night-shift batch: no high load reading, expert 2 gets no token
        return x, x[:, 1:4].sum(-1)

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


ABSORBED_INF.add("hf_adafactor_clip_threshold_zero_meaning_off_dense_moe_unrouted_expert")


# 2e. Cautious AdamW (Liang et al. 2024) ported with ``mask / mask.mean()`` (the paper clamps the mean to 1e-3),
#     on a two-dataset classifier with one head per dataset whose loss is summed over the dataset's samples and
#     divided by max(n, 1) (that guard is right). At step 3 the batch holds no sample of dataset B: head B's
#     gradient is exactly 0 (set_to_none does not apply: the head is in the graph), Adam's momentum is not, so
#     update * grad > 0 nowhere, the mask is all 0 and its mean 0: 0 / 0 = NaN in head B.
class CautiousAdamW(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if len(state) == 0:
                    state["step"], state["exp_avg"], state["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                mask = (update * grad > 0).to(grad.dtype)
                mask = mask / mask.mean()  # <origin:cautious_mask>
                p.add_(update * mask, alpha=-group["lr"])


class TwoDatasetClassifier(nn.Module):
    def __init__(self, features: int = 12, d: int = 32) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(features, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.head_a = nn.Linear(d, 5)
        self.head_b = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.backbone(x)
        return self.head_a(h), self.head_b(h)


def two_dataset_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, source = batch
    logits_a, logits_b = model(x)
    in_a, in_b = source == 0, source == 1
    loss_a = F.cross_entropy(logits_a[in_a], y[in_a].clamp(max=4), reduction="sum") / max(int(in_a.sum()), 1)
    loss_b = F.cross_entropy(logits_b[in_b], y[in_b].clamp(max=2), reduction="sum") / max(int(in_b.sum()), 1)
    return loss_a + loss_b


@case("cautious_adamw_mask_mean_without_clamp_head_of_absent_dataset",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "head_b", "cautious_mask", "div_by_zero"))
def _cautious() -> Program:
    torch.manual_seed(0)
    model = TwoDatasetClassifier()
    g = _gen(1112)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        source = torch.zeros(16, dtype=torch.long) if step == 3 else (torch.arange(16) % 2)
        return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g), source

    return Program(model, CautiousAdamW(model.parameters(), lr=1e-3), _steps(batch, 5), two_dataset_loss)


# ================================================================= 3. quiet programs
QUIET: dict[str, Callable[[], Program]] = {}


def quiet_case(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        return build

    return register


@quiet_case("st_moe_router_softcapped_z_loss_bf16_autocast_raw_sensor")
def _q_moe_softcap() -> Program:
    torch.manual_seed(0)
    model = SensorMoE(softcap=30.0)
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _sensor_batches(1102), moe_loss)


# Mamba-2's SSD in its minimal reference form: ``segsum`` masks the upper triangle with -inf BEFORE exp (the
# exp of the unmasked upper triangle would overflow on this 256-token sequence), and the chunk is causal.
def segsum(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    x_segsum = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=0)
    return x_segsum.masked_fill(~mask, -torch.inf)


class SSDMixer(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, state: int = 8) -> None:
        super().__init__()
        self.h, self.p, self.n = heads, d // heads, state
        self.in_proj = nn.Linear(d, d + 2 * state + heads)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, heads)))
        self.dt_bias = nn.Parameter(torch.full((heads,), 0.5))
        self.out_proj = nn.Linear(d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, t, d = u.shape
        x, bm, cm, dt = self.in_proj(u).split([d, self.n, self.n, self.h], -1)
        dt = F.softplus(dt + self.dt_bias)  # (b, t, h)
        a = -torch.exp(self.A_log) * dt
        big_l = torch.exp(segsum(a.transpose(1, 2)))  # (b, h, t, t)
        xh = (x * 1.0).view(b, t, self.h, self.p) * dt[..., None]
        y = torch.einsum("bln,bsn,bhls,bshp->blhp", cm, bm, big_l, xh)
        return self.out_proj(y.reshape(b, t, d))


class Mamba2LM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm1, self.mixer = RMSNorm(d), SSDMixer(d)
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.mixer(self.norm1(x))
        return self.lm_head(self.norm(x))


@quiet_case("mamba2_ssd_segsum_masked_before_exp_long_sequence")
def _q_mamba2() -> Program:
    torch.manual_seed(0)
    model = Mamba2LM()
    g = _gen(1113)
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                   _steps(lambda s: torch.randint(0, 32, (2, 257 if s == 3 else 33), generator=g), 5), lm_loss)


# GQA with SDPA and left padding: the float mask (0 / -inf) is causal AND key-not-padding, OR the diagonal, so a
# padding query attends to itself (HF's fix for fully masked rows); the loss ignores padding labels.
class LeftPaddedLM(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn_norm, self.attn = RMSNorm(d), GQAttention(d)
        self.mlp_norm, self.mlp = RMSNorm(d), SwiGLU(d, 64)
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        allowed = (causal[None] & attention_mask[:, None, :].bool()) | torch.eye(t, dtype=torch.bool)[None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]
        x = self.embed(idx)
        x = x + self.attn(self.attn_norm(x), mask=mask)
        x = x + self.mlp(self.mlp_norm(x))
        return self.lm_head(self.norm(x))


def left_padded_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    idx, am = batch
    logits = model(idx[:, :-1], am[:, :-1])
    labels = idx[:, 1:].masked_fill(am[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


@quiet_case("gqa_sdpa_left_padding_minus_inf_mask_keeps_diagonal")
def _q_gqa() -> Program:
    torch.manual_seed(0)
    model = LeftPaddedLM()
    g = _gen(1114)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(1, 48, (4, 12), generator=g)
        am = torch.ones(4, 12, dtype=torch.long)
        am[1, :5], am[2, :9] = 0, 0
        return idx.masked_fill(am == 0, 0), am

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, 5), left_padded_loss)


# A small text-conditioned UNet (GroupNorm, SiLU, a cross-attention at the bottleneck), classifier-free guidance
# dropout replacing captions by all-padding; the cross-attention masks padding keys with -finfo.max (the latent
# diffusion code's choice), so a null caption's row is uniform, not NaN.
class CrossAttention(nn.Module):
    def __init__(self, c: int, ctx: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, c)
        self.q, self.k, self.v, self.o = nn.Linear(c, c), nn.Linear(ctx, c), nn.Linear(ctx, c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)
        sim = self.q(h) @ self.k(context).transpose(1, 2) / math.sqrt(c)
        sim = sim.masked_fill(~mask[:, None, :], -torch.finfo(sim.dtype).max)
        out = self.o(sim.softmax(-1) @ self.v(context))
        return x + out.transpose(1, 2).reshape(b, c, hh, ww)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(temb, cout)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.t(t)[..., None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class TinyUNet(nn.Module):
    def __init__(self, c: int = 16, ctx: int = 12, vocab: int = 30) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, ctx)
        self.temb = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 32))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = ResBlock(c, 2 * c, 32)
        self.mid = ResBlock(2 * c, 2 * c, 32)
        self.xattn = CrossAttention(2 * c, ctx)
        self.up = ResBlock(4 * c, c, 32)
        self.out = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        half = 8
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
        temb = self.temb(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], -1))
        h0 = self.inp(x)
        h1 = self.down(F.avg_pool2d(h0, 2), temb)
        h = self.xattn(self.mid(h1, temb), self.tok(tokens), mask)
        h = self.up(torch.cat([F.interpolate(h, scale_factor=2.0), F.interpolate(h1, scale_factor=2.0)], 1), temb)
        return self.out(h + h0)


def diffusion_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, tokens, mask, t, noise = batch
    ab = torch.cos((t / 1000.0 + 0.008) / 1.008 * math.pi / 2) ** 2
    xt = ab.sqrt()[:, None, None, None] * x0 + (1 - ab).sqrt()[:, None, None, None] * noise
    return F.mse_loss(model(xt, t, tokens, mask), noise)


@quiet_case("unet_cfg_null_caption_cross_attention_masked_by_finfo_max")
def _q_unet() -> Program:
    torch.manual_seed(0)
    model = TinyUNet()
    g = _gen(1115)

    def batch(step: int) -> Any:
        tokens = torch.randint(1, 30, (4, 6), generator=g)
        mask = torch.ones(4, 6, dtype=torch.bool)
        mask[:, 4:] = False
        drop = torch.tensor([step % 2 == 1, False, step == 3, False])  # CFG dropout: the null caption
        mask[drop] = False
        tokens = tokens.masked_fill(~mask, 0)
        return (torch.rand(4, 3, 8, 8, generator=g) * 2 - 1, tokens, mask,
                torch.randint(0, 1000, (4,), generator=g).float(), torch.randn(4, 3, 8, 8, generator=g))

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, 5), diffusion_loss)


# ======================================================================= the plain runs
def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def plain_run(program: Program) -> dict[str, Any]:
    """Without nantrace, under the op recorder: the first step whose loss, gradients or (after the update)
    parameters / optimizer state are non-finite, or that raised."""
    model, opt = program.model, program.optimizer
    rec = Made()
    out: dict[str, Any] = dict(step=None, what=None, error=None, rec=rec)
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            opt.zero_grad()
            try:
                loss = run_step(program, program.loss, batch, step)
            except Exception as exc:  # noqa: BLE001
                out.update(step=step, what="raised", error=exc)
                return out
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not bool(torch.isfinite(loss.detach()).all()):
                out.update(step=step, what="loss")
                return out
            if not _finite(grads):
                out.update(step=step, what="grads")
                return out
            opt.step()
            if program.scheduler is not None:
                program.scheduler.step()
            if not _finite(model.parameters()):
                out.update(step=step, what="params")
                return out
            if not _state_finite(opt):
                out.update(step=step, what="state")
                return out
    return out


class NaNMade(TorchDispatchMode):
    """Ops whose floating inputs hold no NaN and whose output does: (step, op, an input row entirely -inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.made: list[tuple[int, str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        clean = not any(bool(torch.isnan(a).any()) for a in tensors)
        out = func(*args, **kwargs)
        if clean and any(isinstance(o, torch.Tensor) and o.is_floating_point() and bool(torch.isnan(o).any())
                         for o in tree_leaves(out)):
            row = any(a.dim() > 0 and bool((a == float("-inf")).all(-1).any()) for a in tensors)
            self.made.append((self.step, f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}", row))
        return out


def _first_nan_op(program: Program, step: int, optimizer: bool = False) -> tuple[str, bool] | None:
    """The failing step's first op that made a NaN from inputs without NaN (-inf allowed), on a fresh build; with
    ``optimizer``, in the failing step's update."""
    rec = NaNMade()
    with rec:
        for s, batch in enumerate(program.batches[: step + 1]):
            rec.step = s
            program.optimizer.zero_grad()
            run_step(program, program.loss, batch, s)
            if optimizer:
                rec.made.clear()
            if s < step or optimizer:
                program.optimizer.step()
    made = [(op, row) for s, op, row in rec.made if s == step]
    return made[0] if made else None


def _first_bad_node(program: Program, step: int, fp32: bool = False) -> str | None:
    """The failing step's first autograd node (in execution order) whose incoming gradients are finite and whose
    outgoing ones are not, on a fresh build trained up to that step (float32 copy when ``fp32``)."""
    model, opt = program.model, program.optimizer
    if fp32:
        model.float()
    for s, batch in enumerate(program.batches[:step]):
        opt.zero_grad()
        run_step(program, program.loss, batch, s)
        opt.step()
        if program.scheduler is not None:
            program.scheduler.step()
    batch = program.batches[step]
    if fp32:
        batch = batch.float() if batch.is_floating_point() else batch
    opt.zero_grad()
    loss = program.loss(model, batch, step)
    bad: list[str] = []

    def ok(ts: Any) -> bool:
        return all(t is None or bool(torch.isfinite(t).all()) for t in ts)

    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        node.register_hook(lambda gin, gout, n=node: bad.append(n.name()) if ok(gout) and not ok(gin) else None)
        stack.extend(nxt for nxt, _ in node.next_functions)
    loss.backward()
    return bad[0] if bad else None


WHAT = {"nonfinite_param": "params", "optimizer_state": "state", "nonfinite_grad": "grads", "nonfinite_loss": "loss",
        "exception": "raised"}


# ======================================================================= the tests
@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails at the expected step, in the expected stage, the
    first op that made a non-finite value is the expected one (forward and optimizer origins) and nothing was
    made non-finite before; for backward origins, the first autograd node that turned finite gradients
    non-finite is the expected op's; a bfloat16 case's step is finite in float32."""
    build, want = CASES[name]
    run = plain_run(build())
    rec = run["rec"]
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), (run["step"], run["what"], run["error"])
    if name in ABSORBED_INF:
        assert {m[1] for m in rec.made if m[0] < want.step} <= {"aten.div.Tensor", "aten.clamp_.default"}, rec.made[:4]
        assert _first_nan_op(build(), want.step, optimizer=True)[0] == want.op
        return
    assert not [m for m in rec.made if m[0] < want.step], rec.made[:4]
    if name in NODE:
        assert _first_bad_node(build(), want.step) == NODE[name]
    elif name in MASKED:
        assert _first_nan_op(build(), want.step) == (want.op, True)
    else:
        assert rec.first(want.step, want.phase == "optimizer") == want.op, rec.made[:6]
    if name in FP32_FINE:
        assert _first_bad_node(build(), want.step, fp32=True) is None


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    run = plain_run(QUIET[name]())
    assert run["step"] is None and not run["rec"].made, (run["step"], run["what"], run["error"], run["rec"].made[:4])


@pytest.mark.parametrize("name,mode", case_params(QUIET, {}))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident that blocks an update, and the program trains to its end."""
    run = train(QUIET[name](), replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert run.error is None, repr(run.error)
