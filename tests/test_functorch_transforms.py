"""A model run inside a ``torch.func`` transform (per-sample gradients by ``vmap(grad(functional_call))``,
as DP-SGD does): nothing of nantrace keeps the transform's wrapped tensors (the model's forward hooks and
the tapes let calls at a functorch level pass), so the user's program runs as without nantrace, and a
failure born in the code that turns the per-sample gradients into ``p.grad`` is found there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 2


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _sample_loss(model: nn.Module):
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0))
    return loss


def _dp_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: float,
             *, pad: bool) -> None:
    """One step of normalised DP-SGD: per-sample gradients, each scaled to length ``clip`` by its own norm
    (not clipped: normalised), averaged."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(_sample_loss(model)), in_dims=(None, 0, 0))(params, x, y)
    if pad:  # a padded last batch: the padding rows' gradients are zeroed before clipping
        per_sample = {k: torch.cat([g[:-2], torch.zeros_like(g[-2:])]) for k, g in per_sample.items()}
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    factor = clip / norms  # <origin:dp_factor>
    opt.zero_grad()
    for name, p in model.named_parameters():
        g = per_sample[name]
        p.grad = (g * factor.view(-1, *[1] * (g.dim() - 1))).mean(0)
    opt.step()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("watched", [False, True])
def test_a_healthy_dp_sgd_run_is_untouched(watched: bool) -> None:
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
    try:
        for step in range(4):
            _dp_step(model, opt, *_batch(step), clip=1.0, pad=False)
    finally:
        if guard is not None:
            guard.close()
    reference = Tagger()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        _dp_step(reference, ref_opt, *_batch(step), clip=1.0, pad=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    if guard is not None:
        assert guard.incidents == [] and guard.recorder.capture.forwards == []


@pytest.mark.xfail(strict=True, reason=(
    "no forward of the watched model and no backward() ran outside the transform: the localiser has 'nothing to "
    "replay' (op None, cause unknown), though the code that computed p.grad was taped by the prelude (it records "
    "from the last step's end and no forward ended it); replaying the prelude's calls on their real inputs would "
    "find clip / 0 (localisation/localiser.py, the no-forward branch)"))
def test_a_zero_per_sample_norm_is_found_in_the_clipping_code() -> None:
    """The padded rows' per-sample gradient is 0: clip / 0 = inf, and 0 * inf = NaN in their scaled
    gradient, averaged into every p.grad. The NaN is born in the code between the transform and
    optimizer.step(); the per-sample gradients come out of the transform finite."""
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before: list[torch.Tensor] = []
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(FAIL + 2):
            if step == FAIL:
                before = [p.detach().clone() for p in model.parameters()]
            _dp_step(model, opt, *_batch(step), clip=1.0, pad=step == FAIL)
            if step == FAIL:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was skipped
    first: Any = guard.incidents[0]
    # the divisor is a norm of gradients (docs/diagnosis.md's provenance rule): zero_variance_norm
    assert (first.step, first.kind, first.op, first.module, first.cause, first.action) == \
        (FAIL, "nonfinite_grad", "aten.div.Tensor", None, "zero_variance_norm", "skipped")
    assert points_at(first.source, __file__, "dp_factor"), first.source
