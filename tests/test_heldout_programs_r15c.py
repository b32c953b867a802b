"""Held-out failures, round 15c: REAL framework training runs (no mocks), the way users run them, with nantrace
attached through its integrations or through nothing at all (``nantrace run``'s in-process path).

Every program builds a real ``lightning.Trainer`` or ``transformers.Trainer`` around a tiny model (Hugging Face
models are built from a config: no download) on synthetic data, on the CPU, and fails at one optimizer step.

1. ``lightning.LightningModule`` under automatic optimisation:
   a. ``accumulate_grad_batches=2``, a DeepSurv Cox partial likelihood whose second micro-batch of step FAIL_STEP
      holds only censored patients (``sum(...) / event.sum()`` = 0 / 0);
   b. ``gradient_clip_val`` set, a sparse coder with an L1/2 penalty ``|code| ** 0.5`` on the codes of a
      bias-free encoder: a blank (all-zero) patch has code 0, the pow's derivative is infinite there and the
      gradient NaN; Lightning's ``clip_grad_norm_`` then spreads the NaN over every gradient: clipping must not
      hide where it came from;
   c. ``precision="bf16-mixed"``, a bag-of-words classifier with a hand-written softmax in ``training_step`` and
      a scraped document of raw counts: its logit is ~150, ``exp`` overflows bfloat16 AND float32 (bfloat16 has
      float32's range: not a precision overflow);
   d. a contextual-bandit policy (REINFORCE) whose frames are standardised per frame: a blank reset frame has
      std 0, the policy's probabilities are NaN, and ``torch.multinomial`` raises in ``training_step``;
   e. a physics-informed network trained with L-BFGS (Lightning drives the closure) for the radial Poisson
      equation ``u'' + u' / r = f``: the collocation grid of step FAIL_STEP includes r = 0;
   f. a masked-feature autoencoder whose ``training_step`` returns ``None`` on a non-finite loss (Lightning then
      skips the batch): nothing masked in the batch of step FAIL_STEP, 0 / 0; the incident is ``logged`` (the
      loop dropped the batch itself), nothing blocks.
2. ``transformers.Trainer``:
   a. a tiny GPT-2 with ``gradient_accumulation_steps=2`` and ``max_grad_norm=1``, a ``compute_loss`` that
      weights each example's NLL by a data-quality score and gathers the token log-probabilities with the
      labels as they come: the collator's ``-100`` padding (the second micro-batch of step FAIL_STEP holds the
      short ends of documents) is an index ``gather`` rejects (raises);
   b. a tiny BERT with a custom head over [CLS] and numeric listing features that returns
      ``log(softmax(...))``: a price in raw units makes the target's probability underflow to 0;
   c. a tiny GPT-2 fed a chat template whose two special tokens were added to the tokenizer without
      ``resize_token_embeddings``: an id beyond the embedding table inside ``Trainer.train`` (raises; the
      Trainer has no exception hook);
   d. a tiny BERT with a supervised-contrastive term in ``compute_loss`` (the reference SupCon code): a class
      with a single example in the batch has no positive, ``mean_log_prob_pos`` is 0 / 0;
   e. a listwise re-ranker (BERT cross-encoder) whose padded candidate slots are set to -inf before the
      cross-entropy: a query left with no candidate has a row of -inf (``masked_softmax_all``).
3. QUIET real runs that must record no blocking incident: a NaN born in ``validation_step`` only (a missing
   value coded 0 in the validation set, ``log`` in the model; the training data are clean); the bf16 classifier
   of 1c with a long document whose logit is ~30 (would overflow float16's exp, not bfloat16's); 2a with the
   labels clamped before the gather; a ``training_step`` that logs a NaN recall (a batch without positives)
   while its loss stays finite.

Modes (``heldout_harness.MODES``): for Lightning, ``replayable`` is nantrace's ``NanTraceCallback`` (which wraps
``training_step`` in ``guard.replayable``) and ``zero_intrusive`` is the same script (build the Trainer, call
``fit``) run under ``nantrace.autowatch.AutoWatch`` in-process, which is what ``nantrace run`` does (nothing of
nantrace in the script; the run must actually be watched: ``Outcome.watched``). For Hugging Face,
``zero_intrusive`` is ``NanTraceCallback`` alone and ``replayable`` adds ``trainer.compute_loss =
nan_cb.guard.replayable(trainer.compute_loss)`` once the guard is open.

Steps follow API.md: ``step`` counts ``optimizer.step()`` calls. Under ``accumulate_grad_batches=2`` /
``gradient_accumulation_steps=2`` micro-batches 2k and 2k+1 are step k (one ``optimizer.step``), so a NaN in the
second micro-batch of step 3 is step 3 and the whole accumulated update is blocked; under L-BFGS the closure's
several evaluations are one step.

How expectations were derived (before nantrace ran): from /work/shared/API.md, docs/diagnosis.md and
docs/integrations.md. The origin is the first op that made a non-finite value from finite inputs (or, when the
NaN-making op received an infinity, the op that made that infinity); for phase ``backward`` the forward op whose
derivative made the first non-finite gradient (``|x| ** 0.5`` at 0: ``aten.pow.Tensor_Scalar``,
``grad_singularity``); module = the innermost module running the op (``None`` for ``training_step`` /
``compute_loss`` code); source = the marked ``# <origin:TAG>`` line, or for an op issued inside transformers'
own code the line of that file (``LIB_LINES``). Causes: a division by a count of an empty mask (events, positives)
or by a value of the data (r = 0) is ``div_by_zero``; a division by the std of a constant frame is
``zero_variance_norm``; ``exp`` beyond float32's range is ``exp_overflow`` whatever the autocast dtype; log of an
underflowed probability is ``log_nonpositive``; log_softmax over a row that a -inf mask covers whole is
``masked_softmax_all``; an index outside its dimension (``-100`` in ``gather``, a token
id past the table) is ``label_out_of_range``; a step that raised because of a value is kind ``exception``,
action ``raised``. Every construction is checked WITHOUT nantrace (``test_cases_fail_without_nantrace``): the same
framework run under round 8b's op recorder ``Made`` (a TorchDispatchMode; here also noting the op an exception
left the dispatcher from, and each op whose output gained a NaN its inputs did not hold, for the -inf mask case)
gives the step, the stage (loss / gradient / parameter, or the exception's type) and the first op that made a
non-finite value, and the bf16 case fails the same way in float32; the quiet runs stay finite in every training step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import MODES, Judge, case_params, describe, same, snapshot
from test_heldout_programs_r8b import MASK_MAKERS, Log, Made, Rows, hf_args
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3
N_STEPS = 5
assert MODES == ("zero_intrusive", "replayable")

CASES: dict[str, tuple[Callable[[Path, str], "Outcome"], Want]] = {}
"""name -> (run(tmp, mode) -> Outcome, expected first blocking incident); mode is a MODES entry or "plain"."""
QUIET: dict[str, Callable[[Path, str], "Outcome"]] = {}
RAISES: dict[str, tuple[type, str]] = {}
"""Exception cases -> (the user's exception type, the op the exception left the dispatcher from)."""
XFAIL: dict[str, str] = {
}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""


def case(name: str, want: Want, raises: tuple[type, str] | None = None) -> Callable:
    def register(run: Callable[[Path, str], Outcome]) -> Callable[[Path, str], Outcome]:
        assert name not in CASES and name not in QUIET, name
        CASES[name] = (run, want)
        if raises is not None:
            RAISES[name] = raises
        return run

    return register


def quiet_case(name: str) -> Callable:
    def register(run: Callable[[Path, str], Outcome]) -> Callable[[Path, str], Outcome]:
        assert name not in CASES and name not in QUIET, name
        QUIET[name] = run
        return run

    return register


def blocked(kind: str, phase: str | None, op: str | None, module: str | None, tag: str | None, cause: str,
            step: int = FAIL_STEP) -> Want:
    return Want(kind, phase, op, module, tag, cause, step=step, action="skipped")


def raised(op: str, module: str | None, tag: str, cause: str, step: int = FAIL_STEP) -> Want:
    return Want("exception", "forward", op, module, tag, cause, step=step, action="raised")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quiet() -> nantrace.Config:
    return nantrace.Config(outputs={"print_incidents": False})


# ============================================================ the record, with and without nantrace
def _op_name(func: Any) -> str:
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


class OpRecorder(Made):
    """Round 8b's ``Made`` (each op that turned finite inputs into a non-finite output, per step), and the op an
    exception left the dispatcher from (the op that raised: an index check, ``multinomial``'s validation)."""

    def __init__(self) -> None:
        super().__init__()
        self.raised: list[tuple[int, str]] = []
        self.nan_born: list[tuple[int, str]] = []
        """Ops whose inputs held no NaN (a -inf mask allowed) and whose output holds one (uninitialised memory and
        mask makers aside: round 8b's ``MASK_MAKERS``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        floats = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        nan_in = any(bool(torch.isnan(a).any()) for a in floats)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except Exception:
            self.raised.append((self.step, _op_name(func)))
            raise
        if not nan_in and func not in MASK_MAKERS and any(bool(torch.isnan(o).any()) for o in tree_leaves(out)
                              if isinstance(o, torch.Tensor) and o.is_floating_point()):
            self.nan_born.append((self.step, _op_name(func)))
        return out


@dataclasses.dataclass
class Outcome:
    incidents: list[Any]
    error: BaseException | None
    unchanged: bool | None
    """Whether the weights after the failing step equal those before it (the update was blocked)."""
    log: Log
    """Filled in ``plain`` mode only: per optimizer step, loss / gradient / parameter finiteness and the ops."""
    watched: bool = True
    """A guard was open on the run (AutoWatch: it found the model/optimizer pair)."""


LIB_LINES: dict[str, tuple[str, str, str]] = {
    "gpt2_wte": ("transformers", os.path.join("models", "gpt2", "modeling_gpt2.py"),
                 "inputs_embeds = self.wte(input_ids)"),
}
"""key -> (package, file inside it, the text of the line): origins inside a framework's own code."""


def _lib_file(package: str, rel: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__import__(package).__file__)), rel)


def lib_line(key: str) -> tuple[str, int]:
    package, rel, text = LIB_LINES[key]
    with open(_lib_file(package, rel), encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if line.strip() == text]
    assert len(hits) == 1, (key, hits)
    return f"{package}/{rel}", hits[0]


def _where(source: str | None) -> Any:
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
        line = lib_line(want.tag[4:]) if want.tag.startswith("lib:") else JUDGE.marked(want.tag)
    return dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
                action=want.action, line=line)


EARLY_WARNINGS = {"grad_growth", "update_ratio", "vanishing_gradient", "lr_schedule", "clipping", "logit_saturation"}


def got_fields(incidents: list[Any], logged: bool = False) -> dict[str, Any] | None:
    """The first blocking incident; ``logged``: the first logged one that is no early warning."""
    main = [i for i in incidents if (i.action == "logged" and i.kind not in EARLY_WARNINGS if logged
                                     else i.action != "logged")]
    if not main:
        return None
    inc = main[0]
    return dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
                action=inc.action, line=_where(inc.source))


# ------------------------------------------------------------------ Lightning
def _pl() -> Any:
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'nantrace[lightning]')")
    import lightning as L

    return L


def _module_cls() -> Any:
    return _pl().LightningModule


def pl_fit(model: Any, batches: list[Any], tmp: Path, mode: str, fail: int = FAIL_STEP, max_steps: int = N_STEPS,
           val_batches: list[Any] | None = None, **trainer_kw: Any) -> Outcome:
    """The user's script: build a ``lightning.Trainer`` and ``fit``. ``plain``: under the op recorder, no nantrace;
    ``replayable``: with nantrace's ``NanTraceCallback``; ``zero_intrusive``: the unchanged script under
    ``AutoWatch`` (``nantrace run``'s in-process path). A test callback snapshots the watched optimizer's
    parameters after each batch (and, plain, logs losses, gradients and parameters per optimizer step)."""
    L = _pl()
    from nantrace.autowatch import AutoWatch
    from nantrace.integrations.lightning import NanTraceCallback

    log = Log()
    log.rec = OpRecorder()
    plain = mode == "plain"

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.after: dict[int, list[torch.Tensor]] = {}
            self.watched: list[torch.Tensor] = []
            self.handle: Any = None

        def on_fit_start(self, trainer, pl_module) -> None:
            opt = trainer.optimizers[0]
            self.watched = [p for group in opt.param_groups for p in group["params"]]
            self.after[-1] = self.after[0] = [p.detach().clone() for p in self.watched]
            if plain:
                self.handle = opt.register_step_post_hook(lambda *_: log.stepped(self.watched))
                step = opt.step

                def checked_step(closure: Any = None, **kw: Any) -> Any:
                    def run_closure() -> Any:
                        out = closure() if closure is not None else None
                        if any(p.grad is not None for p in self.watched):  # a skipped batch has no gradient
                            log.grads(self.watched)
                        return out

                    return step(run_closure, **kw)

                opt.step = checked_step

        def on_fit_end(self, trainer, pl_module) -> None:
            if self.handle is not None:
                self.handle.remove()
                del trainer.optimizers[0].step

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if plain:
                log.loss(loss)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.after[trainer.global_step] = [p.detach().clone() for p in self.watched]

    recorder = Recorder()
    nan_cb = NanTraceCallback(config=_quiet()) if mode == "replayable" else None
    callbacks = [recorder] + ([nan_cb] if nan_cb is not None else [])
    train_loader = torch.utils.data.DataLoader(batches, batch_size=None)
    val_loader = torch.utils.data.DataLoader(val_batches, batch_size=None) if val_batches is not None else None

    def script() -> None:
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=callbacks, default_root_dir=str(tmp), **trainer_kw)
        trainer.fit(model, train_loader, val_loader)

    error: BaseException | None = None
    incidents: list[Any] = []
    watched = True
    if mode == "zero_intrusive":
        auto = AutoWatch(config=_quiet())
        try:
            with auto:
                script()
        except Exception as exc:
            error = exc
        incidents, watched = list(auto.incidents), bool(auto.guards)
    else:
        try:
            if plain:
                with log.rec:
                    script()
            else:
                script()
        except Exception as exc:
            error = exc
        if nan_cb is not None:
            incidents = list(nan_cb.incidents)
    at = recorder.after
    unchanged = same(at[fail + 1], at[fail]) if fail + 1 in at and fail in at else None
    return Outcome(incidents, error, unchanged, log, watched)


# ------------------------------------------------------------------ Hugging Face
def _hf() -> Any:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'nantrace[hf]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'nantrace[hf]')")
    import transformers

    return transformers


def hf_fit(trainer_cls: Any, model: nn.Module, args: Any, dataset: Any, mode: str, fail: int = FAIL_STEP,
           **kw: Any) -> Outcome:
    """``Trainer(...).train()``. ``plain``: under the op recorder, no nantrace; ``zero_intrusive``: with nantrace's
    ``NanTraceCallback``; ``replayable``: and the Trainer's ``compute_loss`` wrapped in the callback's
    ``guard.replayable`` as the guard opens."""
    from transformers import TrainerCallback

    from nantrace.integrations.hf import NanTraceCallback

    log = Log()
    log.rec = OpRecorder()
    plain = mode == "plain"
    snaps: list[list[torch.Tensor]] = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            snaps.append(snapshot(model))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if plain:
                log.grads(model.parameters())

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            snaps.append(snapshot(model))
            if plain:
                log.stepped(model.parameters())

    class Recording(trainer_cls):
        def training_step(self, *a: Any, **k: Any) -> torch.Tensor:
            loss = super().training_step(*a, **k)
            if plain:
                log.loss(loss)
            return loss

    nan_cb = NanTraceCallback(config=_quiet())
    trainer = Recording(model=model, args=args, train_dataset=dataset,
                        callbacks=[Recorder()] if plain else [nan_cb, Recorder()], **kw)
    if mode == "replayable":
        class ReplayableLoss(TrainerCallback):
            def on_train_begin(self, *a: Any, **k: Any) -> None:
                trainer.compute_loss = nan_cb.guard.replayable(trainer.compute_loss)

        trainer.add_callback(ReplayableLoss())  # after nantrace's callback: its guard is open
    error = None
    try:
        if plain:
            with log.rec:
                trainer.train()
        else:
            trainer.train()
    except Exception as exc:
        error = exc
    finally:
        nan_cb.close()  # the Trainer has no exception event (docs/integrations.md)
    unchanged = same(snaps[fail + 1], snaps[fail]) if len(snaps) > fail + 1 else None
    return Outcome(list(nan_cb.incidents), error, unchanged, log)


def _gpt2(vocab: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def _bert_config(**kw: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                      max_position_embeddings=16, **kw)


# ================================================================= 1. Lightning, automatic optimisation
# 1a. DeepSurv: a risk network trained with the Cox partial likelihood, accumulate_grad_batches=2 (micro-batches
#     of 16 patients). Within a micro-batch, patients are sorted by follow-up time and the log of each risk set
#     is log(cumsum(exp(risk))); the NLL is averaged over the observed events. The second micro-batch of step FAIL_STEP
#     holds only censored patients (a site that reports no deaths): event.sum() = 0 and the average is 0 / 0.
#     The step (API.md: each optimizer.step() counts) is FAIL_STEP: micro-batches 2k and 2k+1 make one
#     Lightning optimizer step, so the NaN of micro-batch 2 * FAIL_STEP + 1 is step FAIL_STEP, and the whole
#     accumulated update (the finite first micro-batch's gradient included) is blocked.
def _cox_model() -> Any:
    class DeepSurv(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, time, event = batch
            risk = self(x)
            order = torch.argsort(time, descending=True)
            risk, event = risk[order], event[order]
            log_risk_set = torch.log(torch.cumsum(torch.exp(risk), dim=0))
            nll = -((risk - log_risk_set) * event).sum() / event.sum()  # <origin:pl_cox_div>
            self.log("train_nll", nll)
            return nll

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return DeepSurv()


@case("pl_accumulate2_cox_partial_likelihood_second_microbatch_all_censored",
      blocked("nonfinite_loss", "forward", "aten.div.Tensor", None, "pl_cox_div", "div_by_zero"))
def _pl_cox(tmp: Path, mode: str) -> Outcome:
    g = _gen(15300)
    micro = []
    for i in range(2 * N_STEPS):
        event = (torch.rand(16, generator=g) < 0.7).float()
        event[0] = 1.0
        if i == 2 * FAIL_STEP + 1:  # the second micro-batch of step FAIL_STEP
            event.zero_()
        micro.append((torch.randn(16, 8, generator=g), 10 * torch.rand(16, generator=g), event))
    return pl_fit(_cox_model(), micro, tmp, mode, accumulate_grad_batches=2)


# 1b. A sparse coder on image patches: a bias-free linear encoder (dictionary learning style), a decoder, and an
#     L1/2 sparsity penalty sum |code| ** 0.5 computed in training_step; gradient_clip_val=0.5. A blank patch
#     (all zero: a black border) at step FAIL_STEP has code exactly 0: the forward is finite (0 ** 0.5 = 0) but
#     the pow's derivative 0.5 * 0 ** -0.5 = inf, times sign(0) = 0 in abs's backward: NaN in the encoder's
#     gradient. Lightning clips by the total norm (NaN): every gradient becomes NaN before the optimizer step.
def _sparse_coder_model() -> Any:
    class SparseCoder(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = nn.Linear(32, 48, bias=False)
            self.decoder = nn.Linear(48, 32)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            code = self.encoder(x)
            return self.decoder(code), code

        def training_step(self, batch, batch_idx):
            recon, code = self(batch)
            penalty = code.abs().pow(0.5).sum(-1).mean()  # <origin:pl_lhalf_pow>
            return F.mse_loss(recon, batch) + 1e-3 * penalty

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return SparseCoder()


@case("pl_gradient_clip_val_sparse_coder_l_half_penalty_blank_patch",
      blocked("nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", None, "pl_lhalf_pow", "grad_singularity"))
def _pl_sparse(tmp: Path, mode: str) -> Outcome:
    g = _gen(15310)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(16, 32, generator=g)
        if step == FAIL_STEP:
            x[5] = 0.0  # a blank patch
        batches.append(x)
    return pl_fit(_sparse_coder_model(), batches, tmp, mode, gradient_clip_val=0.5)


# 1c. precision="bf16-mixed" (Lightning runs training_step under CPU bf16 autocast), a bag-of-words classifier on
#     raw term counts, with a hand-written softmax cross-entropy in training_step. The batch of step FAIL_STEP
#     holds a scraped page whose counts are ~60x a normal document's: its top logit is ~150 and exp(150) is
#     beyond bfloat16's range, which is float32's (exp(88.7) is the largest finite): the same step fails in
#     float32 (checked), so this is exp_overflow, not precision_overflow; inf / inf = NaN in the normalisation.
#     QUIET twin: the long document's top logit is ~30, exp(30) = 1e13 is finite in bfloat16 (float16's exp
#     would overflow past 11.1, which bf16-mixed does not use).
def _bow_model() -> Any:
    class BagOfWordsClassifier(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))

        def forward(self, counts: torch.Tensor) -> torch.Tensor:
            return self.net(counts)

        def training_step(self, batch, batch_idx):
            counts, y = batch
            logits = self(counts)
            e = torch.exp(logits)  # <origin:pl_bf16_exp>
            p = e / e.sum(-1, keepdim=True)
            return -torch.log(p.gather(1, y[:, None])).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return BagOfWordsClassifier()


def _long_document(model: nn.Module, g: torch.Generator, top_logit: float) -> tuple[torch.Tensor, int]:
    """A document of raw counts, scaled so that its top logit at initialisation is ``top_logit``; its label is
    that class (the page is about it)."""
    doc = torch.poisson(torch.full((20,), 1.5), generator=g)
    with torch.no_grad():
        lo, hi = 1.0, 1.0
        while float(model(hi * doc).max()) < top_logit:
            hi *= 2.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float(model(mid * doc).max()) < top_logit else (lo, mid)
        scaled = torch.round(hi * doc)
        return scaled, int(model(scaled).argmax())


def _pl_bow(tmp: Path, mode: str, top_logit: float, precision: str = "bf16-mixed") -> Outcome:
    model = _bow_model()
    g = _gen(15320)
    batches = []
    for step in range(N_STEPS):
        counts = torch.poisson(torch.full((8, 20), 1.5), generator=g)
        y = torch.randint(0, 5, (8,), generator=g)
        if step == FAIL_STEP:
            counts[3], y[3] = _long_document(model, g, top_logit)
        batches.append((counts, y))
    return pl_fit(model, batches, tmp, mode, precision=precision)


@case("pl_bf16_mixed_handwritten_softmax_raw_counts_exp_beyond_float32",
      blocked("nonfinite_loss", "forward", "aten.exp.default", None, "pl_bf16_exp", "exp_overflow"))
def _pl_bow_fail(tmp: Path, mode: str) -> Outcome:
    return _pl_bow(tmp, mode, 150.0)


@quiet_case("quiet_pl_bf16_mixed_handwritten_softmax_logit_30_fits_bfloat16")
def _pl_bow_quiet(tmp: Path, mode: str) -> Outcome:
    return _pl_bow(tmp, mode, 30.0)


# 1d. A contextual bandit trained with REINFORCE in training_step: the policy standardises each frame by its own
#     mean and std (a hand-written per-frame normaliser), samples an action with torch.multinomial and is paid
#     1 for the frame's best action. The batch of step FAIL_STEP holds a blank reset frame (every pixel 0.5):
#     std 0, (x - mean) / std = 0 / 0, the policy's probabilities for that frame are NaN and multinomial raises.
class FrameStandardise(nn.Module):
    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        mean = frames.mean(dim=(1, 2, 3), keepdim=True)
        std = frames.std(dim=(1, 2, 3), keepdim=True)
        return (frames - mean) / std  # <origin:pl_frame_std>


def _bandit_model() -> Any:
    class FramePolicy(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.norm = FrameStandardise()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))

        def forward(self, frames: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.body(self.norm(frames)), dim=-1)

        def training_step(self, batch, batch_idx):
            frames, best = batch
            probs = self(frames)
            actions = torch.multinomial(probs, 1).squeeze(1)
            reward = (actions == best).float()
            advantage = reward - reward.mean()
            log_prob = torch.log(probs.gather(1, actions[:, None]).squeeze(1))
            return -(log_prob * advantage).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return FramePolicy()


@case("pl_reinforce_per_frame_standardisation_blank_frame_multinomial_raises",
      raised("aten.div.Tensor", "norm", "pl_frame_std", "zero_variance_norm"),
      raises=(RuntimeError, "aten.multinomial.default"))
def _pl_bandit(tmp: Path, mode: str) -> Outcome:
    g = _gen(15330)
    batches = []
    for step in range(N_STEPS):
        frames = torch.rand(16, 1, 8, 8, generator=g)
        if step == FAIL_STEP:
            frames[4] = 0.5  # the blank frame shown at an episode's reset
        batches.append((frames, torch.randint(0, 4, (16,), generator=g)))
    return pl_fit(_bandit_model(), batches, tmp, mode)


# 1e. A physics-informed network for the radial Poisson equation u'' + u'/r = 4 on (0, 1] (solution r^2), its
#     derivatives taken with torch.autograd.grad(create_graph=True) in training_step, trained with L-BFGS (the
#     usual PINN optimiser; Lightning hands it the closure, evaluated several times per step). The collocation
#     points are random in [0.05, 1] except at step FAIL_STEP, where a uniform grid linspace(0, 1) is used: it
#     includes the axis r = 0, where u'/r divides a finite u' by 0. The closure's evaluations within one
#     optimizer.step(closure) are one step (API.md): the first evaluation of step FAIL_STEP is non-finite.
def _pinn_model() -> Any:
    class RadialPINN(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(1, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1))

        def forward(self, r: torch.Tensor) -> torch.Tensor:
            return self.net(r)

        def training_step(self, batch, batch_idx):
            r, f = batch
            r = r.detach().requires_grad_(True)
            u = self(r)
            du = torch.autograd.grad(u.sum(), r, create_graph=True)[0]
            d2u = torch.autograd.grad(du.sum(), r, create_graph=True)[0]
            residual = d2u + du / r - f  # <origin:pl_pinn_div>
            return (residual ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)

    return RadialPINN()


@case("pl_lbfgs_pinn_radial_laplacian_collocation_grid_includes_axis",
      blocked("nonfinite_loss", "forward", "aten.div.Tensor", None, "pl_pinn_div", "div_by_zero"))
def _pl_pinn(tmp: Path, mode: str) -> Outcome:
    g = _gen(15340)
    batches = []
    for step in range(N_STEPS):
        r = torch.linspace(0.0, 1.0, 48)[:, None] if step == FAIL_STEP else 0.05 + 0.95 * torch.rand(48, 1, generator=g)
        batches.append((r, torch.full((48, 1), 4.0)))
    return pl_fit(_pinn_model(), batches, tmp, mode)


# 1f. A masked-feature autoencoder whose training_step guards itself the way Lightning documents: a non-finite
#     loss returns None, and Lightning skips the batch (no backward; optimizer.step still runs, on no gradient).
#     The masking collator draws the masked features per batch; the batch of step FAIL_STEP has none masked,
#     mask.sum() = 0 and the masked MSE is 0 / 0. docs/diagnosis.md: a loss left without backward() is read at the
#     step's check; a non-finite one is the step's incident, nonfinite_loss, action "logged" (the loop skipped the
#     batch itself); nothing blocking.
def _skip_model() -> Any:
    class MaskedFeatureModel(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 12))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.net(x.masked_fill(mask.bool(), 0.0))

        def training_step(self, batch, batch_idx):
            x, mask = batch
            recon = self(x, mask)
            loss = (((recon - x) ** 2) * mask).sum() / mask.sum()  # <origin:pl_skip_div>
            if not torch.isfinite(loss):
                return None  # Lightning skips this batch
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return MaskedFeatureModel()


@case("pl_training_step_returns_none_on_nan_masked_mse_nothing_masked",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "pl_skip_div", "div_by_zero", step=FAIL_STEP,
           action="logged"))
def _pl_skip(tmp: Path, mode: str) -> Outcome:
    g = _gen(15345)
    batches = []
    for step in range(N_STEPS):
        mask = (torch.rand(16, 12, generator=g) < 0.3).float()
        mask[0, 0] = 1.0
        if step == FAIL_STEP:
            mask.zero_()  # the collator masked nothing
        batches.append((torch.randn(16, 12, generator=g), mask))
    return pl_fit(_skip_model(), batches, tmp, mode)


# 1g. QUIET. A NaN born in validation only: a regressor that log-transforms its (positive) features in its own
#     forward; the validation set codes a missing value as 0, log(0) = -inf and val_loss is NaN (Lightning logs
#     it). Validation runs under inference_mode between steps 1-2 and 3-4 (val_check_interval=2); the training
#     data are clean. Nothing non-finite reaches a training step: API.md's incidents are about training steps
#     (`step` counts optimizer.step() calls; a validation batch is no step), so no blocking incident.
class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def _val_model() -> Any:
    class PriceRegressor(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.features = LogFeatures()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(self.features(x)).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self(x), y))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return PriceRegressor()


@quiet_case("quiet_pl_validation_step_nan_from_missing_value_coded_zero")
def _pl_val(tmp: Path, mode: str) -> Outcome:
    g = _gen(15350)

    def batch(missing: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = 0.5 + 2 * torch.rand(8, 6, generator=g)
        if missing:
            x[2, 4] = 0.0  # a missing value coded 0
        return x, torch.randn(8, generator=g)

    train = [batch(False) for _ in range(N_STEPS)]
    val = [batch(True)]
    return pl_fit(_val_model(), train, tmp, mode, val_batches=val, val_check_interval=2, limit_val_batches=1)


# 1h. QUIET. A fraud classifier whose training_step logs the batch's recall of the positive class,
#     tp / (number of positives), next to a finite BCE loss; the batch of step FAIL_STEP has no positive, so the
#     logged recall is 0 / 0 = NaN. The NaN is a detached metric that reaches neither the loss nor a gradient.
def _recall_model() -> Any:
    class FraudClassifier(_module_cls()):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            with torch.no_grad():
                pred = logits > 0
                recall = (pred & (y == 1)).sum().float() / (y == 1).sum().float()
            self.log("train_recall", recall)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    return FraudClassifier()


@quiet_case("quiet_pl_training_step_logs_nan_recall_batch_without_positives")
def _pl_recall(tmp: Path, mode: str) -> Outcome:
    g = _gen(15360)
    batches = []
    for step in range(N_STEPS):
        y = (torch.rand(16, generator=g) < 0.3).float()
        y[0] = 1.0
        if step == FAIL_STEP:
            y.zero_()
        batches.append((torch.randn(16, 10, generator=g), y))
    return pl_fit(_recall_model(), batches, tmp, mode)


# ================================================================= 2. transformers.Trainer
# 2a. A tiny GPT-2 fine-tuned with gradient_accumulation_steps=2 and max_grad_norm=1, and a compute_loss that
#     weights each example's mean token NLL by a data-quality score from the dataset. The token log-probabilities
#     are gathered with the labels as they come; the mask of padding is applied after the gather. Documents are
#     packed into full rows of 12 tokens, except their short ends: the collator padded those labels with -100,
#     and the second micro-batch of step FAIL_STEP is made of them. gather(-1, -100) raises.
#     QUIET twin: the gather reads labels.clamp(min=0) and the mask removes the padding.
def _weighted_nll_trainer(clamp: bool) -> Any:
    transformers = _hf()

    class QualityWeightedTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            quality = inputs.pop("quality")
            outputs = model(**inputs)
            logp = F.log_softmax(outputs.logits[:, :-1].float(), dim=-1)
            targets = labels[:, 1:]
            mask = (targets != -100).float()
            if clamp:
                token_logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            else:
                token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # <origin:hf_gather>
            per_example = -(token_logp * mask).sum(-1) / mask.sum(-1)
            loss = (per_example * quality).sum() / quality.sum()
            return (loss, outputs) if return_outputs else loss

    return QualityWeightedTrainer


def _hf_weighted(tmp: Path, mode: str, clamp: bool) -> Outcome:
    accum, bs = 2, 2
    short = (FAIL_STEP * accum + 1) * bs  # the rows of the second micro-batch of step FAIL_STEP

    def row(i: int) -> dict[str, Any]:
        g = _gen(15400 + i)
        ids = torch.randint(3, 64, (12,), generator=g)
        mask = torch.ones(12, dtype=torch.long)
        labels = ids.clone()
        if short <= i < short + bs:  # a document's short end, padded by the collator
            ids[8:], mask[8:], labels[8:] = 0, 0, -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "quality": 0.5 + torch.rand((), generator=g)}

    args = hf_args(tmp, per_device_train_batch_size=bs, gradient_accumulation_steps=accum, max_grad_norm=1.0,
                   max_steps=N_STEPS)
    return hf_fit(_weighted_nll_trainer(clamp), _gpt2(), args, Rows(row, N_STEPS * accum * bs), mode)


@case("hf_gpt2_accum2_clip_quality_weighted_nll_gather_minus100_raises",
      raised("aten.gather.default", None, "hf_gather", "label_out_of_range"),
      raises=(RuntimeError, "aten.gather.default"))
def _hf_gather(tmp: Path, mode: str) -> Outcome:
    return _hf_weighted(tmp, mode, clamp=False)


@quiet_case("quiet_hf_gpt2_accum2_clip_quality_weighted_nll_labels_clamped")
def _hf_gather_quiet(tmp: Path, mode: str) -> Outcome:
    return _hf_weighted(tmp, mode, clamp=True)


# 2b. A listing classifier: a tiny BERT encodes the description, a custom head reads [CLS] with three numeric
#     features (standardised) and returns log(softmax(.)) (log-probabilities, scored with nll_loss inside the
#     model's forward as HF models do). The batch of step FAIL_STEP holds a listing whose price was not
#     standardised (raw units, 2.5e5): its logits are thousands apart, the softmax underflows to exactly 0 for
#     the listing's (true) cheapest-looking class and log(0) = -inf: the loss is inf.
class LogProbHead(nn.Module):
    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, k)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.proj(z), dim=-1))  # <origin:hf_head_log>


class ListingClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertModel

        torch.manual_seed(0)
        self.bert = BertModel(_bert_config(), add_pooling_layer=False)
        self.head = LogProbHead(16 + 3, 3)

    def forward(self, input_ids, attention_mask, numeric, labels=None):
        cls = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        logp = self.head(torch.cat([cls, numeric], dim=-1))
        out = {"logits": logp}
        if labels is not None:
            out["loss"] = F.nll_loss(logp, labels)
        return out


@case("hf_bert_custom_head_log_of_softmax_raw_price_underflow",
      blocked("nonfinite_loss", "forward", "aten.log.default", "head", "hf_head_log", "log_nonpositive"))
def _hf_listing(tmp: Path, mode: str) -> Outcome:
    _hf()
    model = ListingClassifier()
    bs = 4
    cheapest = int(model.head.proj.weight[:, 16].argmin())  # the class whose logit a huge price pushes down most
    bad = FAIL_STEP * bs + 1

    def row(i: int) -> dict[str, Any]:
        g = _gen(15500 + i)
        numeric = torch.randn(3, generator=g)
        label = i % 3
        if i == bad:
            numeric[0], label = 2.5e5, cheapest  # the price in raw units
        return {"input_ids": torch.randint(5, 60, (10,), generator=g), "attention_mask": torch.ones(10, dtype=torch.long),
                "numeric": numeric, "labels": torch.tensor(label)}

    return hf_fit(_hf().Trainer, model, hf_args(tmp, per_device_train_batch_size=bs), Rows(row, N_STEPS * bs), mode)


# 2c. A tiny GPT-2 (vocabulary 64) fine-tuned on chat data: the tokenizer got two special tokens for the chat
#     template, ids 64 and 65, and resize_token_embeddings was never called. Plain-text examples come first; the
#     first chat-formatted example is in the batch of step FAIL_STEP: embedding(65) is outside the table, inside
#     the model's forward inside Trainer.train (IndexError).
@case("hf_gpt2_chat_special_tokens_added_without_resize_embedding_raises",
      raised("aten.embedding.default", "transformer.wte", "lib:gpt2_wte", "label_out_of_range"),
      raises=(IndexError, "aten.embedding.default"))
def _hf_vocab(tmp: Path, mode: str) -> Outcome:
    _hf()
    bs = 2
    im_start, im_end = 64, 65

    def row(i: int) -> dict[str, Any]:
        g = _gen(15600 + i)
        ids = torch.randint(3, 64, (12,), generator=g)
        if i == FAIL_STEP * bs + 1:  # "<|im_start|>user ... <|im_end|>"
            ids[0], ids[7] = im_start, im_end
        return {"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": ids.clone()}

    return hf_fit(_hf().Trainer, _gpt2(), hf_args(tmp, per_device_train_batch_size=bs), Rows(row, N_STEPS * bs), mode)


# 2d. A tiny BERT classifier with a supervised-contrastive term (Khosla et al.; the reference implementation's
#     code) on the [CLS] embedding of the last layer, added to the model's cross-entropy in compute_loss. The
#     sampler pairs examples of each class; the batch of step FAIL_STEP holds one example of a class that
#     appears only once: that anchor has no positive, mask.sum(1) = 0 and its mean log-probability over
#     positives is 0 / 0 (the reference code's known NaN).
def _supcon_trainer() -> Any:
    transformers = _hf()

    class SupConTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"]
            outputs = model(**inputs, output_hidden_states=True)
            z = F.normalize(outputs.hidden_states[-1][:, 0], dim=-1)
            n = z.shape[0]
            logits_mask = 1.0 - torch.eye(n)
            mask = (labels[:, None] == labels[None, :]).float() * logits_mask
            logits = z @ z.T / 0.07
            logits = logits - logits.max(dim=1, keepdim=True).values.detach()
            exp_logits = torch.exp(logits) * logits_mask
            log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
            mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)  # <origin:hf_supcon_div>
            loss = outputs.loss - 0.5 * mean_log_prob_pos.mean()
            return (loss, outputs) if return_outputs else loss

    return SupConTrainer


@case("hf_bert_compute_loss_supcon_singleton_class_no_positive",
      blocked("nonfinite_loss", "forward", "aten.div.Tensor", None, "hf_supcon_div", "div_by_zero"))
def _hf_supcon(tmp: Path, mode: str) -> Outcome:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(_bert_config(num_labels=4))
    bs = 8
    pairs = [0, 0, 1, 1, 2, 2, 3, 3]
    singleton = [0, 0, 1, 1, 2, 2, 3, 1]  # class 3 once

    def row(i: int) -> dict[str, Any]:
        g = _gen(15700 + i)
        step, j = divmod(i, bs)
        label = (singleton if step == FAIL_STEP else pairs)[j]
        return {"input_ids": torch.randint(5, 60, (10,), generator=g), "attention_mask": torch.ones(10, dtype=torch.long),
                "labels": torch.tensor(label)}

    return hf_fit(_supcon_trainer(), model, hf_args(tmp, per_device_train_batch_size=bs), Rows(row, N_STEPS * bs), mode)


# 2e. A listwise re-ranker: a tiny BERT cross-encoder (one score per query-candidate pair) trained by a
#     compute_loss that sets the padded candidate slots of each query to -inf and takes the cross-entropy of the
#     relevant candidate over the list. After de-duplication against the training corpus, one query of the batch of
#     step FAIL_STEP has no candidate left: its whole row is -inf and log_softmax of it is NaN (the -inf are the
#     mask, on purpose: the origin is the log_softmax, masked_softmax_all).
def _rerank_trainer() -> Any:
    transformers = _hf()

    class ListwiseRerankTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, att = inputs["input_ids"], inputs["attention_mask"]
            candidates, relevant = inputs["candidate_mask"], inputs["labels"]
            b, k, length = ids.shape
            outputs = model(input_ids=ids.view(b * k, length), attention_mask=att.view(b * k, length))
            scores = outputs.logits.view(b, k).masked_fill(~candidates, float("-inf"))
            loss = F.cross_entropy(scores, relevant)  # <origin:hf_rerank_ce>
            return (loss, outputs) if return_outputs else loss

    return ListwiseRerankTrainer


@case("hf_bert_listwise_rerank_query_without_candidates_after_dedup",
      blocked("nonfinite_loss", "forward", "aten._log_softmax.default", None, "hf_rerank_ce", "masked_softmax_all"))
def _hf_rerank(tmp: Path, mode: str) -> Outcome:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(_bert_config(num_labels=1))
    bs, k = 2, 4

    def row(i: int) -> dict[str, Any]:
        g = _gen(15800 + i)
        kept = int(torch.randint(2, k + 1, (), generator=g))
        if i == FAIL_STEP * bs + 1:
            kept = 0  # every candidate of this query was a duplicate of a training document
        ids = torch.randint(5, 60, (k, 8), generator=g)
        att = torch.ones(k, 8, dtype=torch.long)
        ids[kept:], att[kept:] = 0, 0  # padded candidate slots
        return {"input_ids": ids, "attention_mask": att, "candidate_mask": torch.arange(k) < kept,
                "labels": torch.tensor(0)}

    return hf_fit(_rerank_trainer(), model, hf_args(tmp, per_device_train_batch_size=bs), Rows(row, N_STEPS * bs), mode)


# ======================================================================= the tests
def _stage_bad(log: Log) -> list[int]:
    return sorted({s for d in (log.loss_bad, log.grad_bad, log.param_bad) for s, v in d.items() if v})


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str, tmp_path: Path) -> None:
    """Without nantrace: the first non-finite value appears at the expected optimizer step, not before, in the
    stage the expectation names and made by the expected op; an exception case raises the expected exception
    from the expected op during that step, after nothing non-finite but the expected origin."""
    run, want = CASES[name]
    out = run(tmp_path, "plain")
    log, rec = out.log, out.log.rec
    s = want.step
    assert not [m for m in rec.made if m[0] < s] and not [m for m in rec.nan_born if m[0] < s], \
        (rec.made[:4], rec.nan_born[:4])
    if want.kind == "exception":
        error_type, raising_op = RAISES[name]
        assert isinstance(out.error, error_type), repr(out.error)
        assert log.step == s and not _stage_bad(log), (log.step, _stage_bad(log))
        assert rec.raised and rec.raised[0] == (s, raising_op), rec.raised
        made = [op for step, op, _ in rec.made if step == s]
        if want.op != raising_op:  # a NaN made earlier in the step is what the raising op rejected
            assert made and made[0] == want.op, made
        else:
            assert not made, made
        return
    assert out.error is None, repr(out.error)
    if want.action == "logged":  # the step's code dropped the NaN loss: no backward, no bad gradient or weight
        assert not _stage_bad(log) and log.step == N_STEPS, (_stage_bad(log), log.step)
        assert rec.first(s, False) == want.op, rec.made[:6]
        return
    assert _stage_bad(log) and _stage_bad(log)[0] == s, ({k: v for k, v in log.__dict__.items() if k != "rec"})
    if want.kind == "nonfinite_loss":
        assert log.loss_bad.get(s), log.losses
    elif want.kind == "nonfinite_grad":
        assert not log.loss_bad.get(s) and log.grad_bad.get(s), (log.losses, log.grad_bad)
    if want.cause == "masked_softmax_all":  # the -inf are the mask (masked_fill): the first op to make a NaN
        assert not [m for m in rec.made if m[0] == s and m[2]], rec.made[:4]  # no overflow from finite values
        assert [op for step, op in rec.nan_born if step == s][:1] == [want.op], rec.nan_born[:4]
        return
    assert rec.first(s, want.phase == "optimizer") == want.op, rec.made[:6]


def test_bf16_exp_overflow_fails_in_float32_too(tmp_path: Path) -> None:
    """Case 1c in float32 (precision="32-true"): the same step fails, from the same exp; so bfloat16 is not
    the cause (API.md's precision_overflow is "finite when replayed in float32")."""
    out = _pl_bow(tmp_path, "plain", 150.0, precision="32-true")
    assert out.error is None and _stage_bad(out.log)[0] == FAIL_STEP and out.log.loss_bad[FAIL_STEP]
    assert out.log.rec.first(FAIL_STEP, False) == "aten.exp.default", out.log.rec.made[:4]


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str, tmp_path: Path) -> None:
    """Without nantrace: no training step has a non-finite loss, gradient or parameter, nothing raises (a NaN
    made outside training, the validation loss or a logged metric, is allowed)."""
    out = QUIET[name](tmp_path, "plain")
    assert out.error is None and not _stage_bad(out.log), (repr(out.error), _stage_bad(out.log))
    assert out.log.step == N_STEPS, out.log.step


@pytest.mark.parametrize("name,mode", case_params(CASES, XFAIL))
def test_heldout_diagnosis(name: str, mode: str, tmp_path: Path) -> None:
    run, want = CASES[name]
    out = run(tmp_path, mode)
    assert out.watched, "no guard was opened on the run"
    logged = want.action == "logged"
    if logged:  # the loop skipped the batch itself: nothing blocks
        assert got_fields(out.incidents) is None, [describe(i) + " | " + i.summary for i in out.incidents]
    got = got_fields(out.incidents, logged=logged)
    assert got is not None, ("no incident", repr(out.error))
    assert got == want_fields(want), [describe(i) + " | " + i.summary for i in out.incidents]
    if want.kind == "exception":  # the user's own exception propagates, unchanged
        assert isinstance(out.error, RAISES[name][0]) and not isinstance(out.error, nantrace.NonFiniteError), \
            repr(out.error)
        return
    assert out.error is None, repr(out.error)
    if not logged:
        assert out.unchanged is True, "the blocked step changed the weights"


@pytest.mark.parametrize("name,mode", case_params(QUIET, XFAIL))
def test_quiet_programs(name: str, mode: str, tmp_path: Path) -> None:
    out = QUIET[name](tmp_path, mode)
    assert out.watched, "no guard was opened on the run"
    blocking = [describe(i) + " | " + i.summary for i in out.incidents if i.action != "logged"]
    assert not blocking, blocking
    assert out.error is None, repr(out.error)
