"""Non-finite gradients born in the user's own backward code, not in a built-in derivative.

A custom ``autograd.Function``'s hand-written backward, a tensor hook and a module's full
backward hook run ATen ops during backward that derive no forward op. They used to be linked
to whatever op last ran inside the Function's forward (under no_grad), or to nothing, and were
then called a ``gradient_explosion`` at the forward's line. The origin is the op itself, at the
line of the backward or hook that issued it, judged by the same rules as a forward op (0/0 is a
division by zero or a zero-norm normalisation, log(0) a log of a non-positive value); a value
born in the forward and consumed by a hand-written backward is the forward op's failure. The
control, a recurrent net whose gradient overflows through a long chain, stays a
``gradient_explosion``.
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
from nantrace.diagnosis.classify import classify
from nantrace.localisation.origin import Origin
from nantrace.localisation.tracer import InputRef, OpInfo, OpRecord, op_name

BAD_STEP = 3
STEPS = 5
CONFIG = nantrace.Config(outputs={"print_incidents": False})


# ------------------------------------------------------------------ a straight-through quantiser
class RowScaleSTE(torch.autograd.Function):
    """4-bit fake quantisation with each row's max-abs scale; the forward guards its division,
    the hand-written straight-through backward rescales by the raw scale (0 for an all-zero row)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True)
        ctx.save_for_backward(scale)
        return torch.round(x / scale.clamp(min=1e-8) * 7) / 7 * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (scale,) = ctx.saved_tensors
        return g / scale  # <origin:ste_div>


class Quant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RowScaleSTE.apply(x)


class QuantNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.quant = Quant()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.quant(self.fc1(x))))


def _padded_rows(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(6, 8, generator=g)
    if step == BAD_STEP:
        x[2] = 0.0  # a padding row reaches the quantiser
    return x, torch.randint(0, 3, (6,), generator=g)


# ---------------------------------------------------------------- a fused x·log(x) with its own backward
class XLogX(torch.autograd.Function):
    """x·log(x), 0 at 0 in the forward (xlogy); the hand-written derivative log(x) + 1 is not."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p)
        return torch.xlogy(p, p)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return g * (torch.log(p) + 1)  # <origin:xlogx_log>


class Entropy(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return -XLogX.apply(p).sum(-1)


class CandidateMixer(nn.Module):
    """Mixture weights over a padded set of candidates (softplus scores, padded slots masked to
    exactly 0), with an entropy bonus on the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(6, 4)
        self.entropy = Entropy()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        s = F.softplus(self.score(x)) * slots
        p = s / s.sum(-1, keepdim=True)
        return self.head(p) + 0.1 * self.entropy(p)[:, None]


def _mixer_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, slots, y = batch
    return F.cross_entropy(model(x, slots), y)


def _padded_candidates(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    slots = torch.ones(8, 4)
    if step == BAD_STEP:
        slots[:2, 3] = 0.0  # two samples with only three candidates: a padded slot
    return torch.randn(8, 6, generator=g), slots, torch.randint(0, 2, (8,), generator=g)


# ------------------------------------------------------------------ a gradient-reversal layer
class GradReverse(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by -lambda (DANN)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(lam)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (lam,) = ctx.saved_tensors
        return g.neg() * lam, None


class GRL(nn.Module):
    """Reversal strength on an exponential ramp, off during warm-up; gamma was meant for a ramp
    over a percentage, so at the first step after warm-up exp(gamma) overflows float32."""

    def __init__(self, gamma: float = 100.0) -> None:
        super().__init__()
        self.gamma = gamma
        self.register_buffer("progress", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = torch.exp(self.gamma * self.progress) - 1  # <origin:grl_lambda>
        return GradReverse.apply(x, lam)


class DANN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(6, 8)
        self.label = nn.Linear(8, 3)
        self.grl = GRL()
        self.domain = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.features(x))
        return torch.cat([self.label(h), self.domain(self.grl(h))], -1)


def _dann_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, d = batch
    out = model(x)
    return F.cross_entropy(out[:, :3], y) + F.cross_entropy(out[:, 3:], d)


def _domains(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(8, 6, generator=g)
    return x, torch.randint(0, 3, (8,), generator=g), torch.randint(0, 2, (8,), generator=g)


def _after_warmup(model: nn.Module, step: int) -> None:
    model.grl.progress.fill_(1.0 if step >= BAD_STEP else 0.0)


# ------------------------------------------------------ gradient normalisation with tensor hooks
def unit_grad(g: torch.Tensor) -> torch.Tensor:
    return g / g.norm()  # <origin:unit_grad>


class DropPathBlock(nn.Module):
    """A residual branch whose gradient is normalised by a hook on its activation; stochastic
    depth drops the branch per sample (keep = 0)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        h.register_hook(unit_grad)
        return x + h * keep[:, None]


class DropPathNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = DropPathBlock()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x, keep))


def _drop_path_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, keep, y = batch
    return F.cross_entropy(model(x, keep), y)


def _dropped_branch(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    keep = (torch.rand(8, generator=g) > 0.3).float()
    if step == BAD_STEP:
        keep.zero_()  # every sample drops the branch: its gradient is all zeros
    return torch.randn(8, 8, generator=g), keep, torch.randint(0, 3, (8,), generator=g)


class TwoExperts(nn.Module):
    """Hard-routed experts whose weight gradients are normalised by parameter hooks."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, 2)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        for expert in self.experts:
            expert.weight.register_hook(unit_grad)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        h = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            h = h + torch.where((choice == i)[:, None], expert(x), torch.zeros_like(x))
        return self.head(torch.relu(h))


def _unrouted_expert(model: nn.Module) -> Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]:
    def batch(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8, 8, generator=g)
        if step == BAD_STEP:  # every token is routed to expert 0
            w = model.router.weight.detach()
            x = 0.01 * x + 20.0 * (w[0] - w[1]) / (w[0] - w[1]).norm()
        return x, torch.randint(0, 3, (8,), generator=g)
    return batch


# -------------------------------------------------------- gradient normalisation with a module hook
def normalise_grad_input(module: nn.Module, grad_input: tuple[Any, ...],
                         grad_output: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(g / g.norm() if g is not None else None for g in grad_input)  # <origin:full_hook>


class GatedAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.adapter = nn.Linear(8, 8)
        self.adapter.register_full_backward_hook(normalise_grad_input)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        return self.head(h + gate * self.adapter(h))


def _gated_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, gate, y = batch
    return F.cross_entropy(model(x, gate), y)


def _closed_gate(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    gate = torch.full((1,), 0.0 if step == BAD_STEP else 1.0)  # the adapter is switched off
    return torch.randn(8, 6, generator=g), gate, torch.randint(0, 3, (8,), generator=g)


# ----------------------------------------------------------- control: a genuine gradient explosion
class LinearRNN(nn.Module):
    """A ReLU RNN initialised with recurrent weights 4·I (no normalisation): over a long
    sequence of tiny inputs the forward stays finite but the gradient grows 4× per step."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 4, nonlinearity="relu", bias=False, batch_first=True)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.rnn.weight_ih_l0.copy_(torch.eye(4))
            self.rnn.weight_hh_l0.copy_(4 * torch.eye(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)  # <origin:rnn>
        return self.head(out[:, -1])


def _rnn_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    (x,) = batch
    y = model(x)
    return (y ** 2).mean() + y.mean()


def _long_sequence(step: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.full((2, 70 if step == BAD_STEP else 10, 4), 1e-36),)


# ---------------------------------------------------------------------------------- the programs
def _ce(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


PROGRAMS: dict[str, dict[str, Any]] = {
    "ste_quantiser_backward_div": dict(
        model=QuantNet, loss=_ce, batches=_padded_rows,
        want=dict(phase="backward", op="aten.div.Tensor", module="quant", cause="div_by_zero", marker="ste_div")),
    "custom_backward_log_of_zero": dict(
        model=CandidateMixer, loss=_mixer_loss, batches=_padded_candidates,
        want=dict(phase="backward", op="aten.log.default", module="entropy", cause="log_nonpositive",
                  marker="xlogx_log")),
    "gradient_reversal_inf_factor": dict(
        model=DANN, loss=_dann_loss, batches=_domains, before_step=_after_warmup,
        want=dict(phase="forward", op="aten.exp.default", module="grl", cause="exp_overflow", marker="grl_lambda")),
    "activation_hook_normalises_zero_grad": dict(
        model=DropPathNet, loss=_drop_path_loss, batches=_dropped_branch,
        want=dict(phase="backward", op="aten.div.Tensor", module="block", cause="zero_variance_norm",
                  marker="unit_grad")),
    "parameter_hook_normalises_zero_grad": dict(
        model=TwoExperts, loss=_ce, batches=_unrouted_expert, batches_see_model=True,
        want=dict(phase="backward", op="aten.div.Tensor", module="experts.1", cause="zero_variance_norm",
                  marker="unit_grad")),
    "full_backward_hook_zero_norm": dict(
        model=GatedAdapter, loss=_gated_loss, batches=_closed_gate,
        want=dict(phase="backward", op="aten.div.Tensor", module="adapter", cause="zero_variance_norm",
                  marker="full_hook")),
    "control_rnn_gradient_explosion": dict(
        model=LinearRNN, loss=_rnn_loss, batches=_long_sequence,
        want=dict(phase="backward", op="aten.mm.default", module="rnn", cause="gradient_explosion", marker="rnn")),
}


def _train(name: str, replayable: bool) -> list[nantrace.Incident]:
    program = PROGRAMS[name]
    torch.manual_seed(0)
    model = program["model"]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    make_batch = program["batches"](model) if program.get("batches_see_model") else program["batches"]
    g = torch.Generator().manual_seed(11)
    with nantrace.watch(model, opt, config=CONFIG) as guard:
        step_loss = guard.replayable(program["loss"]) if replayable else program["loss"]
        for step in range(STEPS):
            if "before_step" in program:
                program["before_step"](model, step)
            batch = make_batch(step, g)
            opt.zero_grad()
            step_loss(model, batch).backward()
            opt.step()
        return [i for i in guard.incidents if i.action != "logged"]


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_backward_origin_is_the_users_own_op_and_line(one_thread, name, replayable):
    want = PROGRAMS[name]["want"]
    (got,) = _train(name, replayable)
    assert (got.step, got.kind, got.phase, got.op, got.module, got.cause, got.action) == (
        BAD_STEP, "nonfinite_grad", want["phase"], want["op"], want["module"], want["cause"], "skipped"), got.summary
    assert points_at(got.source, __file__, want["marker"])


# ------------------------------------------- a built-in derivative: overflow only with evidence of it
def _derivative_record(func: Any, args: tuple[torch.Tensor, ...]) -> OpRecord:
    """A backward record of ``func`` run on ``args`` for the node of a forward ``mul`` (whose
    derivative is finite at its inputs), as the tracer keeps it."""
    mul = torch.ops.aten.mul.Tensor
    forward = OpInfo(op=op_name(mul), module="layer", source="model.py:7", index=1, args=(torch.ones(4), torch.ones(4)),
                     kwargs={}, func=mul)
    out = func(*args)
    inputs = [InputRef(f"arg{i}", False, False, None, None) for i in range(len(args))]
    return OpRecord(index=2, op=op_name(func), phase="backward", module="layer", source="model.py:7",
                    node="MulBackward0", forward=forward, out_nan=bool(torch.isnan(out).any()),
                    out_inf=bool(torch.isinf(out).any()), inputs=inputs, scalar_nonfinite=False, args=args, kwargs={},
                    output=out, func=func)


@pytest.mark.parametrize("func, args, cause", [
    (torch.ops.aten.div.Tensor, (torch.zeros(4), torch.zeros(4)), "div_by_zero"),
    (torch.ops.aten.mul.Tensor, (torch.full((4,), 3e38), torch.full((4,), 10.0)), "gradient_explosion"),
], ids=["zero_over_zero", "large_operands"])
def test_a_finite_derivative_is_an_explosion_only_when_its_op_overflowed(func, args, cause):
    """0/0 inside a derivative is no overflow; 3e38 × 10 is."""
    rec = _derivative_record(func, args)
    got = classify(Origin(record=rec, chain=[rec]), observed_in="backward", low_precision_finite=None, param_modules={})
    assert (got.cause, got.op, got.phase) == (cause, "aten.mul.Tensor", "backward"), got.detail
