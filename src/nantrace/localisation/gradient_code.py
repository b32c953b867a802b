"""Replaying the step's code between ``backward()`` and ``optimizer.step()``: the gradient tape.

Clipping, a gradient normalised or averaged by hand, noise added to it, the unscaling of a
GradScaler: code that reads and writes ``param.grad`` after the backward. When the step's
gradients are non-finite while its forward, loss and backward replay finite, this is where
they went bad, and without a replay of it the failure would read as a transient fault.

The replay hands the tape the replayed gradients in place of the real ones: each watched
parameter's ``.grad`` is set, for the replay only, to a copy of its replayed gradient (what
``backward()`` left there), the tape's calls are re-issued under the op tracer, and the real
gradients are put back whatever happens. A call that wrote ``param.grad = ...`` writes the
stand-in, never the real one.

A step may also write its gradients with no ``backward()`` at all (per-sample gradients from a
``torch.func`` transform scaled by hand, an evolution-strategies estimate from fitness-weighted noise):
then the code that made them ran before the optimizer's step with no forward of the model to end the
prelude, and the prelude's kept calls are replayed on their real inputs instead
(:func:`replay_written_gradients`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ..loss_tape import GradRef, LossTape
from .loss_replay import _Decoder, _reissue, _replay_prelude
from .tracer import OpRecord, OpTracer

if TYPE_CHECKING:
    from ..watched import Watched


@dataclasses.dataclass
class GradientCodeResult:
    """What the replayed gradient code made of the replayed gradients."""

    finite: bool
    """Every parameter's gradient finite after the code (as ``optimizer.step()`` would read it)."""
    bad: list[str]
    """Names of the parameters whose gradient the code made non-finite."""
    start: OpRecord | None
    """The traced op that made the first of those gradients non-finite (where the origin search starts)."""
    error: BaseException | None = None
    """What a call of the code raised when re-issued (then nothing is concluded)."""


class _GradientDecoder(_Decoder):
    """The loss tape's decoder, with each :class:`GradRef` read as the stand-in gradient."""

    def __init__(self, stand_ins: dict[int, torch.Tensor], externals: dict[int, str]) -> None:
        super().__init__({}, set(), [], externals)
        self.stand_ins = stand_ins

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, GradRef):
            stand_in = self.stand_ins.get(id(obj.param))
            return stand_in if stand_in is not None else super().__call__(obj.param.grad)
        return super().__call__(obj)


def replayed_gradients(total: dict[int, torch.Tensor], grads: dict[int, torch.Tensor] | None) -> None:
    """Add one replayed unit's gradients into ``total`` (a step of several forwards accumulates them)."""
    for key, g in (grads or {}).items():
        have = total.get(key)
        total[key] = g.detach() if have is None else have + g.detach()


def replay_gradient_code(watched: "Watched", tape: LossTape, grads: dict[int, torch.Tensor],
                         tracer: OpTracer) -> GradientCodeResult:
    """Re-issue ``tape`` (a gradient tape) on copies of ``grads`` (the replayed gradients by
    parameter ``id``) under ``tracer`` (entered here), and judge the gradients it leaves."""
    named = [(name, p) for name, p in watched.root.named_parameters() if p.requires_grad]
    stand_ins = {id(p): grads[id(p)].detach().clone() for _, p in named if id(p) in grads}  # the replay's own
    real = [(p, p.grad) for _, p in named]
    try:
        for _, p in named:
            p.grad = stand_ins.get(id(p))
        decode = _GradientDecoder(stand_ins, tracer.externals)
        with tracer.modules, tracer, torch.no_grad():
            error = _reissue(tape, decode, tracer)
            tracer.flush()
        if error is not None:
            return GradientCodeResult(False, [], None, error)
        final = [(name, p.grad) for name, p in named]
    finally:
        for p, g in real:
            p.grad = g
    bad = [(name, g) for name, g in final if g is not None and not bool(torch.isfinite(g).all())]
    start = next((tracer.producer.get(g) for _, g in bad if tracer.producer.get(g) is not None), None)
    if start is None and bad:
        start = next((r for r in tracer.records if r.creates_nonfinite), tracer.records[0] if tracer.records else None)
    return GradientCodeResult(not bad, [name for name, _ in bad], start)


def _finite(t: torch.Tensor) -> bool:
    """Every value of ``t`` finite (one host read)."""
    return bool(torch.isfinite(t).all())


def replay_written_gradients(watched: "Watched", prelude: LossTape, tracer: OpTracer) -> GradientCodeResult:
    """Re-issue the prelude's kept calls (the step's code, which wrote ``param.grad`` itself: no ``backward()``
    ran) on copies of their real inputs under ``tracer`` (entered here), and find where the gradients went bad.

    The search starts at the op that made the replayed value of the first non-finite gradient that a kept call
    made (``p.grad = (g * factor).mean(0)``, or an in-place write into ``p.grad``), else at the first op that
    created a non-finite value. Nothing of the user's is touched: the prelude's replay works on copies."""
    bad = [(name, p.grad) for name, p in watched.root.named_parameters()
           if p.grad is not None and not _finite(p.grad)]
    try:
        with tracer.modules, tracer, torch.enable_grad():  # as the prelude's own replay in a step's
            by_id, _ = _replay_prelude(prelude, tracer, exclude=set())
            tracer.flush()
    except Exception as exc:  # noqa: BLE001  the user's code raised on re-run: nothing is concluded
        return GradientCodeResult(False, [], None, exc)
    replayed = [by_id.get(id(g)) for _, g in bad]
    made = [r for r in replayed if r is not None and not _finite(r.detach())]
    start = next((tracer.producer.get(r) for r in made if tracer.producer.get(r) is not None), None)
    if start is None:
        start = next((r for r in tracer.records if r.creates_nonfinite), None)
    return GradientCodeResult(start is None, [name for name, _ in bad], start)
