"""Held-out failures, round 5b: programs run by the real ``transformers.Trainer`` and
``lightning.Trainer`` with nantrace's integration callbacks, shaped like what users write with them
(gradient accumulation with one bad micro-batch, a ``compute_loss`` override, a model that computes
its own loss in ``forward``, gradient clipping, bf16 autocast on the CPU, a custom optimizer and
scheduler, an evaluation pass between training steps, manual optimisation of a GAN, a loss computed
in a helper method, a scheduler dict, code in ``on_before_optimizer_step``).

Tiny torch-defined models, synthetic data, the CPU, no downloads. The expected diagnosis of each case
(kind, phase, ATen op, module, cause and the ``# <origin:TAG>`` line) was written from how the
failure was constructed, following shared/API.md, before nantrace ran on it; every construction is
checked without nantrace too (``test_construction``): the first non-finite value appears at
``FAIL_STEP`` (counted in optimizer steps) and not before, in the stage the expectation names, and
the first op that turned finite inputs into a non-finite output there is the one expected (where the
origin rule makes them the same).

An origin in the framework's own code (the optimizer's update, issued by accelerate's or Lightning's
``optimizer.step(...)``) has its source in that file: ``source`` is the innermost frame outside torch
(``LIB_LINES``), as for ``transformers/loss/loss_utils.py`` in docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nantrace
from heldout_harness import describe, same, snapshot
from origin_markers import origin_line

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 3
STEPS = 5
FULL_PRECISION = False
"""Set by ``test_low_precision_cases_finite_in_float32``: the bf16 cases run in float32 instead."""
HERE = os.path.abspath(__file__)


@dataclasses.dataclass
class Want:
    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    """``# <origin:TAG>`` in this file, or ``lib:KEY`` for a line of a framework file (``LIB_LINES``)."""
    cause: str
    step: int = FAIL_STEP
    action: str = "skipped"
    first_op: str | None = "same"
    """The first op at FAIL_STEP that made a non-finite output of finite inputs (``"same"`` = ``op``)."""
    made_before: bool = False
    """A non-finite value is made before FAIL_STEP on purpose, outside training (an evaluation pass)."""


def _lib_file(module: str, rel: str) -> str:
    mod = __import__(module)
    return os.path.join(os.path.dirname(os.path.abspath(mod.__file__)), rel)


LIB_LINES: dict[str, tuple[str, str, str]] = {
    # key: (package, file inside it, the text of the line)
    "accelerate_step": ("accelerate", "optimizer.py", "self.optimizer.step(closure)"),
    "lightning_step": ("lightning", os.path.join("pytorch", "plugins", "precision", "precision.py"),
                       "return optimizer.step(closure=closure, **kwargs)"),
}


def lib_line(key: str) -> tuple[str, int]:
    package, rel, text = LIB_LINES[key]
    path = _lib_file(package, rel)
    with open(path, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if line.strip() == text]
    assert len(hits) == 1, (key, hits)
    return f"{package}/{rel}", hits[0]


def where(source: str | None) -> Any:
    """(file, line) of an incident's source: this file, a framework file of LIB_LINES, else the raw text."""
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


def want_fields(want: Want) -> dict[str, Any]:
    line = None
    if want.tag is not None:
        line = lib_line(want.tag[4:]) if want.tag.startswith("lib:") else (os.path.basename(HERE), origin_line(HERE, want.tag))
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=line)


def got_fields(incidents: list[Any]) -> dict[str, Any] | None:
    main = [i for i in incidents if i.action != "logged"]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=where(inc.source))


# ============================================================ recording, without nantrace
class StepLog:
    """What the construction check reads: per optimizer step, whether a loss / a gradient / a parameter
    after the update was non-finite, and the ops that made non-finite outputs of finite inputs."""

    def __init__(self) -> None:
        self.step = 0
        self.loss_bad: dict[int, bool] = {}
        self.grad_bad: dict[int, bool] = {}
        self.param_bad: dict[int, bool] = {}
        self.made: list[tuple[int, str, bool]] = []
        """(step, op, whether its scalar arguments were finite too)"""

    def loss(self, value: torch.Tensor) -> None:
        bad = not bool(torch.isfinite(value.detach().float()).all())
        self.loss_bad[self.step] = self.loss_bad.get(self.step, False) or bad

    def grads(self, params: Any) -> None:
        self.grad_bad[self.step] = not all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)

    def stepped(self, params: Any) -> None:
        self.param_bad[self.step] = not all(bool(torch.isfinite(p).all()) for p in params)
        self.step += 1


class FirstBad(TorchDispatchMode):
    """Every op whose floating inputs were all finite and whose output was not (with the step it ran in)."""

    def __init__(self, log: StepLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()]
        inputs_ok = all(bool(torch.isfinite(a).all()) for a in tensors if a.dim() > 0)  # read before an in-place op
        scalars_ok = all(math.isfinite(a) for a in leaves if isinstance(a, float)) and \
            all(bool(torch.isfinite(a).all()) for a in tensors if a.dim() == 0)
        out = func(*args, **kwargs)
        flat_out = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if flat_out and inputs_ok and not all(bool(torch.isfinite(o).all()) for o in flat_out):
            name = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
            self.log.made.append((self.log.step, name, scalars_ok))
        return out


@dataclasses.dataclass
class Outcome:
    incidents: list[Any]
    error: BaseException | None
    unchanged: bool | None
    log: StepLog | None = None


def _quiet() -> nantrace.Config:
    return nantrace.Config(outputs={"print_incidents": False})


# ============================================================ Hugging Face
def _hf() -> Any:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import transformers

    return transformers


def hf_args(tmp: Path, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", logging_steps=1, disable_tqdm=True, train_sampling_strategy="sequential",
                learning_rate=1e-2, remove_unused_columns=False, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def hf_fit(trainer_cls: Any, model: nn.Module, args: Any, dataset: Any, watch: bool, **kw: Any) -> Outcome:
    """Train with nantrace's callback (``watch``) or with the recording callbacks only."""
    from transformers import TrainerCallback

    from nantrace.integrations.hf import NanTraceCallback

    log = StepLog()

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.after: list[list[torch.Tensor]] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not watch:
                log.grads(model.parameters())

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.after.append(snapshot(model))
            if not watch:
                log.stepped(model.parameters())

    class Recording(trainer_cls):
        def training_step(self, *a: Any, **k: Any) -> torch.Tensor:
            loss = super().training_step(*a, **k)
            if not watch:
                log.loss(loss)
            return loss

    cb = NanTraceCallback(config=_quiet())
    recorder = Recorder()
    callbacks = [cb, recorder] if watch else [recorder]
    trainer = Recording(model=model, args=args, train_dataset=dataset, callbacks=callbacks, **kw)
    error = None
    mode = FirstBad(log) if not watch else None
    try:
        if mode is not None:
            with mode:
                trainer.train()
        else:
            trainer.train()
    except Exception as exc:
        error = exc
    finally:
        cb.close()
    after = recorder.after
    unchanged = same(after[FAIL_STEP], after[FAIL_STEP - 1]) if len(after) > FAIL_STEP else None
    return Outcome(list(cb.incidents), error, unchanged, log)


class Rows(torch.utils.data.Dataset):
    def __init__(self, make: Callable[[int], dict[str, Any]], n: int) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.make(i)


CASES: dict[str, tuple[Callable[[Path, bool], Outcome], Want]] = {}
XFAIL: dict[str, str] = {}
"""name -> why nantrace is still wrong on it (a strict xfail). Fixed since: a compute_loss that calls the model's
parts directly (model.query_encoder(...)) is recorded by the parts' own hooks (StepRecorder.part_hooks)."""
LOW_PRECISION = ("hf_bf16_cpu_sigmoid_rounds_to_one_log1m", "pl_bf16_mixed_one_pass_variance_cancellation_sqrt",
                 "pl_bf16_mixed_training_step_bce_sigmoid_rounds_to_one")


def case(name: str, want: Want) -> Callable:
    def register(run: Callable[[Path, bool], Outcome]) -> Callable[[Path, bool], Outcome]:
        assert name not in CASES, name
        CASES[name] = (run, want)
        return run

    return register


# ------------------------------------------------------------------ HF 1
# gradient_accumulation_steps=4, batch 2: prices are log-transformed inside the model (a LogFeatures
# module); the second micro-batch of optimizer step FAIL_STEP carries a price of 0 (a free item):
# log(0) = -inf, the linear layer mixes it into +-inf logits, the cross-entropy turns them into NaN.
class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # <origin:hf_log_price>


class PriceClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = LogFeatures()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, prices: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(self.features(prices)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


@case("hf_grad_accum4_one_bad_microbatch_log_price",
      Want("nonfinite_loss", "forward", "aten.log.default", "features", "hf_log_price", "log_nonpositive"))
def _hf_accum(tmp: Path, watch: bool) -> Outcome:
    _hf()
    accum, bs = 4, 2
    bad_sample = (FAIL_STEP * accum + 1) * bs + 1  # micro-batch 1 (of 0..3) of step FAIL_STEP

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(2000 + i)
        prices = torch.rand(5, generator=g) * 50 + 1
        if i == bad_sample:
            prices[2] = 0.0
        return {"prices": prices, "labels": torch.randint(0, 3, (), generator=g)}

    args = hf_args(tmp, per_device_train_batch_size=bs, gradient_accumulation_steps=accum)
    return hf_fit(__import__("transformers").Trainer, PriceClassifier(), args, Rows(row, STEPS * accum * bs), watch)


# ------------------------------------------------------------------ HF 2
# A compute_loss override with hand-written label smoothing on log(softmax): an unnormalised batch
# (a feature in raw units, 1e4) spreads the logits by more than 104, softmax underflows to exactly 0
# and log(0) = -inf; every smoothed target weight is positive, so the loss is +inf.
class TabularNet(nn.Module):
    def __init__(self, d: int = 6, classes: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(d, 16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.body(x))}


def _smoothing_trainer() -> Any:
    from transformers import Trainer

    class SmoothTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs["logits"]
            eps, k = 0.1, logits.shape[-1]
            target = torch.full_like(logits, eps / k).scatter_(1, labels[:, None], 1 - eps + eps / k)
            logp = torch.log(torch.softmax(logits, dim=-1))  # <origin:hf_smooth_log>
            loss = -(target * logp).sum(-1).mean()
            return (loss, outputs) if return_outputs else loss

    return SmoothTrainer


@case("hf_compute_loss_handwritten_label_smoothing_softmax_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "hf_smooth_log", "log_nonpositive"))
def _hf_smoothing(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(3000 + i)
        x = torch.randn(6, generator=g)
        if i // 4 == FAIL_STEP and i % 4 == 2:
            x[0] = 1e4  # a raw-unit feature the scaler missed
        return {"x": x, "labels": torch.randint(0, 4, (), generator=g)}

    return hf_fit(_smoothing_trainer(), TabularNet(), hf_args(tmp, learning_rate=1e-3), Rows(row, 4 * STEPS), watch)


# ------------------------------------------------------------------ HF 3
# A masked-LM whose forward computes its own loss, normalised by the Trainer's num_items_in_batch
# (the forward takes **kwargs, so the Trainer passes it), with gradient accumulation 2: no token of
# either micro-batch of step FAIL_STEP was masked (every label -100), so the token count is 0 and
# the sum of ignored token losses (0) is divided by it.
class TinyMLM(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                **kwargs: Any) -> Any:
        from transformers.modeling_outputs import MaskedLMOutput

        logits = self.lm_head(self.mix(self.emb(input_ids)))
        loss = None
        if labels is not None:
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                    reduction="sum")
            n = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
            loss = total / n  # <origin:hf_mlm_div>
        return MaskedLMOutput(loss=loss, logits=logits)


@case("hf_model_own_mlm_loss_all_labels_ignored_num_items_zero",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "", "hf_mlm_div", "label_out_of_range"))
def _hf_mlm(tmp: Path, watch: bool) -> Outcome:
    _hf()
    accum, bs = 2, 2

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(4000 + i)
        ids = torch.randint(0, 40, (8,), generator=g)
        labels = torch.full((8,), -100)
        if i // (accum * bs) != FAIL_STEP:
            pos = torch.randperm(8, generator=g)[:2]
            labels[pos] = ids[pos]
        return {"input_ids": ids, "labels": labels}

    args = hf_args(tmp, per_device_train_batch_size=bs, gradient_accumulation_steps=accum, learning_rate=1e-3)
    return hf_fit(__import__("transformers").Trainer, TinyMLM(), args, Rows(row, STEPS * accum * bs), watch)


# ------------------------------------------------------------------ HF 4
# max_grad_norm clipping on: a metric-learning model scores pairs by a hand-written Euclidean
# distance sqrt(sum((a-b)^2)); a batch with a duplicated pair (the same item twice) has distance 0,
# whose derivative is infinite: 0 * inf = NaN in the gradient (the forward is finite). The Trainer's
# clipping then multiplies every gradient by the NaN total norm.
class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # <origin:hf_pair_sqrt>


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        self.dist = PairDistance()

    def forward(self, left: torch.Tensor, right: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        d = self.dist(self.encoder(left), self.encoder(right))
        out = {"logits": d}
        if labels is not None:  # contrastive loss: similar pairs pulled together, others pushed to margin 1
            out["loss"] = (labels * d ** 2 + (1 - labels) * F.relu(1.0 - d) ** 2).mean()
        return out


@case("hf_max_grad_norm_clipping_duplicate_pair_sqrt_backward",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "dist", "hf_pair_sqrt", "grad_singularity", first_op=None))
def _hf_clip(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(5000 + i)
        left, right = torch.randn(6, generator=g), torch.randn(6, generator=g)
        if i // 4 == FAIL_STEP and i % 4 == 1:
            right = left.clone()  # the same item twice
        return {"left": left, "right": right, "labels": torch.tensor(float(i % 2))}

    args = hf_args(tmp, max_grad_norm=0.5, learning_rate=1e-3)
    return hf_fit(__import__("transformers").Trainer, Siamese(), args, Rows(row, 4 * STEPS), watch)


# ------------------------------------------------------------------ HF 5
# bf16=True on the CPU: the model's own hand-written BCE runs under the Trainer's bf16 autocast; a
# confident logit (about 10) makes the bf16 sigmoid round to exactly 1.0 (float32 would give
# 0.99995), so log(1 - p) = log(0) = -inf for a negative label. Finite in float32.
class BF16Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        p = torch.sigmoid(self.head(self.body(x))).squeeze(-1)
        out = {"logits": p}
        if labels is not None:
            out["loss"] = -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()  # <origin:hf_bf16_log>
        return out


def logit_at(f: Callable[[torch.Tensor], torch.Tensor], target: float, seed: int) -> torch.Tensor:
    """An input row on which the scalar output ``f`` is ``target`` (float32, at init): a positive direction
    scaled by bisection (``f`` is piecewise linear along it)."""
    from heldout_harness import aligned

    v = aligned(f, 6, 1.0, 5.0, seed)
    lo, hi = 0.0, 1.0
    with torch.no_grad():
        while float(f((hi * v)[None])) < target:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float(f((mid * v)[None])) < target else (lo, mid)
    return hi * v


@case("hf_bf16_cpu_sigmoid_rounds_to_one_log1m",
      Want("nonfinite_loss", "forward", "aten.log.default", "", "hf_bf16_log", "precision_overflow"))
def _hf_bf16(tmp: Path, watch: bool) -> Outcome:
    _hf()
    model = BF16Scorer()
    confident = logit_at(lambda v: model.head(model.body(v)), 10.0, seed=61)

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(6000 + i)
        x = torch.randn(6, generator=g) * 0.3
        y = float(i % 2)
        if i // 4 == FAIL_STEP and i % 4 == 0:
            x = confident.clone()  # a confident (logit about 10) negative
            y = 0.0
        return {"x": x, "labels": torch.tensor(y)}

    args = hf_args(tmp, bf16=not FULL_PRECISION, learning_rate=1e-3)
    return hf_fit(__import__("transformers").Trainer, model, args, Rows(row, 4 * STEPS), watch)


# ------------------------------------------------------------------ HF 6
# A custom optimizer and scheduler (optimizers=(opt, sched)): AdamW with a numpy warmup-cosine
# LambdaLR whose total_steps equals its warmup_steps: the first step after warmup has progress
# 0 / 0 = nan, so lr = nan and the decoupled weight decay multiplies every weight by 1 - nan * wd.
def warmup_cosine(step: int) -> float:
    if step < FAIL_STEP:
        return (step + 1) / FAIL_STEP
    progress = np.float64(step - FAIL_STEP) / np.float64(FAIL_STEP - FAIL_STEP)
    return float(0.5 * (1.0 + np.cos(np.pi * progress)))


@case("hf_custom_adamw_lambdalr_no_decay_steps_nan_lr",
      Want("nonfinite_param", "optimizer", "aten.mul_.Tensor", "body.0", "lib:accelerate_step", "optimizer_state"))
def _hf_nan_lr(tmp: Path, watch: bool) -> Outcome:
    _hf()
    model = TabularNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(7000 + i)
        return {"x": torch.randn(6, generator=g), "labels": torch.randint(0, 4, (), generator=g)}

    from transformers import Trainer

    class CETrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = F.cross_entropy(outputs["logits"], labels)
            return (loss, outputs) if return_outputs else loss

    return hf_fit(CETrainer, model, hf_args(tmp), Rows(row, 4 * STEPS), watch, optimizers=(opt, sched))


# ------------------------------------------------------------------ HF 7
# eval_strategy="steps" with eval_steps=FAIL_STEP: the evaluation set holds an empty document (mask all
# 0), so the evaluation forward (under no_grad, right before step FAIL_STEP) mean-pools 0/0 into NaN logits
# and a NaN eval_loss; training goes on. At FAIL_STEP the compute_loss's supervised-contrastive term
# (hand-written L2 normalisation of the pooled embeddings) meets a training document made of padding
# tokens only (id 0, whose embedding row is zero: padding_idx=0) with its mask left at ones: its
# pooled embedding is the zero vector and the normalisation divides 0 by its zero norm.
class DocEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 12, padding_idx=0)
        self.head = nn.Linear(12, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        m = mask.unsqueeze(-1).float()
        pooled = (self.emb(ids) * m).sum(1) / m.sum(1)
        out = {"logits": self.head(pooled), "pooled": pooled}
        if labels is not None:
            out["loss"] = F.cross_entropy(out["logits"], labels)
        return out


def _contrastive_trainer() -> Any:
    from transformers import Trainer

    class ContrastiveTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            ce = F.cross_entropy(outputs["logits"], labels)
            z = outputs["pooled"]
            z = z / z.norm(dim=-1, keepdim=True)  # <origin:hf_contrastive_l2>
            sim = z @ z.T / 0.5
            same_label = (labels[:, None] == labels[None, :]).float() - torch.eye(len(labels))
            logp = sim - torch.logsumexp(sim - 1e9 * torch.eye(len(labels)), dim=-1, keepdim=True)
            supcon = -(same_label * logp).sum() / same_label.sum().clamp(min=1)
            loss = ce + 0.1 * supcon
            return (loss, outputs) if return_outputs else loss

    return ContrastiveTrainer


@case("hf_eval_pass_with_nan_between_steps_then_contrastive_zero_norm",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "hf_contrastive_l2", "zero_variance_norm", made_before=True))
def _hf_eval(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int, evaluation: bool = False) -> dict[str, Any]:
        g = torch.Generator().manual_seed((9000 if evaluation else 8000) + i)
        ids = torch.randint(1, 30, (6,), generator=g)
        mask = torch.ones(6, dtype=torch.long)
        if evaluation and i == 1:
            mask.zero_()  # an empty document in the evaluation set
        if not evaluation and i // 4 == FAIL_STEP and i % 4 == 2:
            ids = torch.zeros(6, dtype=torch.long)  # a document of padding tokens only, mask not cleaned
        return {"ids": ids, "mask": mask, "labels": torch.tensor(i % 2)}

    args = hf_args(tmp, eval_strategy="steps", eval_steps=FAIL_STEP, per_device_eval_batch_size=4, learning_rate=1e-3)
    return hf_fit(_contrastive_trainer(), DocEncoder(), args, Rows(row, 4 * STEPS), watch,
                  eval_dataset=Rows(lambda i: row(i, True), 4))


# ============================================================ Lightning
def _pl() -> Any:
    pytest.importorskip("lightning")
    import lightning as L

    return L


def pl_fit(model: Any, batches: list[Any], tmp: Path, watch: bool, val_loader: Any = None, batches_per_step: int = 1,
           **trainer_kw: Any) -> Outcome:
    """Fit with nantrace's callback (``watch``) or with the recording callbacks only. The recorded
    parameters are those of the first optimizer (the one nantrace watches)."""
    L = _pl()
    from nantrace.integrations.lightning import NanTraceCallback

    log = StepLog()
    manual = not model.automatic_optimization

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.after: dict[int, list[torch.Tensor]] = {}
            self.watched: list[torch.Tensor] = []
            self.handle: Any = None

        def on_fit_start(self, trainer, pl_module) -> None:
            opt = trainer.optimizers[0]
            self.watched = [p for group in opt.param_groups for p in group["params"]]
            self.after[-1] = [p.detach().clone() for p in self.watched]
            if not watch:
                self.handle = opt.register_step_post_hook(lambda *_: log.stepped(self.watched))
                step = opt.step

                def checked_step(closure: Any = None, **kw: Any) -> Any:
                    def run_closure() -> Any:  # the gradients as the update will read them
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
            if not watch and self.watched[0].requires_grad:  # a GAN's other optimizer is toggled off
                log.loss(loss)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.after[batch_idx if manual else trainer.global_step] = [p.detach().clone() for p in self.watched]

    cb = NanTraceCallback(config=_quiet())
    recorder = Recorder()
    callbacks = [cb, recorder] if watch else [recorder]
    trainer = L.Trainer(max_steps=trainer_kw.pop("max_steps", STEPS), accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=str(tmp), **trainer_kw)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    loaders = (loader, val_loader) if val_loader is not None else (loader,)
    error = None
    try:
        if watch:
            trainer.fit(model, *loaders)
        else:
            with FirstBad(log):
                trainer.fit(model, *loaders)
    except Exception as exc:
        error = exc
    at = recorder.after
    if manual:  # keyed by batch: the failing step ends with batch (FAIL_STEP + 1) * batches_per_step - 1
        after, before = (FAIL_STEP + 1) * batches_per_step - 1, FAIL_STEP * batches_per_step - 1
    else:  # keyed by global_step: after the failing step vs before it
        after, before = FAIL_STEP + 1, FAIL_STEP
    unchanged = same(at[after], at[before]) if after in at and before in at else None
    return Outcome(list(cb.incidents), error, unchanged, log)


def _module_cls() -> Any:
    return _pl().LightningModule


# ------------------------------------------------------------------ Lightning 1
# gradient_clip_val=0.5: a hand-written batch standardisation with eps added outside the sqrt; the
# loader repeats one row for the whole batch at FAIL_STEP (a duplicated-sample bug), every feature
# is constant over the batch, std = sqrt(0) = 0: the forward is finite ((h - mu) = 0), the
# derivative of sqrt at 0 is infinite (0 / 0 = NaN in SqrtBackward). Clipping spreads the NaN norm.
class BatchStandardise(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mu = h.mean(0, keepdim=True)
        std = torch.sqrt(((h - mu) ** 2).mean(0, keepdim=True))  # <origin:pl_std_sqrt>
        return (h - mu) / (std + 1e-5)


def _pl_clip_model() -> Any:
    class Net(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(6, 16)
            self.norm = BatchStandardise()
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.norm(self.proj(x))))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    return Net()


@case("pl_gradient_clip_val_batch_std_sqrt_backward_duplicated_rows",
      Want("nonfinite_grad", "backward", "aten.sqrt.default", "norm", "pl_std_sqrt", "grad_singularity", first_op=None))
def _pl_clip(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(11)
    batches = []
    for step in range(STEPS):
        x = torch.randn(8, 6, generator=g)
        if step == FAIL_STEP:
            x = x[:1].repeat(8, 1)
        batches.append((x, torch.randint(0, 3, (8,), generator=g)))
    return pl_fit(_pl_clip_model(), batches, tmp, watch, gradient_clip_val=0.5)


# ------------------------------------------------------------------ Lightning 2
# accumulate_grad_batches=2: a Poisson count regressor whose rate head is exp(log-rate); the second
# micro-batch of optimizer step FAIL_STEP holds a row in raw units (x1000): exp of a log-rate above
# 88.7 overflows float32, and the hand-written Poisson NLL rate - y * log(rate) is inf - inf.
class RateHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(h)).squeeze(-1)  # <origin:pl_rate_exp>


def _pl_poisson_model() -> Any:
    class CountModel(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
            self.rate = RateHead()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rate(self.body(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            rate = self(x)
            return (rate - y * torch.log(rate)).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return CountModel()


@case("pl_accumulate_grad_batches2_poisson_rate_exp_overflow",
      Want("nonfinite_loss", "forward", "aten.exp.default", "rate", "pl_rate_exp", "exp_overflow"))
def _pl_accum(tmp: Path, watch: bool) -> Outcome:
    from heldout_harness import aligned

    model = _pl_poisson_model()
    outlier = aligned(lambda v: model.rate.lin(model.body(v)), 6, 1.0, 5000.0, 12)
    g = torch.Generator().manual_seed(12)
    batches = []
    for i in range(2 * STEPS):
        x = torch.randn(4, 6, generator=g)
        if i == 2 * FAIL_STEP + 1:
            x[3] = outlier
        batches.append((x, torch.poisson(torch.full((4,), 3.0), generator=g)))
    return pl_fit(model, batches, tmp, watch, accumulate_grad_batches=2, max_steps=STEPS)


# ------------------------------------------------------------------ Lightning 3
# Manual optimisation, a GAN with two optimizers and toggle_optimizer (the generator's first, so it
# is the one watched). The generator starts with PixelNorm (z / sqrt(mean(z^2)), eps = 0 as ported);
# the latent batch of FAIL_STEP has an all-zero row (a zero-padded latent bank): 0 / 0.
class PixelNorm(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z / torch.sqrt((z * z).mean(dim=1, keepdim=True))  # <origin:pl_pixelnorm>


def _pl_gan_model() -> Any:
    class GAN(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.generator = nn.Sequential(PixelNorm(), nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 6))
            self.discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_g, opt_d = self.optimizers()
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

            self.toggle_optimizer(opt_g)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), ones)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

            self.toggle_optimizer(opt_d)
            d_loss = 0.5 * (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                            + F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), zeros))
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))]

    return GAN()


@case("pl_manual_gan_toggle_optimizer_pixelnorm_zero_latent",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "generator.0", "pl_pixelnorm", "zero_variance_norm"))
def _pl_gan(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(13)
    batches = []
    for step in range(STEPS):
        z = torch.randn(8, 4, generator=g)
        if step == FAIL_STEP:
            z[5] = 0.0
        batches.append((torch.randn(8, 6, generator=g) + 2.0, z))
    return pl_fit(_pl_gan_model(), batches, tmp, watch, max_steps=2 * STEPS)  # global_step counts both optimizers


# ------------------------------------------------------------------ Lightning 4
# training_step computes the loss in a helper method (a _shared_step used by training and
# validation): a mean squared log error; the targets of FAIL_STEP code a missing value as -1, and
# log1p(-1) = -inf makes the loss +inf.
def _pl_msle_model() -> Any:
    class Regressor(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softplus(self.net(x)).squeeze(-1)

        def _shared_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            pred = self(x)
            return F.mse_loss(torch.log1p(pred), torch.log1p(y))  # <origin:pl_msle_log1p>

        def training_step(self, batch, batch_idx):
            loss = self._shared_step(batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Regressor()


@case("pl_training_step_helper_method_msle_missing_target",
      Want("nonfinite_loss", "forward", "aten.log1p.default", None, "pl_msle_log1p", "log_nonpositive"))
def _pl_helper(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(14)
    batches = []
    for step in range(STEPS):
        y = torch.rand(8, generator=g) * 20
        if step == FAIL_STEP:
            y[6] = -1.0  # missing value sentinel
        batches.append((torch.randn(8, 6, generator=g), y))
    return pl_fit(_pl_msle_model(), batches, tmp, watch)


# ------------------------------------------------------------------ Lightning 5
# precision="bf16-mixed" on the CPU: a hand-written batch norm with the one-pass variance
# E[h^2] - E[h]^2, computed in bfloat16 on the projection's output; the batch of FAIL_STEP carries a
# common offset (a sensor drift: every row about 40 + small noise), so E[h^2] and E[h]^2 are large and
# nearly equal: rounded to bf16 their difference is negative for some features and sqrt gives NaN.
# In float32 the difference keeps its (small, positive) value.
class OnePassBatchNorm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mean = h.mean(0, keepdim=True)
        var = (h * h).mean(0, keepdim=True) - mean * mean
        return (h - mean) / torch.sqrt(var + 1e-5)  # <origin:pl_bf16_sqrt>


def _pl_bf16_model() -> Any:
    class Net(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(6, 16)
            self.bn = OnePassBatchNorm()
            self.head = nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.bn(self.proj(x))))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return Net()


@case("pl_bf16_mixed_one_pass_variance_cancellation_sqrt",
      Want("nonfinite_loss", "forward", "aten.sqrt.default", "bn", "pl_bf16_sqrt", "precision_overflow"))
def _pl_bf16(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(15)
    batches = []
    for step in range(STEPS):
        x = torch.randn(16, 6, generator=g)
        if step == FAIL_STEP:
            x = 40.0 + 0.1 * x
        batches.append((x, torch.randint(0, 2, (16,), generator=g)))
    return pl_fit(_pl_bf16_model(), batches, tmp, watch, precision="32-true" if FULL_PRECISION else "bf16-mixed")


# ------------------------------------------------------------------ Lightning 6
# configure_optimizers returns a dict with an LR scheduler config (interval "step"): Adam with the
# warmup-cosine LambdaLR above (no decay steps): lr = nan at FAIL_STEP, the update is
# param.addcdiv_(exp_avg, denom, value=-nan).
def _pl_sched_model() -> Any:
    class Net(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    return Net()


@case("pl_scheduler_dict_lambdalr_nan_lr_adam",
      Want("nonfinite_param", "optimizer", "aten.addcdiv_.default", "net.0", "lib:lightning_step", "optimizer_state"))
def _pl_sched(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(16)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(STEPS)]
    return pl_fit(_pl_sched_model(), batches, tmp, watch)


# ------------------------------------------------------------------ Lightning 7
# Code between backward and the update in the LightningModule's own on_before_optimizer_step hook:
# normalised-gradient descent (gradients divided by their global norm). A masked-LM batch in which no
# position was masked has loss 0 (the masked mean divides by clamp(count, 1)) and every gradient
# exactly 0: the global norm is 0 and the division 0 / 0.
def _pl_normgrad_model() -> Any:
    class MLM(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(30, 16)
            self.out = nn.Linear(16, 30)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.emb(tokens)))

        def training_step(self, batch, batch_idx):
            tokens, labels, mask = batch
            logits = self(tokens)
            per_tok = F.cross_entropy(logits.reshape(-1, 30), labels.reshape(-1), reduction="none")
            return (per_tok * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)

        def on_before_optimizer_step(self, optimizer):
            with torch.no_grad():
                total = torch.sqrt(sum((p.grad ** 2).sum() for p in self.parameters() if p.grad is not None))
                for p in self.parameters():
                    p.grad.div_(total)  # <origin:pl_grad_normalise>

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return MLM()


@case("pl_on_before_optimizer_step_normalised_gradient_all_zero",
      Want("nonfinite_grad", "backward", "aten.div_.Tensor", None, "pl_grad_normalise", "zero_variance_norm"))
def _pl_normgrad(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(17)
    batches = []
    for step in range(STEPS):
        tokens = torch.randint(0, 30, (4, 6), generator=g)
        mask = (torch.rand(4, 6, generator=g) < 0.3).float()
        mask[0, 0] = 1.0
        if step == FAIL_STEP:
            mask.zero_()
        batches.append((tokens, torch.randint(0, 30, (4, 6), generator=g), mask))
    return pl_fit(_pl_normgrad_model(), batches, tmp, watch)


# ------------------------------------------------------------------ Lightning 8
# Manual optimisation, the discriminator's optimizer first (WGAN-style: D steps first, so it is the one
# watched), and the LightningModule's submodules called directly (self.discriminator(real), as the
# Lightning GAN examples do; forward is the generator). The discriminator normalises each input row
# by its L2 norm (eps = 0); the real batch of FAIL_STEP holds a blank sample (all zeros): 0 / 0 in
# module discriminator.0.
class RowNormalise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)  # <origin:pl_d_rownorm>


def _pl_gan_d_first_model() -> Any:
    class GAN(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 6))
            self.discriminator = nn.Sequential(RowNormalise(), nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_d, opt_g = self.optimizers()
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

            self.toggle_optimizer(opt_d)
            fake = self(z).detach()
            d_loss = 0.5 * (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                            + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros))
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)

            self.toggle_optimizer(opt_g)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), ones)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

        def configure_optimizers(self):
            return [torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))]

    return GAN()


@case("pl_manual_gan_discriminator_first_submodule_called_directly_blank_sample",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "discriminator.0", "pl_d_rownorm", "zero_variance_norm"))
def _pl_gan_d(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(18)
    batches = []
    for step in range(STEPS):
        real = torch.randn(8, 6, generator=g) + 2.0
        if step == FAIL_STEP:
            real[2] = 0.0  # a blank sample
        batches.append((real, torch.randn(8, 4, generator=g)))
    return pl_fit(_pl_gan_d_first_model(), batches, tmp, watch, max_steps=2 * STEPS)


# ------------------------------------------------------------------ HF 8
# A loss function handed to the Trainer (compute_loss_func=..., transformers' hook for a custom loss
# with the model's own outputs): a hand-written focal loss on softmax probabilities; an unnormalised
# row (raw units) saturates the softmax so the true class's probability underflows to 0: log(0).
def focal_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    p = torch.softmax(outputs["logits"], dim=-1).gather(1, labels[:, None]).squeeze(1)
    return (-(1 - p) ** 2 * torch.log(p)).mean()  # <origin:hf_focal_log>


@case("hf_compute_loss_func_focal_loss_softmax_underflow",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "hf_focal_log", "log_nonpositive"))
def _hf_focal(tmp: Path, watch: bool) -> Outcome:
    _hf()
    model = TabularNet()
    with torch.no_grad():
        probe = torch.zeros(6)
        probe[0] = 1e4
        top = int(model(probe[None])["logits"].argmax())

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(3100 + i)
        x, y = torch.randn(6, generator=g), torch.randint(0, 4, (), generator=g)
        if i // 4 == FAIL_STEP and i % 4 == 1:
            x[0] = 1e4  # a raw-unit feature; its label is not the class the saturated logits pick
            y = torch.tensor((top + 1) % 4)
        return {"x": x, "labels": y}

    return hf_fit(__import__("transformers").Trainer, model, hf_args(tmp, learning_rate=1e-3), Rows(row, 4 * STEPS),
                  watch, compute_loss_func=focal_loss)


# ------------------------------------------------------------------ Lightning 9
# A validation loop between training steps (val_check_interval=FAIL_STEP: validation runs, under
# Lightning's inference_mode, right before step FAIL_STEP) with validation_step and training_step
# sharing a helper that computes the loss; the validation batch has a missing-target sentinel too
# (a NaN val_loss, which Lightning only logs). The training batch of FAIL_STEP: log1p(-1) = -inf.
def _pl_val_model() -> Any:
    class Regressor(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softplus(self.net(x)).squeeze(-1)

        def _shared_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(torch.log1p(self(x)), torch.log1p(y))  # <origin:pl_val_msle>

        def training_step(self, batch, batch_idx):
            return self._shared_step(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._shared_step(batch))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Regressor()


@case("pl_validation_loop_between_steps_shared_helper_msle",
      Want("nonfinite_loss", "forward", "aten.log1p.default", None, "pl_val_msle", "log_nonpositive", made_before=True))
def _pl_val(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(19)

    def batch(bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.rand(8, generator=g) * 20
        if bad:
            y[1] = -1.0
        return torch.randn(8, 6, generator=g), y

    train = [batch(step == FAIL_STEP) for step in range(STEPS)]
    val = torch.utils.data.DataLoader([batch(True)], batch_size=None)
    return pl_fit(_pl_val_model(), train, tmp, watch, val_check_interval=FAIL_STEP, limit_val_batches=1, val_loader=val)


# ------------------------------------------------------------------ Lightning 10
# precision="bf16-mixed", the loss computed in training_step (which Lightning runs under its bf16
# autocast): a hand-written BCE on sigmoid probabilities; a confident negative (logit about 10)
# rounds to p = 1.0 in bfloat16 and log(1 - p) = log(0). Finite in float32.
def _pl_bf16_bce_model() -> Any:
    class Scorer(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x)).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            p = torch.sigmoid(self(x))
            return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # <origin:pl_bf16_bce>

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Scorer()


@case("pl_bf16_mixed_training_step_bce_sigmoid_rounds_to_one",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "pl_bf16_bce", "precision_overflow"))
def _pl_bf16_bce(tmp: Path, watch: bool) -> Outcome:
    model = _pl_bf16_bce_model()
    confident = logit_at(lambda v: model(v), 10.0, seed=62)
    g = torch.Generator().manual_seed(20)
    batches = []
    for step in range(STEPS):
        x, y = 0.3 * torch.randn(8, 6, generator=g), (torch.rand(8, generator=g) > 0.5).float()
        if step == FAIL_STEP:
            x[4], y[4] = confident, 0.0
        batches.append((x, y))
    return pl_fit(model, batches, tmp, watch, precision="32-true" if FULL_PRECISION else "bf16-mixed")


# ------------------------------------------------------------------ Lightning 11
# Manual optimisation with a closure (the pattern Lightning documents for optimizers that re-evaluate
# the loss): opt.step(closure=closure), where the closure runs the forward, manual_backward and
# returns the loss. The model log-transforms its count features (log of 0 for an absent count at
# FAIL_STEP): the gradients are computed inside optimizer.step itself.
def _pl_closure_model() -> Any:
    class Net(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.features = LogFeatures()
            self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.features(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()

            def closure() -> torch.Tensor:
                loss = F.cross_entropy(self(x), y)
                opt.zero_grad()
                self.manual_backward(loss)
                return loss

            opt.step(closure=closure)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return Net()


@case("pl_manual_optimisation_step_with_closure_log_count",
      Want("nonfinite_loss", "forward", "aten.log.default", "features", "hf_log_price", "log_nonpositive"))
def _pl_closure(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(21)
    batches = []
    for step in range(STEPS):
        x = torch.rand(8, 5, generator=g) * 50 + 1
        if step == FAIL_STEP:
            x[3, 1] = 0.0
        batches.append((x, torch.randint(0, 3, (8,), generator=g)))
    return pl_fit(_pl_closure_model(), batches, tmp, watch)


# ------------------------------------------------------------------ Lightning 12
# Automatic optimisation, training_step calling the LightningModule's submodules directly (no
# self(...), no forward at all: common in Lightning code), accumulate_grad_batches=2 with the bad
# micro-batch first of its pair, gradient_clip_val on. The encoder mean-pools over the attention mask;
# an empty document (mask all 0) in the first micro-batch of step FAIL_STEP: 0 / 0 in encoder.pool.
class MaskedMeanPool(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1)  # <origin:pl_pool_div>


class PoolEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.pool = MaskedMeanPool()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.pool(self.emb(ids), mask)


def _pl_no_forward_model() -> Any:
    class DocClassifier(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = PoolEncoder()
            self.classifier = nn.Linear(16, 2)

        def training_step(self, batch, batch_idx):
            ids, mask, y = batch
            return F.cross_entropy(self.classifier(self.encoder(ids, mask)), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return DocClassifier()


@case("pl_submodules_called_directly_accumulate_first_microbatch_empty_document",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "encoder.pool", "pl_pool_div", "div_by_zero"))
def _pl_no_forward(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(22)
    batches = []
    for i in range(2 * STEPS):
        ids = torch.randint(1, 50, (4, 7), generator=g)
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[1, 5:] = 0
        if i == 2 * FAIL_STEP:
            mask[2] = 0  # an empty document after cleaning
        batches.append((ids, mask, torch.randint(0, 2, (4,), generator=g)))
    return pl_fit(_pl_no_forward_model(), batches, tmp, watch, accumulate_grad_batches=2, gradient_clip_val=1.0)


# ------------------------------------------------------------------ HF 9
# A dual encoder (sentence-embedding style) trained with a compute_loss that calls the model's two
# encoders directly (model.query_encoder(...), model.doc_encoder(...)), never model(...), and an
# in-batch-negatives loss. A query that is empty after cleaning (mask all 0) at FAIL_STEP: the masked
# mean pool of query_encoder divides 0 by 0.
class DualEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query_encoder = PoolEncoder()
        self.doc_encoder = PoolEncoder()

    def forward(self, q_ids: torch.Tensor, q_mask: torch.Tensor, d_ids: torch.Tensor, d_mask: torch.Tensor,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        return {"logits": self.query_encoder(q_ids, q_mask) @ self.doc_encoder(d_ids, d_mask).T}


def _dual_trainer() -> Any:
    from transformers import Trainer

    class InBatchNegativesTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            q = model.query_encoder(inputs["q_ids"], inputs["q_mask"])
            d = model.doc_encoder(inputs["d_ids"], inputs["d_mask"])
            scores = q @ d.T
            loss = F.cross_entropy(scores, torch.arange(len(q)))
            return (loss, {"logits": scores}) if return_outputs else loss

    return InBatchNegativesTrainer


@case("hf_compute_loss_calls_submodules_directly_empty_query",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", "query_encoder.pool", "pl_pool_div", "div_by_zero"))
def _hf_dual(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(9500 + i)
        q_mask = torch.ones(5, dtype=torch.long)
        if i // 4 == FAIL_STEP and i % 4 == 2:
            q_mask.zero_()
        return {"q_ids": torch.randint(1, 50, (5,), generator=g), "q_mask": q_mask,
                "d_ids": torch.randint(1, 50, (7,), generator=g), "d_mask": torch.ones(7, dtype=torch.long)}

    return hf_fit(_dual_trainer(), DualEncoder(), hf_args(tmp, learning_rate=1e-3), Rows(row, 4 * STEPS), watch)


# ------------------------------------------------------------------ HF 10
# A custom data_collator that standardises each batch's features by the batch's own statistics; in the
# batch of FAIL_STEP every row comes from the same store, so the "store size" column is constant: 0 / 0.
# The collator is the data pipeline, not the step's code: the DataLoader calls it (in a worker process
# with num_workers > 0; here accelerate's loader even prefetches it during the previous step), so
# the batch as the step receives it carries the NaN: phase data, nonfinite_input. (First written as
# traced to the division like code before the forward; that broke the API's meaning of "the batch".)
def standardising_collator(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    x = torch.stack([r["x"] for r in rows])
    x = (x - x.mean(0)) / x.std(0)
    return {"x": x, "labels": torch.stack([r["labels"] for r in rows])}


@case("hf_data_collator_batch_standardisation_constant_column",
      Want("nonfinite_input", "data", None, None, None, "nonfinite_input", first_op=None, made_before=True))
def _hf_collate(tmp: Path, watch: bool) -> Outcome:
    _hf()

    def row(i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(9700 + i)
        x = torch.randn(6, generator=g)
        if i // 4 == FAIL_STEP:
            x[3] = 12.0  # store size: the same store for the whole batch
        return {"x": x, "labels": torch.randint(0, 4, (), generator=g)}

    from transformers import Trainer

    class CETrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = F.cross_entropy(outputs["logits"], labels)
            return (loss, outputs) if return_outputs else loss

    return hf_fit(CETrainer, TabularNet(), hf_args(tmp, learning_rate=1e-3), Rows(row, 4 * STEPS), watch,
                  data_collator=standardising_collator)


# ------------------------------------------------------------------ Lightning 13
# The same standardisation in the LightningModule's on_after_batch_transfer hook (Lightning calls it
# on every batch after moving it to the device, before training_step).
def _pl_transfer_model() -> Any:
    class Net(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 1))

        def on_after_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            return (x - x.mean(0)) / x.std(0), y  # <origin:pl_transfer_std>

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return Net()


@case("pl_on_after_batch_transfer_standardisation_constant_column",
      Want("nonfinite_input", "forward", "aten.div.Tensor", None, "pl_transfer_std", "zero_variance_norm"))
def _pl_transfer(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(23)
    batches = []
    for step in range(STEPS):
        x = torch.randn(8, 5, generator=g)
        if step == FAIL_STEP:
            x[:, 2] = 3.0
        batches.append((x, torch.randn(8, generator=g)))
    return pl_fit(_pl_transfer_model(), batches, tmp, watch)


# ------------------------------------------------------------------ Lightning 14
# Manual optimisation with gradient accumulation written by hand (step every 2 batches, loss / 2),
# the bad batch first of its pair: log of an absent count (0) in the model's LogFeatures module.
def _pl_manual_accum_model() -> Any:
    class Net(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.features = LogFeatures()
            self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.features(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            self.manual_backward(F.cross_entropy(self(x), y) / 2)
            if (batch_idx + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return Net()


@case("pl_manual_optimisation_hand_written_accumulation_log_count",
      Want("nonfinite_loss", "forward", "aten.log.default", "features", "hf_log_price", "log_nonpositive"))
def _pl_manual_accum(tmp: Path, watch: bool) -> Outcome:
    g = torch.Generator().manual_seed(24)
    batches = []
    for i in range(2 * STEPS):
        x = torch.rand(8, 5, generator=g) * 50 + 1
        if i == 2 * FAIL_STEP:
            x[6, 0] = 0.0
        batches.append((x, torch.randint(0, 3, (8,), generator=g)))
    return pl_fit(_pl_manual_accum_model(), batches, tmp, watch, batches_per_step=2, max_steps=STEPS)


# ======================================================================= the tests
def _params(d: dict[str, str]) -> list[Any]:
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=d[n])] if n in d else [], id=n) for n in CASES]


@pytest.mark.parametrize("name", _params(XFAIL))
def test_framework_diagnosis(name: str, tmp_path: Path) -> None:
    run, want = CASES[name]
    out = run(tmp_path, True)
    got = got_fields(out.incidents)
    assert got is not None, ("no incident", repr(out.error))
    assert got == want_fields(want), [describe(i) + " | " + i.summary for i in out.incidents]
    assert out.error is None, repr(out.error)
    assert out.unchanged is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str, tmp_path: Path) -> None:
    """Without nantrace: the first non-finite value appears at FAIL_STEP, not before, in the stage the
    expectation names (loss / gradient with a finite loss / parameter after the update with finite
    loss and gradients), and the first op at FAIL_STEP that made a non-finite output of finite inputs
    is the expected one (for a forward origin; a backward origin's op runs inside autograd)."""
    run, want = CASES[name]
    out = run(tmp_path, False)
    log = out.log
    assert out.error is None, repr(out.error)
    for s in range(FAIL_STEP):
        assert not (log.loss_bad.get(s) or log.grad_bad.get(s) or log.param_bad.get(s)), (s, log.__dict__)
    assert want.made_before or not [m for m in log.made if m[0] < FAIL_STEP], log.made
    s = FAIL_STEP
    if want.kind in ("nonfinite_loss", "nonfinite_input"):
        assert log.loss_bad.get(s), log.__dict__
    elif want.kind == "nonfinite_grad":
        assert not log.loss_bad.get(s) and log.grad_bad.get(s), log.__dict__
    elif want.kind == "nonfinite_param":
        assert not log.loss_bad.get(s) and not log.grad_bad.get(s) and log.param_bad.get(s), log.__dict__
    first = [op for st, op, scalars_ok in log.made if st == s and (scalars_ok or want.phase == "optimizer")]
    expected = want.op if want.first_op == "same" else want.first_op
    if expected is not None:
        assert first and first[0] == expected, first[:5]


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_cases_finite_in_float32(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 constructions fail because of bfloat16: the same run in float32 stays finite throughout."""
    monkeypatch.setattr(sys.modules[__name__], "FULL_PRECISION", True)
    out = CASES[name][0](tmp_path, False)
    log = out.log
    assert out.error is None and log.step == STEPS, (repr(out.error), log.step)
    assert not any(log.loss_bad.values()) and not any(log.grad_bad.values()) and not any(log.param_bad.values()), \
        log.__dict__
