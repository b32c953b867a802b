"""Step post-hooks of the user's: code torch runs inside ``optimizer.step()`` AFTER the update (the optimizer's own
post-hooks, then torch's global ``register_optimizer_step_post_hook`` ones). A hook that writes the parameters must
not let a non-finite value land silently (nantrace.optimizer_step, diagnosis/update_replay.py).

Patterns shaped like real programs, each in both modes (zero-intrusive, ``guard.replayable``):

- TransE (Bordes et al. 2013) whose step post-hook renormalises the entity rows of the batch to unit length, as
  efficient implementations do (only the rows the batch touched), registered AFTER ``watch()``. The last batch of
  the epoch (step FAIL) is padded to the batch size with the ``<pad>`` entity (``padding_idx=0``, a zero row); the
  loss masks the padded triples out, but the hook normalises every row of the batch: 0 / 0 at ``aten.div.Tensor``,
  a row over its own norm (``zero_variance_norm``), phase ``optimizer``, module ``entity``;
- a WGAN critic (RMSprop, as in Arjovsky et al.) whose weight clip is written as a post-hook that rescales each row
  of a weight matrix by its max-abs (``p.div_(scale).mul_(scale.clamp(max=c))``), registered BEFORE ``watch()``.
  At step FAIL a structured pruning (GAN compression) removes the weakest hidden units by zeroing their incoming
  weights and bias: their ReLU gets 0 and its derivative at 0 is 0, so the rows stay 0 through RMSprop's update and
  the clip divides them by a max-abs of 0: ``aten.div_.Tensor``, ``zero_variance_norm``, module ``hidden``; every
  later step does the same (each is blocked and undone);
- the same two hooks registered with torch's GLOBAL step post-hook (before or after ``watch()``): torch runs them
  after every optimizer's own post-hooks, so the guard checks the update from a global post-hook kept last;
- quiet: an EMA-of-weights post-hook (writes only its own copy), instance and global, and the TransE renormalisation
  with the norm clamped (writes the parameters every step): no incident, and the run trains bit for bit as without
  nantrace (the EMA copy too).

Each construction is checked first with plain torch (``test_construction``): the first step whose parameters are
non-finite after ``step()``, the first op that made a non-finite value from finite inputs, its line in this file,
and the module holding the first parameter (in the optimizer's order) that went non-finite. Then nantrace must
report exactly (step, kind, phase, op, module, cause, action, source line), leave the weights of every blocked step as
they were, and end with the weights and optimizer state of a plain run that skipped those steps. A healthy step
costs no host read more without a user post-hook, and at most one more with one.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import optimizer as optimizer_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from nantrace.testing.host_reads import HostReadCounter
from origin_markers import origin_line, points_at

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
    hook: Callable[..., Any]
    hook_after_watch: bool = False
    hook_global: bool = False
    """Registered with torch's global ``register_optimizer_step_post_hook`` (every optimizer's step runs it)."""
    before_step: Callable[[int], None] | None = None
    """Run by the loop before each step (under ``no_grad``), also before a step a reference run skips."""
    extra: nn.Module | None = None
    """Another module the hook writes (an EMA copy): compared with the plain run's too."""

    def register(self) -> Any:
        if self.hook_global:
            return optimizer_module.register_optimizer_step_post_hook(self.hook)
        return self.optimizer.register_step_post_hook(self.hook)


def globally(build: Callable[[], Program], after_watch: bool) -> Callable[[], Program]:
    def program() -> Program:
        return dataclasses.replace(build(), hook_global=True, hook_after_watch=after_watch)
    return program


@dataclasses.dataclass
class Want:
    kind: str
    phase: str
    op: str
    module: str
    tag: str
    cause: str
    skipped: frozenset[int]
    """The steps a correct guard blocks (and undoes)."""
    step: int = FAIL
    action: str = "skipped"


# ======================================================================= A. TransE, batch rows renormalised
class TransE(nn.Module):
    def __init__(self, entities: int = 40, relations: int = 5, d: int = 12) -> None:
        super().__init__()
        self.entity = nn.Embedding(entities, d, padding_idx=0)
        self.relation = nn.Embedding(relations, d)

    def forward(self, h: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (self.entity(h) + self.relation(r) - self.entity(t)).norm(p=1, dim=-1)


def _transe(safe: bool = False) -> Program:
    torch.manual_seed(0)
    model = TransE()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    touched: dict[str, torch.Tensor] = {}

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        h, r, t, t_neg = b
        touched["rows"] = torch.cat([h, t, t_neg])
        keep = (h != 0).float()  # padded triples are masked out of the loss
        return (F.relu(1.0 + m(h, r, t) - m(h, r, t_neg)) * keep).sum() / keep.sum()

    def renormalise_batch_entities(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            w = model.entity.weight
            rows = touched["rows"]
            e = w[rows]
            n = e.norm(dim=1, keepdim=True)
            if safe:
                n = n.clamp_min(1e-12)
            w[rows] = e / n  # <origin:batch_rows>

    g = torch.Generator().manual_seed(7)
    batches = []
    for step in range(N_STEPS):
        h, t, t_neg = (torch.randint(1, 40, (16,), generator=g) for _ in range(3))
        r = torch.randint(0, 5, (16,), generator=g)
        if step == FAIL:  # the epoch's last batch: 10 triples, padded with <pad> (entity 0, relation 0)
            for x in (h, r, t, t_neg):
                x[10:] = 0
        batches.append((h, r, t, t_neg))
    return Program(model, opt, batches, loss, hook=renormalise_batch_entities, hook_after_watch=True)


# ======================================================================= B. WGAN critic, max-abs row clip
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def _wgan() -> Program:
    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.RMSprop(critic.parameters(), lr=5e-4)

    def clip_critic_rows(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.dim() < 2:
                        continue
                    scale = p.abs().amax(dim=1, keepdim=True)
                    p.div_(scale).mul_(scale.clamp(max=0.05))  # <origin:critic_clip>

    def prune(step: int) -> None:
        if step == FAIL:  # structured pruning: the 4 weakest hidden units are removed (incoming weights and bias 0)
            idx = critic.hidden.weight.norm(dim=1).argsort()[:4]
            critic.hidden.weight[idx] = 0.0
            critic.hidden.bias[idx] = 0.0

    g = torch.Generator().manual_seed(8)
    batches = [(1.0 + torch.randn(24, 8, generator=g), torch.randn(24, 8, generator=g)) for _ in range(N_STEPS)]
    return Program(critic, opt, batches, lambda m, b: m(b[1]).mean() - m(b[0]).mean(), hook=clip_critic_rows,
                   before_step=prune)


# ======================================================================= quiet: EMA of the weights
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


def _ema() -> Program:
    torch.manual_seed(0)
    model = Regressor()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def update_ema(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.99).add_(p, alpha=0.01)

    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(20, 6, generator=g), torch.randn(20, generator=g)) for _ in range(N_STEPS)]
    return Program(model, opt, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]), hook=update_ema, extra=ema)


CASES: dict[str, tuple[Callable[[], Program], Want]] = {
    "transe_batch_entity_renormalisation_post_hook_after_watch_padded_last_batch":
        (_transe, Want("nonfinite_param", "optimizer", "aten.div.Tensor", "entity", "batch_rows", "zero_variance_norm",
                       frozenset({FAIL}))),
    "wgan_critic_max_abs_row_clip_post_hook_before_watch_pruned_units":
        (_wgan, Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "hidden", "critic_clip", "zero_variance_norm",
                     frozenset(range(FAIL, N_STEPS)))),
    "transe_batch_entity_renormalisation_global_post_hook_after_watch":
        (globally(_transe, True), Want("nonfinite_param", "optimizer", "aten.div.Tensor", "entity", "batch_rows",
                                       "zero_variance_norm", frozenset({FAIL}))),
    "wgan_critic_max_abs_row_clip_global_post_hook_before_watch":
        (globally(_wgan, False), Want("nonfinite_param", "optimizer", "aten.div_.Tensor", "hidden", "critic_clip",
                                      "zero_variance_norm", frozenset(range(FAIL, N_STEPS)))),
}
QUIET: dict[str, Callable[[], Program]] = {
    "ema_of_weights_post_hook": _ema,
    "ema_of_weights_global_post_hook_after_watch": globally(_ema, True),
    "transe_renormalisation_with_clamped_norm": lambda: _transe(safe=True),
}


# ======================================================================= the loop, with and without nantrace
def state_of(program: Program) -> dict[str, Any]:
    out = {"model": copy.deepcopy(program.model.state_dict()),
           "optimizer": copy.deepcopy(program.optimizer.state_dict())}
    if program.extra is not None:
        out["extra"] = copy.deepcopy(program.extra.state_dict())
    return out


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(torch.nan_to_num(a, 7.0),
                                                                                    torch.nan_to_num(b, 7.0))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def train(program: Program, mode: str | None, *, skip: frozenset[int] = frozenset()
          ) -> tuple[Any, dict[int, bool], set[int], dict[str, Any]]:
    """The loop (``mode=None``: without nantrace; steps in ``skip`` are not run). Returns the guard, whether the
    parameters were unchanged by each step the guard skipped, the steps it skipped, and the final state."""
    model, opt = program.model, program.optimizer
    handles = []
    if not program.hook_after_watch:
        handles.append(program.register())
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) \
        if mode is not None else None
    if program.hook_after_watch:
        handles.append(program.register())
    loss_fn = guard.replayable(program.loss) if guard is not None and mode == "replayable" else program.loss
    unchanged: dict[int, bool] = {}
    skipped: set[int] = set()
    try:
        for step, batch in enumerate(program.batches):
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(step)
            if step in skip:
                continue
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
            if guard is not None and guard.last_step is not None and guard.last_step["skipped"]:
                skipped.add(step)
                unchanged[step] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        if guard is not None:
            guard.close()
        for handle in handles:
            handle.remove()
    return guard, unchanged, skipped, state_of(program)


# ======================================================================= the construction, without nantrace
class Made(TorchDispatchMode):
    """Ops whose floating inputs were all finite and after which an output or an argument written in place holds a
    non-finite value: (step, op, line of this file that issued it)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.made: list[tuple[int, str, int | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        finite_in = all(bool(torch.isfinite(t).all()) for t in tensors)
        out = func(*args, **kwargs)
        if finite_in:
            after = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()] + tensors
            if not all(bool(torch.isfinite(t).all()) for t in after):
                name = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
                frame, line = sys._getframe(1), None
                while frame is not None:
                    if frame.f_code.co_filename == __file__:
                        line = frame.f_lineno
                        break
                    frame = frame.f_back
                self.made.append((self.step, name, line))
        return out


def plain_failure(program: Program) -> dict[str, Any]:
    """Without nantrace: the first step whose loss, gradients or parameters after ``step()`` are non-finite, the
    ops that made a non-finite value at that step, and the module of the first non-finite parameter."""
    model, opt = program.model, program.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    handle = program.register()
    rec = Made()
    try:
        with rec:
            for step, batch in enumerate(program.batches):
                rec.step = step
                if program.before_step is not None:
                    with torch.no_grad():
                        program.before_step(step)
                opt.zero_grad()
                loss = program.loss(model, batch)
                loss.backward()
                if not bool(torch.isfinite(loss)) or not all(bool(torch.isfinite(p.grad).all())
                                                             for p in model.parameters() if p.grad is not None):
                    return {"step": step, "stage": "loss or grads"}
                opt.step()
                params = [p for g in opt.param_groups for p in g["params"]]
                bad = [names[id(p)] for p in params if not bool(torch.isfinite(p).all())]
                if bad:
                    return {"step": step, "stage": "params", "module": bad[0].rpartition(".")[0],
                            "made": [m[1:] for m in rec.made if m[0] == step],
                            "earlier": [m for m in rec.made if m[0] < step]}
    finally:
        handle.remove()
    return {"step": None}


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    build, want = CASES[name]
    got = plain_failure(build())
    assert (got["step"], got["stage"]) == (want.step, "params"), got
    assert not got["earlier"], got["earlier"][:3]
    assert got["made"][0] == (want.op, origin_line(__file__, want.tag)), got["made"][:4]
    assert got["module"] == want.module


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_construction(name: str) -> None:
    assert plain_failure(QUIET[name]())["step"] is None


# ======================================================================= nantrace
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis_and_weights(name: str, mode: str) -> None:
    build, want = CASES[name]
    guard, unchanged, skipped, state = train(build(), mode)
    blocking = [i for i in guard.incidents if i.action != "logged"]
    assert blocking, "no incident"
    first = blocking[0]
    got = (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action)
    assert got == (want.step, want.kind, want.phase, want.op, want.module, want.cause, want.action), \
        [(i.step, i.kind, i.phase, i.op, i.module, i.cause, i.action, i.source) for i in guard.incidents]
    assert points_at(first.source, __file__, want.tag), first.source
    assert "post-hook" in first.summary and first.details["checked_because"], first.summary
    assert skipped == want.skipped
    assert unchanged == {s: True for s in want.skipped}  # each blocked step left the weights as they were
    _, _, _, reference = train(build(), None, skip=frozenset(skipped))
    assert same_state(state, reference)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_train_as_plain(name: str, mode: str) -> None:
    guard, _, skipped, state = train(QUIET[name](), mode)
    assert not guard.incidents and not skipped, [(i.step, i.kind, i.cause, i.action) for i in guard.incidents]
    _, _, _, reference = train(QUIET[name](), None)
    assert same_state(state, reference)


def test_host_reads_of_a_healthy_step() -> None:
    """No user post-hook: the guard's one read per step, nothing more; with one (an EMA): at most one more (the
    copied update's check)."""
    counts: dict[tuple[bool, bool], int] = {}
    for hooked in (False, True):
        for watched in (False, True):
            program = _ema()
            model, opt = program.model, program.optimizer
            handle = program.register() if hooked else None
            guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) \
                if watched else None
            try:
                for step, (x, y) in enumerate(program.batches[:3]):  # the third step: past the first-step set-up
                    with HostReadCounter() as reads:
                        opt.zero_grad()
                        F.mse_loss(model(x), y).backward()
                        opt.step()
            finally:
                if guard is not None:
                    guard.close()
                if handle is not None:
                    handle.remove()
            counts[(hooked, watched)] = reads.count
    without = counts[(False, True)] - counts[(False, False)]
    assert without == 1, counts  # the step's one read (tests/test_host_reads.py)
    assert counts[(True, True)] - counts[(True, False)] <= without + 1, counts


def test_hooks_are_left_as_found() -> None:
    """``close()`` leaves the optimizer's post-hooks and torch's global ones as it found them (the guard's global
    post-hook, registered at the first step that met a user's global post-hook, is removed with it)."""
    before = dict(optimizer_module._global_optimizer_post_hooks)
    program = globally(_transe, True)()
    guard, _, _, _ = train(program, "zero_intrusive")
    assert guard.closed and guard._global_post_handle is not None
    assert dict(optimizer_module._global_optimizer_post_hooks) == before
    assert not program.optimizer._optimizer_step_post_hooks and not program.optimizer._optimizer_step_pre_hooks
