"""Held-out failures, round 17b: failures born INSIDE THE MODEL in modern architectures, diagnosed without
``guard.replayable`` (zero-intrusive must be as good as replayable: the origin is in the model's forward, so the
loss tape plays no part in the diagnosis). Each case is a small stand-alone program (model class, loss, loop
data) shaped like public code:

1. a Mamba/S4-style selective scan, post-norm stack, whose S4D-real init dropped the minus of ``A = -exp(A_log)``:
   ``exp(dt * A)`` with ``dt = softplus(...)`` overflows on a batch with a sensor spike;
2. a Switch-style MoE layer whose load term is normalised by the expert capacity ``int(cf * tokens / experts)``,
   0 on the short last batch of an epoch;
3. rotary embeddings whose inverse frequencies ``theta ** (-2i/d)`` are computed in the forward from a config
   whose ``rope_theta`` is 0 (0 to a negative power);
4. ALiBi slopes computed by hand for a head count that is not a power of two (5): the extra heads' spacing
   divides by ``log2(5 - 4) = 0``;
5. an audio front end (learned pre-emphasis, ``torch.fft.rfft``) whose magnitude is written
   ``sqrt(re**2 + im**2)``: a digitally silent clip gives a zero spectrum, sqrt's derivative at 0. (``abs()`` of
   a complex zero is NOT a singularity on this torch: its gradient is ``sgn(0) = 0``; checked, it is the quiet fix);
6. a learned positional embedding (``nn.Embedding(max_len)``) indexed past ``max_len`` by a long document (raises);
7. torch's own ``nn.RMSNorm(eps=0.0)`` (config ``norm_eps: 0``) on the all-zero padding embedding (index 0) in a
   bidirectional encoder: the NaN of the padded position spreads through attention to every position;
8. a SwiGLU MLP in pure fp16 on the CPU (``.half()``): a clip read as raw int16 PCM saturates the gate's sigmoid
   (exactly 1), silu passes its whole pre-activation and value x gate overflows 65504 (finite in float32);
9. attention scaled by ``1/sqrt(tau * d)`` with a learned temperature ``tau`` that an entropy regulariser and Adam
   drive below 0;
10. a ConvNet with ``GroupNorm(eps=0)`` after a ReLU: a group of channels with a negative bias init only fires on
    edges; a foggy (edge-free) frame kills it, a constant group of zeros;
11. QUIET programs: the common fix of each (``-exp(A_log)``, ``max(1, capacity)``, ``eps=1e-6``, complex
    ``abs()``, ``eps=1e-5``, a softplus-parameterised temperature); no incident at all.

How expectations were derived: each expectation (kind, phase, ATen op, module, ``# <origin:TAG>`` line, cause,
step) was written from the construction before nantrace ran, following /work/shared/API.md and
docs/diagnosis.md and earlier rounds' conventions: the op that made the first non-finite value (for a
torch composite such as ``nn.RMSNorm``, the decomposed op, ``aten.rsqrt.default``, and the user's line that
called the module); ``0 ** (negative)`` and ``0 / 0`` are ``div_by_zero``; an RMS/group normalisation of a
constant (all-zero) input with eps 0 is ``zero_variance_norm`` (r3b's ``gpt_rmsnorm_no_eps_padding_token``); a value
finite in float32 and non-finite in fp16 is ``precision_overflow``; a derivative singular at a finite forward is
phase ``backward``, ``grad_singularity``; an embedding index past its table raises, kind ``exception``,
``label_out_of_range``, action ``raised``. The constructions were checked WITHOUT nantrace by
``test_cases_fail_without_nantrace``: the plain loop fails first at the expected step in the expected way (loss,
gradients, or the raise), and an independent ``TorchDispatchMode`` (``FirstNonFinite``) names the expected forward
op, module and line, or (backward origins) the forward is finite and the first autograd node whose outputs turn
non-finite from finite incoming gradients is the expected node.

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

from heldout_harness import Judge, Program, assert_diagnosis, case_params, describe, run_step, sgd, steps, train
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


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any], fail: int = FAIL) -> list[Any]:
    return steps(normal, bad, fail, STEPS)


# ======================================================================= 1. selective scan (Mamba / S4D)
# A post-norm stack (S4's default ``prenorm: false``): the encoder's output reaches layer 0's mixer unnormalised.
# The S4D-real init stores A_log = log(1..N) and the forward forgot the minus of A = -exp(A_log): A > 0, so the
# zero-order-hold exp(dt * A) grows with dt. Normal batches keep dt * A small; the batch of step 3 carries a sensor
# spike (x 100), dt = softplus(...) is large and exp(dt * A) overflows float32.
class SelectiveSSM(nn.Module):
    def __init__(self, d_model: int = 16, d_state: int = 8, dt_rank: int = 4, fixed: bool = False) -> None:
        super().__init__()
        d_inner = 2 * d_model
        self.d_state, self.dt_rank, self.fixed = d_state, dt_rank, fixed
        self.in_proj = nn.Linear(d_model, 2 * d_inner)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model)
        with torch.no_grad():  # dt in [1e-3, 1e-1] at init (inverse softplus of the bias)
            dt = torch.exp(torch.rand(d_inner) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        x, z = self.in_proj(x).chunk(2, dim=-1)
        x = F.silu(x)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        A = -torch.exp(self.A_log) if self.fixed else torch.exp(self.A_log)
        dA = torch.exp(dt.unsqueeze(-1) * A)  # <origin:mamba_dA>
        dBx = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        h = x.new_zeros(b, x.shape[-1], self.d_state)
        ys = []
        for t in range(length):
            h = dA[:, t] * h + dBx[:, t]
            ys.append((h * C[:, t].unsqueeze(1)).sum(-1))
        y = torch.stack(ys, dim=1) + x * self.D
        return self.out_proj(y * F.silu(z))


class SSMBlock(nn.Module):
    def __init__(self, d_model: int, fixed: bool) -> None:
        super().__init__()
        self.mixer = SelectiveSSM(d_model, fixed=fixed)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mixer(x))


class SSMClassifier(nn.Module):
    def __init__(self, n_feat: int = 6, d_model: int = 16, n_layers: int = 2, n_cls: int = 3, fixed: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Linear(n_feat, d_model)
        self.layers = nn.ModuleList(SSMBlock(d_model, fixed) for _ in range(n_layers))
        self.head = nn.Linear(d_model, n_cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def _ssm_program(fixed: bool) -> Program:
    torch.manual_seed(0)
    model = SSMClassifier(fixed=fixed)
    g = _gen(17101)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4, 12, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

    def spike(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(s)
        x[1, 5:8] *= 100.0
        return x, y

    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _steps(batch, spike),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@case("mamba_postnorm_s4d_real_init_missing_minus_sensor_spike_dt_exp_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", "layers.0.mixer", "mamba_dA", "exp_overflow"))
def _ssm() -> Program:
    return _ssm_program(fixed=False)


@quiet("mamba_postnorm_s4d_real_init_negative_a_sensor_spike")
def _ssm_quiet() -> Program:
    return _ssm_program(fixed=True)


# ======================================================================= 2. MoE capacity-normalised load term
# Switch-Transformer routing with a capacity per expert, int(capacity_factor * tokens / experts); the layer keeps
# its own auxiliary load term (fraction of capacity used x mean router probability), which the loss code adds.
# The epoch's last batch is short (3 tokens, 8 experts): the capacity is int(1.25 * 3 / 8) = 0.
class SwitchMoE(nn.Module):
    def __init__(self, d: int = 16, n_experts: int = 8, capacity_factor: float = 1.25, min_capacity: int = 0) -> None:
        super().__init__()
        self.n_experts, self.capacity_factor, self.min_capacity = n_experts, capacity_factor, min_capacity
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(n_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(dim=-1)
        gate, expert = probs.max(dim=-1)
        capacity = max(self.min_capacity, int(self.capacity_factor * tokens.shape[0] / self.n_experts))
        onehot = F.one_hot(expert, self.n_experts).to(tokens.dtype)
        position = (onehot.cumsum(dim=0) - 1) * onehot
        kept = onehot * (position < capacity).to(tokens.dtype)
        load = onehot.sum(dim=0) / capacity  # <origin:moe_capacity>
        self.aux_loss = self.n_experts * (load * probs.mean(dim=0)).sum()
        out = torch.zeros_like(tokens)
        for e, expert_net in enumerate(self.experts):
            sel = kept[:, e].bool()
            if sel.any():
                out[sel] = expert_net(tokens[sel]) * gate[sel, None]
        return x + out.reshape_as(x)


class MoEClassifier(nn.Module):
    def __init__(self, min_capacity: int = 0) -> None:
        super().__init__()
        self.embed = nn.Linear(10, 16)
        self.moe = SwitchMoE(min_capacity=min_capacity)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(F.gelu(self.embed(x))))


def _moe_program(min_capacity: int) -> Program:
    torch.manual_seed(0)
    model = MoEClassifier(min_capacity)
    g = _gen(17102)

    def batch(n: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        return lambda s: (torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g))

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1]) + 0.01 * m.moe.aux_loss

    return Program(model, sgd(model, 0.05), _steps(batch(32), batch(3)), loss)


@case("switch_moe_capacity_normalised_load_short_last_batch_capacity_zero",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "moe", "moe_capacity", "div_by_zero"))
def _moe() -> Program:
    return _moe_program(0)


@quiet("switch_moe_min_capacity_one_short_last_batch")
def _moe_quiet() -> Program:
    return _moe_program(1)


# ======================================================================= 3. rotary embeddings, theta = 0
# A GPT block whose rotary module computes its inverse frequencies in the forward (so a changed config takes
# effect) as theta ** (-2i/d); the run config says rope_theta: 0 (a templated value left empty). 0 ** 0 = 1 for
# i = 0, and 0 ** (negative) = inf for every other pair; cos/sin of 0 * inf and of inf are NaN in q and k. The loss
# stays finite (checked: torch's CPU flash-attention kernel drops the NaN scores in its running max), the gradients
# are NaN: kind nonfinite_grad, the NaN made in the forward.
class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = q.shape[-2]
        exponent = -torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        inv_freq = self.theta ** exponent  # <origin:rope_pow>
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos().repeat(1, 2), freqs.sin().repeat(1, 2)

        def rot(t: torch.Tensor) -> torch.Tensor:
            a, b = t.chunk(2, dim=-1)
            return torch.cat([-b, a], dim=-1)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class RotaryAttention(nn.Module):
    def __init__(self, d: int, n_heads: int, theta: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.rotary = Rotary(d // n_heads, theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        q, k = self.rotary(q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TinyGPT(nn.Module):
    def __init__(self, attention: Callable[[], nn.Module], vocab: int = 32, d: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(ln=nn.LayerNorm(d), attn=attention(), ln2=nn.LayerNorm(d),
                                                       mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))))
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln"](x))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.lm_head(self.ln_f(x))


def _lm_steps(seed: int, length: int = 10, vocab: int = 32) -> list[torch.Tensor]:
    g = _gen(seed)
    return [torch.randint(0, vocab, (4, length + 1), generator=g) for _ in range(STEPS)]


def _lm_loss(m: nn.Module, idx: torch.Tensor, s: int) -> torch.Tensor:
    logits = m(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


@case("gpt_rotary_inv_freq_in_forward_config_rope_theta_zero",
      Want("nonfinite_grad", "forward", "aten.pow.Scalar", "blocks.0.attn.rotary", "rope_pow", "div_by_zero", step=0))
def _rope() -> Program:
    torch.manual_seed(0)
    config = dict(rope_theta=0.0, n_heads=2, d=16)
    model = TinyGPT(lambda: RotaryAttention(config["d"], config["n_heads"], config["rope_theta"]))
    return Program(model, sgd(model), _lm_steps(17103), _lm_loss)


# ======================================================================= 4. ALiBi slopes by hand, 5 heads
# Press et al.'s slopes for n heads: a geometric sequence from 2^(-8/n) when n is a power of two; for other n the
# reference code takes the closest power of two and interleaves extra heads. This port does the interleaving in
# torch, spacing the extra heads by 1/log2(n - closest): with 5 heads that is log2(1) = 0, and 0 / 0 for the one
# extra head.
def alibi_slopes(n_heads: int) -> torch.Tensor:
    n = torch.tensor(float(n_heads))
    closest = 2 ** torch.floor(torch.log2(n))
    base = 2 ** (-8.0 / closest)
    slopes = base ** torch.arange(1, int(closest) + 1, dtype=torch.float32)
    extra = n - closest
    if extra > 0:
        spacing = torch.arange(int(extra), dtype=torch.float32) / torch.log2(extra)  # <origin:alibi_div>
        slopes = torch.cat([slopes, base ** (spacing + 0.5)])
    return slopes


class ALiBiAttention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        pos = torch.arange(t)
        distance = (pos[None, :] - pos[:, None]).clamp(max=0).float()
        bias = alibi_slopes(self.n_heads)[:, None, None] * distance
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        bias = bias.masked_fill(~causal, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


@case("alibi_slopes_by_hand_five_heads_extra_spacing_log2_one",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "blocks.0.attn", "alibi_div", "div_by_zero", step=0))
def _alibi() -> Program:
    torch.manual_seed(0)
    model = TinyGPT(lambda: ALiBiAttention(20, 5), d=20)
    return Program(model, sgd(model), _lm_steps(17104), _lm_loss)


# ======================================================================= 5. rfft magnitude of a silent clip
# Keyword spotting on raw audio: a learned pre-emphasis (bias-free conv), frames, rfft, a magnitude written
# sqrt(re^2 + im^2), log1p, a small classifier. The batch of step 3 holds a digitally silent clip: its spectrum is
# exactly 0, the forward is finite (log1p(0) = 0) and sqrt's derivative there is infinite.
class SpectralFrontEnd(nn.Module):
    def __init__(self, frame: int = 32, complex_abs: bool = False) -> None:
        super().__init__()
        self.frame, self.complex_abs = frame, complex_abs
        self.preemph = nn.Conv1d(1, 1, kernel_size=2, bias=False)
        with torch.no_grad():
            self.preemph.weight.copy_(torch.tensor([[[-0.97, 1.0]]]))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = self.preemph(wav.unsqueeze(1)).squeeze(1)
        frames = x[:, : (x.shape[-1] // self.frame) * self.frame].unfold(-1, self.frame, self.frame)
        spec = torch.fft.rfft(frames * torch.hann_window(self.frame), dim=-1)
        if self.complex_abs:
            mag = spec.abs()
        else:
            mag = torch.sqrt(spec.real ** 2 + spec.imag ** 2)  # <origin:fft_mag>
        return torch.log1p(mag)


class KeywordSpotter(nn.Module):
    def __init__(self, complex_abs: bool = False) -> None:
        super().__init__()
        self.frontend = SpectralFrontEnd(complex_abs=complex_abs)
        self.encoder = nn.Sequential(nn.Linear(17, 32), nn.ReLU(), nn.Linear(32, 32))
        self.classifier = nn.Linear(32, 5)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.frontend(wav)).mean(dim=1))


def _kws_program(complex_abs: bool) -> Program:
    torch.manual_seed(0)
    model = KeywordSpotter(complex_abs)
    g = _gen(17105)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return 0.3 * torch.randn(4, 257, generator=g), torch.randint(0, 5, (4,), generator=g)

    def silent(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        wav, y = batch(s)
        wav[2] = 0.0
        return wav, y

    return Program(model, sgd(model), _steps(batch, silent), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@case("keyword_spotter_rfft_magnitude_sqrt_silent_clip",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "frontend", "fft_mag", "grad_singularity"))
def _kws() -> Program:
    return _kws_program(False)


@quiet("keyword_spotter_rfft_complex_abs_silent_clip")
def _kws_quiet() -> Program:
    return _kws_program(True)


# ======================================================================= 6. learned positions past max_len
# A BERT-style encoder with learned absolute positions, nn.Embedding(max_len=24); the collate function pads to the
# longest document of the batch and nobody truncates: the batch of step 3 holds a 30-token document.
class LearnedPosEncoder(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, max_len: int = 24) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        h = self.tok(ids) + self.pos_emb(positions)  # <origin:pos_emb>
        return self.head(self.layer(h, src_key_padding_mask=ids == 0)[:, 0])


@case("bert_learned_positions_long_document_past_max_len_raises",
      Want("exception", "forward", "aten.embedding.default", "pos_emb", "pos_emb", "label_out_of_range", action="raised"))
def _pos() -> Program:
    torch.manual_seed(0)
    model = LearnedPosEncoder()
    g = _gen(17106)

    def batch(length: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        return lambda s: (torch.randint(1, 40, (4, length), generator=g), torch.randint(0, 2, (4,), generator=g))

    return Program(model, sgd(model), _steps(batch(20), batch(30)), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ======================================================================= 7. nn.RMSNorm(eps=0) on the padding token
# A bidirectional encoder with torch's nn.RMSNorm built from config.norm_eps = 0.0 (eps=None would have been
# finfo.eps; 0.0 is taken literally). The token embedding has padding_idx=0, whose row is initialised to zeros and
# never trained. The batch of step 3 is right-padded: the padded positions' RMS is 0, rsqrt(0) = inf, 0 * inf = NaN;
# the key-padding mask fills the scores, but the NaN values still meet weight 0 in attn @ V and spread.
class RMSEncoderBlock(nn.Module):
    def __init__(self, d: int, n_heads: int, norm_eps: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.input_norm = nn.RMSNorm(d, eps=norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.post_norm = nn.RMSNorm(d, eps=norm_eps)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_norm(x)  # <origin:rms_eps0>
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in self.qkv(h).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.mlp(self.post_norm(x))


class RMSEncoder(nn.Module):
    def __init__(self, norm_eps: float, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.layers = nn.ModuleList(RMSEncoderBlock(d, 2, norm_eps) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((x * keep).sum(1) / keep.sum(1))


def _rms_program(norm_eps: float) -> Program:
    torch.manual_seed(0)
    model = RMSEncoder(norm_eps)
    g = _gen(17107)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(1, 40, (4, 9), generator=g), torch.randint(0, 3, (4,), generator=g)

    def padded(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, y = batch(s)
        ids[1, 6:] = 0
        return ids, y

    return Program(model, sgd(model), _steps(batch, padded), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@case("encoder_torch_rmsnorm_config_eps_zero_right_padded_batch",
      Want("nonfinite_loss", "forward", "aten.rsqrt.default", "layers.0.input_norm", "rms_eps0", "zero_variance_norm"))
def _rms() -> Program:
    return _rms_program(0.0)


@quiet("encoder_torch_rmsnorm_eps_1e6_right_padded_batch")
def _rms_quiet() -> Program:
    return _rms_program(1e-6)


# ======================================================================= 8. fp16 SwiGLU MLP on raw PCM
# A frame classifier with SwiGLU layers (value(x) * silu(gate(x))) trained in pure fp16 on the CPU (model.half()),
# inputs normalised to [-1, 1]; the clip of step 3 came through a loader path that returns raw int16 PCM
# (x 32767). The gate's sigmoid saturates to exactly 1 in fp16, so silu passes its whole pre-activation (~3e4), and
# value x gate of two such numbers exceeds fp16's 65504 (finite in float32: ~1e9).
class SwiGLU(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.value = nn.Linear(d_in, d_out)
        self.gate = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value(x) * F.silu(self.gate(x))  # <origin:glu_product>


class GLUFrameNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.glu1 = SwiGLU(64, 64)
        self.glu2 = SwiGLU(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.glu2(self.glu1(x)))


@case("pure_fp16_swiglu_frame_classifier_raw_int16_pcm_clip_gate_saturates_product_overflow",
      Want("nonfinite_loss", "forward", "aten.mul.Tensor", "glu1", "glu_product", "precision_overflow"))
def _glu() -> Program:
    torch.manual_seed(0)
    model = GLUFrameNet().half()
    g = _gen(17108)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.rand(8, 64, generator=g) * 2 - 1).half(), torch.randint(0, 4, (8,), generator=g)

    def raw(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(s)
        x[0] = (x[0].float() * 32767).round().half()
        return x, y

    return Program(model, sgd(model), _steps(batch, raw), lambda m, b, s: F.cross_entropy(m(b[0]).float(), b[1]))


# ======================================================================= 9. learned attention temperature
# Retrieval attention (a query token attends over memory slots) with scores / sqrt(tau * d_head), a learned
# temperature tau (init 0.1) in its own Adam param group with a larger learning rate, and an attention-entropy
# regulariser the layer computes for the loss ("sharpen the retrieval"): the entropy grows with tau, so tau's gradient
# is positive every step, Adam moves it down by about lr = 0.04 per step, and the update of step 2 takes it below 0.
class TemperedRetrieval(nn.Module):
    def __init__(self, d: int = 16, softplus_tau: bool = False) -> None:
        super().__init__()
        self.softplus_tau = softplus_tau
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.tau = nn.Parameter(torch.tensor(0.1 if not softplus_tau else math.log(math.expm1(0.1))))

    def forward(self, query: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(query), self.k(memory), self.v(memory)
        tau = F.softplus(self.tau) if self.softplus_tau else self.tau
        scale = torch.sqrt(tau * q.shape[-1])  # <origin:tau_sqrt>
        w = ((q.unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) / scale).softmax(dim=-1)
        self.entropy = -(w * torch.log(w + 1e-9)).sum(-1).mean()
        return (w.unsqueeze(-1) * v).sum(1)


class RetrievalModel(nn.Module):
    def __init__(self, softplus_tau: bool = False) -> None:
        super().__init__()
        self.attn = TemperedRetrieval(softplus_tau=softplus_tau)
        self.head = nn.Linear(16, 8)

    def forward(self, query: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(query, memory))


def _retrieval_program(softplus_tau: bool) -> Program:
    torch.manual_seed(0)
    model = RetrievalModel(softplus_tau)
    tau = [model.attn.tau]
    rest = [p for n, p in model.named_parameters() if n != "attn.tau"]
    opt = torch.optim.Adam([dict(params=rest, lr=1e-3), dict(params=tau, lr=0.04)])
    g = _gen(17109)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        memory = torch.randn(8, 8, 16, generator=g)
        target = torch.randint(0, 8, (8,), generator=g)
        query = memory[torch.arange(8), target] + 0.1 * torch.randn(8, 16, generator=g)
        return query, memory, target

    return Program(model, opt, [batch(s) for s in range(STEPS)], lambda m, b, s: F.cross_entropy(m(b[0], b[1]), b[2]) + m.attn.entropy)


@case("retrieval_attention_learned_temperature_adam_below_zero_sqrt",
      Want("nonfinite_loss", "forward", "aten.sqrt.default", "attn", "tau_sqrt", "sqrt_negative"))
def _tau() -> Program:
    return _retrieval_program(False)


@quiet("retrieval_attention_softplus_temperature")
def _tau_quiet() -> Program:
    return _retrieval_program(True)


# ======================================================================= 10. GroupNorm(eps=0) after a dead ReLU group
# A ConvNet stem conv -> ReLU -> GroupNorm(4 groups, eps=0 from a config). The last group's channels were given a
# negative bias at init ("sparse edge detectors"): they fire only where the image has edges. The frame of step 3 is
# fog (a constant grey): every channel of that group is 0 everywhere, a constant group, 0 / sqrt(0 + 0).
class Stem(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8, eps=eps)
        with torch.no_grad():
            self.conv.bias[6:] = -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.relu(self.conv(x)))  # <origin:gn_eps0>


class FogNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.stem = Stem(eps)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean(dim=(2, 3)))


def _fog_program(eps: float) -> Program:
    torch.manual_seed(0)
    model = FogNet(eps)
    g = _gen(17110)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(4, 3, 8, 8, generator=g) * 2 - 1, torch.randint(0, 3, (4,), generator=g)

    def fog(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(s)
        x[2] = 0.1
        return x, y

    return Program(model, sgd(model), _steps(batch, fog), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@case("convnet_groupnorm_eps0_edge_group_dead_relu_foggy_frame",
      Want("nonfinite_loss", "forward", "aten.native_group_norm.default", "stem.norm", "gn_eps0", "zero_variance_norm"))
def _fog() -> Program:
    return _fog_program(0.0)


@quiet("convnet_groupnorm_default_eps_foggy_frame")
def _fog_quiet() -> Program:
    return _fog_program(1e-5)


# ======================================================================= independent checks (no nantrace)
class FirstNonFinite(TorchDispatchMode):
    """The first op whose output holds a NaN its inputs did not, or an infinity while every input and scalar
    argument was finite (an explicit -inf fill is not a creation); the innermost module of ``model`` running
    (torch's global module hooks) and the deepest line of this file on the Python stack."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.found: tuple[str, str | None, int | None] | None = None

    def __enter__(self) -> FirstNonFinite:
        self._hooks = (nn.modules.module.register_module_forward_pre_hook(self._push),
                       nn.modules.module.register_module_forward_hook(self._pop))
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
        if self.found is None:
            flat = tree_flatten((args, kwargs))[0]
            ins = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
            nums = [x for x in flat if isinstance(x, float)]
            in_nan = any(bool(t.isnan().any()) for t in ins)
            in_bad = in_nan or any(not bool(t.isfinite().all()) for t in ins) or any(not math.isfinite(x) for x in nums)
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.found is None:
                self.found = (str(func), *self._where())
            raise
        if self.found is None:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if (any(bool(t.isnan().any()) for t in outs) and not in_nan) or \
                    (any(bool(t.isinf().any()) for t in outs) and not in_bad):
                self.found = (str(func), *self._where())
        return out


def first_nonfinite_node(loss: torch.Tensor) -> str | None:
    """The first autograd node, in the order the backward ran, whose outputs hold a non-finite value while the
    gradients it received were finite."""
    found: list[str] = []
    seen, todo, hooks = set(), [loss.grad_fn], []

    def hook(node: Any) -> Callable:
        def check(grad_inputs: Any, grad_outputs: Any) -> None:
            if _finite(grad_outputs) and not _finite(grad_inputs) and not found:
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
    return all(t is None or not isinstance(t, torch.Tensor) or bool(torch.isfinite(t).all()) for t in ts)


def plain_run(program: Program) -> dict[str, Any]:
    """The loop without nantrace: the first step whose loss or gradients are non-finite, and what; the forward
    origin at that step (FirstNonFinite over a re-run of the step's loss code from the same state) and the
    first non-finite backward node."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        received = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            loss = run_step(program, program.loss, batch, step)
        except (IndexError, RuntimeError, ValueError):
            model.load_state_dict(state)
            mode = FirstNonFinite(model)
            with pytest.raises((IndexError, RuntimeError, ValueError)), mode:
                program.loss(model, received, step)
            return dict(step=step, what="raised", origin=mode.found, node=None)
        grads_ok = _finite(p.grad for p in model.parameters())
        loss_ok = bool(torch.isfinite(loss).all())
        if not (loss_ok and grads_ok):
            model.load_state_dict(state)
            mode = FirstNonFinite(model)
            with mode:
                program.loss(model, received, step)
            node = None
            if loss_ok:
                model.zero_grad()
                node = first_nonfinite_node(program.loss(model, received, step))
            return dict(step=step, what="loss" if not loss_ok else "grads", origin=mode.found, node=node)
        opt.step()
        if not _finite(model.parameters()):
            return dict(step=step, what="params", origin=None, node=None)
    return dict(step=None, what=None, origin=None, node=None)


WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised"}
BACKWARD_NODE = {"aten.sqrt.default": "SqrtBackward0"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """Without nantrace the program fails first at the expected step in the expected way; a forward origin is
    the expected op, module and line; a backward origin has a finite forward and the expected first node."""
    build, want = CASES[name]
    run = plain_run(build())
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    if want.phase == "backward":
        assert run["origin"] is None and run["node"] == BACKWARD_NODE[want.op], run
    else:
        op, module, line = run["origin"]
        assert (op, module, line) == (want.op, want.module, JUDGE.marked(want.tag)[1]), run


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
