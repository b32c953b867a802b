"""A model made only of torch modules (a bare ``nn.Sequential``) has no line of the user's inside
it: a replay names the line that called the model in the real step (``ForwardRecord.call_site``,
``tracer.replay_site``), not the ``optimizer.step()`` line from which the guard replays it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

BAD_STEP = 2


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)  # <origin:call>
    return F.mse_loss(out, y)


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_bare_sequential_is_named_at_the_line_that_called_it(replayable):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8, eps=0.0), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(_loss) if replayable else _loss
        for step in range(4):
            x = torch.randn(4, 8, generator=g)
            if step == BAD_STEP:
                x[1] = 0.5  # a constant sample: its layer norm divides 0 by 0
            opt.zero_grad()
            loss_fn(model, x, torch.randn(4, 2, generator=g)).backward()
            opt.step()  # <origin:step>
        (inc,) = guard.incidents
    assert (inc.step, inc.kind, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_loss", "aten.native_layer_norm.default", "0", "zero_variance_norm")
    assert points_at(inc.source, __file__, "call"), inc.source


def test_the_call_site_is_the_users_line_of_each_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        model(torch.randn(2, 3))  # <origin:first>
        model(torch.randn(2, 3)).sum().backward()  # <origin:second>
        sites = [f.call_site for f in guard.recorder.capture.forwards]
        opt.step()
    assert points_at(sites[0], __file__, "first") and points_at(sites[1], __file__, "second"), sites


class _RowNormalise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)  # <origin:rownorm>


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 6))
        self.critic = nn.Sequential(_RowNormalise(), nn.Linear(6, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)


def _gan_loss(model: nn.Module, z: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    fake = model(z)
    return model.critic(real).mean() - model.critic(fake).mean()  # a submodule called from the loss code


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_submodule_called_from_the_loss_code_is_named(replayable):
    """The loss code calls a submodule of the watched model directly (``model.critic(real)``, as GAN
    code does): its ops are named with that submodule (``Entry.module`` on the loss tape)."""
    torch.manual_seed(0)
    model = _Gan()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(4)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(_gan_loss) if replayable else _gan_loss
        for step in range(4):
            real = torch.randn(5, 6, generator=g)
            if step == BAD_STEP:
                real[2] = 0.0  # a blank sample: 0 / 0
            opt.zero_grad()
            loss_fn(model, torch.randn(5, 4, generator=g), real).backward()
            opt.step()
        (inc,) = guard.incidents
    assert (inc.step, inc.kind, inc.op, inc.module, inc.cause) == (
        BAD_STEP, "nonfinite_loss", "aten.div.Tensor", "critic.0", "zero_variance_norm"), inc.summary
    assert points_at(inc.source, __file__, "rownorm"), inc.source
