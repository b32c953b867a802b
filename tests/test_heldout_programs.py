"""Held-out failures shaped like real training programs, written without looking at what
nantrace says about them (issue: the cause is the weakest part of the diagnosis).

Each case is a small model and synthetic data built with torch only, a plain training loop
under ``nantrace.watch(model, optimizer)``, and one failure injected at ``FAIL_STEP`` by the
data or a hyper-parameter, the way real runs fail (a zero-terminal-SNR diffusion schedule, a
fully padded sequence, a blank image, an unrescaled 16-bit image, a sparse-reward rollout, a
sentinel -1 for a missing count, a temperature typed wrong, ...). The expected diagnosis
(kind, phase, ATen op, module, cause and the ``# <origin:TAG>`` source line) was written down
from how the failure was constructed, before nantrace ran on it.

Every case runs twice: zero-intrusive (the loss code is plain Python, as most users run) and
with the loss code wrapped in ``guard.replayable``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 3
STEPS = 5
_TAG = re.compile(r"#\s*<origin:([\w-]+)>")


def origin_line(tag: str) -> int:
    """The 1-based line of this file that carries ``# <origin:tag>``."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) for m in _TAG.finditer(line) if m.group(1) == tag]
    if len(hits) != 1:
        raise LookupError(f"origin tag {tag!r} found {len(hits)} times")
    return hits[0]


# ============================================================================ harness
from test_programs import Want  # noqa: E402  the same diagnosis record as the other real-program cases


@dataclasses.dataclass
class Program:
    """What a training script sets up: the watched model, its optimizer, the batches and the
    per-step loss code ``loss(model, batch, step) -> scalar``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[[nn.Module, Any, int], torch.Tensor]
    autocast: torch.dtype | None = None


@dataclasses.dataclass
class Run:
    incidents: list[Any]
    error: BaseException | None
    error_step: int | None
    unchanged_at_incident: bool | None


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(torch.nan_to_num(x, 1.0, 2.0, 3.0), torch.nan_to_num(y, 1.0, 2.0, 3.0)) for x, y in zip(a, b))


def train(program: Program, *, replayable: bool) -> Run:
    """A plain loop under ``nantrace.watch``; an exception ends the run as it would end the script."""
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            before, seen = _snapshot(model), len(guard.incidents)
            try:
                opt.zero_grad()
                if program.autocast is not None:
                    with torch.autocast("cpu", dtype=program.autocast):
                        loss = loss_fn(model, batch, step)
                else:
                    loss = loss_fn(model, batch, step)
                loss.backward()
                opt.step()
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                unchanged = _same(before, _snapshot(model)) if unchanged is None else unchanged
                break
            if len(guard.incidents) > seen and unchanged is None:
                unchanged = _same(before, _snapshot(model))
    finally:
        guard.close()
    return Run(list(guard.incidents), error, error_step, unchanged)


def _line(source: str | None) -> int | None:
    """The line of ``source`` if it points into this file, -1 if elsewhere, None if absent."""
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    if not path or not os.path.exists(path) or not os.path.samefile(path, __file__):
        return -1
    return int(line)


def describe(inc: Any) -> str:
    return (f"step={inc.step} kind={inc.kind} phase={inc.phase} op={inc.op} module={inc.module!r} "
            f"cause={inc.cause} action={inc.action} source={inc.source}")


def got_of(run: Run) -> dict[str, Any] | None:
    """The diagnosis fields of the first blocking incident (early warnings are logged, not blocking)."""
    main = [i for i in run.incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=_line(inc.source))


def want_of(want: Want) -> dict[str, Any]:
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=origin_line(want.tag) if want.tag else None)


def _sgd(model: nn.Module, lr: float = 1e-2) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return [bad(s) if s == FAIL_STEP else normal(s) for s in range(STEPS)]


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


# ===================================================================== the programs
# 1. DDPM with a zero-terminal-SNR schedule (alpha_bar_T = 0), loss on the x0 recovered from
#    the predicted noise: at t = T, x0 = (x_t - sqrt(1 - ab) eps) / sqrt(ab) divides by 0.
T_DIFF = 10
ALPHA_BAR = 1.0 - torch.linspace(0.0, 1.0, T_DIFF + 1)  # zero terminal SNR: alpha_bar[T] == 0


class EpsNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, 32), nn.SiLU(), nn.Linear(32, d))

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_t, t], dim=1))


def ddpm_x0_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x0, t, noise = batch
    ab = ALPHA_BAR[t].unsqueeze(1)
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    eps = model(x_t, t.float().unsqueeze(1) / T_DIFF)
    x0_pred = (x_t - (1 - ab).sqrt() * eps) / ab.sqrt()  # <origin:ddpm_x0>
    return F.mse_loss(x0_pred, x0)


@case("ddpm_x0_loss_zero_terminal_snr",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "ddpm_x0", "div_by_zero"))
def _ddpm() -> Program:
    torch.manual_seed(0)
    model = EpsNet()
    g = torch.Generator().manual_seed(1)

    def batch(step: int, last: bool = False) -> tuple[torch.Tensor, ...]:
        t = torch.randint(1, T_DIFF, (6,), generator=g)
        if last:
            t[2] = T_DIFF  # the sampler now draws t in [1, T]
        return torch.randn(6, 8, generator=g), t, torch.randn(6, 8, generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), ddpm_x0_loss)


# 2. SimCLR/InfoNCE under float16 autocast: the temperature of the sweep config was typed
#    1e-5 instead of 0.1 for one run phase: cosine / 1e-5 ~ 1e5 > 65504.
class ProjEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


TEMPERATURES = [0.1, 0.1, 0.1, 1e-5, 0.1]


def info_nce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x1, x2 = batch
    z1, z2 = model(x1), model(x2)
    logits = z1 @ z2.t() / TEMPERATURES[step]  # <origin:nce_logits>
    return F.cross_entropy(logits.float(), torch.arange(x1.shape[0]))


@case("infonce_fp16_autocast_tiny_temperature",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "nce_logits", "precision_overflow"))
def _infonce() -> Program:
    torch.manual_seed(0)
    model = ProjEncoder()
    g = torch.Generator().manual_seed(2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 16, generator=g)
        return x, x + 0.05 * torch.randn(6, 16, generator=g)

    return Program(model, _sgd(model), [batch(s) for s in range(STEPS)], info_nce, autocast=torch.float16)


# 3. A segmentation model that computes its own loss (HF style), a per-image soft recall /
#    Tversky term without smoothing: an image with an empty mask gives 0 / 0.
class SoftRecallLoss(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(logits)
        tp = (p * target).sum(dim=(1, 2, 3))
        return (1 - tp / target.sum(dim=(1, 2, 3))).mean()  # <origin:recall_div>


class TinySegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 1, 3, padding=1)
        self.criterion = SoftRecallLoss()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.conv2(torch.relu(self.conv1(x))), mask)


@case("segmentation_recall_empty_mask",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "criterion", "recall_div", "div_by_zero"))
def _seg() -> Program:
    torch.manual_seed(0)
    model = TinySegNet()
    g = torch.Generator().manual_seed(3)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(3, 1, 8, 8, generator=g)
        mask = (torch.rand(3, 1, 8, 8, generator=g) > 0.7).float()
        mask[:, :, 0, 0] = 1.0
        if empty:
            mask[1] = 0.0  # an image without any foreground
        return x, mask

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), lambda m, b, s: m(*b))


# 4. A siamese bag-of-words model scoring cosine similarity by hand; the embedding of the
#    padding index is the zero vector and the projection has no bias: an all-padding text
#    (empty after cleaning) is the zero vector, and dot / (|u| |v|) is 0 / 0.
class BagSiamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.proj = nn.Linear(16, 16, bias=False)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(tokens).sum(1))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        u, v = self.encode(a), self.encode(b)
        return (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))  # <origin:cosine_div>


@case("siamese_cosine_of_all_padding_text",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "cosine_div", "div_by_zero"))
def _siamese() -> Program:
    torch.manual_seed(0)
    model = BagSiamese()
    g = torch.Generator().manual_seed(4)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, ...]:
        a, b = torch.randint(1, 50, (4, 6), generator=g), torch.randint(1, 50, (4, 6), generator=g)
        if empty:
            b[2] = 0
        return a, b, torch.rand(4, generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, bt, s: F.mse_loss(m(bt[0], bt[1]), bt[2]))


# 5. torchvision-style sigmoid focal loss with gamma < 1: a confidently right prediction
#    (an unnormalised input) makes 1 - p_t exactly 0, and d/dx x**0.5 is infinite at 0.
class Tabular(nn.Module):
    def __init__(self, d: int = 10, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.ReLU())
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float = 0.5) -> torch.Tensor:
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * (1 - p_t) ** gamma  # <origin:focal_pow>
    return loss.mean()


@case("focal_loss_gamma_below_one_confident",
      Want("nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", None, "focal_pow", "grad_singularity"))
def _focal() -> Program:
    torch.manual_seed(0)
    model = Tabular()
    g = torch.Generator().manual_seed(5)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 10, generator=g)
        if raw:
            x[0] *= 500.0  # one record in raw units
        return x, (torch.rand(8, 4, generator=g) > 0.5).float()

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: focal_loss(m(b[0]), b[1]))


# 6. A discrete VAE with a Gumbel-softmax quantiser fed pre-drawn uniform noise that was
#    quantised to 8 bits: a u of exactly 1 makes -log(-log(1)) = -log(-0) = +inf.
class GumbelQuantizer(nn.Module):
    def __init__(self, d: int = 16, k: int = 8, tau: float = 1.0) -> None:
        super().__init__()
        self.proj = nn.Linear(d, k)
        self.codebook = nn.Linear(k, d, bias=False)
        self.tau = tau

    def forward(self, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        logits = self.proj(h)
        g = -torch.log(-torch.log(u))  # <origin:gumbel_noise>
        return self.codebook(F.softmax((logits + g) / self.tau, dim=-1))


class DiscreteVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(12, 16), nn.ReLU())
        self.quantizer = GumbelQuantizer()
        self.dec = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.dec(self.quantizer(self.enc(x), u))


@case("gumbel_softmax_uniform_noise_of_one",
      Want("nonfinite_loss", "forward", "aten.log.default", "quantizer", "gumbel_noise", "log_nonpositive"))
def _gumbel() -> Program:
    torch.manual_seed(0)
    model = DiscreteVAE()
    g = torch.Generator().manual_seed(6)

    def batch(step: int, one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.rand(4, 8, generator=g) * 0.98 + 0.01
        if one:
            u[1, 2] = 1.0  # round(255 * r) / 255 == 1
        return torch.randn(4, 12, generator=g), u

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0], b[1]), b[0]))


# 7. nn.MultiheadAttention with a key padding mask, mean-pooled: a sequence that is all
#    padding (an empty document) masks every key of its rows; softmax over all -inf is NaN.
class PaddedTextClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        h, _ = self.attn(x, x, x, key_padding_mask=tokens == 0)  # <origin:mha_call>
        return self.head(h.mean(1))


@case("multihead_attention_fully_padded_sequence",
      Want("nonfinite_loss", "forward", "aten._softmax.default", "attn", "mha_call", "masked_softmax_all"))
def _mha() -> Program:
    torch.manual_seed(0)
    model = PaddedTextClassifier()
    g = torch.Generator().manual_seed(7)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        tok = torch.randint(1, 30, (4, 6), generator=g)
        tok[0, 4:] = 0  # ordinary padding
        if empty:
            tok[3] = 0
        return tok, torch.randint(0, 3, (4,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 8. A hand-written LayerNorm without eps on token embeddings (no positions, MLP-Mixer
#    style): the padding token's embedding is the zero vector, a constant row: 0 / sqrt(0).
class ManualLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return self.weight * (x - mean) / var.sqrt() + self.bias  # <origin:manual_ln>


class TokenMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, padding_idx=0)
        self.norm = ManualLayerNorm(16)
        self.ff = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.ff(self.norm(self.emb(tokens))))
        return self.head(h.mean(1))


@case("manual_layernorm_no_eps_padding_token",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "norm", "manual_ln", "zero_variance_norm"))
def _manual_ln() -> Program:
    torch.manual_seed(0)
    model = TokenMixer()
    g = torch.Generator().manual_seed(8)

    def batch(step: int, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        tok = torch.randint(1, 40, (4, 5), generator=g)
        if pad:
            tok[2, 3:] = 0  # a shorter sequence padded for the first time
        return tok, torch.randint(0, 2, (4,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 9. Ring loss (a feature-norm regulariser) on bias-free tanh features: a blank input (all
#    zeros) gives the zero feature vector, and the derivative of sqrt at 0 is infinite.
#    (x.norm() itself is safe: PyTorch's norm backward defines 0 there.)
class BiasFreeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.fc2 = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.head(feats), feats


def ce_ring_loss(model: nn.Module, batch: Any, step: int, radius: float = 1.0) -> torch.Tensor:
    x, y = batch
    logits, feats = model(x)
    norms = feats.pow(2).sum(dim=1).sqrt()  # <origin:ring_norm>
    return F.cross_entropy(logits, y) + 0.01 * ((norms - radius) ** 2).mean()


@case("ring_loss_feature_norm_of_blank_input",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "ring_norm", "grad_singularity"))
def _ring() -> Program:
    torch.manual_seed(0)
    model = BiasFreeNet()
    g = torch.Generator().manual_seed(9)

    def batch(step: int, blank: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 8, generator=g)
        if blank:
            x[4] = 0.0  # a blank image
        return x, torch.randint(0, 3, (6,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), ce_ring_loss)


# 10. An angular head predicting cos(theta) through tanh and returning theta = acos(cos): an
#     unnormalised input saturates tanh to exactly 1.0, where acos has an infinite derivative.
class AngleRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.acos(torch.tanh(self.fc(x)).squeeze(-1))  # <origin:acos_angle>


@case("angle_head_acos_of_saturated_tanh",
      Want("nonfinite_grad", "backward", "aten.acos.default", "", "acos_angle", "grad_singularity"))
def _acos() -> Program:
    torch.manual_seed(0)
    model = AngleRegressor()
    g = torch.Generator().manual_seed(10)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(5, 6, generator=g)
        if raw:
            x[1] = 1e3 * torch.sign(model.fc.weight[0].detach())  # raw units
        return x, torch.rand(5, generator=g) * 3

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 11. The original minimax GAN discriminator loss with log(D(x)): one batch of real signals was
#     not rescaled (raw signed 16-bit samples): D's logits reach -1e4, sigmoid is exactly 0.
class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def d_loss(disc: nn.Module, batch: Any, step: int) -> torch.Tensor:
    real, z, generator = batch
    d_real = torch.sigmoid(disc(real))
    d_fake = torch.sigmoid(disc(generator(z).detach()))
    return -(torch.log(d_real) + torch.log(1 - d_fake)).mean()  # <origin:gan_d_log>


@case("gan_minimax_discriminator_unscaled_reals",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "gan_d_log", "log_nonpositive"))
def _gan() -> Program:
    torch.manual_seed(0)
    disc = Discriminator()
    generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh())  # trained by its own loop, not watched here
    g = torch.Generator().manual_seed(11)

    def batch(step: int, raw: bool = False) -> tuple[Any, ...]:
        real = torch.rand(8, 16, generator=g) * 2 - 1
        if raw:
            real = torch.randint(-32768, 32768, (8, 16), generator=g).float()
        return real, torch.randn(8, 4, generator=g), generator

    return Program(disc, torch.optim.Adam(disc.parameters(), lr=2e-4), _steps(batch, lambda s: batch(s, True)), d_loss)


# 12. Knowledge distillation with the KL written by hand; the temperature schedule drops to
#     0.01 for a phase: the teacher's softmax underflows to exact zeros and log(0) = -inf.
KD_TEMPS = [4.0, 4.0, 4.0, 0.01, 4.0]


def kd_loss(student: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, teacher = batch
    temp = KD_TEMPS[step]
    with torch.no_grad():
        p_t = F.softmax(teacher(x) / temp, dim=-1)
    log_q = F.log_softmax(student(x) / temp, dim=-1)
    kl = (p_t * (torch.log(p_t) - log_q)).sum(-1).mean()  # <origin:kd_log>
    return kl * temp * temp


@case("distillation_cold_teacher_softmax",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "kd_log", "log_nonpositive"))
def _kd() -> Program:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))  # frozen, not watched
    with torch.no_grad():
        teacher[2].weight.mul_(3.0)
    student = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5))
    g = torch.Generator().manual_seed(12)
    return Program(student, _sgd(student), [(torch.randn(6, 10, generator=g), teacher) for _ in range(STEPS)], kd_loss)


# 13. PPO with per-batch advantage normalisation without eps: a sparse-reward rollout in
#     which every return and value is 0 makes the advantages constant: 0 / std = 0 / 0.
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.pi = nn.Linear(32, 4)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.pi(self.body(obs))


def ppo_loss(policy: nn.Module, batch: Any, step: int, clip: float = 0.2) -> torch.Tensor:
    obs, actions, old_logp, returns, values = batch
    adv = returns - values
    adv = (adv - adv.mean()) / adv.std()  # <origin:adv_norm>
    logp = torch.distributions.Categorical(logits=policy(obs)).log_prob(actions)
    ratio = torch.exp(logp - old_logp)
    return -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()


@case("ppo_advantage_normalisation_sparse_reward",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "adv_norm", "zero_variance_norm"))
def _ppo_adv() -> Program:
    torch.manual_seed(0)
    policy = Policy()
    g = torch.Generator().manual_seed(13)

    def batch(step: int, sparse: bool = False) -> tuple[torch.Tensor, ...]:
        obs = torch.randn(8, 6, generator=g)
        actions = torch.randint(0, 4, (8,), generator=g)
        returns, values = torch.randn(8, generator=g), torch.randn(8, generator=g) * 0.5
        if sparse:
            returns, values = torch.zeros(8), torch.zeros(8)
        return obs, actions, torch.full((8,), math.log(0.25)), returns, values

    return Program(policy, _sgd(policy), _steps(batch, lambda s: batch(s, True)), ppo_loss)


# 14. A colour loss on CIE L* (cube root of luminance) that expects images in [0, 1]; the
#     targets of one batch come from a pipeline normalised to [-1, 1]: (-y) ** (1/3) is NaN.
LUMA = torch.tensor([0.2126, 0.7152, 0.0722])


def lightness(rgb: torch.Tensor) -> torch.Tensor:
    y = (rgb * LUMA.view(1, 3, 1, 1)).sum(1)
    return 116.0 * y ** (1.0 / 3.0) - 16.0  # <origin:lab_cbrt>


class Colorizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)

    def forward(self, gray: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(gray))


@case("lightness_loss_negative_luminance_targets",
      Want("nonfinite_loss", "forward", "aten.pow.Tensor_Scalar", None, "lab_cbrt", "sqrt_negative"))
def _lab() -> Program:
    torch.manual_seed(0)
    model = Colorizer()
    g = torch.Generator().manual_seed(14)

    def batch(step: int, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rgb = torch.rand(2, 3, 6, 6, generator=g)
        if signed:
            rgb = rgb * 2 - 1  # Normalize(mean=0.5, std=0.5)
        return rgb.mean(1, keepdim=True), rgb

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.l1_loss(lightness(m(b[0])), lightness(b[1])))


# 15. A pure float16 tabular MLP; one batch carries raw, unstandardised features (~6e4):
#     each fits float16, but the first layer's products sum beyond 65504.
class HalfMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # <origin:fp16_mlp>


@case("fp16_mlp_raw_features_linear_overflow",
      Want("nonfinite_loss", "forward", "aten.addmm.default", "net.0", "fp16_mlp", "precision_overflow"))
def _fp16_mlp() -> Program:
    torch.manual_seed(0)
    model = HalfMLP().half()
    g = torch.Generator().manual_seed(15)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, 32, generator=g)
        if raw:
            x[1] = 6e4 * torch.sign(model.net[0].weight[0].detach().float())  # raw values aligned with a unit
        return x.half(), torch.randn(4, 1, generator=g).half()

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 16. Regression with a missing target: the CSV had an empty cell, parsed as NaN, in the
#     labels only (the features are clean).
@case("regression_target_nan_missing_label",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input"))
def _target_nan() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(16)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
        if missing:
            y[5, 0] = float("nan")
        return x, y

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 17. A float16 model with the usual attention padding mask filled with -1e9: the first batch
#     that needs a mask raises, -1e9 does not fit float16.
class HalfAttention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.d = d

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, :] == 0, -1e9)  # <origin:fill_fp16>
        return F.softmax(scores, dim=-1) @ v


class HalfEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = HalfAttention()
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.attn(x, mask).mean(1))


@case("fp16_attention_mask_fill_minus_1e9",
      Want("exception", "forward", "aten.masked_fill.Scalar", "attn", "fill_fp16", "precision_overflow",
           action="raised"))
def _fill_fp16() -> Program:
    torch.manual_seed(0)
    model = HalfEncoder().half()
    g = torch.Generator().manual_seed(17)

    def batch(step: int, padded: bool = False) -> tuple[Any, ...]:
        x = torch.randn(2, 5, 16, generator=g).half()
        mask = None
        if padded:
            mask = torch.ones(2, 5)
            mask[1, 3:] = 0
        return x, mask, torch.randint(0, 2, (2,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0], b[1]).float(), b[2]))


# 18. A policy that samples inside forward with action masking: a terminal state that was not
#     filtered has no legal action, so the masked probabilities sum to 0.
class MaskedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.head(self.body(obs)), dim=-1) * legal
        action = torch.multinomial(probs, 1)  # <origin:multinomial_masked>
        return probs, action


def masked_reinforce(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, reward = batch
    probs, action = m(obs, legal)
    logp = torch.log(probs.gather(1, action).squeeze(1))
    return -(logp * reward).mean()


@case("policy_multinomial_no_legal_action",
      Want("exception", "forward", "aten.multinomial.default", "", "multinomial_masked", "domain_error",
           action="raised"))
def _multinomial() -> Program:
    torch.manual_seed(0)
    model = MaskedPolicy()
    g = torch.Generator().manual_seed(18)

    def batch(step: int, terminal: bool = False) -> tuple[torch.Tensor, ...]:
        legal = torch.ones(5, 4)
        legal[:, 3] = 0.0
        if terminal:
            legal[2] = 0.0
        return torch.randn(5, 6, generator=g), legal, torch.randn(5, generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), masked_reinforce)


# 19. DeepSurv (Cox partial likelihood): one patient's lab value is in the wrong unit (x 1e4);
#     the log hazard reaches the hundreds and exp overflows float32.
def cox_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, time, event = batch
    log_h = model(x).squeeze(-1)
    order = torch.argsort(time, descending=True)
    log_h, event = log_h[order], event[order]
    risk = torch.exp(log_h)  # <origin:cox_exp>
    log_cum = torch.log(torch.cumsum(risk, 0))
    return -((log_h - log_cum) * event).sum() / event.sum()


@case("cox_partial_likelihood_unit_error",
      Want("nonfinite_loss", "forward", "aten.exp.default", None, "cox_exp", "exp_overflow"))
def _cox() -> Program:
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.3, -0.2, 0.1, 0.25, -0.15]]))
    g = torch.Generator().manual_seed(19)

    def batch(step: int, unit: bool = False) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 5, generator=g)
        if unit:
            x[3, 0] = 4.2e3  # mg/L entered where g/L is expected
        return x, torch.rand(8, generator=g), torch.ones(8)

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), cox_loss)


# 20. An input normalisation layer computing the variance as E[x^2] - E[x]^2: one feature of
#     a batch is a timestamp-like column (~1e4 with a tiny spread): the cancellation makes the
#     variance negative, and sqrt(var + eps) is NaN.
class NaiveBatchNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0)
        var = (x * x).mean(0) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5)  # <origin:naive_bn_sqrt>


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = NaiveBatchNorm()
        self.fc = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x))


NEG_VAR_COLUMN = 1e4 + 1e-3 * torch.randn(8, generator=torch.Generator().manual_seed(1))  # E[x^2]-E[x]^2 = -8 in float32


@case("naive_variance_cancellation_negative",
      Want("nonfinite_loss", "forward", "aten.sqrt.default", "bn", "naive_bn_sqrt", "sqrt_negative"))
def _naive_bn() -> Program:
    torch.manual_seed(0)
    model = NormedMLP()
    g = torch.Generator().manual_seed(20)

    def batch(step: int, stamp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 4, generator=g)
        if stamp:
            x[:, 2] = NEG_VAR_COLUMN
        return x, torch.randn(8, 1, generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 21. DQN's q.gather over actions recorded by an environment with one more action than the
#     Q-network has outputs.
def dqn_loss(qnet: nn.Module, batch: Any, step: int, gamma: float = 0.99) -> torch.Tensor:
    obs, actions, rewards, next_obs = batch
    q = qnet(obs).gather(1, actions.unsqueeze(1)).squeeze(1)  # <origin:dqn_gather>
    with torch.no_grad():
        target = rewards + gamma * qnet(next_obs).max(1).values
    return F.smooth_l1_loss(q, target)


@case("dqn_gather_action_out_of_range",
      Want("exception", "forward", "aten.gather.default", None, "dqn_gather", "label_out_of_range", action="raised"))
def _dqn() -> Program:
    torch.manual_seed(0)
    qnet = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(21)

    def batch(step: int, extra: bool = False) -> tuple[torch.Tensor, ...]:
        actions = torch.randint(0, 3, (6,), generator=g)
        if extra:
            actions[4] = 3  # NOOP of the new environment version
        return torch.randn(6, 4, generator=g), actions, torch.randn(6, generator=g), torch.randn(6, 4, generator=g)

    return Program(qnet, _sgd(qnet), _steps(batch, lambda s: batch(s, True)), dqn_loss)


# 22. Count features log-transformed inside the model; the export marks a missing count with
#     the sentinel -1: log1p(-1) = -inf.
class LogCounts(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.log1p(counts)  # <origin:log1p_counts>


class CountModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = LogCounts()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(counts))


@case("log1p_counts_missing_sentinel",
      Want("nonfinite_loss", "forward", "aten.log1p.default", "features", "log1p_counts", "log_nonpositive"))
def _log1p() -> Program:
    torch.manual_seed(0)
    model = CountModel()
    g = torch.Generator().manual_seed(22)

    def batch(step: int, missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.randint(0, 50, (6, 6), generator=g).float()
        if missing:
            counts[0, 4] = -1.0
        return counts, torch.randint(0, 2, (6,), generator=g)

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 23. A hand-written softplus activation, log(1 + exp(x)), in a module: a batch of
#     unnormalised inputs drives a pre-activation above 88.7 and exp overflows float32.
class NaiveSoftplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(1 + torch.exp(x))  # <origin:naive_softplus>


class SoftplusNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = NaiveSoftplus()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@case("naive_softplus_activation_exp_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", "act", "naive_softplus", "exp_overflow"))
def _softplus() -> Program:
    torch.manual_seed(0)
    model = SoftplusNet()
    g = torch.Generator().manual_seed(23)

    def batch(step: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, 8, generator=g)
        if raw:
            x[2] = 1e3 * torch.sign(model.fc1.weight[0].detach())  # raw units, aligned with a unit
        return x, torch.randn(4, 1, generator=g)

    return Program(model, _sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 24. A loss that normalises a prediction error by the per-sample target range (a scale-free
#     regression, MASE-like); a flat series (all target values equal) has range 0: 0 / 0? No:
#     the error is not 0, so err / 0 = inf.
def range_normalised_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    pred = model(x)
    scale = y.amax(dim=1) - y.amin(dim=1)
    return ((pred - y).abs().mean(dim=1) / scale).mean()  # <origin:range_div>


@case("forecast_loss_flat_series_range",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "range_div", "div_by_zero"))
def _range() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6))
    g = torch.Generator().manual_seed(24)

    def batch(step: int, flat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 6, generator=g)
        if flat:
            y[3] = 7.0  # a sensor stuck at one value
        return x, y

    return Program(model, _sgd(model), _steps(batch, lambda s: batch(s, True)), range_normalised_loss)


# ======================================================================= the tests
MODES = ("zero_intrusive", "replayable")


def _params() -> list[Any]:
    out = []
    for name in CASES:
        for mode in MODES:
            marks = [pytest.mark.xfail(strict=True, reason=XFAIL[f"{name}[{mode}]"])] if f"{name}[{mode}]" in XFAIL else []
            out.append(pytest.param(name, mode, id=f"{name}-{mode}", marks=marks))
    return out


@pytest.mark.parametrize("name,mode", _params())
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train(build(), replayable=mode == "replayable")
    got = got_of(run)
    assert got is not None, "no incident"
    assert got == want_of(want), [describe(i) + " | " + i.summary for i in run.incidents]
    if want.kind == "exception":
        assert run.error is not None and run.error_step == want.step, (run.error, run.error_step)
        assert not isinstance(run.error, nantrace.NonFiniteError)
    else:
        assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


def test_cases_fail_without_nantrace() -> None:
    """The construction itself: without nantrace, every program fails at FAIL_STEP and not before."""
    for name, (build, want) in CASES.items():
        program = build()
        model, opt = program.model, program.optimizer
        for step, batch in enumerate(program.batches):
            opt.zero_grad()
            try:
                ctx = torch.autocast("cpu", dtype=program.autocast) if program.autocast else _null()
                with ctx:
                    loss = program.loss(model, batch, step)
                loss.backward()
            except Exception:
                assert want.kind == "exception" and step == want.step, (name, step)
                break
            grads_ok = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            bad = not bool(torch.isfinite(loss).all()) or not grads_ok
            if step != want.step:
                assert not bad, (name, step)
                opt.step()
                continue
            if want.kind == "nonfinite_loss" or want.kind == "nonfinite_input":
                assert not bool(torch.isfinite(loss).all()), (name, float(loss))
            elif want.kind == "nonfinite_grad":
                assert bool(torch.isfinite(loss).all()) and not grads_ok, name
            else:
                raise AssertionError(f"{name} did not raise at step {step}")
            break


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
