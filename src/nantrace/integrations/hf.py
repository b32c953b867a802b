"""nantrace for the Hugging Face ``transformers.Trainer``: one callback.

Usage::

    from transformers import Trainer
    from nantrace.integrations.hf import NanTraceCallback

    nan_cb = NanTraceCallback(run_dir="runs/nantrace")
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[nan_cb]).train()
    nan_cb.incidents        # [Incident(step=3, kind='nonfinite_loss', op='aten.div.Tensor', ...)]
    # each training log record gains nantrace/loss, nantrace/grad_norm, nantrace/skipped, ...
"""

from __future__ import annotations

from typing import Any

from .._imports import require

require("transformers", feature="nantrace.integrations.hf")

from transformers import TrainerCallback  # noqa: E402

from . import GuardSession, SessionCallback, check_watch_kwargs, step_metrics  # noqa: E402

__all__ = ["NanTraceCallback"]


class NanTraceCallback(SessionCallback, TrainerCallback):
    """Watches the Trainer's model, optimizer and (fp16) GradScaler during ``train()``.

    ``**watch_kwargs`` are those of :func:`nantrace.watch` (``run_dir``, ``on_anomaly``,
    ``config``). A Hugging Face model computes its loss inside ``forward`` when given
    ``labels``, so replaying the captured forward replays the loss too. Steps count
    optimizer updates, as ``state.global_step`` does. If ``train()`` raises, call
    :meth:`close` (the next ``train()`` also closes the previous guard).

    Checkpoints stay healthy: when the Trainer is about to save (``control.should_save``) while
    the weights hold non-finite values or an incident episode is unresolved, the save is
    cancelled (a ``CheckpointRefusedWarning`` and an incident; no checkpoint written, none
    rotated away by ``save_total_limit``). A run resumed from a checkpoint whose weights are
    non-finite is reported at its first step, naming the tensors (and the checkpoint, when
    ``args.resume_from_checkpoint`` names it).
    """

    def __init__(self, **watch_kwargs: Any) -> None:
        self.watch_kwargs = check_watch_kwargs(watch_kwargs, "NanTraceCallback")
        self.session: GuardSession | None = None
        self._logged_step = -1

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.close()
        scaler = getattr(optimizer, "scaler", None)  # accelerate keeps the fp16 GradScaler on its wrapper
        self.session = GuardSession(model, optimizer, scaler, **self.watch_kwargs)
        self.session.guard.step = state.global_step  # resumed from a checkpoint: count on from there
        self._logged_step = -1
        resumed = getattr(args, "resume_from_checkpoint", None)
        self.session.guard.checkpoints.loaded_from = resumed if isinstance(resumed, str) else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._veto(control, state, "Trainer save (on_step_end)")

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._veto(control, state, "Trainer save (on_epoch_end)")

    def _veto(self, control: Any, state: Any, where: str) -> None:
        """Cancel a save the Trainer is about to make when now is not a safe moment."""
        if self.guard is None or self.guard.closed or not getattr(control, "should_save", False):
            return
        if self.guard.checkpoints.refuse_if_unsafe(where, f"checkpoint-{state.global_step}"):
            control.should_save = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        row = self.guard.last_step if self.guard is not None else None
        if logs is None or row is None or row["step"] == self._logged_step:
            return
        self._logged_step = row["step"]
        metrics = step_metrics(self.guard)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)  # Trainer.log appended a copy of logs before calling us

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the guard and remove every hook; idempotent."""
        if self.session is not None:
            self.session.close()
