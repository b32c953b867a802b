"""Held-out failures, round 6d: the OPTIMIZER STEP and TRAINING DYNAMICS, part two.

Round 5a covered LAMB, Adafactor, Sophia, torch's Adam with eps 0 on each code path, NaN learning
rates and weight decays from schedules, a parameter group with an infinite learning rate, and six
divergences (100x learning rate, a momentum typo, a tanh RNN, an LR-range test, drifting inputs,
a post-norm chain). This round takes other optimizers and other dynamics, each as a stand-alone
script (model class, loss, loop data):

1. Failures born in the optimizer's own code: an AdamW written from scratch with ``betas=(0.9,
   1.0)`` from a sweep (its bias correction ``1 - beta2**t`` is 0, ``v / 0 = 0 / 0``); SAM whose
   first step divides rho by the norm of an all-zero gradient (a batch without labelled samples);
   Muon's Newton-Schulz normalisation ``G / ||G||`` on the layer in front of a zero-initialised
   projection; adaptive gradient clipping (AGC) written by hand on an embedding's padding row
   (``0 / 0`` of two unit norms); Shampoo's inverse fourth root of a statistics matrix that one
   batch leaves rank-deficient (eigenvalues negative by rounding); K-FAC inverting the input
   covariance of a batch with a dead feature (``linalg.inv`` refuses a singular matrix); SGLD
   whose noise scale ``sqrt(2 lr / T)`` meets an annealed temperature of 0; a Riemannian SGD on
   the unit sphere whose retraction normalises an all-zero padding row.

   Expected, as round 5a's docstring derives from docs/api.md: kind ``nonfinite_param`` (``exception``
   when the step raised), phase ``optimizer``, op = the op that made the first non-finite value,
   module = the module holding the first parameter written non-finite, source = the optimizer's
   own line (Python optimizers); cause ``div_by_zero`` when the divisor is a quantity of this step
   (a gradient norm, the updated parameter's norm), ``optimizer_state`` when it is the optimizer's
   state or a hyper-parameter (beta2 = 1, a temperature of 0, a singular statistics matrix kept as
   state). Gradient code between ``backward()`` and ``step()`` that is not the optimizer's (AGC in
   the loop) follows round 3a's normalised-gradient case: ``nonfinite_grad``, phase ``backward``,
   module ``None``, source its line, ``zero_variance_norm`` for a division by the norm of an
   all-zero vector. SAM's first step writes the weights before ``step()`` is called, so skipping
   cannot repair them: its action is ``raised``, as for any weight already non-finite at a step.

2. DIVERGENCE without a domain error: a cubic feature network whose loss grows super-exponentially
   (log-loss convex, the case the detector's straight-line R^2 >= 0.8 gate is known to miss),
   CyclicLR with ``max_lr`` a hundred times too high, a linear-decay LambdaLR left running past its
   end (a negative learning rate: gradient ascent), the linear scaling rule applied to a batch
   size raised 8x mid-run, timm's Lookahead called with another package's positional arguments
   (alpha = 5, synced every step), hypergradient descent (SGD-HD) whose learned learning rate runs
   away, and off-policy TD(0) with linear features on Baird's counterexample. Expected: the divergence
   incident of docs/escalation.md (``loss_spike``/``loss_divergence``, or ``grad_explosion``/
   ``gradient_explosion`` when the gradient norm's growth began first), op and module ``None``, at
   or after the step where the documented rule first holds on the plain run's series (round 5a's
   ``_rule_step``, written independently of nantrace) and before the first non-finite value.

How expectations were derived: each was written from the construction before nantrace ran. The
constructions are checked with plain torch (``test_cases_fail_without_nantrace``) by an op oracle
written here (``FirstBad``, a TorchDispatchMode): the step, the first op whose floating inputs were
finite and whose output (or in-place argument) was not, the source line in this file that issued
it, whether it ran inside an ``Optimizer`` method, and the first parameter it made non-finite; for
the divergences, the rule's step on the loss and gradient-norm series, the series that began to
grow first, and the first non-finite step.
"""

from __future__ import annotations

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import MODES, Judge, Program, assert_diagnosis, case_params, describe, run_step, sgd, train
from test_heldout_programs_r5a import _rule_step
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

JUDGE = Judge(__file__)
HERE = os.path.abspath(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
DIVERGING: set[str] = set()
"""Cases whose expected step is the divergence rule's step (computed from the plain run)."""
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
_WHY: dict[str, str] = {}
XFAIL.update({f"{name}[{mode}]": why for name, why in _WHY.items() for mode in MODES})


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


def _labelled_blobs(g: torch.Generator, n: int, d: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, classes, (n,), generator=g)
    centres = torch.linspace(-1.0, 1.0, classes)[:, None] * torch.ones(classes, d)
    return centres[y] + 0.5 * torch.randn(n, d, generator=g), y


# ================================================================= 1. the optimizer step
# 1a. "AdamW from scratch" (as written in course assignments: no argument checks) run from a sweep
#     grid over beta2 whose last value is 1.0 ("no second-moment decay"). With beta2 = 1 the second
#     moment never moves from 0 (1 - beta2 = 0) and its bias correction 1 - beta2**t is 0: v_hat =
#     0 / 0 = NaN at the first step, in the first parameter the loop reaches.
class ScratchAdamW(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
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
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["m"] / (1 - b1 ** st["t"])
                v_hat = st["v"] / (1 - b2 ** st["t"])  # <origin:adamw_v_hat>
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])


class ResMLP(nn.Module):
    def __init__(self, d_in: int = 12, d: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h + self.block(h))


@case("scratch_adamw_beta2_one_from_sweep_bias_correction_zero",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "stem", "adamw_v_hat", "optimizer_state", step=0))
def _scratch_adamw() -> Program:
    torch.manual_seed(0)
    model = ResMLP()
    sweep = {"beta2": [0.95, 0.98, 0.99, 1.0]}
    opt = ScratchAdamW(model.parameters(), lr=3e-4, betas=(0.9, sweep["beta2"][-1]))
    g = torch.Generator().manual_seed(601)
    return Program(model, opt, _steps(lambda s: _labelled_blobs(g, 16, 12, 4), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1b. SAM (Foret et al.), the usual two-pass loop: first_step() after the first backward, a second
#     forward/backward at the perturbed weights, then step() (= second_step). Written without the
#     reference code's "+ 1e-12". Semi-supervised batches: the loss is averaged over the labelled
#     samples only, and batch 3 holds none: loss 0, every gradient exactly 0, grad_norm 0, and
#     rho / 0 = inf; e_w = 0 * inf = NaN in every parameter, the first of which is features.0's.
#     The weights are NaN before step() is called, so skipping the update cannot repair them: the
#     action is "raised" (as for any parameter already non-finite at the step: test_optimizer_phase.py).
class SAM(torch.optim.Optimizer):
    def __init__(self, params: Any, base_optimizer: type, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / grad_norm  # <origin:sam_scale>
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # back to "w" from "w + e(w)"
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.second_step()

    def _grad_norm(self) -> torch.Tensor:
        return torch.norm(torch.stack([p.grad.norm(p=2) for group in self.param_groups for p in group["params"]
                                       if p.grad is not None]), p=2)


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.classifier = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def labelled_only_ce(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, labelled = batch
    ce = F.cross_entropy(model(x), y, reduction="none")
    return (ce * labelled).sum() / labelled.sum().clamp(min=1)


@case("sam_first_step_zero_gradient_batch_without_labels",
      Want("nonfinite_param", "optimizer", "aten.reciprocal.default", "features.0", "sam_scale", "div_by_zero",
           action="raised"))
def _sam() -> Program:
    torch.manual_seed(0)
    model = WideMLP()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(602)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        x, y = _labelled_blobs(g, 16, 20, 5)
        labelled = (torch.rand(16, generator=g) < 0.25).float()
        labelled[step % 16] = 1.0
        if step == 3:
            labelled.zero_()  # the sampler drew only unlabelled images
        return x, y, labelled

    batches = _steps(batch, 5)

    def between(m: nn.Module, o: SAM, step: int) -> None:
        o.first_step(zero_grad=True)
        labelled_only_ce(m, batches[step], step).backward()  # the second pass, at w + e(w)

    return Program(model, opt, batches, labelled_only_ce, between=between)


# 1c. Muon (Keller Jordan's MuonWithAuxAdam: Muon for hidden matrices, Adam for the rest) with the
#     Newton-Schulz normalisation written as X / ||X|| (the reference adds 1e-7). modded-nanogpt
#     zero-initialises each block's output projection, so at the first step the layer in front of
#     it (fc) gets an exactly zero gradient: its momentum is 0, ||X|| = 0, and 0 / 0 = NaN.
def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True)  # <origin:muon_norm>
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class MuonWithAuxAdam(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        for group in param_groups:
            if group["use_muon"]:
                group.setdefault("lr", 0.02)
                group.setdefault("momentum", 0.95)
                group.setdefault("weight_decay", 0.0)
            else:
                group.setdefault("lr", 3e-4)
                group.setdefault("betas", (0.9, 0.95))
                group.setdefault("eps", 1e-10)
                group.setdefault("weight_decay", 0.0)
        super().__init__(param_groups, dict())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if group["use_muon"]:
                    if not st:
                        st["momentum_buffer"] = torch.zeros_like(p)
                    buf = st["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    update = p.grad.lerp(buf, group["momentum"])  # nesterov
                    update = zeropower_via_newtonschulz5(update) * max(1, p.size(-2) / p.size(-1)) ** 0.5
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.reshape(p.shape).to(p.dtype), alpha=-group["lr"])
                else:
                    if not st:
                        st["exp_avg"], st["exp_avg_sq"], st["step"] = torch.zeros_like(p), torch.zeros_like(p), 0
                    st["step"] += 1
                    b1, b2 = group["betas"]
                    st["exp_avg"].lerp_(p.grad, 1 - b1)
                    st["exp_avg_sq"].lerp_(p.grad.square(), 1 - b2)
                    update = st["exp_avg"] / (1 - b1 ** st["step"])
                    update = update / (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt().add_(group["eps"])
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-group["lr"])


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.proj = nn.Linear(4 * d, d, bias=False)
        self.proj.weight.detach().zero_()  # zero-init, as modded-nanogpt does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.relu(self.fc(self.norm(x))).square())


class MuonNet(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([MLPBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@case("muon_newton_schulz_zero_gradient_before_zero_init_projection",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "blocks.0.fc", "muon_norm", "div_by_zero", step=0))
def _muon() -> Program:
    torch.manual_seed(0)
    model = MuonNet()
    hidden = [p for p in model.blocks.parameters() if p.ndim >= 2]
    other = [*model.embed.parameters(), *[p for p in model.blocks.parameters() if p.ndim < 2], *model.head.parameters()]
    opt = MuonWithAuxAdam([dict(params=hidden, use_muon=True, lr=0.02), dict(params=other, use_muon=False, lr=3e-4)])
    g = torch.Generator().manual_seed(603)
    return Program(model, opt, _steps(lambda s: _labelled_blobs(g, 16, 16, 4), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# 1d. Adaptive gradient clipping (NFNets) written into the loop between backward() and step(),
#     without the reference's two guards (the weight norm clamped to eps, the gradient norm to
#     1e-6). A text classifier's embedding has padding_idx=0: that row is initialised to zero and
#     never gets a gradient, so max_norm / grad_norm = 0 / 0 = NaN for it, and the clamp keeps NaN.
#     Cause: a division by the norm of an all-zero vector with no eps, which the suite calls
#     zero_variance_norm outside the optimizer (round 3a's normalised gradient, SimCLR's manual L2
#     normalisation; first written here as div_by_zero, corrected to that convention).
def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm() if x.ndim <= 1 else x.norm(dim=tuple(range(1, x.ndim)), keepdim=True)


@torch.no_grad()
def adaptive_clip_grad_(parameters: Any, clip_factor: float = 0.02) -> None:
    for p in parameters:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p) * clip_factor
        p.grad.mul_((max_norm / unitwise_norm(p.grad)).clamp(max=1.0))  # <origin:agc_ratio>


class BagOfEmbeddings(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 24, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != 0).float().unsqueeze(-1)
        pooled = (self.embed(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(torch.tanh(self.proj(pooled)))


def _padded(g: torch.Generator, n: int = 8, length: int = 10, vocab: int = 50) -> torch.Tensor:
    t = torch.randint(1, vocab, (n, length), generator=g)
    lengths = torch.randint(3, length + 1, (n,), generator=g)
    t[torch.arange(length)[None] >= lengths[:, None]] = 0
    return t


@case("agc_handwritten_padding_row_zero_weight_and_gradient_norm",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", None, "agc_ratio", "zero_variance_norm", step=0))
def _agc() -> Program:
    torch.manual_seed(0)
    model = BagOfEmbeddings()
    g = torch.Generator().manual_seed(604)
    return Program(model, sgd(model, 0.1, momentum=0.9),
                   _steps(lambda s: (_padded(g), torch.randint(0, 3, (8,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]),
                   between=lambda m, o, s: adaptive_clip_grad_(m.parameters()))


# 1e. Shampoo with its inverse roots taken by eigendecomposition, epsilon = 1e-12 ("1e-4 slowed
#     convergence"). The first batch's left statistics G G^T of a 32 x 16 weight have rank <= 16:
#     half the eigenvalues are 0 up to rounding, some of them negative, and (-tiny) ** -0.25 = NaN.
def matrix_inverse_root(mat: torch.Tensor, root: int, eps: float) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(mat + eps * torch.eye(mat.shape[0], dtype=mat.dtype))
    return evecs @ torch.diag(evals ** (-1.0 / root)) @ evecs.mT  # <origin:shampoo_root>


class Shampoo(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.05, epsilon: float = 1e-4, update_freq: int = 1) -> None:
        super().__init__(params, dict(lr=lr, epsilon=epsilon, update_freq=update_freq))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, st = p.grad, self.state[p]
                if not st:
                    st["step"] = 0
                    for i, dim in enumerate(grad.shape):
                        st[f"precond_{i}"] = torch.zeros(dim, dim)
                        st[f"inv_precond_{i}"] = torch.zeros(dim, dim)
                root = 2 * grad.ndim
                for i in range(grad.ndim):
                    g_i = grad.movedim(i, 0).reshape(grad.shape[i], -1)
                    st[f"precond_{i}"].add_(g_i @ g_i.mT)
                    if st["step"] % group["update_freq"] == 0:
                        st[f"inv_precond_{i}"].copy_(matrix_inverse_root(st[f"precond_{i}"], root, group["epsilon"]))
                update = grad
                for i in range(grad.ndim):
                    update = torch.tensordot(update, st[f"inv_precond_{i}"], dims=([0], [0]))  # contracts dim 0, appends
                st["step"] += 1
                p.add_(update, alpha=-group["lr"])


@case("shampoo_eigh_inverse_root_rank_deficient_first_batch",
      Want("nonfinite_param", "optimizer", "aten.pow.Tensor_Scalar", "0", "shampoo_root", "optimizer_state", step=0))
def _shampoo() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = Shampoo(model.parameters(), lr=0.05, epsilon=1e-12)
    g = torch.Generator().manual_seed(605)
    w = torch.randn(16, 1, generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 16, generator=g)
        return x, torch.tanh(x @ w)

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 1f. K-FAC for the Linear layers of a tabular regressor, with the Kronecker factors of each batch
#     inverted directly and no damping (the tutorial form). At step 3 the batch comes from a site
#     whose sensor 2 is missing (filled with 0): the input covariance A = a^T a / n has a zero row
#     and column, and torch.linalg.inv refuses the singular matrix (the step raises).
class KFAC(torch.optim.Optimizer):
    def __init__(self, model: nn.Module, lr: float = 0.05, damping: float = 0.0) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
        super().__init__([p for m in self.layers for p in m.parameters()], dict(lr=lr, damping=damping))
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.grad_outputs: dict[nn.Module, torch.Tensor] = {}
        for m in self.layers:
            m.register_forward_pre_hook(self._save_input)
            m.register_full_backward_hook(self._save_grad_output)

    def _save_input(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if torch.is_grad_enabled():
            self.inputs[module] = inputs[0].detach()

    def _save_grad_output(self, module: nn.Module, grad_input: Any, grad_output: tuple[torch.Tensor, ...]) -> None:
        self.grad_outputs[module] = grad_output[0].detach()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        group = self.param_groups[0]
        for m in self.layers:
            a = torch.cat([self.inputs[m], torch.ones(len(self.inputs[m]), 1)], 1)
            d = self.grad_outputs[m] * len(self.grad_outputs[m])  # per-sample gradients of a mean loss
            A = a.mT @ a / len(a)
            G = d.mT @ d / len(d)
            A_inv = torch.linalg.inv(A + group["damping"] * torch.eye(len(A)))  # <origin:kfac_inv>
            G_inv = torch.linalg.inv(G + group["damping"] * torch.eye(len(G)))
            grad = torch.cat([m.weight.grad, m.bias.grad[:, None]], 1)
            natural = G_inv @ grad @ A_inv
            m.weight.add_(natural[:, :-1], alpha=-group["lr"])
            m.bias.add_(natural[:, -1], alpha=-group["lr"])


class SiteRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@case("kfac_no_damping_input_covariance_dead_sensor_singular",
      Want("exception", "optimizer", "aten.linalg_inv_ex.default", "net.0", "kfac_inv", "domain_error",
           action="raised"))
def _kfac() -> Program:
    torch.manual_seed(0)
    model = SiteRegressor()
    opt = KFAC(model, lr=0.05)
    g = torch.Generator().manual_seed(606)
    w = torch.randn(6, 1, generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 6, generator=g)
        if step == 3:
            x[:, 2] = 0.0  # the site without sensor 2
        return x, x @ w + 0.1 * torch.randn(32, 1, generator=g)

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 1g. SGLD (Welling & Teh) with simulated annealing of the temperature, np.linspace(T0, 0, n): the
#     noise scale sqrt(2 lr / T) is computed in numpy floats, so T = 0 at step 3 gives inf (a
#     warning, not an error), and the noise step adds inf * N(0, 1) to every weight.
class SGLD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, temperature: float = 1.0) -> None:
        super().__init__(params, dict(lr=lr, temperature=temperature))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            noise_scale = math.sqrt(2 * group["lr"] / group["temperature"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.add_(p.grad, alpha=-group["lr"])
                p.add_(torch.randn_like(p), alpha=noise_scale)  # <origin:sgld_noise>


class BayesLogReg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)


@case("sgld_annealed_temperature_reaches_zero_infinite_noise",
      Want("nonfinite_param", "optimizer", "aten.add_.Tensor", "linear", "sgld_noise", "optimizer_state"))
def _sgld() -> Program:
    torch.manual_seed(0)
    model = BayesLogReg()
    opt = SGLD(model.parameters(), lr=1e-3)
    temperatures = np.linspace(1.0, 0.0, 4)  # anneal to 0 over the run's "4" steps; it runs 5
    g = torch.Generator().manual_seed(607)
    w = torch.randn(10, generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 10, generator=g)
        return x, (x @ w > 0).float()

    def between(m: nn.Module, o: torch.optim.Optimizer, step: int) -> None:
        o.param_groups[0]["temperature"] = temperatures[min(step, len(temperatures) - 1)]

    return Program(model, opt, _steps(batch, 5),
                   lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0]), b[1], reduction="sum"), between=between)


# 1h. Hyperspherical word embeddings trained with Riemannian SGD on the unit sphere (geoopt's
#     Sphere: projx(x) = x / ||x||, no eps). The padding row (padding_idx=0) is zero and gets no
#     gradient: the retraction normalises a zero row, 0 / 0 = NaN.
class RiemannianSGD(torch.optim.Optimizer):
    """SGD on the parameters of groups with ``sphere=True`` (rows on the unit sphere), plain SGD elsewhere."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr, sphere=False))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not group["sphere"]:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                rgrad = p.grad - (p.grad * p).sum(-1, keepdim=True) * p  # project onto the tangent space
                moved = p - group["lr"] * rgrad
                p.copy_(moved / moved.norm(dim=-1, keepdim=True))  # <origin:sphere_retract>


class SphericalBoW(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        with torch.no_grad():
            self.embed.weight[1:] /= self.embed.weight[1:].norm(dim=-1, keepdim=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).sum(1) / (tokens != 0).sum(1, keepdim=True).clamp(min=1))


@case("riemannian_sgd_sphere_retraction_of_zero_padding_row",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "embed", "sphere_retract", "div_by_zero", step=0))
def _sphere() -> Program:
    torch.manual_seed(0)
    model = SphericalBoW()
    opt = RiemannianSGD([{"params": [model.embed.weight], "sphere": True}, {"params": list(model.head.parameters())}],
                        lr=0.1)
    g = torch.Generator().manual_seed(608)
    return Program(model, opt, _steps(lambda s: (_padded(g), torch.randint(0, 3, (8,), generator=g)), 5),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ============================================================ 2. divergence and explosion
SPIKE = ("loss_spike", "forward", None, None, None, "loss_divergence")
GRAD = ("grad_explosion", "backward", None, None, None, "gradient_explosion")


# 2a. A network with a cubic feature layer (polynomial features, as in some physics-informed
#     regressors) at a learning rate just above its stable value. The update of the lift layer grows
#     like w^5, so the loss grows super-exponentially: 0.67, 1.56, 1.93, 2.24, 78, 3e15, NaN. The
#     documented rule holds at step 4 (four rises, 117x); step 5 is still finite.
class CubicFeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(4, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lift(x) ** 3)


@case("cubic_feature_net_super_exponential_divergence", Want(*SPIKE, step=-1), diverging=True)
def _cubic() -> Program:
    torch.manual_seed(0)
    model = CubicFeatureNet()
    g = torch.Generator().manual_seed(11)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 4, generator=g)
        return x, torch.sin(x.sum(1, keepdim=True))

    return Program(model, sgd(model, 0.254), _steps(batch, 12), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 2b. CyclicLR (triangular) with max_lr=1.0 where 1e-2 was meant, SGD with Nesterov momentum (the
#     scheduler cycles the momentum too): the learning rate climbs linearly through the stable limit
#     around step 5 and the loss takes off while it is still climbing (0.13, 0.32, 2.6, 17, 490, ...).
def _regression_batches(seed: int, n: int, d: int = 12, scale: float = 0.3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, d, generator=g)
        out.append((x, x @ w * scale))
    return out


@case("cyclic_lr_max_lr_hundredfold_nesterov", Want(*SPIKE, step=-1), diverging=True)
def _cyclic() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = sgd(model, 1e-3, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1.0, step_size_up=20)
    return Program(model, opt, _regression_batches(13, 40), lambda m, b, s: F.mse_loss(m(b[0]), b[1]), scheduler=sched)


# 2c. A linear-decay LambdaLR, lambda s: 1 - s / total, with total = the steps of ONE epoch (the
#     number of epochs forgotten). After it, the learning rate is negative and growing in size:
#     gradient ascent on a regression loss, which grows exponentially from step ~14.
@case("linear_decay_lambdalr_past_total_negative_lr_gradient_ascent", Want(*SPIKE, step=-1), diverging=True)
def _negative_lr() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = sgd(model, 0.05, momentum=0.9)
    steps_per_epoch = 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps_per_epoch)
    return Program(model, opt, _regression_batches(14, 40), lambda m, b, s: F.mse_loss(m(b[0]), b[1]), scheduler=sched)


# 2d. The linear scaling rule (Goyal et al.) applied mid-run without a new warm-up: at step 20 the
#     batch grows from 32 to 256 and the learning rate is multiplied by 8. A regression MLP that was
#     training near its stable limit diverges at once: 3.1, 20, 107, 1.8e3, 8.7e6, 1.4e19, inf.
@case("linear_scaling_rule_batch_x8_lr_x8_mid_run", Want(*SPIKE, step=-1), diverging=True)
def _scaling() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = sgd(model, 0.04, momentum=0.9)
    g = torch.Generator().manual_seed(15)
    w = torch.randn(12, 1, generator=g)
    big_batch_from = 20

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32 if step < big_batch_from else 256, 12, generator=g)
        return x, x @ w

    def before(m: nn.Module, step: int) -> None:
        if step == big_batch_from:
            for group in opt.param_groups:
                group["lr"] *= 256 / 32

    return Program(model, opt, _steps(batch, 30), lambda m, b, s: F.mse_loss(m(b[0]), b[1]), before_step=before)


# 2e. Lookahead (timm's signature: base_optimizer, alpha=0.5, k=6) called with the positional
#     arguments of another package's Lookahead(optimizer, la_steps=5, la_alpha=0.5): alpha = 5 and
#     k = 0.5. Every integer step is a multiple of 0.5, so the slow weights are synced at every
#     step with alpha = 5: an extrapolation of five times each fast update. The same loop with
#     alpha=0.5, k=5 trains (checked below).
class Lookahead(torch.optim.Optimizer):
    def __init__(self, base_optimizer: torch.optim.Optimizer, alpha: float = 0.5, k: float = 6) -> None:
        self.base_optimizer = base_optimizer
        super().__init__(base_optimizer.param_groups, dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0))
        self.param_groups = base_optimizer.param_groups
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def update_slow(self, group: dict[str, Any]) -> None:
        for fast in group["params"]:
            st = self.state[fast]
            if "slow_buffer" not in st:
                st["slow_buffer"] = fast.detach().clone()
            slow = st["slow_buffer"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.base_optimizer.step()
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)


def _lookahead_program(args: tuple[float, float]) -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = Lookahead(sgd(model, 0.1, momentum=0.9), *args)
    return Program(model, opt, _regression_batches(16, 20), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


@case("lookahead_positional_args_swapped_alpha5_every_step", Want(*SPIKE, step=-1), diverging=True)
def _lookahead() -> Program:
    return _lookahead_program((5, 0.5))  # meant: la_steps=5, la_alpha=0.5


# 2f. Hypergradient descent (SGD-HD, Baydin et al. 2018): the learning rate is itself learned,
#     lr += beta * g_t . g_{t-1}. With beta = 0.2 (the paper's values are ~1e-3 for SGD) aligned
#     gradients feed a positive loop: the learning rate runs away and the loss with it
#     (1.3, 1.7, 2.6, 1.8e4, 1.3e27), and the next update makes the weights non-finite.
class SGDHD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, hypergrad_lr: float = 1e-3) -> None:
        super().__init__(params, dict(lr=lr, hypergrad_lr=hypergrad_lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            h = 0.0
            for p in group["params"]:
                if "prev_grad" in self.state[p]:
                    h += float((p.grad * self.state[p]["prev_grad"]).sum())
            group["lr"] += group["hypergrad_lr"] * h
            for p in group["params"]:
                self.state[p]["prev_grad"] = p.grad.clone()
                p.add_(p.grad, alpha=-group["lr"])


@case("sgd_hd_hypergradient_learning_rate_runs_away", Want(*SPIKE, step=-1), diverging=True)
def _sgdhd() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = SGDHD(model.parameters(), lr=0.01, hypergrad_lr=0.2)
    return Program(model, opt, _regression_batches(17, 10), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 2g. Off-policy TD(0) with linear features on Baird's counterexample (Sutton & Barto, 11.2):
#     expected semi-gradient updates over the seven states, target policy always "solid". The
#     weights grow by a steady factor per step from the very first one (the deadly triad: function
#     approximation, bootstrapping, off-policy data); the loss grows x1.16 per step.
def baird_features() -> torch.Tensor:
    x = torch.zeros(7, 8)
    for i in range(6):
        x[i, i], x[i, 7] = 2.0, 1.0
    x[6, 6], x[6, 7] = 1.0, 2.0
    return x


def td0_loss(model: nn.Module, states: torch.Tensor, step: int, gamma: float = 0.99) -> torch.Tensor:
    v = model(states).squeeze(-1)
    target = gamma * v[6].detach()  # every state's "solid" action leads to state 7
    return 0.5 * (target - v).pow(2).mean()


@case("td0_off_policy_linear_baird_counterexample", Want(*SPIKE, step=-1), diverging=True)
def _baird() -> Program:
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1, 1, 1, 1, 1, 10, 1]]))
    return Program(model, sgd(model, 0.3), [baird_features() for _ in range(40)], td0_loss)


# ======================================================================= the plain runs
def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The arguments an op writes in place (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def _bad(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and not bool(torch.isfinite(t).all())


class FirstBad(TorchDispatchMode):
    """The oracle: the first op whose floating inputs were all finite and whose output or in-place
    argument was not; the line of this file that issued it, whether an Optimizer method was running,
    the loop's phase, and the first parameter (by storage) an op left non-finite. Also the last
    ``*_ex`` linear-algebra op that reported a failure in its ``info`` output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.step = 0
        self.phase = "before"
        self.origin: dict[str, Any] | None = None
        self.param: str | None = None
        self.failed_ex: str | None = None
        self._storages: dict[int, str] = {}

    def new_step(self, step: int) -> None:
        self.step = step
        self._storages = {p.untyped_storage().data_ptr(): n for n, p in self.model.named_parameters()}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        finite_in = not any(_bad(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        if name.endswith("_ex") and isinstance(out, tuple) and isinstance(out[-1], torch.Tensor) \
                and not out[-1].is_floating_point() and bool((out[-1] != 0).any()):
            self.failed_ex = f"aten.{func._schema.name.split('::')[1]}.{func._overloadname}"
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)] + _written(func, args, kwargs)
        if self.origin is None and finite_in and any(_bad(t) for t in results):
            frames, in_optimizer, line = inspect.currentframe(), False, None
            f = frames.f_back if frames is not None else None
            while f is not None:
                mine = os.path.abspath(f.f_code.co_filename) == HERE and f.f_code.co_name != "__torch_dispatch__"
                if line is None and mine:
                    line = f.f_lineno
                in_optimizer |= isinstance(f.f_locals.get("self"), torch.optim.Optimizer)
                f = f.f_back
            self.origin = dict(step=self.step, phase=self.phase, in_optimizer=in_optimizer, line=line,
                               op=f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}")
        if self.param is None and self.origin is not None:
            for t in _written(func, args, kwargs):
                key = t.untyped_storage().data_ptr()
                if key in self._storages and _bad(t):
                    self.param = self._storages[key]
        return out


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def plain_run(program: Program, oracle: bool = False) -> dict[str, Any]:
    """The program without nantrace: per step loss and gradient norm, the first step whose loss,
    gradients or (after the update) parameters are non-finite or that raised, and (``oracle``)
    what FirstBad saw."""
    model, opt = program.model, program.optimizer
    mode = FirstBad(model) if oracle else None
    losses, norms = [], []
    result: dict[str, Any] = dict(losses=losses, norms=norms, step=None, what=None)
    try:
        if mode is not None:
            mode.__enter__()
        for step, batch in enumerate(program.batches):
            if mode is not None:
                mode.new_step(step)
                mode.phase = "before"
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            opt.zero_grad()
            if mode is not None:
                mode.phase = "loss"
            loss = run_step(program, program.loss, batch, step)
            if mode is not None:
                mode.phase = "between"
            if program.between is not None:
                program.between(model, opt, step)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            losses.append(float(loss.detach().sum()))
            norms.append(float(torch.stack([g.double().norm() for g in grads]).norm()))
            if mode is not None:
                mode.phase = "step"
            try:
                opt.step()
            except Exception as exc:
                result.update(step=step, what="exception", error=exc)
                break
            if program.scheduler is not None:
                program.scheduler.step()
            if not math.isfinite(losses[-1]):
                result.update(step=step, what="loss")
                break
            if not _finite(grads):
                result.update(step=step, what="grads")
                break
            if not _finite(model.parameters()):
                result.update(step=step, what="params")
                break
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    if mode is not None:
        result.update(origin=mode.origin, param=mode.param, failed_ex=mode.failed_ex)
    return result


def _run_start(series: list[float], s: int) -> int:
    """The step the rise ending at ``s`` started from."""
    while s > 0 and series[s] > series[s - 1]:
        s -= 1
    return s


def _divergence_expectation(run: dict[str, Any]) -> tuple[int, int, tuple[Any, ...]]:
    """From the plain run, by docs/escalation.md: the first step the rule holds on the loss or the
    gradient norm, the first step that shows a non-finite value (the run's length if none does;
    the step after the one whose update made the weights non-finite), and which incident: the
    gradients lead when both grow and the norm's rise began first."""
    losses, norms = run["losses"], run["norms"]
    end = len(losses) if run["step"] is None else run["step"] + (run["what"] == "params")  # an update made it non-finite
    rules = [r for r in (_rule_step(losses[:end]), _rule_step(norms[:end])) if r is not None]
    assert rules, (losses, norms)
    first = min(rules)
    s = next(s for s in range(first, end) if losses[s] > losses[s - 1])  # the loss rising too
    leads = GRAD if norms[s] > norms[s - 1] and _run_start(norms, s) < _run_start(losses, s) else SPIKE
    return first, end, leads


_PLAIN: dict[str, dict[str, Any]] = {}


def plain(name: str) -> dict[str, Any]:
    if name not in _PLAIN:
        _PLAIN[name] = plain_run(CASES[name][0](), oracle=name not in DIVERGING)
    return _PLAIN[name]


# ======================================================================= the tests
WHAT = {"nonfinite_param": ("params", "grads", "loss"), "nonfinite_grad": ("grads", "params"),
        "exception": ("exception",)}
"""What the plain loop sees first (a NaN parameter made before the step shows in its gradients)."""


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction. Optimizer-step cases: the oracle's first non-finite op is the expected one,
    issued from the marked line, at the expected step, inside an Optimizer method exactly when the
    expected phase is ``optimizer``, and the first parameter it made non-finite is in the expected
    module; the step raised for ``exception``. Diverging ones: the rule holds before the first
    non-finite value, and the expected incident (loss or gradients leading) is the rule's."""
    _, want = CASES[name]
    run = plain(name)
    if name in DIVERGING:
        first, end, leads = _divergence_expectation(run)
        assert first < end, (first, end, run["losses"])
        assert leads == (want.kind, want.phase, want.op, want.module, want.tag, want.cause), (leads, run["norms"])
        return
    assert run["step"] == want.step and run["what"] in WHAT[want.kind], {k: run[k] for k in ("step", "what", "losses")}
    if want.kind == "exception":
        assert run["failed_ex"] == want.op, run["failed_ex"]
        return
    origin = run["origin"]
    assert origin is not None
    assert (origin["step"], origin["op"], origin["line"]) == (want.step, want.op, JUDGE.marked(want.tag)[1]), origin
    assert origin["in_optimizer"] == (want.phase == "optimizer"), origin
    if want.phase == "optimizer":
        assert (run["param"].rpartition(".")[0] if run["param"] else None) == want.module, run["param"]
    else:  # gradient code in the loop, outside the model and the optimizer
        assert origin["phase"] == "between" and want.module is None, origin


def test_lookahead_with_the_intended_arguments_trains() -> None:
    """2e's control: alpha=0.5, k=5 (what was meant) on the same loop stays finite and does not diverge."""
    run = plain_run(_lookahead_program((0.5, 5)))
    assert run["step"] is None and _rule_step(run["losses"]) is None and run["losses"][-1] < run["losses"][0]


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n not in DIVERGING}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    run = train(build(), replayable=mode == "replayable")
    if want.action == "raised" and want.kind != "exception":  # weights non-finite before step(): no skip can help
        got = JUDGE.got(run.incidents)
        assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
        assert isinstance(run.error, nantrace.NonFiniteError) and run.error_step == want.step, repr(run.error)
        return
    assert_diagnosis(run, want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if n in DIVERGING}, XFAIL))
def test_heldout_divergence(name: str, mode: str) -> None:
    """The first blocking incident is the divergence, at or after the rule's step and before the
    first non-finite value; the update it blocked did not happen; the run ends (at most) paused."""
    build, want = CASES[name]
    first, end, _ = _divergence_expectation(plain(name))
    run = train(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    fields = {k: v for k, v in got.items() if k != "step"}
    assert fields == {k: v for k, v in JUDGE.want(want).items() if k != "step"}, [describe(i) for i in run.incidents]
    assert first <= got["step"] < end, (got["step"], first, end)
    assert run.error is None or isinstance(run.error, nantrace.NonFiniteError), repr(run.error)
    assert run.unchanged_at_incident is True


def test_a_skipped_update_also_undoes_the_learning_rate_its_step_wrote() -> None:
    """2f's SGD-HD writes its learned learning rate inside step(); when the update is blocked (divergence
    detection off, so the block is the non-finite update of step 6), the learning rate is as before it."""
    program = _sgdhd()
    opt = program.optimizer
    guard = nantrace.watch(program.model, opt, config=nantrace.Config(detection={"detect_divergence": False},
                                                                      outputs={"print_incidents": False}))
    blocked = None
    try:
        for step, batch in enumerate(program.batches):
            lr, seen = opt.param_groups[0]["lr"], len(guard.incidents)
            opt.zero_grad()
            program.loss(program.model, batch, step).backward()
            opt.step()
            if any(i.action != "logged" for i in guard.incidents[seen:]):
                blocked = (step, lr, opt.param_groups[0]["lr"])
                break
    finally:
        guard.close()
    assert blocked is not None and blocked[0] == 6, blocked
    assert blocked[2] == blocked[1], blocked
