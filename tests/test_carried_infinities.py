"""A softmax-family op that only passes on a ``-inf`` it received (a dynamic program's unreachable states,
a row of a recursion that no path reaches yet) creates no non-finite value in the forward; the NaN is its
derivative's, ``exp(x - lse) = exp(-inf - (-inf))`` over a row that is all ``-inf``. The diagnosis names
that op in the backward with ``masked_softmax_all`` (classify._backward_cause), not the forward op "absorbed"
by a later slice (which has no value of its own to judge). Long loss code (a recursion over frames, a
few hundred calls) is taped and replayed whole (loss_tape.MAX_ENTRIES).

Each program is checked without nantrace first: the forward is finite, the gradient NaN at step FAIL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 3
NEG = float("-inf")


class Emitter(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).log_softmax(-1)


def ctc_nll(lp: torch.Tensor, target: list[int]) -> torch.Tensor:
    """CTC in log space written by hand (alpha over the blank-extended target, frame by frame)."""
    ext = [0]
    for c in target:
        ext += [c, 0]
    ext_t = torch.tensor(ext)
    skip = torch.tensor([s >= 2 and ext[s] != 0 and ext[s] != ext[s - 2] for s in range(len(ext))])
    minus_inf = torch.full((len(ext),), NEG)
    alpha = torch.cat([lp[0, ext_t[:2]], minus_inf[2:]])
    for t in range(1, lp.shape[0]):
        one = torch.cat([minus_inf[:1], alpha[:-1]])
        two = torch.where(skip, torch.cat([minus_inf[:2], alpha[:-2]]), minus_inf)
        alpha = torch.logsumexp(torch.stack([alpha, one, two]), dim=0) + lp[t, ext_t]  # <origin:ctc>
    return -torch.logsumexp(alpha[-2:], dim=0)


def ctc_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    feats, targets = batch
    lp = model(feats)
    return torch.stack([ctc_nll(lp[i], targets[i]) for i in range(len(targets))]).mean()


def ctc_batch(step: int) -> Any:
    g = torch.Generator().manual_seed(step)
    targets = [[int(torch.randint(1, 5, (), generator=g))] for _ in range(4)]
    if step == FAIL:
        targets[2] = [3, 1, 4]  # the first three-label target: states unreachable at t = 2 enter the recursion
    return torch.randn(4, 9, 6, generator=g), targets


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Callable[[int], Any], str, str]] = {
    "hand_written_ctc_three_label_target": (lambda: Emitter(5), ctc_loss, ctc_batch, "ctc", "grad"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_construction_without_nantrace(name: str) -> None:
    make, loss_fn, batch, _, what = CASES[name]
    torch.manual_seed(0)
    model = make()
    for step in range(FAIL + 1):
        model.zero_grad()
        loss = loss_fn(model, batch(step))
        loss.backward()
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        if step < FAIL:
            assert torch.isfinite(loss) and grads_ok
    assert torch.isfinite(loss) and not grads_ok  # finite forward, NaN derivative


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_intrusive", "replayable"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_derivative_over_an_all_minus_inf_row_is_named(name: str, replayable: bool) -> None:
    make, loss_fn, batch, tag, what = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    fn = guard.replayable(loss_fn) if replayable else loss_fn
    with guard:
        for step in range(FAIL + 2):
            opt.zero_grad()
            fn(model, batch(step)).backward()
            opt.step()
    inc = guard.incidents[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (
        FAIL, "nonfinite_grad", "backward", "aten.logsumexp.default", None, "masked_softmax_all"), inc.summary
    assert points_at(inc.source, __file__, tag), inc.source
