"""Held-out failures, round 3 (b): failures *inside* the watched model of programs shaped like
public training code (nanoGPT-style GPTs and a post-LN ViT, VAEs, diffusion/score models, RL
policies, custom autograd Functions, normalisation layers and weight parametrisations, and
divergence / explosion).

Every expected diagnosis (kind, phase, ATen op, module, cause and the ``# <origin:TAG>`` line)
was written down from how the failure was constructed, following docs/api.md's rules, before
nantrace ran on these programs. Where a first expectation broke those rules or the construction
turned out to fail differently (checked with plain torch), the comment on the case says so.
Each case runs twice: zero-intrusive (the loss code is plain Python) and with the loss code
wrapped in ``guard.replayable``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from origin_markers import origin_line
import dataclasses

from test_heldout_programs import FAIL_STEP, STEPS, Program, describe
from test_heldout_programs import train as _train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = __file__


# ============================================================================ harness
@dataclasses.dataclass
class PreludeProgram(Program):
    """A program with code that runs between two steps, before the step's snapshot is taken
    (``before_step(model, step)``: an imprinting or a pruning step of the training script)."""

    before_step: Callable[[nn.Module, int], None] | None = None


class _HookedBatches(list):
    """The batches, calling ``before_step`` when the loop fetches the next one (between steps)."""

    def __init__(self, program: PreludeProgram) -> None:
        super().__init__(program.batches)
        self.program = program

    def __iter__(self):
        for step, batch in enumerate(list.__iter__(self)):
            if self.program.before_step is not None:
                with torch.no_grad():
                    self.program.before_step(self.program.model, step)
            yield batch


def train(program: Program, *, replayable: bool) -> Any:
    """test_heldout_programs.train; a PreludeProgram's between-steps code runs as the loop fetches a batch."""
    if isinstance(program, PreludeProgram):
        program = dataclasses.replace(program, batches=_HookedBatches(program))
    return _train(program, replayable=replayable)


def _line(source: str | None) -> int | None:
    """The line of ``source`` if it points into this file, -1 if elsewhere, None if absent."""
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    if not path or not os.path.exists(path) or not os.path.samefile(path, HERE):
        return -1
    return int(line)


def got_of(run: Any) -> dict[str, Any] | None:
    """The diagnosis fields of the first blocking incident (early warnings are logged, not blocking)."""
    main = [i for i in run.incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=_line(inc.source))


def want_of(want: Want) -> dict[str, Any]:
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=origin_line(HERE, want.tag) if want.tag else None)


def _sgd(model: nn.Module, lr: float = 1e-2) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any], n: int = STEPS) -> list[Any]:
    return [bad(s) if s == FAIL_STEP else normal(s) for s in range(n)]


CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        return build

    return register


# ===================================================================== 1. GPTs
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention written by hand, with the options of later GPTs: a key padding mask,
    LayerNorm QK-norm, xPos rotary embeddings."""

    def __init__(self, d: int, n_head: int, block: int, *, qk_norm_eps: float | None = None,
                 rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.n_head, self.d = n_head, d
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))
        hs = d // n_head
        if qk_norm_eps is not None:
            self.q_norm = nn.LayerNorm(hs, eps=qk_norm_eps)
            self.k_norm = nn.LayerNorm(hs, eps=qk_norm_eps)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)  # <origin:gpt_qnorm>
            k = self.k_norm(k)
        if self.rotary is not None:
            freqs, scale = self.rotary(T)
            q = apply_rotary(freqs, q, scale)
            k = apply_rotary(freqs, k, scale ** -1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # <origin:attn_qk>
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        if pad is not None:
            att = att.masked_fill(pad[:, None, None, :], float("-inf"))
        att = F.softmax(att, dim=-1)  # <origin:gpt_softmax>
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class RMSNormNoEps(nn.Module):
    """A Llama-style RMSNorm written by hand, with the eps forgotten."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight  # <origin:rms_noeps>


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, block: int, norm: Callable[[int], nn.Module], **attn: Any) -> None:
        super().__init__()
        self.ln_1 = norm(d)
        self.attn = CausalSelfAttention(d, n_head, block, **attn)
        self.ln_2 = norm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), pad)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT: token (+ optional learned position) embeddings, pre-LN blocks, a final norm and an
    lm_head whose weight is tied to the token embedding (untied in the Llama-style variants)."""

    def __init__(self, vocab: int = 24, d: int = 32, n_head: int = 2, n_layer: int = 1, block: int = 16, *,
                 positions: bool = True, norm: Callable[[int], nn.Module] = nn.LayerNorm, pad_idx: int | None = None,
                 tie: bool = True, **attn: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d, padding_idx=pad_idx)
        self.wpe = nn.Embedding(block, d) if positions else None
        self.h = nn.ModuleList([Block(d, n_head, block, norm, **attn) for _ in range(n_layer)])
        self.ln_f = norm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.wte.weight = self.lm_head.weight  # weight tying (nanoGPT)
        if pad_idx is not None:
            with torch.no_grad():
                self.wte.weight[pad_idx].zero_()

    def forward(self, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.h:
            x = blk(x, pad)
        return self.lm_head(self.ln_f(x))


def lm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    idx, targets, pad = batch
    logits = model(idx, pad)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tokens(g: torch.Generator, B: int, T: int, vocab: int = 24, low: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(low, vocab, (B, T + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


# 1a. A left-padded batch (the sampler began batching prompts for generation-style training):
#     with the causal mask, query 0 of a left-padded row sees only key 0, which is padding:
#     softmax over a row that is entirely -inf.
@case("gpt_left_padding_with_causal_mask",
      Want("nonfinite_loss", "forward", "aten._softmax.default", "h.0.attn", "gpt_softmax", "masked_softmax_all"))
def _gpt_left_pad() -> Program:
    torch.manual_seed(0)
    model = GPT()
    g = torch.Generator().manual_seed(101)

    def batch(step: int, left: bool = False) -> tuple[Any, ...]:
        idx, tgt = _tokens(g, 4, 8)
        pad = torch.zeros(4, 8, dtype=torch.bool)
        if left:
            idx[1, :3] = 0
            pad[1, :3] = True
        return idx, tgt, pad

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)),
                   lm_loss)


# 1b. A post-LN ViT (attention reads the patch embeddings directly) trained under float16 CPU
#     autocast; one batch of 12-bit raw images was not divided by 4095: the attention logits
#     q @ k^T exceed 65504 in float16 (finite in float32). (bfloat16 shares float32's range, so
#     the overflow under bf16 would be a real overflow; float16 is the precision case.)
class PostLNBlock(nn.Module):
    def __init__(self, d: int, n_head: int, block: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(d, n_head, block)
        self.ln_1 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln_2 = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class TinyViT(nn.Module):
    def __init__(self, d: int = 32, patches: int = 16) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(3 * 4 * 4, d)
        self.pos = nn.Parameter(torch.zeros(1, patches, d))
        self.blocks = nn.ModuleList([PostLNBlock(d, 2, patches)])
        self.head = nn.Linear(d, 5)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        B = img.shape[0]
        p = img.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(B, 16, 48)
        x = self.patch_embed(p) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(1))


@case("vit_fp16_autocast_raw_12bit_images",
      Want("nonfinite_loss", "forward", "aten.bmm.default", "blocks.0.attn", "attn_qk", "precision_overflow"))
def _vit() -> Program:
    torch.manual_seed(0)
    model = TinyViT()
    g = torch.Generator().manual_seed(102)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.rand(4, 3, 16, 16, generator=g)
        if raw:
            img = torch.round(img * 4095)  # 12-bit sensor values, not rescaled
        return img, torch.randint(0, 5, (4,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]).float(), b[1]), autocast=torch.float16)


# 1c. xPos rotary embeddings (lucidrains' rotary-embedding-torch, use_xpos=True) with the scale
#     base typed 1 instead of 512: harmless on the usual 16-token batches (scale**8), but the
#     first long batch (160 tokens) raises the scale to the power 80: pow overflows float32.
class RotaryXPos(nn.Module):
    def __init__(self, dim: int, scale_base: float, theta: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)))
        self.register_buffer("scale", (torch.arange(0, dim, 2).float() + 0.4 * dim) / (1.4 * dim))
        self.scale_base = scale_base

    def forward(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(T, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        power = (t - T // 2) / self.scale_base
        scale = self.scale ** power[:, None]  # <origin:xpos_pow>
        return freqs, torch.cat((scale, scale), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(freqs: torch.Tensor, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t * freqs.cos() * scale) + (_rotate_half(t) * freqs.sin() * scale)


@case("gpt_xpos_scale_base_typo_long_batch",
      Want("nonfinite_loss", "forward", "aten.pow.Tensor_Tensor", "h.0.attn.rotary", "xpos_pow", "exp_overflow"))
def _xpos() -> Program:
    torch.manual_seed(0)
    model = GPT(block=192, positions=False, rotary=RotaryXPos(16, scale_base=1.0))
    g = torch.Generator().manual_seed(103)

    def batch(step: int, long: bool = False) -> tuple[Any, ...]:
        idx, tgt = _tokens(g, 2, 160 if long else 16)
        return idx, tgt, None

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)),
                   lm_loss)


# 1d. A Llama-style GPT (RMSNorm, no position embeddings, bias-free projections) with LayerNorm
#     QK-norm whose eps was set to 0; the padding token's embedding is the zero vector, so a pad
#     position's query is the zero vector: a constant slice normalised with eps = 0.
@case("gpt_qk_layernorm_eps0_padding_query",
      Want("nonfinite_loss", "forward", "aten.native_layer_norm.default", "h.0.attn.q_norm", "gpt_qnorm",
           "zero_variance_norm"))
def _qknorm() -> Program:
    torch.manual_seed(0)
    model = GPT(positions=False, norm=RMSNorm, pad_idx=0, tie=False, qk_norm_eps=0.0)
    g = torch.Generator().manual_seed(104)

    def batch(step: int, padded: bool = False) -> tuple[Any, ...]:
        idx, tgt = _tokens(g, 4, 8)
        if padded:
            idx[2, 5:] = 0  # the first shorter document, right-padded
        return idx, tgt, None

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)),
                   lm_loss)


# 1e. The same Llama-style GPT with its hand-written RMSNorm missing the eps: at the first padded
#     batch, the pad token's zero embedding reaches ln_1: rsqrt(mean(0^2)) = inf, 0 * inf.
@case("gpt_rmsnorm_no_eps_padding_token",
      Want("nonfinite_loss", "forward", "aten.rsqrt.default", "h.0.ln_1", "rms_noeps", "zero_variance_norm"))
def _rms() -> Program:
    torch.manual_seed(0)
    model = GPT(positions=False, norm=RMSNormNoEps, pad_idx=0, tie=False)
    g = torch.Generator().manual_seed(105)

    def batch(step: int, padded: bool = False) -> tuple[Any, ...]:
        idx, tgt = _tokens(g, 4, 8)
        if padded:
            idx[0, 6:] = 0
        return idx, tgt, None

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)),
                   lm_loss)


# ===================================================================== 2. VAEs
class VAE(nn.Module):
    def __init__(self, d: int = 64, h: int = 32, z: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.fc_mu = nn.Linear(h, z)
        self.fc_logvar = nn.Linear(h, z)
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d))

    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)  # <origin:vae_reparam>
        return mu + torch.randn_like(std) * std

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        return self.dec(self.reparameterize(mu, logvar)), mu, logvar


def vae_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    (x,) = batch
    recon, mu, logvar = model(x)
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1)
    return F.mse_loss(recon, x, reduction="sum") / x.shape[0] + kld.mean()


# 2a. The PyTorch-examples VAE; one batch of 16-bit images was not divided by 65535: logvar
#     reaches the thousands and exp(0.5 * logvar) overflows float32 in the reparameterisation.
@case("vae_reparam_logvar_exp_overflow_raw_16bit",
      Want("nonfinite_loss", "forward", "aten.exp.default", "", "vae_reparam", "exp_overflow"))
def _vae_exp() -> Program:
    torch.manual_seed(0)
    model = VAE()
    g = torch.Generator().manual_seed(201)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor]:
        x = torch.rand(8, 64, generator=g)
        if raw:
            x = torch.round(x * 65535)
        return (x,)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)),
                   vae_loss)


# 2b. A variational layer that returns the KL with the sample (Pyro/BNN style), sigma through
#     softplus and KL written with -log(sigma): an input batch in the wrong units (x 300) drives
#     the pre-softplus value below -104, softplus underflows to exactly 0, log(0) = -inf.
class GaussianEncoder(nn.Module):
    def __init__(self, d: int = 16, z: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.Tanh())
        self.mu = nn.Linear(32, z)
        self.s = nn.Linear(d, z)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu = self.mu(self.body(x))
        sigma = F.softplus(self.s(x))
        kl = (-torch.log(sigma) + 0.5 * (sigma ** 2 + mu ** 2) - 0.5).sum(-1)  # <origin:kl_log_sigma>
        return mu + sigma * torch.randn_like(sigma), kl


class KLVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = GaussianEncoder()
        self.decoder = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, kl = self.encoder(x)
        return self.decoder(z), kl


@case("vae_kl_log_sigma_softplus_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", "encoder", "kl_log_sigma", "log_nonpositive"))
def _vae_kl() -> Program:
    torch.manual_seed(0)
    model = KLVAE()
    with torch.no_grad():
        model.encoder.s.bias.fill_(-1.0)
    g = torch.Generator().manual_seed(202)

    def batch(step: int, units: bool = False) -> tuple[torch.Tensor]:
        x = torch.randn(8, 16, generator=g)
        if units:
            x[5] = -300.0 * torch.sign(model.encoder.s.weight[0].detach())  # a record in the wrong units
        return (x,)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        recon, kl = m(b[0])
        return F.mse_loss(recon, b[0]) + 0.1 * kl.mean()

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), loss)


# 2c. A Bernoulli decoder whose log-likelihood is written by hand, x log p + (1 - x) log(1 - p),
#     trained under bfloat16 autocast: a badly standardised batch gives decoder logits up to ~11,
#     where bfloat16's sigmoid rounds to exactly 1 (float32 would give 1 - p ~ 1e-4): log(0).
class BernoulliDecoder(nn.Module):
    def __init__(self, z: int = 8, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(z, d)

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.fc(z))
        return (x * torch.log(p) + (1 - x) * torch.log(1 - p)).sum(-1)  # <origin:bern_log>


class BernoulliVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.decoder = BernoulliDecoder()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        return self.decoder(z + 0.01 * torch.randn_like(z), target)


BERN_SCALE = 50.0


@case("vae_bernoulli_loglik_bf16_sigmoid_rounds_to_one",
      Want("nonfinite_loss", "forward", "aten.log.default", "decoder", "bern_log", "precision_overflow"))
def _bern() -> Program:
    torch.manual_seed(0)
    model = BernoulliVAE()
    with torch.no_grad():
        model.enc.weight.mul_(0.5)
        model.decoder.fc.weight.mul_(0.5)
    g = torch.Generator().manual_seed(203)

    def batch(step: int, sharp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 16, generator=g)
        target = (x > 0).float()
        if sharp:
            x = x * BERN_SCALE  # standardised with the std of another dataset
        return x, target

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: -m(b[0], b[1]).mean(), autocast=torch.bfloat16)


# ===================================================================== 3. diffusion / score models
class FourierMLP(nn.Module):
    """A denoiser conditioned on a scalar noise level through sinusoidal features."""

    def __init__(self, d: int = 8, n_freq: int = 8) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.exp(-math.log(1000.0) * torch.arange(n_freq) / n_freq))
        self.net = nn.Sequential(nn.Linear(d + 2 * n_freq, 32), nn.SiLU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        e = c[:, None] * self.freqs[None]
        return self.net(torch.cat([x, e.sin(), e.cos()], dim=1))


# 3a. EDM (Karras et al.) preconditioning; the training loop draws sigmas from the *sampling*
#     schedule, which ends with sigma = 0: c_noise = log(sigma) / 4 = -inf.
class EDMPrecond(nn.Module):
    def __init__(self, sigma_data: float = 0.5) -> None:
        super().__init__()
        self.sigma_data = sigma_data
        self.model = FourierMLP()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sigma = sigma.reshape(-1, 1)
        c_skip = self.sigma_data ** 2 / (sigma ** 2 + self.sigma_data ** 2)
        c_out = sigma * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2).sqrt()
        c_in = 1 / (self.sigma_data ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4  # <origin:edm_log>
        F_x = self.model(c_in * x, c_noise.flatten())
        return c_skip * x + c_out * F_x


def edm_loss(model: nn.Module, batch: Any, step: int, sigma_data: float = 0.5) -> torch.Tensor:
    y, sigma, n = batch
    weight = (sigma ** 2 + sigma_data ** 2) / (sigma * sigma_data) ** 2
    D = model(y + n * sigma[:, None], sigma)
    return (weight[:, None] * (D - y) ** 2).mean()


KARRAS = torch.cat([(80.0 ** (1 / 7) + torch.linspace(0, 1, 9) * (0.002 ** (1 / 7) - 80.0 ** (1 / 7))) ** 7,
                    torch.zeros(1)])


@case("edm_precond_sigma_zero_from_sampling_schedule",
      Want("nonfinite_loss", "forward", "aten.log.default", "", "edm_log", "log_nonpositive"))
def _edm() -> Program:
    torch.manual_seed(0)
    model = EDMPrecond()
    g = torch.Generator().manual_seed(301)

    def batch(step: int, last: bool = False) -> tuple[torch.Tensor, ...]:
        idx = torch.randint(0, 9, (6,), generator=g)
        if last:
            idx[4] = 9  # the schedule's final sigma = 0
        return torch.randn(6, 8, generator=g), KARRAS[idx], torch.randn(6, 8, generator=g)

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), edm_loss)


# 3b. A lucidrains-style GaussianDiffusion module that computes its own loss, epsilon objective
#     with min-SNR-gamma weighting min(snr, 5) / snr, on a zero-terminal-SNR schedule: the first
#     batch that draws t = T has snr = 0: 0 / 0.
T_DIFF = 10
ALPHA_BAR = 1.0 - torch.linspace(0.0, 1.0, T_DIFF + 1) ** 1.5  # alpha_bar[T] == 0


class GaussianDiffusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))
        self.register_buffer("alphas_cumprod", ALPHA_BAR.clone())

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ab = self.alphas_cumprod[t][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        pred = self.net(torch.cat([x_t, t[:, None].float() / T_DIFF], dim=1))
        snr = ab / (1 - ab)
        weight = snr.clamp(max=5.0) / snr  # <origin:minsnr_div>
        return (weight * (pred - noise) ** 2).mean()


@case("diffusion_min_snr_weight_zero_terminal_snr",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "minsnr_div", "div_by_zero"))
def _minsnr() -> Program:
    torch.manual_seed(0)
    model = GaussianDiffusion()
    g = torch.Generator().manual_seed(302)

    def batch(step: int, last: bool = False) -> tuple[torch.Tensor, ...]:
        t = torch.randint(1, T_DIFF, (6,), generator=g)
        if last:
            t[1] = T_DIFF
        return torch.randn(6, 8, generator=g), t, torch.randn(6, 8, generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), lambda m, b, s: m(*b))


# 3c. Song et al.'s score network, output divided by the marginal std sqrt((s^2t - 1) / 2 log s),
#     trained with VDM's low-discrepancy time sampler t_i = (u0 + i / B) mod 1 and the
#     t >= eps offset forgotten: a draw of u0 = 0 gives t = 0 and std = 0.
SIGMA = 25.0


def marginal_prob_std(t: torch.Tensor) -> torch.Tensor:
    return torch.sqrt((SIGMA ** (2 * t) - 1.0) / 2.0 / math.log(SIGMA))


class ScoreNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(8) * 30, requires_grad=False)
        self.net = nn.Sequential(nn.Linear(8 + 16, 64), nn.SiLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        proj = t[:, None] * self.W[None] * 2 * math.pi
        h = self.net(torch.cat([x, proj.sin(), proj.cos()], dim=1))
        return h / marginal_prob_std(t)[:, None]  # <origin:score_div>


class ScoreModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score_net = ScoreNet()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.score_net(x, t)


def dsm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, u0, z = batch
    t = (u0 + torch.arange(x.shape[0]) / x.shape[0]) % 1.0
    std = marginal_prob_std(t)
    score = model(x + z * std[:, None], t)
    return torch.mean(torch.sum((score * std[:, None] + z) ** 2, dim=1))


@case("score_model_low_discrepancy_time_zero",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "score_net", "score_div", "div_by_zero"))
def _score() -> Program:
    torch.manual_seed(0)
    model = ScoreModel()
    g = torch.Generator().manual_seed(303)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, ...]:
        u0 = torch.tensor(0.0) if zero else torch.rand((), generator=g) * 0.1 + 0.01
        return torch.randn(8, 8, generator=g), u0, torch.randn(8, 8, generator=g)

    return Program(model, _sgd(model, 1e-4), _steps(batch, lambda s: batch(s, True)), dsm_loss)


# ===================================================================== 4. RL
class MaskedPolicy(nn.Module):
    """A policy that applies the environment's legal-action mask itself and returns log-probs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.pi = nn.Linear(32, 4)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        logits = self.pi(self.body(obs)).masked_fill(~legal, float("-inf"))
        return F.log_softmax(logits, dim=-1)  # <origin:masked_logsoftmax>


def pg_loss(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, actions, adv = batch
    logp = policy(obs, legal).gather(1, actions[:, None]).squeeze(1)
    return -(logp * adv).mean()


# 4a. A terminal state that the rollout did not filter has no legal action: every logit is -inf.
@case("policy_masked_log_softmax_no_legal_action",
      Want("nonfinite_loss", "forward", "aten._log_softmax.default", "", "masked_logsoftmax", "masked_softmax_all"))
def _masked_pi() -> Program:
    torch.manual_seed(0)
    model = MaskedPolicy()
    g = torch.Generator().manual_seed(401)

    def batch(step: int, terminal: bool = False) -> tuple[torch.Tensor, ...]:
        legal = torch.ones(6, 4, dtype=torch.bool)
        legal[:, 3] = False
        if terminal:
            legal[2] = False
        return (torch.randn(6, 6, generator=g), legal, torch.randint(0, 3, (6,), generator=g),
                torch.randn(6, generator=g))

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), pg_loss)


# 4b. An actor-critic head that returns the entropy bonus, -(p * log p).sum(); the environment's
#     first state with an illegal action (masked to -inf) gives p = 0 there: log(0) = -inf, 0 * -inf.
class CategoricalHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 5)

    def forward(self, h: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(h).masked_fill(~legal, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        entropy = -(probs * torch.log(probs)).sum(-1)  # <origin:entropy_log>
        return F.log_softmax(logits, dim=-1), entropy


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
        self.head = CategoricalHead()
        self.value = nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.body(obs)
        logp, ent = self.head(h, legal)
        return logp, ent, self.value(h).squeeze(-1)


def a2c_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, actions, returns = batch
    logp, ent, value = model(obs, legal)
    adv = (returns - value).detach()
    return (-(logp.gather(1, actions[:, None]).squeeze(1) * adv).mean() + 0.5 * F.mse_loss(value, returns)
            - 0.01 * ent.mean())


@case("actor_critic_entropy_of_masked_action",
      Want("nonfinite_loss", "forward", "aten.log.default", "head", "entropy_log", "log_nonpositive"))
def _entropy() -> Program:
    torch.manual_seed(0)
    model = ActorCritic()
    g = torch.Generator().manual_seed(402)

    def batch(step: int, masked: bool = False) -> tuple[torch.Tensor, ...]:
        legal = torch.ones(6, 5, dtype=torch.bool)
        if masked:
            legal[3, 4] = False  # the first state where action 4 is illegal
        return (torch.randn(6, 6, generator=g), legal, torch.randint(0, 4, (6,), generator=g),
                torch.randn(6, generator=g))

    return Program(model, torch.optim.Adam(model.parameters(), lr=3e-4), _steps(batch, lambda s: batch(s, True)),
                   a2c_loss)


# 4c. Offline RL (AWAC / behaviour cloning) with a tanh-squashed Gaussian policy that scores the
#     dataset's actions by inverting the squashing, u = atanh(a): the dataset clipped some actions
#     to exactly 1.0, atanh(1) = inf.
class TanhGaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 32), nn.ReLU())
        self.mu = nn.Linear(32, 2)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        mu = self.mu(self.body(obs))
        u = torch.atanh(actions)  # <origin:atanh_action>
        logp = torch.distributions.Normal(mu, self.log_std.exp()).log_prob(u).sum(-1)
        return logp - torch.log(1 - actions.pow(2) + 1e-6).sum(-1)


@case("offline_rl_atanh_of_clipped_dataset_action",
      Want("nonfinite_loss", "forward", "aten.atanh.default", "", "atanh_action", "domain_error"))
def _atanh() -> Program:
    torch.manual_seed(0)
    model = TanhGaussianPolicy()
    g = torch.Generator().manual_seed(403)

    def batch(step: int, clipped: bool = False) -> tuple[torch.Tensor, ...]:
        actions = torch.rand(8, 2, generator=g) * 1.8 - 0.9
        if clipped:
            actions[6, 0] = 1.0
        return torch.randn(8, 5, generator=g), actions, torch.rand(8, generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: -(m(b[0], b[1]) * b[2]).mean())


# 4d. A PPO Gaussian policy with a state-dependent, unclamped log-std head; a batch of
#     unnormalised observations drives log_std to about -75: std = 3e-33 is finite, but std^2
#     underflows float32 to 0 and Normal.log_prob divides (a - mu)^2 by 2 var = 0.
#     [Construction fixed twice after nantrace ran, each time checked in plain torch: with a
#     2-output log-std head the same observation drove the other output to +55 and std ** 2
#     overflowed first (pow, exp_overflow, as nantrace said); then log_std was only ~-44, var a
#     subnormal, not 0, and the division overflowed (overflow, as nantrace said). Now one output
#     at ~-75, checked: var == 0 exactly and the division is the first non-finite op.]
class GaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.Tanh())
        self.mu = nn.Linear(32, 2)
        self.log_std = nn.Linear(4, 1)  # one state-dependent log-std shared by the action dimensions

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        dist = torch.distributions.Normal(self.mu(self.body(obs)), self.log_std(obs).exp())
        return dist.log_prob(actions).sum(-1)  # <origin:normal_logprob>


@case("ppo_gaussian_log_std_variance_underflow",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "normal_logprob", "div_by_zero"))
def _logstd() -> Program:
    torch.manual_seed(0)
    model = GaussianPolicy()
    g = torch.Generator().manual_seed(404)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(8, 4, generator=g)
        if raw:
            w = model.log_std.weight[0].detach()
            obs[2] = -75.0 * torch.sign(w) / w.abs().sum()  # an unnormalised observation: log_std ~ -75
        return obs, torch.randn(8, 2, generator=g), torch.randn(8, generator=g)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        obs, actions, adv = b
        return -(m(obs, actions) * adv).mean()

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), loss)


# ===================================================================== 5. backward singularities, norms
# 5a. Weight imprinting (Qi et al. 2018) for a new class with an ArcFace-style head that takes
#     theta = acos(cos) without a clamp: the new class' centre is imprinted from the normalised
#     feature of its one example, so that example's cosine is 1 up to rounding. [First written as
#     cos == 1.0 exactly, a backward grad_singularity; checked in plain torch, the float32 cosine
#     comes out as 1 + 1.19e-7 > 1, so acos is NaN in the forward: a domain_error.]
class ArcHead(nn.Module):
    def __init__(self, d: int = 16, classes: int = 6, s: float = 8.0, m: float = 0.3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, d))
        self.s, self.m = s, m

    def forward(self, feats: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos = F.linear(F.normalize(feats), F.normalize(self.weight))
        theta = torch.acos(cos)  # <origin:arc_acos>
        onehot = F.one_hot(labels, cos.shape[1]).float()
        return self.s * torch.cos(theta + self.m * onehot)


class ArcFaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = ArcHead()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x), labels)


@case("arcface_acos_imprinted_class_centre",
      Want("nonfinite_loss", "forward", "aten.acos.default", "head", "arc_acos", "domain_error"))
def _arcface() -> Program:
    torch.manual_seed(0)
    model = ArcFaceNet()
    g = torch.Generator().manual_seed(501)
    batches = [(torch.randn(6, 10, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(STEPS)]
    x_new = batches[FAIL_STEP][0][0]
    batches[FAIL_STEP][1][0] = 5  # the example of the new class 5

    def imprint(m: nn.Module, s: int) -> None:
        if s == FAIL_STEP:  # imprint the new class from its example
            m.head.weight[5] = F.normalize(m.backbone(x_new[None]))[0]

    return PreludeProgram(model, _sgd(model), batches, lambda m, b, s: F.cross_entropy(m(*b), b[1]),
                          before_step=imprint)


# 5b. A bilinear-pooling CNN (Lin et al.) with the signed square root sign(x) * |x| ** 0.5
#     written without an epsilon, on bias-free convolutions: a blank image gives all-zero bilinear
#     features, and d/dx |x| ** 0.5 is infinite at 0 (the forward is 0).
class BilinearPool(nn.Module):
    def forward(self, f: torch.Tensor) -> torch.Tensor:
        B, C, H, W = f.shape
        phi = torch.einsum("bchw,bdhw->bcd", f, f).flatten(1) / (H * W)
        phi = torch.sign(phi) * torch.abs(phi) ** 0.5  # <origin:signed_sqrt>
        return F.normalize(phi, dim=1)


class BilinearCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.Tanh(),
                                      nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.Tanh())
        self.pool = BilinearPool()
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.features(x)))


@case("bilinear_cnn_signed_sqrt_blank_image",
      Want("nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", "pool", "signed_sqrt", "grad_singularity"))
def _bilinear() -> Program:
    torch.manual_seed(0)
    model = BilinearCNN()
    g = torch.Generator().manual_seed(502)

    def batch(step: int, blank: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(4, 1, 8, 8, generator=g)
        if blank:
            x[1] = 0.0  # a blank scan
        return x, torch.randint(0, 3, (4,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 5c. A CNN with per-channel GroupNorm (groups == channels) whose eps was set to 0, after a
#     valid (unpadded) convolution: a solid-colour image gives spatially constant channels.
class GNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.gn = nn.GroupNorm(8, 8, eps=0.0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.gn(self.conv(x)))  # <origin:gn_call>
        return self.fc(h.mean((2, 3)))


@case("groupnorm_eps0_solid_colour_image",
      Want("nonfinite_loss", "forward", "aten.native_group_norm.default", "gn", "gn_call", "zero_variance_norm"))
def _gn() -> Program:
    torch.manual_seed(0)
    model = GNNet()
    g = torch.Generator().manual_seed(503)

    def batch(step: int, solid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(4, 3, 8, 8, generator=g)
        if solid:
            x[2] = torch.tensor([0.2, 0.5, 0.9])[:, None, None]  # a solid-colour placeholder image
        return x, torch.randint(0, 4, (4,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 5d. Structured magnitude pruning of a weight-normalised layer (torch.nn.utils.parametrizations
#     .weight_norm): the pruning step zeroes the direction v of the weakest output unit, and the
#     next forward normalises a zero vector: g * v / ||v|| = 0 / 0. (The op runs in the
#     parametrisation module, the innermost module running, reached from fc1's forward.)
class WNMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.parametrizations.weight_norm(nn.Linear(10, 16))
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # <origin:wn_call>


@case("weight_norm_pruned_zero_direction",
      Want("nonfinite_loss", "forward", "aten._weight_norm_interface.default", "fc1.parametrizations.weight.0",
           "wn_call", "div_by_zero"))
def _wn() -> Program:
    torch.manual_seed(0)
    model = WNMLP()
    g = torch.Generator().manual_seed(504)
    batches = [(torch.randn(8, 10, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]

    def prune(m: nn.Module, s: int) -> None:
        if s == FAIL_STEP:  # the pruning schedule's first structured pruning step
            v = m.fc1.parametrizations.weight.original1
            v[v.norm(dim=1).argmin()] = 0.0

    return PreludeProgram(model, _sgd(model), batches, lambda m, b, s: F.mse_loss(m(b[0]), b[1]), before_step=prune)


# 5e. A SchNet-style interatomic-distance module with a custom autograd Function for the square
#     root (forward clamped, backward g / (2 sqrt(x)) by hand): a structure file with a duplicated
#     atom puts two atoms at the same position, distance 0, and the user's backward divides by 0.
class SqrtFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.clamp_min(0.0).sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g / (2 * y)  # <origin:sqrt_fn_bwd>


class Distances(nn.Module):
    def __init__(self, n_atoms: int = 5) -> None:
        super().__init__()
        i, j = torch.triu_indices(n_atoms, n_atoms, offset=1)
        self.register_buffer("i", i)
        self.register_buffer("j", j)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return SqrtFn.apply(((pos[:, self.i] - pos[:, self.j]) ** 2).sum(-1))


class TinySchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.strain = nn.Parameter(torch.ones(3))  # a learned anisotropic cell scaling
        self.distance = Distances()
        self.register_buffer("mu", torch.linspace(0, 3, 12))
        self.mlp = nn.Sequential(nn.Linear(12, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        d = self.distance(pos * self.strain)
        rbf = torch.exp(-4.0 * (d[..., None] - self.mu) ** 2)
        return self.mlp(rbf).sum((1, 2))


@case("schnet_custom_sqrt_backward_duplicate_atom",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", "distance", "sqrt_fn_bwd", "div_by_zero"))
def _schnet() -> Program:
    torch.manual_seed(0)
    model = TinySchNet()
    g = torch.Generator().manual_seed(505)

    def batch(step: int, dup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.randn(3, 5, 3, generator=g)
        if dup:
            pos[1, 4] = pos[1, 2]  # a duplicated atom
        return pos, torch.randn(3, generator=g)

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# ===================================================================== 6. explosion / overflow
# 6a. A vanilla tanh RNN (hand-written cell) initialised with a recurrent gain of 3, the chaotic
#     regime: the usual 20-step sequences train, the first 600-step sequence makes the
#     back-propagated gradient grow exponentially through h @ W_h until it overflows float32;
#     the forward stays bounded by tanh.
class TanhCell(nn.Module):
    def __init__(self, d_in: int = 4, d: int = 32, gain: float = 3.0) -> None:
        super().__init__()
        self.W_x = nn.Parameter(torch.randn(d_in, d) / math.sqrt(d_in))
        self.W_h = nn.Parameter(torch.randn(d, d) * gain / math.sqrt(d))
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x_t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x_t @ self.W_x + h @ self.W_h + self.b)  # <origin:rnn_mm>


class VanillaRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = TanhCell()
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 32)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.out(h)


@case("vanilla_rnn_long_sequence_gradient_explosion",
      Want("nonfinite_grad", "backward", "aten.mm.default", "cell", "rnn_mm", "gradient_explosion"))
def _rnn() -> Program:
    torch.manual_seed(0)
    model = VanillaRNN()
    g = torch.Generator().manual_seed(601)

    def batch(step: int, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(2, 600 if long else 20, 4, generator=g), torch.randn(2, 1, generator=g)

    return Program(model, _sgd(model, 1e-4), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 6b. A factorisation machine (Rendle) on raw count features; one export marks a missing count
#     with UINT64_MAX (2^64 as float32): the pairwise term's x * x is 2^128, beyond float32.
class FMLayer(nn.Module):
    def __init__(self, d: int = 6, k: int = 4) -> None:
        super().__init__()
        self.V = nn.Parameter(torch.randn(d, k) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xv = x @ self.V
        x2v2 = (x * x) @ (self.V * self.V)  # <origin:fm_sq>
        return 0.5 * (xv * xv - x2v2).sum(-1, keepdim=True)


class FMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 1)
        self.fm = FMLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.fm(x)


@case("factorization_machine_uint64_missing_sentinel",
      Want("nonfinite_loss", "forward", "aten.mul.Tensor", "fm", "fm_sq", "overflow"))
def _fm() -> Program:
    torch.manual_seed(0)
    model = FMModel()
    g = torch.Generator().manual_seed(602)

    def batch(step: int, sentinel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.log1p(torch.randint(0, 100, (8, 6), generator=g).float())
        if sentinel:
            x[3, 1] = float(2 ** 64 - 1)  # the missing-value marker of the new export, not log-transformed
        return x, torch.randn(8, 1, generator=g)

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 6c. A plain nn.Sequential MLP trained under float16 CPU autocast on tabular data whose new
#     export marks a missing value with the sentinel 99999: autocast's cast of the input to
#     float16 (inside the first Linear) overflows, 99999 > 65504. The model has no forward of the
#     user's own, so the user's line is the loss code's call of the model.
def sentinel_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)  # <origin:seq_call>


@case("sequential_mlp_fp16_autocast_missing_sentinel",
      Want("nonfinite_loss", "forward", "aten._to_copy.default", "0", "seq_call", "precision_overflow"))
def _seq_sentinel() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(603)

    def batch(step: int, sentinel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 6, generator=g)
        if sentinel:
            x[5, 2] = 99999.0
        return x, torch.randn(8, 1, generator=g)

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), sentinel_loss,
                   autocast=torch.float16)


# ===================================================================== 7. divergence (more steps)
# A cosine schedule with warm restarts whose restart peak was typed 1.0 instead of 0.01 (100x):
# from the restart at step RESTART the loss grows by a constant factor per step until it is
# non-finite. Expected: a loss_spike / loss_divergence flagged while the loss is still finite
# (at least one step before the first non-finite loss of the same run without nantrace), after
# the restart, with nothing blocking before it; op, module and source None.
RESTART = 40
DIV_STEPS = 50


def _lr_at(step: int) -> float:
    return 0.01 if step < RESTART else 1.0


def divergence_program() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(701)
    w = torch.randn(8, 1, generator=g)
    batches = []
    for _ in range(DIV_STEPS):
        x = torch.randn(32, 8, generator=g)
        batches.append((x, x @ w + 0.1 * torch.randn(32, 1, generator=g)))

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        for group in opt.param_groups:  # the scheduler
            group["lr"] = _lr_at(s)
        return F.mse_loss(m(b[0]), b[1])

    return Program(model, opt, batches, loss)


def _reference_first_nonfinite() -> int | None:
    program = divergence_program()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        loss = program.loss(model, batch, step)
        if not bool(torch.isfinite(loss)):
            return step
        loss.backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            return step
        opt.step()
    return None


# ======================================================================= the tests
MODES = ("zero_intrusive", "replayable")


def _params() -> list[Any]:
    out = []
    for name in CASES:
        for mode in MODES:
            key = f"{name}[{mode}]"
            marks = [pytest.mark.xfail(strict=True, reason=XFAIL[key])] if key in XFAIL else []
            out.append(pytest.param(name, mode, id=f"{name}-{mode}", marks=marks))
    return out


@pytest.mark.parametrize("name,mode", _params())
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train(build(), replayable=mode == "replayable")
    got = got_of(run)
    assert got is not None, "no incident"
    assert got == want_of(want), [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


@pytest.mark.parametrize("mode", MODES)
def test_lr_restart_100x_divergence(mode: str) -> None:
    first_bad = _reference_first_nonfinite()
    assert first_bad is not None and first_bad > RESTART + 2, first_bad
    run = train(divergence_program(), replayable=mode == "replayable")
    got = got_of(run)
    assert got is not None, "no incident"
    detail = [describe(i) + " | " + i.summary for i in run.incidents]
    assert RESTART < got["step"] < first_bad, (got, first_bad, detail)
    assert (got["kind"], got["phase"], got["op"], got["module"], got["cause"], got["action"], got["line"]) == (
        "loss_spike", "forward", None, None, "loss_divergence", "skipped", None), detail


def test_cases_fail_without_nantrace() -> None:
    """The construction itself: without nantrace, every program fails at FAIL_STEP and not before,
    the way its Want says (a non-finite loss, or a finite loss with a non-finite gradient)."""
    for name, (build, want) in CASES.items():
        program = build()
        model, opt = program.model, program.optimizer
        batches = _HookedBatches(program) if isinstance(program, PreludeProgram) else program.batches
        for step, batch in enumerate(batches):
            opt.zero_grad()
            if program.autocast is not None:
                with torch.autocast("cpu", dtype=program.autocast):
                    loss = program.loss(model, batch, step)
            else:
                loss = program.loss(model, batch, step)
            loss.backward()
            grads_ok = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            bad = not bool(torch.isfinite(loss).all()) or not grads_ok
            if step != want.step:
                assert not bad, (name, step)
                opt.step()
                continue
            if want.kind == "nonfinite_loss":
                assert not bool(torch.isfinite(loss).all()), (name, float(loss))
            else:
                assert want.kind == "nonfinite_grad" and bool(torch.isfinite(loss).all()) and not grads_ok, name
            break
