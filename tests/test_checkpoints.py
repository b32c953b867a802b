"""Checkpoints that stay healthy (issue 12): real ``Trainer.fit`` / ``Trainer.train`` runs whose
checkpoint saves are refused while the weights are non-finite or an episode is unresolved;
``guard.checkpoint_ok()`` for plain loops; a model loaded with non-finite tensors named at step 0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from conftest import mlp
from nantrace.response.checkpoints import CheckpointRefusedWarning

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]


def _refusals(incidents):
    return [(i.step, i.kind, i.details["where"]) for i in incidents if i.details.get("checkpoint") == "refused"]


# ----------------------------------------------------------------------------- Lightning
class Corrupt:
    """A Lightning callback that writes a NaN into ``head.weight`` at the end of batch ``at``."""

    def __new__(cls, at: int):
        import lightning as L

        class _Corrupt(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if batch_idx == at:
                    with torch.no_grad():
                        pl_module.head.weight[0, 0] = float("nan")

        return _Corrupt()


def _lightning_fit(tmp_path, *, empty_step, corrupt_at=None, save_top_k=-1, episode_gap=2, max_steps=6):
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nantrace.integrations.lightning import NanTraceCallback
    from test_integration_lightning import BATCH, Sequences, Tiny

    empty = {BATCH * empty_step + 2} if empty_step is not None else set()
    data = torch.utils.data.DataLoader(Sequences(BATCH * max_steps, empty), batch_size=BATCH)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=save_top_k,
                           save_last=True)
    cb = NanTraceCallback(config=nantrace.Config(print_incidents=False, episode_gap=episode_gap))
    callbacks = [cb, ckpt] + ([Corrupt(corrupt_at)] if corrupt_at is not None else [])
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    error = None
    with pytest.warns(CheckpointRefusedWarning) as warned:
        try:
            trainer.fit(Tiny(), data)
        except nantrace.NonFiniteError as exc:
            error = exc
    messages = [str(w.message) for w in warned if issubclass(w.category, CheckpointRefusedWarning)]
    return cb, ckpt, sorted(os.listdir(tmp_path / "ckpt")), messages, error


def test_lightning_refuses_checkpoints_during_an_unresolved_episode(tmp_path):
    """The NaN at step 3 is skipped; the saves after steps 3 and 4 (global_step 4, 5) come before two
    healthy steps have ended the episode: refused. Nothing else changes."""
    cb, ckpt, files, warned, error = _lightning_fit(tmp_path, empty_step=3)
    assert error is None
    assert files == ["last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt", "step=6.ckpt"]
    refused = _refusals(cb.incidents)
    # one incident per refused step (its top-k and its last.ckpt save were both refused)
    assert refused == [(3, "nonfinite_loss", "ModelCheckpoint.save_topk_checkpoint"),
                       (4, "nonfinite_loss", "ModelCheckpoint.save_topk_checkpoint")]
    assert len(warned) == 2 and all("an incident episode is unresolved (nonfinite_loss, since step 3" in w for w in warned)
    assert ckpt.best_model_path.endswith("step=6.ckpt")


def test_lightning_never_rotates_a_good_checkpoint_away_for_non_finite_weights(tmp_path):
    """save_top_k=1 deletes the previous file when it saves a new one: after the weights turn NaN at the
    end of batch 3, the last good checkpoint (step=3) must survive, and last.ckpt must still be it."""
    cb, ckpt, files, warned, error = _lightning_fit(tmp_path, empty_step=None, corrupt_at=3, save_top_k=1)
    assert files == ["last.ckpt", "step=3.ckpt"]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())
    [refusal] = _refusals(cb.incidents)[:1]
    assert refusal == (3, "nonfinite_param", "ModelCheckpoint.save_topk_checkpoint")
    assert "head.weight (1 NaN, 0 Inf of 8)" in warned[0]
    # the next step's check finds the parameter already non-finite and stops the run, naming it
    assert isinstance(error, nantrace.NonFiniteError) and error.incident.kind == "nonfinite_param"


def test_lightning_resume_from_a_corrupted_checkpoint_is_reported_at_the_first_step(tmp_path):
    pytest.importorskip("lightning")
    from nantrace.integrations.lightning import NanTraceCallback
    from test_integration_lightning import Tiny, _fit

    trainer, _ = _fit(NanTraceCallback(config=nantrace.Config(print_incidents=False)), Tiny(), empty_step=None,
                      max_steps=2)
    path = str(tmp_path / "resume.ckpt")
    trainer.save_checkpoint(path)  # the callback is closed after fit: nothing vetoes this one
    state = torch.load(path, weights_only=False)
    state["state_dict"]["enc.bias"][3] = float("inf")
    torch.save(state, path)
    cb = NanTraceCallback(config=nantrace.Config(print_incidents=False))
    with pytest.raises(nantrace.NonFiniteError) as info:
        _fit(cb, Tiny(), empty_step=None, max_steps=4, ckpt_path=path)
    incident = info.value.incident
    assert (incident.step, incident.kind, incident.cause, incident.module) == (2, "nonfinite_param", "nonfinite_param", "enc")
    assert incident.details["checkpoint_file"] == path
    assert f"loaded from {path}" in incident.summary and "enc.bias (0 NaN, 1 Inf of 8)" in incident.summary


# ----------------------------------------------------------------------------- Hugging Face
def test_hf_trainer_cancels_saves_during_an_unresolved_episode(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nantrace.integrations.hf import NanTraceCallback
    from test_integration_hf import ACCUMULATE, BATCH, FAIL_STEP, MAX_STEPS, Tokens

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, report_to=[], use_cpu=True, save_strategy="steps", save_steps=1,
        save_total_limit=2, logging_steps=1, disable_tqdm=True, train_sampling_strategy="sequential", learning_rate=1e-3,
    )
    cb = NanTraceCallback(config=nantrace.Config(print_incidents=False, episode_gap=2))
    with pytest.warns(CheckpointRefusedWarning, match="an incident episode is unresolved"):
        Trainer(model=model, args=args, train_dataset=Tokens(FAIL_STEP), callbacks=[cb]).train()
    # the NaN of step 3 (global step 4) is skipped; the saves at global steps 4 and 5 come before two healthy
    # steps have ended its episode: cancelled, so the rotation (save_total_limit=2) kept checkpoint-2 and -3
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-2", "checkpoint-3"]
    assert [(s, k, w) for s, k, w in _refusals(cb.incidents)] == [
        (3, "nonfinite_loss", "Trainer save (on_step_end)"), (4, "nonfinite_loss", "Trainer save (on_step_end)")]


# ----------------------------------------------------------------------------- plain loops
def test_checkpoint_ok_in_a_plain_loop():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, episode_gap=3))
    verdicts = []
    for step in range(10):
        x = torch.randn(16, 8)
        if step == 2:
            x[0, 0] = float("nan")
        opt.zero_grad()
        F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        verdicts.append(guard.checkpoint_ok())
    assert verdicts == [True, True, False, False, False, True, True, True, True, True]
    with torch.no_grad():
        model[2].weight[1, 1] = float("nan")
    assert guard.checkpoint_ok() is True, "cached for this step (one check per step)"
    guard.step += 1
    assert guard.checkpoint_ok() is False and "2.weight (1 NaN, 0 Inf of 1024)" in guard.checkpoints.reason
    guard.close()


@pytest.mark.parametrize("where", ["param", "frozen_param", "buffer"])
def test_a_model_loaded_with_non_finite_tensors_is_named_at_the_first_step(where):
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    state = model.state_dict()
    name = {"param": "2.weight", "frozen_param": "0.bias", "buffer": "1.running_var"}[where]
    state[name].view(-1)[0] = float("nan")
    model.load_state_dict(state)
    if where == "frozen_param":
        model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    with pytest.raises(nantrace.NonFiniteError) as info:
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    guard.close()
    incident = info.value.incident
    assert (incident.step, incident.kind, incident.cause, incident.action) == (0, "nonfinite_param", "nonfinite_param", "raised")
    assert [t["name"] for t in incident.details["nonfinite_state"]] == [name]
    assert incident.module == name.rpartition(".")[0] and f"{name} (1 NaN" in incident.summary
