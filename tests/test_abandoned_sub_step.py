"""A loop that skips a non-finite loss and trains on (``if not torch.isfinite(loss): continue``, Lightning's
``return None``): the skipped batch's forward and the next batch's run in one optimizer step, with no
``backward()`` between them. The step's check reports the skipped loss (``nonfinite_loss``, logged: the update
is the next batch's and lands), localised on a replay of that sub-step alone; steps with several forwards that
all reach the backward (a siamese pair, gradient accumulation) read nothing more than one value a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.testing.host_reads import HostReadCounter
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 3
STEPS = 6


class BagOfWords(nn.Module):
    """Term frequencies (counts / document length), then a classifier: an empty document is 0 / 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        tf = counts / counts.sum(1, keepdim=True)  # <origin:tf>
        return self.fc(tf)


def bow_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    counts = torch.poisson(torch.full((8, 20), 0.7), generator=g)
    counts[:, 0] += 1
    if step == FAIL and micro == 1:
        counts[5] = 0  # a document emptied by the stop-word filter
    return counts, torch.randint(0, 3, (8,), generator=g)


def bow_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def poisson_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A Poisson likelihood written with exp of the raw prediction; the targets' scale is in the data."""
    x, y = batch
    rate = torch.exp(model(x) * y.mean())  # <origin:rate_exp>
    return (rate - y * torch.log(rate)).mean()


def poisson_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * step + micro)
    y = torch.poisson(torch.full((16,), 2.0), generator=g)
    if step == FAIL and micro == 1:
        y = y * 1e4  # counts in another unit: exp overflows in the loss code, the model's outputs are finite
    return torch.randn(16, 4, generator=g), y


# name -> (model, loss, batch, origin tag, op, module, cause)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Callable[..., Any], str, str, str | None, str]] = {
    "model_output_nan_empty_document": (BagOfWords, bow_loss, bow_batch, "tf", "aten.div.Tensor", "", "div_by_zero"),
    "loss_code_overflow_rescaled_counts": (Regressor, poisson_loss, poisson_batch, "rate_exp", "aten.exp.default", None,
                                           "exp_overflow"),
}


def skip_loop(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: Callable[..., Any], *,
              accumulate: int, guard: Any = None) -> tuple[list[tuple[int, int]], list[int]]:
    """The user's loop: ``accumulate`` micro-batches a step; a non-finite micro-batch loss is skipped (no
    backward) and the loop goes on. Returns the skipped (step, micro) and the host reads of each step."""
    opt = guard.optimizer if guard is not None else torch.optim.SGD(model.parameters(), lr=0.05)
    skipped, reads = [], []
    with HostReadCounter() as counter:
        for step in range(STEPS):
            counter.reset()
            opt.zero_grad()
            for micro in range(accumulate):
                loss = loss_fn(model, batch(step, micro))
                if not bool(torch.isfinite(loss)):
                    skipped.append((step, micro))
                    continue
                (loss / accumulate).backward()
            opt.step()
            reads.append(len([e for e in counter.events if e.where.startswith("nantrace" + os.sep)]))
    return skipped, reads


@pytest.mark.parametrize("accumulate", [2, 3], ids=["skip_then_next_batch", "accumulation_middle_micro_batch"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_skipped_nonfinite_loss_is_reported_and_the_next_batch_trains(name: str, accumulate: int) -> None:
    make, loss_fn, batch, tag, op, module, cause = CASES[name]
    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    model = make()
    plain_skipped, _ = skip_loop(plain, loss_fn, batch, accumulate=accumulate)
    assert plain_skipped == [(FAIL, 1)]  # the construction: one micro-batch's loss is non-finite, without nantrace
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        skipped, reads = skip_loop(model, loss_fn, batch, accumulate=accumulate, guard=guard)
    finally:
        guard.close()
    assert skipped == [(FAIL, 1)]
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL, "nonfinite_loss", "forward", op, module, cause, "logged"), inc.summary
    assert points_at(inc.source, __file__, tag), inc.source
    assert inc.details["abandoned_forward"] == 1
    for a, b in zip(plain.parameters(), model.parameters()):  # every step's update landed, as without nantrace
        assert torch.equal(a, b)
    assert reads[:FAIL] + reads[FAIL + 1:] == [1] * (STEPS - 1)  # healthy steps: one read each


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


def test_several_forwards_that_reach_the_backward_read_nothing_more() -> None:
    """Must not fire, nor read: a siamese pair (two forwards, one loss), a forward whose auxiliary scalar is
    made before the second forward (both reach the loss), and an evaluation forward under grad whose metric is
    finite and never backwarded. One host read a step, no incident."""
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    g = torch.Generator().manual_seed(5)
    reads = []
    with HostReadCounter() as counter:
        for step in range(STEPS):
            counter.reset()
            a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
            opt.zero_grad()
            if step % 3 == 0:
                loss = F.mse_loss(model(a), model(b))
            elif step % 3 == 1:
                za = model(a)
                reg = za.pow(2).mean()  # a scalar made from the first forward, used in the loss below
                loss = F.mse_loss(za, model(b)) + 0.1 * reg
            else:
                metric = model(a).norm()  # an evaluation with grad on, never backwarded (finite)
                loss = F.mse_loss(model(b), torch.zeros(8, 8)) + 0 * metric.detach()
            loss.backward()
            opt.step()
            reads.append(len([e for e in counter.events if e.where.startswith("nantrace" + os.sep)]))
    guard.close()
    assert list(guard.incidents) == []
    assert reads[0] == 1 and reads[1] == 1  # the siamese and the auxiliary-scalar steps read only the check
