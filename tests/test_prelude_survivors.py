"""A value the step's code made early, before a loop longer than the prelude's window, is still replayed.

The prelude (the step's code before the model's forward, taped) keeps ``PRELUDE_ENTRIES`` calls and starts over
when full. A start-over carries on the calls whose outputs are still alive (the program holds them), with the
calls they need to be recomputed, when re-running them gives back exactly the live values
(``LossTape._survivors``). So a behaviour policy's log-probability of 0 computed before a long GAE loop, a
running normaliser's log-scale of a constant target column before 2,000 calls of augmentation, and a cached
distance-decay table made before a long beam search are still traced to the op and line that made them, not
answered ``unknown``. Must not fire / not kept: an early value the program dropped before the loss (its
arguments, an evaluation's outputs, are not kept alive by the prelude), and an early random draw still alive
(re-running it draws other values: it is not carried, the user's RNG stream is untouched).

Each construction is checked with plain torch first (``test_construction_without_nantrace``): the step that
fails, the first call that made a non-finite value from finite inputs and its line (a ``TorchFunctionMode``),
and that more than 1.2 x ``PRELUDE_ENTRIES`` calls ran between it and the model's forward.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import nantrace
import nantrace.loss_tape as loss_tape
from nantrace.loss_tape import PRELUDE_ENTRIES, LossTape, Ref
from origin_markers import origin_line, points_at

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

HERE = os.path.abspath(__file__)
BAD_STEP = 3
STEPS = 5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------- 1. PPO: behaviour log-prob, then a long GAE loop
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
        self.v = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pi(obs), self.v(obs).squeeze(-1)


def _policy() -> nn.Module:
    torch.manual_seed(0)
    model = Policy()
    with torch.no_grad():  # hidden unit 0 fires only for a large first observation; then action 0 takes all the mass
        model.pi[0].weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        model.pi[0].bias[0] = -3.0
        model.pi[2].weight[0] *= 0.0
        model.pi[2].weight[0, 0] = 200.0
        model.pi[2].bias[0] = 200.0
    return model


def _rollout(step: int) -> tuple[torch.Tensor, ...]:
    g = _gen(100 + step)
    n = 120
    obs = torch.randn(n, 4, generator=g) * 0.5
    actions = torch.randint(0, 3, (n,), generator=g)
    if step == BAD_STEP:  # an exploration action where the policy's probability underflowed to 0
        obs[7] = torch.tensor([10.0, 0.0, 0.0, 0.0])
        actions[7] = 2
    return obs, actions, torch.randn(n, generator=g), (torch.rand(n, generator=g) < 0.05).float()


def clipped_ppo_step(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, actions, rewards, dones = batch
    with torch.no_grad():
        logits, values = model(obs)
        behaviour = torch.log_softmax(logits, -1)
        probs = torch.softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
        old_logp = torch.log(probs)  # <origin:old_logp>
        entropy_ref = -(behaviour.exp() * behaviour).sum(-1).mean()
    adv = torch.zeros_like(rewards)
    last = torch.zeros(())
    for t in reversed(range(len(rewards) - 1)):  # ~15 calls a transition: ~1,800
        delta = rewards[t] + 0.99 * values[t + 1] * (1 - dones[t]) - values[t]
        last = delta + 0.99 * 0.95 * (1 - dones[t]) * last
        adv[t] = last
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    logits, values_new = model(obs)
    new_logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(new_logp - old_logp)
    return -(ratio * adv).mean() + 0.5 * F.mse_loss(values_new, values) + 0.0 * entropy_ref


# ----------------------------------------------------------------- 2. a running normaliser, then 2,000 augmentation calls
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _regressor() -> nn.Module:
    torch.manual_seed(1)
    return Regressor()


def _regression(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(300 + step)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g) * 2.0
    if step == BAD_STEP:
        y[:, 1] = 0.75  # a sensor stuck for the whole batch: that column's variance is 0
    return x, y


def normaliser_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    log_scale = torch.log(y.var(0))  # <origin:log_scale>
    g = _gen(11)
    for _ in range(700):  # augmentation of the inputs before the forward: 3 calls each, 2,100
        x = x + 0.01 * torch.randn(x.shape, generator=g)
    pred = model(x)
    return (((pred - y) ** 2) * torch.exp(-log_scale)).mean()


# ----------------------------------------------------------------- 3. a cached distance-decay table, then a beam search
V, K = 12, 4


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(V, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _scorer() -> nn.Module:
    torch.manual_seed(2)
    return Scorer()


def _beams(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(500 + step)
    positions = torch.arange(1, 17)  # 1-based positions of the target segment
    if step == BAD_STEP:
        positions = torch.arange(0, 16)  # a packed segment that starts at 0 (off by one)
    return torch.randn(V, V, generator=g), positions, torch.randn((), generator=g)


def beam_step(model: nn.Module, batch: Any) -> torch.Tensor:
    trans, positions, target = batch
    decay = torch.rsqrt(positions.float())  # <origin:decay>
    logp = torch.log_softmax(trans, -1)
    scores = logp[0].topk(K).values
    seqs = logp[0].topk(K).indices[:, None]
    for _ in range(150):  # a beam search before the forward: ~9 calls a step, ~1,350
        cand = (scores[:, None] + logp[seqs[:, -1]]).flatten()
        top = cand.topk(K)
        beam, token = top.indices // V, top.indices % V
        seqs = torch.cat([seqs[beam], token[:, None]], 1)
        scores = top.values
    feats = F.one_hot(seqs[0, -len(positions):], V).float()
    return ((model(feats) * decay).sum() - target) ** 2


# ----------------------------------------------------------------- 4. must not fire, nothing kept: an early value dropped
class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _wide() -> nn.Module:
    torch.manual_seed(3)
    return Wide()


def _wide_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(900 + step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 512, (8,), generator=g)


HELD: list[Any] = []
"""Weak references to the evaluation outputs of :func:`dropped_early_step` (the test reads them)."""


def dropped_early_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    with torch.no_grad():
        evaluation = model(torch.randn(1024, 8, generator=_gen(5)))  # 2 MB the program drops below
    HELD.append(weakref.ref(evaluation))
    confidence = evaluation.softmax(-1).amax(-1).mean()
    del evaluation
    scale = float(confidence)  # read as a number, then the tensor is dropped too
    del confidence
    g = _gen(6)
    for _ in range(450):  # input refinement before the forward: 3 calls each, 1,350
        x = x + 0.001 * torch.randn(x.shape, generator=g)
    return F.cross_entropy(model(x), y) * (1.0 + 0.0 * scale)


def random_early_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A noise draw made early and used after a long loop: alive, but not replayable (global RNG)."""
    x, y = batch
    noise = 0.01 * torch.randn(8, 8)
    g = _gen(6)
    for _ in range(450):
        x = x + 0.001 * torch.randn(x.shape, generator=g)
    return F.cross_entropy(model(x + noise), y)


# ----------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int], Any]
    step: Callable[[nn.Module, Any], torch.Tensor]
    want: tuple[str, str, str, str | None, str] | None
    """(kind, phase, op, module, cause) at BAD_STEP; None: no incident at all (must not fire)."""
    origin: str | None
    """The line marked ``# <origin:...>`` of the first call that made a non-finite value (plain torch) and that
    ``source`` must name; None for a healthy program."""


CASES = {
    "ppo_behaviour_logprob_of_zero_then_1800_call_gae_loop": Case(
        _policy, _rollout, clipped_ppo_step,
        ("nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive"), "old_logp"),
    "running_normaliser_log_scale_of_a_constant_column_then_2100_augmentation_calls": Case(
        _regressor, _regression, normaliser_step,
        ("nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive"), "log_scale"),
    "distance_decay_table_of_position_zero_then_1350_call_beam_search": Case(
        _scorer, _beams, beam_step,
        ("nonfinite_loss", "forward", "aten.rsqrt.default", None, "div_by_zero"), "decay"),
    # must not fire: a dropped early value (not kept alive), an early random draw (not carried)
    "early_value_dropped_before_a_1350_call_loop": Case(_wide, _wide_batch, dropped_early_step, None, None),
    "early_random_draw_alive_after_a_1350_call_loop": Case(_wide, _wide_batch, random_early_step, None, None),
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
    for step, batch in enumerate([case.batch(s) for s in range(STEPS)]):
        calls.log.clear()
        opt.zero_grad()
        with calls:
            loss = case.step(model, batch)
        if not bool(torch.isfinite(loss)):
            return step, list(calls.log)
        loss.backward()
        opt.step()
    return None, list(calls.log)


@pytest.mark.parametrize("name", list(CASES))
def test_construction_without_nantrace(name: str) -> None:
    case = CASES[name]
    step, log = _plain(case)
    if case.want is None:
        assert step is None  # healthy: every loss finite
        assert log.index("FORWARD") > 1.2 * PRELUDE_ENTRIES  # and the code before the forward overflows the window
        return
    assert step == BAD_STEP
    first = next((i for i, entry in enumerate(log) if entry != "FORWARD" and entry[1]), None)
    assert first is not None and log[first][0] == origin_line(HERE, case.origin), log[first] if first else None
    assert log.index("FORWARD") - first > 1.2 * PRELUDE_ENTRIES  # beyond the prelude's window


# ----------------------------------------------------------------- with nantrace (zero-intrusive)
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis(name: str) -> None:
    case = CASES[name]
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [case.batch(s) for s in range(STEPS)]
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        prelude = guard.recorder.prelude
        for s, batch in enumerate(batches):
            opt.zero_grad()
            loss = case.step(model, batch)
            assert prelude._restarts >= 1 or s == 0  # the window started over in every step (it opens at step 0's end)
            loss.backward()
            opt.step()
    if case.want is None:
        assert guard.incidents == [], [(i.kind, i.cause, i.summary) for i in guard.incidents]
        return
    assert guard.incidents, "no incident"
    inc = guard.incidents[0]
    kind, phase, op, module, cause = case.want
    got = (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action)
    assert got == (BAD_STEP, kind, phase, op, module, cause, "skipped"), (got, inc.summary, inc.details)
    assert points_at(inc.source, HERE, case.origin), inc.source
    assert "received_from_untaped_code" not in inc.details


# ----------------------------------------------------------------- the mechanism, on the tape itself
def test_a_dropped_early_value_and_what_it_read_are_not_kept_alive() -> None:
    """The evaluation's 2 MB output, read by a taped call whose result the program dropped, is freed once the
    window starts over (the survivors are the calls with live outputs only), and the prelude then holds nothing
    only it keeps alive."""
    HELD.clear()
    case = CASES["early_value_dropped_before_a_1350_call_loop"]
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen: list[tuple[bool, int, int]] = []
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        prelude = guard.recorder.prelude

        def forward_pre(m: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                gc.collect()
                seen.append((HELD[-1]() is None, prelude.held_alone_bytes(), prelude._restarts))

        model.register_forward_pre_hook(forward_pre)
        for s in range(3):
            opt.zero_grad()
            case.step(model, case.batch(s)).backward()
            opt.step()
    assert len(seen) == 3
    for freed, alone, restarts in seen[1:]:  # the prelude opens at the end of step 0
        assert restarts >= 1
        assert freed  # the evaluation's output is gone before the step's forward
        assert alone < 64 << 10, alone


def test_survivors_are_renumbered_and_read_by_later_calls() -> None:
    tape = LossTape(64, prelude=True)
    table = torch.linspace(0.0, 1.0, 8)
    tape.resume()
    try:
        early = torch.log(table)  # alive: carried on, with nothing else (table came from outside)
        acc = torch.zeros(8)
        acc[0] = early[1]  # written in place: the write comes with it
        dropped = table * 3.0  # dead below: not carried
        del dropped
        y = table + 1.0
        for _ in range(70):  # overflows the 64-call window
            y = y * 1.0001
        late = early + acc
    finally:
        tape.pause()
    assert tape._restarts == 1
    names = [getattr(e.func, "__name__", "") for e in tape.entries]
    assert names[:4] == ["log", "zeros", "__getitem__", "__setitem__"], names[:8]
    late_entry = tape.entries[-1]
    assert late_entry.args == (Ref(0, 0), Ref(1, 0))  # the later call names the survivors by their new positions
    assert tape.ref_of(early) == Ref(0, 0) and tape.ref_of(acc) == Ref(1, 0)
    assert tape.rng_marks[0][0] == 4  # the RNG is put back after the survivors, where the new calls begin
    del y, late
    tape.detach()


def test_a_random_early_draw_is_not_carried_and_the_users_rng_is_untouched() -> None:
    def program(tape: LossTape | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(123)
        if tape is not None:
            tape.resume()
        try:
            noise = torch.randn(4)
            fixed = torch.arange(4.0).sqrt()
            y = torch.ones(4)
            for _ in range(70):
                y = y * 1.0001
            after = torch.randn(4)  # drawn after the start-over: the survivor check must not have moved the RNG
        finally:
            if tape is not None:
                tape.pause()
        return noise + fixed, after

    plain = program(None)
    tape = LossTape(64, prelude=True)
    taped = program(tape)
    assert torch.equal(plain[0], taped[0]) and torch.equal(plain[1], taped[1])
    assert tape._restarts == 1
    names = [getattr(e.func, "__name__", "") for e in tape.entries]
    assert "randn" not in names[:3], names[:6]  # the early draw is not carried (re-running it draws other values)
    assert names[:2] == ["arange", "sqrt"], names[:6]
    tape.detach()


def test_survivors_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``PRELUDE_SURVIVORS`` calls (a quarter of the window) are carried on, however many values live."""
    monkeypatch.setattr(loss_tape, "PRELUDE_SURVIVORS", 8)
    tape = LossTape(256, prelude=True)
    base = torch.ones(3)
    tape.resume()
    try:
        kept = [base * float(i) for i in range(300)]  # 300 live values, each one call
    finally:
        tape.pause()
    assert tape._restarts == 1
    assert len(tape.entries) == 8 + (300 - 256)
    del kept
    tape.detach()


class _Counted(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls += 1  # the user's code: a start-over must never run it again
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2.0


def test_a_custom_function_made_early_is_never_rerun_by_a_start_over() -> None:
    model = _wide()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        prelude = guard.recorder.prelude
        for s in range(3):
            x, y = _wide_batch(s)
            before = _Counted.calls
            opt.zero_grad()
            shift = _Counted.apply(torch.full((8,), 0.01))  # alive until the loss: kept as one call of user code
            for _ in range(450):
                x = x + 0.001 * torch.randn(x.shape, generator=_gen(s))
            assert prelude._restarts >= 1 or s == 0
            assert _Counted.calls == before + 1
            F.cross_entropy(model(x + shift), y).backward()
            opt.step()
    assert guard.incidents == []
