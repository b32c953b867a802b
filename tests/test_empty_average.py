"""A mean-type reduction over nothing is a division by a zero count (docs/diagnosis.md: an empty mean is
``div_by_zero``), whatever reduction divides: ``mean`` of an empty selection, along the rows or along
the columns, a loss's ``"mean"`` reduction over an empty boolean selection. A NaN that a reduction
makes from a genuinely bad value stays what it is."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 2


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _centroid_loss(out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Pull the kept rows towards their centroid (the centroid of none is 0/0)."""
    centroid = out[keep].mean(0)  # <origin:centroid>
    return (out - centroid).pow(2).mean()


def _masked_l1(out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """An L1 regression over the valid pixels only."""
    return F.l1_loss(out[keep], torch.zeros_like(out[keep]))  # <origin:masked_l1>


def _class_mean_logit(out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each sample's mean logit over the classes the batch allows (none allowed: every row's mean is 0/0)."""
    allowed = keep[: out.shape[1]]
    return out[:, allowed].mean(1).pow(2).mean()  # <origin:row_mean>


CASES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int, str, str]] = {
    "centroid_of_an_empty_selection": (_centroid_loss, 0, "aten.mean.dim", "centroid"),
    "l1_over_no_valid_pixel": (_masked_l1, 0, "aten.mean.default", "masked_l1"),  # l1_loss is abs, then mean
    "row_means_over_no_allowed_class": (_class_mean_logit, 0, "aten.mean.dim", "row_mean"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_average_over_too_few_elements_is_a_division_by_zero(name: str) -> None:
    loss_of, kept_at_fail, op, tag = CASES[name]
    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(FAIL + 2):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            keep = torch.ones(6, dtype=torch.bool)
            if step == FAIL:
                keep[:] = False
                keep[:kept_at_fail] = True
            opt.zero_grad()
            loss_of(model(x), keep).backward()
            opt.step()
    first = guard.incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action) == \
        (FAIL, "nonfinite_loss", "forward", op, None, "div_by_zero", "skipped")
    assert points_at(first.source, __file__, tag), first.source


def test_a_mean_of_a_bad_value_is_not_an_empty_average() -> None:
    """The mean of a selection holding sqrt(-1): the NaN is sqrt's (domain), not the mean's."""
    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(FAIL + 1):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            shift = -100.0 if step == FAIL else 100.0
            opt.zero_grad()
            out = model(x)
            torch.sqrt(out + shift).mean().backward()  # <origin:sqrt_negative>
            opt.step()
    first = guard.incidents[0]
    assert (first.step, first.op, first.cause) == (FAIL, "aten.sqrt.default", "sqrt_negative")
    assert points_at(first.source, __file__, "sqrt_negative"), first.source
