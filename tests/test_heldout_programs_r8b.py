"""Held-out failures, round 8b: failures inside REAL framework training loops and at the
optimizer / loss-scaler level, as users meet them.

1. The optimizer and its settings (a plain loop, ``heldout_harness.train``, zero-intrusive and
   ``replayable``): a T5-style ``rsqrt`` LR decay with ``warmup_steps=0`` (lr = inf at step 0), a
   vocabulary extension whose new embedding rows are the mean of an empty selection, written through
   ``.data`` between two steps and never read by the forward (AdamW's decoupled weight decay carries the
   NaN), nGPT-style row normalisation through ``.data`` of a zero padding row (read by the next forward),
   RAdam with ``eps=0`` on a recommender whose cold-start users have no interactions (the variance
   rectification only switches on at step 5), ``model.half()`` with Adam's default ``eps=1e-8`` (0 in
   float16), a zero-initialised input column for a new raw-unit feature (an amount in wei) whose huge but
   finite gradient overflows Adam's second moment while every parameter stays finite.
2. The GradScaler (float16 / bfloat16 autocast on the CPU, ``torch.amp.GradScaler("cpu")``, its own loop
   ``train_amp``): a float16 forward overflow, which is an incident and not the scaler's calibration; a
   float16 backward overflow that no scale can fix (a collapse at its first skip); ``init_scale=0`` ported
   from a DeepSpeed config ("0 = dynamic"); ``clip_grad_norm_`` called before ``scaler.unscale_`` and
   ``clip_grad_norm_(params, 0)`` from a config where 0 meant "off" (early warnings, nothing blocked).
   (A scale growing to inf, suggested for this round, cannot be built: torch's ``_amp_update_scale_`` grows
   the scale only to a finite value, it saturates at 2**127.)
3. Divergence without a NaN: SGD with a weight-decay typo (``1e2`` for ``1e-2``), a matrix factorisation
   with a sum-reduced loss and SGD whose loss grows super-exponentially, and ``transformers.Trainer`` with
   ``optim="sgd"``, a constant learning rate too high and clipping switched off.
4. Real ``transformers.Trainer`` and ``lightning.Trainer`` runs with nantrace's callbacks (tiny models,
   built from configs, no downloads): ``gradient_accumulation_steps=2`` with a ``compute_loss`` whose
   inverse-frequency class weights divide by a zero count; a ``GPT2LMHeadModel`` whose supervised-token
   count is 0 for a batch of prompt-only examples, with hand-written label smoothing in ``compute_loss`` and
   with the Trainer's own ``label_smoothing_factor`` (transformers' ``LabelSmoother``); a
   ``BertForSequenceClassification`` trained with ``adam_epsilon=0`` (rows of the vocabulary that never
   occur get zero gradient; an all-padding row in each batch is harmless); a Lightning DQN with
   ``RMSprop(eps=0)`` and ``gradient_clip_val``, whose head row for an action never taken gets zero
   gradient; a Lightning GAN under manual optimisation and ``precision="bf16-mixed"`` whose minimax
   generator loss ``log(1 - D(G(z)))`` meets a probability that bfloat16 rounds to exactly 1 (finite in
   float32: ``precision_overflow``); a bf16-mixed survival model whose ``exp`` overflows float32 too
   (``exp_overflow``, not precision); ``precision="16-mixed"`` through the CPU ``MixedPrecision`` plugin and
   its GradScaler, with attention scores that overflow float16; ``Trainer(detect_anomaly=True)``, whose
   anomaly check raises inside ``backward()``.

How expectations were derived (before nantrace ran): from docs/api.md / shared API.md and
docs/diagnosis.md, as rounds 5a and 5b derive them. Optimizer-phase failures: kind ``nonfinite_param``
(``optimizer_state`` when the parameters stay finite and only the state goes non-finite), phase
``optimizer``, op = the update op that made the first non-finite value, module = the module holding that
parameter, source = the user's ``optimizer.step()`` line (``opt_step``) for a torch optimizer in a plain
loop, the framework's ``optimizer.step(...)`` line under a Trainer; cause ``optimizer_state`` when the
bad operand is the optimizer's state or a setting (lr, eps), the generic rule otherwise (an ``addcmul_``
whose float64 value exceeds float32: ``overflow``). A parameter made non-finite between steps by the
user: kind and cause ``nonfinite_param``, phase / op / source ``None``, module its holder. Divergence:
docs/escalation.md's rule, computed independently from the plain run (``_rule_step`` of round 5a), the
gradient norm leading when its rise began first. Every construction is checked without nantrace
(``test_cases_fail_without_nantrace``, ``test_framework_construction``): the first non-finite value
appears at the expected step, in the expected stage, made by the expected op (a TorchDispatchMode of
this file that also sees the arguments in-place and fused kernels write).
"""

from __future__ import annotations

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import (MODES, Judge, Program, Run, _blocking, assert_diagnosis, case_params, describe, run_step,
                             same, snapshot, train)
from origin_markers import origin_line
from test_heldout_programs_r5a import _rule_step
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
DIVERGING: set[str] = set()
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
_WHY: dict[str, str] = {}
XFAIL.update({f"{name}[{mode}]": why for name, why in _WHY.items() for mode in MODES})
SPIKE = ("loss_spike", "forward", None, None, None, "loss_divergence")
GRAD = ("grad_explosion", "backward", None, None, None, "gradient_explosion")


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


def input_at(f: Callable[[torch.Tensor], torch.Tensor], d: int, target: float, seed: int) -> torch.Tensor:
    """An input whose scalar output ``f`` is ``target`` at init: a direction with a positive output, scaled
    by bisection (``f`` is piecewise linear along the ray)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        at = lambda v: float(f(v[None]))  # noqa: E731
        for _ in range(2000):  # rising along the ray, and still rising far out (its last linear piece)
            v = torch.randn(d, generator=g)
            if at(8 * v) > at(0 * v) and at(16 * v) > at(8 * v) + 0.2:
                break
        else:
            raise AssertionError("no rising direction")
        lo, hi = 0.0, 16.0
        while at(hi * v) < target:
            hi *= 2
            assert hi < 1e6, "target out of reach"
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if at(mid * v) < target else (lo, mid)
    return hi * v


# ============================================================ the construction check's recorder
MASK_MAKERS = {torch.ops.aten.scalar_tensor.default, torch.ops.aten.where.self, torch.ops.aten.full.default,
               torch.ops.aten.masked_fill.Scalar, torch.ops.aten.masked_fill_.Scalar, torch.ops.aten.fill_.Scalar,
               torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
               torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default}
"""Ops that make attention masks (-inf by design) or uninitialised memory: never an origin in this file."""


class Made(TorchDispatchMode):
    """Every op whose floating tensor inputs were all finite and after which an output, or an argument it
    wrote (in-place, ``_foreach_*_``, ``_fused_adamw_``), holds a non-finite value: (step, op, scalars finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.made: list[tuple[int, str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()]
        inputs_ok = all(bool(torch.isfinite(a).all()) for a in tensors if a.dim() > 0)
        scalars_ok = all(math.isfinite(a) for a in leaves if isinstance(a, float)) and \
            all(bool(torch.isfinite(a).all()) for a in tensors if a.dim() == 0)
        out = func(*args, **kwargs)
        if inputs_ok and func not in MASK_MAKERS:
            after = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()] + \
                [a for a in tensors if a.dim() > 0]
            if not all(bool(torch.isfinite(o).all()) for o in after):
                name = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
                self.made.append((self.step, name, scalars_ok))
        return out

    def first(self, step: int, optimizer_phase: bool) -> str | None:
        ops = [op for s, op, scalars_ok in self.made if s == step and (scalars_ok or optimizer_phase)]
        return ops[0] if ops else None


# ================================================================= 1. the optimizer and its settings
# 1a. A T5-style inverse-square-root decay, lr = 1 / sqrt(max(step, warmup_steps)), computed with numpy,
#     and warmup_steps = 0 in the fine-tuning config ("no warmup when fine-tuning"): at step 0 the factor is
#     1 / sqrt(0) = inf (numpy warns, no exception), LambdaLR sets lr = inf before the first step, and Adam's
#     param.addcdiv_(exp_avg, denom, value=-inf) makes the first parameter (encoder.weight) +-inf / NaN.
class TicketClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(12, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.encoder(x)))


@case("t5_rsqrt_decay_warmup_steps_zero_inf_lr_adam",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "encoder", "opt_step", "optimizer_state", step=0))
def _t5_rsqrt() -> Program:
    torch.manual_seed(0)
    model = TicketClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    warmup_steps = 0  # config: fine-tuning, no warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / np.sqrt(np.maximum(s, warmup_steps)))
    g = torch.Generator().manual_seed(801)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)

    return Program(model, opt, _steps(batch, 4), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), scheduler=sched)


# 1b. Vocabulary extension between two steps: 8 domain tokens are added at step 2 and their rows are
#     initialised, through .data, to the mean of the embeddings of their word pieces; the lookup finds no
#     piece (the tokenizer's prefix differs), the mean of an empty selection is NaN. The new tokens never
#     occur in the batches, so the loss and the gradients stay finite; AdamW's decoupled weight decay
#     (p.mul_(1 - lr * wd)) carries the NaN rows on. A parameter written non-finite between steps.
VOCAB = [f"tok{i}" for i in range(32)] + [f"[DOM{i}]" for i in range(8)]


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


@case("vocab_extension_rows_mean_of_empty_pieces_written_through_data_adamw_decay",
      Want("nonfinite_param", None, None, "emb", None, "nonfinite_param", step=2, action="raised"))
def _vocab_extension() -> Program:
    torch.manual_seed(0)
    model = BagOfWords()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(802)

    def before(m: nn.Module, step: int) -> None:
        if step == 2:
            pieces = [i for i, t in enumerate(VOCAB[:32]) if t.startswith("##dom")]  # empty: the prefix is "tok"
            m.emb.weight.data[32:] = m.emb.weight.data[pieces].mean(0)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 3, (8,), generator=g)

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=before)


# 1c. A matrix-factorisation recommender trained with RAdam(eps=0). The user table holds 8 cold-start
#     users registered before they rated anything: their rows get exactly zero gradient, so exp_avg_sq = 0.
#     RAdam applies its adaptive term only once the variance rectification is defined (rho_t > 5, the 6th
#     step): sqrt(bias_correction2) / (sqrt(0) + 0) = inf (a reciprocal of the state), times exp_avg = 0: NaN.
class MatrixFactorisation(nn.Module):
    def __init__(self, users: int, items: int, dim: int = 8) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim)
        self.items = nn.Embedding(items, dim)
        nn.init.normal_(self.users.weight, std=0.3)
        nn.init.normal_(self.items.weight, std=0.3)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (self.users(u) * self.items(i)).sum(-1)


@case("recommender_radam_eps0_cold_start_users_rectification_step5",
      Want("nonfinite_param", "optimizer", "aten.reciprocal.default", "users", "opt_step", "optimizer_state", step=5))
def _radam() -> Program:
    torch.manual_seed(0)
    model = MatrixFactorisation(48, 20)
    opt = torch.optim.RAdam(model.parameters(), lr=1e-2, eps=0.0)
    g = torch.Generator().manual_seed(803)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u = torch.randint(0, 40, (64,), generator=g)  # users 40..47 have no ratings yet
        return u, torch.randint(0, 20, (64,), generator=g), torch.randint(1, 6, (64,), generator=g).float()

    return Program(model, opt, _steps(batch, 8), lambda m, b, s: F.mse_loss(m(b[0], b[1]), b[2]))


# 1d. model.half() "to save memory", Adam with its default eps = 1e-8: in float16 the eps rounds to 0
#     (the smallest subnormal is 6e-8), and (1 - beta2) * g^2 underflows to 0 for the small gradients of the
#     first layer: denom = sqrt(0) + 0 = 0 while exp_avg != 0, so addcdiv_ gives inf (NaN where g = 0).
class SensorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@case("half_precision_model_adam_default_eps_rounds_to_zero",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "fc1", "opt_step", "optimizer_state", step=0))
def _half_adam() -> Program:
    torch.manual_seed(0)
    model = SensorNet().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(804)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=g)
        return x.half(), (0.3 * x[:, :1] + 0.1 * torch.randn(32, 1, generator=g)).half()

    return Program(model, opt, _steps(batch, 3), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 1e. A fraud model gets a new input feature, the transfer amount, appended as a zero-initialised column
#     of its first layer (so it starts from the trained model). The amount is 0 for events that are not
#     transfers and is in wei (1e18 per token): the whale transfer of step 3 (3.2e24 wei) leaves the forward
#     untouched (0 * x) but the column's gradient is ~1e22; Adam's exp_avg_sq.addcmul_(g, g, 1 - beta2)
#     exceeds float32 (1e41, finite in float64). The update m / sqrt(inf) = 0 leaves the parameters finite:
#     only the optimizer state is non-finite (and those weights never move again).
class FraudNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.weight[:, 6] = 0.0  # the new feature's column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


@case("wei_amount_feature_zero_init_column_adam_second_moment_overflow",
      Want("optimizer_state", "optimizer", "aten.addcmul_.default", "fc1", "opt_step", "overflow", step=3))
def _wei() -> Program:
    torch.manual_seed(0)
    model = FraudNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(805)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([torch.randn(16, 6, generator=g), torch.zeros(16, 1)], 1)
        if step == 3:
            x[5, 6] = 3.2e24  # a whale transfer, in wei
        return x, (torch.rand(16, generator=g) < 0.3).float()

    return Program(model, opt, _steps(batch, 5), lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0]), b[1]))


# 1f. nGPT-style normalisation: after every update the embedding rows are put back on the unit sphere in place,
#     through .data (no autograd, no version bump). The padding row (padding_idx=0) is all zeros and never
#     trained: 0 / 0 = NaN on the first normalisation, before step 1. Padding tokens occur in every batch, so
#     the NaN row reaches the forward at step 1: a parameter already non-finite when the step began.
class SphereEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


@case("ngpt_style_row_normalisation_through_data_zero_padding_row",
      Want("nonfinite_param", None, None, "emb", None, "nonfinite_param", step=1, action="raised"))
def _ngpt() -> Program:
    torch.manual_seed(0)
    model = SphereEncoder()
    g = torch.Generator().manual_seed(809)

    def renormalise(m: nn.Module, step: int) -> None:
        if step > 0:  # after the previous update
            w = m.emb.weight.data
            w.div_(w.norm(dim=1, keepdim=True))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 30, (8, 7), generator=g)
        ids[:, 5:] = 0  # padding
        return ids, torch.randint(0, 4, (8,), generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.1), _steps(batch, 4),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=renormalise)


# ================================================================= 3. divergence without a NaN (plain loops)
# 3a. weight_decay=1e2 where 1e-2 was meant: SGD's update p -= lr * (g + wd * p) multiplies every weight by
#     1 - 0.1 * 100 = -9 per step; the two-layer model's loss grows ~81^2 per step, finite for several steps.
@case("sgd_weight_decay_typo_1e2_weights_times_minus_9", Want(*SPIKE, step=-1), diverging=True)
def _wd_typo() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e2)
    g = torch.Generator().manual_seed(806)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 6, generator=g)
        return x, x[:, :1] - 0.5 * x[:, 1:2]

    return Program(model, opt, _steps(batch, 26), lambda m, b, s: F.mse_loss(m(b[0]), b[1]))


# 3b. Matrix factorisation with a sum-reduced squared error and SGD at lr = 0.1: the curvature grows with the
#     factors themselves, so each overshoot makes the next one larger and the loss grows super-exponentially
#     (674, 723, 574, 587, 1.9e3, 5.6e4, 1.3e9, 1.5e24, inf). The gradient norm rises from step 0, the
#     loss only from step 2: the gradients lead.
@case("matrix_factorisation_sum_loss_sgd_super_exponential", Want(*GRAD, step=-1), diverging=True)
def _mf_diverge() -> Program:
    torch.manual_seed(0)
    model = MatrixFactorisation(30, 20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randint(0, 30, (64,), generator=g), torch.randint(0, 20, (64,), generator=g),
                torch.randint(1, 6, (64,), generator=g).float())

    return Program(model, opt, _steps(batch, 12), lambda m, b, s: F.mse_loss(m(b[0], b[1]), b[2], reduction="sum"))


# ================================================================= 2. the GradScaler (its own loop)
@dataclasses.dataclass
class AmpProgram(Program):
    """A Program trained with autocast and a GradScaler: ``scaler.scale(loss).backward()``,
    ``scaler.step(opt)``, ``scaler.update()``; ``clip_before_unscale``: ``clip_grad_norm_`` is called on
    the scaled gradients (``scaler.unscale_`` forgotten)."""

    dtype: torch.dtype = torch.float16
    init_scale: float = 2.0 ** 16
    clip_before_unscale: float | None = None
    clip_after: float | None = None
    """``clip_grad_norm_`` after ``scaler.unscale_``, the documented order."""


AMP: dict[str, tuple[Callable[[], AmpProgram], Want]] = {}
EARLY: dict[str, tuple[Callable[[], AmpProgram], tuple[str, str, int, int]]] = {}
"""Early-warning cases: (kind, cause, first step, last step) of the first incident, logged; nothing blocked."""


def _amp_step(program: AmpProgram, scaler: torch.amp.GradScaler, loss_fn: Callable, batch: Any,
              step: int) -> tuple[torch.Tensor, float | None]:
    with torch.autocast("cpu", dtype=program.dtype):
        loss = loss_fn(program.model, batch, step)
    scaler.scale(loss).backward()
    total = None
    if program.clip_before_unscale is not None:
        total = float(torch.nn.utils.clip_grad_norm_(program.model.parameters(), program.clip_before_unscale))
    if program.clip_after is not None:
        scaler.unscale_(program.optimizer)
        total = float(torch.nn.utils.clip_grad_norm_(program.model.parameters(), program.clip_after))
    scaler.step(program.optimizer)
    scaler.update()
    return loss, total


def train_amp(program: AmpProgram, *, replayable: bool) -> Run:
    """heldout_harness.train with autocast and a GradScaler (the scaler handed to watch)."""
    model, opt = program.model, program.optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=program.init_scale)
    guard = nantrace.watch(model, opt, scaler=scaler, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(program.batches):
            before, seen = snapshot(model), _blocking(guard.incidents)
            try:
                opt.zero_grad()
                _amp_step(program, scaler, loss_fn, batch, step)
            except Exception as exc:
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if _blocking(guard.incidents) > seen and unchanged is None:
                unchanged = same(before, snapshot(model))
    finally:
        guard.close()
    return Run(list(guard.incidents), error, error_step, unchanged)


def plain_amp(program: AmpProgram) -> dict[str, Any]:
    """Without nantrace: per step the loss, whether the scaler skipped, the clipping call's total norm,
    the scale, and the ops that made non-finite values."""
    scaler = torch.amp.GradScaler("cpu", init_scale=program.init_scale)
    rec = Made()
    out: dict[str, Any] = dict(losses=[], skipped=[], totals=[], scales=[], made=rec)
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            program.optimizer.zero_grad()
            scale = scaler.get_scale()
            loss, total = _amp_step(program, scaler, program.loss, batch, step)
            out["losses"].append(float(loss))
            out["skipped"].append(scaler.get_scale() < scale)
            out["totals"].append(total)
            out["scales"].append(scale)
    return out


# 2a. A float16-autocast regression on smart-meter readings with a GradScaler: one batch holds a reading in
#     raw units (6e4, representable in float16) along the first unit's weights: fc1's output, 8e4, is beyond
#     float16's 65504: inf, and the loss is inf. Finite in float32: precision_overflow in fc1, at step 3,
#     not a calibration skip of the scaler (no scale can make a non-finite loss finite).
class MeterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # <origin:amp_fc1>
        return self.fc2(F.gelu(h)).float()


def _meter(bad_step: int | None, n: int, **kw: Any) -> AmpProgram:
    torch.manual_seed(0)
    model = MeterNet()
    raw = 6e4 * torch.sign(model.fc1.weight[0].detach())
    g = torch.Generator().manual_seed(807)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=g)
        y = x[:, :1] - x[:, 1:2]
        if step == bad_step:
            x[9] = raw
        return x, y

    return AmpProgram(model, torch.optim.SGD(model.parameters(), lr=1e-2), _steps(batch, n),
                      lambda m, b, s: F.mse_loss(m(b[0]), b[1]), **kw)


AMP["amp_fp16_gradscaler_raw_meter_reading_forward_overflow"] = (
    lambda: _meter(3, 5),
    Want("nonfinite_loss", "forward", "aten.addmm.default", "fc1", "amp_fc1", "precision_overflow", step=3))

# 2b. The most common AMP mistake: clip_grad_norm_(model.parameters(), 1.0) right after
#     scaler.scale(loss).backward(), without scaler.unscale_(optimizer) first. The norm it compares with
#     max_norm is 65536x the real one, so every update is clipped to ~1/65536 of its size. An early warning
#     (docs/dynamics.md: clipping / clip_threshold, "called on gradients still scaled by a GradScaler") at the
#     first such call, step 0; nothing is blocked.
EARLY["amp_clip_grad_norm_before_unscale"] = (lambda: _meter(None, 6, dtype=torch.bfloat16, clip_before_unscale=1.0),
                                              ("clipping", "clip_threshold", 0, 0))

# 2e. A plain loop whose config came from Hugging Face's TrainingArguments, where max_grad_norm=0 means "no
#     clipping": clip_grad_norm_(params, cfg.max_grad_norm) with 0 zeroes every gradient (the clip
#     coefficient is 0 / (norm + 1e-6) = 0): the model never trains, nothing is ever non-finite. The clipping
#     monitor's rule (docs/dynamics.md: clipping fired on >= 95% of the last 200 steps, judged after
#     dynamics_warmup = 100 steps, the norms read in batches of 32) reports it between step 199 and ~333.
#     (A bfloat16-autocast loop with a GradScaler, unscaled before clipping as documented.)
EARLY["hf_config_max_grad_norm_zero_means_off_clip_grad_norm_zeroes_every_update"] = (
    lambda: _meter(None, 345, dtype=torch.bfloat16, clip_after=0.0), ("clipping", "clip_threshold", 199, 339))


# 2c. A float16-autocast model of oscillators predicts a log-period and returns the frequency 1 / exp(log_period).
#     The batch of step 3 holds a very fast oscillator (log-period -8: period 3.4e-4, frequency 2981, all
#     finite in float16). Backward, the reciprocal's derivative -1 / period^2 = -8.9e6 overflows float16 at
#     ANY loss scale, 1 included: lowering the scale cannot help. docs/escalation.md: a collapse called at its
#     first skip, the origin named from the replay at scale 1 (the reciprocal, in module head, phase backward).
class FreqHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        period = torch.exp(self.lin(h)).squeeze(-1)
        return 1.0 / period  # <origin:amp_freq_recip>


class OscillatorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.1))
        self.head = FreqHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).float()


def _oscillators(**kw: Any) -> AmpProgram:
    torch.manual_seed(0)
    model = OscillatorNet()
    fast = input_at(lambda v: -model.head.lin(model.body(v)), 4, 8.0, seed=88)  # log-period -8
    g = torch.Generator().manual_seed(808)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = 0.3 * torch.randn(16, 4, generator=g)
        if step == 3:
            x[7] = fast
        return x, torch.ones(16) + 0.1 * torch.randn(16, generator=g)

    return AmpProgram(model, torch.optim.SGD(model.parameters(), lr=1e-3), _steps(batch, 5),
                      lambda m, b, s: F.mse_loss(m(b[0]), b[1]), **kw)


AMP["amp_fp16_frequency_head_reciprocal_backward_overflows_at_scale_one"] = (
    _oscillators,
    Want("scaler_collapse", "backward", "aten.reciprocal.default", "head", "amp_freq_recip", "scaler_collapse", step=3))

# 2d. A loss-scaling setting ported from a DeepSpeed config, where "loss_scale": 0 means dynamic scaling:
#     GradScaler(init_scale=0). The scaled loss and the gradients are 0; unscale_ multiplies them by 1 / 0 = inf,
#     0 * inf = NaN, but the scaler looks for non-finite values in the scaled gradients (0, finite), so
#     found_inf stays 0 and the NaN gradients are applied: every weight is NaN after step 0. A scale below 1
#     is a collapse of the scaler (docs/escalation.md: "the scaler now shrinks the gradients"), here 0, at
#     step 0; the update must not land. (Which op to name is not fixed by the contract here, the first
#     non-finite value being the scaler's own 1 / scale: the check is on step, kind, cause and action.)
SCALER: dict[str, tuple[Callable[[], AmpProgram], tuple[int, str, str, str]]] = {
    "amp_gradscaler_init_scale_zero_from_deepspeed_config":
        (lambda: _meter(None, 4, dtype=torch.bfloat16, init_scale=0.0), (0, "scaler_collapse", "scaler_collapse", "skipped")),
}


# ======================================================================= plain runs
def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _state_finite(opt: torch.optim.Optimizer) -> bool:
    return all(_finite(v for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
               for st in opt.state.values())


def plain_run(program: Program) -> dict[str, Any]:
    """Round 5a's plain run, under the recorder: per step loss and gradient norm, and the first step whose
    loss, gradients or (after the update) parameters / optimizer state are non-finite."""
    model, opt = program.model, program.optimizer
    losses, norms = [], []
    rec = Made()
    with rec:
        for step, batch in enumerate(program.batches):
            rec.step = step
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, step)
            opt.zero_grad()
            loss = run_step(program, program.loss, batch, step)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            losses.append(float(loss.detach().sum()))
            norms.append(float(torch.stack([g.double().norm() for g in grads]).norm()))
            what = None
            if not math.isfinite(losses[-1]):
                what = "loss"
            elif not _finite(grads):
                what = "grads"
            else:
                opt.step()
                if program.scheduler is not None:
                    program.scheduler.step()
                if not _finite(model.parameters()):
                    what = "params"
                elif not _state_finite(opt):
                    what = "state"
            if what is not None:
                return dict(losses=losses, norms=norms, step=step, what=what, made=rec)
    return dict(losses=losses, norms=norms, step=None, what=None, made=rec)


_PLAIN: dict[str, dict[str, Any]] = {}


def plain(name: str) -> dict[str, Any]:
    if name not in _PLAIN:
        _PLAIN[name] = plain_run(CASES[name][0]())
    return _PLAIN[name]


def _rise_start(series: list[float], at: int) -> int:
    """The first step of the run of rises that ends at ``at``."""
    s = at
    while s > 0 and series[s] > series[s - 1]:
        s -= 1
    return s


def leader(losses: list[float], norms: list[float]) -> str:
    """docs/escalation.md: the gradients lead when both diverge and the norm's rise began first."""
    rl, rn = _rule_step(losses), _rule_step(norms)
    if rn is None:
        return "loss_spike"
    if rl is None:
        return "grad_explosion"
    return "grad_explosion" if _rise_start(norms, rn) < _rise_start(losses, rl) else "loss_spike"


# ======================================================================= the tests (plain loops)
BETWEEN_STEPS = ("aten.mean.dim", "aten.index_put_.default", "aten.div_.Tensor")
"""The user's own writes between steps that make the NaN of a ``nonfinite_param`` case (no_grad, .data)."""
WHAT = {"nonfinite_param": ("params", "loss"), "optimizer_state": ("state",), "nonfinite_grad": ("grads",),
        "nonfinite_loss": ("loss",)}
"""What the plain run sees first: a parameter written non-finite between steps shows in the loss of the
next step when the forward reads it (else in the parameters after the update)."""


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """Without nantrace: the program fails at the expected step in the expected stage (loss, gradients,
    parameters or optimizer state after the update), nothing non-finite is made before it (except by the
    user between steps), and the op that made the first non-finite value is the expected one; diverging
    runs rise by the documented rule before the first non-finite value, led by the expected series."""
    _, want = CASES[name]
    run = plain(name)
    rec: Made = run["made"]
    assert run["step"] is not None, (name, run["losses"])
    if name in DIVERGING:
        rules = [r for r in (_rule_step(run["losses"]), _rule_step(run["norms"])) if r is not None]
        assert rules and min(rules) < run["step"], (rules, run["step"], run["losses"], run["norms"])
        assert leader(run["losses"], run["norms"]) == want.kind, (run["losses"], run["norms"])
        return
    assert run["step"] == want.step and run["what"] in WHAT[want.kind], {k: v for k, v in run.items() if k != "made"}
    assert not [m for m in rec.made if m[0] < want.step], rec.made
    if want.op is not None:
        assert rec.first(want.step, want.phase == "optimizer") == want.op, rec.made
    else:  # written between steps by the user (under no_grad, .data), first thing at that step
        first = [m for m in rec.made if m[0] == want.step]
        assert first and first[0][1] in BETWEEN_STEPS, rec.made


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
    """The first blocking incident is the divergence, at or after the rule's first step (on either series)
    and before the first non-finite value; the update it blocked did not happen."""
    build, want = CASES[name]
    reference = plain(name)
    rules = [r for r in (_rule_step(reference["losses"]), _rule_step(reference["norms"])) if r is not None]
    run = train(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    assert {k: v for k, v in got.items() if k != "step"} == {k: v for k, v in JUDGE.want(want).items() if k != "step"}, \
        [describe(i) for i in run.incidents]
    assert rules and min(rules) <= got["step"] < reference["step"], (got["step"], rules, reference["step"])
    assert run.error is None or isinstance(run.error, nantrace.NonFiniteError), repr(run.error)
    assert run.unchanged_at_incident is True


@pytest.mark.parametrize("name", list(AMP) + list(EARLY))
def test_amp_cases_without_nantrace(name: str) -> None:
    """The scaled loops without nantrace: the forward overflow is at its step only, made by the expected
    float16 op, and finite in float32; the clipping call compares norms 65536x too large at every step."""
    if name in AMP:
        build, want = AMP[name]
        run = plain_amp(build())
        assert not [m for m in run["made"].made if m[0] < want.step], run["made"].made
        full = plain_amp(dataclasses.replace(build(), dtype=torch.float32))
        s = want.step  # float32: finite through the failing step, and its update not skipped
        assert all(math.isfinite(v) for v in full["losses"][:s + 1]) and not any(full["skipped"][:s + 1]), full
        if want.kind == "scaler_collapse":  # finite loss, skipped at its step only, non-finite even at scale 1
            assert all(math.isfinite(v) for v in run["losses"]), run["losses"]
            assert [s for s, k in enumerate(run["skipped"]) if k] == [want.step], run["skipped"]
            assert scale_one_grads_finite(build, want.step) == (False, True)
            return
        bad = [s for s, v in enumerate(run["losses"]) if not math.isfinite(v)]
        assert bad == [want.step], run["losses"]
        assert run["made"].first(want.step, False) == want.op, run["made"].made
    else:
        build, _ = EARLY[name]
        program = build()
        before = snapshot(program.model)
        run = plain_amp(program)
        assert all(math.isfinite(v) for v in run["losses"]) and not any(run["skipped"]), run
        if program.clip_before_unscale is not None:  # every call compares a norm 65536x too large
            assert all(t > 1000 * program.clip_before_unscale for t in run["totals"]), run["totals"]
        else:  # every call clips, and to zero: the weights never move
            assert all(t > program.clip_after for t in run["totals"]) and same(before, snapshot(program.model))


def scale_one_grads_finite(build: Callable[[], AmpProgram], step: int) -> tuple[bool, bool]:
    """Train the program plainly up to ``step``, then back-propagate that step's loss unscaled (scale 1) in its
    autocast precision and in float32: are the gradients finite?"""
    program = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=program.init_scale)
    for s, batch in enumerate(program.batches[:step]):
        program.optimizer.zero_grad()
        _amp_step(program, scaler, program.loss, batch, s)
    out = []
    for dtype in (program.dtype, None):
        program.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = program.loss(program.model, program.batches[step], step)
        loss.backward()
        out.append(_finite(p.grad for p in program.model.parameters()))
    return out[0], out[1]


@pytest.mark.parametrize("name", list(SCALER))
def test_scaler_cases_without_nantrace(name: str) -> None:
    """Without nantrace: the first loss is finite, every later one NaN (the weights are NaN after step 0's
    update, which the scaler did not skip), and the scale is 0 throughout."""
    build, (step, *_) = SCALER[name]
    run = plain_amp(build())
    assert math.isfinite(run["losses"][step]) and not any(map(math.isfinite, run["losses"][step + 1:])), run["losses"]
    assert not run["skipped"][step] and all(sc == 0.0 for sc in run["scales"]), run


@pytest.mark.parametrize("name,mode", case_params({n: None for n in SCALER}, XFAIL))
def test_scaler_diagnosis(name: str, mode: str) -> None:
    build, (step, kind, cause, action) = SCALER[name]
    run = train_amp(build(), replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error), [describe(i) for i in run.incidents])
    assert (got["step"], got["kind"], got["cause"], got["action"]) == (step, kind, cause, action), \
        [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name,mode", case_params({n: None for n in AMP}, XFAIL))
def test_amp_diagnosis(name: str, mode: str) -> None:
    build, want = AMP[name]
    assert_diagnosis(train_amp(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in EARLY}, XFAIL))
def test_amp_early_warning(name: str, mode: str) -> None:
    """The first incident is the early warning, logged (the update applied), and nothing is blocked."""
    build, (kind, cause, lo, hi) = EARLY[name]
    run = train_amp(build(), replayable=mode == "replayable")
    assert run.incidents, "no incident"
    first = run.incidents[0]
    assert (first.kind, first.cause, first.action) == (kind, cause, "logged") and lo <= first.step <= hi, \
        [describe(i) for i in run.incidents]
    assert not [i for i in run.incidents if i.action != "logged"], [describe(i) for i in run.incidents]
    assert run.error is None, repr(run.error)


# ======================================================================= 4. real framework trainers
FAIL_STEP = 3


@dataclasses.dataclass
class FWant:
    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    """``# <origin:TAG>`` in this file, or ``lib:KEY`` for a framework line (round 5b's ``LIB_LINES``)."""
    cause: str
    step: int = FAIL_STEP
    action: str = "skipped"


class Log:
    """Per optimizer step, without nantrace: loss (summed over micro-batches) and whether it, a gradient,
    or a parameter after the update was non-finite; the gradient norm."""

    def __init__(self) -> None:
        self.step = 0
        self.losses: dict[int, float] = {}
        self.norms: dict[int, float] = {}
        self.loss_bad: dict[int, bool] = {}
        self.grad_bad: dict[int, bool] = {}
        self.param_bad: dict[int, bool] = {}
        self.rec = Made()

    def loss(self, value: torch.Tensor) -> None:
        v = float(value.detach().float().sum())
        self.losses[self.step] = self.losses.get(self.step, 0.0) + v
        self.loss_bad[self.step] = self.loss_bad.get(self.step, False) or not math.isfinite(v)

    def grads(self, params: Any) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        self.grad_bad[self.step] = not _finite(grads)
        self.norms[self.step] = float(torch.stack([g.double().norm() for g in grads]).norm())

    def stepped(self, params: Any) -> None:
        self.param_bad[self.step] = not all(bool(torch.isfinite(p).all()) for p in params)
        self.step += 1
        self.rec.step = self.step


@dataclasses.dataclass
class Outcome:
    incidents: list[Any]
    error: BaseException | None
    unchanged: bool | None
    log: Log


def _quiet() -> nantrace.Config:
    return nantrace.Config(outputs={"print_incidents": False})


LIB_LINES: dict[str, tuple[str, str, str]] = {
    "hf_label_smoother": ("transformers", "trainer_pt_utils.py", "nll_loss = nll_loss.sum() / denominator"),
}
"""Framework lines of this round, beside round 5b's (``accelerate_step``, ``lightning_step``)."""


def _lib_lines() -> dict[str, tuple[str, str, str]]:
    from test_heldout_frameworks_r5b import LIB_LINES as R5B

    return {**R5B, **LIB_LINES}


def lib_line(key: str) -> tuple[str, int]:
    from test_heldout_frameworks_r5b import _lib_file

    package, rel, text = _lib_lines()[key]
    with open(_lib_file(package, rel), encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if line.strip() == text]
    assert len(hits) == 1, (key, hits)
    return f"{package}/{rel}", hits[0]


def _where(source: str | None) -> Any:
    from test_heldout_frameworks_r5b import _lib_file

    LIB_LINES = _lib_lines()
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    full = os.path.abspath(path)
    if os.path.exists(full) and os.path.samefile(full, HERE):
        return os.path.basename(HERE), int(line)
    for package, rel, _ in LIB_LINES.values():
        if os.path.exists(full) and os.path.samefile(full, _lib_file(package, rel)):
            return f"{package}/{rel}", int(line)
    return source


def fw_want(want: FWant) -> dict[str, Any]:
    line = None
    if want.tag is not None:
        line = lib_line(want.tag[4:]) if want.tag.startswith("lib:") else (os.path.basename(HERE), origin_line(HERE, want.tag))
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=line)


def fw_got(incidents: list[Any]) -> dict[str, Any] | None:
    main = [i for i in incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=_where(inc.source))


# ------------------------------------------------------------------ Hugging Face
def _hf() -> Any:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nantrace[hf]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'nantrace[hf]')")
    import transformers

    return transformers


def hf_args(tmp: Path, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp / "out"), max_steps=5, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", logging_steps=1, disable_tqdm=True, train_sampling_strategy="sequential",
                learning_rate=1e-3, remove_unused_columns=False, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def hf_fit(trainer_cls: Any, model: nn.Module, args: Any, dataset: Any, watch: bool, fail: int, **kw: Any) -> Outcome:
    """Train with nantrace's callback (``watch``) or under the recorder only."""
    from transformers import TrainerCallback

    from nantrace.integrations.hf import NanTraceCallback

    log = Log()
    snaps: list[list[torch.Tensor]] = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            snaps.append(snapshot(model))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not watch:
                log.grads(model.parameters())

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            snaps.append(snapshot(model))
            if not watch:
                log.stepped(model.parameters())

    class Recording(trainer_cls):
        def training_step(self, *a: Any, **k: Any) -> torch.Tensor:
            loss = super().training_step(*a, **k)
            if not watch:
                log.loss(loss)
            return loss

    cb = NanTraceCallback(config=_quiet())
    callbacks = [cb, Recorder()] if watch else [Recorder()]
    trainer = Recording(model=model, args=args, train_dataset=dataset, callbacks=callbacks, **kw)
    error = None
    try:
        if watch:
            trainer.train()
        else:
            with log.rec:
                trainer.train()
    except Exception as exc:
        error = exc
    finally:
        cb.close()
    unchanged = same(snaps[fail + 1], snaps[fail]) if len(snaps) > fail + 1 else None
    return Outcome(list(cb.incidents), error, unchanged, log)


class Rows(torch.utils.data.Dataset):
    def __init__(self, make: Callable[[int], dict[str, Any]], n: int) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.make(i)


FW: dict[str, tuple[Callable[..., Outcome], FWant]] = {}
FW_DIVERGING: set[str] = set()
FW_XFAIL: dict[str, str] = {
}
"""name -> why nantrace is still wrong on it (a strict xfail)."""


def fw_case(name: str, want: FWant, diverging: bool = False) -> Callable:
    def register(run: Callable[..., Outcome]) -> Callable[..., Outcome]:
        assert name not in FW, name
        FW[name] = (run, want)
        if diverging:
            FW_DIVERGING.add(name)
        return run

    return register


class TabularNet(nn.Module):
    def __init__(self, d: int = 6, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(d, 16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.body(x))}


# HF 1. gradient_accumulation_steps=2 and a compute_loss with class weights from the batch's inverse
#       frequency, normalised to sum to 1 (a common recipe for imbalanced data). The second micro-batch of
#       step FAIL_STEP holds no example of class 2: its count is 0, n / (k * 0) = inf, the normalisation
#       inf / inf = NaN and finite / inf = 0, and the weighted cross-entropy is 0 / 0.
def _inverse_frequency_trainer() -> Any:
    from transformers import Trainer

    class WeightedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            k = outputs["logits"].shape[-1]
            counts = torch.bincount(labels, minlength=k).float()
            weights = counts.sum() / (k * counts)  # <origin:hf_inv_freq>
            weights = weights / weights.sum()
            loss = F.cross_entropy(outputs["logits"], labels, weight=weights)
            return (loss, outputs) if return_outputs else loss

    return WeightedTrainer


@fw_case("hf_grad_accum2_compute_loss_inverse_frequency_weights_absent_class",
         FWant("nonfinite_loss", "forward", "aten.div.Tensor", None, "hf_inv_freq", "div_by_zero"))
def _hf_inv_freq(tmp: Path, watch: bool) -> Outcome:
    _hf()
    accum, bs = 2, 4
    bad = (FAIL_STEP * accum + 1) * bs  # first row of micro-batch 1 of step FAIL_STEP

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(8100 + i)
        label = i % 3 if not bad <= i < bad + bs else (i - bad) % 2  # classes 0 and 1 only
        return {"x": torch.randn(6, generator=g) + 0.5 * label, "labels": torch.tensor(label)}

    args = hf_args(tmp, per_device_train_batch_size=bs, gradient_accumulation_steps=accum)
    return hf_fit(_inverse_frequency_trainer(), TabularNet(), args, Rows(row, 5 * accum * bs), watch, FAIL_STEP)


# HF 2. A GPT2LMHeadModel built from a tiny config, instruction-tuned with a compute_loss that smooths the
#       labels by hand and averages over the supervised (response) tokens. The prompt tokens are masked with
#       -100 by the collator; the second micro-batch of step FAIL_STEP holds only examples whose response was
#       truncated away at max_length, so every label is -100 and the token count is 0: 0 / 0.
def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def _smoothed_lm_trainer() -> Any:
    from transformers import Trainer

    class SmoothedLMTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits, targets = outputs.logits[:, :-1], labels[:, 1:]
            logp = F.log_softmax(logits.float(), dim=-1)
            supervised = (targets != -100).float()
            nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            per_token = 0.9 * nll - 0.1 * logp.mean(-1)
            loss = (per_token * supervised).sum() / supervised.sum()  # <origin:hf_ls_div>
            return (loss, outputs) if return_outputs else loss

    return SmoothedLMTrainer


@fw_case("hf_gpt2_compute_loss_label_smoothing_prompt_only_microbatch",
         FWant("nonfinite_loss", "forward", "aten.div.Tensor", None, "hf_ls_div", "div_by_zero"))
def _hf_gpt2(tmp: Path, watch: bool) -> Outcome:
    _hf()
    accum, bs = 2, 2
    bad = (FAIL_STEP * accum + 1) * bs

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(8200 + i)
        ids = torch.randint(3, 64, (12,), generator=g)
        labels = ids.clone()
        prompt = 12 if bad <= i < bad + bs else 7  # the response was truncated away
        labels[:prompt] = -100
        return {"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": labels}

    args = hf_args(tmp, per_device_train_batch_size=bs, gradient_accumulation_steps=accum, max_grad_norm=1.0)
    return hf_fit(_smoothed_lm_trainer(), _gpt2(), args, Rows(row, 5 * accum * bs), watch, FAIL_STEP)


# HF 2b. The same instruction-tuning run with the Trainer's own label smoothing (label_smoothing_factor=0.1,
#       transformers' LabelSmoother) and no gradient accumulation: the Trainer counts the supervised tokens of
#       the batch (num_items_in_batch, labels != -100 after the shift) and LabelSmoother divides the summed
#       NLL by it. The batch of step FAIL_STEP is all prompt-only examples: 0 / 0 in transformers' code.
@fw_case("hf_label_smoothing_factor_gpt2_prompt_only_batch",
         FWant("nonfinite_loss", "forward", "aten.div.Tensor", None, "lib:hf_label_smoother", "div_by_zero"))
def _hf_label_smoother(tmp: Path, watch: bool) -> Outcome:
    _hf()
    bs = 2

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(8250 + i)
        ids = torch.randint(3, 64, (12,), generator=g)
        labels = ids.clone()
        labels[:12 if i // bs == FAIL_STEP else 7] = -100
        return {"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": labels}

    args = hf_args(tmp, per_device_train_batch_size=bs, label_smoothing_factor=0.1)
    return hf_fit(__import__("transformers").Trainer, _gpt2(), args, Rows(row, 5 * bs), watch, FAIL_STEP)


# HF 3. A BertForSequenceClassification built from a tiny config, trained by the Trainer's default
#       optimizer (fused AdamW) with adam_epsilon=0 ("eps only matters in fp16"). Token ids come from part of
#       the vocabulary; the rows of the others (and of the positions beyond the sequence length) get exactly
#       zero gradient: exp_avg = exp_avg_sq = 0 and the fused update divides 0 by sqrt(0) + 0 at step 0, in
#       the first parameter of the first group, the word embeddings. (Each batch also carries an all-padding
#       row, attention mask all 0, that BERT's SDPA attention handles: finite.)
def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(cfg)


@fw_case("hf_bert_from_config_adam_epsilon_zero_unused_vocabulary_rows",
         FWant("nonfinite_param", "optimizer", "aten._fused_adamw_.default", "bert.embeddings.word_embeddings",
               "lib:accelerate_step", "optimizer_state", step=0))
def _hf_bert(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(8300 + i)
        ids, mask = torch.randint(5, 40, (10,), generator=g), torch.ones(10, dtype=torch.long)
        if i % 4 == 3:
            ids, mask = torch.zeros(10, dtype=torch.long), torch.zeros(10, dtype=torch.long)  # an empty example
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(i % 3)}

    args = hf_args(tmp, adam_epsilon=0.0, max_steps=3)
    return hf_fit(__import__("transformers").Trainer, _bert(), args, Rows(row, 12), watch, 0)


# HF 4. optim="sgd", a constant learning rate of 0.2 and max_grad_norm=0 (clipping off) on a linear
#       regression over unnormalised features (scale 3: the loss's curvature is ~18, so each step multiplies
#       the error by ~|1 - 0.2 * 18|). The loss grows geometrically, finite for dozens of steps.
class LinearRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pred = self.linear(x).squeeze(-1)
        out = {"logits": pred}
        if labels is not None:
            out["loss"] = F.mse_loss(pred, labels)
        return out


@fw_case("hf_trainer_optim_sgd_constant_lr_too_high_no_clipping", FWant(*SPIKE, step=-1), diverging=True)
def _hf_sgd(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(8400 + i)
        x = 3.0 * torch.randn(6, generator=g)
        return {"x": x, "labels": x[0] - 0.5 * x[1] + 0.1 * torch.randn((), generator=g)}

    args = hf_args(tmp, optim="sgd", learning_rate=0.2, lr_scheduler_type="constant", max_grad_norm=0.0,
                   per_device_train_batch_size=8, max_steps=10)
    return hf_fit(__import__("transformers").Trainer, LinearRegressor(), args, Rows(row, 80), watch, 0)


# ------------------------------------------------------------------ Lightning
def _pl() -> Any:
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'nantrace[lightning]')")
    import lightning as L

    return L


def pl_fit(model: Any, batches: list[Any], tmp: Path, watch: bool, fail: int, max_steps: int = 5,
           **trainer_kw: Any) -> Outcome:
    """Fit with nantrace's callback (``watch``) or under the recorder only; the recorded parameters are the
    first optimizer's (the one nantrace watches)."""
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

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if not watch and self.watched[0].requires_grad:
                log.loss(loss)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.after[batch_idx if manual else trainer.global_step] = [p.detach().clone() for p in self.watched]

    cb = NanTraceCallback(config=_quiet())
    recorder = Recorder()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[cb, recorder] if watch else [recorder], default_root_dir=str(tmp), **trainer_kw)
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


def _module_cls() -> Any:
    return _pl().LightningModule


# Lightning 1. A DQN (the Lightning RL example's shape) with the Nature-DQN optimizer RMSprop, eps=0 (the
#     paper's epsilon lived inside the square root; the port dropped it), and gradient_clip_val=10. The
#     behaviour policy never takes action 3 (FIRE is disabled in this environment): Q(s, 3) is never gathered,
#     so the head's row 3 (weight and bias) gets exactly zero gradient: square_avg = 0 and
#     param.addcdiv_(grad, sqrt(0) + 0) = 0 / 0 at step 0, in q_net.2.
def _pl_dqn_model() -> Any:
    class DQN(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q_net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 4))

        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return self.q_net(s)

        def training_step(self, batch, batch_idx):
            s, a, r, s2, done = batch
            q = self(s).gather(1, a[:, None]).squeeze(1)
            with torch.no_grad():
                target = r + 0.99 * (1 - done) * self(s2).max(1).values
            return F.smooth_l1_loss(q, target)

        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=2.5e-4, alpha=0.95, eps=0.0)

    return DQN()


@fw_case("pl_dqn_rmsprop_eps0_gradient_clip_action_never_taken",
         FWant("nonfinite_param", "optimizer", "aten.addcdiv_.default", "q_net.2", "lib:lightning_step",
               "optimizer_state", step=0))
def _pl_dqn(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(8500)
    batches = [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g), torch.randn(16, generator=g),
                torch.randn(16, 4, generator=g), (torch.rand(16, generator=g) < 0.1).float()) for _ in range(3)]
    return pl_fit(_pl_dqn_model(), batches, tmp, watch, 0, max_steps=3, gradient_clip_val=10.0)


# Lightning 2. A GAN under manual optimisation (generator's optimizer first, so it is the one watched) with
#     precision="bf16-mixed" and the original minimax generator loss, minimise log(1 - D(G(z))). The latent
#     batch of step FAIL_STEP holds a point of a latent walk far out (|z| large) on which the discriminator's
#     logit is about 8: sigmoid(8) = 0.99966 in float32, but the bfloat16 sigmoid rounds it to exactly 1.0,
#     and log(1 - 1) = -inf. Finite in float32: precision_overflow.
def _pl_gan_model() -> Any:
    class GAN(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 6))
            self.discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_g, opt_d = self.optimizers()

            self.toggle_optimizer(opt_g)
            p_fake = torch.sigmoid(self.discriminator(self(z)))
            g_loss = torch.log(1 - p_fake).mean()  # <origin:pl_gan_log1m>
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

            self.toggle_optimizer(opt_d)
            d_real = torch.sigmoid(self.discriminator(real))
            d_fake = torch.sigmoid(self.discriminator(self(z).detach()))
            d_loss = -(torch.log(d_real) + torch.log(1 - d_fake)).mean()
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))]

    return GAN()


@fw_case("pl_manual_gan_bf16_minimax_generator_log1m_sigmoid_rounds_to_one",
         FWant("nonfinite_loss", "forward", "aten.log.default", None, "pl_gan_log1m", "precision_overflow"))
def _pl_gan(tmp: Path, watch: bool, full_precision: bool = False) -> Outcome:
    model = _pl_gan_model()
    far = input_at(lambda z: model.discriminator(model.generator(z)), 4, 8.0, seed=85)
    g = torch.Generator().manual_seed(8600)
    batches = []
    for step in range(5):
        z = torch.randn(8, 4, generator=g)
        if step == FAIL_STEP:
            z[3] = far
        batches.append((torch.randn(8, 6, generator=g) + 1.0, z))
    return pl_fit(model, batches, tmp, watch, FAIL_STEP, max_steps=10,
                  precision="32-true" if full_precision else "bf16-mixed")


# Lightning 3. precision="bf16-mixed", an exponential survival model: hazard = exp(linear(h)), NLL
#     hazard * t - event * log(hazard). A record of step FAIL_STEP carries a duration in raw seconds where
#     years were expected, its log-hazard is about 200: exp(200) overflows bfloat16, and float32 as well
#     (bfloat16 shares float32's range): a real exp overflow, not precision; inf - inf = NaN in the loss.
class HazardHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(h)).squeeze(-1)  # <origin:pl_hazard_exp>


def _pl_survival_model() -> Any:
    class Survival(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
            self.hazard = HazardHead()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hazard(self.body(x))

        def training_step(self, batch, batch_idx):
            x, t, event = batch
            hazard = self(x)
            return (hazard * t - event * torch.log(hazard)).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Survival()


@fw_case("pl_bf16_mixed_survival_hazard_exp_overflows_float32_too",
         FWant("nonfinite_loss", "forward", "aten.exp.default", "hazard", "pl_hazard_exp", "exp_overflow"))
def _pl_survival(tmp: Path, watch: bool, full_precision: bool = False) -> Outcome:
    model = _pl_survival_model()
    outlier = input_at(lambda v: model.hazard.lin(model.body(v)), 6, 200.0, seed=87)
    g = torch.Generator().manual_seed(8700)
    batches = []
    for step in range(5):
        x = torch.randn(8, 6, generator=g)
        if step == FAIL_STEP:
            x[2] = outlier
        batches.append((x, torch.rand(8, generator=g) * 2, (torch.rand(8, generator=g) < 0.6).float()))
    return pl_fit(model, batches, tmp, watch, FAIL_STEP, precision="32-true" if full_precision else "bf16-mixed")


# Lightning 4. precision="16-mixed" on the CPU through the explicit MixedPrecision plugin with a GradScaler
#     (docs/integrations.md), gradient_clip_val=1 (Lightning unscales before clipping). A set encoder whose
#     dot-product attention forgot the 1 / sqrt(d) scaling; one sequence of step FAIL_STEP carries a token in
#     raw units, its query-key product is ~2e5: beyond float16's 65504 (inf in the bmm), finite in float32.
#     The softmax of a row holding inf is NaN: precision_overflow in module attn.
class DotAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(6, 16), nn.Linear(6, 16), nn.Linear(6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # <origin:pl_fp16_scores>
        return torch.softmax(scores, dim=-1) @ self.v(x)


def _pl_set_model() -> Any:
    class SetClassifier(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attn = DotAttention()
            self.head = nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x).mean(1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return SetClassifier()


@fw_case("pl_16_mixed_cpu_scaler_plugin_unscaled_attention_scores_overflow",
         FWant("nonfinite_loss", "forward", "aten.bmm.default", "attn", "pl_fp16_scores", "precision_overflow"))
def _pl_fp16_attention(tmp: Path, watch: bool, full_precision: bool = False) -> Outcome:
    _pl()
    from lightning.pytorch.plugins import MixedPrecision

    model = _pl_set_model()
    g = torch.Generator().manual_seed(8800)
    token = torch.randn(6, generator=g)
    with torch.no_grad():  # the raw-unit factor c at which the token's self-score q.k is 2e5 (at init, float32)
        c = float((2e5 / (model.attn.q(token) @ model.attn.k(token)).abs()).sqrt())
    batches = []
    for step in range(5):
        x = torch.randn(4, 5, 6, generator=g)
        if step == FAIL_STEP:
            x[1, 2] = c * token
        batches.append((x, torch.randint(0, 2, (4,), generator=g)))
    kw: dict[str, Any] = dict(precision="32-true") if full_precision else \
        dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    return pl_fit(model, batches, tmp, watch, FAIL_STEP, gradient_clip_val=1.0, **kw)


# Lightning 5. Trainer(detect_anomaly=True), switched on to hunt a NaN, with nantrace's callback too. A
#     metric-learning model regresses the Euclidean distance of a pair, sqrt(sum((a - b)^2)); the batch of
#     step FAIL_STEP holds the same item twice: the distance is 0 (finite), its derivative 1 / (2 * 0) = inf,
#     and the pow's backward inf * 0 = NaN. Anomaly mode raises inside backward ("Function 'PowBackward0'
#     returned nan values"): the step raised because of a bad value, kind exception, the origin the sqrt's
#     derivative (grad_singularity, module dist), and the user's RuntimeError propagates out of fit().
class EuclideanDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # <origin:pl_anomaly_sqrt>


def _pl_anomaly_model() -> Any:
    class PairRegressor(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
            self.dist = EuclideanDistance()

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.dist(self.encoder(a), self.encoder(b))

        def training_step(self, batch, batch_idx):
            a, b, target = batch
            return F.mse_loss(self(a, b), target)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return PairRegressor()


@fw_case("pl_detect_anomaly_true_duplicate_pair_sqrt_backward_raises",
         FWant("exception", "backward", "aten.sqrt.default", "dist", "pl_anomaly_sqrt", "grad_singularity",
               action="raised"))
def _pl_anomaly(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(8900)
    batches = []
    for step in range(5):
        a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        if step == FAIL_STEP:
            b[4] = a[4]  # the same item twice
        batches.append((a, b, torch.rand(8, generator=g) * 3))
    return pl_fit(_pl_anomaly_model(), batches, tmp, watch, FAIL_STEP, detect_anomaly=True)


LOW_PRECISION = {"pl_manual_gan_bf16_minimax_generator_log1m_sigmoid_rounds_to_one": True,
                 "pl_16_mixed_cpu_scaler_plugin_unscaled_attention_scores_overflow": True,
                 "pl_bf16_mixed_survival_hazard_exp_overflows_float32_too": False}
"""bf16 cases -> whether the same run in float32 stays finite."""


# ======================================================================= the tests (frameworks)
def _fw_params(names: list[str]) -> list[Any]:
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=FW_XFAIL[n])] if n in FW_XFAIL else [], id=n)
            for n in names]


def _series(log: Log) -> tuple[list[float], list[float]]:
    n = min(len(log.losses), len(log.norms))
    return [log.losses[s] for s in range(n)], [log.norms[s] for s in range(n)]


def _first_bad(log: Log) -> int | None:
    bad = [s for s in range(log.step + 1) if log.loss_bad.get(s) or log.grad_bad.get(s) or log.param_bad.get(s)]
    return bad[0] if bad else None


@pytest.mark.parametrize("name", _fw_params([n for n in FW if n not in FW_DIVERGING]))
def test_framework_diagnosis(name: str, tmp_path: Path) -> None:
    run, want = FW[name]
    out = run(tmp_path, True)
    got = fw_got(out.incidents)
    assert got is not None, ("no incident", repr(out.error))
    assert got == fw_want(want), [describe(i) + " | " + i.summary for i in out.incidents]
    if want.kind == "exception":  # the user's own error propagates, unchanged
        assert isinstance(out.error, RuntimeError) and not isinstance(out.error, nantrace.NonFiniteError), repr(out.error)
        return
    assert out.error is None, repr(out.error)
    assert out.unchanged is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name", _fw_params([n for n in FW if n in FW_DIVERGING]))
def test_framework_divergence(name: str, tmp_path: Path) -> None:
    """The divergence is the first blocking incident, at or after the rule's step and before the first
    non-finite value (none within the run here), and the update it blocked did not happen."""
    run, want = FW[name]
    reference = run(tmp_path / "plain", False)
    losses, norms = _series(reference.log)
    rules = [r for r in (_rule_step(losses), _rule_step(norms)) if r is not None]
    end = _first_bad(reference.log)
    out = run(tmp_path / "watched", True)
    got = fw_got(out.incidents)
    assert got is not None, ("no incident", repr(out.error))
    assert {k: v for k, v in got.items() if k != "step"} == {k: v for k, v in fw_want(want).items() if k != "step"}, \
        [describe(i) for i in out.incidents]
    assert rules and min(rules) <= got["step"] < (end if end is not None else len(losses)), (got["step"], rules, end)
    assert out.error is None or isinstance(out.error, nantrace.NonFiniteError), repr(out.error)


@pytest.mark.parametrize("name", list(FW))
def test_framework_construction(name: str, tmp_path: Path) -> None:
    """Without nantrace: the first non-finite value appears at the expected step, not before, in the stage
    the expectation names, made by the expected op (diverging runs: finite, rising by the documented rule,
    led by the expected series)."""
    run, want = FW[name]
    out = run(tmp_path, False)
    log = out.log
    if want.kind == "exception":  # raised in the failing step's backward, nothing non-finite before it
        assert isinstance(out.error, RuntimeError) and "nan values" in str(out.error), repr(out.error)
        assert log.step == want.step and _first_bad(log) is None and want.step in log.losses, log.__dict__
        assert not [m for m in log.rec.made if m[0] < want.step], log.rec.made
        return
    assert out.error is None, repr(out.error)
    if name in FW_DIVERGING:
        losses, norms = _series(log)
        assert _first_bad(log) is None and len(losses) >= 8, (log.__dict__)
        rules = [r for r in (_rule_step(losses), _rule_step(norms)) if r is not None]
        assert rules, (losses, norms)
        assert leader(losses, norms) == want.kind, (losses, norms)
        return
    s = want.step
    assert _first_bad(log) == s, {k: v for k, v in log.__dict__.items() if k != "rec"}
    assert not [m for m in log.rec.made if m[0] < s], log.rec.made
    if want.kind == "nonfinite_loss":
        assert log.loss_bad.get(s), log.__dict__
    elif want.kind == "nonfinite_param":
        assert not log.loss_bad.get(s) and not log.grad_bad.get(s) and log.param_bad.get(s), log.__dict__
    assert log.rec.first(s, want.phase == "optimizer") == want.op, log.rec.made[:6]


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_low_precision_cases_in_float32(name: str, tmp_path: Path) -> None:
    """The same bf16-mixed run in float32: finite throughout when the failure is bfloat16's (the GAN), the
    same failure at the same step when it is a real overflow (the survival model)."""
    out = FW[name][0](tmp_path, False, full_precision=True)
    log = out.log
    assert out.error is None, repr(out.error)
    if LOW_PRECISION[name]:
        assert _first_bad(log) is None, log.__dict__
    else:
        assert _first_bad(log) == FAIL_STEP and log.rec.first(FAIL_STEP, False) == FW[name][1].op, log.rec.made[:4]
