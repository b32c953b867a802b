"""nantrace.integrations.hf: a real ``transformers.Trainer.train()`` on a tiny GPT-2 built
locally (no download), with a genuine failure at a known optimizer step.

With gradient accumulation the Trainer divides the summed token losses by the number of
non-ignored labels in the whole accumulated batch. Both micro-batches of optimizer step
``FAIL_STEP`` have every label set to -100 (fully ignored), so that count is 0 and the
loss, computed inside the model's forward, is 0/0: the op is a division, the cause the labels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import nantrace  # noqa: E402
from conftest import assert_unhooked, same_state  # noqa: E402
from nantrace.integrations.hf import NanTraceCallback  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
              pytest.mark.usefixtures("one_thread")]

BATCH, ACCUMULATE, MAX_STEPS, FAIL_STEP = 4, 2, 5, 3



class Tokens(torch.utils.data.Dataset):
    """Deterministic 16-token samples; the samples of ``ignored_step`` have all labels -100."""

    def __init__(self, ignored_step: int | None) -> None:
        per_step = BATCH * ACCUMULATE
        self.ignored = set(range(per_step * ignored_step, per_step * (ignored_step + 1))) if ignored_step is not None else set()

    def __len__(self) -> int:
        return BATCH * ACCUMULATE * MAX_STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        labels = torch.full_like(ids, -100) if i in self.ignored else ids.clone()
        return {"input_ids": ids, "labels": labels}


class ParamRecorder(TrainerCallback):
    """The parameters after each optimizer step (index = step)."""

    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.after.append({n: p.detach().clone() for n, p in model.named_parameters()})


def _train(tmp_path, cb: NanTraceCallback, ignored_step: int | None = FAIL_STEP) -> tuple[Trainer, ParamRecorder]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        disable_tqdm=True, train_sampling_strategy="sequential", learning_rate=1e-3,
    )
    recorder = ParamRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(ignored_step), callbacks=[cb, recorder])
    trainer.train()
    return trainer, recorder


def test_failure_inside_the_model_forward_is_diagnosed_and_skipped(tmp_path):
    cb = NanTraceCallback(run_dir=tmp_path / "run", config=nantrace.Config(print_incidents=False))
    trainer, recorder = _train(tmp_path, cb)

    [incident] = cb.incidents
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause, incident.action) == (
        FAIL_STEP, "nonfinite_loss", "forward", "aten.div.Tensor", "", "label_out_of_range", "skipped")
    assert "transformers/loss/loss_utils.py:" in incident.source
    assert [s["zeros"] for s in incident.input_stats] == [1, 1]  # 0 / 0: no label left to average over
    # the division is only where it shows: the cause is the labels (every one is ignore_index)
    assert "ignore_index=-100" in incident.summary and "ignore index" in incident.fix
    assert incident.transient is False and incident.bundle is not None
    # optimizer steps are counted (5 of them, 10 micro-batches); step 3 did not change the weights
    assert trainer.state.global_step == MAX_STEPS and cb.guard.step == MAX_STEPS and len(recorder.after) == MAX_STEPS
    assert same_state(recorder.after[FAIL_STEP], recorder.after[FAIL_STEP - 1])
    assert not same_state(recorder.after[FAIL_STEP + 1], recorder.after[FAIL_STEP])
    # the figures are in every training log record (HF's own "loss" shows 0.0 for the NaN step)
    train_logs = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["nantrace/skipped"] for r in train_logs] == [float(s == FAIL_STEP) for s in range(MAX_STEPS)]
    assert [r["nantrace/incidents"] for r in train_logs] == [float(s >= FAIL_STEP) for s in range(MAX_STEPS)]
    bad = train_logs[FAIL_STEP]
    assert bad["nantrace/loss"] != bad["nantrace/loss"] and bad["loss"] == 0.0
    assert all(r["nantrace/grad_norm"] > 0 for i, r in enumerate(train_logs) if i != FAIL_STEP)
    assert cb.guard.closed
    assert_unhooked(trainer.model, cb.session.optimizer)


def test_raise_policy_stops_train_with_the_diagnosis(tmp_path):
    cb = NanTraceCallback(on_anomaly="raise", config=nantrace.Config(print_incidents=False))
    with pytest.raises(nantrace.NonFiniteError) as info:
        _train(tmp_path, cb)
    incident = info.value.incident
    assert (incident.step, incident.op, incident.module, incident.cause, incident.action) == (
        FAIL_STEP, "aten.div.Tensor", "", "label_out_of_range", "raised")
    model = cb.guard.root
    assert all(torch.isfinite(p).all() for p in model.parameters())
    cb.close()  # the Trainer has no exception event: the user (or the next train()) closes
    cb.close()
    assert_unhooked(model, cb.session.optimizer)


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="NanTraceCallback: unknown on_anomaly 'later'"):
        NanTraceCallback(on_anomaly="later")
    with pytest.raises(TypeError, match="unknown argument\\(s\\) 'model'"):
        NanTraceCallback(model=None)
