"""Code between ``backward()`` and ``optimizer.step()`` that makes finite gradients non-finite
(a gradient normalised by hand, divided by a token count, preconditioned, averaged by a count of
ranks): the gradient tape replays it on the replayed gradients and names its op and line
(``localisation/gradient_code.py``). Before it, the forward, loss and backward replayed finite and
the incident read as a transient hardware fault.

Every case is checked against plain PyTorch first (the gradients are finite right after
``backward()`` and non-finite at ``step()``), then under nantrace in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

BAD_STEP = 3
STEPS = 5


def _lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, targets, mask = batch
    logits = model(tokens)
    return (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            * mask.reshape(-1)).sum()


def _lm_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(STEPS):
        mask = (torch.rand(4, 6, generator=g) < 0.5).float()
        mask[0, 0] = 1.0
        if step == BAD_STEP:
            mask.zero_()  # a batch of padding only: no token counts
        out.append((torch.randint(0, 30, (4, 6), generator=g), torch.randint(0, 30, (4, 6), generator=g), mask))
    return out


def _lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(30, 16), nn.ReLU(), nn.Linear(16, 30))


# ----------------------------------------------------------------------------- the gradient code
def by_token_count(model: nn.Module, batch: Any) -> None:
    """A summed loss, its gradients divided by the number of tokens afterwards (as when the count is
    only known after all micro-batches)."""
    n_tokens = batch[2].sum()
    for p in model.parameters():
        p.grad.div_(n_tokens)  # <origin:token_count>


def by_global_norm(model: nn.Module, batch: Any) -> None:
    """Normalised gradient descent by hand: every gradient divided by the global norm."""
    with torch.no_grad():
        total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        for p in model.parameters():
            p.grad.div_(total)  # <origin:global_norm>


def rebound_average(model: nn.Module, batch: Any) -> None:
    """An average over the ranks that contributed, by reassignment (``p.grad = ...``): none did."""
    contributed = batch[2].amax().reshape(())  # 0 when this rank's batch held no token
    for p in model.parameters():
        p.grad = p.grad / contributed  # <origin:rebound>


def clipped_then_scaled(model: nn.Module, batch: Any) -> None:
    """The library clip first (it reads every ``p.grad`` inside torch), then a hand-written division."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    denom = batch[2].sum()
    for p in model.parameters():
        p.grad.mul_(1.0 / denom)  # <origin:after_clip>


CASES: dict[str, tuple[Callable[[nn.Module, Any], None], str, str, str]] = {
    # name: (gradient code, op, cause, origin tag)
    "token_count": (by_token_count, "aten.div_.Tensor", "div_by_zero", "token_count"),
    "global_norm": (by_global_norm, "aten.div_.Tensor", "zero_variance_norm", "global_norm"),
    "rebound_average": (rebound_average, "aten.div.Tensor", "div_by_zero", "rebound"),
    "after_clip": (clipped_then_scaled, "aten.reciprocal.default", "div_by_zero", "after_clip"),
}


def _train(between: Callable[[nn.Module, Any], None], *, guard_mode: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = _lm_batches()
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) \
        if guard_mode is not None else None
    loss_fn = guard.replayable(_lm_loss) if guard is not None and guard_mode == "replayable" else _lm_loss
    finite_after_backward, finite_at_step, unchanged = [], [], None
    for step, batch in enumerate(batches):
        opt.zero_grad()
        loss_fn(model, batch).backward()
        finite_after_backward.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        between(model, batch)
        finite_at_step.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        before = [p.detach().clone() for p in model.parameters()]
        seen = len(guard.incidents) if guard is not None else 0
        opt.step()
        if guard is not None and len(guard.incidents) > seen and unchanged is None:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if guard is not None:
        guard.close()
    return dict(incidents=list(guard.incidents) if guard is not None else [], unchanged=unchanged,
                after_backward=finite_after_backward, at_step=finite_at_step)


@pytest.mark.parametrize("name", list(CASES))
def test_the_construction_without_nantrace(name):
    """Finite right after every backward; the gradient code makes them non-finite at BAD_STEP only."""
    run = _train(CASES[name][0], guard_mode=None)
    assert run["after_backward"][:BAD_STEP + 1] == [True] * (BAD_STEP + 1)
    assert run["at_step"][:BAD_STEP + 1] == [s != BAD_STEP for s in range(BAD_STEP + 1)]


@pytest.mark.parametrize("mode", ["zero_code", "replayable"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_gradient_code_is_named(name, mode):
    between, op, cause, tag = CASES[name]
    run = _train(between, guard_mode=mode)
    (inc,) = run["incidents"]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        BAD_STEP, "nonfinite_grad", "backward", op, None, cause, "skipped"), inc.summary
    assert points_at(inc.source, __file__, tag), inc.source
    assert inc.transient is False
    assert "between backward() and optimizer.step()" in inc.summary
    assert set(inc.details["gradient_code_made_nonfinite"]) == {"0.weight", "2.weight", "2.bias"}
    assert run["unchanged"] is True


def test_the_real_gradients_are_put_back_after_the_replay():
    """The replay works on stand-ins: the real (non-finite) gradients are what the step set aside."""
    torch.manual_seed(0)
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[list[torch.Tensor]] = []
    with nantrace.watch(model, opt, on_anomaly="raise",
                        config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step, batch in enumerate(_lm_batches()):
            opt.zero_grad()
            _lm_loss(model, batch).backward()
            by_token_count(model, batch)
            seen.append([p.grad for p in model.parameters()])
            if step == BAD_STEP:
                with pytest.raises(nantrace.NonFiniteError):
                    opt.step()
                break
            opt.step()
        (inc,) = guard.incidents
    assert inc.op == "aten.div_.Tensor" and inc.transient is False
    real = [p.grad for p in model.parameters()]
    assert all(a is b for a, b in zip(real, seen[-1]))  # the user's own gradient tensors, not the stand-ins
    assert all(not bool(torch.isfinite(g).all()) for g in real)


def test_a_healthy_run_with_clipping_trains_the_same_bytes():
    """The gradient tape only watches: clipping and hand-written gradient code train as without it."""
    def between(model: nn.Module, batch: Any) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for p in model.parameters():
            p.grad.mul_(0.9)

    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _lm()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
        g = torch.Generator().manual_seed(2)
        for _ in range(12):
            tokens, targets = torch.randint(0, 30, (4, 6), generator=g), torch.randint(0, 30, (4, 6), generator=g)
            opt.zero_grad()
            _lm_loss(model, (tokens, targets, torch.ones(4, 6))).backward()
            between(model, None)
            opt.step()
        if guard is not None:
            assert guard.incidents == []
            guard.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_the_tape_holds_no_gradient_past_its_step():
    """What the tape read through ``p.grad`` is let go when the next step starts."""
    torch.manual_seed(0)
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = _lm_batches()[0]
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        opt.zero_grad()
        _lm_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        tape = guard.recorder.capture.gradient_tape
        # the clip is one call on the tape (its own ~5 ops per parameter run untaped)
        assert tape is not None and [e.func.__name__ for e in tape.entries] == ["clip_grad_norm_"]
        opt.step()
        assert not tape.entries and not tape._grad_of
