"""Held-out failures, round 16b: patterns from PUBLIC BUG REPORTS about NaN/Inf in PyTorch training, each
rebuilt as a small stand-alone program (model class, loss, loop data) shaped like the reporter's, the
report's URL in the case's comment (no code copied). Reports whose bug torch has since fixed (atan2 / angle /
``x.norm()`` / ``std`` / ``cdist`` gradients at 0, ``0 ** p``) were checked on this torch (2.13) and left out.
Most cases are ones where the op that shows the NaN is not the cause:

1. EvoNorm-B0's instance variance over a 1x1 feature map (unbiased ``var`` of one element), in the model;
2. ``eps`` too small for fp16: ``F.normalize``'s default 1e-12 and BERT's hand-written LayerNorm 1e-12 in a
   pure-fp16 model (the eps rounds to 0; finite in float32);
3. ``cross_entropy(weight=...)`` whose crop holds only the zero-weighted class (0 / 0 in ``nll_loss2d``);
4. Kabsch RMSD on a linear molecule: ``linalg.svd`` with repeated zero singular values (NaN only in backward);
5. a Beta policy scored on an action the environment wrapper clipped to the bound (``xlogy(b-1, 0) = -inf``);
6. NaN "fixed" after the fact: attention pooling whose fully padded row is zeroed with ``nan_to_num`` after the
   softmax (forward finite, the NaN weights leak into the backward), and a relative error whose zero-target
   entries are overwritten by index assignment (``x / 0`` then ``y[mask] = 0``);
7. an end-point error written with ``torch.hypot`` on sparse ground truth (hypot's derivative at (0, 0));
8. QUIET programs: the fix each thread settled on, on the same data; no incident at all.

How expectations were derived: each expectation (kind, phase, ATen op, module, ``# <origin:TAG>`` line, cause,
step) was written from the construction before nantrace ran, following /work/shared/API.md and
docs/diagnosis.md and the conventions of earlier rounds: a NaN made in the forward and hidden by a mask or a
``where`` is kind ``nonfinite_grad``, phase ``forward``, the op that made it, cause ``where_gradient_trap``
(r4's ``where_bce_unselected_log_of_zero``), except a fully masked softmax, whose own cause
``masked_softmax_all`` names what made the NaN (6a: corrected after the run, see its comment); a derivative singular at a finite forward is phase ``backward``,
``grad_singularity`` (r6's eigh case); an unbiased spread of one element is ``zero_variance_norm`` (the PPO
minibatch-of-one case); a value finite in float32 and non-finite in fp16 is ``precision_overflow``; an empty
weighted mean is ``div_by_zero``; module ``None`` for ops outside the watched model. The constructions were
checked WITHOUT nantrace by ``test_cases_fail_without_nantrace``: the plain loop fails first at the expected
step in the expected way, and an independent ``TorchDispatchMode`` (``FirstNonFinite``) names the expected
forward op, module and line, or (backward origins) the forward is finite and the first autograd node whose
outputs turn non-finite from finite incoming gradients is the expected node.

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

from heldout_harness import Judge, Program, case_params, describe, run_step, sgd, steps, train, assert_diagnosis
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


# ======================================================================= 1. EvoNorm-B0 on a 1x1 feature map
# https://github.com/digantamisra98/EvoNorm/pull/5 ("torch.var(x) returns NaN when x is a scalar ... width =
# channel = 1"), https://github.com/pytorch/pytorch/issues/29372 (std/var of one element is NaN, unbiased).
# A small CNN with EvoNorm-B0 after each strided conv, trained with multi-scale crops: the crops of step 3 are
# 4x4, so the second stage's map is 1x1 and the instance variance over (H, W) divides 0 by n - 1 = 0.
class EvoNormB0(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-5, unbiased: bool = True) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.v = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.eps, self.unbiased = eps, unbiased

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_var = x.var(dim=(0, 2, 3), keepdim=True, unbiased=False)
        inst_var = x.var(dim=(2, 3), keepdim=True, unbiased=self.unbiased)  # <origin:evonorm_var>
        den = torch.maximum((batch_var + self.eps).sqrt(), self.v * x + (inst_var + self.eps).sqrt())
        return x / den * self.gamma + self.beta


class EvoCNN(nn.Module):
    def __init__(self, unbiased: bool = True) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(3, 8, 3, 2, 1), EvoNormB0(8, unbiased=unbiased)
        self.conv2, self.norm2 = nn.Conv2d(8, 16, 3, 2, 1), EvoNormB0(16, unbiased=unbiased)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm2(self.conv2(self.norm1(self.conv1(x))))
        return self.head(x.mean((2, 3)))


def _evo_program(unbiased: bool) -> Program:
    torch.manual_seed(0)
    model = EvoCNN(unbiased)
    g = _gen(1601)

    def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 3, size, size, generator=g), torch.randint(0, 5, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, 4)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@case("evonorm_b0_instance_variance_multiscale_crop_one_pixel_map",
      Want("nonfinite_loss", "forward", "aten.var.correction", "norm2", "evonorm_var", "zero_variance_norm"))
def _evo() -> Program:
    return _evo_program(True)


# ======================================================================= 2. eps too small for fp16
# 2a. https://github.com/pytorch/pytorch/issues/32137 ("F.normalize epsilon too small for half precision"): a
#     CLIP-style dual encoder trained in pure fp16 (model.half()); the text tower mean-pools token embeddings
#     (padding_idx 0) and projects without bias, so an empty caption's feature is exactly 0; F.normalize's
#     default eps=1e-12 is 0 in fp16, and the feature is 0 / 0. In float32 it is 0 / 1e-12 = 0.
class TextTower(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, eps: float = 1e-12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.proj = nn.Linear(d, d, bias=False)
        self.eps = eps

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(self.proj(pooled), dim=-1, eps=self.eps)  # <origin:clip_normalize>


class DualEncoder(nn.Module):
    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 16))
        self.text = TextTower(eps=eps)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        img = F.normalize(self.image(images), dim=-1, eps=self.text.eps)
        return self.logit_scale.exp() * img @ self.text(ids).t()


def clip_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    images, ids = batch
    logits = model(images, ids).float()
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _clip_program(eps: float) -> Program:
    torch.manual_seed(0)
    model = DualEncoder(eps).half()
    g = _gen(1602)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 50, (8, 6), generator=g)
        ids[:, 4:] = 0
        if empty:
            ids[5] = 0  # a caption emptied by the text cleaner
        return torch.randn(8, 24, generator=g).half(), ids

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)), clip_loss)


@case("clip_pure_fp16_normalize_default_eps_empty_caption",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "text", "clip_normalize", "precision_overflow"))
def _clip() -> Program:
    return _clip_program(1e-12)


# 2b. https://github.com/pytorch/pytorch/issues/41527 and https://github.com/wenet-e2e/wenet/pull/907 (layer norm
#     eps=1e-12 gives NaN for an all-zero row in fp16): a bag-of-tokens encoder with the original BERT
#     LayerNorm written by hand (eps 1e-12 inside the sqrt), run in pure fp16. Only the last length bucket
#     (step 3) is padded; a padding position's embedding is the zero row, its variance 0, and 0 / sqrt(0 + 0).
class BertLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)  # <origin:bert_ln>
        return self.weight * x + self.bias


class BagEncoder(nn.Module):
    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        self.embed = nn.Embedding(60, 16, padding_idx=0)
        self.norm = BertLayerNorm(16, eps)
        self.ff = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.cls = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        h = h + self.ff(h)
        mask = (ids != 0).unsqueeze(-1).to(h.dtype)
        return self.cls((h * mask).sum(1) / mask.sum(1))


def _bert_ln_program(eps: float) -> Program:
    torch.manual_seed(0)
    model = BagEncoder(eps).half()
    g = _gen(1603)

    def batch(step: int, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 60, (8, 10), generator=g)
        if padded:
            ids[:, 7:] = 0
        return ids, torch.randint(0, 3, (8,), generator=g)

    return Program(model, sgd(model, 1e-2), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]).float(), b[1]))


@case("bert_hand_written_layernorm_eps_1e12_pure_fp16_padded_bucket",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "norm", "bert_ln", "precision_overflow"))
def _bert_ln() -> Program:
    return _bert_ln_program(1e-12)


# ======================================================================= 3. class weights of a void class
# https://github.com/holgerroth/3Dunet_abdomen_cascade/issues/3 ("sum of pixel-wise loss weights is zero" for a
# patch with a single class), https://github.com/nvidia-cosmos/cosmos-rl/pull/155 (all targets without weight:
# cross_entropy divides by zero). A segmentation net trained with class weights whose "void" class 0 weighs 0;
# the random crop of step 3 falls outside the annotated area: every pixel is void, the weighted mean is 0 / 0.
class TinySegNet(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.classifier = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.body(x))


CLASS_WEIGHTS = torch.tensor([0.0, 1.0, 2.0, 4.0])


def weighted_seg_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    images, masks = batch
    return F.cross_entropy(model(images), masks, weight=CLASS_WEIGHTS)  # <origin:seg_ce>


def safe_weighted_seg_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    images, masks = batch
    per_pixel = F.cross_entropy(model(images), masks, weight=CLASS_WEIGHTS, reduction="none")
    return per_pixel.sum() / CLASS_WEIGHTS[masks].sum().clamp(min=1.0)


def _seg_program(loss: Callable) -> Program:
    torch.manual_seed(0)
    model = TinySegNet()
    g = _gen(1604)

    def batch(step: int, void: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        masks = torch.zeros(2, 8, 8, dtype=torch.long) if void else torch.randint(0, 4, (2, 8, 8), generator=g)
        return torch.randn(2, 3, 8, 8, generator=g), masks

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), loss)


@case("segmentation_class_weighted_ce_crop_outside_annotation_all_void",
      Want("nonfinite_loss", "forward", "aten.nll_loss2d_forward.default", None, "seg_ce", "div_by_zero"))
def _seg() -> Program:
    return _seg_program(weighted_seg_loss)


# ======================================================================= 4. Kabsch on a linear molecule
# https://github.com/pytorch/pytorch/issues/49886 ("SVD backward isn't correctly defined when multiple 0
# eigenvalues"). A coordinate regressor scored by the RMSD after Kabsch alignment (the SVD of the 3x3
# cross-covariance). The molecule of step 3 is linear and stored along the x axis (CO2-like, y = z = 0): the
# covariance has rank 1, two singular values are exactly 0, and the SVD's backward divides by s_i^2 - s_j^2 = 0.
# The forward (and the loss) is finite.
class CoordRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.atom = nn.Sequential(nn.Linear(6, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.coord = nn.Linear(32, 3)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.coord(self.atom(feats))


def kabsch_rmsd(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    feats, target = batch
    pred = model(feats)
    p, q = pred - pred.mean(0), target - target.mean(0)
    u, s, vh = torch.linalg.svd(p.t() @ q)  # <origin:kabsch_svd>
    rot = vh.t() @ u.t()
    return ((p @ rot.t() - q) ** 2).sum(-1).mean().sqrt()


def _kabsch_steps(linear: Callable[[int], Any]) -> list[Any]:
    g = _gen(1605)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)

    return _steps(batch, linear)


def _linear_molecule(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(16050)
    target = torch.zeros(3, 3)
    target[:, 0] = torch.tensor([-1.16, 0.0, 1.16])
    return torch.randn(3, 6, generator=g), target


@case("kabsch_rmsd_svd_linear_molecule_repeated_zero_singular_values",
      Want("nonfinite_grad", "backward", "aten._linalg_svd.default", None, "kabsch_svd", "grad_singularity"))
def _kabsch() -> Program:
    torch.manual_seed(0)
    model = CoordRegressor()
    return Program(model, sgd(model), _kabsch_steps(_linear_molecule), kabsch_rmsd)


# ======================================================================= 5. Beta policy at the bound
# https://github.com/pytorch/pytorch/issues/92260 ("distributions.Beta returning incorrect results at 0 and 1"),
# https://github.com/tensorforce/tensorforce/issues/94 (Beta policy NaN in PPO). An actor-critic with a Beta
# policy over a throttle in [0, 1]; the environment wrapper clips the actions it executes and the rollout stores
# the clipped ones. Step 3's rollout holds an action clipped to exactly 1.0: log_prob's xlogy(beta - 1, 1 - a)
# is log(0) = -inf and the policy-gradient loss is infinite.
class BetaActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.conc = nn.Linear(32, 2)
        self.value = nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        c = F.softplus(self.conc(h)) + 1.0
        return c[:, 0], c[:, 1], self.value(h).squeeze(-1)


def beta_a2c_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, returns = batch
    alpha, beta, value = model(obs)
    adv = (returns - value).detach()
    logp = torch.distributions.Beta(alpha, beta).log_prob(actions)  # <origin:beta_logp>
    return -(logp * adv).mean() + 0.5 * F.mse_loss(value, returns)


def beta_a2c_loss_clamped(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, returns = batch
    alpha, beta, value = model(obs)
    adv = (returns - value).detach()
    logp = torch.distributions.Beta(alpha, beta).log_prob(actions.clamp(1e-6, 1 - 1e-6))
    return -(logp * adv).mean() + 0.5 * F.mse_loss(value, returns)


def _beta_program(loss: Callable) -> Program:
    torch.manual_seed(0)
    model = BetaActorCritic()
    g = _gen(1606)

    def batch(step: int, at_bound: bool = False) -> tuple[torch.Tensor, ...]:
        raw = torch.rand(16, generator=g) * 0.8 + 0.1
        if at_bound:
            raw[6] = 1.3  # the executed action, clipped by the wrapper
        returns = torch.rand(16, generator=g) + 1.0
        return torch.randn(16, 8, generator=g), raw.clamp(0.0, 1.0), returns

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), loss)


@case("beta_policy_env_wrapper_clipped_action_exactly_one_log_prob",
      Want("nonfinite_loss", "forward", "aten.xlogy.Tensor", None, "beta_logp", "log_nonpositive"))
def _beta() -> Program:
    return _beta_program(beta_a2c_loss)


# ======================================================================= 6. NaN "fixed" after it was made
# 6a. https://github.com/pytorch/pytorch/issues/24816 (an all-padded sequence gives NaN; "I tried
#     output[torch.isnan(output)] = 0 but it wasn't helpful"), https://github.com/pytorch/pytorch/issues/41508
#     (the NaN rows are cut from the loss and still poison the gradients). A review classifier with additive
#     attention pooling masked with -inf; the batch of step 3 holds a review emptied by the cleaner. Its weights
#     are 0/0 = NaN; the model zeroes the NaN pooled vector with nan_to_num, so the loss is finite, but the
#     backward of the weighted sum multiplies the NaN weights by the (zero) gradient: NaN gradients.
#     Cause: first written as where_gradient_trap (the NaN hidden by nan_to_num); corrected to masked_softmax_all,
#     which is what made the NaN (a softmax over a row that is entirely -inf, the contract's definition word for
#     word) and what the thread's fix addresses (mask before the softmax); nan_to_num selects no branch, it only
#     overwrote the result (src/nantrace/diagnosis/classify.py keeps the softmax's own cause wherever its NaN went).
class AttentionPool(nn.Module):
    def __init__(self, d: int, safe: bool = False) -> None:
        super().__init__()
        self.score = nn.Linear(d, 1)
        self.safe = safe

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.score(h).squeeze(-1)
        if self.safe:  # the fix: a finite fill, and empty rows dropped by a 0/1 factor after pooling
            w = scores.masked_fill(~mask, -1e9).softmax(-1)
            return (w.unsqueeze(-1) * h).sum(1) * mask.any(-1, keepdim=True).to(h.dtype)
        w = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # <origin:pool_softmax>
        pooled = (w.unsqueeze(-1) * h).sum(1)
        return torch.nan_to_num(pooled)


class ReviewClassifier(nn.Module):
    def __init__(self, safe: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(80, 16, padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.pool = AttentionPool(16, safe)
        self.cls = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.cls(self.pool(self.encoder(self.embed(ids)), ids != 0))


def _review_program(safe: bool) -> Program:
    torch.manual_seed(0)
    model = ReviewClassifier(safe)
    g = _gen(1607)

    def batch(step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 80, (8, 12), generator=g)
        ids[:, 9:] = 0
        if empty:
            ids[2] = 0
        return ids, torch.randint(0, 2, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


@case("review_attention_pool_empty_review_nan_to_num_after_pooling",
      Want("nonfinite_grad", "forward", "aten._softmax.default", "pool", "pool_softmax", "masked_softmax_all"))
def _review() -> Program:
    return _review_program(False)


# 6b. https://github.com/pytorch/pytorch/issues/4132 ("x.grad should be 0 but get NaN after x/0": y = x / div;
#     y[div == 0] = 0). An hourly energy forecaster trained on the relative error; hours whose metered load is
#     0 (a plant shut down, step 3) are meant to be excluded by overwriting their ratio with 0. The forward is
#     finite; the division's derivative at the excluded entries is 0 / 0 in the backward.
class LoadForecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def relative_error_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, load = batch
    pred = model(x)
    rel = (pred - load).abs() / load  # <origin:rel_div>
    rel[load == 0] = 0.0
    return rel.mean()


def relative_error_loss_safe(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, load = batch
    pred = model(x)
    metered = load != 0
    return ((pred - load).abs()[metered] / load[metered]).mean()


def _load_program(loss: Callable) -> Program:
    torch.manual_seed(0)
    model = LoadForecaster()
    g = _gen(1608)

    def batch(step: int, shutdown: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        load = torch.rand(16, 4, generator=g) * 5 + 1
        if shutdown:
            load[3:6] = 0.0
        return torch.randn(16, 12, generator=g), load

    return Program(model, sgd(model, 1e-3), _steps(batch, lambda s: batch(s, True)), loss)


@case("energy_forecast_relative_error_zero_load_overwritten_by_index_assignment",
      Want("nonfinite_grad", "forward", "aten.div.Tensor", None, "rel_div", "where_gradient_trap"))
def _load() -> Program:
    return _load_program(relative_error_loss)


# ======================================================================= 7. end-point error with hypot
# https://github.com/pytorch/pytorch/issues/2421 (gradient of a zero norm is NaN; the subgradient fix went into
# norm, not into hypot), https://github.com/pytorch/pytorch/issues/6394. An optical-flow net trained on dense
# synthetic flow, then (step 3) on a sparse-ground-truth sample (KITTI-style valid mask); the EPE is computed on
# the masked difference, so invalid pixels are (0, 0) and hypot's derivative there is 0 / 0 in the backward.
class FlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(6, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.flow = nn.Conv2d(16, 2, 3, padding=1)

    def forward(self, img1: torch.Tensor, img2: torch.Tensor) -> torch.Tensor:
        return self.flow(self.enc(torch.cat([img1, img2], 1)))


def epe_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    img1, img2, flow_gt, valid = batch
    diff = (model(img1, img2) - flow_gt) * valid[:, None]
    epe = torch.hypot(diff[:, 0], diff[:, 1])  # <origin:epe_hypot>
    return epe.sum() / valid.sum()


def epe_loss_selected(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    img1, img2, flow_gt, valid = batch
    diff = (model(img1, img2) - flow_gt).permute(0, 2, 3, 1)[valid.bool()]
    return torch.hypot(diff[:, 0], diff[:, 1]).mean()


def _flow_program(loss: Callable) -> Program:
    torch.manual_seed(0)
    model = FlowNet()
    g = _gen(1609)

    def batch(step: int, sparse: bool = False) -> tuple[torch.Tensor, ...]:
        valid = (torch.rand(2, 8, 8, generator=g) < 0.3).float() if sparse else torch.ones(2, 8, 8)
        return (torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 3, 8, 8, generator=g),
                torch.randn(2, 2, 8, 8, generator=g), valid)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), loss)


@case("optical_flow_epe_hypot_sparse_ground_truth_masked_difference",
      Want("nonfinite_grad", "backward", "aten.hypot.default", None, "epe_hypot", "grad_singularity"))
def _flow() -> Program:
    return _flow_program(epe_loss)


# ======================================================================= 8. quiet programs (the threads' fixes)
@quiet("evonorm_b0_biased_instance_variance_multiscale_crop_one_pixel_map")
def _evo_quiet() -> Program:
    return _evo_program(False)  # EvoNorm PR #5's outcome: a variance of one element is 0, not NaN


@quiet("clip_pure_fp16_normalize_eps_1e4_empty_caption")
def _clip_quiet() -> Program:
    return _clip_program(1e-4)  # pytorch#32137: an eps fp16 can hold


@quiet("bert_layernorm_eps_1e5_pure_fp16_padded_bucket")
def _bert_quiet() -> Program:
    return _bert_ln_program(1e-5)  # wenet#907: eps 1e-5


@quiet("segmentation_weighted_ce_clamped_total_weight_all_void_crop")
def _seg_quiet() -> Program:
    return _seg_program(safe_weighted_seg_loss)


@quiet("beta_policy_actions_clamped_inside_open_interval")
def _beta_quiet() -> Program:
    return _beta_program(beta_a2c_loss_clamped)


@quiet("review_attention_pool_finite_fill_empty_review")
def _review_quiet() -> Program:
    return _review_program(True)


@quiet("energy_forecast_relative_error_selected_before_division")
def _load_quiet() -> Program:
    return _load_program(relative_error_loss_safe)


@quiet("optical_flow_epe_on_selected_valid_pixels")
def _flow_quiet() -> Program:
    return _flow_program(epe_loss_selected)


@quiet("kabsch_rmsd_nonlinear_molecules")
def _kabsch_quiet() -> Program:
    torch.manual_seed(0)
    model = CoordRegressor()
    g = _gen(16051)
    return Program(model, sgd(model), _kabsch_steps(lambda s: (torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g))),
                   kabsch_rmsd)


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
        out = func(*args, **kwargs)
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
        loss = run_step(program, program.loss, batch, step)
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


WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads"}
BACKWARD_NODE = {"aten._linalg_svd.default": "LinalgSvdBackward0", "aten.hypot.default": "HypotBackward0"}


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
