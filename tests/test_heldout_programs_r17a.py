"""Held-out failures, round 17a: ADVANCED STEP STRUCTURES of research code, where the replay must re-create
what the step did.

1. Knowledge distillation with a frozen teacher that is a separate, unwatched ``nn.Module``: (a) the teacher
   run under ``no_grad`` before the student's forward and a hand-written KL whose ``log(p_t)`` meets an exact
   0 of an over-exposed frame; (b) decoupled KD (DKD) whose non-target renormalisation divides by
   ``1 - p_t[target]`` = 0 when the teacher is certain.
2. EMA target networks: (a) BYOL with a target updated after the optimizer step (between steps) and the
   target projection normalised by hand, a blank frame; (b) a mean teacher updated INSIDE the step's code
   (``lerp_`` before the student's forward) whose MixMatch sharpening ``p**(1/T) / sum`` underflows to 0/0.
3. WGAN-GP with ``torch.autograd.grad(create_graph=True)``: the interpolate of a blank real frame and its
   bias-free autoencoder reconstruction is exactly 0, the ReLU critic's input gradient is exactly 0 there, and
   ``sqrt(sum(g**2))`` has an infinite derivative (double backward).
4. MAML: (a) a second-order inner loop (``autograd.grad(create_graph=True)`` + ``functional_call``) whose
   support labels are off by one (the inner cross-entropy raises); (b) an inner step with ``torch.func.grad``
   and a cosine-classifier head meeting a blank query frame with the adapted weights.
5. Gradient checkpointing (``checkpoint(..., use_reentrant=False)``): (a) a log-energy front end's log(0) at a
   silent frame in the forward; (b) a learned filterbank's power-law compression ``|h|**0.3`` at an exactly-zero
   activation, infinite derivative in the recomputed backward.
6. ``torch.compile(model, backend="eager")`` with an RMSNorm without eps at an all-zero embedding row.
7. A custom ``autograd.Function``: a clipped straight-through estimator whose backward rescales by the
   fraction of activations inside the clip range, 0 on an over-exposed batch (0/0 in the user's backward).
8. Gradient accumulation (two micro-batches, ``(loss / 2).backward()`` each): (a) per-sample curriculum
   weights all 0 in the second micro-batch, ``sum(w * l) / sum(w)``; (b) a capsule-length ``sqrt`` of an
   exactly-zero capsule in the first micro-batch (backward).
9. A loss over a long sequence computed in chunks, a running sum divided by a count read to the host with
   ``int()``: an SFT sample whose prompt fills the whole window (every label -100).
10. Five QUIET programs (KD with kl_div log_target, BYOL with F.normalize, WGAN-GP with torch.norm, chunked loss with
    the count clamped to 1; a dithered checkpointed filterbank), fed the same bad data.

How expectations were derived: each was written from the construction before nantrace ran, following
/work/shared/API.md and docs/diagnosis.md: the origin is the op that made the first non-finite value (or the
op that made the infinity it received: ``log`` for ``p * log(p)``); for a failure seen in the gradients, the
forward op whose derivative made the first non-finite gradient, or the op of the user's own ``backward``;
module ``None`` for the loss code (an unwatched teacher/target/autoencoder runs there too), the innermost
watched module otherwise (names without ``_orig_mod``, as in r4/r8c); a division by the norm of a zero vector
or an RMS without eps of a zero row is ``zero_variance_norm``, a division by a zero count/sum/fraction is
``div_by_zero``, a chunked loss whose labels are all the ignore index is ``label_out_of_range`` (the
convention of r7's chunked lm-head case), a class index outside ``[0, C)`` raising in ``nll_loss`` is
``label_out_of_range`` with kind ``exception``. The constructions were checked WITHOUT nantrace
(``test_cases_fail_without_nantrace``): the first failing step and what failed, the first op that made a
non-finite value (a ``TorchDispatchMode`` of this file's own, with the module and this file's line), and for a
gradient the first autograd node whose output went non-finite (a post-hook on every node).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint

from heldout_harness import MODES, Judge, Program, assert_diagnosis, case_params, describe, run_step, sgd, steps, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL = 2
STEPS = 4
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


def raised(phase: str, op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want("exception", phase, op, module, tag, cause, step=FAIL, action="raised")


def want(kind: str, phase: str, op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want(kind, phase, op, module, tag, cause, step=FAIL)


# ======================================================================= 1. knowledge distillation
class ConvLikeStudent(nn.Module):
    def __init__(self, d: int = 16, c: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 32)
        self.fc2 = nn.Linear(32, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Teacher(nn.Module):
    def __init__(self, d: int = 16, c: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _frames(g: torch.Generator, n: int = 16, d: int = 16, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(n, d, generator=g) * gain


# 1a. Hinton KD, teacher run under no_grad BEFORE the student's forward, KL written out by hand. An
#     over-exposed frame (x 1000) saturates the teacher: softmax(t / 2) has exact zeros, log(0) = -inf,
#     0 * -inf = NaN in the KL.
@case("kd_teacher_before_student_hand_kl_overexposed_frame",
      want("nonfinite_loss", "forward", "aten.log.default", None, "kd_log", "log_nonpositive"))
def _kd_hand_kl() -> Program:
    torch.manual_seed(0)
    student, teacher = ConvLikeStudent(), Teacher().eval().requires_grad_(False)
    g = _gen(1701)

    def batch(s: int, bad: bool = False) -> Any:
        x = _frames(g)
        if bad:
            x[3] *= 1000.0
        return x, torch.randint(0, 8, (16,), generator=g)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        x, y = b
        with torch.no_grad():
            t = teacher(x)
        logits = m(x)
        T = 2.0
        p_t = F.softmax(t / T, dim=1)
        log_q = F.log_softmax(logits / T, dim=1)
        kl = (p_t * (torch.log(p_t) - log_q)).sum(1).mean()  # <origin:kd_log>
        return 0.5 * F.cross_entropy(logits, y) + 0.5 * T * T * kl

    return Program(student, sgd(student), _steps(batch, lambda s: batch(s, True)), loss)


# 1b. Decoupled KD (DKD): the non-target distribution is p * (1 - gt) / (1 - p[gt]); a teacher certain of
#     the labelled class (p[gt] rounds to exactly 1 on an over-exposed frame, the others to 0) gives 0 / 0.
@case("dkd_non_target_renormalisation_certain_teacher",
      want("nonfinite_loss", "forward", "aten.div.Tensor", None, "dkd_div", "div_by_zero"))
def _dkd() -> Program:
    torch.manual_seed(1)
    student, teacher = ConvLikeStudent(), Teacher().eval().requires_grad_(False)
    g = _gen(1702)

    def batch(s: int, bad: bool = False) -> Any:
        x = _frames(g)
        if bad:
            x[5] *= 1000.0
        with torch.no_grad():
            y = teacher(x).argmax(1)  # labels agree with the teacher (a pseudo-labelled shard)
        return x, y

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        x, y = b
        logits = m(x)
        with torch.no_grad():
            t = teacher(x)
        T = 4.0
        gt = F.one_hot(y, 8).float()
        p_t, p_s = F.softmax(t / T, 1), F.softmax(logits / T, 1)
        pt_nt = p_t * (1 - gt) / (1 - (p_t * gt).sum(1, keepdim=True))  # <origin:dkd_div>
        ps_nt = p_s * (1 - gt) / (1 - (p_s * gt).sum(1, keepdim=True) + 1e-8)
        nckd = (pt_nt * (torch.log(pt_nt + 1e-12) - torch.log(ps_nt + 1e-12))).sum(1).mean()
        return F.cross_entropy(logits, y) + T * T * nckd

    return Program(student, sgd(student), _steps(batch, lambda s: batch(s, True)), loss)


# ======================================================================= 2. EMA target networks
class ByolOnline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False))
        self.projector = nn.Linear(16, 16, bias=False)
        self.predictor = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.projector(self.encoder(x)))


class ByolTarget(nn.Module):
    def __init__(self, online: ByolOnline) -> None:
        super().__init__()
        self.encoder = copy.deepcopy(online.encoder).requires_grad_(False)
        self.projector = copy.deepcopy(online.projector).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))


def _byol(safe: bool) -> Program:
    torch.manual_seed(2)
    online = ByolOnline()
    target = ByolTarget(online)
    g = _gen(1703)

    def batch(s: int, bad: bool = False) -> Any:
        x = _frames(g)
        if bad:
            x[7] = 0.0  # a blank frame: both views are blank
        return x, x + 0.1 * torch.randn(16, 16, generator=g) * (x.abs().sum(1, keepdim=True) > 0)

    def before_step(m: nn.Module, s: int) -> None:  # EMA of the target after the previous optimizer step
        for tp, op in zip(target.parameters(), list(m.encoder.parameters()) + list(m.projector.parameters())):
            tp.mul_(0.99).add_(op.detach(), alpha=0.01)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        x1, x2 = b
        p = m(x1)
        with torch.no_grad():
            z = target(x2)
        if safe:
            p, z = F.normalize(p, dim=-1), F.normalize(z, dim=-1)
        else:
            p = p / p.norm(dim=-1, keepdim=True)
            z = z / z.norm(dim=-1, keepdim=True)  # <origin:byol_norm>
        return (2 - 2 * (p * z).sum(-1)).mean()

    return Program(online, sgd(online, lr=0.05), _steps(batch, lambda s: batch(s, True)), loss, before_step=before_step)


@case("byol_ema_target_after_step_hand_normalised_blank_frame",
      want("nonfinite_loss", "forward", "aten.div.Tensor", None, "byol_norm", "zero_variance_norm"))
def _byol_bad() -> Program:
    return _byol(False)


@quiet("byol_ema_target_f_normalize_blank_frame")
def _byol_quiet() -> Program:
    return _byol(True)


# 2b. Mean teacher (MixMatch-style sharpening), the EMA applied inside the step's code before the student's
#     forward. A faint frame leaves the teacher unsure (every p < 0.35), p ** 100 underflows to exactly 0 in
#     every class, and the renormalisation is 0 / 0.
@case("mean_teacher_ema_in_step_sharpening_underflow_faint_frame",
      want("nonfinite_loss", "forward", "aten.div.Tensor", None, "sharpen_div", "div_by_zero"))
def _mean_teacher() -> Program:
    torch.manual_seed(3)
    student = ConvLikeStudent()
    teacher = copy.deepcopy(student).requires_grad_(False)
    g = _gen(1704)

    def batch(s: int, bad: bool = False) -> Any:
        x = _frames(g, gain=50.0)
        if bad:
            x[2] *= 1e-4
        return x, torch.randint(0, 8, (16,), generator=g)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        x, y = b
        with torch.no_grad():
            for tp, sp in zip(teacher.parameters(), m.parameters()):
                tp.lerp_(sp.detach(), 0.01)
            pt = F.softmax(teacher(x), 1)
            sharp = pt ** (1 / 0.01)
            target = sharp / sharp.sum(1, keepdim=True)  # <origin:sharpen_div>
        logits = m(x + 0.05 * torch.randn_like(x))
        return F.cross_entropy(logits, y) - (target * F.log_softmax(logits, 1)).sum(1).mean()

    return Program(student, sgd(student), _steps(batch, lambda s: batch(s, True)), loss)


# ======================================================================= 3. WGAN-GP
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32, bias=False)  # DCGAN-style bias-free first layer
        self.act = nn.ReLU()
        self.l2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.act(self.l1(x)))


def _wgan(safe: bool) -> Program:
    torch.manual_seed(4)
    critic = Critic()
    ae = nn.Sequential(nn.Linear(16, 8, bias=False), nn.ReLU(), nn.Linear(8, 16, bias=False)).requires_grad_(False)
    g = _gen(1705)

    def batch(s: int, bad: bool = False) -> Any:
        x = _frames(g).abs()
        if bad:
            x[4] = 0.0  # a blank frame in the real batch
        return x

    def loss(m: nn.Module, real: torch.Tensor, s: int) -> torch.Tensor:
        with torch.no_grad():
            fake = ae(real)  # the reconstruction is the "fake"
        alpha = torch.rand(real.size(0), 1)
        x_hat = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        d_hat = m(x_hat)
        grad = torch.autograd.grad(d_hat.sum(), x_hat, create_graph=True)[0]
        if safe:
            gnorm = grad.norm(2, dim=1)
        else:
            gnorm = torch.sqrt(grad.pow(2).sum(1))  # <origin:gp_sqrt>
        gp = ((gnorm - 1) ** 2).mean()
        return m(fake).mean() - m(real).mean() + 10.0 * gp

    return Program(critic, torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9)),
                   _steps(batch, lambda s: batch(s, True)), loss)


@case("wgan_gp_sqrt_sum_squares_interpolate_equals_blank_real",
      want("nonfinite_grad", "backward", "aten.sqrt.default", None, "gp_sqrt", "grad_singularity"))
def _wgan_bad() -> Program:
    return _wgan(False)


@quiet("wgan_gp_torch_norm_interpolate_equals_blank_real")
def _wgan_quiet() -> Program:
    return _wgan(True)


# ======================================================================= 4. MAML / functional inner loops
class FewShotMLP(nn.Module):
    def __init__(self, d: int = 8, n_way: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.ReLU())
        self.head = nn.Linear(32, n_way)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


# 4a. Second-order MAML: the episode sampler labels the support set 1..n_way instead of 0..n_way-1 on one
#     episode; the inner cross-entropy raises.
@case("maml_second_order_functional_call_support_labels_off_by_one",
      raised("forward", "aten.nll_loss_forward.default", None, "maml_inner", "label_out_of_range"))
def _maml() -> Program:
    torch.manual_seed(5)
    model = FewShotMLP()
    g = _gen(1706)

    def batch(s: int, bad: bool = False) -> Any:
        ys = torch.arange(5).repeat(2)
        return (torch.randn(10, 8, generator=g), ys + 1 if bad else ys, torch.randn(15, 8, generator=g),
                torch.arange(5).repeat(3))

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        xs, ys, xq, yq = b
        params = dict(m.named_parameters())
        for _ in range(2):
            inner = F.cross_entropy(functional_call(m, params, (xs,)), ys)  # <origin:maml_inner>
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            params = {k: v - 0.1 * gr for (k, v), gr in zip(params.items(), grads)}
        return F.cross_entropy(functional_call(m, params, (xq,)), yq)

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), _steps(batch, lambda s: batch(s, True)), loss)


class CosineHead(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x / x.norm(dim=1, keepdim=True)  # <origin:cos_head>
        w = self.weight / self.weight.norm(dim=1, keepdim=True)
        return 10.0 * x @ w.t()


class CosineNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Linear(16, 32, bias=False)
        self.act = nn.ReLU()
        self.head = CosineHead(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.feat(x)))


# 4b. One inner step with torch.func.grad over functional_call, then the query loss with the adapted weights;
#     a blank query frame through the bias-free feature layer is a zero vector in the cosine head.
@case("func_grad_inner_step_cosine_head_blank_query_frame",
      want("nonfinite_loss", "forward", "aten.div.Tensor", "head", "cos_head", "zero_variance_norm"))
def _func_grad() -> Program:
    torch.manual_seed(6)
    model = CosineNet()
    g = _gen(1707)

    def batch(s: int, bad: bool = False) -> Any:
        xq = torch.randn(15, 16, generator=g)
        if bad:
            xq[6] = 0.0
        return torch.randn(10, 16, generator=g), torch.arange(5).repeat(2), xq, torch.arange(5).repeat(3)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        xs, ys, xq, yq = b
        params = dict(m.named_parameters())

        def inner(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return F.cross_entropy(functional_call(m, p, (xs,)), ys)

        grads = torch.func.grad(inner)(params)
        fast = {k: params[k] - 0.1 * grads[k] for k in params}
        return F.cross_entropy(functional_call(m, fast, (xq,)), yq)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), loss)


# ======================================================================= 5. gradient checkpointing
class LogEnergyBlock(nn.Module):
    def __init__(self, f: int = 16, d: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(f + 1, d)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        energy = frames.pow(2).mean(-1, keepdim=True)
        feats = torch.cat([frames, torch.log(energy)], -1)  # <origin:ckpt_log>
        return F.gelu(self.proj(feats))


class CheckpointedTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = LogEnergyBlock()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False)
        return self.head(h.mean(1))


@case("checkpointed_log_energy_block_silent_frame",
      want("nonfinite_loss", "forward", "aten.log.default", "block", "ckpt_log", "log_nonpositive"))
def _ckpt_log() -> Program:
    torch.manual_seed(7)
    model = CheckpointedTagger()
    g = _gen(1708)

    def batch(s: int, bad: bool = False) -> Any:
        x = torch.randn(8, 6, 16, generator=g)
        if bad:
            x[1, 2] = 0.0  # a silent frame
        return x, torch.randint(0, 4, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


class FilterbankBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.filterbank = nn.Linear(16, 24, bias=False)
        self.mix = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fb = self.filterbank(x)
        c = fb.abs().pow(0.3)  # <origin:ckpt_pow>
        return F.gelu(self.mix(c))


class CheckpointedFilterbankNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([FilterbankBlock()])
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=False)
        return self.head(h.mean(1))


@case("checkpointed_filterbank_power_compression_silent_frame_backward",
      want("nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", "blocks.0", "ckpt_pow", "grad_singularity"))
def _ckpt_pow() -> Program:
    torch.manual_seed(8)
    model = CheckpointedFilterbankNet()
    g = _gen(1709)

    def batch(s: int, bad: bool = False) -> Any:
        x = torch.randn(8, 6, 16, generator=g)
        if bad:
            x[3, 4] = 0.0
        return x, torch.randint(0, 4, (8,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ======================================================================= 6. torch.compile (eager backend)
class RMSNormNoEps(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight  # <origin:compiled_rms>


class TinyRMSClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16, bias=False)
        self.norm = RMSNormNoEps(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


@case("compiled_eager_rmsnorm_without_eps_zero_feature_row",
      want("nonfinite_loss", "forward", "aten.rsqrt.default", "norm", "compiled_rms", "zero_variance_norm"))
def _compiled() -> Program:
    torch.manual_seed(9)
    model = TinyRMSClassifier()
    opt = sgd(model)
    g = _gen(1710)

    def batch(s: int, bad: bool = False) -> Any:
        x = torch.randn(8, 12, generator=g)
        if bad:
            x[0] = 0.0
        return x, torch.randint(0, 3, (8,), generator=g)

    return Program(torch.compile(model, backend="eager"), opt, _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ======================================================================= 7. custom autograd.Function
class ClippedSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x.abs() <= 1)
        return torch.sign(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (inside,) = ctx.saved_tensors
        keep = inside.float()
        return grad * keep / keep.mean()  # <origin:ste_div>


class BinaryAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClippedSTE.apply(x)


class BinaryMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = BinaryAct()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act1(self.fc1(x)))


@case("binarised_mlp_clipped_ste_rescaled_by_fraction_overexposed_batch",
      want("nonfinite_grad", "backward", "aten.div.Tensor", "act1", "ste_div", "div_by_zero"))
def _ste() -> Program:
    torch.manual_seed(10)
    model = BinaryMLP()
    g = _gen(1711)

    def batch(s: int, bad: bool = False) -> Any:
        x = torch.randn(16, 16, generator=g) * 0.3
        if bad:
            x = x * 1e5  # an unnormalised shard: every pre-activation far outside [-1, 1]
        return x, torch.randint(0, 4, (16,), generator=g)

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ======================================================================= 8. gradient accumulation
@case("accumulation_curriculum_weights_all_zero_in_second_micro_batch",
      want("nonfinite_loss", "forward", "aten.div.Tensor", None, "accum_wsum", "div_by_zero"))
def _accum_weights() -> Program:
    torch.manual_seed(11)
    model = ConvLikeStudent()
    g = _gen(1712)

    def micro(bad: bool) -> Any:
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)
        difficulty = torch.rand(8, generator=g) + (2.0 if bad else 0.0)
        return x, y, (difficulty < 0.9).float()  # the curriculum keeps the easy samples

    def batch(s: int, bad: bool = False) -> Any:
        return [micro(False), micro(bad)]

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        x, y, w = b
        per = F.cross_entropy(m(x), y, reduction="none")
        return (per * w).sum() / w.sum()  # <origin:accum_wsum>

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), loss, accum=True)


class CapsuleLengths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.caps = nn.Linear(12, 16, bias=False)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.caps(x).view(-1, 4, 4)
        lengths = torch.sqrt(u.pow(2).sum(-1))  # <origin:caps_sqrt>
        return self.head(lengths)


@case("accumulation_capsule_length_zero_capsule_first_micro_batch",
      want("nonfinite_grad", "backward", "aten.sqrt.default", "", "caps_sqrt", "grad_singularity"))
def _accum_caps() -> Program:
    torch.manual_seed(12)
    model = CapsuleLengths()
    g = _gen(1713)

    def micro(bad: bool) -> Any:
        x = torch.randn(8, 12, generator=g)
        if bad:
            x[5] = 0.0
        return x, torch.randint(0, 3, (8,), generator=g)

    def batch(s: int, bad: bool = False) -> Any:
        return [micro(bad), micro(False)]

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), accum=True)


# ======================================================================= 9. chunked loss over a long sequence
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + F.gelu(self.mix(torch.cumsum(h, 1) / torch.arange(1, tokens.size(1) + 1)[None, :, None]))
        return self.lm_head(h)


def _chunked(safe: bool) -> Program:
    torch.manual_seed(13)
    model = TinyLM()
    g = _gen(1714)
    T, CHUNK = 24, 8

    def batch(s: int, bad: bool = False) -> Any:
        tokens = torch.randint(0, 32, (2, T), generator=g)
        labels = tokens.clone()
        prompt = T if bad else 6  # SFT: the prompt's labels are masked; one prompt fills the window
        labels[:, :prompt] = -100
        return tokens, labels

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        tokens, labels = b
        logits = m(tokens)[:, :-1]
        labels = labels[:, 1:]
        total, count = logits.new_zeros(()), 0
        for start in range(0, labels.size(1), CHUNK):
            lc, yc = logits[:, start:start + CHUNK], labels[:, start:start + CHUNK]
            total = total + F.cross_entropy(lc.reshape(-1, lc.size(-1)), yc.reshape(-1), ignore_index=-100,
                                            reduction="sum")
            count += int((yc != -100).sum())
        if safe:
            return total / max(count, 1)
        return total / count  # <origin:chunk_div>

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), loss)


@case("chunked_sft_loss_running_sum_over_host_count_prompt_fills_window",
      want("nonfinite_loss", "forward", "aten.div.Tensor", None, "chunk_div", "label_out_of_range"))
def _chunked_bad() -> Program:
    return _chunked(False)


@quiet("chunked_sft_loss_count_clamped_prompt_fills_window")
def _chunked_quiet() -> Program:
    return _chunked(True)


# ======================================================================= 10. more quiet programs
@quiet("kd_teacher_before_student_kl_div_log_target_overexposed_frame")
def _kd_quiet() -> Program:
    torch.manual_seed(0)
    student, teacher = ConvLikeStudent(), Teacher().eval().requires_grad_(False)
    g = _gen(1701)

    def batch(s: int, bad: bool = False) -> Any:
        x = _frames(g)
        if bad:
            x[3] *= 1000.0
        return x, torch.randint(0, 8, (16,), generator=g)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        x, y = b
        with torch.no_grad():
            t = teacher(x)
        logits = m(x)
        T = 2.0
        kl = F.kl_div(F.log_softmax(logits / T, 1), F.log_softmax(t / T, 1), log_target=True, reduction="batchmean")
        return 0.5 * F.cross_entropy(logits, y) + 0.5 * T * T * kl

    return Program(student, sgd(student), _steps(batch, lambda s: batch(s, True)), loss)


@quiet("checkpointed_filterbank_power_compression_with_floor_silent_frame")
def _ckpt_quiet() -> Program:
    torch.manual_seed(8)
    model = CheckpointedFilterbankNet()
    g = _gen(1709)

    def batch(s: int, bad: bool = False) -> Any:
        x = torch.randn(8, 6, 16, generator=g)
        if bad:
            x[3, 4] = 0.0
        return x, torch.randint(0, 4, (8,), generator=g)

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        return F.cross_entropy(m(b[0] + 1e-3), b[1])  # a dither floor: no exactly-zero filterbank output

    return Program(model, sgd(model), _steps(batch, lambda s: batch(s, True)), loss)



# ======================================================================= the independent checks
class FirstNonFinite(TorchDispatchMode):
    """The first dispatched op that made a non-finite value: its output holds NaN while no input did, or an
    infinity while every input and scalar argument was finite (an explicit -inf fill is not a creation).
    Notes the innermost module of ``model`` running (a compiled wrapper's ``_orig_mod.`` prefix dropped) (torch's global module hooks) and the deepest line of
    this file on the Python stack; also the op that raised, if one did."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): ("" if n == "_orig_mod" else n.removeprefix("_orig_mod.")) for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.found: tuple[str, str | None, int | None] | None = None
        self.raised: tuple[str, str | None, int | None] | None = None

    def __enter__(self) -> FirstNonFinite:
        pre = nn.modules.module.register_module_forward_pre_hook(self._push)
        post = nn.modules.module.register_module_forward_hook(self._pop)
        self._hooks = (pre, post)
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
        if self.found is None:  # read before the op runs: an in-place op writes its input
            flat_in = tree_flatten((args, kwargs))[0]
            ins = [t for t in flat_in if isinstance(t, torch.Tensor) and t.is_floating_point()]
            nums = [x for x in flat_in if isinstance(x, float)]
            in_nan = any(bool(t.isnan().any()) for t in ins)
            in_bad = in_nan or any(not bool(t.isfinite().all()) for t in ins) or any(not math.isfinite(x) for x in nums)
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.raised is None:
                self.raised = (str(func), *self._where())
            raise
        if self.found is None:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            out_nan = any(bool(t.isnan().any()) for t in outs)
            out_inf = any(bool(t.isinf().any()) for t in outs)
            if (out_nan and not in_nan) or (out_inf and not in_bad):
                self.found = (str(func), *self._where())
        return out




def first_nonfinite_node(loss: torch.Tensor) -> str | None:
    """The first autograd node, in the order the backward ran them, whose outputs (the gradients it passes on)
    hold a non-finite value while the gradients it received were finite (a post-hook on every node)."""
    found: list[str] = []
    seen, todo, hooks = set(), [loss.grad_fn], []

    def hook(node: Any) -> Callable:
        def check(grad_inputs: Any, grad_outputs: Any) -> None:
            ok_in = _finite(g for g in grad_outputs if isinstance(g, torch.Tensor))
            ok_out = _finite(g for g in grad_inputs if isinstance(g, torch.Tensor))
            if ok_in and not ok_out and not found:
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
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _clone(batch: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


def _micro(program: Program, batch: Any) -> list[Any]:
    return list(batch) if program.accum else [batch]


def plain_run(program: Program) -> dict[str, Any]:
    """The loop without nantrace (before_step included): the first step whose loss or gradients are
    non-finite, that raises, or whose update is non-finite, and what; at that step the origin from
    FirstNonFinite over the step's loss code (each micro-batch, from the same state and RNG), and for a
    gradient the first autograd node that went non-finite."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        if program.before_step is not None:
            with torch.no_grad():
                program.before_step(model, step)
        opt.zero_grad()
        received = _clone(batch)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        try:
            loss = run_step(program, program.loss, batch, step)
        except Exception as exc:
            torch.set_rng_state(rng)
            mode = FirstNonFinite(model)
            with pytest.raises(type(exc)), mode:
                for mb in _micro(program, received):
                    program.loss(model, mb, step)
            return dict(step=step, what="raised", error=exc, origin=mode.raised)
        grads_ok = _finite(p.grad for p in model.parameters())
        loss_ok = bool(torch.isfinite(loss).all())
        if not (loss_ok and grads_ok):
            return dict(step=step, what="loss" if not loss_ok else "grads", state=state, rng=rng, received=received)
        opt.step()
        if not _finite(model.parameters()):
            return dict(step=step, what="params")
    return dict(step=None, what=None)


def origin_at_failure(program: Program, run: dict[str, Any]) -> dict[str, Any]:
    """Re-runs the failing step's loss code (each micro-batch in order) from the state it started from."""
    model = program.model
    model.load_state_dict(run["state"])
    torch.set_rng_state(run["rng"])
    mode, node = FirstNonFinite(model), None
    with mode:
        for mb in _micro(program, _clone(run["received"])):
            program.loss(model, mb, run["step"])
    if run["what"] == "grads":
        torch.set_rng_state(run["rng"])
        for mb in _micro(program, _clone(run["received"])):
            model.zero_grad()
            node = first_nonfinite_node(program.loss(model, mb, run["step"]))
            if node is not None:
                break
    return dict(origin=mode.found, node=node)


# ======================================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised"}
BACKWARD_NODE = {"aten.sqrt.default": "SqrtBackward0", "aten.pow.Tensor_Scalar": "PowBackward0",
                 "aten.div.Tensor": "ClippedSTEBackward"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace the program fails first at the expected step in the expected way;
    the first op that made a non-finite value (or raised) is the expected op, in the expected module, on the
    marked line; a backward origin is the expected autograd node, with a finite forward."""
    build, want = CASES[name]
    program = build()
    run = plain_run(program)
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    if want.kind == "exception":
        op, module, line = run["origin"]
    else:
        found = origin_at_failure(program, run)
        if want.phase == "backward":
            assert found["node"] == BACKWARD_NODE[want.op] and found["origin"] is None, found
            return
        op, module, line = found["origin"]
    assert (op, module) == (want.op, want.module), (op, module)
    assert line == JUDGE.marked(want.tag)[1], (line, JUDGE.marked(want.tag))


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
