"""Held-out failures, round 13b: step code SPREAD OVER OBJECTS, where the zero-intrusive guard must find loss
code it was never told about.

1. ``torch.optim.LBFGS`` driven by a closure (the optimizer calls it several times per step): a Poisson rate head
   without a link function whose ``log(rate)`` meets a negative rate in the loss inside the closure; a log
   transform of raw counts inside the model (``log`` instead of ``log1p``) meeting a zero count.
2. A real ``transformers.Trainer`` (tiny ``BertForSequenceClassification`` built from a config) whose
   ``compute_loss`` override adds a hand-written distillation KL on stored soft labels: one batch of rule-based
   (one-hot) labels has exact zeros, ``log(0)``.
3. Real Lightning: a GAN under manual optimisation (two optimizers, ``manual_backward``) whose generator loss
   carries a mode-seeking term ``mean|G(z2) - G(z1)| / mean|z2 - z1|``, 0 / 0 on a batch whose two latent draws
   coincide; a ``Callback.on_before_backward`` that adds a router-entropy regulariser to the loss in place,
   ``p * log(p)`` with a gate probability that underflowed to 0.
4. A loss OBJECT with its own parameters (Kendall-style learned task weights; a learnable-temperature InfoNCE):
   an empty task mask (0 / 0 count) and a zero embedding normalised by its norm, both born in the loss module's
   forward; a DeiT-style distillation loss object holding a frozen, unwatched teacher whose cosine head divides a
   blank image's zero features by their norm; a diffusion wrapper trained through ``model.compute_loss(...)`` (its
   ``forward`` never runs) whose min-SNR weight divides by an SNR of 0 at the last step of a zero-terminal-SNR
   schedule; a sparse autoencoder whose KL sparsity penalty is computed in a user forward hook registered on the
   encoder.
5. Code inside the optimizer step: an ``Optimizer.register_step_pre_hook`` that row-normalises an embedding's
   gradient (0 / 0 on the rows of items absent from the batch); a ``LambdaLR`` lambda with a Noam-schedule typo
   (``sqrt(e - warmup)``) evaluated with numpy, inf at ``e == warmup``. The pre-hook twice: registered before the
   guard was made, and installed by the loop's set-up after it (as under ``nantrace run``).
6. Failures that RAISE from such code: a hard-negative sampler object whose ``exp(scores / tau)`` overflows
   (``torch.multinomial`` rejects the NaN probabilities); a collator called in the step that looks word vectors
   up with ``F.embedding`` and meets a token id added after the table was exported; a GP marginal-likelihood loss
   module whose pairwise distances (diagonal zeroed, duplicates not) take ``sqrt`` of a rounding-negative square
   distance of a duplicated example, and ``torch.linalg.cholesky`` rejects the NaN kernel.
7. QUIET programs of the same shapes that must not fire.

How expectations were derived (before nantrace ran): from /work/shared/API.md and docs/diagnosis.md. The origin
is the first op that made a non-finite value from finite inputs (or, when the NaN-making op received an infinity,
the op that made that infinity: ``log(0)`` before ``0 * -inf``); module = the innermost module whose call was in
progress when the op was issued (``None`` for a loss object, a sampler, a collator, a Lightning callback, a
``training_step`` / ``compute_loss`` body; the hooked module for code in its forward hook, which runs inside its
``__call__``); source = the marked line (the loop's ``optimizer.step()`` for a torch optimizer driven by a
plain-number setting). Causes: a zero count is ``div_by_zero``; a norm of a zero vector is ``zero_variance_norm``;
a divisor that is a norm of this step's gradient, in the optimizer step, is ``div_by_zero``; an infinite
learning rate is ``optimizer_state``; a raised step is kind ``exception``, action ``raised``, with the value's
origin and cause (an id outside the table: ``label_out_of_range``). Every construction is checked without nantrace,
with plain torch and round 8b's op recorder ``Made`` (a TorchDispatchMode): ``test_cases_fail_without_nantrace``
and ``test_framework_construction`` assert the step, the stage (loss, gradient, parameter after the update, or the
exception's type) and the first op that made a non-finite value from finite inputs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from heldout_harness import (Judge, Program, Run, _blocking, aligned, case_params, describe, run_step, same,
                             snapshot, train)
from origin_markers import origin_line
from test_heldout_programs_r8b import Log, Made, Outcome, Rows, _finite, hf_args, hf_fit
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3
N_STEPS = 5

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
RAISES: dict[str, type] = {}
"""Exception cases -> the type of the user's exception."""
XFAIL: dict[str, str] = {
}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want, raises: type | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if raises is not None:
            RAISES[name] = raises
        return build

    return register


def raised(phase: str, op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want("exception", phase, op, module, tag, cause, step=FAIL_STEP, action="raised")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class ClosureProgram(Program):
    """A program trained with ``optimizer.step(closure)`` (L-BFGS): the closure zeroes the gradients, runs the
    loss code and ``backward()`` and returns the loss; the optimizer may call it several times a step."""


def train_closure(program: ClosureProgram, *, replayable: bool) -> Run:
    """The harness's loop (``heldout_harness.train``) for a closure-driven optimizer."""
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            before, seen = snapshot(model), _blocking(guard.incidents)
            try:
                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = loss_fn(model, batch, step)
                    loss.backward()
                    return loss

                opt.step(closure)  # <origin:lbfgs_step>
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if _blocking(guard.incidents) > seen and unchanged is None:
                unchanged = same(before, snapshot(model))
    finally:
        guard.close()
    return Run(list(guard.incidents), error, error_step, unchanged)


def train_any(program: Program, *, replayable: bool) -> Run:
    return (train_closure if isinstance(program, ClosureProgram) else train)(program, replayable=replayable)


# ================================================================= 1. L-BFGS and its closure
# 1a. Poisson regression of event counts, fitted by full-batch L-BFGS (strong Wolfe line search), with a rate
#     head written as a plain linear layer ("the bias starts at 5, the rate stays positive"). The batch of step
#     FAIL_STEP holds one record with a sensor glitch (x60 along a direction where the rate is negative):
#     rate < 0 and log(rate) = NaN at the closure's first evaluation of that step.
class CountRegressor(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.rate = nn.Linear(d, 1)
        with torch.no_grad():
            self.rate.weight.mul_(0.3)
            self.rate.bias.fill_(5.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rate(x).squeeze(-1)


def poisson_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, counts = batch
    rate = model(x)
    return (rate - counts * torch.log(rate)).mean()  # <origin:lbfgs_log_rate>


def _poisson_batches(model: nn.Module, seed: int, glitch: bool) -> list[Any]:
    g = _gen(seed)
    bad = aligned(lambda v: model(v), 6, -1.0, 60.0, seed + 1)
    out = []
    for step in range(N_STEPS):
        x = 0.3 * torch.randn(32, 6, generator=g)
        if glitch and step == FAIL_STEP:
            x[7] = bad
        out.append((x, torch.poisson(torch.full((32,), 5.0), generator=g)))
    return out


@case("lbfgs_closure_poisson_rate_without_link_log_negative",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "lbfgs_log_rate", "log_nonpositive"))
def _lbfgs_poisson() -> Program:
    torch.manual_seed(0)
    model = CountRegressor()
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=4, line_search_fn="strong_wolfe")
    return ClosureProgram(model, opt, _poisson_batches(model, 1300, True), poisson_nll)


# 1b. A count-feature regressor that log-transforms its raw counts inside the model (``torch.log`` where
#     ``log1p`` was meant), fitted by L-BFGS. A row of the batch of step FAIL_STEP has two zero counts:
#     log(0) = -inf in the module ``features``; the next layer mixes the two -inf with weights of opposite
#     signs (inf - inf = NaN) and the loss is NaN at the closure's first evaluation.
class LogCounts(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.log(counts)  # <origin:lbfgs_log_counts>


class CountFeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = LogCounts()
        self.mlp = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.features(counts)).squeeze(-1)


def _count_batches(seed: int, zero: bool) -> list[Any]:
    g = _gen(seed)
    out = []
    for step in range(N_STEPS):
        counts = torch.randint(1, 50, (24, 5), generator=g).float()
        if zero and step == FAIL_STEP:
            counts[4, 1:3] = 0.0  # a store closed for two days
        out.append((counts, torch.randn(24, generator=g)))
    return out


@case("lbfgs_closure_model_log_transform_zero_count",
      Want("nonfinite_loss", "forward", "aten.log.default", "features", "lbfgs_log_counts", "log_nonpositive"))
def _lbfgs_counts() -> Program:
    torch.manual_seed(0)
    model = CountFeatureNet()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    return ClosureProgram(model, opt, _count_batches(1310, True), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# ================================================================= 4. loss objects, methods, hooks
# 4a. Multi-task regression + classification with Kendall et al.'s learned task weights in a loss OBJECT
#     (its own log-variances, optimised with the model: not part of the model). The regression target is
#     missing for part of the data (mask); the batch of step FAIL_STEP has no labelled regression target at
#     all: the masked mean is 0 / 0 in the loss module's forward.
class MultiTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.reg_head = nn.Linear(32, 1)
        self.cls_head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.reg_head(h).squeeze(-1), self.cls_head(h)


class UncertaintyWeightedLoss(nn.Module):
    def __init__(self, tasks: int = 2, clamp_count: bool = False) -> None:
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(tasks))
        self.clamp_count = clamp_count

    def forward(self, outputs: Any, y_reg: torch.Tensor, has_reg: torch.Tensor, y_cls: torch.Tensor) -> torch.Tensor:
        pred_reg, logits = outputs
        mask = has_reg.float()
        count = mask.sum().clamp(min=1.0) if self.clamp_count else mask.sum()
        reg = ((pred_reg - y_reg) ** 2 * mask).sum() / count  # <origin:uw_masked_mean>
        cls = F.cross_entropy(logits, y_cls)
        losses = torch.stack([reg, cls])
        return (torch.exp(-self.log_vars) * losses + self.log_vars).sum()


def _multitask(seed: int, clamp_count: bool) -> Program:
    torch.manual_seed(0)
    model, criterion = MultiTaskNet(), UncertaintyWeightedLoss(clamp_count=clamp_count)
    opt = torch.optim.Adam([{"params": model.parameters()}, {"params": criterion.parameters(), "lr": 1e-2}], lr=1e-3)
    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        has_reg = torch.rand(16, generator=g) < 0.5
        has_reg[0] = True
        if step == FAIL_STEP:
            has_reg[:] = False  # a batch drawn only from the unlabelled source
        batches.append((torch.randn(16, 8, generator=g), torch.randn(16, generator=g), has_reg,
                        torch.randint(0, 4, (16,), generator=g)))
    return Program(model, opt, batches, lambda m, b, s: criterion(m(b[0]), b[1], b[2], b[3]))


@case("loss_object_uncertainty_weights_empty_regression_mask",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "uw_masked_mean", "div_by_zero"))
def _uw() -> Program:
    return _multitask(1400, clamp_count=False)


# 4b. Audio-text contrastive learning with an InfoNCE loss OBJECT holding a learnable temperature (CLIP's
#     logit scale). It L2-normalises the embeddings itself, ``z / z.norm()`` without eps; the audio tower is
#     bias-free, so a silent clip (all-zero features) in the batch of step FAIL_STEP embeds to exactly 0:
#     0 / 0 in the loss module's forward, a norm of a constant (zero) vector.
class AudioTextModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.audio = nn.Sequential(nn.Linear(20, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
        self.text = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(1), nn.Linear(16 * 6, 16))

    def forward(self, audio: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.audio(audio), self.text(tokens)


class InfoNCE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = a / a.norm(dim=-1, keepdim=True)  # <origin:infonce_norm>
        t = t / t.norm(dim=-1, keepdim=True)
        logits = self.logit_scale.exp() * a @ t.T
        target = torch.arange(len(a))
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


@case("loss_object_learnable_temperature_infonce_silent_clip_zero_embedding",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "infonce_norm", "zero_variance_norm"))
def _infonce() -> Program:
    torch.manual_seed(0)
    model, criterion = AudioTextModel(), InfoNCE()
    opt = torch.optim.AdamW(list(model.parameters()) + list(criterion.parameters()), lr=1e-3)
    g = _gen(1410)
    batches = []
    for step in range(N_STEPS):
        audio = torch.randn(8, 20, generator=g)
        if step == FAIL_STEP:
            audio[5] = 0.0  # a silent clip
        batches.append((audio, torch.randint(0, 50, (8, 6), generator=g)))
    return Program(model, opt, batches, lambda m, b, s: criterion(*m(*b)))


# 4b'. DeiT-style distillation: a loss OBJECT (timm's ``DistillationLoss`` shape) holding a frozen teacher network,
#     not watched, whose classifier is cosine (features divided by their norm, no eps). A blank image (all zeros,
#     a failed decode replaced by zeros) in the batch of step FAIL_STEP reaches the teacher's bias-free trunk:
#     0 / 0 in the teacher's forward, which runs inside the loss object, outside the watched model.
class CosineTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
        self.prototypes = nn.Parameter(torch.randn(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.trunk(x)
        f = f / f.norm(dim=-1, keepdim=True)  # <origin:teacher_cosine>
        return 10.0 * f @ F.normalize(self.prototypes, dim=-1).T


class DistillationLoss(nn.Module):
    def __init__(self, teacher: nn.Module, alpha: float = 0.5, tau: float = 2.0) -> None:
        super().__init__()
        self.teacher = teacher.eval().requires_grad_(False)
        self.alpha, self.tau = alpha, tau

    def forward(self, inputs: torch.Tensor, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        base = F.cross_entropy(outputs, labels)
        with torch.no_grad():
            teacher_logits = self.teacher(inputs)
        kd = F.kl_div(F.log_softmax(outputs / self.tau, -1), F.log_softmax(teacher_logits / self.tau, -1),
                      reduction="batchmean", log_target=True) * self.tau ** 2
        return (1 - self.alpha) * base + self.alpha * kd


@case("distillation_loss_object_frozen_teacher_cosine_head_blank_image",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "teacher_cosine", "zero_variance_norm"))
def _deit() -> Program:
    torch.manual_seed(0)
    criterion = DistillationLoss(CosineTeacher())
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
    g = _gen(1415)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(8, 12, generator=g)
        if step == FAIL_STEP:
            x[2] = 0.0  # a blank image
        batches.append((x, torch.randint(0, 4, (8,), generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), batches,
                   lambda m, b, s: criterion(b[0], m(b[0]), b[1]))


# 4c. A diffusion wrapper trained through ``model.compute_loss(x0, t, noise)``, a method other than forward (its
#     forward is sampling and never runs in training). The schedule is rescaled to zero terminal SNR
#     (alphas_cumprod[-1] = 0) and the loss is weighted by min-SNR-5 written for epsilon prediction,
#     ``min(snr, 5) / snr``: at t = T - 1, snr = 0 and the weight is 0 / 0. t = T - 1 is first drawn at step
#     FAIL_STEP.
class Denoiser(nn.Module):
    def __init__(self, d: int = 8, T: int = 20) -> None:
        super().__init__()
        self.t_emb = nn.Embedding(T, 16)
        self.net = nn.Sequential(nn.Linear(d + 16, 32), nn.SiLU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, self.t_emb(t)], -1))


class GaussianDiffusion(nn.Module):
    def __init__(self, T: int = 20, weighting: str = "min_snr_eps") -> None:
        super().__init__()
        self.denoiser = Denoiser(T=T)
        self.weighting = weighting
        betas = torch.linspace(1e-4, 0.2, T, dtype=torch.float64)
        sqrt_ac = torch.cumprod(1 - betas, 0).sqrt()
        first, last = sqrt_ac[0].clone(), sqrt_ac[-1].clone()
        sqrt_ac = (sqrt_ac - last) * first / (first - last)  # rescaled to zero terminal SNR
        self.register_buffer("alphas_cumprod", (sqrt_ac ** 2).float())

    @torch.no_grad()
    def forward(self, n: int) -> torch.Tensor:  # sampling (not used in training)
        return torch.randn(n, 8)

    def compute_loss(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ac = self.alphas_cumprod[t][:, None]
        x_t = ac.sqrt() * x0 + (1 - ac).sqrt() * noise
        pred = self.denoiser(x_t, t)
        snr = ac / (1 - ac)
        if self.weighting == "min_snr_eps":
            weight = torch.clamp(snr, max=5.0) / snr  # <origin:diffusion_min_snr>
        else:
            weight = torch.clamp(snr, max=5.0) / (snr + 1)
        return (weight * (pred - noise) ** 2).mean()


def _diffusion(seed: int, weighting: str) -> Program:
    torch.manual_seed(0)
    model = GaussianDiffusion(weighting=weighting)
    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        t = torch.randint(0, 19, (16,), generator=g)
        if step == FAIL_STEP:
            t[9] = 19
        batches.append((torch.randn(16, 8, generator=g), t, torch.randn(16, 8, generator=g)))
    return Program(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches,
                   lambda m, b, s: m.compute_loss(*b))


@case("diffusion_compute_loss_method_min_snr_zero_terminal_snr",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "diffusion_min_snr", "div_by_zero"))
def _diffusion_case() -> Program:
    return _diffusion(1420, "min_snr_eps")


# 4d. A sparse autoencoder whose KL sparsity penalty (Ng's notes) is computed in a forward hook the user
#     registered on the encoder and collected into a list the loss sums. The batch of step FAIL_STEP is a run of
#     one stuck sensor reading (x40): a hidden sigmoid unit saturates to exactly 1.0 on every row, rho_hat = 1,
#     and (1 - rho) / (1 - rho_hat) divides by 0 (a Python float over a tensor: reciprocal) inside the hook.
class SparseAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 24), nn.Sigmoid())
        self.decoder = nn.Linear(24, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def _sae(seed: int, clamp: bool) -> Program:
    torch.manual_seed(0)
    model = SparseAutoencoder()
    rho, penalties = 0.05, []

    def kl_sparsity(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        rho_hat = out.mean(0)
        if clamp:
            rho_hat = rho_hat.clamp(1e-6, 1 - 1e-6)
        kl = rho * torch.log(rho / rho_hat) + (1 - rho) * torch.log((1 - rho) / (1 - rho_hat))  # <origin:sae_hook_kl>
        penalties.append(kl.sum())

    model.encoder.register_forward_hook(kl_sparsity)

    def loss(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        penalties.clear()
        recon = m(x)
        return F.mse_loss(recon, x) + 1e-3 * sum(penalties)

    stuck = aligned(lambda v: model.encoder[0](v)[:, 3] - 20.0, 12, 1.0, 40.0, seed + 1)
    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(16, 12, generator=g)
        if step == FAIL_STEP:
            x = stuck.expand(16, 12) + 0.01 * x
        batches.append(x)
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, loss)


@case("sparse_autoencoder_kl_penalty_in_user_forward_hook_saturated_unit",
      Want("nonfinite_loss", "forward", "aten.reciprocal.default", "encoder", "sae_hook_kl", "div_by_zero"))
def _sae_case() -> Program:
    return _sae(1430, clamp=False)


# ================================================================= 5. code inside the optimizer step
# 5a. Two-tower recommender whose item-embedding gradient is row-normalised by an optimizer step PRE-HOOK
#     ("so that popular items do not dominate"), ``g.div_(g.norm(dim=1))``. The catalogue has 6 items; the batch
#     of step FAIL_STEP holds items 0..3 only: rows 4, 5 of the gradient are 0, 0 / 0 in the hook, and SGD writes
#     NaN into those rows of ``items``.
class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 8))
        self.items = nn.Embedding(6, 8)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.user(users) * self.items(items)).sum(-1)


def _two_tower(seed: int, eps: float, install_at_start: bool = False) -> Program:
    torch.manual_seed(0)
    model = TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def normalise_item_rows(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        g = model.items.weight.grad
        if g is not None:
            g.div_(g.norm(dim=1, keepdim=True) + eps)  # <origin:prehook_row_norm>

    before_step = None
    if install_at_start:  # the loop's set-up installs it when training starts (after the guard was made)
        def before_step(m: nn.Module, step: int) -> None:
            if step == 0:
                opt.register_step_pre_hook(normalise_item_rows)
    else:
        opt.register_step_pre_hook(normalise_item_rows)
    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        items = torch.randint(0, 4 if step == FAIL_STEP else 6, (32,), generator=g)
        items[:6] = torch.arange(6) if step != FAIL_STEP else items[:6]
        batches.append((torch.randn(32, 10, generator=g), items, torch.rand(32, generator=g)))
    return Program(model, opt, batches, lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2]),
                   before_step=before_step)


@case("optimizer_step_pre_hook_row_normalised_item_gradient_absent_items",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "items", "prehook_row_norm", "div_by_zero"))
def _prehook() -> Program:
    return _two_tower(1500, eps=0.0)


# 5a'. The same hook installed by the loop's set-up when training starts, that is after the guard was made (as
#     under ``nantrace run``, which watches the optimizer when the script creates it): the hook now runs after
#     every hook that was registered before it.
@case("optimizer_step_pre_hook_installed_after_watch_absent_items",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "items", "prehook_row_norm", "div_by_zero"))
def _prehook_late() -> Program:
    return _two_tower(1500, eps=0.0, install_at_start=True)


# 5b. A Noam-style schedule in a LambdaLR lambda, written with numpy, with a typo after the warm-up:
#     ``sqrt(warmup) / sqrt(e - warmup)`` instead of ``/ sqrt(e)``. At e == warmup (= FAIL_STEP) numpy returns
#     inf (a warning, no exception), the scheduler sets lr = inf before the step, and SGD's
#     ``param.add_(grad, alpha=-inf)`` makes the first parameter non-finite.
class TabularMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@case("lambda_lr_noam_typo_numpy_sqrt_zero_after_warmup",
      Want("nonfinite_param", "optimizer", "aten.add_.Tensor", "body.0", "opt_step", "optimizer_state"))
def _noam() -> Program:
    torch.manual_seed(0)
    model = TabularMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    warmup = FAIL_STEP
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: (e + 1) / warmup if e < warmup else np.sqrt(warmup) / np.sqrt(e - warmup))
    g = _gen(1510)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(N_STEPS)]
    return Program(model, opt, batches, lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), scheduler=sched)


# ================================================================= 6. failures that raise from spread code
# 6a. Hard-negative mining in a sampler OBJECT: negatives drawn with probability exp(score / tau), written
#     without the max-shift; the batch of step FAIL_STEP has a user with unnormalised features (x30): a score
#     above tau * 88.7 overflows exp to inf, inf / inf = NaN, and torch.multinomial raises.
class ScoreModel(nn.Module):
    def __init__(self, items: int = 12) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
        self.items = nn.Embedding(items, 8)

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return self.user(users) @ self.items.weight.T


class HardNegativeSampler:
    def __init__(self, tau: float = 0.05, stable: bool = False) -> None:
        self.tau, self.stable = tau, stable

    @torch.no_grad()
    def sample(self, scores: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
        logits = scores / self.tau
        if self.stable:
            logits = logits - logits.max(-1, keepdim=True).values
        w = torch.exp(logits)  # <origin:sampler_exp>
        w[torch.arange(len(pos)), pos] = 0.0
        return torch.multinomial(w / w.sum(-1, keepdim=True), k)


def _bpr(seed: int, stable: bool) -> Program:
    torch.manual_seed(0)
    model = ScoreModel()
    sampler = HardNegativeSampler(stable=stable)

    def bpr_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        users, pos = batch
        scores = m(users)
        neg = sampler.sample(scores, pos, k=3)
        return -F.logsigmoid(scores.gather(1, pos[:, None]) - scores.gather(1, neg)).mean()

    far = aligned(lambda v: model(v).max(-1).values - 6.0, 10, 1.0, 30.0, seed + 1)
    g = _gen(seed)
    batches = []
    for step in range(N_STEPS):
        users = torch.randn(16, 10, generator=g)
        if step == FAIL_STEP:
            users[2] = far
        batches.append((users, torch.randint(0, 12, (16,), generator=g)))
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, bpr_loss)


@case("hard_negative_sampler_object_exp_overflow_multinomial_raises",
      raised("forward", "aten.exp.default", None, "sampler_exp", "exp_overflow"), raises=RuntimeError)
def _sampler() -> Program:
    return _bpr(1600, stable=False)


# 6b. A collator called inside the step looks pretrained word vectors up (frozen table exported with the
#     tokenizer's vocabulary of 40) and mean-pools them; the tokenizer later gained a special token, id 40, which
#     first occurs in the batch of step FAIL_STEP: F.embedding raises (an id outside the table).
class VectorCollator:
    def __init__(self, vectors: torch.Tensor) -> None:
        self.vectors = vectors

    def __call__(self, token_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = F.embedding(token_ids, self.vectors).mean(1)  # <origin:collate_embedding>
        return feats, labels


@case("collator_in_step_word_vectors_token_added_after_export",
      raised("forward", "aten.embedding.default", None, "collate_embedding", "label_out_of_range"), raises=IndexError)
def _collator() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    collate = VectorCollator(torch.randn(40, 16))

    def loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y = collate(*batch)
        return F.cross_entropy(m(x), y)

    g = _gen(1610)
    batches = []
    for step in range(N_STEPS):
        ids = torch.randint(0, 40, (8, 7), generator=g)
        if step == FAIL_STEP:
            ids[3, 0] = 40  # the new [CLS]-like special token
        batches.append((ids, torch.randint(0, 2, (8,), generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, loss)


# 6c. Deep kernel learning: a GP marginal-likelihood loss OBJECT (its own log lengthscale, outputscale, noise)
#     on a feature extractor's outputs, Matern-1/2 kernel over distances from the expansion
#     |a|^2 + |b|^2 - 2 a.b with the diagonal zeroed (the author knew self-distances round) and
#     ``sqrt(sq + 1e-12)`` (a finite gradient at distance 0) but no clamp. The batch of step FAIL_STEP holds one
#     example twice (sampling with replacement): its off-diagonal square distance rounds negative (below
#     -1e-12), sqrt gives NaN, and torch.linalg.cholesky rejects the kernel.
class FeatureExtractor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ExactGPMarginalLikelihood(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_lengthscale = nn.Parameter(torch.tensor(0.0))
        self.log_outputscale = nn.Parameter(torch.tensor(0.0))
        self.log_noise = nn.Parameter(torch.tensor(-2.0))

    def forward(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sq = (f ** 2).sum(-1)[:, None] + (f ** 2).sum(-1)[None] - 2 * f @ f.T
        sq = sq.fill_diagonal_(0.0)
        r = torch.sqrt(sq + 1e-12)  # <origin:gp_sqrt>
        K = self.log_outputscale.exp() * torch.exp(-r / self.log_lengthscale.exp())
        K = K + self.log_noise.exp() * torch.eye(len(f))
        L = torch.linalg.cholesky(K)
        alpha = torch.cholesky_solve(y[:, None], L)
        return (0.5 * (y[:, None] * alpha).sum() + L.diagonal().log().sum()) / len(y)


def _duplicate_row(model: nn.Module, mll: nn.Module, batches: list[Any], seed: int) -> torch.Tensor:
    """An input row that, put at rows 4 and 9 of the batch of step FAIL_STEP, gives a rounding-negative square
    distance between the two copies, with the parameters the first FAIL_STEP steps leave (found on copies)."""
    model, mll = copy.deepcopy(model), copy.deepcopy(mll)
    opt = torch.optim.Adam([*model.parameters(), *mll.parameters()], lr=1e-4)
    for x, y in batches[:FAIL_STEP]:
        opt.zero_grad()
        mll(model(x), y).backward()
        opt.step()
    g = _gen(seed)
    with torch.no_grad():
        for _ in range(500):
            v = 3 * torch.randn(5, generator=g)
            x = batches[FAIL_STEP][0].clone()
            x[4] = x[9] = v
            f = model(x)
            sq = (f ** 2).sum(-1)[:, None] + (f ** 2).sum(-1)[None] - 2 * f @ f.T
            if float(sq[4, 9]) < -1e-10:
                return v
    raise AssertionError("no rounding-negative duplicate")


@case("gp_marginal_likelihood_loss_object_duplicate_example_sqrt_cholesky_raises",
      raised("forward", "aten.sqrt.default", None, "gp_sqrt", "sqrt_negative"), raises=torch.linalg.LinAlgError)
def _gp() -> Program:
    torch.manual_seed(0)
    model, mll = FeatureExtractor(), ExactGPMarginalLikelihood()
    opt = torch.optim.Adam([*model.parameters(), *mll.parameters()], lr=1e-4)
    g = _gen(1620)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(12, 5, generator=g)
        batches.append((x, torch.sin(x.sum(-1))))
    dup = _duplicate_row(model, mll, batches, 1621)
    x = batches[FAIL_STEP][0]
    x[4] = x[9] = dup  # the same example drawn twice
    batches[FAIL_STEP] = (x, torch.sin(x.sum(-1)))
    return Program(model, opt, batches, lambda m, b, s: mll(m(b[0]), b[1]))


# ================================================================= 7. quiet programs
QUIET: dict[str, Callable[[], Program]] = {}


def quiet_case(name: str) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = build
        return build

    return register


@quiet_case("lbfgs_closure_poisson_softplus_rate_same_glitch")
def _q_lbfgs() -> Program:
    torch.manual_seed(0)
    model = CountRegressor()

    def loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, counts = batch
        rate = F.softplus(m(x))
        return (rate - counts * torch.log(rate + 1e-8)).mean()

    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=4, line_search_fn="strong_wolfe")
    return ClosureProgram(model, opt, _poisson_batches(model, 1300, True), loss)


@quiet_case("loss_object_uncertainty_weights_clamped_mask_count")
def _q_uw() -> Program:
    return _multitask(1400, clamp_count=True)


@quiet_case("diffusion_compute_loss_min_snr_v_prediction_weight")
def _q_diffusion() -> Program:
    return _diffusion(1420, "min_snr_v")


@quiet_case("sparse_autoencoder_hook_kl_clamped_rho_hat")
def _q_sae() -> Program:
    return _sae(1430, clamp=True)


@quiet_case("optimizer_step_pre_hook_row_normalised_with_eps")
def _q_prehook() -> Program:
    return _two_tower(1500, eps=1e-12)


@quiet_case("hard_negative_sampler_max_shifted")
def _q_sampler() -> Program:
    return _bpr(1600, stable=True)


# ======================================================================= the plain runs
def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def plain_run(program: Program) -> dict[str, Any]:
    """Without nantrace, under the op recorder: the first step whose loss (any closure evaluation), gradients or
    (after the update) parameters / state are non-finite, or that raised."""
    model, opt = program.model, program.optimizer
    rec = Made()
    out = dict(step=None, what=None, error=None, rec=rec, evaluation=None)
    closure_mode = isinstance(program, ClosureProgram)
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            bad: dict[str, Any] = {}
            try:
                if closure_mode:
                    calls = [0]

                    def closure() -> torch.Tensor:
                        opt.zero_grad()
                        loss = program.loss(model, batch, step)
                        loss.backward()
                        calls[0] += 1
                        if not math.isfinite(float(loss)) and "loss" not in bad:
                            bad["loss"] = calls[0]
                        return loss

                    opt.step(closure)
                    if bad:
                        out.update(step=step, what="loss", evaluation=bad["loss"])
                        return out
                else:
                    opt.zero_grad()
                    loss = run_step(program, program.loss, batch, step)
                    if not math.isfinite(float(loss.detach().sum())):
                        out.update(step=step, what="loss")
                        return out
                    if not _finite(p.grad for p in model.parameters() if p.grad is not None):
                        out.update(step=step, what="grads")
                        return out
                    opt.step()
                    if program.scheduler is not None:
                        program.scheduler.step()
            except Exception as exc:  # noqa: BLE001
                out.update(step=step, what="raised", error=exc)
                return out
            params = [p for group in opt.param_groups for p in group["params"]]
            if not _finite(params):
                out.update(step=step, what="params")
                return out
            if not _state_finite(opt):
                out.update(step=step, what="state")
                return out
    return out


WHAT = {"nonfinite_param": "params", "optimizer_state": "state", "nonfinite_grad": "grads", "nonfinite_loss": "loss",
        "exception": "raised"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails at the expected step in the expected stage (or raises
    the expected exception there); nothing non-finite is made before that step; the first op that made a
    non-finite value from finite inputs at that step is the expected origin (for an optimizer-phase case, after
    finite gradients; for the L-BFGS cases, at the closure's first evaluation of the step)."""
    build, want = CASES[name]
    program = build()
    run = plain_run(program)
    rec = run["rec"]
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), (run["step"], run["what"], run["error"])
    assert not [m for m in rec.made if m[0] < want.step], rec.made[:4]
    if isinstance(program, ClosureProgram):
        assert run["evaluation"] == 1, run["evaluation"]
    if want.kind == "exception":
        assert type(run["error"]) is RAISES[name], repr(run["error"])
        if want.cause == "label_out_of_range":
            assert "out of range" in str(run["error"]) and not rec.made, (run["error"], rec.made)
            return
    assert rec.first(want.step, want.phase == "optimizer") == want.op, rec.made[:6]


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train_any(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
    if want.kind == "exception":  # the user's own exception, unchanged
        assert type(run.error) is RAISES[name] and run.error_step == want.step, (repr(run.error), run.error_step)
    else:
        assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    run = plain_run(QUIET[name]())
    assert run["step"] is None and not run["rec"].made, (run["step"], run["what"], run["error"], run["rec"].made[:4])


@pytest.mark.parametrize("name,mode", case_params(QUIET, {}))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident that blocks an update, and the program trains to its end."""
    run = train_any(QUIET[name](), replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert run.error is None, repr(run.error)


# ======================================================================= 2-3. real framework trainers
@dataclasses.dataclass
class FWant:
    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    cause: str
    step: int = FAIL_STEP
    action: str = "skipped"


FW: dict[str, tuple[Callable[..., Outcome], FWant | None]] = {}
"""name -> (run(tmp, watch) -> Outcome, the expected diagnosis; None for a quiet program)."""
FW_XFAIL: dict[str, str] = {}
"""name -> why nantrace is still wrong on it (a strict xfail)."""


def fw_case(name: str, want: FWant | None) -> Callable:
    def register(run: Callable[..., Outcome]) -> Callable[..., Outcome]:
        assert name not in FW, name
        FW[name] = (run, want)
        return run

    return register


def _fw_where(source: str | None) -> Any:
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    if path and os.path.exists(path) and os.path.samefile(path, HERE):
        return os.path.basename(HERE), int(line)
    return source


def fw_want(want: FWant) -> dict[str, Any]:
    line = (os.path.basename(HERE), origin_line(HERE, want.tag)) if want.tag is not None else None
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=line)


def fw_got(incidents: list[Any]) -> dict[str, Any] | None:
    main = [i for i in incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=_fw_where(inc.source))


def _hf() -> Any:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nantrace[hf]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'nantrace[hf]')")
    import transformers

    return transformers


def _pl() -> Any:
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'nantrace[lightning]')")
    import lightning as L

    return L


# HF. A tiny BertForSequenceClassification built from a config, distilled from stored soft labels (a teacher
#     ensemble's probabilities in the dataset) by a Trainer subclass whose compute_loss adds a hand-written
#     KL(teacher || student) = sum t * (log t - log p). The batch of step FAIL_STEP comes from a rule-based
#     annotator whose soft labels are one-hot: log(0) = -inf and 0 * -inf = NaN.
def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16, num_labels=3)
    return BertForSequenceClassification(cfg)


def _distill_trainer(safe: bool) -> Any:
    transformers = _hf()

    class DistillationTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            soft = inputs.pop("soft_labels")
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logp = F.log_softmax(outputs.logits, -1)
            if safe:
                kd = F.kl_div(logp, soft, reduction="batchmean")
            else:
                kd = (soft * (torch.log(soft) - logp)).sum(-1).mean()  # <origin:hf_kd_log>
            loss = 0.5 * F.cross_entropy(outputs.logits, labels) + 0.5 * kd
            return (loss, outputs) if return_outputs else loss

    return DistillationTrainer


def _hf_distill(tmp: Path, watch: bool, safe: bool) -> Outcome:
    bs = 4

    def row(i: int) -> dict[str, Any]:
        g = _gen(1700 + i)
        label = i % 3
        if i // bs == FAIL_STEP:  # the rule-based annotator's examples
            soft = F.one_hot(torch.tensor(label), 3).float()
        else:
            soft = torch.softmax(torch.randn(3, generator=g) + 2.0 * F.one_hot(torch.tensor(label), 3), -1)
        return {"input_ids": torch.randint(5, 60, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": torch.tensor(label), "soft_labels": soft}

    args = hf_args(tmp, per_device_train_batch_size=bs, max_steps=N_STEPS)
    return hf_fit(_distill_trainer(safe), _bert(), args, Rows(row, N_STEPS * bs), watch, FAIL_STEP)


@fw_case("hf_trainer_compute_loss_handwritten_kd_one_hot_soft_labels",
         FWant("nonfinite_loss", "forward", "aten.log.default", None, "hf_kd_log", "log_nonpositive"))
def _hf_kd(tmp: Path, watch: bool) -> Outcome:
    return _hf_distill(tmp, watch, safe=False)


@fw_case("quiet_hf_trainer_compute_loss_kl_div_one_hot_soft_labels", None)
def _hf_kd_quiet(tmp: Path, watch: bool) -> Outcome:
    return _hf_distill(tmp, watch, safe=True)


def pl_fit(model: Any, batches: list[Any], tmp: Path, watch: bool, fail: int, user_callbacks: list[Any] = (),
           max_steps: int = N_STEPS) -> Outcome:
    """Round 8b's ``pl_fit`` with the user's own callbacks (listed before nantrace's, as a script appends it)."""
    L = _pl()
    from nantrace.integrations.lightning import NanTraceCallback

    log = Log()
    manual = not model.automatic_optimization

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.after: dict[int, list[torch.Tensor]] = {}
            self.watched: list[torch.Tensor] = []
            self.handle: Any = None

        def on_fit_start(self, trainer, pl_module) -> None:
            opt = trainer.optimizers[0]
            self.watched = [p for group in opt.param_groups for p in group["params"]]
            self.after[-1] = self.after[0] = [p.detach().clone() for p in self.watched]
            if not watch:
                self.handle = opt.register_step_post_hook(lambda *_: log.stepped(self.watched))
                step = opt.step

                def checked_step(closure: Any = None, **kw: Any) -> Any:
                    def run_closure() -> Any:
                        out = closure() if closure is not None else None
                        log.grads(self.watched)
                        return out

                    return step(run_closure, **kw)

                opt.step = checked_step

        def on_fit_end(self, trainer, pl_module) -> None:
            if self.handle is not None:
                self.handle.remove()
                del trainer.optimizers[0].step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.after[batch_idx if manual else trainer.global_step] = [p.detach().clone() for p in self.watched]

    class LossRecorder(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if not watch and self_watched()[0].requires_grad:
                log.loss(loss)

    cb = NanTraceCallback(config=nantrace.Config(outputs={"print_incidents": False}))
    recorder = Recorder()
    self_watched = lambda: recorder.watched  # noqa: E731
    callbacks = [*user_callbacks, LossRecorder(), recorder] + ([cb] if watch else [])
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=callbacks, default_root_dir=str(tmp))
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    error = None
    try:
        if watch:
            trainer.fit(model, loader)
        else:
            with log.rec:
                trainer.fit(model, loader)
    except Exception as exc:
        error = exc
    at = recorder.after
    after, before = (fail, fail - 1) if manual else (fail + 1, fail)
    unchanged = same(at[after], at[before]) if after in at and before in at else None
    return Outcome(list(cb.incidents), error, unchanged, log)


# PL 1. A GAN under manual optimisation (generator's optimizer first: the watched one) with a mode-seeking
#     regulariser (Mao et al. 2019) in the generator's loss: lz = mean|G(z2) - G(z1)| / mean|z2 - z1|, and
#     1 / (lz + 1e-5). The latent pairs of step FAIL_STEP come from a generator reseeded with the same seed for
#     both draws: z2 == z1, lz = 0 / 0.
def _pl_gan_model() -> Any:
    L = _pl()

    class MSGAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 6))
            self.discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            real, z1, z2 = batch
            opt_g, opt_d = self.optimizers()

            self.toggle_optimizer(opt_g)
            fake1, fake2 = self(z1), self(z2)
            adv = F.binary_cross_entropy_with_logits(self.discriminator(fake1), torch.ones(len(z1), 1))
            lz = torch.mean(torch.abs(fake2 - fake1)) / torch.mean(torch.abs(z2 - z1))  # <origin:pl_ms_div>
            g_loss = adv + 0.1 * (1 / (lz + 1e-5))
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

            self.toggle_optimizer(opt_d)
            d_real = self.discriminator(real)
            d_fake = self.discriminator(fake1.detach())
            d_loss = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + \
                F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))]

    return MSGAN()


@fw_case("pl_manual_gan_mode_seeking_term_identical_latent_pair",
         FWant("nonfinite_loss", "forward", "aten.div.Tensor", None, "pl_ms_div", "div_by_zero"))
def _pl_msgan(tmp: Path, watch: bool) -> Outcome:
    model = _pl_gan_model()
    g = _gen(1800)
    batches = []
    for step in range(N_STEPS):
        z1 = torch.randn(8, 4, generator=g)
        z2 = z1.clone() if step == FAIL_STEP else torch.randn(8, 4, generator=g)
        batches.append((torch.randn(8, 6, generator=g) + 1.0, z1, z2))
    return pl_fit(model, batches, tmp, watch, FAIL_STEP, max_steps=2 * N_STEPS)  # both optimizers' steps count


# PL 2. A mixture-of-experts classifier (automatic optimisation) and a user Callback whose on_before_backward
#     adds a router-entropy bonus to the loss in place, -(p * log p).sum(); the router's softmax is kept on the
#     module by its forward. The batch of step FAIL_STEP carries an unscaled record (x300): the router logits are
#     hundreds apart, a gate probability underflows to exactly 0, log(0) = -inf and 0 * -inf = NaN.
def _pl_moe_model() -> Any:
    L = _pl()

    class MoEClassifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.router = nn.Linear(8, 4)
            self.experts = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
                                          for _ in range(4)])
            self.last_gate: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate = torch.softmax(self.router(x), -1)
            self.last_gate = gate
            out = torch.stack([e(x) for e in self.experts], 1)
            return (gate.unsqueeze(-1) * out).sum(1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return MoEClassifier()


def _router_entropy_callback(safe: bool) -> Any:
    L = _pl()

    class RouterEntropyBonus(L.Callback):
        def __init__(self, weight: float = 0.01) -> None:
            self.weight = weight

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            p = pl_module.last_gate
            if safe:
                entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(-1).mean()
            else:
                entropy = -(p * torch.log(p)).sum(-1).mean()  # <origin:pl_cb_log>
            loss.sub_(self.weight * entropy)

    return RouterEntropyBonus()


def _pl_moe(tmp: Path, watch: bool, safe: bool) -> Outcome:
    model = _pl_moe_model()
    g = _gen(1810)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(16, 8, generator=g)
        if step == FAIL_STEP:
            x[6] = 300.0 * torch.randn(8, generator=g)
        batches.append((x, torch.randint(0, 3, (16,), generator=g)))
    return pl_fit(model, batches, tmp, watch, FAIL_STEP, user_callbacks=[_router_entropy_callback(safe)])


@fw_case("pl_callback_on_before_backward_router_entropy_gate_underflow",
         FWant("nonfinite_loss", "forward", "aten.log.default", None, "pl_cb_log", "log_nonpositive"))
def _pl_cb(tmp: Path, watch: bool) -> Outcome:
    return _pl_moe(tmp, watch, safe=False)


@fw_case("quiet_pl_callback_on_before_backward_router_entropy_clamped_log", None)
def _pl_cb_quiet(tmp: Path, watch: bool) -> Outcome:
    return _pl_moe(tmp, watch, safe=True)


def _fw_params(names: list[str]) -> list[Any]:
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=FW_XFAIL[n])] if n in FW_XFAIL else [], id=n)
            for n in names]


@pytest.mark.parametrize("name", list(FW))
def test_framework_construction(name: str, tmp_path: Path) -> None:
    """Without nantrace: the first non-finite value appears at the expected step in the expected stage, made by
    the expected op (nothing before); a quiet program stays finite to its end."""
    run, want = FW[name]
    out = run(tmp_path, False)
    log = out.log
    bad = sorted(s for d in (log.loss_bad, log.grad_bad, log.param_bad) for s, v in d.items() if v)
    if want is None:
        assert out.error is None and not bad and not log.rec.made, (out.error, bad, log.rec.made[:4])
        return
    assert out.error is None, repr(out.error)
    assert bad and bad[0] == want.step and log.loss_bad.get(want.step), (bad, log.losses)
    assert not [m for m in log.rec.made if m[0] < want.step], log.rec.made[:4]
    assert log.rec.first(want.step, False) == want.op, log.rec.made[:6]


@pytest.mark.parametrize("name", _fw_params(list(FW)))
def test_framework_diagnosis(name: str, tmp_path: Path) -> None:
    run, want = FW[name]
    out = run(tmp_path, True)
    if want is None:
        blocking = [describe(i) + " | " + i.summary for i in out.incidents if i.action != "logged"]
        assert not blocking and out.error is None, (blocking, repr(out.error))
        return
    got = fw_got(out.incidents)
    assert got is not None, ("no incident", repr(out.error))
    assert got == fw_want(want), [describe(i) + " | " + i.summary for i in out.incidents]
    assert out.error is None, repr(out.error)
    assert out.unchanged is True, "the blocked step changed the weights"
