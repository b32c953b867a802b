"""Re-running the user's code to diagnose a step leaves the Python state it keeps between steps as it
found it (``localisation/python_state.py``, used by ``rerun.run_unit``).

Loss code (and model code) that keeps state in plain Python computes the next step from it: an EMA of
losses in a list, per-task loss histories in a dict, a deque of recent losses, a call counter on a
nested object, a model counting its own forwards. nantrace re-runs that code to localise a failure;
unless the re-run's traces are put back, the run then trains differently from one that merely
skipped the failing update. Each program below fails at ``FAIL_STEP`` in its loss code, with the
state updated in that step from finite values, so a second call changes what later steps train on
(checked with plain torch: ``test_construction``). Each must be diagnosed exactly, and train to the
same parameters, with the same Python state, as a plain run that skipped the failing update.

The negative program reads state (a config dict, a closure's class weights) and writes none.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import random
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import Judge, Program, run_step, sgd, steps, train
from nantrace.capture import RngState
from nantrace.localisation import python_state
from nantrace.localisation.python_state import snapshot_of
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 3
STEPS = 6
JUDGE = Judge(__file__)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _regressor(seed: int, out: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, out))


# ------------------------------------------------------------------ 1. an EMA of losses kept in a list
# The main regression loss is normalised by an EMA of its own past values, kept in a list held by the
# loss function's closure (appended after use). An auxiliary log-count head regresses log(count); at
# FAIL_STEP a record with count 0 reaches the loss: log(0) = -inf, the loss is inf.
def _ema_program() -> tuple[Program, Callable[[], Any]]:
    model = _regressor(1, out=2)
    ema: list[float] = []

    def ema_normalised_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y, count = batch
        out = m(x)
        main = F.mse_loss(out[:, 0], y)
        scale = ema[-1] if ema else 1.0
        ema.append(0.9 * scale + 0.1 * float(main))
        aux = (out[:, 1] - torch.log(count)).pow(2).mean()  # <origin:ema_log>
        return main / scale + 0.1 * aux

    g = _gen(11)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 4, generator=g)
        count = 1.0 + torch.randint(0, 20, (8,), generator=g).float()
        if zero:
            count[5] = 0.0
        return x, x.sum(-1) + 0.1 * torch.randn(8, generator=g), count

    program = Program(model, sgd(model, lr=0.05), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS),
                      ema_normalised_loss)
    return program, lambda: list(ema)


# ------------------------------------------------------------------ 2. a dict of per-task histories (a global)
# Two tasks weighted by the inverse of their mean loss so far, the finite losses of each task kept in a
# module-level dict of lists. The regression task is a masked L1 normalised by the collator's count of
# valid targets; at FAIL_STEP the collator counted 0 while the mask kept rows: x / 0 = inf.
TASK_LOSSES: dict[str, list[float]] = {}


def inverse_mean_weighted_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, labels, target, mask, n_valid = batch
    out = m(x)
    losses = {"cls": F.cross_entropy(out[:, :3], labels),
              "reg": ((out[:, 3] - target).abs() * mask).sum() / n_valid}  # <origin:task_div>
    total = out.new_zeros(())
    for task, value in losses.items():
        history = TASK_LOSSES.setdefault(task, [])
        weight = 1.0 / (sum(history) / len(history)) if history else 1.0
        total = total + weight * value
        if math.isfinite(float(value)):
            history.append(float(value))
    return total


def _task_dict_program() -> tuple[Program, Callable[[], Any]]:
    TASK_LOSSES.clear()
    model = _regressor(2, out=4)
    g = _gen(12)

    def batch(step: int, miscounted: bool = False) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 4, generator=g)
        mask = (torch.rand(8, generator=g) > 0.3).float()
        n_valid = torch.zeros(()) if miscounted else mask.sum().clamp(min=1)
        return x, torch.randint(0, 3, (8,), generator=g), x[:, 0] * 2.0, mask, n_valid

    program = Program(model, sgd(model, lr=0.05), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS),
                      inverse_mean_weighted_loss)
    return program, lambda: copy.deepcopy(TASK_LOSSES)


# ------------------------------------------------------------------ 3. a deque of recent losses (a bound method)
# A loss object damps spikes by dividing by the mean of its recent losses, kept in a bounded deque; each
# sample is weighted by the square root of a reliability column of the batch, in which a missing value
# was written as the sentinel -1 at FAIL_STEP: sqrt(-1) = NaN.
class SpikeDampedLoss:
    def __init__(self) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=3)

    def compute(self, m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y, reliability = batch
        err = (m(x)[:, 0] - y).pow(2)
        damp = sum(self.recent) / len(self.recent) if self.recent else 1.0
        self.recent.append(float(err.mean()))
        weight = torch.sqrt(reliability)  # <origin:deque_sqrt>
        return (weight * err).mean() / damp


def _deque_program() -> tuple[Program, Callable[[], Any]]:
    model = _regressor(3)
    loss = SpikeDampedLoss()
    g = _gen(13)

    def batch(step: int, sentinel: bool = False) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 4, generator=g)
        reliability = torch.rand(8, generator=g) + 0.5
        if sentinel:
            reliability[2] = -1.0
        return x, x[:, 1] - x[:, 2], reliability

    program = Program(model, sgd(model, lr=0.05), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS),
                      loss.compute)
    return program, lambda: (loss.recent.maxlen, list(loss.recent))


# ------------------------------------------------------------------ 4. a counter on a nested object (a closure)
# A token-level loss whose auxiliary term is warmed up by a schedule object nested in the training
# context the loss function closes over; the schedule counts its calls. The main term is normalised by
# the collator's token count, which is 0 at FAIL_STEP while the padding mask kept tokens: inf.
class Warmup:
    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0

    def factor(self) -> float:
        self.calls += 1
        return min(1.0, self.calls / self.steps)


class TrainContext:
    def __init__(self) -> None:
        self.aux = types.SimpleNamespace(warmup=Warmup(5))


def _counter_program() -> tuple[Program, Callable[[], Any]]:
    model = _regressor(4, out=3)
    ctx = TrainContext()

    def token_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, labels, keep, n_tokens = batch
        out = m(x)
        nll = F.cross_entropy(out, labels, reduction="none")
        main = (nll * keep).sum() / n_tokens  # <origin:counter_div>
        return main + ctx.aux.warmup.factor() * out.pow(2).mean()

    g = _gen(14)

    def batch(step: int, miscounted: bool = False) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 4, generator=g)
        keep = torch.ones(8)
        return x, torch.randint(0, 3, (8,), generator=g), keep, torch.zeros(()) if miscounted else keep.sum()

    program = Program(model, sgd(model, lr=0.05), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS), token_loss)
    return program, lambda: ctx.aux.warmup.calls


# ------------------------------------------------------------------ 5. a model that counts its own forwards
# Input noise annealed by the model itself, from a count of its forwards kept as a plain attribute (a
# forward re-run, in either mode, would count once more). The loss is a Poisson log-likelihood with an
# exposure offset, log_rate = model(x) + log(exposure); at FAIL_STEP one record has exposure 0 (a unit
# observed for no time): log(0) = -inf.
class AnnealedNoiseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        shift = 0.5 / self.forwards  # deterministic "noise" annealed by the count
        return self.body(x + shift)[:, 0]


def poisson_exposure_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, counts, exposure = batch
    log_rate = m(x) + torch.log(exposure)  # <origin:exposure_log>
    return (log_rate.exp() - counts * log_rate).mean()


def _module_counter_program() -> tuple[Program, Callable[[], Any]]:
    torch.manual_seed(5)
    model = AnnealedNoiseNet()
    g = _gen(15)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, ...]:
        x = 0.3 * torch.randn(8, 4, generator=g)
        exposure = 0.5 + torch.rand(8, generator=g)
        if zero:
            exposure[4] = 0.0
        return x, torch.poisson(2.0 * torch.ones(8), generator=g), exposure

    program = Program(model, sgd(model, lr=0.02), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS),
                      poisson_exposure_loss)
    return program, lambda: model.forwards


# ------------------------------------------------------------------ 5b. a forward hook logging activations
# An activation monitor: a forward hook on the hidden layer appends each call's mean activation to a list in
# its closure (a dead-unit tracker's log, read after training). A replayed forward runs the hook again; the
# log must end as a plain run's. The loss's log of an exposure of 0 is the failure, as in 5.
def _hook_log_program() -> tuple[Program, Callable[[], Any]]:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))
    log: list[float] = []

    def monitor(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        log.append(round(float(out.detach().abs().mean()), 6))

    model[1].register_forward_hook(monitor)
    g = _gen(17)

    def batch(step: int, zero: bool = False) -> tuple[torch.Tensor, ...]:
        x = 0.3 * torch.randn(8, 4, generator=g)
        exposure = 0.5 + torch.rand(8, generator=g)
        if zero:
            exposure[2] = 0.0
        return x, torch.poisson(2.0 * torch.ones(8), generator=g), exposure

    program = Program(model, sgd(model, lr=0.02), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS),
                      poisson_exposure_loss)
    return program, lambda: list(log)


# ------------------------------------------------------------------ 6. negative: state read, never written
# A class-weighted, label-smoothed cross-entropy whose class weights sit in a closure's list and whose
# smoothing sits in a global config dict (only read), plus a log-ratio regression head; at FAIL_STEP a
# ratio of 0 (a product never sold) reaches it: log(0) = -inf.
CONFIG: dict[str, Any] = {"smoothing": 0.05, "aux": 0.3}


def _negative_program() -> tuple[Program, Callable[[], Any]]:
    model = _regressor(6, out=4)
    class_weights = [1.0, 2.0, 0.5]

    def weighted_ce(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, labels, ratio = batch
        out = m(x)
        ce = F.cross_entropy(out[:, :3], labels, weight=torch.tensor(class_weights),
                             label_smoothing=CONFIG["smoothing"])
        aux = (out[:, 3] - torch.log(ratio)).pow(2).mean()  # <origin:neg_log>
        return ce + CONFIG["aux"] * aux

    g = _gen(16)

    def batch(step: int, unsold: bool = False) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 4, generator=g)
        ratio = 0.2 + torch.rand(8, generator=g)
        if unsold:
            ratio[6] = 0.0
        return x, torch.randint(0, 3, (8,), generator=g), ratio

    program = Program(model, sgd(model, lr=0.05), steps(batch, lambda s: batch(s, True), FAIL_STEP, STEPS),
                      weighted_ce)
    return program, lambda: (list(class_weights), copy.deepcopy(CONFIG))


CASES: dict[str, tuple[Callable[[], tuple[Program, Callable[[], Any]]], Want, bool]] = {
    "ema_of_losses_in_a_closure_list": (
        _ema_program, Want("nonfinite_loss", "forward", "aten.log.default", None, "ema_log", "log_nonpositive"), True),
    "per_task_histories_in_a_global_dict": (
        _task_dict_program, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "task_div", "div_by_zero"), True),
    "deque_of_recent_losses_on_a_bound_self": (
        _deque_program, Want("nonfinite_loss", "forward", "aten.sqrt.default", None, "deque_sqrt", "sqrt_negative"), True),
    "counter_on_a_nested_object_in_a_closure": (
        _counter_program, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "counter_div", "div_by_zero"), True),
    "model_counting_its_forwards": (
        _module_counter_program,
        Want("nonfinite_loss", "forward", "aten.log.default", None, "exposure_log", "log_nonpositive"), True),
    "forward_hook_logging_activations_in_a_closure_list": (
        _hook_log_program,
        Want("nonfinite_loss", "forward", "aten.log.default", None, "exposure_log", "log_nonpositive"), True),
    "negative_state_only_read": (
        _negative_program, Want("nonfinite_loss", "forward", "aten.log.default", None, "neg_log", "log_nonpositive"), False),
}
"""name -> (builder, the diagnosis, whether a second call of the step's code changes the state)."""
MODES = ("zero_intrusive", "replayable")


# ------------------------------------------------------------------ the independent check (plain torch)
class FirstNonFinite(TorchDispatchMode):
    """The first op that made a non-finite value from finite inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.origin: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.origin is None:
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            finite = all(bool(torch.isfinite(t).all()) for t in ins if t.is_floating_point())
            if finite and any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in outs):
                self.origin = str(func)
        return out


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _plain(program: Program) -> dict[str, torch.Tensor]:
    """Parameters after a plain run that skipped the failing update (what ``on_anomaly="skip"`` promises)."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        loss = run_step(program, program.loss, batch, step)
        if bool(torch.isfinite(loss).all()) and _finite(p.grad for p in model.parameters()):
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    """Without nantrace: finite until FAIL_STEP, non-finite loss there, first made by the expected op; and
    calling the step's code a second time changes the kept state (not for the negative program)."""
    build, want, stateful = CASES[name]
    program, state = build()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches[:FAIL_STEP]):
        opt.zero_grad()
        loss = run_step(program, program.loss, batch, step)
        assert bool(torch.isfinite(loss)) and _finite(p.grad for p in model.parameters()), (name, step)
        opt.step()
    mode = FirstNonFinite()
    with mode:
        loss = program.loss(model, program.batches[FAIL_STEP], FAIL_STEP)
    assert not bool(torch.isfinite(loss)), name
    assert mode.origin == want.op, mode.origin
    once = state()
    program.loss(model, program.batches[FAIL_STEP], FAIL_STEP)
    assert (state() != once) == stateful, (once, state())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_rerun_leaves_python_state_and_training_alone(name: str, mode: str) -> None:
    build, want, _ = CASES[name]
    reference_program, reference_state = build()
    reference = _plain(reference_program)
    expected_state = reference_state()
    program, state = build()
    run = train(program, replayable=mode == "replayable")
    got = JUDGE.got(run.incidents)
    assert got == JUDGE.want(want), [(i.step, i.kind, i.phase, i.op, i.module, i.cause, i.summary) for i in run.incidents]
    assert run.error is None and run.unchanged_at_incident is True
    assert state() == expected_state
    params = program.model.state_dict()
    assert all(torch.equal(reference[k], params[k]) for k in reference), [k for k in reference
                                                                        if not torch.equal(reference[k], params[k])]


# ------------------------------------------------------------------ the mechanism itself
GLOBAL_COUNT = 0
GLOBAL_LOG: list[int] = []


class _Slotted:
    __slots__ = ("n", "items")

    def __init__(self) -> None:
        self.n = 0
        self.items: list[int] = []


def test_state_is_restored_in_place_when_the_rerun_raises() -> None:
    history: list[list[float]] = [[1.0]]
    per_task = collections.defaultdict(list, {"a": [1.0]})
    counts: collections.Counter[str] = collections.Counter(a=2)
    recent: collections.deque[float] = collections.deque([1.0, 2.0], maxlen=2)
    seen = {1, 2}
    slotted = _Slotted()
    holder = types.SimpleNamespace(inner=types.SimpleNamespace(calls=0))
    total = 0

    def step_code() -> None:
        nonlocal total
        global GLOBAL_COUNT
        history[0].append(2.0)
        history.append([3.0])
        per_task["b"].append(4.0)
        counts.update("ab")
        recent.append(5.0)
        seen.add(3)
        slotted.n += 1
        slotted.items.append(1)
        holder.inner.calls += 1
        holder.inner.added = True
        total += 10
        GLOBAL_COUNT += 1
        GLOBAL_LOG.append(GLOBAL_COUNT)
        raise ValueError("the re-run raised")

    ids = [id(history), id(history[0]), id(per_task), id(per_task["a"]), id(recent), id(seen), id(slotted.items)]
    with pytest.raises(ValueError):
        with python_state.python_state_kept(step_code) as snapshot:
            step_code()
    assert history == [[1.0]] and per_task == {"a": [1.0]} and isinstance(per_task, collections.defaultdict)
    assert counts == collections.Counter(a=2) and list(recent) == [1.0, 2.0] and recent.maxlen == 2 and seen == {1, 2}
    assert (slotted.n, slotted.items, holder.inner.calls, total, GLOBAL_COUNT, GLOBAL_LOG) == (0, [], 0, 0, 0, [])
    assert not hasattr(holder.inner, "added")
    assert ids == [id(history), id(history[0]), id(per_task), id(per_task["a"]), id(recent), id(seen), id(slotted.items)]
    assert snapshot.not_kept == []


def test_tensors_modules_and_optimizer_are_left_to_their_own_keepers() -> None:
    """A parameter's value, a module's submodule table and hooks, an optimizer's state: not restored here."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    notes: list[int] = []

    def loss_code() -> None:
        with torch.no_grad():
            model.weight.add_(1.0)
        model.register_forward_hook(lambda *a: None)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        notes.append(1)

    before = model.weight.detach().clone()
    with python_state.python_state_kept(loss_code, model, opt):
        loss_code()
    assert notes == [] and len(model._forward_hooks) == 1 and len(opt.state) == 2
    assert not torch.equal(model.weight, before)


def test_a_container_too_large_to_copy_is_named_when_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(python_state, "MAX_CONTAINER", 10)
    big, small = list(range(50)), [1]

    def grows() -> None:
        big.append(50)
        small.append(2)

    with python_state.python_state_kept(grows) as snapshot:
        grows()
    assert small == [1] and len(big) == 51
    assert snapshot.not_kept == ["list of 51 entries (over the copy limit)"]

    with python_state.python_state_kept(lambda: big[0]) as untouched:
        _ = big[0]
    assert untouched.not_kept == []


def test_the_incident_names_the_state_a_rerun_could_not_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the copy limit, a changed container is not put back; the incident says so (``details``)."""
    monkeypatch.setattr(python_state, "MAX_CONTAINER", 3)
    program, _ = _ema_program()
    run = train(program, replayable=True)
    first = next(i for i in run.incidents if i.action != "logged")
    assert first.step == FAIL_STEP and first.op == "aten.log.default"
    # steps 0..3 appended four entries, the re-run a fifth, which stays: that is what the incident says
    assert first.details.get("python_state_not_kept") == ["list of 5 entries (over the copy limit)"], first.details


# ============================== A ``replayable`` call's re-run leaves the user's Python state as a plain run's
# (python_state.py: class code and iterators; rerun.py: Python's and NumPy's RNG; localiser: a skipped re-run).
#
# The patterns are shaped like public training code:
#
# - mixup with NumPy's global RNG (``np.random.beta``, ``np.random.permutation``) and a random crop decided with
#   Python's ``random``: the re-run starts from the real call's entry states (it draws what the real call drew: the
#   failure reproduces, no ``replayable_call_finite``) and both streams end as in a plain run;
# - a semi-supervised step that pulls its unlabeled batch inside the call from a Python GENERATOR (its position
#   cannot be put back: the call is not re-run, ``details["rerun_skipped"]`` says why, the forwards and tapes
#   diagnose it) or from a LIST iterator (its position is put back after the re-run);
# - a loss OBJECT whose ``__call__`` (through a helper method) appends to a module-level list: the globals the code
#   of its class names are put back;
# - must-not-fire: a healthy run drawing from both RNGs and pulling from a generator (no incident, state and weights
#   as a plain run's), and a plain loss function with no RNG or iterator use whose re-run is not skipped.
#
# Each construction is checked in plain torch first (``test_state_construction``): the step at which the loss goes
# non-finite, the first op whose inputs were finite and output not (a TorchDispatchMode), and whether it ran inside
# the model.


@dataclasses.dataclass
class StateProgram:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[..., torch.Tensor]
    state: Callable[[], Any]
    """The user's Python state to compare with a plain run's after the run."""


@dataclasses.dataclass
class StateWant:
    kind: str
    phase: str
    op: str
    module: str | None
    cause: str
    detail: str | None = None
    """A key incident.details must hold (``rerun_skipped``), or None."""
    absent: str | None = None
    """A key incident.details must not hold."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rng_state() -> Any:
    state = np.random.get_state()
    return random.getstate(), [int(v) for v in state[1][:8]], int(state[2]), state[3], state[4]


# ----------------------------------------------------------------------------------- 1. NumPy mixup
def numpy_mixup(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    lam = float(np.random.beta(0.2, 0.2))
    index = torch.from_numpy(np.random.permutation(x.shape[0]))
    x = lam * x + (1 - lam) * x[index]
    target = lam * F.one_hot(y, 5).float() + (1 - lam) * F.one_hot(y[index], 5).float()
    logp = torch.log(torch.softmax(model(x), dim=1))  # softmax underflows to 0 on a raw-unit batch
    return -(target * logp).sum(1).mean()


def _numpy_mixup() -> StateProgram:
    torch.manual_seed(0)
    np.random.seed(7)
    random.seed(7)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))
    g = _gen(21)
    batches = []
    for s in range(STEPS):
        x = torch.randn(16, 12, generator=g)
        if s == FAIL_STEP:
            x *= 1e4  # a batch exported in raw units
        batches.append((x, torch.randint(0, 5, (16,), generator=g)))
    return StateProgram(model, torch.optim.SGD(model.parameters(), lr=0.01), batches, numpy_mixup, _rng_state)


# ----------------------------------------------------------------- 2. Python-random crop (failure depends on the draw)
CROP = 8
WIDTH = 16


def random_crop_with_energy_term(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    start = random.randrange(0, WIDTH - CROP + 1)
    crop = x[:, start:start + CROP]
    energy = torch.log(crop.abs().sum(1))  # log(0) for a row blank over the crop that was drawn
    return F.cross_entropy(model(crop), y) - 0.01 * energy.mean()


def _crop_starts(seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(0, WIDTH - CROP + 1) for _ in range(STEPS + 1)]


CROP_SEED = 3


def _random_crop() -> StateProgram:
    torch.manual_seed(0)
    np.random.seed(3)
    random.seed(CROP_SEED)
    model = nn.Sequential(nn.Linear(CROP, 16), nn.ReLU(), nn.Linear(16, 4))
    starts = _crop_starts(CROP_SEED)
    g = _gen(22)
    batches = []
    for s in range(STEPS):
        x = torch.rand(12, WIDTH, generator=g) + 0.5
        if s == FAIL_STEP:  # a sensor dropout blanks exactly the window the real call crops
            x[5, starts[s]:starts[s] + CROP] = 0.0
        batches.append((x, torch.randint(0, 4, (12,), generator=g)))
    return StateProgram(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, random_crop_with_energy_term,
                   _rng_state)


# -------------------------------------------------------- 3. FixMatch-style: next(unlabeled) inside the call
def _unlabeled(kind: str) -> tuple[Iterator[torch.Tensor], Callable[[], Any]]:
    g = _gen(23)
    items = []
    for s in range(STEPS + 3):
        xu = torch.rand(8, 10, generator=g)
        if s == FAIL_STEP:
            xu[2] = 0.0  # a blank spectrum
        items.append(xu)
    if kind == "list":
        it: Iterator[torch.Tensor] = iter(items)
        return it, lambda: it.__length_hint__()
    pulled = [0]

    def stream() -> Iterator[torch.Tensor]:
        for xu in items:
            pulled[0] += 1
            yield xu

    gen = stream()
    return gen, lambda: pulled[0]


def _fixmatch(kind: str) -> Callable[[], StateProgram]:
    def build() -> StateProgram:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
        unlabeled, position = _unlabeled(kind)

        def step_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
            x, y = batch
            xu = next(unlabeled)
            weak = xu / xu.norm(dim=1, keepdim=True)  # 0 / 0 for a blank row
            with torch.no_grad():
                pseudo = m(weak).argmax(1)
            strong = weak + 0.05 * torch.cos(3.0 * weak)
            return F.cross_entropy(m(x), y) + F.cross_entropy(m(strong), pseudo)

        g = _gen(24)
        batches = [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]
        return StateProgram(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, step_loss, position)

    return build


# ------------------------------------------------------- 4. a loss object whose __call__ appends to a global
METRIC_LOG: list[float] = []


class MaskedRegressionLoss:
    """A masked MSE averaged over the labelled entries; logs each value into a module-level list."""

    def __init__(self) -> None:
        self.calls = 0

    def _log(self, value: torch.Tensor) -> None:
        METRIC_LOG.append(round(float(value.detach()), 5))

    def __call__(self, model: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, target, mask = batch
        pred = model(x).squeeze(-1)
        loss = (mask * (pred - target) ** 2).sum() / mask.sum()  # no labelled entry: 0 / 0
        self.calls += 1
        self._log(loss)
        return loss


def _loss_object() -> StateProgram:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    g = _gen(25)
    batches = []
    for s in range(STEPS):
        mask = torch.zeros(10) if s == FAIL_STEP else (torch.rand(10, generator=g) < 0.7).float()
        if s != FAIL_STEP:
            mask[0] = 1.0
        batches.append((torch.randn(10, 6, generator=g), torch.randn(10, generator=g), mask))
    loss = MaskedRegressionLoss()
    METRIC_LOG.clear()
    return StateProgram(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, loss,
                   lambda: (loss.calls, list(METRIC_LOG)))


# ---------------------------------------------------------------------- 5. must not fire
def _healthy() -> StateProgram:
    torch.manual_seed(0)
    np.random.seed(5)
    random.seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    g = _gen(26)
    pool = [torch.randn(8, 8, generator=g) for _ in range(STEPS + 2)]
    pulled = [0]

    def stream() -> Iterator[torch.Tensor]:
        for xu in pool:
            pulled[0] += 1
            yield xu

    unlabeled = stream()

    def loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, y = batch
        lam = float(np.random.beta(1.0, 1.0))
        if random.random() < 0.5:
            x = x.flip(0)
        xu = next(unlabeled)
        return F.cross_entropy(m(lam * x + (1 - lam) * xu), y)

    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(STEPS)]
    return StateProgram(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, loss,
                   lambda: (_rng_state(), pulled[0]))


def plain_bce_function(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    p = torch.sigmoid(model(x)).squeeze(-1)
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # p saturates to exactly 1: log(0)


def _plain_function() -> StateProgram:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    g = _gen(27)
    batches = []
    for s in range(STEPS):
        x = torch.randn(10, 4, generator=g)
        if s == FAIL_STEP:
            x[1] = 1e6
        batches.append((x, (torch.rand(10, generator=g) < 0.5).float()))
    return StateProgram(model, torch.optim.SGD(model.parameters(), lr=0.01), batches, plain_bce_function,
                   lambda: None)


STATE_CASES: dict[str, tuple[Callable[[], StateProgram], StateWant | None]] = {
    "numpy_mixup_softmax_underflow": (_numpy_mixup, StateWant(
        "nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive")),
    "python_random_crop_blank_window": (_random_crop, StateWant(
        "nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive", absent="replayable_call_finite")),
    "fixmatch_generator_blank_spectrum": (_fixmatch("generator"), StateWant(
        "nonfinite_input", "forward", "aten.div.Tensor", None, "zero_variance_norm", detail="rerun_skipped")),
    "fixmatch_list_iterator_blank_spectrum": (_fixmatch("list"), StateWant(
        "nonfinite_input", "forward", "aten.div.Tensor", None, "zero_variance_norm", absent="rerun_skipped")),
    "loss_object_global_log_no_labelled_entry": (_loss_object, StateWant(
        "nonfinite_loss", "forward", "aten.div.Tensor", None, "div_by_zero")),
    "plain_function_bce_saturated_no_state": (_plain_function, StateWant(
        "nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive", absent="rerun_skipped")),
    "healthy_rng_and_generator": (_healthy, None),
}


# ------------------------------------------------------------------------ plain torch, nantrace off
class _FirstNonFiniteOp(TorchDispatchMode):
    """The first op whose floating inputs were finite and whose output was not; whether the model was running."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.depth = 0
        self.found: tuple[str, bool] | None = None
        model.register_forward_pre_hook(lambda *a: self._enter())
        model.register_forward_hook(lambda *a: self._leave())

    def _enter(self) -> None:
        self.depth += 1

    def _leave(self) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if all(bool(torch.isfinite(t).all()) for t in ins) and any(not bool(torch.isfinite(t).all()) for t in outs):
                self.found = (str(func), self.depth > 0)
        return out


def plain_state_run(p: StateProgram, skip_bad: bool = True) -> tuple[int | None, tuple[str, bool] | None]:
    """The program without nantrace; a non-finite loss's update is skipped (on_anomaly="skip"). Returns the first
    step whose loss was non-finite and the first op that made a non-finite value from finite inputs there."""
    first: int | None = None
    origin = None
    for step, batch in enumerate(p.batches):
        p.optimizer.zero_grad()
        oracle = _FirstNonFiniteOp(p.model) if first is None else None
        if oracle is not None:
            with oracle:
                loss = p.loss(p.model, batch, step)
        else:
            loss = p.loss(p.model, batch, step)
        if not bool(torch.isfinite(loss)):
            if first is None:
                first, origin = step, oracle.found if oracle is not None else None
            if skip_bad:
                continue
        loss.backward()
        p.optimizer.step()
    return first, origin


def train_state(p: StateProgram, replayable: bool = True) -> list[Any]:
    guard = nantrace.watch(p.model, p.optimizer, on_anomaly="skip",
                           config=nantrace.Config(outputs={"print_incidents": False}))
    fn = guard.replayable(p.loss) if replayable else p.loss
    try:
        for step, batch in enumerate(p.batches):
            p.optimizer.zero_grad()
            loss = fn(p.model, batch, step)
            loss.backward()
            p.optimizer.step()
    finally:
        guard.close()
    return list(guard.incidents)


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("name", [n for n, (_, w) in STATE_CASES.items() if w is not None])
def test_state_construction(name: str) -> None:
    """Checked without nantrace: the loss goes non-finite at FAIL_STEP, made by the expected op, in or outside the model."""
    build, want = STATE_CASES[name]
    assert want is not None
    step, origin = plain_state_run(build())
    assert step == FAIL_STEP
    assert origin == (want.op, want.module is not None), origin
    if name == "python_random_crop_blank_window":  # another draw would crop a window that is not blank
        starts = _crop_starts(CROP_SEED)
        assert starts[FAIL_STEP + 1] != starts[FAIL_STEP] and starts[FAIL_STEP] not in starts[:FAIL_STEP]


@pytest.mark.parametrize("name", list(STATE_CASES))
def test_diagnosis_and_state_as_plain_run(name: str) -> None:
    build, want = STATE_CASES[name]
    # the first watch() of a process imports rich, whose import draws from Python's random (rich/style.py:
    # getrandbits(24)); not the re-run's doing: done before the programs seed their streams
    nantrace.watch(nn.Linear(1, 1), config=nantrace.Config(outputs={"print_incidents": False})).close()
    reference = build()
    plain_state_run(reference)
    expected = reference.state()
    weights = [p.detach().clone() for p in reference.model.parameters()]
    program = build()
    incidents = train_state(program)
    if want is None:
        assert not incidents, [(i.kind, i.cause, i.summary) for i in incidents]
    else:
        assert incidents, "no incident"
        i = incidents[0]
        got = (i.step, i.kind, i.phase, i.op, i.module, i.cause)
        assert got == (FAIL_STEP, want.kind, want.phase, want.op, want.module, want.cause), (got, i.summary, i.details)
        if want.detail is not None:
            assert want.detail in i.details, i.details
        if want.absent is not None:
            assert want.absent not in i.details, i.details
        assert "python_state_not_kept" not in i.details, i.details
    assert _same_state(program.state(), expected), (program.state(), expected)
    assert all(torch.equal(a, b) for a, b in zip(weights, program.model.parameters())), "the weights differ"


def test_generator_skip_says_why() -> None:
    program = _fixmatch("generator")()
    incidents = train_state(program)
    assert incidents[0].details["rerun_skipped"] == "the call can advance an iterator it reaches: generator"


# ------------------------------------------------------------------------ the snapshot itself
HELPER_LOG: list[int] = []


class _Base:
    def note(self) -> None:
        HELPER_LOG.append(1)


class _Callable(_Base):
    def __call__(self) -> None:
        self.note()


def test_snapshot_follows_the_class_code_of_a_callable_object() -> None:
    HELPER_LOG.clear()
    obj = _Callable()
    snap = snapshot_of(obj)
    obj()
    obj()
    snap.restore()
    assert HELPER_LOG == [] and not snap.not_kept


def test_snapshot_puts_back_seekable_iterators_and_names_the_others() -> None:
    items = list(range(5))
    it, rit, ranged = iter(items), reversed(items), iter(range(5))
    next(it)

    def gen() -> Iterator[int]:
        yield 1

    g = gen()
    snap = snapshot_of(lambda: (it, rit, ranged), it, rit, ranged)
    for x in (it, rit, ranged):
        next(x)
    snap.restore()
    assert list(it) == [1, 2, 3, 4] and list(rit) == [4, 3, 2, 1, 0] and list(ranged) == [0, 1, 2, 3, 4]
    assert snapshot_of(lambda: g, g).unrestorable == ["generator"]
    short = iter([1])
    snap = snapshot_of(lambda: short, short)
    next(short)
    with pytest.raises(StopIteration):
        next(short)
    snap.restore()
    assert snap.not_kept and "exhausted" in snap.not_kept[0]


def test_host_rng_state_round_trip_and_cost() -> None:
    state = RngState.current(host=True)
    assert state.python is not None and state.numpy is not None  # numpy is imported here
    a = (random.random(), float(np.random.rand()), float(torch.rand(())))
    state.restore()
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == a
    assert RngState.current().python is None  # a forward's record stays torch-only
    t0 = time.perf_counter()
    for _ in range(200):
        random.getstate()
        sys.modules["numpy"].random.get_state()
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 1e-3, per_call  # a few microseconds in practice
