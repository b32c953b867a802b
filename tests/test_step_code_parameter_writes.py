"""Parameters written non-finite by the step's own code after ``backward()`` and before ``optimizer.step()``.

SAM's ``first_step`` climbs to ``w + rho * g / ||g||`` before its second pass, a loop adds Gaussian weight noise
scaled to the batch, a max-norm constraint is projected by hand: code that writes the weights inside the step. A
parameter non-finite at the step's check used to be taken for one written between steps ("a checkpoint loaded
mid-run or an in-place write": ``nonfinite_param``, phase ``None``) and was never localised. The step's tapes hold
that code (the loss tape what ran after one ``backward()`` up to the next forward, the gradient tape what ran after the
last one): replayed on stand-ins of the parameters, the op whose non-finite value a write carried into a parameter is
the origin: its op and line, the normal cause rules (a zero divisor in a weight update is ``div_by_zero``, as in the
optimizer's own update; the parameter's own values divided by their std or norm, ``zero_variance_norm``), phase ``optimizer``, module the one holding the first parameter written non-finite, action
``raised`` (the weights are non-finite before ``step()``: skipping the update cannot repair them). A parameter made
non-finite between steps (a corrupted checkpoint loaded) keeps ``nonfinite_param`` even when the step's code writes
into it too (``gradient_code.localise_parameter_writes``). The replay starts from the copies the tapes keep of each
parameter before the first write into it after a ``backward()`` (``test_parameter_copies_in_healthy_steps``).

Every construction is checked with plain PyTorch first (``test_construction``): an op oracle written here
(``FirstBad``, a TorchDispatchMode) finds the step, the first op whose floating inputs were finite and whose output was
not, the line of this file that issued it, whether the parameters were finite after ``backward()`` and before the
step's code wrote them, and the first parameter (in ``named_parameters()`` order) left non-finite.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from origin_markers import origin_line, points_at

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

HERE = os.path.abspath(__file__)
STEPS = 5


@dataclasses.dataclass
class Program:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    after_backward: Callable[[nn.Module, torch.optim.Optimizer, Any, Callable], None] | None = None
    """The step's code between ``backward()`` and ``optimizer.step()`` (gets the loss function, for a second pass)."""
    between_steps: Callable[[nn.Module, int], None] | None = None
    """Code before the step's forward (a checkpoint loaded)."""


@dataclasses.dataclass
class Want:
    step: int
    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    cause: str


# ----------------------------------------------------------------------------- 1. SAM, a batch with no labelled target
class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as usually copied (no ``+ 1e-12`` in the scale)."""

    def __init__(self, params: Any, base: type, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base(self.param_groups, **kwargs)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grad_norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]
                                 if p.grad is not None]).norm()
        for group in self.param_groups:
            scale = group["rho"] / grad_norm  # <origin:sam_scale>
            for p in group["params"]:
                if p.grad is not None:
                    e_w = p.grad * scale
                    self.state[p]["e_w"] = e_w
                    p.add_(e_w)
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base.step()


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.trunk(x))


def masked_mse(model: nn.Module, batch: Any) -> torch.Tensor:
    """Multi-task regression: each sample labels some of the 3 targets; the mean runs over labelled ones."""
    x, y, labelled = batch
    return (((model(x) - y) ** 2) * labelled).sum() / labelled.sum().clamp(min=1)


def _sam_batches(bad: int) -> list[Any]:
    g = torch.Generator().manual_seed(31)
    out = []
    for step in range(STEPS):
        labelled = (torch.rand(16, 3, generator=g) < 0.4).float()
        labelled[0, step % 3] = 1.0
        if step == bad:
            labelled.zero_()  # this batch's samples carry no labelled target: loss 0, every gradient exactly 0
        out.append((torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g), labelled))
    return out


def sam_second_pass(model: nn.Module, opt: SAM, batch: Any, loss_fn: Callable) -> None:
    opt.first_step()
    loss_fn(model, batch).backward()  # the gradient at w + e(w)


def _sam() -> Program:
    torch.manual_seed(3)
    model = Regressor()
    return Program(model, SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05), _sam_batches(3), masked_mse,
                   after_backward=sam_second_pass)


# ----------------------------------------------------------------------------- 2. weight noise scaled to the batch
class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 24), nn.ReLU())
        self.head = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _noise_batches(bad: int) -> list[Any]:
    g = torch.Generator().manual_seed(32)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(12, 6, generator=g), torch.randn(12, generator=g)
        if step == bad:
            y = torch.full((12,), 0.5)  # a batch of one sample repeated: its targets are constant
        out.append((x, y))
    return out


def head_weight_noise(model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
    """Gaussian noise on the head's weights, in units of the batch's target spread (1e-3 of it)."""
    y = batch[1]
    with torch.no_grad():
        for p in model.head.parameters():
            p.add_(torch.randn_like(p) * 1e-3 / y.std())  # <origin:noise_scale>


def _noise() -> Program:
    torch.manual_seed(4)
    model = Classifier()
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), _noise_batches(2), mse,
                   after_backward=head_weight_noise)


# ----------------------------------------------------------------------------- 3. a max-norm projection by hand
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)  # the padding row is all zeros
        self.cls = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.cls(self.emb(tokens))


def tag_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, tags = batch
    return F.cross_entropy(model(tokens).reshape(-1, 4), tags.reshape(-1))


def max_norm_rows(model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
    """Each embedding row projected to norm <= 1: normalised, then scaled by its clamped norm."""
    with torch.no_grad():
        w = model.emb.weight
        norms = w.norm(dim=1, keepdim=True)
        w.div_(norms).mul_(norms.clamp(max=1.0))  # <origin:max_norm>


def _max_norm() -> Program:
    torch.manual_seed(5)
    model = Tagger()
    g = torch.Generator().manual_seed(33)
    batches = [(torch.randint(0, 20, (4, 7), generator=g), torch.randint(0, 4, (4, 7), generator=g))
               for _ in range(STEPS)]
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, tag_loss, after_backward=max_norm_rows)


# ----------------------------------------------------------------------------- 5. adversarial weight perturbation
def awp_second_pass(model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
    """Adversarial weight perturbation (as in AWP / layer-wise ASAM ports): each weight climbs gamma * ||w|| * g / ||g||,
    its own norm over its gradient's (no eps), the gradient is taken there, and the climb is undone before the update."""
    climbs = []
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                scale = 0.01 * p.norm() / p.grad.norm()  # <origin:awp_scale>
                e = p.grad * scale
                p.add_(e)
                climbs.append((p, e))
    opt.zero_grad()
    loss_fn(model, batch).backward()
    with torch.no_grad():
        for p, e in climbs:
            p.sub_(e)


def _awp() -> Program:
    torch.manual_seed(7)
    model = Regressor()
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), _sam_batches(2), masked_mse,
                   after_backward=awp_second_pass)


# ----------------------------------------------------------------------------- 6. class-incremental, rows standardised
def standardise_head_rows(model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
    """Each class's weight row kept zero-mean, unit-variance (a cosine-style classifier), written back after backward."""
    with torch.no_grad():
        w = model.head.weight
        w.copy_((w - w.mean(dim=1, keepdim=True)) / w.std(dim=1, keepdim=True))  # <origin:row_std>


class Incremental(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _incremental() -> Program:
    """Class-incremental learning: class 4 arrives at step 2, its classifier row initialised to zeros (a constant row)."""
    torch.manual_seed(8)
    model = Incremental()
    g = torch.Generator().manual_seed(34)
    batches = [(torch.randn(10, 6, generator=g), torch.randint(0, 4 if s < 2 else 5, (10,), generator=g))
               for s in range(STEPS)]

    def new_class(m: nn.Module, step: int) -> None:
        if step == 2:
            m.head.weight[4] = 0.0
            m.head.bias[4] = 0.0

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), batches,
                   lambda m, b: F.cross_entropy(m(b[0]), b[1]), after_backward=standardise_head_rows,
                   between_steps=new_class)


# ----------------------------------------------------------------------------- 4. negative: a corrupted checkpoint
def _corrupted_load(with_noise: bool, standardise: bool = False) -> Program:
    """A checkpoint saved after an earlier run's head went NaN, loaded between steps 2 and 3 (a resume by hand);
    with ``with_noise``, the step's code writes every parameter too (finite weight noise), without making them bad."""
    torch.manual_seed(6)
    model = Classifier()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved["head.weight"][0, 3] = float("nan")

    def load(m: nn.Module, step: int) -> None:
        if step == 3:
            m.load_state_dict(saved)

    def noise(m: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1e-4 * torch.randn_like(p))

    def standardise(m: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
        with torch.no_grad():  # the head's rows standardised in place (they read the parameter, NaN since the load)
            w = m.head.weight
            w.sub_(w.mean(dim=1, keepdim=True)).div_(w.std(dim=1, keepdim=True))

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), _noise_batches(-1), mse,
                   after_backward=standardise if standardise else noise if with_noise else None, between_steps=load)


CASES: dict[str, tuple[Callable[[], Program], Want]] = {
    "sam_first_step_no_labelled_target": (
        _sam, Want(3, "nonfinite_param", "optimizer", "aten.reciprocal.default", "trunk.0", "sam_scale", "div_by_zero")),
    "weight_noise_over_constant_target_std": (
        _noise, Want(2, "nonfinite_param", "optimizer", "aten.div.Tensor", "head", "noise_scale", "div_by_zero")),
    # the row divided by its own norm: a normalisation of constant (all-zero) data, as the same division in a forward
    "max_norm_projection_of_zero_padding_row": (
        _max_norm, Want(0, "nonfinite_param", "optimizer", "aten.div_.Tensor", "emb", "max_norm", "zero_variance_norm")),
    # the weight's own norm over its gradient's: the divisor is a gradient's norm, a zero divisor in a weight update
    "adversarial_weight_perturbation_no_labelled_target": (
        _awp, Want(2, "nonfinite_param", "optimizer", "aten.div.Tensor", "trunk.0", "awp_scale", "div_by_zero")),
    "class_incremental_zero_row_standardised_after_backward": (
        _incremental, Want(2, "nonfinite_param", "optimizer", "aten.div.Tensor", "head", "row_std",
                           "zero_variance_norm")),
    "corrupted_checkpoint_loaded_step_code_writes_weights": (
        lambda: _corrupted_load(True), Want(3, "nonfinite_param", None, None, "head", None, "nonfinite_param")),
    "corrupted_checkpoint_loaded_step_code_standardises_weights": (
        lambda: _corrupted_load(False, standardise=True),
        Want(3, "nonfinite_param", None, None, "head", None, "nonfinite_param")),
    "corrupted_checkpoint_loaded_plain_loop": (
        lambda: _corrupted_load(False), Want(3, "nonfinite_param", None, None, "head", None, "nonfinite_param")),
}

BLOCKED: dict[str, str] = {}


# ----------------------------------------------------------------------------- the plain-torch oracle
class FirstBad(TorchDispatchMode):
    """The first op whose floating inputs were all finite and whose output (or in-place argument) was not."""

    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[str, int | None] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        finite_in = all(bool(torch.isfinite(t).all()) for t in ins)
        out = func(*args, **kwargs)
        if self.first is None and finite_in:
            outs = [t for t in tree_leaves((out, args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if any(not bool(torch.isfinite(t).all()) for t in outs):
                lines = [f.lineno for f in traceback.extract_stack()
                         if os.path.abspath(f.filename) == HERE and f.name != "__torch_dispatch__"]
                self.first = (str(func), lines[-1] if lines else None)
        return out


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def plain_run(program: Program) -> dict[str, Any]:
    """The loop without nantrace: where the parameters first turn non-finite, and what made them so."""
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        if program.between_steps is not None:
            with torch.no_grad():
                program.between_steps(model, step)
        if not _finite(model):
            bad = next(n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all()))
            return {"step": step, "where": "between_steps", "param": bad, "first": None}
        opt.zero_grad()
        program.loss(model, batch).backward()
        finite_after_backward = _finite(model)
        oracle = FirstBad()
        if program.after_backward is not None:
            with oracle:
                program.after_backward(model, opt, batch, program.loss)
        if not _finite(model):
            bad = next(n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all()))
            return {"step": step, "where": "after_backward" if finite_after_backward else "backward", "param": bad,
                    "first": oracle.first}
        opt.step()
    return {"step": None}


def train(program: Program, *, replayable: bool) -> tuple[list[Any], BaseException | None, int | None]:
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    error, error_step = None, None
    try:
        for step, batch in enumerate(program.batches):
            if program.between_steps is not None:
                with torch.no_grad():
                    program.between_steps(model, step)
            try:
                opt.zero_grad()
                loss_fn(model, batch).backward()
                if program.after_backward is not None:
                    program.after_backward(model, opt, batch, loss_fn)
                opt.step()
            except Exception as exc:  # the script would have died here
                error, error_step = exc, step
                break
    finally:
        guard.close()
    return list(guard.incidents), error, error_step


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    """Plain torch: the parameters turn non-finite at the expected step; in the step's code after backward() (finite
    right after it), by the expected op at the marked line, first in the expected module; the negative cases, before
    the step's forward (the load)."""
    build, want = CASES[name]
    run = plain_run(build())
    assert run["step"] == want.step, run
    assert run["param"].rpartition(".")[0] == want.module, run
    if want.phase is None:
        assert run["where"] == "between_steps", run
        return
    assert run["where"] == "after_backward", run
    assert run["first"] == (want.op, origin_line(HERE, want.tag)), run


@pytest.mark.parametrize("mode", ["zero_intrusive", "replayable"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=BLOCKED[n]))
                                  if n in BLOCKED else n for n in CASES])
def test_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    incidents, error, error_step = train(build(), replayable=mode == "replayable")
    main = [i for i in incidents if i.action != "logged"]
    assert main, ("no incident", repr(error))
    inc = main[0]
    got = (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action)
    assert got == (want.step, want.kind, want.phase, want.op, want.module, want.cause, "raised"), (got, inc.summary,
                                                                                                  inc.details)
    if want.tag is None:  # the replay ran where the step's code writes the weights, and proved nothing
        assert inc.source is None and "parameters_written_by_step_code" not in inc.details, inc.source
        assert ("parameter_writes" in inc.details) == (build().after_backward is not None), inc.details
    else:
        assert points_at(inc.source, HERE, want.tag), inc.source
        assert inc.transient is False and "before optimizer.step()" in inc.summary, inc.summary
    assert isinstance(error, nantrace.NonFiniteError) and error_step == want.step, repr(error)


# ----------------------------------------------------------------------------- the copies the tapes keep
def _grads_halved(model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
    """Gradients averaged by hand over two workers: writes into ``p.grad`` only, never into a parameter."""
    for p in model.parameters():
        p.grad.mul_(0.5)


@pytest.mark.parametrize("after_backward,copied", [
    (standardise_head_rows, {"head.weight"}),  # written in place every step (read first): copied once per step
    (sam_second_pass, None),  # SAM writes every parameter after the first backward(): each copied by the loss tape
    (_grads_halved, set()),  # gradients written, no parameter: nothing copied, no lookup table built
])
def test_parameter_copies_in_healthy_steps(after_backward: Callable, copied: set[str] | None) -> None:
    """A healthy run whose step code writes after backward(): no incident, training as without nantrace; the tapes hold
    a copy of exactly the parameters the code wrote, from before its first write (the values at the step's start)."""
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(9)
        model = Incremental()
        opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05) if after_backward is sam_second_pass \
            else torch.optim.SGD(model.parameters(), lr=0.05)
        return model, opt

    g = torch.Generator().manual_seed(35)
    batches = [(torch.randn(10, 6, generator=g), torch.randint(0, 5, (10,), generator=g)) for _ in range(3)]
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    plain, opt = build()
    for batch in batches:
        opt.zero_grad()
        loss(plain, batch).backward()
        after_backward(plain, opt, batch, loss)
        opt.step()
    model, opt = build()
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        for i, batch in enumerate(batches):
            opt.zero_grad()
            loss(model, batch).backward()
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            after_backward(model, opt, batch, loss)
            tapes = [guard.recorder.tape, guard.recorder.gradient_tape]
            kept = {n: before for t in tapes for n, p in model.named_parameters()
                    for held, before in [t.before_write.get(id(p), (None, None))] if held is p}
            want = set(dict(model.named_parameters())) if copied is None else copied
            assert set(kept) == want, (i, set(kept))
            assert all(torch.equal(kept[n], start[n]) for n in kept)
            if copied == set():  # no parameter written: not even the table of their storages was built
                assert all(t._param_storage is None for t in tapes)
            if copied:  # written after the last backward(): both tapes saw the write, and hold one copy between them
                w = model.head.weight
                assert tapes[0].before_write[id(w)] is tapes[1].before_write[id(w)]
            opt.step()
    finally:
        guard.close()
    assert not guard.incidents, [i.summary for i in guard.incidents]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
