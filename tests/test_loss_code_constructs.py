"""Loss code built from more than plain torch calls, replayed as it ran: a custom
``autograd.Function`` (kept by the tape as one call, ``patches.FUNCTION_APPLY``, so the replay runs
its backward), a gradient hook on one of its tensors (kept by the tape, registered again on the
replayed tensor), and a ``replayable`` loss function that keeps state between calls (its re-run
computes something else; the step's own tape is replayed instead)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

BAD_STEP = 2
QUIET = nantrace.Config(outputs={"print_incidents": False})
from torch.autograd.function import _SingleLevelFunction


class SoftRank(torch.autograd.Function):
    """A blackbox ranking layer: piecewise-constant forward, interpolated gradient (the interpolation
    strength ``lam`` divides the perturbed ranks' difference)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, lam: float) -> torch.Tensor:
        ranks = scores.argsort(-1).argsort(-1).float()
        ctx.save_for_backward(scores, ranks)
        ctx.lam = lam
        return ranks

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scores, ranks = ctx.saved_tensors
        perturbed = (scores + ctx.lam * grad).argsort(-1).argsort(-1).float()
        return -(perturbed - ranks) / ctx.lam, None  # <origin:rank_backward>


soft_rank = SoftRank.apply  # an alias bound at import, before any guard: the tape still keeps the call


def _rank_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor, lam: float) -> torch.Tensor:
    ranks = soft_rank(model(x), lam)
    return F.mse_loss(ranks, target)


def _reversal_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor, lam: float) -> torch.Tensor:
    """An adversarial branch weighted by ``lam``, whose gradient is reversed and normalised by a hook."""
    feats = model(x)
    centred = feats - feats.mean(0, keepdim=True)
    centred.register_hook(lambda g: -g / g.norm())  # <origin:hook>
    return F.mse_loss(feats, target) + lam * centred.pow(2).mean()


class _Budget:
    """A loss whose weight is 1 / (calls left): the third call of the run divides by zero. Called twice,
    the step computes something else the second time."""

    def __init__(self, budget: int) -> None:
        self.budget, self.calls, self.history = budget, 0, []

    def __call__(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor, lam: float) -> torch.Tensor:
        self.calls += 1
        left = torch.tensor(float(self.budget - self.calls))
        weight = 1.0 / left  # <origin:budget>
        loss = weight * F.mse_loss(model(x), target)
        self.history.append(float(loss))
        return loss


def _train(loss_fn, *, replayable: bool, lam_at_bad: float = 1.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nantrace.watch(model, opt, config=QUIET) as guard:
        fn = guard.replayable(loss_fn) if replayable else loss_fn
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, target = torch.randn(6, 4, generator=g), torch.randn(6, 5, generator=g)
            lam = lam_at_bad if step == BAD_STEP else 1.0
            opt.zero_grad()
            fn(model, x, target, lam).backward()
            opt.step()
        incidents = list(guard.incidents)
    return incidents


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_custom_functions_backward_in_the_loss_code_is_replayed(replayable):
    incidents = _train(_rank_loss, replayable=replayable, lam_at_bad=0.0)
    inc = incidents[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_grad", "backward", "aten.div.Tensor", None, "div_by_zero"), inc.summary
    assert points_at(inc.source, __file__, "rank_backward"), inc.source
    assert "apply" not in _SingleLevelFunction.__dict__  # taken off again by close()


def test_the_tape_keeps_a_custom_function_as_one_call():
    model = nn.Linear(4, 5)
    with nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=1e-2), config=QUIET) as guard:
        _rank_loss(model, torch.randn(6, 4), torch.randn(6, 5), 1.0).backward()
        names = [getattr(e.func, "__name__", str(e.func)) for e in guard.recorder.capture.tape.entries]
    assert "apply" in names and "argsort" not in names, names


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_gradient_hook_of_the_loss_code_runs_in_the_replay(replayable):
    incidents = _train(_reversal_loss, replayable=replayable, lam_at_bad=0.0)  # the branch switched off: its gradient is 0
    inc = incidents[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (  # g / ||g|| of an all-zero g
        BAD_STEP, "nonfinite_grad", "backward", "aten.div.Tensor", None, "zero_variance_norm"), inc.summary
    assert points_at(inc.source, __file__, "hook"), inc.source


def test_a_stateful_replayable_loss_is_diagnosed_from_its_tape():
    """Re-running the wrapped function divides by 1/(3 - 4), finite: the taped call kept the 0 it divided by.
    The re-run leaves the object as the run left it: four calls, four losses (localisation/python_state.py, from rerun.run_unit)."""
    loss = _Budget(3)
    incidents = _train(loss, replayable=True)
    assert loss.calls == 4 and len(loss.history) == 4, (loss.calls, loss.history)
    inc = incidents[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (  # 1.0 / t is reciprocal(t)
        BAD_STEP, "nonfinite_loss", "forward", "aten.reciprocal.default", None, "div_by_zero"), inc.summary
    assert points_at(inc.source, __file__, "budget"), inc.source
    assert inc.details.get("replayable_call_finite") is True
    assert not inc.transient


class _Broken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's own error")

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


def test_an_error_inside_a_custom_function_shows_no_frame_of_nantrace():
    model = nn.Linear(3, 3)
    with nantrace.watch(model, config=QUIET):
        out = model(torch.randn(2, 3))
        with pytest.raises(ValueError) as raised:
            _Broken.apply(out)
    from nantrace._user_traceback import without_wrappers

    files = [f.filename for f in traceback.extract_tb(without_wrappers(raised.value.__traceback__))]
    assert not [f for f in files if "/nantrace/" in f.replace("\\", "/")], files


class _ClassBalanced:
    """Class-balanced weights from the counts seen so far, the counts updated in place after use: at
    the step where a class never seen before appears, its weight divides by a count of 0."""

    def __init__(self, classes: int) -> None:
        self.counts = torch.ones(classes)
        self.counts[4] = 0.0  # a class the data has not shown yet

    def __call__(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor, lam: float) -> torch.Tensor:
        labels = target[:, :4].argmax(-1)
        if lam == 0.0:
            labels[0] = 4  # the new class arrives: its weight is inf, the weighted mean inf / inf
        weight = self.counts.sum() / self.counts  # <origin:class_weight>
        loss = F.cross_entropy(model(x), labels, weight=weight)
        self.counts += torch.bincount(labels, minlength=len(self.counts)).float()  # after use: a replay must not see it
        return loss


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_tensor_the_loss_code_writes_after_use_is_replayed_as_it_was_used(replayable):
    """The tape keeps a copy of a received tensor before the loss code first writes into it
    (``LossTape.before_write``): the replay divides by the counts the real step divided by, not by the
    counts as they are after the update."""
    incidents = _train(_ClassBalanced(5), replayable=replayable, lam_at_bad=0.0)
    inc = incidents[0]
    assert (inc.step, inc.kind, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_loss", "aten.div.Tensor", None, "div_by_zero"), inc.summary
    assert points_at(inc.source, __file__, "class_weight"), inc.source


def test_only_a_tensor_read_before_its_write_is_copied():
    """An EMA of the loss written without being read first needs no copy (what a replay reads of it is
    what it reads); the counts read by the loss code and then updated get one."""
    model = nn.Linear(4, 5)
    ema, counts = torch.zeros(5), torch.ones(5)
    with nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=1e-2), config=QUIET) as guard:
        out = model(torch.randn(6, 4))
        loss = (out - counts.sum()).pow(2).mean()
        ema.mul_(0.9)
        counts.add_(1.0)
        loss.backward()
        kept = guard.recorder.capture.tape.before_write
        assert list(kept) == [id(counts)] and torch.equal(kept[id(counts)][1], torch.ones(5))
