"""Code that runs inside ``optimizer.step()``: the user's step pre-hooks, and a closure the optimizer evaluates
several times per step (L-BFGS). Neither may let a non-finite update land (nantrace.optimizer_step).

Patterns shaped like real programs, each in both modes (zero-intrusive, ``guard.replayable``):

- step pre-hooks: a recommender that row-normalises its item-embedding gradient (registered BEFORE ``watch()``)
  and meets a batch without some items (0 / 0); gradient centralisation with the norm kept, registered AFTER
  ``watch()`` (as a trainer's set-up does), on a batch of black frames (the first layer's gradient and its centred
  gradient are 0: their norms divide, 0 / 0); quiet: weight standardisation with an eps (a hook
  that writes the parameters every step);
- L-BFGS: a physics-informed decay fit whose relative data error divides by a sensor reading of 0; a logistic
  regression with a hand-written BCE whose sigmoid saturates to 1 (log(0)); a marginal-likelihood fit whose
  noise variance has no positivity link, where the closure's first evaluation is finite and a LATER one (the
  iteration overshoots the variance below 0) is log(negative); quiet: the same logistic regression on clean data
  under strong-Wolfe line search (trains bit for bit as without nantrace).

Each construction is checked first with plain torch (``test_construction``): the step and stage where it goes
non-finite, the closure evaluation, and the first op that made a non-finite value from finite inputs. Then
nantrace must report exactly (step, kind, phase, op, module, cause, action, source line), leave the weights of the
blocked step as they were, and end with the weights (and optimizer state) of a plain run that skipped that step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from nantrace.testing.host_reads import HostReadCounter
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL = 3
N_STEPS = 5
MODES = ("zero_intrusive", "replayable")


@dataclasses.dataclass
class Program:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    closure: bool = False
    """Stepped as ``optimizer.step(closure)``."""
    hook: Callable[..., Any] | None = None
    hook_after_watch: bool = False
    """The step pre-hook is registered after ``nantrace.watch()`` (else before it)."""
    hook_global: bool = False
    """The hook is registered for every optimizer with torch's global ``register_optimizer_step_pre_hook`` (as a
    tooling library installs it): torch runs global hooks before the optimizer's own."""

    def register(self) -> Any:
        if self.hook_global:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            return register_optimizer_step_pre_hook(self.hook)
        return self.optimizer.register_step_pre_hook(self.hook)


def globally(build: Callable[[], Program], after_watch: bool) -> Callable[[], Program]:
    """``build``'s program with its step pre-hook registered as a global hook, before or after ``watch()``."""
    def program() -> Program:
        return dataclasses.replace(build(), hook_global=True, hook_after_watch=after_watch)
    return program


@dataclasses.dataclass
class Want:
    kind: str
    phase: str
    op: str
    module: str | None
    tag: str
    cause: str
    step: int = FAIL
    action: str = "skipped"


# ======================================================================= step pre-hooks
# A. Two-tower recommender: the item-embedding gradient is row-normalised in a step pre-hook ("popular items must
#    not dominate"), registered before the guard. The batch of step FAIL holds items 0..3 only: rows 4, 5 of the
#    gradient are 0, the hook divides 0 by a norm of 0, and SGD writes NaN into those rows of ``items``.
class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 8))
        self.items = nn.Embedding(6, 8)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.user(users) * self.items(items)).sum(-1)


def _recommender() -> Program:
    torch.manual_seed(0)
    model = TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def normalise_item_rows(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        g = model.items.weight.grad
        if g is not None:
            g.div_(g.norm(dim=1, keepdim=True))  # <origin:item_rows>

    g = torch.Generator().manual_seed(41)
    batches = []
    for step in range(N_STEPS):
        items = torch.randint(0, 4 if step == FAIL else 6, (32,), generator=g)
        if step != FAIL:
            items[:6] = torch.arange(6)
        batches.append((torch.randn(32, 10, generator=g), items, torch.rand(32, generator=g)))
    return Program(model, opt, batches, lambda m, b: F.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2]),
                   hook=normalise_item_rows)


# B. Gradient centralisation (GC) of every weight matrix, the gradient's norm kept, in a pre-hook a trainer's set-up
#    installs after the guard was made. A frame classifier on flattened pixels; the batch of step FAIL holds black
#    frames (the camera was off): the first layer's weight gradient is 0, so is its centred gradient, and
#    ``g.norm() / gc.norm()`` is 0 / 0 = NaN, which the hook writes into the gradient; Adam writes NaN.
class FrameClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 24)
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def _centralised() -> Program:
    torch.manual_seed(0)
    model = FrameClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def centralise(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dim() < 2:
                    continue
                g = p.grad
                gc = g - g.mean(dim=1, keepdim=True)
                scale = g.norm() / gc.norm()  # <origin:gc_scale>
                g.copy_(gc * scale)

    g = torch.Generator().manual_seed(42)
    batches = []
    for step in range(N_STEPS):
        x = torch.rand(20, 16, generator=g)
        if step == FAIL:
            x = torch.zeros(20, 16)  # black frames: the camera was off
        batches.append((x, torch.randint(0, 3, (20,), generator=g)))
    return Program(model, opt, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), hook=centralise,
                   hook_after_watch=True)


# Quiet: weight standardisation of every weight matrix before each update (a hook that writes the parameters).
def _standardised() -> Program:
    torch.manual_seed(0)
    model = FrameClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def standardise(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.dim() >= 2:
                        p.sub_(p.mean(dim=1, keepdim=True)).div_(p.std(dim=1, keepdim=True) + 1e-5)

    g = torch.Generator().manual_seed(43)
    batches = [(torch.rand(20, 16, generator=g), torch.randint(0, 3, (20,), generator=g)) for _ in range(N_STEPS)]
    return Program(model, opt, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), hook=standardise)


# ======================================================================= L-BFGS and its closure
# D. A physics-informed fit of a decaying signal u(t) (du/dt = -k u, the residual by autograd) to sensor
#    readings, with a relative data error. A reading of step FAIL decayed below the sensor's resolution and was
#    stored as 0: (u - 0) / 0 = inf at the closure's first evaluation.
class DecayNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.net(t)


def pinn_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    t_col, t_obs, y_obs = batch
    t_col = t_col.clone().requires_grad_(True)
    u = model(t_col)
    du = torch.autograd.grad(u.sum(), t_col, create_graph=True)[0]
    physics = (du + 0.7 * u).pow(2).mean()
    rel = (model(t_obs).squeeze(-1) - y_obs) / y_obs  # <origin:pinn_rel>
    return physics + rel.pow(2).mean()


def _pinn() -> Program:
    torch.manual_seed(0)
    model = DecayNet()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    g = torch.Generator().manual_seed(44)
    batches = []
    for step in range(N_STEPS):
        t_obs = 3.0 * torch.rand(12, 1, generator=g)
        y = torch.exp(-0.7 * t_obs.squeeze(-1)) * (1 + 0.01 * torch.randn(12, generator=g))
        if step == FAIL:
            y[5] = 0.0
        batches.append((torch.linspace(0, 3, 16).unsqueeze(-1), t_obs, y))
    return Program(model, opt, batches, pinn_loss, closure=True)


# E. Logistic regression fitted by L-BFGS with a hand-written binary cross-entropy. A record of step FAIL has a
#    feature glitch (x60 along the weights): sigmoid(z) rounds to 1, log(1 - p) = log(0) at the first evaluation.
def bce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    p = torch.sigmoid(model(x).squeeze(-1))
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # <origin:logreg_log>


def _logreg(glitch: bool, line_search: str | None = None) -> Program:
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=5, line_search_fn=line_search)
    g = torch.Generator().manual_seed(45)
    w = torch.randn(5, generator=g)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(40, 5, generator=g)
        y = (x @ w + 0.5 * torch.randn(40, generator=g) > 0).float()
        if glitch and step == FAIL:
            x[7] = 60.0 * w.sign()
            y[7] = 1.0
        batches.append((x, y))
    return Program(model, opt, batches, bce, closure=True)


# F. A regression with a learned noise variance (the marginal likelihood's noise term) written without a
#    positivity link, fitted by L-BFGS. The batch of step FAIL is far less noisy: the closure's first evaluation is
#    finite, the iteration then steps the variance below 0 and a later evaluation takes log(negative) in the
#    model's ``likelihood``.
class Likelihood(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noise = nn.Parameter(torch.tensor(1.0))

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return 0.5 * (r.pow(2) / self.noise + torch.log(self.noise)).mean()  # <origin:noise_log>


class NoisyRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(3, 1)
        self.likelihood = Likelihood()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.likelihood(y - self.mean(x).squeeze(-1))


def _noise_fit() -> Program:
    torch.manual_seed(0)
    model = NoisyRegression()
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=5)
    g = torch.Generator().manual_seed(100)
    w = torch.randn(3, generator=g)
    batches = []
    for step in range(N_STEPS):
        x = torch.randn(64, 3, generator=g)
        batches.append((x, x @ w + (0.01 if step == FAIL else 1.0) * torch.randn(64, generator=g)))
    return Program(model, opt, batches, lambda m, b: m(b[0], b[1]), closure=True)


CASES: dict[str, tuple[Callable[[], Program], Want, int | None]] = {
    # name: (build, expected diagnosis, the closure evaluation that goes non-finite first)
    "recommender_item_row_normaliser_pre_hook_before_watch":
        (_recommender, Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "items", "item_rows", "div_by_zero"),
         None),
    "gradient_centralisation_pre_hook_after_watch_black_frames":
        (_centralised, Want("nonfinite_param", "optimizer", "aten.div.Tensor", "encoder", "gc_scale", "div_by_zero"),
         None),
    # the same hooks registered for every optimizer with torch's global step pre-hook (run before instance hooks)
    "recommender_item_row_normaliser_global_pre_hook_before_watch":
        (globally(_recommender, False), Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "items", "item_rows",
                                             "div_by_zero"), None),
    "gradient_centralisation_global_pre_hook_after_watch_black_frames":
        (globally(_centralised, True), Want("nonfinite_param", "optimizer", "aten.div.Tensor", "encoder", "gc_scale",
                                            "div_by_zero"), None),
    "lbfgs_pinn_relative_error_zero_reading":
        (_pinn, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "pinn_rel", "div_by_zero"), 1),
    "lbfgs_logistic_regression_saturated_sigmoid":
        (lambda: _logreg(True), Want("nonfinite_loss", "forward", "aten.log.default", None, "logreg_log",
                                     "log_nonpositive"), 1),
    "lbfgs_noise_variance_without_link_later_evaluation":
        (_noise_fit, Want("nonfinite_loss", "forward", "aten.log.default", "likelihood", "noise_log",
                          "log_nonpositive"), 3),
}
QUIET: dict[str, Callable[[], Program]] = {
    "weight_standardising_pre_hook_with_eps": _standardised,
    "lbfgs_logistic_regression_strong_wolfe_clean": lambda: _logreg(False, "strong_wolfe"),
    "weight_standardising_global_pre_hook_with_eps": globally(_standardised, False),
}


# ======================================================================= the loop, with and without nantrace
def state_of(program: Program) -> dict[str, Any]:
    return {"model": copy.deepcopy(program.model.state_dict()),
            "optimizer": copy.deepcopy(program.optimizer.state_dict())}


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(torch.nan_to_num(a, 7.0),
                                                                                    torch.nan_to_num(b, 7.0))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def train(program: Program, mode: str | None, *, skip: frozenset[int] = frozenset(),
          watch: Callable[[Program], Any] | None = None) -> tuple[Any, dict[int, bool], dict[str, Any]]:
    """The loop (``mode=None``: without nantrace; steps in ``skip`` are not run). Returns the guard, whether the
    parameters were unchanged by each step that reported a blocking incident, and the final state."""
    model, opt = program.model, program.optimizer
    handles = []
    if program.hook is not None and not program.hook_after_watch:
        handles.append(program.register())
    guard = None
    if mode is not None:
        guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    if program.hook is not None and program.hook_after_watch:
        handles.append(program.register())
    loss_fn = guard.replayable(program.loss) if mode == "replayable" else program.loss
    unchanged: dict[int, bool] = {}
    try:
        for step, batch in enumerate(program.batches):
            if step in skip:
                continue
            before = [p.detach().clone() for p in model.parameters()]
            seen = len(guard.incidents) if guard is not None else 0
            if program.closure:
                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = loss_fn(model, batch)
                    loss.backward()
                    return loss

                opt.step(closure)
            else:
                opt.zero_grad()
                loss_fn(model, batch).backward()
                opt.step()
            if guard is not None and any(i.action != "logged" for i in guard.incidents[seen:]):
                unchanged[step] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        if guard is not None:
            guard.close()
        for handle in handles:
            handle.remove()
    return guard, unchanged, state_of(program)


# ======================================================================= the construction, without nantrace
class Made(TorchDispatchMode):
    """Ops whose floating inputs were all finite and after which an output or an argument written in place holds
    a non-finite value: (step, evaluation, op)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: tuple[int, int] = (0, 0)
        self.made: list[tuple[int, int, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        finite_in = all(bool(torch.isfinite(t).all()) for t in tensors)
        out = func(*args, **kwargs)
        if finite_in:
            after = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()] + tensors
            if not all(bool(torch.isfinite(t).all()) for t in after):
                name = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
                self.made.append((*self.where, name))
        return out


def _finite(tensors: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def plain_failure(program: Program) -> dict[str, Any]:
    """Without nantrace: the first step whose loss (any closure evaluation), gradients at the entry of step() or
    parameters after it are non-finite, the evaluation, and the ops that made a non-finite value at that step."""
    model, opt = program.model, program.optimizer
    handle = program.register() if program.hook is not None else None
    rec = Made()
    try:
        return _plain_failure(program, model, opt, rec)
    finally:
        if handle is not None:
            handle.remove()


def _plain_failure(program: Program, model: nn.Module, opt: torch.optim.Optimizer, rec: "Made") -> dict[str, Any]:
    with rec:
        for step, batch in enumerate(program.batches):
            found: dict[str, Any] = {}
            if program.closure:
                calls = [0]

                def closure() -> torch.Tensor:
                    calls[0] += 1
                    rec.where = (step, calls[0])
                    opt.zero_grad()
                    loss = program.loss(model, batch)
                    loss.backward()
                    if not math.isfinite(float(loss)) and "evaluation" not in found:
                        found["evaluation"] = calls[0]
                    return loss

                opt.step(closure)
                if found:
                    return {"step": step, "stage": "loss", **found, "ops": [o for s, _, o in rec.made if s == step],
                            "earlier": [m for m in rec.made if m[0] < step]}
            else:
                rec.where = (step, 0)
                opt.zero_grad()
                loss = program.loss(model, batch)
                loss.backward()
                if not math.isfinite(float(loss)) or not _finite(p.grad for p in model.parameters()):
                    return {"step": step, "stage": "loss or grads"}
                opt.step()
            if not _finite(model.parameters()):
                return {"step": step, "stage": "params", "ops": [o for s, _, o in rec.made if s == step],
                        "earlier": [m for m in rec.made if m[0] < step]}
    return {"step": None}


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    build, want, evaluation = CASES[name]
    got = plain_failure(build())
    stage = "loss" if want.kind == "nonfinite_loss" else "params"
    assert (got["step"], got["stage"]) == (want.step, stage), got
    assert not got["earlier"], got["earlier"][:3]
    assert got.get("evaluation") == evaluation, got
    assert got["ops"][0] == want.op, got["ops"][:4]


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_construction(name: str) -> None:
    assert plain_failure(QUIET[name]())["step"] is None


# ======================================================================= nantrace
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis_and_weights(name: str, mode: str) -> None:
    build, want, _ = CASES[name]
    guard, unchanged, state = train(build(), mode)
    blocking = [i for i in guard.incidents if i.action != "logged"]
    assert blocking, "no incident"
    first = blocking[0]
    got = (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action)
    assert got == (want.step, want.kind, want.phase, want.op, want.module, want.cause, want.action), \
        [(i.step, i.kind, i.phase, i.op, i.module, i.cause, i.action, i.source) for i in guard.incidents]
    assert points_at(first.source, __file__, want.tag), first.source
    assert [i.step for i in blocking] == [want.step], [(i.step, i.kind) for i in blocking]
    assert unchanged == {want.step: True}
    _, _, reference = train(build(), None, skip=frozenset({want.step}))
    assert same_state(state, reference)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_train_as_plain(name: str, mode: str) -> None:
    guard, _, state = train(QUIET[name](), mode)
    assert not guard.incidents, [(i.step, i.kind, i.cause, i.action) for i in guard.incidents]
    _, _, reference = train(QUIET[name](), None)
    assert same_state(state, reference)


def test_lbfgs_host_reads_are_bounded() -> None:
    """A healthy L-BFGS step reads the host once for its check (first evaluation), once per later evaluation
    of the closure and once after the update (its copy check): besides L-BFGS' own ``float(loss)`` per
    evaluation and its own convergence tests."""
    counts = {}
    for watched in (False, True):
        program = _logreg(False, "strong_wolfe")
        model, opt = program.model, program.optimizer
        guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) \
            if watched else None
        evaluations = []
        try:
            x, y = program.batches[0]
            for _ in range(2):  # the second step: past nantrace's first-step set-up
                evaluations.clear()

                def closure() -> torch.Tensor:
                    evaluations.append(1)
                    opt.zero_grad()
                    loss = bce(model, (x, y))
                    loss.backward()
                    return loss

                with HostReadCounter() as reads:
                    opt.step(closure)
        finally:
            if guard is not None:
                guard.close()
        counts[watched] = (reads.count, len(evaluations))
    (plain, n_plain), (watched_reads, n_watched) = counts[False], counts[True]
    assert n_plain == n_watched > 1
    assert watched_reads - plain <= 2 + (n_watched - 1), (plain, watched_reads, n_watched)


def test_global_hooks_are_left_as_found_and_a_guard_opened_inside_the_global_chain_registers_later() -> None:
    """The guard's global hook is removed by ``close()``; under ``nantrace run``'s pairing at the first step (a
    guard opened from inside torch's global hook chain, which must not be changed while it runs) the guard
    registers it at its own instance hook, and a user's global hook is checked as the optimizer's code from the
    next step on."""
    from torch.optim import optimizer as optimizer_module

    from nantrace.autowatch import AutoWatch

    before = dict(optimizer_module._global_optimizer_pre_hooks)
    program = globally(_recommender, False)()
    handle = program.register()
    try:
        with AutoWatch(config=nantrace.Config(outputs={"print_incidents": False})) as auto:
            model = program.model
            # the loss's own temperature is stepped too: a partial owner, so AutoWatch pairs at the first step
            temperature = nn.Parameter(torch.ones(()))
            opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.05, momentum=0.9)
            for batch in program.batches:
                opt.zero_grad()
                F.binary_cross_entropy_with_logits(model(batch[0], batch[1]) * temperature, batch[2]).backward()
                opt.step()
            [guard] = auto.guards
            assert guard.optimizer is opt and guard._global_handle is not None  # registered at its instance hook
        blocking = [i for i in auto.incidents if i.action != "logged"]
        assert [(i.step, i.kind, i.phase, i.op, i.module, i.cause) for i in blocking] == [
            (FAIL, "nonfinite_param", "optimizer", "aten.div_.Tensor", "items", "div_by_zero")]
        assert guard.closed
    finally:
        handle.remove()
    assert dict(optimizer_module._global_optimizer_pre_hooks) == before


def test_a_step_ended_at_a_later_evaluation_returns_the_first_evaluations_loss() -> None:
    """torch's L-BFGS returns its first evaluation's loss from ``step(closure)``: a step the guard ends at a later,
    non-finite evaluation returns the same, so ``loss = opt.step(closure); loss.item()`` goes on training."""
    program = _noise_fit()
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    returned = []
    try:
        for batch in program.batches:
            first = []

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = program.loss(model, batch)
                loss.backward()
                if not first:
                    first.append(loss)
                return loss

            returned.append((opt.step(closure), first[0]))
    finally:
        guard.close()
    assert [i.step for i in guard.incidents if i.action != "logged"] == [FAIL]
    assert all(out is loss for out, loss in returned) and math.isfinite(returned[FAIL][0].item())
