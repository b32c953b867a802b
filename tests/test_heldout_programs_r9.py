"""Held-out failures, round 9: the mechanisms nantrace gained in round 8 (backward() itself raising,
parameters written through ``.data`` between steps, unusable GradScaler scales, the code between two
micro-batches of an accumulation, models run inside ``torch.func`` transforms, torch's fused fast paths,
layers run one by one from the loss code), each where it must fire and where it must NOT, and program
classes not yet covered (an expert-choice and a top-2 mixture-of-experts router, LSQ quantisation-aware
training with a pruned channel, a LoRA rank sweep with r = 0, a GAN with an R1 penalty written as a norm,
a seq2seq model with teacher forcing and label smoothing).

1. ``backward()`` raises: anomaly mode (``detect_anomaly``) stopping the engine at the first node that returns
   NaN, whose name is NOT the origin (a Charbonnier loss with eps = 0: ``PowBackward0`` is named, sqrt's
   infinite derivative at 0 is first; velocity features of a duplicated video frame under gradient
   accumulation: the squares' ``PowBackward0`` is named, the ``** 0.5`` is first); anomaly mode switched on
   to hunt a FORWARD NaN (a masked mean of an empty review: the loss is NaN and anomaly mode then raises in
   the backward: the origin is the forward division); a user's "refuse non-finite gradients" hook on every
   parameter meeting a ``torch.where`` gradient trap (``0 log 0`` guarded by ``where`` in an entropy bonus).
   Must NOT fire: a backward error that is no value's (a variance capped in place after ``exp`` under
   anomaly mode: "modified by an inplace operation").
2. ``.data`` between steps: weight standardisation applied as a projection through ``m.weight.data = ...``
   from step 3, whose 1x1 depthwise conv has ONE weight per filter (``std`` of one element is NaN): reported
   at that step's check as ``nonfinite_param`` (raised: skipping cannot help, docs/api.md). Must NOT fire: a
   mean teacher updated with ``ema.data.copy_(...)``, a pruning mask applied with ``.data.mul_`` and dead
   units re-initialised through ``.data`` (finite writes), and the LSQ case below, whose pruning mask and
   step-size initialisation are ``.data`` writes of finite values.
3. GradScaler: a run resumed at step 3 from the scaler state of a run whose scale had collapsed to the
   smallest subnormal (2**-149: its reciprocal overflows float32; plain torch then APPLIES NaN updates,
   found_inf being computed on the underflowed zeros) -> ``scaler_collapse`` at step 3, update blocked.
   Must NOT fire: ``init_scale=2**18`` with float16 autocast, two ordinary calibration skips (steps 0 and 5).
4. Gradient accumulation: logit adjustment whose class prior is recomputed at the start of each micro-batch
   (after the previous one's backward) from the counts seen so far; a class absent from the warm-up counts
   gets log(0) = -inf, harmless until it is a target (micro-batch 3 of step 3): the origin is that
   loss-code ``log``, not the model and not "a mask".
5. ``torch.func``: a Jacobian penalty ``vmap(jacrev(functional_call(model, ...)))`` whose per-sample
   Frobenius norm is written as ``sqrt(sum(J**2))``, zero for a blank input (bias-free first layer, ReLU:
   J = 0): the sqrt around the transform, phase backward; importance weights ``1 / (N p)`` from per-sample
   gradient norms computed with ``vmap(grad(...))`` before the forward, one zero-padded sample (gradient
   exactly 0): the reciprocal made before the model's forward is the origin; sharpness-aware minimisation
   written functionally (``autograd.grad`` in the loss code, ``functional_call`` at the perturbed weights) on a
   batch whose hinge margins are all met (g / ||g|| = 0 / 0); and, without any transform, a group-lasso
   penalty ``sqrt(sum w**2)`` computed before the forward on a neuron pruned to zero (the same "code before
   the forward differentiated into the parameters" as the Jacobian penalty).
6. Fast paths: a frozen ``norm_first`` ``nn.TransformerEncoder`` teacher (eval, no_grad: the fused
   ``_transformer_encoder_layer_fwd``) called from the distillation LOSS code on an empty text; and
   ``test_nantrace_changes_nothing_on_healthy_steps``: logits (and the final state) bit for bit equal with and
   without nantrace on healthy runs of the fast paths (fused layer, nested tensors, ``_native_multi_head_
   attention``), the functorch programs, layer-by-layer loss code, anomaly mode, accumulation and the scaler.
7. Layers run one by one from the loss code through a ModuleList below a child: deep supervision over
   ``model.encoder.layers[i]`` with exits ``model.exits[i]``; stochastic depth by the linear decay rule with a
   final survival probability of 0 from the config: the last layer's ``x / keep_prob`` divides by 0 when
   stochastic depth switches on at step 3 (module ``encoder.layers.3.drop_path``); a dense multi-task model
   whose loss code runs the heads of the ModuleDict ``model.decoder.heads`` through ``.items()``, the depth
   head's log of a zero depth on a dropped (black) camera frame (module ``decoder.heads.depth``).
8. New program classes: top-2 MoE whose balance term averages the router probability over the tokens an
   expert received (an expert receiving none: mean of an empty selection); expert-choice routing whose
   softmax over each sequence's tokens meets an empty document (all ``-inf``); LSQ with torch's fused per-
   channel fake-quant in the forward and the step-size gradient written by hand in the backward, where a
   pruned output channel gets step size 0 (0 / 0 in the user's backward); a LoRA rank sweep over
   ``np.arange(0, 17, 8)`` whose r = 0 config makes ``alpha / r`` a numpy inf (inf x the empty product's 0);
   a GAN discriminator step with R1 written as ``sqrt(sum g**2) ** 2`` through ``autograd.grad(create_graph=
   True)`` on a black real image; a seq2seq Transformer with teacher forcing, label smoothing and
   per-sentence length normalisation over an empty (all-padding) target; depth completion whose ``mse_loss``
   over the boolean-selected lidar pixels meets a frame without any return (a mean over no element).

Found (strict xfails, reasons in ``XFAIL``): a mean over no element (``mean`` of an empty selection, a
``mse_loss`` over empty selections) is called ``domain_error`` instead of ``div_by_zero``; code before the
model's forward whose result is differentiated into the parameters (a penalty on the weights, a Jacobian
penalty through ``vmap(jacrev)``) is replayed cut from them zero-intrusive ("transient"); a forward of the
watched model through ``functional_call`` with substituted weights is replayed with the module's own weights
("transient"). Observed and allowed: in ``replayable`` mode a GradScaler calibration skip re-runs the loss
function once (the skip is a non-finite read); the re-run reproduces the step's outputs bit for bit.

How expectations were derived: every ``Want`` was written from the construction before nantrace ran, by
shared/API.md's fields and cause table and docs/diagnosis.md's origin rule (the op that created the first
non-finite value; if it received an infinity, the op that made it; a ``-inf`` mask is intentional, a log of 0
is not; for a backward origin the forward op whose derivative went non-finite first, with its module and
line; an op in a custom Function's backward is an origin of its own; an absorbed value dropped by ``where``
is ``where_gradient_trap`` at the op that made the infinity, phase forward; an op inside torch's module code
has the user's calling line as source). Kinds: what the step showed first (``exception`` when the step
raised, ``nonfinite_loss`` / ``nonfinite_grad`` otherwise; a parameter written non-finite between steps is
``nonfinite_param`` with phase, op and source None, action raised, as tests/scenarios.py and round 8b).
``test_cases_fail_without_nantrace`` checks each construction with plain torch and an oracle written here (a
TorchDispatchMode: the first op making a NaN from NaN-free inputs or an infinity from finite ones, the
running watched module, and for a backward op the autograd node and the forward call that made it).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import (Judge, Program, Run, _blocking, aligned, assert_diagnosis, case_params, describe, run_step,
                             same, snapshot)
from origin_markers import origin_line
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3
STEPS = 5


@dataclasses.dataclass
class Program9(Program):
    """A Program with the settings this round's loops add: anomaly mode around each step, CPU autocast with a
    GradScaler (``amp``), a scaler state loaded at a given step (a resumed run)."""

    anomaly: bool = False
    amp: torch.dtype | None = None
    init_scale: float = 2.0 ** 16
    resume_scaler: tuple[int, dict[str, Any]] | None = None
    fast_path: bool = False
    """The oracle must not put a TorchFunctionMode on the stack (it switches torch's fused paths off)."""


CASES: dict[str, tuple[Callable[..., Program9], Want]] = {}
QUIET: dict[str, tuple[Callable[[], Program9], type | None]] = {}
"""Programs that must produce no blocking incident: builder, and the exception type the program dies of (None)."""
BETWEEN_TAG: dict[str, str] = {}
"""nonfinite_param cases: the tag of the user's write between steps (checked by the construction test)."""
XFAIL: dict[str, str] = {
}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want, between_tag: str | None = None) -> Callable:
    def register(build: Callable[..., Program9]) -> Callable[..., Program9]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        if between_tag is not None:
            BETWEEN_TAG[name] = between_tag
        return build

    return register


def quiet(name: str, error: type | None = None) -> Callable:
    def register(build: Callable[[], Program9]) -> Callable[[], Program9]:
        QUIET[name] = (build, error)
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batches(batch: Callable[[int, bool], Any], bad: bool, n: int = STEPS) -> list[Any]:
    """``n`` batches; the one at FAIL_STEP built bad when ``bad``."""
    return [batch(s, bad and s == FAIL_STEP) for s in range(n)]


TAPS: list[torch.Tensor] | None = None
"""While a healthy run is compared bit for bit: the model outputs the loss code saw, in order."""


def tap(*ts: torch.Tensor) -> None:
    if TAPS is not None:
        TAPS.extend(t.detach().clone() for t in ts)


# ================================================================= 1. backward() raises
# 1a. Optical flow with a Charbonnier loss, eps = 0 in the config ("the robust L1, eps only for stability"),
#     trained with anomaly mode on (as while hunting NaNs). Crops near the image border are padded and the
#     valid mask zeroes both sides: diff = 0 exactly, sqrt(0) = 0 is finite, its derivative inf; the square's
#     backward makes 2 * 0 * inf = NaN and anomaly mode names "PowBackward0". The first non-finite derivative is
#     sqrt's, in the loss code.
class TinyFlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(6, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 12, 3, padding=1), nn.ReLU())
        self.flow_head = nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.flow_head(self.encoder(frames))


CHARBONNIER_EPS = 0.0


def charbonnier_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    frames, flow, valid = batch
    pred = model(frames)
    tap(pred)
    diff = (pred - flow) * valid
    return torch.sqrt(diff ** 2 + CHARBONNIER_EPS ** 2).sum() / (2 * valid.sum())  # <origin:charb_sqrt>


@case("optical_flow_charbonnier_eps0_anomaly_mode_padded_border_crop",
      Want("exception", "backward", "aten.sqrt.default", None, "charb_sqrt", "grad_singularity", step=FAIL_STEP,
           action="raised"))
def _charbonnier(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = TinyFlowNet()
    g = _gen(901)

    def batch(step: int, padded: bool) -> tuple[torch.Tensor, ...]:
        valid = torch.ones(3, 1, 10, 10)
        if padded:
            valid[1, :, 7:] = 0.0  # a crop at the bottom border, padded to 10 rows
        return torch.randn(3, 6, 10, 10, generator=g), torch.randn(3, 2, 10, 10, generator=g), valid

    return Program9(model, torch.optim.Adam(model.parameters(), lr=1e-3), _batches(batch, bad), charbonnier_loss,
                    anomaly=True)


# 1b. Anomaly mode switched on to hunt a FORWARD NaN: a review classifier's masked mean pooling divides by the
#     number of tokens, and the batch of step 3 holds an empty review (every id is padding): 0 / 0 in the
#     forward, a NaN loss, and anomaly mode then stops backward() at the first node returning NaN. The step
#     raised; its first bad value is the forward division.
class MaskedMeanPool(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1)  # <origin:pool_div>


class ReviewClassifier(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.pool = MaskedMeanPool()
        self.head = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.encoder(self.embed(ids)), ids != 0))


def _reviews(g: torch.Generator, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 50, (6, 10), generator=g)
    for row, length in enumerate(torch.randint(3, 11, (6,), generator=g).tolist()):
        ids[row, length:] = 0
    if empty:
        ids[4] = 0  # a review whose text was only markup, stripped by the cleaner
    return ids, torch.randint(0, 3, (6,), generator=g)


def review_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    logits = model(batch[0])
    tap(logits)
    return F.cross_entropy(logits, batch[1])


@case("review_classifier_anomaly_mode_hunting_forward_nan_empty_review",
      Want("exception", "forward", "aten.div.Tensor", "pool", "pool_div", "div_by_zero", step=FAIL_STEP,
           action="raised"))
def _anomaly_forward(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = ReviewClassifier()
    g = _gen(902)
    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05),
                    _batches(lambda s, b: _reviews(g, b), bad), review_loss, anomaly=True)


# 1c. ReLU attention pooling (sparse weights: exact zeros allowed) with an entropy bonus switched on at step 3,
#     computed with the usual 0 log 0 = 0 guard, torch.where(w > 0, w * log(w), 0). The user registered a
#     "refuse non-finite gradients" hook on every parameter. At the zero weights log(0) = -inf, 0 * -inf = NaN
#     in the branch where() drops: the forward is finite, the backward's 0 * (-inf) is NaN (the where trap)
#     and the hook on score.weight raises FloatingPointError inside backward().
class ReLUAttentionPool(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.score = nn.Linear(d, 1)
        self.entropy_weight = 0.0

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = F.relu(self.score(h).squeeze(-1))
        w = s / (s.sum(1, keepdim=True) + 1e-6)
        entropy = h.new_zeros(())
        if self.entropy_weight > 0:
            plogp = torch.where(w > 0, w * torch.log(w), torch.zeros_like(w))  # <origin:ent_log>
            entropy = -plogp.sum(1).mean()
        return (w.unsqueeze(-1) * h).sum(1), entropy


class SparsePoolTagger(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.pool = ReLUAttentionPool(d)
        self.head = nn.Linear(d, 4)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, entropy = self.pool(self.proj(self.embed(ids)))
        return self.head(pooled), entropy


def refuse_nonfinite(name: str, g: torch.Tensor) -> None:
    if not bool(torch.isfinite(g).all()):
        raise FloatingPointError(f"non-finite gradient for {name}")


def entropy_bonus_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    logits, entropy = model(batch[0])
    tap(logits)
    return F.cross_entropy(logits, batch[1]) - model.pool.entropy_weight * entropy


@case("sparse_attention_pool_entropy_bonus_where_guard_nan_refusing_hooks",
      Want("exception", "forward", "aten.log.default", "pool", "ent_log", "where_gradient_trap", step=FAIL_STEP,
           action="raised"))
def _entropy_hooks(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = SparsePoolTagger()
    for name, p in model.named_parameters():
        p.register_hook(functools.partial(refuse_nonfinite, name))
    g = _gen(903)

    def schedule(m: nn.Module, step: int) -> None:
        m.pool.entropy_weight = 0.01 if bad and step >= FAIL_STEP else 0.0

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 40, (6, 9), generator=g), torch.randint(0, 4, (6,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), entropy_bonus_loss,
                    before_step=schedule)


# 1d. Anomaly mode and gradient accumulation (two micro-batches): an action recogniser whose motion module
#     turns frame embeddings into velocity features, |e[t+1] - e[t]| written as (sum of squares) ** 0.5. The
#     video decoder duplicated a frame in the second micro-batch of step 3: velocity 0, the ** 0.5's derivative
#     is inf and the squares' backward 2 * 0 * inf = NaN, where anomaly mode stops (it names PowBackward0 of the
#     SQUARE). The origin is the ** 0.5, in the module, in the second micro-batch.
class Motion(nn.Module):
    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return (e[:, 1:] - e[:, :-1]).pow(2).sum(-1).pow(0.5)  # <origin:vel_pow>


class ActionRecogniser(nn.Module):
    def __init__(self, d_in: int = 10, d: int = 12, frames: int = 6) -> None:
        super().__init__()
        self.frame_encoder = nn.Sequential(nn.Linear(d_in, d), nn.Tanh())
        self.motion = Motion()
        self.head = nn.Linear(d + frames - 1, 5)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        e = self.frame_encoder(clips)
        return self.head(torch.cat([e.mean(1), self.motion(e)], -1))


def clip_loss(model: nn.Module, micro: Any, step: int) -> torch.Tensor:
    logits = model(micro[0])
    tap(logits)
    return F.cross_entropy(logits, micro[1])


@case("action_recogniser_anomaly_mode_accumulation_duplicated_frame_velocity",
      Want("exception", "backward", "aten.pow.Tensor_Scalar", "motion", "vel_pow", "grad_singularity",
           step=FAIL_STEP, action="raised"))
def _velocity(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = ActionRecogniser()
    g = _gen(904)

    def micro(step: int, index: int, dup: bool) -> tuple[torch.Tensor, torch.Tensor]:
        clips = torch.randn(4, 6, 10, generator=g)
        if dup and index == 1:
            clips[2, 3] = clips[2, 2]  # the decoder repeated frame 2
        return clips, torch.randint(0, 5, (4,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05),
                    _batches(lambda s, b: [micro(s, i, b) for i in range(2)], bad), clip_loss, accum=True, anomaly=True)


# 1e. MUST NOT fire: a heteroscedastic regressor caps its variance in place after exp (var.clamp_(max=50)) when
#     a batch makes it large (step 3's readings are 20x larger): exp saved its output for the backward, and
#     backward() raises "modified by an inplace operation" (anomaly mode on adds the forward trace). Not a
#     value's error: no incident, the user's RuntimeError propagates.
class VarianceRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.Tanh())
        self.mu = nn.Linear(16, 1)
        self.logvar = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        var = torch.exp(self.logvar(h) + x[:, :1])
        if bool((var > 50).any()):
            var.clamp_(max=50.0)
        return self.mu(h), var


def gaussian_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    mu, var = model(batch[0])
    return 0.5 * (torch.log(var) + (batch[1] - mu) ** 2 / var).mean()


@quiet("heteroscedastic_variance_capped_in_place_after_exp_anomaly_mode", error=RuntimeError)
def _inplace() -> Program9:
    torch.manual_seed(0)
    model = VarianceRegressor()
    g = _gen(905)

    def batch(step: int, big: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 5, generator=g)
        if big:
            x[:, 0] = 20.0 * x[:, 0].abs()  # readings in another unit
        return x, torch.randn(8, 1, generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(batch, True), gaussian_nll,
                    anomaly=True)


# ================================================================= 2. parameters written through .data
# 2a. Weight standardisation applied as a projection after each update, from step 3 (after warm-up), through
#     m.weight.data = (w - mean) / std over each filter. The 1x1 depthwise conv has ONE weight per filter: the
#     unbiased std of one element is NaN, so its weights are NaN when step 3 begins.
class DepthwiseSeparableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 1, groups=8)
        self.pw = nn.Conv2d(8, 16, 1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        h = F.relu(self.pw(self.dw(h)))
        return self.head(h.mean((2, 3)))


def image_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    logits = model(batch[0])
    tap(logits)
    return F.cross_entropy(logits, batch[1])


@case("weight_standardisation_projection_through_data_one_weight_depthwise_filter",
      Want("nonfinite_param", None, None, "dw", None, "nonfinite_param", step=FAIL_STEP, action="raised"),
      between_tag="ws_std")
def _weight_standardisation(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = DepthwiseSeparableNet()
    g = _gen(906)

    def standardise(m: nn.Module, step: int) -> None:
        if step < FAIL_STEP:
            return
        for conv in m.modules():
            if isinstance(conv, nn.Conv2d) and (bad or conv.weight[0].numel() > 1):
                w = conv.weight.data
                conv.weight.data = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / w.std(dim=(1, 2, 3), keepdim=True)  # <origin:ws_std>

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), image_loss,
                    before_step=standardise)


# 2b. MUST NOT fire: a mean teacher held by the watched model (frozen, outside the optimizer), updated between
#     steps with ema.data.copy_(...); magnitude pruning of the student's first layer re-applied with
#     weight.data.mul_(mask); dead units re-initialised through .data at step 2. Every write is finite.
class MeanTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def mean_teacher_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, noise = batch
    logits = model(x + noise)
    with torch.no_grad():
        target = F.softmax(model.teacher(x), -1)
    tap(logits, target)
    return F.cross_entropy(logits, y) + F.mse_loss(F.softmax(logits, -1), target)


@quiet("mean_teacher_ema_data_copy_pruning_mask_and_dead_unit_reinit_through_data")
def _mean_teacher() -> Program9:
    torch.manual_seed(0)
    model = MeanTeacher()
    mask = (torch.rand(32, 10, generator=_gen(907)) > 0.3).float()
    g = _gen(908)

    def between_steps(m: nn.Module, step: int) -> None:
        first = m.student[0].weight
        first.data.mul_(mask)
        if step == 2:
            dead = torch.tensor([3, 17])
            first.data[dead] = 0.1 * torch.randn(2, 10, generator=_gen(909))
        for ema, p in zip(m.teacher.parameters(), m.student.parameters()):
            ema.data.copy_(0.99 * ema.data + 0.01 * p.data)

    def batch(step: int, _: bool) -> tuple[torch.Tensor, ...]:
        return (torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g),
                0.1 * torch.randn(8, 10, generator=g))

    return Program9(model, torch.optim.SGD(model.student.parameters(), lr=0.05), _batches(batch, False, 6),
                    mean_teacher_loss, before_step=between_steps)


# ================================================================= 3. the GradScaler
# 3a. A smart-meter regressor under bfloat16 autocast and a GradScaler. At step 3 the job is resumed and the
#     scaler's state comes from the checkpoint of a run whose scale had halved down to the smallest float32
#     subnormal, 2**-149. Its reciprocal overflows float32: the scaled gradients underflow to 0, unscale_
#     multiplies them by inf (NaN), and found_inf, computed on the scaled zeros, stays 0: plain torch applies
#     the NaN update. A scale nothing can be unscaled from is a collapse of the scaler, before the update.
class MeterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def meter_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    pred = model(batch[0])
    tap(pred)
    return F.mse_loss(pred.float(), batch[1])


COLLAPSED_SCALER = {"scale": 2.0 ** -149, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                    "_growth_tracker": 0}


@case("amp_resume_scaler_state_of_collapsed_run_subnormal_scale",
      Want("scaler_collapse", None, None, None, None, "scaler_collapse", step=FAIL_STEP, action="skipped"))
def _scaler_resume(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = MeterNet()
    g = _gen(910)

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 6, generator=g)
        return x, x[:, :1] - 0.5 * x[:, 1:2]

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(batch, bad), meter_loss,
                    amp=torch.bfloat16, resume_scaler=(FAIL_STEP, COLLAPSED_SCALER) if bad else None)


# 3b. MUST NOT fire: float16 autocast with init_scale=2**18 (copied from a larger model's recipe): the scaled
#     float16 gradients overflow at step 0 (2**18) and once more at step 5 (2**17, a batch with larger
#     gradients); the scaler skips those two steps and backs off. Calibration, not an incident.
@quiet("amp_fp16_init_scale_2_18_two_calibration_skips")
def _calibration() -> Program9:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    g = _gen(1)

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(batch, False, 7), meter_loss,
                    amp=torch.float16, init_scale=2.0 ** 18)


# ================================================================= 4. code between micro-batches
# 4a. Long-tail classification with logit adjustment (Menon et al.): logits + tau * log(prior), the prior
#     recomputed at the start of each micro-batch (after the previous one's backward) from the class counts
#     seen so far, started from a warm-up sample in which class 4 never occurred: log(0) = -inf in its column,
#     harmless (a -inf logit of a class never asked for) until a sample of class 4 arrives, in the third
#     micro-batch of step 3: its cross-entropy is inf. The -inf is a log of 0, not a mask.
class TailClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, logit_adjust: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.body(x))
        return logits if logit_adjust is None else logits + logit_adjust


class LogitAdjustedLoss:
    def __init__(self, warmup_counts: torch.Tensor, tau: float = 1.0) -> None:
        self.counts = warmup_counts.clone()
        self.tau = tau

    def __call__(self, model: nn.Module, micro: Any, step: int) -> torch.Tensor:
        x, y = micro
        prior = self.counts / self.counts.sum()
        adjust = self.tau * torch.log(prior)  # <origin:la_log>
        logits = model(x, adjust)
        tap(logits)
        loss = F.cross_entropy(logits, y)
        self.counts += torch.bincount(y, minlength=len(self.counts)).float()
        return loss


@case("accumulation_logit_adjustment_prior_recomputed_between_micro_batches_unseen_class",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "la_log", "log_nonpositive", step=FAIL_STEP))
def _logit_adjustment(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = TailClassifier()
    g = _gen(911)

    def micro(index: int, rare: bool) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.multinomial(torch.tensor([0.4, 0.3, 0.2, 0.1]), 8, replacement=True, generator=g)
        if rare and index == 2:
            y[5] = 4
        return torch.randn(8, 12, generator=g), y

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05),
                    _batches(lambda s, b: [micro(i, b) for i in range(3)], bad),
                    LogitAdjustedLoss(torch.tensor([40.0, 31.0, 18.0, 11.0, 0.0 if bad else 2.0])), accum=True)


# ================================================================= 5. torch.func transforms
# 5a. A Jacobian-regularised classifier (input-output Jacobian penalty for robustness): per-sample Jacobians by
#     vmap(jacrev(functional_call(model, params, x))), their Frobenius norms written as sqrt(sum J**2). The
#     first layer has no bias: a blank input row (a sensor dropout, all zeros) has every ReLU at 0, J = 0
#     exactly, and sqrt's derivative at 0 is inf; the double backward through jacrev carries NaN into fc1.
class RobustMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def jacobian_regularised_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    params = dict(model.named_parameters())
    jac = vmap(jacrev(lambda xi: functional_call(model, params, (xi,))))(x)
    jac_norm = jac.pow(2).sum(dim=(1, 2)).sqrt()  # <origin:jac_sqrt>
    logits = model(x)
    tap(logits, jac)
    return F.cross_entropy(logits, y) + 0.01 * jac_norm.mean()


@case("jacobian_penalty_vmap_jacrev_functional_call_blank_input_sqrt",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "jac_sqrt", "grad_singularity", step=FAIL_STEP))
def _jacobian(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = RobustMLP()
    g = _gen(912)

    def batch(step: int, blank: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 16, generator=g)
        if blank:
            x[3] = 0.0
        return x, torch.randint(0, 4, (6,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), jacobian_regularised_loss)


# 5b. Importance weighting by per-sample gradient norms (Katharopoulos & Fleuret): before the forward, the
#     per-sample gradients of the current parameters by vmap(grad(...)) over functional_call; p = norm / sum,
#     weights 1 / (N p). The bias-free regressor maps a zero-padded sample (x = 0, y = 0, the last batch padded
#     to size) to 0: its gradient is exactly 0, p = 0 and 1 / 0 = inf, times its loss 0 = NaN.
class BiasFreeRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32, bias=False)
        self.fc2 = nn.Linear(32, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


def per_sample_grad_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, p, (xi[None],)) - yi[None]).pow(2).mean()

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.stack([gr.flatten(1).norm(dim=1) for gr in grads.values()]).norm(dim=0)


def importance_weighted_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    norms = per_sample_grad_norms(model, x, y)
    p = norms / norms.sum()
    w = 1.0 / (len(x) * p)  # <origin:is_weight>
    pred = model(x)
    tap(pred, norms)
    return (w * (pred - y).pow(2)).mean()


@case("importance_weights_from_vmap_per_sample_grad_norms_zero_padded_sample",
      Want("nonfinite_loss", "forward", "aten.reciprocal.default", None, "is_weight", "div_by_zero", step=FAIL_STEP))
def _importance(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = BiasFreeRegressor()
    g = _gen(913)

    def batch(step: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 8, generator=g)
        y = x[:, 0] - 0.3 * x[:, 1]
        if padded:
            x[7], y[7] = 0.0, 0.0
        return x, y

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.02), _batches(batch, bad), importance_weighted_loss)

# 5c. Sharpness-aware minimisation written functionally in the loss code: the gradient of a hinge loss by
#     torch.autograd.grad, the ascent step eps = rho * g / ||g|| added to the parameters, and the loss at the
#     perturbed weights by functional_call (no transform). Step 3's batch holds only easy, far-out examples whose
#     labels agree with the model: every margin is satisfied, the hinge's gradient is exactly 0, ||g|| = 0 and
#     g / ||g|| is 0 / 0 (a norm of zeros); the perturbed weights, the outputs and the loss are NaN.
def sam_hinge_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    params = dict(model.named_parameters())
    margin = F.relu(1 - y * model(x).squeeze(-1)).mean()
    grads = torch.autograd.grad(margin, list(params.values()))
    grad_norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    perturbed = {k: p + 0.05 * g / grad_norm for (k, p), g in zip(params.items(), grads)}  # <origin:sam_eps>
    out = functional_call(model, perturbed, (x,)).squeeze(-1)
    tap(out)
    return F.relu(1 - y * out).mean()


@case("sam_functional_call_at_perturbed_weights_hinge_all_margins_met_zero_gradient_norm",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "sam_eps", "zero_variance_norm", step=FAIL_STEP))
def _sam(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    g = _gen(923)
    f = lambda v: model(v).squeeze(-1)  # noqa: E731

    def batch(step: int, easy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if easy:  # far-out rows, labelled as the model scores them
            x = torch.stack([aligned(f, 6, sign, 50.0, 9230 + k) for k, sign in enumerate([1.0, -1.0] * 4)])
            return x, torch.tensor([1.0, -1.0] * 4)
        x = torch.randn(8, 6, generator=g)
        return x, torch.where(x[:, 0] + 0.5 * x[:, 1] > 0, 1.0, -1.0)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), sam_hinge_loss)

# 5d. (no transform: the prelude alone) Group-lasso regularisation computed at the top of the loss function, before
#     the forward: the sum over neurons of the L2 norm of each neuron's incoming weights, written as
#     sqrt(sum w**2). Structured pruning zeroes neuron 7 of fc1 through .data when step 3 begins (a finite write):
#     its group norm is sqrt(0) and its derivative inf, 0 * inf = NaN in fc1's gradient.
class PrunableMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def group_lasso_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    group_norms = model.fc1.weight.pow(2).sum(1).sqrt()  # <origin:lasso_sqrt>
    penalty = 1e-3 * group_norms.sum()
    logits = model(x)
    tap(logits)
    return F.cross_entropy(logits, y) + penalty


@case("group_lasso_before_forward_structured_pruning_zeroes_a_neuron_through_data",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "lasso_sqrt", "grad_singularity", step=FAIL_STEP))
def _group_lasso(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = PrunableMLP()
    g = _gen(925)

    def prune(m: nn.Module, step: int) -> None:
        if bad and step == FAIL_STEP:
            m.fc1.weight.data[7] = 0.0  # the neuron with the smallest group norm, pruned

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), group_lasso_loss,
                    before_step=prune)


# ================================================================= 6. fast paths
# 6a. Distillation from a frozen norm_first Transformer teacher held by the watched model, kept in eval mode and
#     called from the LOSS code under no_grad: each layer takes the fused _transformer_encoder_layer_fwd, which
#     returns NaN for a sequence whose every key is padding (an empty text in step 3's batch). The teacher's
#     CLS distribution is NaN and so is the KL term.
class DistilledTagger(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.teacher = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.teacher_head = nn.Linear(d, 3)
        self.student = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 3))
        self.teacher.requires_grad_(False).eval()
        self.teacher_head.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = (ids != 0).unsqueeze(-1).float()
        return self.student((self.embed(ids) * m).sum(1) / m.sum(1).clamp(min=1))


def distill_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    ids, labels = batch
    student_logits = model(ids)
    with torch.no_grad():
        h = model.teacher(model.embed(ids), src_key_padding_mask=ids == 0)  # <origin:teacher_call>
        teacher_probs = F.softmax(model.teacher_head(h[:, 0]) / 2.0, -1)
    tap(student_logits, h)
    kd = F.kl_div(F.log_softmax(student_logits / 2.0, -1), teacher_probs, reduction="batchmean")
    return 0.5 * F.cross_entropy(student_logits, labels) + 0.5 * kd


@case("distillation_frozen_norm_first_teacher_fast_path_called_from_loss_empty_text",
      Want("nonfinite_loss", "forward", "aten._transformer_encoder_layer_fwd.default", "teacher.layers.0",
           "teacher_call", "masked_softmax_all", step=FAIL_STEP))
def _teacher(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = DistilledTagger()
    g = _gen(914)

    def batch(step: int, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 40, (5, 8), generator=g)
        for row, length in enumerate(torch.randint(2, 9, (5,), generator=g).tolist()):
            ids[row, length:] = 0
        if empty:
            ids[2] = 0
        return ids, torch.randint(0, 3, (5,), generator=g)

    return Program9(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05),
                    _batches(batch, bad), distill_loss, fast_path=True)


# 6b. (healthy only, for the bit-for-bit test) A linear probe over a frozen encoder on its nested-tensor path and
#     a frozen set attention on nn.MultiheadAttention's fused path, padded rows but none empty.
class FrozenProbes(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0).requires_grad_(False)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2).requires_grad_(False).eval()
        self.set_attn = nn.MultiheadAttention(d, 2, batch_first=True).requires_grad_(False).eval()
        self.probe = nn.Linear(2 * d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        e = self.embed(ids)
        h = self.encoder(e, src_key_padding_mask=pad)
        a, _ = self.set_attn(e, e, e, key_padding_mask=pad, need_weights=False)
        keep = (~pad).unsqueeze(-1).float()
        pooled = torch.cat([(h * keep).sum(1), (a * keep).sum(1)], -1) / keep.sum(1)
        return self.probe(pooled)


def _frozen_probes() -> Program9:
    torch.manual_seed(0)
    model = FrozenProbes()
    g = _gen(915)

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 40, (5, 8), generator=g)
        for row, length in enumerate(torch.randint(2, 9, (5,), generator=g).tolist()):
            ids[row, length:] = 0
        return ids, torch.randint(0, 3, (5,), generator=g)

    return Program9(model, torch.optim.SGD(model.probe.parameters(), lr=0.05), _batches(batch, False), review_loss,
                    fast_path=True)


# ================================================================= 7. layers run from the loss code
# 7a. Deep supervision: the loss code runs model.encoder.layers[i] one by one and scores each depth with its exit
#     model.exits[i]. Stochastic depth follows the linear decay rule, survival_l = 1 - l / (L - 1) * (1 - p_L),
#     with p_L = 0 from the config ("final_survival: 0.0", meant as "no drop"), switched on at step 3 after a
#     warm-up: the last layer's keep probability is 0 and its hand-written drop path computes x / 0 (inf)
#     times a mask of zeros (NaN). Layers 0-2 stay finite.
class DropPath(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty(x.shape[0], 1, 1).bernoulli_(keep)
        return x / keep * mask  # <origin:drop_path>


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop_path = DropPath()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.drop_path(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop_path(self.mlp(self.norm2(x)))


class Encoder(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(d) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class DeepSupervisedNet(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.encoder = Encoder(d, depth)
        self.exits = nn.ModuleList([nn.Linear(d, 3) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exits[-1](self.encoder(self.embed(x)).mean(1))


def deep_supervision_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    h = model.embed(x)
    losses = []
    for i, layer in enumerate(model.encoder.layers):
        h = layer(h)
        logits = model.exits[i](h.mean(1))
        tap(logits)
        losses.append(F.cross_entropy(logits, y))
    return torch.stack(losses).mean()


@case("deep_supervision_layers_from_loss_code_stochastic_depth_final_survival_zero",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "encoder.layers.3.drop_path", "drop_path", "div_by_zero",
           step=FAIL_STEP))
def _deep_supervision(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = DeepSupervisedNet()
    final_survival = 0.0 if bad else 0.5
    g = _gen(916)

    def stochastic_depth(m: nn.Module, step: int) -> None:
        depth = len(m.encoder.layers)
        for i, layer in enumerate(m.encoder.layers):
            survival = 1.0 - i / (depth - 1) * (1.0 - final_survival)
            layer.drop_path.p = 0.0 if step < FAIL_STEP else 1.0 - survival

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4, 7, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

    return Program9(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _batches(batch, bad), deep_supervision_loss,
                    before_step=stochastic_depth)

# 7b. A multi-task dense model whose loss code runs the backbone and then every head of the ModuleDict
#     model.decoder.heads through .items(). The depth head predicts depth as a square (positive by construction)
#     and returns its log; backbone and heads have no bias: a dropped camera frame (all zeros, step 3) gives
#     features 0, depth 0 and log(0) = -inf, whose L1 distance to the target's log-depth is inf.
class DepthHead(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, 1, 1, bias=False)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        depth = self.conv(f).pow(2).squeeze(1)
        return torch.log(depth)  # <origin:log_depth>


class Decoder(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"seg": nn.Conv2d(c, 4, 1, bias=False), "depth": DepthHead(c)})


class DenseMultiTask(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.ReLU(),
                                      nn.Conv2d(c, c, 3, padding=1, bias=False), nn.ReLU())
        self.decoder = Decoder(c)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        feats = self.backbone(x)
        return {task: head(feats) for task, head in self.decoder.heads.items()}


def multitask_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, seg, depth = batch
    feats = model.backbone(x)
    losses = []
    for task, head in model.decoder.heads.items():
        out = head(feats)
        tap(out)
        losses.append(F.cross_entropy(out, seg) if task == "seg" else F.l1_loss(out, torch.log(depth)))
    return sum(losses)


@case("multitask_moduledict_heads_run_from_loss_code_log_depth_dropped_frame",
      Want("nonfinite_loss", "forward", "aten.log.default", "decoder.heads.depth", "log_depth", "log_nonpositive",
           step=FAIL_STEP))
def _multitask(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = DenseMultiTask()
    g = _gen(924)

    def batch(step: int, dropped: bool) -> tuple[torch.Tensor, ...]:
        x = torch.rand(3, 3, 6, 6, generator=g)
        if dropped:
            x[1] = 0.0
        return x, torch.randint(0, 4, (3, 6, 6), generator=g), 1.0 + 9.0 * torch.rand(3, 6, 6, generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(batch, bad), multitask_loss)


# ================================================================= 8. new program classes
# 8a. Top-2 mixture of experts with a balance term that averages each expert's router probability over the
#     tokens it RECEIVED (probs[tok, e].mean()). Step 3's batch is a page of one repeated token ("====="):
#     every token picks the same two experts, the other two receive none, and the mean of an empty selection
#     is NaN.
class Top2MoE(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
                                      for _ in range(experts)])

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(h), -1)
        top_p, top_i = probs.topk(2, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        balance = []
        for e, expert in enumerate(self.experts):
            tok, slot = (top_i == e).nonzero(as_tuple=True)
            out = out.index_add(0, tok, top_p[tok, slot, None] * expert(h[tok]))
            mean_prob = probs[tok, e].mean()  # <origin:moe_importance>
            balance.append(mean_prob * tok.numel() / h.shape[0])
        return h + out, len(self.experts) * torch.stack(balance).sum()


class MoELM(nn.Module):
    def __init__(self, vocab: int = 24, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.moe = Top2MoE(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux = self.moe(self.embed(tokens).flatten(0, 1))
        return self.head(h), aux


def moe_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, labels = batch
    logits, aux = model(tokens)
    tap(logits)
    return F.cross_entropy(logits, labels.flatten()) + 0.01 * aux


@case("top2_moe_balance_mean_router_prob_over_received_tokens_expert_without_tokens",
      Want("nonfinite_loss", "forward", "aten.mean.default", "moe", "moe_importance", "div_by_zero", step=FAIL_STEP))
def _moe_mean(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = MoELM()
    g = _gen(917)

    def batch(step: int, repeated: bool) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 24, (4, 8), generator=g)
        if repeated:
            tokens.fill_(11)
        return tokens, torch.randint(0, 24, (4, 8), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), moe_loss)


# 8b. Expert-choice routing (Zhou et al. 2022): each expert picks its top-c tokens of a sequence, by a softmax over
#     the sequence's tokens in which padding is -inf. An empty document (all padding) leaves every expert's
#     column -inf: softmax NaN, its gates NaN, and the masked mean pool (NaN * 0 = NaN) carries it to the loss.
class ExpertChoiceRouter(nn.Module):
    def __init__(self, d: int, experts: int, capacity: int) -> None:
        super().__init__()
        self.wg = nn.Linear(d, experts)
        self.capacity = capacity

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.wg(h).masked_fill(pad.unsqueeze(-1), float("-inf"))
        affinity = F.softmax(scores, dim=1)  # <origin:ec_softmax>
        return affinity.topk(self.capacity, dim=1)


class ExpertChoiceMoE(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4, capacity: int = 3) -> None:
        super().__init__()
        self.router = ExpertChoiceRouter(d, experts, capacity)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        gates, idx = self.router(h, pad)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = idx[..., e].unsqueeze(-1).expand(-1, -1, h.shape[-1])
            picked = torch.gather(h, 1, sel)
            out = out.scatter_add(1, sel, gates[..., e:e + 1] * expert(picked))
        return h + out


class DocClassifier(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.moe = ExpertChoiceMoE(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        h = self.moe(self.embed(ids), pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))


@case("expert_choice_routing_softmax_over_tokens_empty_document",
      Want("nonfinite_loss", "forward", "aten._softmax.default", "moe.router", "ec_softmax", "masked_softmax_all",
           step=FAIL_STEP))
def _expert_choice(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = DocClassifier()
    g = _gen(918)

    def batch(step: int, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 40, (5, 8), generator=g)
        for row, length in enumerate(torch.randint(3, 9, (5,), generator=g).tolist()):
            ids[row, length:] = 0
        if empty:
            ids[1] = 0
        return ids, torch.randint(0, 3, (5,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.05), _batches(batch, bad), review_loss)


# 8c. Quantisation-aware training with LSQ: torch's fused per-channel fake-quant in the forward (it returns 0 for a
#     channel whose step size is 0, finite), the LSQ step-size gradient written by hand in the backward. fc1's
#     output channel 5 was pruned before QAT (the mask is re-applied through .data before every step); QAT starts
#     at step 3 with LSQ's initialisation s = 2 mean|w| / sqrt(Qp) written through .data: s = 0 for the pruned
#     channel, and the backward's w / s is 0 / 0 there.
class LSQWeightFakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, grad_factor: float) -> torch.Tensor:
        ctx.save_for_backward(w, scale)
        ctx.qmin, ctx.qmax, ctx.grad_factor = qmin, qmax, grad_factor
        zero = torch.zeros(scale.shape, dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(w, scale, zero, 0, qmin, qmax)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        w, scale = ctx.saved_tensors
        q = w / scale[:, None]  # <origin:lsq_bwd>
        inside = (q >= ctx.qmin) & (q <= ctx.qmax)
        grad_scale = torch.where(inside, torch.round(q) - q, q.clamp(ctx.qmin, ctx.qmax))
        return g * inside, (g * grad_scale).sum(1) * ctx.grad_factor, None, None, None


class QuantLinear(nn.Linear):
    def __init__(self, fan_in: int, fan_out: int, bits: int = 4) -> None:
        super().__init__(fan_in, fan_out)
        self.qmin, self.qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
        self.step_size = nn.Parameter(torch.ones(fan_out))
        self.quantise = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantise:
            return super().forward(x)
        w = LSQWeightFakeQuant.apply(self.weight, self.step_size, self.qmin, self.qmax,
                                     1.0 / math.sqrt(self.weight.numel() * self.qmax))
        return F.linear(x, w, self.bias)


class QATNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = QuantLinear(10, 16)
        self.fc2 = QuantLinear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


@case("lsq_qat_fused_fake_quant_pruned_channel_zero_step_size_hand_written_backward",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", "fc1", "lsq_bwd", "div_by_zero", step=FAIL_STEP))
def _lsq(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = QATNet()
    keep = torch.ones(16, 1)
    if bad:
        keep[5] = 0.0  # pruned output channel

    def prune_then_qat(m: nn.Module, step: int) -> None:
        m.fc1.weight.data.mul_(keep)
        if step == FAIL_STEP:
            for layer in (m.fc1, m.fc2):
                layer.step_size.data.copy_(2 * layer.weight.data.abs().mean(1) / math.sqrt(layer.qmax))
                layer.quantise = True

    g = _gen(919)

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(batch, bad), image_loss,
                    before_step=prune_then_qat)


# 8d. A LoRA rank sweep over np.arange(0, 17, 8): the first config, r = 0 ("0 = adapter off", the baseline),
#     builds empty A and B; alpha / r with a numpy int is inf (numpy warns, no exception). x @ A^T @ B^T is the
#     empty sum 0, and 0 * inf = NaN in every output of the adapted layer, at step 0.
class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: Any, alpha: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(0.01 * torch.randn(int(r), base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, int(r)))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling  # <origin:lora_scale>


class IntentClassifier(nn.Module):
    def __init__(self, r: Any, alpha: int = 16) -> None:
        super().__init__()
        self.proj = LoRALinear(nn.Linear(24, 32), r, alpha)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.proj(x)))


@case("lora_rank_sweep_numpy_r0_alpha_over_r_inf_times_empty_product",
      Want("nonfinite_loss", "forward", "aten.mul.Tensor", "proj", "lora_scale", "inf_arithmetic", step=0))
def _lora_r0(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    sweep = np.arange(0, 17, 8)
    model = IntentClassifier(sweep[0] if bad else sweep[1])
    g = _gen(920)

    def batch(step: int, _: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)

    return Program9(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
                    _batches(batch, False), image_loss)


# 8e. A GAN discriminator step with an R1 penalty written through the gradient's norm, ||grad_x D(x)||^2 as
#     sqrt(sum g^2) ** 2, by autograd.grad(create_graph=True). The critic's first conv has no bias and a ReLU: a
#     black real image (exact zeros, an all-dark frame of the dataset) has every unit at 0, grad_x D = 0 exactly,
#     and sqrt's derivative there is 0 / 0 in the second-order backward.
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.out = nn.Linear(16 * 4 * 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x).flatten(1))


def _r1_loss(generator: nn.Module) -> Callable[[nn.Module, Any, int], torch.Tensor]:
    def r1_discriminator_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        real, z = batch
        with torch.no_grad():
            fake = generator(z).view(-1, 1, 8, 8)
        real.requires_grad_(True)
        d_real, d_fake = model(real), model(fake)
        tap(d_real, d_fake)
        (g,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
        grad_norm = g.pow(2).sum(dim=(1, 2, 3)).sqrt()  # <origin:gp_sqrt>
        r1 = grad_norm.pow(2).mean()
        return F.softplus(d_fake).mean() + F.softplus(-d_real).mean() + 5.0 * r1

    return r1_discriminator_loss


@case("gan_r1_penalty_as_gradient_norm_double_backward_black_real_image",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "gp_sqrt", "grad_singularity", step=FAIL_STEP))
def _r1(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = Critic()
    generator = nn.Sequential(nn.Linear(8, 64), nn.Tanh()).requires_grad_(False)
    g = _gen(921)

    def batch(step: int, black: bool) -> tuple[torch.Tensor, torch.Tensor]:
        real = torch.rand(4, 1, 8, 8, generator=g)
        if black:
            real[2] = 0.0
        return real, torch.randn(4, 8, generator=g)

    return Program9(model, torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.0, 0.99)), _batches(batch, bad),
                    _r1_loss(generator))


# 8f. A seq2seq Transformer trained with teacher forcing, label smoothing 0.1 and ignore_index=PAD, each sentence's
#     loss normalised by its own target length. The tokenizer adds no EOS, so a source whose translation is empty
#     has an all-padding target: its token losses are all 0 (ignored) and its length 0: 0 / 0. (The decoder
#     itself stays finite: every decoder query still sees BOS.)
PAD, BOS = 0, 1


class TinySeq2Seq(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.transformer = nn.Transformer(d, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.generator = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        h = self.transformer(self.src_embed(src), self.tgt_embed(tgt_in), tgt_mask=causal,
                             src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt_in == PAD,
                             memory_key_padding_mask=src == PAD)
        return self.generator(h)


def seq2seq_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    src, tgt = batch
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], 1)
    logits = model(src, tgt_in)
    tap(logits)
    tok = F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=PAD, label_smoothing=0.1, reduction="none")
    per_sentence = tok.sum(1) / (tgt != PAD).sum(1)  # <origin:s2s_len_norm>
    return per_sentence.mean()


@case("seq2seq_teacher_forcing_label_smoothing_length_normalised_empty_target",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "s2s_len_norm", "div_by_zero", step=FAIL_STEP))
def _seq2seq(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = TinySeq2Seq()
    g = _gen(922)

    def batch(step: int, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.randint(2, 30, (4, 7), generator=g)
        tgt = torch.randint(2, 30, (4, 6), generator=g)
        for row, length in enumerate(torch.randint(2, 7, (4,), generator=g).tolist()):
            tgt[row, length:] = PAD
        if empty:
            tgt[3] = PAD
        return src, tgt

    return Program9(model, torch.optim.Adam(model.parameters(), lr=1e-3), _batches(batch, bad), seq2seq_loss)

# 8g. Depth completion supervised by sparse lidar: the loss is F.mse_loss over the pixels with a lidar return,
#     selected by boolean indexing (pred[valid], target[valid]). A frame recorded while the lidar was occluded has
#     no return at all: both selections are empty and the mean squared error of no element is NaN (0 / 0).
class DepthCompletion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))

    def forward(self, rgb_sparse: torch.Tensor) -> torch.Tensor:
        return self.net(rgb_sparse).squeeze(1)


def sparse_depth_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, target, valid = batch
    pred = model(x)
    tap(pred)
    return F.mse_loss(pred[valid], target[valid])  # <origin:sparse_mse>


@case("depth_completion_mse_over_boolean_selected_lidar_pixels_occluded_frame",
      Want("nonfinite_loss", "forward", "aten.mse_loss.default", None, "sparse_mse", "div_by_zero", step=FAIL_STEP))
def _sparse_depth(bad: bool = True) -> Program9:
    torch.manual_seed(0)
    model = DepthCompletion()
    g = _gen(926)

    def batch(step: int, occluded: bool) -> tuple[torch.Tensor, ...]:
        valid = torch.rand(1, 8, 8, generator=g) < 0.1
        valid[0, 0, 0] = True
        if occluded:
            valid.zero_()
        x = torch.randn(1, 4, 8, 8, generator=g)
        return x, 5.0 + torch.rand(1, 8, 8, generator=g), valid

    return Program9(model, torch.optim.SGD(model.parameters(), lr=0.01), _batches(batch, bad), sparse_depth_loss)


# ======================================================================= the loops
def _one_step(program: Program9, loss_fn: Callable, batch: Any, step: int,
              scaler: torch.amp.GradScaler | None) -> torch.Tensor:
    """The loop body: zero_grad, the loss code and backward (under anomaly mode when asked), the code between
    backward and the update, the update."""
    model, opt = program.model, program.optimizer
    with torch.autograd.set_detect_anomaly(program.anomaly):
        opt.zero_grad()
        if scaler is None:
            loss = run_step(program, loss_fn, batch, step)
        else:
            with torch.autocast("cpu", dtype=program.amp):
                loss = loss_fn(model, batch, step)
            scaler.scale(loss).backward()
    if program.between is not None:
        program.between(model, opt, step)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return loss


def train9(program: Program9, *, replayable: bool, watched: bool = True) -> Run:
    """heldout_harness.train with this round's settings; ``watched=False`` runs the same loop without nantrace."""
    model, opt = program.model, program.optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=program.init_scale) if program.amp is not None else None
    guard = nantrace.watch(model, opt, scaler=scaler, config=nantrace.Config(outputs={"print_incidents": False})) \
        if watched else None
    loss_fn = guard.replayable(program.loss) if guard is not None and replayable else program.loss
    incidents = (lambda: guard.incidents) if guard is not None else (lambda: [])
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            if scaler is not None and program.resume_scaler is not None and program.resume_scaler[0] == step:
                scaler.load_state_dict(dict(program.resume_scaler[1]))
            before, seen = snapshot(model), _blocking(incidents())
            try:
                _one_step(program, loss_fn, batch, step, scaler)
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if _blocking(incidents()) > seen and unchanged is None:
                unchanged = same(before, snapshot(model))
    finally:
        if guard is not None:
            guard.close()
    return Run(list(incidents()), error, error_step, unchanged)


# ======================================================================= the oracle
_NODES = {"aten.sqrt.default": "SqrtBackward0", "aten.pow.Tensor_Scalar": "PowBackward0"}
"""For a backward origin in torch's derivative: the autograd node of the forward op the expectation names."""
_SKIP = {"__torch_dispatch__", "__torch_function__", "_pre", "_post", "_oracle_run", "_case_line", "_one_step",
         "train9", "test_cases_fail_without_nantrace", "register"}


def _floats(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]


def _case_line() -> tuple[int | None, str | None]:
    """The innermost line of this file's program code on the stack, and its function's name."""
    frame = inspect.currentframe()
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == HERE and frame.f_code.co_name not in _SKIP:
            return frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None, None


_UNINITIALISED = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}
"""Ops whose output is uninitialised memory (filled by the next op, a ``bernoulli_``): a NaN there is garbage, not a
value the program made (whether one shows depends on what the allocator hands back)."""

class FirstBad(TorchDispatchMode):
    """The first op of a step that made a NaN from NaN-free inputs, or an infinity from finite inputs (an explicit
    infinite constant argument excepted): op, phase, line of this file, watched module, autograd node."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.made: dict[int, tuple[str | None, int | None]] = {}
        self.keep: list[Any] = []
        self.first: dict[str, Any] | None = None

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.first is None and func._schema.name.split("::")[1] not in _UNINITIALISED:
            ins, outs = _floats((args, kwargs)), _floats(out)
            if func._schema.is_mutable:  # an in-place op: what it wrote
                outs = outs + [a for a in _floats(args)]
            const_inf = any(isinstance(a, float) and math.isinf(a) for a in tree_leaves((args, kwargs)))
            nan = any(bool(t.isnan().any()) for t in outs) and not any(bool(t.isnan().any()) for t in ins)
            bad = (not const_inf and any(not bool(t.isfinite().all()) for t in outs)
                   and all(bool(t.isfinite().all()) for t in ins))
            if nan or bad:
                op = f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}"
                backward = torch._C._current_graph_task_id() != -1
                line, where = _case_line()
                module, node = (self.stack[-1] if self.stack else None), None
                if backward:
                    current = torch._C._current_autograd_node()
                    node = type(current).__name__ if current is not None else None
                    site = self.made.get(id(current), (None, None))
                    module = site[0]
                    if where != "backward":  # torch's derivative: the forward call's line
                        line = site[1]
                self.first = dict(op=op, phase="backward" if backward else "forward", line=line, module=module,
                                  node=node)
        return out


class NodeSites(TorchFunctionMode):
    """Where each forward torch call ran (watched module, line of this file), by its output's autograd node."""

    def __init__(self, oracle: FirstBad) -> None:
        super().__init__()
        self.oracle = oracle

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() == -1:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t.grad_fn) not in self.oracle.made:
                    self.oracle.made[id(t.grad_fn)] = (self.oracle.stack[-1] if self.oracle.stack else None,
                                                       _case_line()[0])
                    self.oracle.keep.append(t.grad_fn)
        return out


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _oracle_run(program: Program9) -> dict[str, Any]:
    """The program without nantrace, each step under the oracle: the first step that fails, how, and where
    (``raised``: the step raised; ``loss``, ``grads``; ``params``: the update made them non-finite)."""
    model, opt = program.model, program.optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=program.init_scale) if program.amp is not None else None
    for step, batch in enumerate(program.batches):
        oracle = FirstBad(model)
        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(oracle._pre),
                 torch.nn.modules.module.register_module_forward_hook(oracle._post, always_call=True)]
        sites = NodeSites(oracle) if not program.fast_path else None
        try:
            if sites is not None:
                sites.__enter__()
            with oracle:
                if program.before_step is not None:
                    with torch.no_grad():
                        program.before_step(model, step)
                if scaler is not None and program.resume_scaler is not None and program.resume_scaler[0] == step:
                    scaler.load_state_dict(dict(program.resume_scaler[1]))
                try:
                    with torch.autograd.set_detect_anomaly(program.anomaly):
                        opt.zero_grad()
                        if scaler is None:
                            loss = run_step(program, program.loss, batch, step)
                        else:
                            with torch.autocast("cpu", dtype=program.amp):
                                loss = program.loss(model, batch, step)
                            scaler.scale(loss).backward()
                except Exception as exc:  # noqa: BLE001
                    return dict(step=step, what="raised", error=exc, origin=oracle.first)
        finally:
            if sites is not None:
                sites.__exit__(None, None, None)
            for h in hooks:
                h.remove()
        if not bool(torch.isfinite(loss).all()):
            return dict(step=step, what="loss", origin=oracle.first)
        if not _finite(p.grad for p in model.parameters()):
            return dict(step=step, what="grads", origin=oracle.first)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if not _finite(model.parameters()):
            return dict(step=step, what="params", origin=oracle.first)
    return dict(step=None, what=None, origin=None)


# ======================================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised", "nonfinite_param": "loss",
        "scaler_collapse": "params"}
"""What the plain run shows first: a parameter written non-finite between steps shows in the next loss; a
scaler that cannot unscale applies a NaN update."""


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program is finite until the expected step, fails there as the
    expected kind says, and the oracle names the expected op (a backward origin in torch's derivative: the
    expected forward op's node), phase, watched module and line; the healthy twin (``bad=False``) never fails."""
    build, want = CASES[name]
    run = _oracle_run(build())
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    origin = run["origin"]
    if want.kind == "nonfinite_param":  # the user's own write between the steps
        assert origin is not None and origin["line"] == origin_line(HERE, BETWEEN_TAG[name]), origin
    elif want.op is not None:
        assert origin is not None, run
        if origin["phase"] == "backward" and origin["node"] in _NODES.values():
            assert origin["node"] == _NODES[want.op], origin
        else:
            assert origin["op"] == want.op, origin
        assert (origin["phase"], origin["line"]) == (want.phase, origin_line(HERE, want.tag)), origin
        if origin["module"] is not None or want.module is None:
            assert origin["module"] == want.module, origin
    if want.kind == "exception":
        assert not isinstance(run["error"], nantrace.NonFiniteError)
    healthy = _oracle_run(build(bad=False))
    assert healthy["step"] is None, healthy


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train9(build(), replayable=mode == "replayable")
    if want.kind == "scaler_collapse":  # which op to name is not fixed by the contract: step, kind, cause, action
        got = JUDGE.got(run.incidents)
        assert got is not None, ("no incident", repr(run.error), [describe(i) for i in run.incidents])
        assert (got["step"], got["kind"], got["cause"], got["action"]) == (want.step, want.kind, want.cause, want.action), \
            [describe(i) + " | " + i.summary for i in run.incidents]
        assert run.error is None, repr(run.error)
        assert run.unchanged_at_incident is True, "the blocked step changed the weights"
        return
    if want.kind == "nonfinite_param":  # weights non-finite before step(): no skip can help, nantrace raises
        got = JUDGE.got(run.incidents)
        assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
        assert isinstance(run.error, nantrace.NonFiniteError) and run.error_step == want.step, repr(run.error)
        return
    assert_diagnosis(run, want, JUDGE)


QUIET_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("name,mode", case_params(QUIET, QUIET_XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No blocking incident; the program dies of its own error (or not at all) exactly as without nantrace, and
    leaves the model as the plain run does."""
    build, error = QUIET[name]
    plain_program, program = build(), build()
    plain = train9(plain_program, replayable=False, watched=False)
    run = train9(program, replayable=mode == "replayable")
    blocking = [describe(i) + " | " + i.summary for i in run.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert not [i for i in run.incidents if i.kind == "exception"], [describe(i) for i in run.incidents]
    assert type(run.error) is type(plain.error) and (error is None) == (run.error is None), (run.error, plain.error)
    if error is not None:
        assert isinstance(run.error, error) and run.error_step == plain.error_step, (repr(run.error), run.error_step)
        assert str(run.error) == str(plain.error)
    _assert_same_state(plain_program.model, program.model)


def test_quiet_constructions() -> None:
    """The quiet programs do what they claim without nantrace: the in-place cap raises at FAIL_STEP (and only
    then), the scaler skips exactly steps 0 and 5, the .data writes really change the weights."""
    plain = train9(_inplace(), replayable=False, watched=False)
    assert plain.error_step == FAIL_STEP and "inplace operation" in str(plain.error), repr(plain.error)
    program = _calibration()
    scaler = torch.amp.GradScaler("cpu", init_scale=program.init_scale)
    skipped = []
    for step, batch in enumerate(program.batches):
        scale = scaler.get_scale()
        _one_step(program, program.loss, batch, step, scaler)
        skipped.append(scaler.get_scale() < scale)
    assert skipped == [True, False, False, False, False, True, False], skipped
    program = _mean_teacher()
    teacher = [p.detach().clone() for p in program.model.teacher.parameters()]
    train9(program, replayable=False, watched=False)
    assert not same(teacher, [p.detach().clone() for p in program.model.teacher.parameters()])


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, differ


HEALTHY: dict[str, Callable[[], Program9]] = {
    **{name: functools.partial(CASES[name][0], bad=False) for name in (
        "optical_flow_charbonnier_eps0_anomaly_mode_padded_border_crop",
        "action_recogniser_anomaly_mode_accumulation_duplicated_frame_velocity",
        "accumulation_logit_adjustment_prior_recomputed_between_micro_batches_unseen_class",
        "jacobian_penalty_vmap_jacrev_functional_call_blank_input_sqrt",
        "importance_weights_from_vmap_per_sample_grad_norms_zero_padded_sample",
        "distillation_frozen_norm_first_teacher_fast_path_called_from_loss_empty_text",
        "deep_supervision_layers_from_loss_code_stochastic_depth_final_survival_zero",
        "expert_choice_routing_softmax_over_tokens_empty_document",
        "lsq_qat_fused_fake_quant_pruned_channel_zero_step_size_hand_written_backward",
        "amp_resume_scaler_state_of_collapsed_run_subnormal_scale")},
    "frozen_encoder_nested_tensor_and_mha_fast_path_probe": _frozen_probes,
    "mean_teacher_ema_data_copy_pruning_mask_and_dead_unit_reinit_through_data": _mean_teacher,
    "amp_fp16_init_scale_2_18_two_calibration_skips": _calibration,
}
"""Healthy programs (the failing cases' twins without their bad batch or setting, and the quiet ones)."""


def _taps(build: Callable[[], Program9], *, watched: bool, replayable: bool) -> tuple[list[torch.Tensor], Program9, Run]:
    global TAPS
    program = build()
    TAPS = []
    try:
        run = train9(program, replayable=replayable, watched=watched)
        return TAPS, program, run
    finally:
        TAPS = None


@pytest.mark.parametrize("name,mode", [pytest.param(n, m, id=f"{n}-{m}") for n in HEALTHY
                                       for m in ("zero_intrusive", "replayable")])
def test_nantrace_changes_nothing_on_healthy_steps(name: str, mode: str) -> None:
    """Watching changes nothing the steps compute: every model output the loss code saw (logits of the fused
    encoder paths, per-sample Jacobians and gradient norms of the functorch transforms, each exit of the layers
    run from the loss code, autocast outputs), in the same number and order, and the final state, are bit for
    bit those of the same loop without nantrace; no incident blocks anything."""
    build = HEALTHY[name]
    plain, plain_program, plain_run = _taps(build, watched=False, replayable=False)
    got, program, run = _taps(build, watched=True, replayable=mode == "replayable")
    assert plain_run.error is None and run.error is None, (plain_run.error, run.error)
    assert not [i for i in run.incidents if i.action != "logged"], [describe(i) for i in run.incidents]
    if plain_program.amp is not None and mode == "replayable":
        # a scaler's calibration skip reads non-finite scaled gradients: the step is replayed (docs/diagnosis.md
        # section 1), which re-runs the replayable loss function; each re-run must reproduce the real one bit for bit
        got = [t for k, t in enumerate(got) if not (k and t.shape == got[k - 1].shape and torch.equal(t, got[k - 1]))]
    assert len(got) == len(plain), (len(got), len(plain))
    differ = [k for k, (a, b) in enumerate(zip(plain, got)) if a.shape != b.shape or not torch.equal(a, b)]
    assert not differ, differ
    _assert_same_state(plain_program.model, program.model)


FUSED = ("aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention", "aten::_nested_tensor_from_mask",
         "aten::_masked_softmax")


def _fused_calls(build: Callable[[], Program9], watched: bool, replayable: bool) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train9(build(), replayable=replayable, watched=watched)
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name in FUSED:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


@pytest.mark.parametrize("mode", ["zero_intrusive", "replayable"])
@pytest.mark.parametrize("build", [_frozen_probes, functools.partial(_teacher, bad=False)], ids=["probes", "teacher"])
def test_fused_paths_stay_fused_under_watch(build: Callable[[], Program9], mode: str) -> None:
    """The frozen encoders and attention take torch's fused kernels exactly as often with nantrace watching as
    without (nantrace's hooks and modes must not move them to the slow path: same numbers is not enough, the slow
    path could agree by chance)."""
    plain = _fused_calls(build, watched=False, replayable=False)
    assert plain.get("aten::_transformer_encoder_layer_fwd", 0) >= 10, plain
    assert _fused_calls(build, watched=True, replayable=mode == "replayable") == plain
