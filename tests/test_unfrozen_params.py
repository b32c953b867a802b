"""A parameter the optimizer holds but that was frozen when ``watch()`` ran (gradual unfreezing,
an adapter switched on later) is watched like the others from its first gradient on: the step
check reads its gradient, and the optimizer-phase check names it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nantrace

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8, bias=False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sqrt(self.encoder(x).abs()))  # sqrt at 0: an infinite derivative


def test_a_nan_gradient_of_a_layer_unfrozen_after_watch_is_blocked_at_its_step():
    torch.manual_seed(0)
    model = _Net()
    model.encoder.requires_grad_(False)  # frozen for the first steps
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(4):
            if step == 2:
                model.encoder.requires_grad_(True)
            x = torch.randn(8, 4, generator=g)
            if step == 3:
                x[0] = 0.0  # a blank sample: every pre-activation 0
            before = model.encoder.weight.detach().clone()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        incidents = [i for i in guard.incidents if i.action != "logged"]
    (inc,) = incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        3, "nonfinite_grad", "backward", "aten.sqrt.default", "", "grad_singularity", "skipped"), inc.summary
    assert [t["name"] for t in inc.details["nonfinite_grads"]] == ["encoder.weight"]
    assert torch.equal(before, model.encoder.weight)
