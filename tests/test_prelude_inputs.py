"""A model input made non-finite by the step's own code before the forward (features standardised
by the batch's own std, counts turned into shares of their column) is traced to that code through the prelude
tape, in zero-code mode too; a NaN that came in with the batch is still the batch's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

BAD_STEP = 3


def standardise(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / x.std(0)  # <origin:std>


def column_shares(x: torch.Tensor) -> torch.Tensor:
    return x.abs() / x.abs().sum(0)  # <origin:shares>


def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def _batch(step: int, g: torch.Generator, bad: str) -> torch.Tensor:
    x = torch.randn(8, 4, generator=g)
    if step == BAD_STEP:
        if bad == "constant_column":
            x[:, 2] = 1.5
        elif bad == "empty_column":
            x[:, 1] = 0.0
        else:
            x[0, 1] = float("nan")
    return x


CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str, tuple]] = {
    # name: (the code before the forward, what the batch holds, (kind, phase, op, module, cause, tag))
    "batch_standardisation": (standardise, "constant_column",
                              ("nonfinite_input", "forward", "aten.div.Tensor", None, "zero_variance_norm", "std")),
    "column_shares": (column_shares, "empty_column",
                      ("nonfinite_input", "forward", "aten.div.Tensor", None, "div_by_zero", "shares")),
    "nan_in_the_batch": (doubled, "nan",
                         ("nonfinite_input", "data", None, None, "nonfinite_input", None)),
}


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("name", list(CASES))
def test_an_input_made_before_the_forward_is_traced_to_its_line(name, replayable):
    prepare, bad, want = CASES[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(5)

    def step_loss(m: nn.Module, raw: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(prepare(raw)), y)

    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(step_loss) if replayable else None
        for step in range(5):
            raw, y = _batch(step, g, bad), torch.randn(8, 1, generator=g)
            opt.zero_grad()
            if replayable:
                loss = loss_fn(model, raw, y)
            else:
                x = prepare(raw)
                loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        incidents = [i for i in guard.incidents if i.action != "logged"]
    inc = incidents[0]
    kind, phase, op, module, cause, tag = want
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (BAD_STEP, kind, phase, op, module, cause), \
        inc.summary
    if tag is None:
        assert inc.source is None
    else:
        assert points_at(inc.source, __file__, tag), inc.source
