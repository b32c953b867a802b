"""Replay of the loss tape: the user's loss code re-issued on copies of what it received,
under the op tracer, forward and then backward to the model's outputs.

Copies of floating inputs that required grad (the model's outputs, parameters used in a
regulariser) become fresh leaves, so the backward of the loss code is replayed exactly as
far as the model's outputs and no ``.grad`` is touched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..loss_tape import LossTape, Ref, tensors_of
from .tracer import OpTracer


@dataclasses.dataclass
class TapeResult:
    loss: torch.Tensor | None
    forward_finite: bool
    grads_finite: bool | None
    error: BaseException | None = None
    failed_at: int | None = None
    """Index of the call that raised during the replay."""


class _Decoder:
    def __init__(self) -> None:
        self.values: list[list[torch.Tensor]] = []
        self.copies: dict[int, torch.Tensor] = {}
        self.leaves: list[torch.Tensor] = []

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, Ref):
            return self.values[obj.entry][obj.slot]
        if isinstance(obj, torch.Tensor):
            copy = self.copies.get(id(obj))
            if copy is None:
                copy = obj.detach().clone()
                if obj.requires_grad and (copy.is_floating_point() or copy.is_complex()):
                    copy.requires_grad_(True)
                    self.leaves.append(copy)
                self.copies[id(obj)] = copy
            return copy
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self(v) for v in obj)
        if isinstance(obj, list):
            return [self(v) for v in obj]
        if isinstance(obj, dict):
            return {k: self(v) for k, v in obj.items()}
        return obj


def replay_tape(tape: LossTape, tracer: OpTracer, *, backward: bool = True) -> TapeResult:
    """Re-issue the tape's calls (inside the tracer and a module stack); then its backward."""
    decode = _Decoder()
    error: BaseException | None = None
    failed_at = None
    with torch.enable_grad():
        for index, entry in enumerate(tape.entries):
            tracer.source_override = entry.source
            try:
                out = entry.func(*decode(entry.args), **decode(entry.kwargs))
            except Exception as exc:
                error, failed_at = exc, index
                break
            finally:
                tracer.source_override = None
            decode.values.append(tensors_of(out))
        tracer.flush()
    if error is not None or tape.loss is None:
        return TapeResult(None, error is None, None, error, failed_at)
    loss = decode.values[tape.loss.entry][tape.loss.slot]
    if not bool(torch.isfinite(loss.detach()).all()):
        return TapeResult(loss, False, None)
    if not backward or not loss.requires_grad or not decode.leaves:
        return TapeResult(loss, True, None)
    grads = torch.autograd.grad(loss, decode.leaves, allow_unused=True)
    return TapeResult(loss, True, all(bool(torch.isfinite(g).all()) for g in grads if g is not None))
