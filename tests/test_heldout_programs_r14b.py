"""Held-out failures, round 14b: probes of the mechanisms docs/diagnosis.md describes as new, in programs
shaped like public training code.

1. TENSOR HOOKS belong to the code that registered them: a fairseq-style tagger whose loss code divides the
   gradient of the model's logits by the batch's token count (module ``None``); an auxiliary depth head that
   rescales its own hidden state's gradient to a target RMS in its forward (module ``aux``); a learnable prior
   offset whose gradient is unit-normalised by a hook registered at construction (module ``prior``).
2. A LOSS TERM MADE IN A USER'S FORWARD HOOK on a submodule (a feature-decorrelation penalty on a backbone, the
   last partial batch of one sample: Bessel's std of one element), added to the loss by the loss code (module =
   the hooked submodule), versus a per-example inverse-propensity weight that is NaN in the batch of a model that
   also carries a hook penalty (``nonfinite_input``).
3. STEP CODE THAT WRITES PARAMETERS after ``backward()`` and before ``optimizer.step()``: an ASAM port without the
   ``+ 1e-12`` on a hinge-loss batch whose margins are all met (every gradient exactly 0), and weight
   standardisation done in place on a conv whose smallest filter was pruned to zero between steps. Expected:
   ``nonfinite_param``, phase ``optimizer``, the op that made the value, the module holding the first parameter
   written non-finite, action ``raised`` (the weights are bad before ``step()``; test_step_code_parameter_writes.py).
4. A VALUE MADE EARLY in a long step and read by the loss code, with a loop of > 1,100 torch calls between it and
   the model's forward: per-class weights from the batch's label histogram (a class absent) before a per-sample
   augmentation loop; a behaviour policy's log-probability (its softmax underflowed at a cold temperature) before
   a discounted-returns loop; a temperature annealed to 0 and jittered by a GLOBAL RNG draw before the same
   augmentation loop (the only case where ``unknown`` is accepted, as the brief allows: the prelude does not carry
   a random draw over a start-over).
5. ``replayable`` and the USER'S PYTHON STATE: a Dynamic Weight Average loss object keeping a history list (its
   re-run reads the history as the real call left it: finite, so the step must be diagnosed from the tapes), a
   contrastive loss object with a ``deque`` memory bank, and 2's penalty list filled by a forward hook. After the
   run, that state equals a plain run's that skipped the failing update (``test_python_state_as_plain_run``).
6. OVERFLOW AT THE END OF A DIVERGENCE (``finite_anomaly_action="log"``, so the finite divergence is only logged):
   a stacked-linear forecaster with an L1 loss at lr 0.5 whose ``addmm`` overflows (``overflow``, the divergence
   named in the summary), and a binarised MLP (sign with a straight-through estimator) whose gradients grow
   through the chain of layers step after step, forward bounded, until a backward matmul overflows
   (``gradient_explosion``).
7. OPTIMIZER STEP PRE-HOOKS that rewrite ``p.grad`` in place, one registered before ``watch()`` (block-normalised
   gradients) and one after (a LARS trust ratio), and ``torch.optim.LBFGS`` with a closure whose loss goes NaN
   (a Weibull survival model, an event at time 0): the update must not land.
8. QUIET programs of the same shapes (no incident at all, training bit for bit as without nantrace).

Further probes of the same mechanisms: a hook registered by the ROOT model's forward on its encoder's output
(module ``""``, 1d); a forward-hook penalty made twice a step by the same module, bad only in its second call
(2c); Langevin noise written through ``p.data`` (3c); SAM written with foreach kernels (3d); batch statistics made
before the long loop and applied right before the forward (4d); a dict of per-task EMAs (5c); NumPy / Python random
draws in a replayable step (5d: mixup); a step that pulls its unlabeled batch from an iterator (5e: FixMatch); 7a's
hook installed with torch's GLOBAL ``register_optimizer_step_pre_hook`` (7d).

How expectations were derived: each case's expected diagnosis was written from its construction and API.md
(kinds, phases, the origin rule, cause codes) before nantrace ran on it; ``test_cases_fail_without_nantrace``
checks every construction in plain torch with an op oracle written here (``Oracle``: a TorchDispatchMode that
finds the first op whose floating inputs were finite and whose output, or in-place argument, was not, the line of
this file that issued it, the innermost module running it, or for a backward op the module whose forward made its
autograd node) and the loop's own checks (the step, and whether the loss, the gradients, or the parameters before
or after ``step()`` went bad first). The diagnosis test runs each case zero-intrusive and with ``replayable``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import MODES, Judge, Program, case_params, describe, same, snapshot, steps
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL = 3
STEPS = 5
LOG_FINITE = {"response": {"finite_anomaly_action": "log"}}


@dataclasses.dataclass
class Script(Program):
    """A Program with the extras of this round: optimizer step pre-hooks registered before / after ``watch()``,
    an optimizer that needs a closure (L-BFGS), and the user's Python state to compare after the run."""

    hooks_before_watch: list[Callable] = dataclasses.field(default_factory=list)
    hooks_after_watch: list[Callable] = dataclasses.field(default_factory=list)
    closure: bool = False
    state: Callable[[], Any] | None = None
    global_hooks: list[Callable] = dataclasses.field(default_factory=list)
    """Registered with torch.optim.optimizer.register_optimizer_step_pre_hook (every optimizer of the process)."""


@dataclasses.dataclass
class Case:
    build: Callable[[], Script]
    want: Want | None  # None: a quiet program
    config: dict[str, Any] | None = None
    unknown_ok: bool = False
    summary_says: tuple[str, ...] = ()
    kinds_ok: tuple[str, ...] = ()
    """Other kinds accepted (what the check observed is ambiguous); every other field must match."""


CASES: dict[str, Case] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
STATE_XFAIL: dict[str, str] = {}
"""name[mode] -> why the user's Python state differs from a plain run's after the run (a strict xfail)."""


def case(name: str, want: Want | None, **kw: Any) -> Callable:
    def register(build: Callable[[], Script]) -> Callable[[], Script]:
        assert name not in CASES, name
        CASES[name] = Case(build, want, **kw)
        return build

    return register


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(normal: Callable[[int], Any], bad: Callable[[int], Any]) -> list[Any]:
    return steps(normal, bad, FAIL, STEPS)


# ============================================================ 1. tensor hooks belong to the code that registered them
# 1a. A POS tagger trained fairseq-style: the loss is a SUM over tokens and the gradient is averaged over the
#     batch's real tokens by a hook the loss code puts on the model's logits. The bucketing sampler of step 3
#     serves a bucket of padding only (sentences filtered out after tokenisation): the loss is 0, the logits'
#     gradient is exactly 0, and the hook divides it by a token count of 0: 0 / 0. The hook's op belongs to the
#     loss code: module None, div_by_zero (the divisor is a count of a mask).
class PosTagger(nn.Module):
    def __init__(self, vocab: int = 60, tags: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16, padding_idx=0)
        self.enc = nn.Linear(16, 32)
        self.out = nn.Linear(32, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.enc(self.emb(tokens))))


def token_sum_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    tokens, tags = batch
    logits = model(tokens)
    real = (tokens != 0).float()
    n_tokens = real.sum()
    logits.register_hook(lambda g: g / n_tokens)  # <origin:tok_norm>
    ce = F.cross_entropy(logits.reshape(-1, 5), tags.reshape(-1), reduction="none")
    return (ce * real.reshape(-1)).sum()


@case("fairseq_style_tagger_loss_hook_divides_logit_grad_by_token_count_padding_bucket",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", None, "tok_norm", "div_by_zero", step=FAIL))
def _tagger() -> Script:
    torch.manual_seed(0)
    model = PosTagger()
    g = _gen(141)

    def batch(step: int, bad: bool = False) -> Any:
        tokens = torch.randint(1, 60, (6, 9), generator=g)
        tokens[:, 6:] = 0
        if bad:
            tokens.zero_()
        return tokens, torch.randint(0, 5, (6, 9), generator=g)

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  token_sum_loss)


# 1b. Multi-task scene model: a classification head and an auxiliary depth head. The depth head keeps the
#     gradient it sends into the trunk at a fixed RMS (a gradient-balancing trick): its forward hooks its own
#     hidden state. The batch of step 3 comes from a dataset without depth maps (has_depth all 0): the masked depth
#     loss is 0, the hidden state's gradient is exactly 0, its RMS is 0 and target_rms / rms is inf; 0 * inf = NaN.
#     The hook's op belongs to the submodule that registered it: ``aux``; the divisor is a root mean square of an
#     all-zero slice (docs/diagnosis.md's provenance table): zero_variance_norm, at the reciprocal.
class AuxDepthHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 16)
        self.out = nn.Linear(16, 1)
        self.target_rms = 1e-3

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.fc(h))
        if z.requires_grad:
            z.register_hook(self._rescale)
        return self.out(z)

    def _rescale(self, g: torch.Tensor) -> torch.Tensor:
        rms = g.pow(2).mean().sqrt()
        return g * (self.target_rms / rms)  # <origin:aux_rms>


class SceneWithDepth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.cls = nn.Linear(32, 3)
        self.aux = AuxDepthHead()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.aux(h)


def scene_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, depth, has_depth = batch
    logits, d = model(x)
    depth_err = has_depth * (d.squeeze(-1) - depth) ** 2
    return F.cross_entropy(logits, y) + depth_err.sum() / has_depth.sum().clamp(min=1)


@case("multitask_aux_head_rescales_its_hidden_grad_to_target_rms_batch_without_depth",
      Want("nonfinite_grad", "backward", "aten.reciprocal.default", "aux", "aux_rms", "zero_variance_norm", step=FAIL))
def _aux_rms() -> Script:
    torch.manual_seed(0)
    model = SceneWithDepth()
    g = _gen(142)

    def batch(step: int, bad: bool = False) -> Any:
        has = torch.zeros(12) if bad else (torch.rand(12, generator=g) < 0.7).float()
        x, y = torch.randn(12, 10, generator=g), torch.randint(0, 3, (12,), generator=g)
        return x, y, torch.randn(12, generator=g), has

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  scene_loss)


# 1c. Semi-supervised classifier (a FixMatch-like consistency term on the features) with a learnable per-class
#     prior offset on its logits, whose gradient is unit-normalised by a hook the module registers on the parameter
#     at construction. The batch of step 3 holds no labelled example: the supervised term is 0, the offset's
#     gradient is exactly 0 and g / ||g|| is 0 / 0. The hook's op belongs to the module holding the parameter
#     (``prior``); a division by a zero norm in a hook: zero_variance_norm (docs/diagnosis.md,
#     tests/test_hook_owners.py).
class PriorOffset(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(classes))
        self.offset.register_hook(lambda g: g / g.norm())  # <origin:offset_unit>

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.offset


class SemiSupervised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.prior = PriorOffset(4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.encoder(x)
        return f, self.prior(self.head(f))


def semi_supervised_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, labelled = batch
    f_weak, logits = model(x)
    f_strong, _ = model(x + 0.1 * torch.sin(3.0 * x))
    sup = (F.cross_entropy(logits, y, reduction="none") * labelled).sum() / labelled.sum().clamp(min=1)
    return sup + F.mse_loss(f_strong, f_weak.detach())


@case("semi_supervised_prior_offset_param_hook_unit_grad_batch_without_labels",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", "prior", "offset_unit", "zero_variance_norm", step=FAIL))
def _prior_offset() -> Script:
    torch.manual_seed(0)
    model = SemiSupervised()
    g = _gen(143)

    def batch(step: int, bad: bool = False) -> Any:
        labelled = torch.zeros(16) if bad else (torch.rand(16, generator=g) < 0.5).float()
        labelled[0] = 0.0 if bad else 1.0
        return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g), labelled

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  semi_supervised_loss)


# 1d. A speaker-verification model whose top-level forward scales the gradient reaching its encoder by the inverse
#     of the batch's number of distinct speakers (a per-class gradient average written as a hook, registered by the
#     model's own forward on the encoder's output). The batch of step 3 comes from an unlabelled shard: every speaker
#     id is -1 and the forward counts distinct labelled speakers over an empty selection: 0; the hook computes
#     g / 0 with g finite and non-zero (the loss has an unsupervised term): +-inf. The hook was registered by the
#     ROOT model's forward, not by the encoder that made the tensor: module "" (the watched model itself); the divisor
#     is a count: div_by_zero.
class SpeakerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 32), nn.Tanh())
        self.classifier = nn.Linear(32, 6)
        self.decoder = nn.Linear(32, 20)

    def forward(self, x: torch.Tensor, speakers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        if h.requires_grad:
            n_speakers = torch.unique(speakers[speakers >= 0]).numel() * torch.ones(())
            h.register_hook(lambda g: g / n_speakers)  # <origin:spk_hook>
        return self.classifier(h), self.decoder(h)


def speaker_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, speakers = batch
    logits, recon = model(x, speakers)
    labelled = speakers >= 0
    ce = F.cross_entropy(logits, speakers.clamp(min=0), reduction="none")
    return (ce * labelled).sum() / labelled.sum().clamp(min=1) + F.mse_loss(recon, x)


@case("speaker_net_root_forward_hooks_encoder_output_by_speaker_count_unlabelled_shard",
      Want("nonfinite_grad", "backward", "aten.div.Tensor", "", "spk_hook", "div_by_zero", step=FAIL))
def _speaker() -> Script:
    torch.manual_seed(0)
    model = SpeakerNet()
    g = _gen(157)

    def batch(step: int, bad: bool = False) -> Any:
        speakers = torch.full((12,), -1) if bad else torch.randint(0, 6, (12,), generator=g)
        return torch.randn(12, 20, generator=g), speakers

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  speaker_loss)


# ===================================================== 2. a loss term made in a user's forward hook vs a NaN weight
# 2a. A classifier with a feature-decorrelation penalty (Barlow-Twins-like) computed by a forward hook the training
#     script puts on the backbone, into a list the loss code sums and clears. The loader keeps the last partial
#     batch (drop_last=False): at step 3 it holds ONE sample, and Bessel's std over one element is 0 / 0.
#     Module: the hooked submodule (``backbone``); the std of too few elements: zero_variance_norm at the std op.
class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def _decorrelation_script(batches: list[Any]) -> Script:
    torch.manual_seed(0)
    model = Classifier()
    penalties: list[torch.Tensor] = []

    def decorrelation_penalty(module: nn.Module, inputs: Any, h: torch.Tensor) -> None:
        z = (h - h.mean(0)) / h.std(0)  # <origin:decor_std>
        c = z.T @ z / z.shape[0]
        penalties.append((c - torch.diag(torch.diagonal(c))).pow(2).sum() / h.shape[1])

    model.backbone.register_forward_hook(decorrelation_penalty)

    def loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y = batch
        ce = F.cross_entropy(m(x), y)
        pen = torch.stack(penalties).sum()
        penalties.clear()
        return ce + 0.05 * pen

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, loss, state=lambda: penalties)


def _decor_batches(last_partial: bool) -> list[Any]:
    g = _gen(144)
    n = [32, 32, 32, 1 if last_partial else 32, 32]
    return [(torch.randn(k, 20, generator=g), torch.randint(0, 10, (k,), generator=g)) for k in n]


@case("decorrelation_penalty_in_backbone_forward_hook_last_partial_batch_of_one",
      Want("nonfinite_loss", "forward", "aten.std.correction", "backbone", "decor_std", "zero_variance_norm",
           step=FAIL))
def _decor() -> Script:
    return _decorrelation_script(_decor_batches(True))


# 2b. Off-policy recommender regression weighted by inverse propensity scores from the logging policy; the model
#     carries an activation penalty computed by a forward hook on its tower (finite). One logged impression of the
#     batch of step 3 has no propensity (NaN in the log): the weight is NaN in the batch: nonfinite_input.
class Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.tower(x)).squeeze(-1)


@case("ips_weighted_regression_nan_propensity_with_activation_penalty_hook",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input", step=FAIL))
def _ips() -> Script:
    torch.manual_seed(0)
    model = Recommender()
    acts: list[torch.Tensor] = []
    model.tower.register_forward_hook(lambda m, i, h: acts.append(h.pow(2).mean()))
    g = _gen(145)

    def batch(step: int, bad: bool = False) -> Any:
        w = 1.0 / (0.05 + torch.rand(24, generator=g))
        if bad:
            w[5] = float("nan")
        return torch.randn(24, 8, generator=g), torch.randn(24, generator=g), w

    def ips_loss(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        x, y, w = b
        err = (w * (m(x) - y) ** 2).sum() / w.sum()
        pen = torch.stack(acts).sum()
        acts.clear()
        return err + 1e-3 * pen

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.02), _steps(batch, lambda s: batch(s, True)),
                  ips_loss, state=lambda: acts)


# 2c. Two-view training (a siamese consistency step) of an encoder carrying an activation-sparsity penalty in a
#     forward hook on its bias-free ReLU block: the mean magnitude of the ACTIVE units, |h|.sum() / (h > 0).sum(),
#     one penalty per call of the block into a list the loss sums. The block runs twice a step; in the batch of step
#     3 the SECOND view is blank (the augmentation cropped an all-black region: zero input rows): no unit is active
#     in that call and its penalty is 0 / 0; the first view's penalty is finite. Module: the hooked block; the
#     divisor is a count: div_by_zero. (Probes which of the two penalties made by the same module the replay reads.)
class TwoViewEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU())
        self.proj = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.block(x))


@case("two_view_consistency_sparsity_hook_penalty_second_view_blank",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "block", "active_l1", "div_by_zero", step=FAIL))
def _two_view() -> Script:
    torch.manual_seed(0)
    model = TwoViewEncoder()
    penalties: list[torch.Tensor] = []

    def active_l1(module: nn.Module, inputs: Any, h: torch.Tensor) -> None:
        penalties.append(h.abs().sum() / (h > 0).sum())  # <origin:active_l1>

    model.block.register_forward_hook(active_l1)
    g = _gen(161)

    def batch(step: int, bad: bool = False) -> Any:
        x = torch.randn(8, 16, generator=g)
        x2 = x + 0.1 * torch.randn(8, 16, generator=g)
        if bad:
            x2 = torch.zeros(8, 16)
        return x, x2

    def consistency(m: nn.Module, b: Any, step: int) -> torch.Tensor:
        z1, z2 = m(b[0]), m(b[1])
        pen = torch.stack(penalties).sum()
        penalties.clear()
        return F.mse_loss(z1, z2) + 1e-2 * pen

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  consistency, state=lambda: penalties)


# ================================================ 3. step code that writes the parameters before optimizer.step()
# 3a. ASAM (adaptive sharpness-aware minimisation) ported from the paper's pseudo-code without the 1e-12 in the
#     scale, on a multi-class hinge loss, with self-training: the batch of step 3 is the unlabelled pool's most
#     confident examples, pseudo-labelled by the model between steps (margins all met): the loss is exactly 0,
#     every gradient is exactly 0, the adaptive gradient norm is 0, rho / 0 = inf and
#     e_w = p^2 * 0 * inf = NaN is added to every weight by first_step(), before step(). Origin: the reciprocal of
#     ``rho / grad_norm``; module of the first parameter written (``body.0``); action raised.
class ASAM(torch.optim.Optimizer):
    def __init__(self, params: Any, base_optimizer: type, rho: float = 0.5, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grad_norm = torch.norm(torch.stack([(torch.abs(p) * p.grad).norm(p=2) for group in self.param_groups
                                            for p in group["params"] if p.grad is not None]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / grad_norm  # <origin:asam_scale>
            for p in group["params"]:
                if p.grad is None:
                    continue
                e_w = torch.pow(p, 2) * p.grad * scale
                p.add_(e_w)
                self.state[p]["e_w"] = e_w
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()


class MarginNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def hinge_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    return F.multi_margin_loss(model(x), y)


def _asam_script(easy_step: int) -> Script:
    torch.manual_seed(0)
    model = MarginNet()
    g = _gen(146)
    pool = torch.randn(400, 10, generator=g) * 20.0
    batches = [(torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)) for s in range(STEPS)]
    opt = ASAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.05)

    def self_training_batch(m: nn.Module, step: int) -> None:
        """Self-training: the step's batch is the pool's most confident examples, pseudo-labelled by the model."""
        if step == easy_step:
            top = m(pool).topk(2, dim=1)
            keep = (top.values[:, 0] - top.values[:, 1]).argsort(descending=True)[:16]
            batches[step][0].copy_(pool[keep])
            batches[step][1].copy_(top.indices[keep, 0])

    def second_pass(m: nn.Module, o: ASAM, step: int) -> None:
        o.first_step()
        hinge_loss(m, batches[step], step).backward()

    return Script(model, opt, batches, hinge_loss, before_step=self_training_batch, between=second_pass)


@case("asam_port_without_eps_hinge_batch_all_margins_met",
      Want("nonfinite_param", "optimizer", "aten.reciprocal.default", "body.0", "asam_scale", "div_by_zero", step=FAIL,
           action="raised"))
def _asam() -> Script:
    return _asam_script(FAIL)


# 3d. SAM written with multi-tensor (foreach) kernels, as fast ports do, on an epsilon-insensitive (SVR) loss. The
#     batch of step 3 is pseudo-labelled by the model itself between steps (targets = its own predictions, a
#     self-distillation batch): every residual is inside the epsilon tube, the loss and every gradient are exactly
#     0, rho / ||g|| = inf and torch._foreach_mul(grads, inf) = 0 * inf = NaN, written into every weight by
#     torch._foreach_add_. Origin: the reciprocal of ``rho / grad_norm``; module of the first parameter (``fc1``);
#     div_by_zero; action raised. (Probes a parameter write made by a foreach kernel, whose destinations are a list.)
class ForeachSAM(torch.optim.Optimizer):
    def __init__(self, params: Any, base_optimizer: type, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            scale = group["rho"] / grad_norm  # <origin:fsam_scale>
            e_ws = torch._foreach_mul(grads, scale)
            torch._foreach_add_(params, e_ws)
            for p, e in zip(params, e_ws):
                self.state[p]["e_w"] = e
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if "e_w" in self.state[p]]
            torch._foreach_sub_(params, [self.state[p].pop("e_w") for p in params])
        self.base_optimizer.step()


class SvrNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 24)
        self.fc2 = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


def svr_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    return F.relu((model(x) - y).abs() - 0.1).mean()


@case("foreach_sam_svr_loss_self_distilled_batch_inside_epsilon_tube",
      Want("nonfinite_param", "optimizer", "aten.reciprocal.default", "fc1", "fsam_scale", "div_by_zero", step=FAIL,
           action="raised"))
def _foreach_sam() -> Script:
    torch.manual_seed(0)
    model = SvrNet()
    g = _gen(162)
    batches = [(torch.randn(16, 6, generator=g), torch.randn(16, generator=g)) for _ in range(STEPS)]

    def self_distilled(m: nn.Module, step: int) -> None:
        if step == FAIL:
            batches[step][1].copy_(m(batches[step][0]))

    opt = ForeachSAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05)

    def second_pass(m: nn.Module, o: ForeachSAM, step: int) -> None:
        o.first_step()
        svr_loss(m, batches[step], step).backward()

    return Script(model, opt, batches, svr_loss, before_step=self_distilled, between=second_pass)


# 3b. Weight standardisation (Qiao et al.) done IN PLACE on the conv's filters after backward() (a projected
#     variant: the update is taken from standardised weights), with magnitude pruning between steps: at step 3 the
#     filter of smallest L1 norm is set to zero. Its mean and std are 0: (0 - 0) / 0 in the in-place div_. The op
#     that made the value is that div_; module ``conv``; a normalisation of a constant slice with eps = 0:
#     zero_variance_norm (API.md). Action raised.
class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).mean((2, 3)))


def standardise_conv_weights(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    with torch.no_grad():
        w = model.conv.weight
        w.sub_(w.mean(dim=(1, 2, 3), keepdim=True))
        w.div_(w.std(dim=(1, 2, 3), keepdim=True))  # <origin:ws_div>


def prune_smallest_filter(model: nn.Module, step: int) -> None:
    if step == FAIL:
        w = model.conv.weight
        w[w.abs().sum(dim=(1, 2, 3)).argmin()] = 0.0


@case("weight_standardisation_in_place_after_backward_pruned_filter",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "conv", "ws_div", "zero_variance_norm", step=FAIL,
           action="raised"))
def _ws() -> Script:
    torch.manual_seed(0)
    model = TinyConvNet()
    g = _gen(147)
    batches = [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(STEPS)]
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), batches,
                  lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=prune_smallest_filter,
                  between=standardise_conv_weights)


# 3c. Stochastic-gradient Langevin dynamics written in old-style ``.data`` code after backward(): Gaussian noise of
#     variance 2 lr / N_valid is added to every weight (N_valid: the batch's samples that survived the quality
#     filter). Every sample of the batch of step 3 was filtered out (the masked loss is 0): 2 lr / 0 = inf, the noise
#     is +-inf and p.data.add_ writes it. The op that made the value: the reciprocal of ``2 * lr / n_valid`` (a float
#     over a tensor); a count: div_by_zero; module of the first parameter written (``enc``); action raised.
class QualityRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(7, 24)
        self.out = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.enc(x))).squeeze(-1)


def filtered_mse(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, keep = batch
    return ((model(x) - y) ** 2 * keep).sum() / keep.sum().clamp(min=1)


@case("sgld_data_attribute_noise_scaled_by_valid_sample_count_batch_all_filtered",
      Want("nonfinite_param", "optimizer", "aten.reciprocal.default", "enc", "sgld_var", "div_by_zero", step=FAIL,
           action="raised"))
def _sgld() -> Script:
    torch.manual_seed(0)
    model = QualityRegressor()
    g = _gen(158)
    lr = 0.01

    def batch(step: int, bad: bool = False) -> Any:
        keep = torch.zeros(20) if bad else (torch.rand(20, generator=g) < 0.8).float()
        return torch.randn(20, 7, generator=g), torch.randn(20, generator=g), keep

    batches = _steps(batch, lambda s: batch(s, True))

    def langevin_noise(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        n_valid = batches[step][2].sum()
        std = (2 * lr / n_valid).sqrt()  # <origin:sgld_var>
        for p in m.parameters():
            p.data.add_(torch.randn_like(p.data) * std)

    return Script(model, torch.optim.SGD(model.parameters(), lr=lr), batches, filtered_mse, between=langevin_noise)


# ================================================================ 4. a value made early, a long loop, then the loss
def augment(x: torch.Tensor) -> torch.Tensor:
    """Per-sample deterministic augmentation, written as a Python loop: 3 torch calls a sample."""
    out = []
    for i in range(x.shape[0]):
        xi = torch.roll(x[i], shifts=i % 4)
        out.append(xi * (1.0 + 0.01 * (i % 5)))
    return torch.stack(out)


N_AUG = 400  # 1,200 calls in augment()


# 4a. Class-balanced cross-entropy with weights from the batch's own label histogram, computed first, then the
#     augmentation loop, then the forward. The shard of step 3 lacks class 4: its count is 0, n / (C * 0) = inf,
#     and the renormalisation inf / inf = NaN. Origin: the division that made the inf; module None; div_by_zero.
class Mlp(nn.Module):
    def __init__(self, d: int = 12, c: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def balanced_ce_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    counts = torch.bincount(y, minlength=5).float()
    weights = counts.sum() / (5 * counts)  # <origin:cw_div>
    weights = weights / weights.sum() * 5
    x = augment(x)
    return F.cross_entropy(model(x), y, weight=weights)


@case("batch_class_weights_then_1200_call_per_sample_augmentation_absent_class",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "cw_div", "div_by_zero", step=FAIL))
def _class_weights() -> Script:
    torch.manual_seed(0)
    model = Mlp()
    g = _gen(148)

    def batch(step: int, bad: bool = False) -> Any:
        y = torch.randint(0, 4 if bad else 5, (N_AUG,), generator=g)
        y[:5] = torch.arange(5) if not bad else torch.arange(5) % 4
        return torch.randn(N_AUG, 12, generator=g), y

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  balanced_ce_step)


# 4b. Off-policy policy gradient with importance weights: the behaviour policy's log-probability of each logged
#     action is computed first (from the logged behaviour logits and the actor's temperature), then the discounted
#     returns by a Python loop over the 600-step rollout (1,800 calls), then the forward. The rollout of step 3 was
#     collected by an actor at temperature 0.01 that still took an exploratory action: its softmax underflows to
#     exactly 0 and log(0) = -inf, so the importance ratio is exp(+inf). Origin: the log; module None.
class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.pi = nn.Linear(32, 3)
        self.v = nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


T_ROLLOUT, GAMMA = 600, 0.99


def offpolicy_pg(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, actions, rewards, beh_logits, beh_temp = batch
    beh_probs = F.softmax(beh_logits / beh_temp, dim=-1)
    beh_logp = torch.log(beh_probs.gather(1, actions[:, None]).squeeze(1))  # <origin:beh_log>
    ret, returns = torch.zeros(()), []
    for t in reversed(range(T_ROLLOUT)):
        ret = rewards[t] + GAMMA * ret
        returns.append(ret)
    returns = torch.stack(returns[::-1])
    logits, values = model(obs)
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(logp.detach() - beh_logp)
    adv = returns - values.detach()
    return -(ratio * adv * logp).mean() + 0.5 * F.mse_loss(values, returns)


@case("offpolicy_pg_behaviour_logprob_cold_actor_then_1800_call_returns_loop",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "beh_log", "log_nonpositive", step=FAIL))
def _offpolicy() -> Script:
    torch.manual_seed(0)
    model = ActorCritic()
    g = _gen(149)

    def batch(step: int, bad: bool = False) -> Any:
        beh_logits = torch.randn(T_ROLLOUT, 3, generator=g)
        actions = torch.randint(0, 3, (T_ROLLOUT,), generator=g)
        temp = 1.0
        if bad:
            temp = 0.01
            beh_logits[7] = torch.tensor([3.0, 0.0, -1.0])
            actions[7] = 2
        return (torch.randn(T_ROLLOUT, 6, generator=g), actions, 0.1 * torch.randn(T_ROLLOUT, generator=g), beh_logits,
                temp)

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.01), _steps(batch, lambda s: batch(s, True)),
                  offpolicy_pg)


# 4c. Temperature-scaled cross-entropy whose temperature follows a linear anneal that reaches 0 at step 3, jittered
#     by a global RNG draw ("noisy temperature"), drawn before the augmentation loop: tau = 0 * (1 + 0.05 n) = 0 and
#     logits / 0 is +-inf. Origin: the division (div_by_zero), module None. Since tau came from a random draw made
#     more than 1,024 calls before the forward, a diagnosis ``unknown`` with op, module and line None is accepted.
TAU = [1.0, 0.7, 0.35, 0.0, 0.0]


def jittered_temperature_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    tau = TAU[step] * (1.0 + 0.05 * torch.randn(()))
    x = augment(x)
    logits = model(x) / tau  # <origin:tau_div>
    return F.cross_entropy(logits, y)


@case("annealed_temperature_jittered_by_global_rng_before_1200_call_augmentation",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "tau_div", "div_by_zero", step=FAIL), unknown_ok=True)
def _tau() -> Script:
    torch.manual_seed(0)
    model = Mlp()
    g = _gen(150)
    batches = [(torch.randn(N_AUG, 12, generator=g), torch.randint(0, 5, (N_AUG,), generator=g)) for _ in range(STEPS)]
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, jittered_temperature_step)


# 4d. Standardisation with the raw batch's own statistics, computed FIRST (before the augmentation loop) and applied
#     to the augmented batch right before the forward. The batch of step 3 comes from a site whose 3rd sensor was
#     unplugged (a constant 0 column): its std is 0 and the division makes +-inf/NaN features. The division is recent;
#     its divisor's producer (the std) is 1,200 calls back. Expected as tests/test_prelude_inputs.py's batch
#     standardisation: nonfinite_input (a model input the step's code made), phase forward, the division, module
#     None, zero_variance_norm (a std of a constant column).
def early_stats_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    mu, sd = x.mean(0), x.std(0)
    x = augment(x)
    x = (x - mu) / sd  # <origin:std_div>
    return F.cross_entropy(model(x), y)


@case("batch_statistics_computed_before_1200_call_augmentation_unplugged_sensor",
      Want("nonfinite_input", "forward", "aten.div.Tensor", None, "std_div", "zero_variance_norm", step=FAIL))
def _early_stats() -> Script:
    torch.manual_seed(0)
    model = Mlp()
    g = _gen(159)

    def batch(step: int, bad: bool = False) -> Any:
        x = torch.randn(N_AUG, 12, generator=g) * 3.0 + 1.0
        if bad:
            x[:, 2] = 0.0
        return x, torch.randint(0, 5, (N_AUG,), generator=g)

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  early_stats_step)


# ======================================================================= 5. the user's Python state and replayable
# 5a. Dynamic Weight Average (Liu et al., MTAN): task weights from the ratio of the last two steps' task losses,
#     kept by the loss object in a history list that it appends to after use. The batch of step 1 has no
#     regression labels (its regression loss is exactly 0), so at step 3 the ratio L(2) / L(1) is x / 0 = inf for
#     that task, exp(inf) = inf and the softmax-like weights are inf / inf = NaN. Origin: the ratio's division
#     (div_by_zero), module None. ``replayable``'s re-run reads the history as the real call left it (one entry
#     longer: a finite ratio), so the step must be diagnosed from the tapes; the history must end as in a plain run.
class TwoTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.cls = nn.Linear(32, 3)
        self.reg = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.reg(h).squeeze(-1)


LOSS_LOG: list[float] = []
"""A module-level log the DWA object writes into (a global its code names)."""


class DynamicWeightAverage:
    def __init__(self, tasks: int = 2, temperature: float = 2.0) -> None:
        self.tasks, self.temperature = tasks, temperature
        self.history: list[torch.Tensor] = []
        self.calls = 0

    def __call__(self, model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y, target, has_target = batch
        logits, pred = model(x)
        reg = (has_target * (pred - target) ** 2).sum() / has_target.sum().clamp(min=1)
        losses = torch.stack([F.cross_entropy(logits, y), reg])
        if len(self.history) >= 2:
            r = self.history[-1] / self.history[-2]  # <origin:dwa_ratio>
            e = torch.exp(r / self.temperature)
            w = self.tasks * e / e.sum()
        else:
            w = torch.ones(self.tasks)
        self.history.append(losses.detach())
        self.calls += 1
        LOSS_LOG.append(round(float(losses.detach().sum()), 4))
        return (w * losses).sum()


def _dwa_script(unlabelled_step: int) -> Script:
    torch.manual_seed(0)
    model = TwoTaskNet()
    g = _gen(151)
    batches = []
    for s in range(STEPS):
        has = torch.zeros(16) if s == unlabelled_step else (torch.rand(16, generator=g) < 0.6).float()
        has[0] = 0.0 if s == unlabelled_step else 1.0
        batches.append((torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g),
                        torch.randn(16, generator=g), has))
    dwa = DynamicWeightAverage()
    LOSS_LOG.clear()
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, dwa,
                  state=lambda: (dwa.history, dwa.calls, list(LOSS_LOG)))


@case("dwa_task_weighting_history_list_regression_loss_zero_two_steps_before",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "dwa_ratio", "div_by_zero", step=FAIL))
def _dwa() -> Script:
    return _dwa_script(FAIL - 2)


# 5b. A contrastive loss object with a memory bank of past batches' embeddings in a ``deque(maxlen=4)`` (appended
#     after use), L2-normalising by hand. The batch of step 3 holds a blank (all-black) image; the bias-free
#     encoder maps it to a zero embedding and z / ||z|| is 0 / 0. Origin: that division, module None,
#     zero_variance_norm (a norm of an all-zero slice, as round 3a's SimCLR case). The deque must end as in a plain run.
class BankEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MemoryBankInfoNCE:
    def __init__(self, size: int = 4, tau: float = 0.2) -> None:
        g = _gen(152)
        self.tau = tau
        self.bank: deque[torch.Tensor] = deque((F.normalize(torch.randn(8, 8, generator=g), dim=1) for _ in range(2)),
                                               maxlen=size)

    def __call__(self, model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x1, x2 = batch
        z1, z2 = model(x1), model(x2)
        z1 = z1 / z1.norm(dim=1, keepdim=True)  # <origin:bank_l2>
        z2 = z2 / z2.norm(dim=1, keepdim=True)
        pos = (z1 * z2).sum(1, keepdim=True)
        neg = z1 @ torch.cat(list(self.bank)).T
        logits = torch.cat([pos, neg], 1) / self.tau
        self.bank.append(z2.detach())
        return F.cross_entropy(logits, torch.zeros(len(x1), dtype=torch.long))


@case("memory_bank_deque_infonce_manual_l2_normalise_blank_image",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "bank_l2", "zero_variance_norm", step=FAIL))
def _bank() -> Script:
    torch.manual_seed(0)
    model = BankEncoder()
    g = _gen(153)

    def batch(step: int, bad: bool = False) -> Any:
        x = torch.rand(8, 16, generator=g)
        if bad:
            x[2] = 0.0
        return x, (x + 0.05 * torch.randn(8, 16, generator=g)) * (x.abs().sum(1, keepdim=True) > 0)

    loss = MemoryBankInfoNCE()
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)), loss,
                  state=lambda: loss.bank)


# 5c. Loss balancing by each task's running mean loss, kept in a dict of EMAs keyed by task name (tasks appear as
#     the multi-dataset sampler serves them; a new task's EMA starts at its first loss). At step 3 the sampler first
#     serves the "depth" task, from a shard whose depth maps are all invalid: its masked loss is 0, its EMA starts at
#     0 and loss / ema is 0 / 0. Origin: that division (div_by_zero: an EMA of a loss is no statistic of the data),
#     module None. The dict must end as in a plain run (a re-run updates the EMAs again).
class MultiHeadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(9, 32), nn.ReLU())
        self.heads = nn.ModuleDict({"seg": nn.Linear(32, 4), "depth": nn.Linear(32, 1)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


class EmaBalancedLoss:
    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.ema: dict[str, torch.Tensor] = {}

    def __call__(self, model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        task, x, target, valid = batch
        out = model(x, task)
        if task == "seg":
            loss = F.cross_entropy(out, target.long())
        else:
            loss = ((out.squeeze(-1) - target) ** 2 * valid).sum() / valid.sum().clamp(min=1)
        if task not in self.ema:
            self.ema[task] = loss.detach().clone()
        else:
            self.ema[task] = self.decay * self.ema[task] + (1 - self.decay) * loss.detach()
        return loss / self.ema[task]  # <origin:ema_div>


@case("per_task_ema_dict_loss_balancing_new_task_first_batch_all_invalid",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "ema_div", "div_by_zero", step=FAIL))
def _ema_dict() -> Script:
    torch.manual_seed(0)
    model = MultiHeadNet()
    g = _gen(160)
    batches = []
    for s in range(STEPS):
        task = "depth" if s >= FAIL else "seg"
        valid = torch.zeros(16) if s == FAIL else torch.ones(16)
        target = torch.randint(0, 4, (16,), generator=g).float() if task == "seg" else torch.randn(16, generator=g)
        batches.append((task, torch.randn(16, 9, generator=g), target, valid))
    loss = EmaBalancedLoss()
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, loss, state=lambda: loss.ema)


# 5d. Mixup as in the reference implementation (lambda from numpy's global RNG: np.random.beta), a random horizontal
#     flip decided with Python's ``random``, and a hand-written soft-target cross-entropy, -(t * log softmax) with
#     log(F.softmax(...)). A record of the batch of step 3 was exported in raw units (x1000): its logits are ~1e3
#     apart, softmax underflows to exactly 0 and log(0) = -inf (0 * -inf = NaN where the target is 0). Origin: the
#     log, module None, log_nonpositive. The user's Python and NumPy random streams must end as in a plain run (a
#     re-run of the replayable call must not draw from them a second time, or every later lambda and flip differs).
class FlipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mixup_step(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    if random.random() < 0.5:
        x = x.flip(1)
    lam = float(np.random.beta(0.4, 0.4))
    perm = torch.arange(x.shape[0]).roll(1)
    x = lam * x + (1 - lam) * x[perm]
    t = lam * F.one_hot(y, 4).float() + (1 - lam) * F.one_hot(y[perm], 4).float()
    logp = torch.log(F.softmax(model(x), dim=1))  # <origin:mix_log>
    return -(t * logp).sum(1).mean()


def _python_rng_state() -> Any:
    state = np.random.get_state()
    return random.getstate(), [int(v) for v in state[1][:8]], int(state[2])


@case("mixup_numpy_beta_python_random_flip_raw_unit_record_softmax_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "mix_log", "log_nonpositive", step=FAIL))
def _mixup() -> Script:
    torch.manual_seed(0)
    random.seed(14)
    np.random.seed(14)
    model = FlipNet()
    g = _gen(163)

    def batch(step: int, bad: bool = False) -> Any:
        x = torch.randn(16, 10, generator=g)
        if bad:
            x[6] *= 1000.0
        return x, torch.randint(0, 4, (16,), generator=g)

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  mixup_step, state=_python_rng_state)


# 5e. FixMatch-style semi-supervised step that pulls its unlabeled batch inside the step (``xu = next(unlabeled)``,
#     the reference implementation's pattern), L2-normalises the raw spectra by hand, pseudo-labels the weak view
#     under no_grad and trains on a strong view. The unlabeled batch of step 3 holds a blank spectrum (a detector
#     dropout): x / ||x|| = 0 / 0 and the model's inputs are NaN. Expected as tests/test_prelude_inputs.py's batch
#     standardisation: nonfinite_input (a model input the step's code made), phase forward, the division, module
#     None, zero_variance_norm (a norm of an all-zero row). The unlabeled iterator must end where a plain run leaves
#     it: a re-run of the replayable step must not pull another batch (the next step would train on the wrong one).
def _fixmatch() -> Script:
    torch.manual_seed(0)
    model = Mlp(d=12, c=5)
    g = _gen(164)
    unlabeled = []
    for s in range(STEPS + 3):
        xu = torch.rand(10, 12, generator=g)
        if s == FAIL:
            xu[4] = 0.0
        unlabeled.append(xu)
    stream = iter(unlabeled)

    def fixmatch_step(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y = batch
        xu = next(stream)
        weak = xu / xu.norm(dim=1, keepdim=True)  # <origin:fm_l2>
        with torch.no_grad():
            pseudo = m(weak).argmax(1)
        strong = weak + 0.1 * torch.sin(5.0 * weak)
        return F.cross_entropy(m(x), y) + F.cross_entropy(m(strong), pseudo)

    batches = [(torch.randn(10, 12, generator=g), torch.randint(0, 5, (10,), generator=g)) for _ in range(STEPS)]
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, fixmatch_step,
                  state=lambda: stream.__length_hint__())


case("fixmatch_step_pulls_unlabeled_batch_from_iterator_blank_spectrum",
     Want("nonfinite_input", "forward", "aten.div.Tensor", None, "fm_l2", "zero_variance_norm", step=FAIL))(_fixmatch)


# ====================================================================== 6. an overflow at the end of a divergence
# 6a. A forecaster made of three stacked linear layers (no activation) trained with an L1 loss at lr 0.5 and
#     momentum 0.9: the weights grow super-exponentially (loss 83, 2e3, 4e4, 9e7, 7e14, 4e28) until the forward's
#     addmm overflows at step 25 (plain torch, Oracle). finite_anomaly_action="log": the divergence is logged, the
#     overflow blocks: nonfinite_loss, aten.addmm.default in the last layer (``2``, a bare Sequential: its ops are
#     attributed to the line that called the model), cause overflow, the divergence named in the summary.
DIVERGE_STEPS = 30


def forecast_l1(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    pred = model(x)  # <origin:forecast_call>
    return F.l1_loss(pred, y)


@case("stacked_linear_forecaster_l1_lr_too_high_logged_divergence_addmm_overflow",
      Want("nonfinite_loss", "forward", "aten.addmm.default", "2", "forecast_call", "overflow", step=25),
      config=LOG_FINITE, summary_says=("diverg",))
def _forecaster() -> Script:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1))
    g = _gen(1)
    w = torch.randn(8, 1, generator=g)
    batches = []
    for _ in range(DIVERGE_STEPS):
        x = torch.randn(64, 8, generator=g)
        batches.append((x, x @ w))
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), batches, forecast_l1)


# 6b. A binarised MLP (BinaryConnect-style: sign activations with a straight-through estimator) at lr 0.5: the
#     forward is bounded (every hidden value is +-1, the loss stays ~10-20) while the gradient through the chain of
#     8 binarised layers grows step after step (4e4, 3e9, 4e15, 8e21, ... 1.3e38) until a backward matmul overflows
#     at step 22. finite_anomaly_action="log": the growth is logged, the overflow blocks: nonfinite_grad, phase
#     backward, the forward op whose derivative overflowed (Oracle: the mm of AddmmBackward0 making the first
#     layer's weight gradient, the end of the chain: aten.addmm.default in ``layers.0``), cause
#     gradient_explosion (docs/diagnosis.md's history row; API.md: gradients grew to inf through a long chain).
class BinLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.weight, self.bias)  # <origin:bin_linear>
        return h + (torch.sign(h) - h).detach()


class BinarisedMlp(nn.Module):
    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[BinLinear(16 if i == 0 else 32, 32) for i in range(depth)])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(torch.sign(x)))


@case("binarised_mlp_ste_lr_too_high_gradients_grow_until_backward_overflow",
      Want("nonfinite_grad", "backward", "aten.addmm.default", "layers.0", "bin_linear", "gradient_explosion", step=22),
      config=LOG_FINITE)
def _bnn() -> Script:
    torch.manual_seed(0)
    model = BinarisedMlp()
    g = _gen(1)
    batches = []
    for _ in range(25):  # three failing steps (22-24): fewer than skip_budget, so the run is not escalated
        x = torch.randn(32, 16, generator=g)
        batches.append((x, x[:, :4].argmax(1)))
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), batches,
                  lambda m, b, s: F.cross_entropy(m(b[0]), b[1]))


# ======================================================== 7. optimizer step pre-hooks and L-BFGS with a closure
# 7a. Block-normalised gradients (Yu et al.: each parameter's gradient divided by its own norm) in a step pre-hook
#     registered BEFORE watch(), on a scene model with a classification and a segmentation-class head. The batch of
#     step 3 has no segmentation labels: the head's gradient is exactly 0 and grad / ||grad|| is 0 / 0 in place;
#     SGD writes NaN into ``seg_head``. Optimizer phase, the hook's div_, div_by_zero (a zero norm of this step's
#     gradient, docs/diagnosis.md), action skipped.
class SceneNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.cls = nn.Linear(32, 5)
        self.seg_head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.seg_head(h)


def scene_two_heads(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, seg, has_seg = batch
    logits, seg_logits = model(x)
    seg_loss = (F.cross_entropy(seg_logits, seg, reduction="none") * has_seg).sum() / has_seg.sum().clamp(min=1)
    return F.cross_entropy(logits, y) + seg_loss


def block_normalise(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.div_(p.grad.norm())  # <origin:bng_div>


def lars_trust_ratio(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None or p.ndim == 1:
                continue
            trust = p.norm() / p.grad.norm()  # <origin:lars_trust>
            p.grad.mul_(0.02 * trust)


def _scene_script(unlabelled_step: int, before: list[Callable], after: list[Callable]) -> Script:
    torch.manual_seed(0)
    model = SceneNet()
    g = _gen(154)
    batches = []
    for s in range(STEPS):
        has = torch.zeros(16) if s == unlabelled_step else (torch.rand(16, generator=g) < 0.5).float()
        has[0] = 0.0 if s == unlabelled_step else 1.0
        batches.append((torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g),
                        torch.randint(0, 3, (16,), generator=g), has))
    return Script(model, torch.optim.SGD(model.parameters(), lr=0.01), batches, scene_two_heads,
                  hooks_before_watch=before, hooks_after_watch=after)


@case("multitask_block_normalised_gradient_prehook_before_watch_head_without_labels",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "seg_head", "bng_div", "div_by_zero", step=FAIL))
def _bng() -> Script:
    return _scene_script(FAIL, [block_normalise], [])


# 7b. A click-through-rate model with a user and a category embedding; a trainer callback installs a LARS trust
#     ratio as a step pre-hook AFTER watch(). In the batch of step 3 the category field is missing for every
#     impression (all padding_idx): the category embedding's gradient is exactly 0, ||W|| / 0 = inf and grad * inf
#     = 0 * inf = NaN; SGD writes NaN into ``cat_emb``. The inf is made by the trust ratio's division: div_by_zero.
class CtrModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user_emb = nn.Embedding(30, 8)
        self.cat_emb = nn.Embedding(12, 8, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, users: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.user_emb(users), self.cat_emb(cats)], -1)).squeeze(-1)


@case("ctr_lars_trust_ratio_prehook_after_watch_category_field_all_padding",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "cat_emb", "lars_trust", "div_by_zero", step=FAIL))
def _lars() -> Script:
    torch.manual_seed(0)
    model = CtrModel()
    g = _gen(155)

    def batch(step: int, bad: bool = False) -> Any:
        cats = torch.zeros(32, dtype=torch.long) if bad else torch.randint(1, 12, (32,), generator=g)
        return torch.randint(0, 30, (32,), generator=g), cats, (torch.rand(32, generator=g) < 0.3).float()

    return Script(model, torch.optim.SGD(model.parameters(), lr=0.05), _steps(batch, lambda s: batch(s, True)),
                  lambda m, b, s: F.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2]),
                  hooks_after_watch=[lars_trust_ratio])


# 7d. 7a's block-normalised gradients installed for every optimizer of the process with torch's GLOBAL step
#     pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook, as a tooling library does). The code is the
#     same and runs at the same place, inside optimizer.step() before the update: the diagnosis must be 7a's (phase
#     optimizer, the hook's div_, module seg_head, div_by_zero). The check may observe the gradients the hook wrote
#     (nonfinite_grad) or the parameters the update made (nonfinite_param, as 7a): either kind is accepted.
@case("global_optimizer_step_pre_hook_block_normalised_gradient_head_without_labels",
      Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "seg_head", "bng_div", "div_by_zero", step=FAIL),
      kinds_ok=("nonfinite_grad",))
def _global_bng() -> Script:
    script = _scene_script(FAIL, [], [])
    script.global_hooks = [block_normalise]
    return script


# 7c. A Weibull accelerated-failure-time survival model fitted batch by batch with L-BFGS and a closure. A record of
#     the batch of step 3 has an event at time 0 (admitted and discharged the same day): log(0) = -inf and the
#     log-density's -log t + k (log t - log lam) is inf - inf = NaN at the closure's first evaluation. Origin: the
#     log in the loss code, module None, log_nonpositive; the L-BFGS update must not land.
class WeibullAFT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(6, 1)
        self.log_shape = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale(x).squeeze(-1), self.log_shape.exp()


def weibull_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, t, event = batch
    log_lam, k = model(x)
    log_t = torch.log(t)  # <origin:weibull_log>
    z = k * (log_t - log_lam)
    return -(event * (torch.log(k) - log_t + z) - torch.exp(z)).mean()


def _weibull_script(zero_time_step: int) -> Script:
    torch.manual_seed(0)
    model = WeibullAFT()
    g = _gen(156)
    beta = torch.randn(6, generator=g) * 0.3
    batches = []
    for s in range(STEPS):
        x = torch.randn(32, 6, generator=g)
        t = (x @ beta).exp() * (-torch.log(torch.rand(32, generator=g))) ** (1 / 1.5)
        if s == zero_time_step:
            t[4] = 0.0
        event = (torch.rand(32, generator=g) < 0.8).float()
        event[4] = 1.0
        batches.append((x, t, event))
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=5, history_size=5, line_search_fn="strong_wolfe")
    return Script(model, opt, batches, weibull_nll, closure=True)


@case("weibull_aft_lbfgs_closure_event_at_time_zero",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "weibull_log", "log_nonpositive", step=FAIL))
def _weibull() -> Script:
    return _weibull_script(FAIL)


# ============================================================================================ 8. quiet programs
case("quiet_dwa_task_weighting_all_tasks_labelled", None)(lambda: _dwa_script(-1))
case("quiet_asam_port_hinge_batches_with_margin_violations", None)(lambda: _asam_script(-1))
case("quiet_step_prehooks_before_and_after_watch_both_heads_labelled", None)(
    lambda: _scene_script(-1, [block_normalise], [lars_trust_ratio]))
case("quiet_lbfgs_weibull_positive_times", None)(lambda: _weibull_script(-1))
case("quiet_decorrelation_penalty_hook_full_batches", None)(lambda: _decorrelation_script(_decor_batches(False)))


# ======================================================================= the loop, with and without nantrace
def _blocking(incidents: list[Any]) -> int:
    return sum(1 for i in incidents if i.action != "logged")


@dataclasses.dataclass
class Run:
    incidents: list[Any]
    error: BaseException | None
    error_step: int | None
    unchanged_at_incident: bool | None


def _step(script: Script, loss_fn: Callable, batch: Any, step: int) -> None:
    model, opt = script.model, script.optimizer
    if script.closure:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model, batch, step)
            loss.backward()
            return loss

        opt.step(closure)
        return
    opt.zero_grad()
    loss_fn(model, batch, step).backward()
    if script.between is not None:
        script.between(model, opt, step)
    opt.step()


def train(script: Script, *, replayable: bool, config: dict[str, Any] | None = None) -> Run:
    """heldout_harness.train with a case's config, its step pre-hooks and an L-BFGS closure."""
    model, opt = script.model, script.optimizer
    for hook in script.hooks_before_watch:
        opt.register_step_pre_hook(hook)
    groups = {k: dict(v) for k, v in (config or {}).items()}
    groups.setdefault("outputs", {})["print_incidents"] = False
    guard = nantrace.watch(model, opt, config=nantrace.Config(**groups))
    for hook in script.hooks_after_watch:
        opt.register_step_pre_hook(hook)
    handles = [register_optimizer_step_pre_hook(hook) for hook in script.global_hooks]
    loss_fn = guard.replayable(script.loss) if replayable else script.loss
    error, error_step, unchanged = None, None, None
    try:
        for step, batch in enumerate(script.batches):
            if script.before_step is not None:
                with torch.no_grad():
                    script.before_step(model, step)
            before, seen = snapshot(model), _blocking(guard.incidents)
            try:
                _step(script, loss_fn, batch, step)
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                unchanged = same(before, snapshot(model)) if unchanged is None else unchanged
                break
            if _blocking(guard.incidents) > seen and unchanged is None:
                unchanged = same(before, snapshot(model))
    finally:
        for handle in handles:
            handle.remove()
        guard.close()
    return Run(list(guard.incidents), error, error_step, unchanged)


def _bad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).all())


def _finite(ts: Any) -> bool:
    return not any(_bad(t) for t in ts)


class Oracle(TorchDispatchMode):
    """The first op whose floating inputs were all finite and whose output (or in-place argument) was not: its
    ATen overload, the loop's phase, the line of this file that issued it, the innermost module of the model
    running it (forward) or the module whose forward made the autograd node it runs for (backward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.nodes: dict[Any, str] = {}
        self.phase, self.step = "forward", 0
        self.first: dict[str, Any] | None = None

    def _pre(self, m: nn.Module, args: Any) -> None:
        if m in self.names:
            self.stack.append(self.names[m])

    def _post(self, m: nn.Module, args: Any, out: Any) -> None:
        if m not in self.names:
            return
        self.stack.pop()
        frontier = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        for _ in range(3):  # the nodes the module's forward made (innermost module first)
            nxt = []
            for node in frontier:
                if node is not None and node not in self.nodes:
                    self.nodes[node] = self.names[m]
                    nxt.extend(f for f, _ in node.next_functions)
            frontier = nxt

    def __enter__(self) -> Oracle:
        self._handles = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                         nn.modules.module.register_module_forward_hook(self._post)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        finite_in = not any(_bad(t) for t in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if self.first is None and finite_in and any(_bad(t) for t in tree_leaves((out, args, kwargs))):
            f, line = inspect.currentframe(), None
            while f is not None:
                if os.path.abspath(f.f_code.co_filename) == HERE and f.f_code.co_name not in (
                        "__torch_dispatch__", "_step_under", "plain_run", "closure"):
                    line = f.f_lineno
                    break
                f = f.f_back
            node = torch._C._current_autograd_node()
            module = self.stack[-1] if self.stack else None
            if self.phase == "backward" and node is not None:
                module = self.nodes.get(node)
            self.first = dict(step=self.step, phase=self.phase, line=line, module=module,
                              node=type(node).__name__ if node is not None else None,
                              op=f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}")
        return out


def _first_bad(model: nn.Module) -> str:
    return next(n for n, p in model.named_parameters() if _bad(p))


def plain_run(script: Script, *, skip_bad: bool = False) -> dict[str, Any]:
    """The program without nantrace. ``skip_bad``: an update whose loss or gradients are non-finite is not made
    (what on_anomaly="skip" promises) and the run goes on; else the run ends at the first non-finite value, with
    what went bad first (loss / grads / written: parameters before step() / params: after it) and the oracle's op."""
    model, opt = script.model, script.optimizer
    for hook in script.hooks_before_watch + script.hooks_after_watch:
        opt.register_step_pre_hook(hook)
    handles = [register_optimizer_step_pre_hook(hook) for hook in script.global_hooks]
    try:
        return _plain_loop(script, skip_bad)
    finally:
        for handle in handles:
            handle.remove()


def _plain_loop(script: Script, skip_bad: bool) -> dict[str, Any]:
    model, opt = script.model, script.optimizer
    oracle = Oracle(model)
    losses: list[float] = []
    with oracle:
        for step, batch in enumerate(script.batches):
            oracle.step = step
            if script.before_step is not None:
                with torch.no_grad():
                    script.before_step(model, step)
            if script.closure:
                evals: list[torch.Tensor] = []

                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    oracle.phase = "forward"
                    loss = script.loss(model, batch, step)
                    oracle.phase = "backward"
                    loss.backward()
                    evals.append(loss.detach())
                    return loss

                before = [p.detach().clone() for p in model.parameters()]
                oracle.phase = "optimizer"
                opt.step(closure)
                if not _finite(evals):
                    if skip_bad:
                        with torch.no_grad():
                            for p, b in zip(model.parameters(), before):
                                p.copy_(b)
                        continue
                    return dict(step=step, what="loss", origin=oracle.first, losses=losses)
                losses.append(float(evals[0]))
                continue
            opt.zero_grad()
            oracle.phase = "forward"
            loss = script.loss(model, batch, step)
            losses.append(float(loss.detach()))
            oracle.phase = "backward"
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            bad = None if math.isfinite(losses[-1]) else "loss"
            bad = bad or (None if _finite(grads) else "grads")
            if bad and skip_bad:
                continue
            if bad:
                return dict(step=step, what=bad, origin=oracle.first, losses=losses)
            if script.between is not None:
                oracle.phase = "between"
                script.between(model, opt, step)
                if not _finite(model.parameters()):
                    return dict(step=step, what="written", origin=oracle.first, losses=losses, param=_first_bad(model))
            oracle.phase = "optimizer"
            opt.step()
            if not _finite(model.parameters()):
                return dict(step=step, what="params", origin=oracle.first, losses=losses, param=_first_bad(model))
    return dict(step=None, what=None, origin=None, losses=losses)


# ======================================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_input": "loss", "nonfinite_grad": "grads"}
BACKWARD_NODE = {"binarised_mlp_ste_lr_too_high_gradients_grow_until_backward_overflow": ("AddmmBackward0",
                                                                                         "aten.mm.default")}
FORWARD_HOOK_TAGS = {"decor_std", "active_l1"}
"""Origins inside a user's forward hook: torch runs the oracle's global forward hook (which pops the module) before
the module's own hooks, so the oracle cannot name their module; the construction checks op, step and line."""
LONG_PRELUDES = {"batch_class_weights_then_1200_call_per_sample_augmentation_absent_class": augment,
                 "annealed_temperature_jittered_by_global_rng_before_1200_call_augmentation": augment}


def _want_what(want: Want) -> str:
    if want.kind == "nonfinite_param":
        return "written" if want.action == "raised" else "params"
    return WHAT[want.kind]


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction, in plain torch: the program first goes bad at the expected step, in the expected way
    (loss / gradients / parameters written by the step's code before step() / parameters after step()), and the
    first op with finite inputs and a non-finite output is the expected op, at the marked line (forward and step
    code; hooks in the backward run the marked line too), in the expected module (for the backward overflow, the
    module whose forward made the autograd node). Quiet programs stay finite."""
    c = CASES[name]
    run = plain_run(c.build())
    if c.want is None:
        assert run["step"] is None, run
        return
    want = c.want
    assert (run["step"], run["what"]) == (want.step, _want_what(want)), run
    origin = run["origin"]
    if want.kind == "nonfinite_input" and want.op is None:
        assert origin is None, origin  # no op made the NaN: it came with the batch
        return
    if want.kind == "nonfinite_param":
        assert run["param"].rpartition(".")[0] == want.module, run["param"]
    if name in BACKWARD_NODE:  # the backward op (the weight gradient's mm) runs for the forward's addmm node
        node, op = BACKWARD_NODE[name]
        assert (origin["phase"], origin["node"], origin["op"], origin["module"]) == ("backward", node, op, want.module)
        return
    assert origin is not None and origin["op"] == want.op, origin
    assert origin["line"] == JUDGE.marked(want.tag)[1], (origin, JUDGE.marked(want.tag))
    if want.phase == "forward" and want.module is not None and want.tag not in FORWARD_HOOK_TAGS:
        assert origin["module"] == want.module, origin


def test_long_preludes_are_longer_than_the_window() -> None:
    """4a/4c: the calls between the early value and the model's forward exceed the prelude's 1,024-call window."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        augment(torch.randn(N_AUG, 12))
    assert Count.n > 1100, Count.n


def _check(run: Run, c: Case) -> None:
    want = c.want
    got = JUDGE.got(run.incidents)
    assert got is not None, ("no incident", repr(run.error))
    expected = JUDGE.want(want)
    if c.unknown_ok and got != expected:
        expected = dict(expected, phase=None, op=None, module=None, cause="unknown", line=None)
    if got["kind"] in c.kinds_ok:
        expected = dict(expected, kind=got["kind"])
    assert got == expected, [describe(i) + " | " + i.summary for i in run.incidents]
    main = next(i for i in run.incidents if i.action != "logged")
    for word in c.summary_says:
        assert word in (main.summary + " " + main.fix).lower(), main.summary
    if want.action == "raised" and want.kind != "exception":  # weights bad before step(): the guard raises
        assert isinstance(run.error, nantrace.NonFiniteError) and run.error_step == want.step, repr(run.error)
        return  # the user's own code wrote them before step(): nothing nantrace could leave unchanged (as round 6d)
    assert run.error is None, repr(run.error)
    assert run.unchanged_at_incident is True, "the blocked step changed the weights"


FAILING = {n: c for n, c in CASES.items() if c.want is not None}
QUIET = {n: c for n, c in CASES.items() if c.want is None}


@pytest.mark.parametrize("name,mode", case_params(FAILING, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    c = CASES[name]
    _check(train(c.build(), replayable=mode == "replayable", config=c.config), c)


@pytest.mark.parametrize("name,mode", case_params(QUIET, XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident at all (early warnings included), and the weights end bit for bit as without nantrace."""
    c = CASES[name]
    reference = c.build()
    plain_run(reference)
    script = c.build()
    run = train(script, replayable=mode == "replayable", config=c.config)
    assert not run.incidents and run.error is None, [describe(i) + " | " + i.summary for i in run.incidents]
    assert all(torch.equal(a, b) for a, b in zip(reference.model.parameters(), script.model.parameters()))


def _same_py(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(
            torch.nan_to_num(a, 1.0, 2.0, 3.0), torch.nan_to_num(b, 1.0, 2.0, 3.0))
    if isinstance(a, (list, tuple, deque)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_py(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_py(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


STATEFUL = {n: c for n, c in CASES.items() if c.build().state is not None}


@pytest.mark.parametrize("name,mode", case_params(STATEFUL, STATE_XFAIL))
def test_python_state_as_plain_run(name: str, mode: str) -> None:
    """The user's Python state (a loss object's history list or deque, a hook's penalty list) ends as in a plain
    run that skipped the failing updates: diagnosing (replays of the forwards, the loss code, a ``replayable``
    call) added, removed or changed nothing in it."""
    c = CASES[name]
    reference = c.build()
    plain_run(reference, skip_bad=True)
    expected, weights = copy.deepcopy(reference.state()), [p.detach().clone() for p in reference.model.parameters()]
    script = c.build()
    train(script, replayable=mode == "replayable", config=c.config)
    assert _same_py(script.state(), expected), (script.state(), expected)
    assert _same_py([p.detach() for p in script.model.parameters()], weights), "the weights differ"
