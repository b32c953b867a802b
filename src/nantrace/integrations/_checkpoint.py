"""The checkpoint veto for Lightning: ModelCheckpoint and ``trainer.save_checkpoint`` ask the
guard's :class:`~nantrace.response.checkpoints.CheckpointGate` before they write.

A vetoed ``ModelCheckpoint`` save is skipped *whole*: no file written, no older file
removed by its top-k rotation, ``best_model_path``/``last_model_path`` left on the good
files. Every rank of a DDP run takes the same verdict (identical weights, identical
episodes), so the barrier inside ``save_checkpoint`` is passed by all or by none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["CheckpointVeto"]

_SAVE_METHODS = ("_save_topk_checkpoint", "_save_last_checkpoint")


class CheckpointVeto:
    """Instance-level wrappers on a Lightning trainer's checkpoint paths; :meth:`remove` undoes them."""

    def __init__(self, trainer: Any, gate: Any) -> None:
        self._patched: list[tuple[Any, str, Any]] = []  # (object, attribute, what its __dict__ held before)
        self._gate = gate
        for callback in getattr(trainer, "checkpoint_callbacks", []) or []:
            for name in _SAVE_METHODS:
                if callable(getattr(callback, name, None)):
                    self._wrap(callback, name, f"{type(callback).__name__}.{name.strip('_')}")
        self._wrap(trainer, "save_checkpoint", "Trainer.save_checkpoint")

    def _wrap(self, obj: Any, name: str, where: str) -> None:
        original: Callable[..., Any] = getattr(obj, name)
        gate = self._gate

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            path = next((a for a in args if isinstance(a, str)), kwargs.get("filepath"))
            if gate.refuse_if_unsafe(where, path):
                return None
            return original(*args, **kwargs)

        self._patched.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, guarded)

    def remove(self) -> None:
        for obj, name, previous in reversed(self._patched):
            if previous is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = previous
        self._patched.clear()


_ABSENT = object()
