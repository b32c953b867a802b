"""A non-finite value the replay receives from code that was not taped is not blamed on an op that only received it.

The prelude keeps the last ``PRELUDE_ENTRIES`` calls of the step's code before the model's forward, and carries over
its start-over the calls that remake the values still alive (a behaviour log-probability of 0 before a long GAE
loop, targets standardised by a zero std before a long input-refinement loop: named as within the window). A value
made earlier that cannot be remade exactly (jittered by a draw of the global RNG) enters the loss code's replay as
a tensor no replayed op made. When the prelude forgot calls that step, that is no evidence that the batch carried it: the incident names no op, module, line or phase, says
cause ``unknown`` and which argument received the value (``localiser._received_from_untaped_code``). Must not fire
(unchanged): the same program within the window (the log is named), a ``-inf`` padding mask built before a long
loop and applied additively (``masked_softmax_all`` at the log-softmax), and values that came with the batch in a
short step (``nonfinite_input``), including a logged ``-inf`` log-probability that the loss subtracts: a subtracted
``-inf`` becomes ``+inf`` and is no mask applied (``origin.applied_as_mask``).

Each construction is checked with plain torch first (``test_construction_without_nantrace``): the step that fails,
the first call that made a non-finite value from finite inputs and its line (a ``TorchFunctionMode``), and how many
calls ran between it and the model's forward (beyond or within the prelude's window).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import nantrace
from nantrace.loss_tape import PRELUDE_ENTRIES
from origin_markers import origin_line, points_at

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

HERE = os.path.abspath(__file__)
BAD_STEP = 3
STEPS = 5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------- PPO: behaviour log-probs, a GAE loop, the update
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
        self.v = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pi(obs), self.v(obs).squeeze(-1)


def _policy() -> Policy:
    torch.manual_seed(0)
    model = Policy()
    with torch.no_grad():  # hidden unit 0 fires only for a large first observation; then action 0 takes all the mass
        model.pi[0].weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        model.pi[0].bias[0] = -3.0
        model.pi[2].weight[0] *= 0.0
        model.pi[2].weight[0, 0] = 200.0
        model.pi[2].bias[0] = 200.0
    return model


def _rollout(step: int, n: int) -> tuple[torch.Tensor, ...]:
    g = _gen(100 + step)
    obs = torch.randn(n, 4, generator=g) * 0.5
    actions = torch.randint(0, 3, (n,), generator=g)
    if step == BAD_STEP:  # an exploration action where the policy's probability underflowed to 0
        obs[5] = torch.tensor([10.0, 0.0, 0.0, 0.0])
        actions[5] = 1
    return obs, actions, torch.randn(n, generator=g), (torch.rand(n, generator=g) < 0.05).float()


def ppo_step(model: nn.Module, batch: Any, jitter: bool = False) -> torch.Tensor:
    obs, actions, rewards, dones = batch
    with torch.no_grad():
        logits, values = model(obs)
        p_old = torch.softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
        if jitter:  # a behaviour policy's exploration noise, drawn from the global RNG
            old_logp = torch.log(p_old) - 1e-3 * torch.rand_like(p_old)  # <origin:old_logp_jitter>
        else:
            old_logp = torch.log(p_old)  # <origin:old_logp>
    adv = torch.zeros_like(rewards)
    gae = torch.zeros(())
    for t in reversed(range(len(rewards) - 1)):  # ~15 calls a transition
        delta = rewards[t] + 0.99 * values[t + 1] * (1 - dones[t]) - values[t]
        gae = delta + 0.99 * 0.95 * (1 - dones[t]) * gae
        adv[t] = gae
    logits, values_new = model(obs)
    new_logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(new_logp - old_logp)  # <origin:ratio>
    return -(ratio * adv).mean() + F.mse_loss(values_new, adv + values)


# ----------------------------------------------------------------- regression: targets standardised, inputs refined
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _regression_batch(step: int, bad_step_targets: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(300 + step)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, generator=g) * 3.0 + 1.0
    if step == BAD_STEP:
        if bad_step_targets == "constant":  # every target of the batch the same (a clipped sensor)
            y = torch.full((16,), 2.5)
        elif bad_step_targets == "nan":  # a missing reading in the batch itself
            y[4] = float("nan")
    return x, y


def refined_step(model: nn.Module, batch: Any, refinements: int) -> torch.Tensor:
    x, y = batch
    y = (y - y.mean()) / y.std()  # <origin:y_std>
    g = _gen(7)
    for _ in range(refinements):  # Langevin-style input refinement before the forward: 3 calls each
        x = x + 0.001 * torch.randn(x.shape, generator=g)
    return F.mse_loss(model(x), y)  # <origin:mse>


def raw_target_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    x = x * 0.5
    return F.mse_loss(model(x), y)


# ----------------------------------------------------------------- pointer scoring under a padding mask
class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _candidates(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(500 + step)
    x = torch.randn(4, 6, 8, generator=g)
    valid = torch.rand(4, 6, generator=g) < 0.7
    valid[:, 0] = True
    if step == BAD_STEP:
        valid[2] = False  # an example with no candidate left
    return x, valid, torch.zeros(4, dtype=torch.long)


def masked_pointer_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, valid, target = batch
    pad = torch.zeros(valid.shape).masked_fill(~valid, float("-inf"))  # <origin:pad>
    g = _gen(9)
    for _ in range(450):  # candidate features jittered before the forward: 3 calls each
        x = x + 0.001 * torch.randn(x.shape, generator=g)
    logp = torch.log_softmax(model(x) + pad, -1)  # <origin:lsm>
    return F.nll_loss(logp, target)


# ----------------------------------------------------------------- offline RL: behaviour log-probs logged in the batch
def _logged(step: int) -> tuple[torch.Tensor, ...]:
    g = _gen(700 + step)
    obs = torch.randn(32, 4, generator=g) * 0.5
    actions = torch.randint(0, 3, (32,), generator=g)
    logged = torch.log(torch.full((32,), 1 / 3)) + 0.1 * torch.randn(32, generator=g)
    if step == BAD_STEP:
        logged[9] = float("-inf")  # the actor logged a probability that underflowed to 0
    return obs, actions, logged, torch.randn(32, generator=g)


def offline_step(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, actions, logged, adv = batch
    logits, _ = model(obs)
    new_logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(new_logp - logged)
    return -(ratio * adv).mean()


# ----------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int], Any]
    step: Callable[[nn.Module, Any], torch.Tensor]
    want: tuple[str, str | None, str | None, str | None, str]
    """(kind, phase, op, module, cause) at BAD_STEP."""
    line: str | None
    """The line ``source`` must name (None: no source)."""
    origin: str | None
    """Plain torch: the line of the first call that made a non-finite value from finite inputs (None: no call did,
    the batch carried it)."""
    window: str | None
    """Plain torch: calls from that first call to the model's forward, ``beyond`` or ``within`` the prelude's."""
    received: tuple[str, str] | None = None
    """For ``unknown``: (the argument, the line of the op that received the value)."""


def _regressor() -> nn.Module:
    torch.manual_seed(1)
    return Regressor()


def _scorer() -> nn.Module:
    torch.manual_seed(2)
    return Scorer()


CASES = {
    # beyond the window, the early value is still alive and remade exactly by the calls that made it: carried
    # over the prelude's start-over (LossTape._survivors), so named as within it
    "ppo_behaviour_logprob_of_zero_before_a_1500_call_gae_loop": Case(
        _policy, lambda s: _rollout(s, 100), ppo_step,
        ("nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive"), "old_logp", "old_logp", "beyond"),
    "targets_standardised_by_a_zero_std_before_a_1200_call_input_refinement": Case(
        _regressor, lambda s: _regression_batch(s, "constant"), lambda m, b: refined_step(m, b, 400),
        ("nonfinite_loss", "forward", "aten.div.Tensor", None, "zero_variance_norm"), "y_std", "y_std", "beyond"),
    # beyond the window and jittered by a draw of the global RNG: not remade exactly, not carried; received untaped
    "ppo_jittered_behaviour_logprob_of_zero_before_a_1500_call_gae_loop": Case(
        _policy, lambda s: _rollout(s, 100), lambda m, b: ppo_step(m, b, jitter=True),
        ("nonfinite_loss", None, None, None, "unknown"), None, "old_logp_jitter", "beyond", ("arg1", "ratio")),
    # must not fire: the same programs within the window, a mask, values the batch carried
    "ppo_behaviour_logprob_of_zero_before_a_short_gae_loop": Case(
        _policy, lambda s: _rollout(s, 24), ppo_step,
        ("nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive"), "old_logp", "old_logp", "within"),
    "targets_standardised_by_a_zero_std_before_a_short_input_refinement": Case(
        _regressor, lambda s: _regression_batch(s, "constant"), lambda m, b: refined_step(m, b, 20),
        ("nonfinite_loss", "forward", "aten.div.Tensor", None, "zero_variance_norm"), "y_std", "y_std", "within"),
    "padding_mask_built_before_a_1350_call_loop_masks_a_whole_row": Case(
        _scorer, _candidates, masked_pointer_step,
        ("nonfinite_loss", "forward", "aten._log_softmax.default", None, "masked_softmax_all"), "lsm", "pad", "beyond"),
    "nan_regression_target_in_the_batch": Case(
        _regressor, lambda s: _regression_batch(s, "nan"), raw_target_step,
        ("nonfinite_input", "data", None, None, "nonfinite_input"), None, None, None),
    "logged_behaviour_logprob_of_minus_inf_in_the_batch_subtracted": Case(
        _policy, _logged, offline_step, ("nonfinite_input", "data", None, None, "nonfinite_input"), None, None, None),
}


# ----------------------------------------------------------------- plain torch: the construction
class _Calls(TorchFunctionMode):
    """Every torch call of the step: (this file's line issuing it, made a non-finite value from finite floating
    inputs); the model's forward under grad mode as ``"FORWARD"``."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        floats = lambda obj: [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        ins, outs = floats((args, kwargs)), floats(out)
        made = bool(outs) and all(bool(torch.isfinite(t).all()) for t in ins) \
            and any(not bool(torch.isfinite(t).all()) for t in outs)
        self.log.append((_line(), made))
        return out


def _line() -> int | None:
    frame = sys._getframe(2)
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == HERE and frame.f_code.co_name != "__torch_function__":
            return frame.f_lineno
        frame = frame.f_back
    return None


def _plain(case: Case) -> tuple[int | None, list[Any]]:
    """The first step whose loss is non-finite, and the calls of that step."""
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    calls = _Calls()
    model.register_forward_pre_hook(lambda m, a: calls.log.append("FORWARD") if torch.is_grad_enabled() else None)
    for step, batch in enumerate([case.batch(s) for s in range(STEPS)]):  # loaded before: as a data loader's
        calls.log.clear()
        opt.zero_grad()
        with calls:
            loss = case.step(model, batch)
        if not bool(torch.isfinite(loss)):
            return step, list(calls.log)
        loss.backward()
        opt.step()
    return None, []


@pytest.mark.parametrize("name", list(CASES))
def test_construction_without_nantrace(name: str) -> None:
    case = CASES[name]
    step, log = _plain(case)
    assert step == BAD_STEP
    first = next((i for i, entry in enumerate(log) if entry != "FORWARD" and entry[1]), None)
    if case.origin is None:  # the batch carried it: no call of the step made a non-finite value from finite ones
        assert first is None, log[first]
        return
    assert first is not None and log[first][0] == origin_line(HERE, case.origin), log[first] if first else None
    between = log.index("FORWARD") - first
    if case.window == "beyond":
        assert between > 1.2 * PRELUDE_ENTRIES, between
    else:
        assert between < PRELUDE_ENTRIES / 2, between


# ----------------------------------------------------------------- with nantrace (zero-intrusive)
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis(name: str) -> None:
    case = CASES[name]
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [case.batch(s) for s in range(STEPS)]  # made before the loop, as a data loader's: no step code of it
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for batch in batches:
            opt.zero_grad()
            loss = case.step(model, batch)
            loss.backward()
            opt.step()
    assert guard.incidents, "no incident"
    inc = guard.incidents[0]
    kind, phase, op, module, cause = case.want
    got = (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action)
    assert got == (BAD_STEP, kind, phase, op, module, cause, "skipped"), (got, inc.summary, inc.details)
    if case.line is None:
        assert inc.source is None, inc.source
    else:
        assert points_at(inc.source, HERE, case.line), inc.source
    received = inc.details.get("received_from_untaped_code")
    if case.received is None:
        assert received is None, received
    else:
        argument, line = case.received
        assert received is not None and received["argument"] == argument, received
        assert points_at(received["source"], HERE, line), received
        assert "not taped" in inc.details["localisation"] and str(PRELUDE_ENTRIES) in inc.details["localisation"]
