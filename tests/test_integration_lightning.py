"""nantrace.integrations.lightning: real ``Trainer.fit`` runs on CPU with a genuine failure.

The model pools a sequence with a masked mean; one sample of one batch is an empty
sequence (all-zero mask), so the pooling divides 0 by 0 at a known optimizer step.
"""

from __future__ import annotations

import csv
import importlib.util
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import nantrace  # noqa: E402
from conftest import assert_unhooked, same_state  # noqa: E402
from nantrace.integrations.lightning import NanTraceCallback  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]

BATCH = 4
FAIL_STEP = 3
MAX_STEPS = 6



class MaskedMean(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


DIVISION_LINE = inspect.getsourcelines(MaskedMean.forward)[1] + 1


class Sequences(torch.utils.data.Dataset):
    """Deterministic (x, mask, y) samples; the samples in ``empty`` are empty sequences."""

    def __init__(self, n: int, empty: set[int]) -> None:
        self.n, self.empty = n, empty

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=g), torch.randn((), generator=g)
        mask = torch.zeros(5) if i in self.empty else torch.ones(5)
        return x, mask, y


class Tiny(L.LightningModule):
    def __init__(self, *, manual: bool = False, dict_out: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.pool = MaskedMean()
        self.head = nn.Linear(8, 1)
        self.dict_out = dict_out
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.tanh(self.enc(x)), mask)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            loss = F.mse_loss(self(x, mask), y)
            self.manual_backward(loss)
            opt.step()
            return loss
        loss = F.mse_loss(self(x, mask), y)
        return {"loss": loss, "n": torch.tensor(len(y))} if self.dict_out else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ParamRecorder(L.Callback):
    """The parameters after every training batch, with the optimizer steps taken so far."""

    def __init__(self) -> None:
        self.after: list[tuple[int, dict[str, torch.Tensor]]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.after.append((trainer.global_step, {n: p.detach().clone() for n, p in pl_module.named_parameters()}))

    def at_step(self, steps_done: int) -> dict[str, torch.Tensor]:
        """Parameters once ``steps_done`` optimizer steps have been taken."""
        return next(p for s, p in self.after if s == steps_done)


def _fit(cb: NanTraceCallback, model: Tiny, *, accumulate: int = 1, logger=False, max_steps: int = MAX_STEPS,
         empty_step: int | None = FAIL_STEP, accelerator: str = "cpu", ckpt_path: str | None = None,
         **trainer_kwargs) -> tuple[L.Trainer, ParamRecorder]:
    empty = set()
    if empty_step is not None:  # one sample of the last micro-batch of that optimizer step
        empty = {BATCH * (accumulate * empty_step + accumulate - 1) + 2}
    data = torch.utils.data.DataLoader(Sequences(BATCH * accumulate * max_steps, empty), batch_size=BATCH)
    recorder = ParamRecorder()
    trainer = L.Trainer(max_steps=max_steps, accelerator=accelerator, devices=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate, callbacks=[cb, recorder], **trainer_kwargs)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, recorder


def _cpu_fp16_scaler_plugin():
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))


VARIANTS = {
    "fp32": dict(),
    "dict-output": dict(dict_out=True),
    "accumulate-2": dict(accumulate=2),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "fp16-gradscaler": dict(plugins="fp16-scaler"),
    "manual-optimisation": dict(manual=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_failure_is_diagnosed_skipped_and_training_goes_on(variant, tmp_path):
    opts = dict(VARIANTS[variant])
    model = Tiny(manual=opts.pop("manual", False), dict_out=opts.pop("dict_out", False))
    if opts.get("plugins") == "fp16-scaler":
        opts["plugins"] = [_cpu_fp16_scaler_plugin()]
    accumulate = opts.pop("accumulate", 1)
    cb = NanTraceCallback(run_dir=tmp_path / "run", config=nantrace.Config(print_incidents=False))
    trainer, recorder = _fit(cb, model, accumulate=accumulate, logger=CSVLogger(tmp_path, name="logs"), **opts)

    [incident] = cb.incidents
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause, incident.action) == (
        FAIL_STEP, "nonfinite_loss", "forward", "aten.div.Tensor", "pool", "div_by_zero", "skipped")
    assert incident.source.endswith(f"test_integration_lightning.py:{DIVISION_LINE}")
    assert incident.transient is False
    # the failing update did not land; the others did, and training reached max_steps
    assert same_state(recorder.at_step(FAIL_STEP + 1), recorder.at_step(FAIL_STEP))
    assert not same_state(recorder.at_step(FAIL_STEP + 2), recorder.at_step(FAIL_STEP + 1))
    assert trainer.global_step == MAX_STEPS and cb.guard.step == MAX_STEPS
    assert cb.guard.last_step["step"] == MAX_STEPS - 1 and cb.guard.last_step["skipped"] is False
    if variant == "fp16-gradscaler":
        assert cb.guard.last_step["scale"] is not None
    # closed at fit end: no hook left, training_step is the class's again
    assert cb.guard.closed and "training_step" not in model.__dict__
    assert_unhooked(model, trainer.optimizers[0].optimizer if hasattr(trainer.optimizers[0], "optimizer") else trainer.optimizers[0])
    # the figures reached the trainer's logger, one row per optimizer step
    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    skipped = {int(r["step"]): float(r["nantrace/skipped"]) for r in rows if r.get("nantrace/skipped")}
    assert skipped == {s: float(s == FAIL_STEP) for s in range(MAX_STEPS)}
    assert {"nantrace/loss", "nantrace/grad_norm", "nantrace/param_norm", "nantrace/incidents"} <= set(rows[0])
    from nantrace.storage.runstore import RunStore

    store = RunStore(tmp_path / "run", readonly=True)
    assert [r["step"] for r in store.steps() if r["skipped"]] == [FAIL_STEP]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="precision='16-mixed' with Lightning's own GradScaler needs a CUDA GPU")
def test_fp16_mixed_on_gpu_goes_through_the_gradscaler():
    model = Tiny()
    cb = NanTraceCallback(config=nantrace.Config(print_incidents=False))
    trainer, recorder = _fit(cb, model, accelerator="gpu", precision="16-mixed")
    [incident] = cb.incidents
    assert (incident.step, incident.op, incident.module, incident.cause, incident.action) == (
        FAIL_STEP, "aten.div.Tensor", "pool", "div_by_zero", "skipped")
    assert cb.guard.scaler is trainer.precision_plugin.scaler and cb.guard.last_step["scale"] is not None
    assert same_state(recorder.at_step(FAIL_STEP + 1), recorder.at_step(FAIL_STEP))


def test_resumed_fit_counts_steps_from_the_checkpoint(tmp_path):
    first = NanTraceCallback(config=nantrace.Config(print_incidents=False))
    trainer, _ = _fit(first, Tiny(), max_steps=2, empty_step=None)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    cb = NanTraceCallback(config=nantrace.Config(print_incidents=False))
    trainer, _ = _fit(cb, Tiny(), ckpt_path=str(tmp_path / "two.ckpt"))
    [incident] = cb.incidents
    # the resumed epoch reads its data from batch 0 again: the empty sample (batch 3) is met at global step 2 + 3
    assert (incident.step, incident.module, incident.cause) == (2 + FAIL_STEP, "pool", "div_by_zero")
    assert cb.guard.step == trainer.global_step == MAX_STEPS


def test_raise_policy_stops_the_fit_before_the_update(tmp_path):
    model = Tiny()
    cb = NanTraceCallback(on_anomaly="raise", config=nantrace.Config(print_incidents=False))
    recorder = None
    with pytest.raises(nantrace.NonFiniteError) as info:
        _, recorder = _fit(cb, model)
    incident = info.value.incident
    assert (incident.step, incident.op, incident.module, incident.cause, incident.action) == (
        FAIL_STEP, "aten.div.Tensor", "pool", "div_by_zero", "raised")
    assert cb.incidents == [incident]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert cb.guard.closed and "training_step" not in model.__dict__  # closed by on_exception
    assert_unhooked(model)


def test_healthy_fit_raises_no_incident(tmp_path):
    model = Tiny()
    cb = NanTraceCallback(config=nantrace.Config(print_incidents=False))
    trainer, _ = _fit(cb, model, empty_step=None, max_steps=4)
    assert cb.incidents == [] and cb.guard.step == 4 and trainer.global_step == 4
    assert cb.guard.last_step["skipped"] is False and cb.guard.closed


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(on_anomaly="explode"), ValueError, "NanTraceCallback: unknown on_anomaly 'explode'; expected one of 'skip', 'raise', 'rollback', 'pause'"),
        (dict(optimizer=None), TypeError, "NanTraceCallback: unknown argument(s) 'optimizer'; expected any of run_dir, on_anomaly, config"),
        (dict(config={}), TypeError, "NanTraceCallback: config must be a nantrace.Config, got dict"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error) as info:
        NanTraceCallback(**kwargs)
    assert message in str(info.value)


def test_missing_extra_names_the_pip_command(monkeypatch):
    from nantrace import _imports

    real = importlib.util.find_spec
    monkeypatch.setattr(_imports.importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    _imports.is_available.cache_clear()
    try:
        with pytest.raises(ImportError) as info:
            _imports.require("lightning", feature="nantrace.integrations.lightning")
    finally:
        _imports.is_available.cache_clear()
    assert str(info.value) == ("nantrace.integrations.lightning needs 'lightning', which is not installed: "
                               "run `pip install 'nantrace[lightning]'`")
