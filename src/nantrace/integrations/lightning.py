"""nantrace for Lightning: one callback.

Usage::

    import lightning as L
    from nantrace.integrations.lightning import NanTraceCallback

    nan_cb = NanTraceCallback(run_dir="runs/nantrace", on_anomaly="skip")
    L.Trainer(callbacks=[nan_cb]).fit(model)
    nan_cb.incidents        # [Incident(step=812, kind='nonfinite_loss', op='aten.log.default', ...)]
    # the logger gets nantrace/loss, nantrace/grad_norm, nantrace/skipped, nantrace/incidents, ...
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

from .._imports import require

require("lightning", feature="nantrace.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402

from . import GuardSession, SessionCallback, check_watch_kwargs, step_metrics  # noqa: E402
from ._checkpoint import CheckpointVeto  # noqa: E402

__all__ = ["NanTraceCallback"]

_ABSENT = object()


class NanTraceCallback(SessionCallback, pl.Callback):
    """Watches the LightningModule, its optimizer and (``16-mixed``) GradScaler during ``fit``.

    ``**watch_kwargs`` are those of :func:`nantrace.watch` (``run_dir``, ``on_anomaly``,
    ``config``). Under automatic optimisation ``training_step`` is made replayable, so an
    incident names the op and line even when the loss is computed outside ``forward``.
    With several optimizers the first is watched.

    Checkpoints stay healthy: a save by ``ModelCheckpoint`` or ``trainer.save_checkpoint`` while
    the weights hold non-finite values or an incident episode is unresolved is refused (a
    ``CheckpointRefusedWarning`` and an incident; no file written, none rotated away). A run
    resumed with ``ckpt_path`` whose weights are non-finite is reported at its first step,
    naming the tensors and that file.
    """

    def __init__(self, **watch_kwargs: Any) -> None:
        self.watch_kwargs = check_watch_kwargs(watch_kwargs, "NanTraceCallback")
        self.session: GuardSession | None = None
        self._patched: tuple[pl.LightningModule, Any] | None = None  # (module, its own training_step attr)
        self._veto: CheckpointVeto | None = None
        self._logged_step = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        if not trainer.optimizers:
            warnings.warn("NanTraceCallback: the trainer has no optimizer; nothing is watched", stacklevel=2)
            return
        if len(trainer.optimizers) > 1:
            warnings.warn(f"NanTraceCallback: {len(trainer.optimizers)} optimizers; only the first is watched", stacklevel=2)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.session = GuardSession(pl_module, trainer.optimizers[0], scaler, **self.watch_kwargs)
        self._logged_step = -1
        self.session.guard.checkpoints.loaded_from = getattr(trainer, "ckpt_path", None)
        self._veto = CheckpointVeto(trainer, self.session.guard.checkpoints)
        if pl_module.automatic_optimization:  # a manual training_step steps the optimizer: not replayable
            self._patched = (pl_module, pl_module.__dict__.get("training_step", _ABSENT))
            pl_module.training_step = self.session.guard.replayable(_loss_first(pl_module.training_step))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None:  # a resumed fit: count on from the checkpoint's step
            self.guard.step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        row = self.guard.last_step if self.guard is not None else None
        if row is None or row["step"] == self._logged_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._logged_step = row["step"]
        if row["skipped"] or row["step"] % max(trainer.log_every_n_steps, 1) == 0:
            metrics = step_metrics(self.guard)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=row["step"])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.guard is not None:  # a bad value that made the step raise: diagnosed before the guard closes
            self.guard.diagnose_exception(exception)
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self._veto is not None:
            self._veto.remove()
            self._veto = None
        if self._patched is not None:
            module, previous = self._patched
            if previous is _ABSENT:
                module.__dict__.pop("training_step", None)  # back to the class's method
            else:
                module.__dict__["training_step"] = previous
            self._patched = None
        if self.session is not None:
            self.session.close()


def _loss_first(training_step: Any) -> Any:
    """``training_step`` returning its dict with ``"loss"`` first, so that a replay of the
    step takes that entry as the loss to differentiate."""

    @functools.wraps(training_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        out = training_step(*args, **kwargs)
        if isinstance(out, Mapping) and "loss" in out:
            return {"loss": out["loss"], **out}
        return out

    return step
