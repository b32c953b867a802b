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
import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from heldout_harness import Judge, Program, run_step, sgd, steps, train
from nantrace.localisation import python_state
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
