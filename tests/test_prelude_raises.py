"""A step that dies before the model's forward: the step's own code (the prelude: the noising of a diffusion
loss, a sampler, target preparation) raises in a torch call. The prelude keeps the call that raised; the
diagnosis re-issues the prelude up to it under the op tracer and names the value it rejected and where that
value came from (kind ``exception``, action ``raised``). A prelude error that is no value's (a shape
mismatch the loop catches) is no incident, and the run's later steps are checked as usual.

Also: an advanced index (``x[t]``, ``x[i, j]``: ``aten.index`` takes its indices as a list, one per
dimension) out of its dimension is ``label_out_of_range``, in the prelude and in the model alike.
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

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 3
T = 50
ALPHAS_CUMPROD = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T), 0)


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / T], 1))


def ddpm_step(model: nn.Module, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    ab = ALPHAS_CUMPROD[t][:, None]  # <origin:q_index>
    xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    return F.mse_loss(model(xt, t), noise)


def ddpm_batches(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, T, (16,), generator=g)
    if step == FAIL:
        t[7] = T  # randint(0, T + 1) in the user's sampler: one timestep past the schedule
    return torch.randn(16, 8, generator=g), t, torch.randn(16, 8, generator=g)


PAIR_TABLE = torch.rand(6, 4)


class PairScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, prior[:, None]], 1)).squeeze(1)


def pair_step(model: nn.Module, x: torch.Tensor, user: torch.Tensor, item: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    prior = PAIR_TABLE[user, item]  # <origin:pair_index>
    return F.binary_cross_entropy_with_logits(model(x, prior), y)


def pair_batches(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    user, item = torch.randint(0, 6, (10,), generator=g), torch.randint(0, 4, (10,), generator=g)
    if step == FAIL:
        item[2] = 4  # an item id from a newer catalogue than the prior table (dimension 1 has 4 items)
    return torch.randn(10, 4, generator=g), user, item, torch.rand(10, generator=g).round()


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def sampled_step(model: nn.Module, obs: torch.Tensor, scores: torch.Tensor, temperature: float) -> torch.Tensor:
    probs = torch.softmax(scores / temperature, -1)  # <origin:temp_div>
    actions = torch.multinomial(probs, 1).squeeze(1)  # the exploration policy picks the actions to imitate
    return F.cross_entropy(model(obs), actions)


def sampled_batches(step: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(step)
    scores = torch.randn(12, 3, generator=g)
    temperature = 1.0 - step / FAIL  # an annealing schedule that reaches 0 at step FAIL
    if step == FAIL:
        scores[4] = 0.0  # 0 / 0 in that row: NaN probabilities, which multinomial rejects
    return torch.randn(12, 6, generator=g), scores, temperature


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Callable[[int], tuple[Any, ...]],
                       type[BaseException], tuple[str, str, str, str]]] = {
    "diffusion_timestep_past_schedule": (Denoiser, ddpm_step, ddpm_batches, IndexError,
                                         ("aten.index.Tensor", "label_out_of_range", "q_index", "dimension")),
    "prior_table_item_id_out_of_range": (PairScorer, pair_step, pair_batches, IndexError,
                                         ("aten.index.Tensor", "label_out_of_range", "pair_index", "dimension 1 of size 4")),
    "temperature_annealed_to_zero_multinomial": (Policy, sampled_step, sampled_batches, RuntimeError,
                                                 ("aten.div.Tensor", "div_by_zero", "temp_div", "")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_program_raises_before_any_forward_without_nantrace(name: str) -> None:
    """The construction, in plain torch: the first FAIL steps train, the step FAIL raises in the code before
    the model's forward (the model is never called in it)."""
    make, step_fn, batches, error, _ = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    for step in range(FAIL):
        opt.zero_grad()
        step_fn(model, *batches(step)).backward()
        opt.step()
    before = len(calls)
    with pytest.raises(error):
        step_fn(model, *batches(FAIL))
    assert len(calls) == before


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_that_raises_before_the_forward_is_diagnosed(name: str) -> None:
    make, step_fn, batches, error, (op, cause, tag, detail) = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    with pytest.raises(error):
        with guard:
            for step in range(FAIL + 1):
                opt.zero_grad()
                step_fn(model, *batches(step)).backward()
                opt.step()
    incidents = list(guard.incidents)
    assert len(incidents) == 1, [(i.kind, i.op, i.cause) for i in incidents]
    inc = incidents[0]
    assert (inc.step, inc.kind, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL, "exception", op, None, cause, "raised"), inc.summary
    assert points_at(inc.source, __file__, tag), inc.source
    assert detail in inc.summary, inc.summary
    assert type(error).__name__ in inc.details["exception"] or error.__name__ in inc.details["exception"]


def test_a_caught_prelude_error_of_no_value_is_no_incident() -> None:
    """A shape error in the code before the forward, caught by the loop (a batch of the wrong width skipped):
    no incident; the steps after it are checked as usual, and the NaN of a later step is its own incident."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    skipped = []
    with guard:
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 5 if step == 2 else 4, generator=g)
            try:
                x = x @ torch.eye(4)  # a projection the wrong-width batch cannot take
            except RuntimeError:
                skipped.append(step)
                continue
            if step == 4:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert skipped == [2]
    assert [(i.step, i.kind) for i in guard.incidents] == [(3, "nonfinite_input")]


@pytest.mark.parametrize("name", list(CASES))
def test_a_prelude_failure_the_loop_catches_is_diagnosed_and_training_goes_on(name: str) -> None:
    """The loop catches the error and goes on to the next batch ("skip bad batches"): the failure is diagnosed
    as it leaves the call (no later hook would see it: the next batch's prelude starts over), the bad batch
    changed nothing, and the later steps train and are checked as usual."""
    make, step_fn, batches, error, (op, cause, tag, _) = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    caught = []
    with guard:
        for step in range(FAIL + 3):
            opt.zero_grad()
            try:
                loss = step_fn(model, *batches(step))
            except error:
                caught.append(step)
                continue
            loss.backward()
            opt.step()
    assert caught == [FAIL]
    inc = guard.incidents[0]
    assert len(guard.incidents) == 1, [(i.kind, i.op) for i in guard.incidents]
    assert (inc.step, inc.kind, inc.op, inc.cause, inc.action) == (FAIL, "exception", op, cause, "raised")
    assert points_at(inc.source, __file__, tag), inc.source
    assert guard.step == FAIL + 2  # every other batch's step counted
