"""Settings kept as tensors in an optimizer's param groups (a Schedule-Free ``weight_sum``, a previous learning
rate kept for momentum correction, tensor ``betas`` of a compile-friendly port) are settings, not tensors the
update "found": a zero divisor or a root's negative argument computed from them (and plain numbers) alone is the
settings' doing, ``optimizer_state``, and the counterfactual may move a one-element tensor setting too. A tensor
the optimizer reads from elsewhere (a module's buffer) stays an outside tensor: its zero is ``div_by_zero``.

Every construction is checked with plain torch first (``test_construction_without_nantrace``): the step of the
first non-finite parameter, the first op of that step that made a non-finite value from finite inputs, and what
its bad operand was (a zero or negative value of the expected provenance)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]


# ------------------------------------------------------------------------------------------ optimizers
class ScheduleFreeSGDPort(torch.optim.Optimizer):
    """Schedule-Free SGD (Defazio et al. 2024), ported with its running weight sum kept as a 0-dim tensor in the
    group (as the reference keeps ``weight_sum`` there): ``ckp1 = weight / weight_sum`` with the weight
    ``lr_max ** 2``. A warm-up that starts at lr = 0 makes it 0 / 0 at step 0."""

    def __init__(self, params: Any, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, lr_max=0.0, weight_sum=torch.tensor(0.0)))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr = group["lr"]
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = torch.tensor(lr_max ** 2)
            weight_sum = group["weight_sum"] = group["weight_sum"] + weight
            ckp1 = weight / weight_sum
            for y in group["params"]:
                if y.grad is None:
                    continue
                z = self.state[y].setdefault("z", y.detach().clone())
                y.lerp_(z, ckp1)
                y.add_(y.grad, alpha=lr * (group["momentum"] * (1 - float(ckp1)) - 1))
                z.sub_(y.grad, alpha=lr)


class CorrectedMomentumSGD(torch.optim.Optimizer):
    """SGD with Goyal et al.'s momentum correction (the buffer is rescaled by lr_t / lr_{t-1} when the learning
    rate changes), the previous learning rate kept in the group as a tensor. After a warm-up step at lr = 0 the
    ratio divides by 0."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, prev_lr=torch.tensor(-1.0)))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            first = bool(group["prev_lr"] < 0)
            ratio = 1.0 if first else group["lr"] / group["prev_lr"]  # <momentum-correction>
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = p.grad.clone()
                else:
                    buf.mul_(group["momentum"] * ratio).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])
            group["prev_lr"] = torch.tensor(group["lr"])


class RAdamTensorBetasPort(torch.optim.Optimizer):
    """RAdam ported with its betas as tensors (compile-friendly, no recompiles when a sweep changes them), and
    without the reference's ``rho_t > 5`` guard: the variance rectification ``sqrt((rho_t-4)(rho_t-2)rho_inf /
    ((rho_inf-4)(rho_inf-2)rho_t))`` takes the root of a negative number at t = 3 (rho_3 between 2 and 4)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, betas=(torch.tensor(betas[0]), torch.tensor(betas[1])), eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            rho_inf = 2 / (1 - beta2) - 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                t = st["t"]
                st["m"].lerp_(p.grad, 1 - beta1)
                st["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                b2t = beta2 ** t
                rho_t = rho_inf - 2 * t * b2t / (1 - b2t)
                rect = (((rho_t - 4) * (rho_t - 2) * rho_inf) / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).sqrt()  # <rect>
                m_hat = st["m"] / (1 - beta1 ** t)
                v_hat = (st["v"] / (1 - b2t)).sqrt().add_(group["eps"])
                p.sub_(rect * group["lr"] * m_hat / v_hat)


class ActivationScaledSGD(torch.optim.Optimizer):
    """SGD whose first layer's gradient is divided by a per-input-feature activation scale the model keeps in a
    buffer (the running max of |x|, updated by a forward pre-hook): an input feature that is always 0 (a dead
    sensor) has scale 0. The scale is a tensor the optimizer reads from the model, not a setting."""

    def __init__(self, params: Any, scale: torch.Tensor, lr: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr))
        self.scale = scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad / self.scale if p.dim() == 2 and p.shape[1] == self.scale.numel() else p.grad  # <act-scale>
                p.add_(g, alpha=-group["lr"])


# ------------------------------------------------------------------------------------------ programs
class Program:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 sched: Any = None) -> None:
        self.model, self.opt, self.batches, self.sched = model, opt, batches, sched


def _batches(seed: int, n: int, dead: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)
        if dead is not None:
            x[:, dead] = 0.0
        out.append((x, y))
    return out


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def schedule_free_warmup_from_zero() -> Program:
    model = _mlp()
    opt = ScheduleFreeSGDPort(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
    return Program(model, opt, _batches(1, 4), sched)


def schedule_free_warmup_from_first_step() -> Program:
    model = _mlp()
    opt = ScheduleFreeSGDPort(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return Program(model, opt, _batches(1, 4), sched)


def momentum_correction_after_zero_lr_warmup() -> Program:
    model = _mlp()
    opt = CorrectedMomentumSGD(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
    return Program(model, opt, _batches(2, 4), sched)


def radam_tensor_betas_without_rho_guard() -> Program:
    model = _mlp()
    return Program(model, RAdamTensorBetasPort(model.parameters()), _batches(3, 4))


class ScaledMLP(nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.register_buffer("act_scale", torch.zeros(6))
        self[0].register_forward_pre_hook(self._track)

    def _track(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            torch.maximum(self.act_scale, args[0].abs().amax(0), out=self.act_scale)


def activation_scale_of_a_dead_sensor() -> Program:
    model = ScaledMLP()
    batches = _batches(4, 3, dead=3)
    return Program(model, ActivationScaledSGD(model.parameters(), model.act_scale), batches)


# name -> (build, expected (step, kind, phase, op, module, cause) of the first blocking incident or None, setting named)
CASES: dict[str, tuple[Callable[[], Program], tuple[Any, ...] | None, str | None]] = {
    "schedule_free_weight_sum_tensor": (
        schedule_free_warmup_from_zero,
        (0, "nonfinite_param", "optimizer", "aten.div.Tensor", "0", "optimizer_state"), "lr = 0"),
    "momentum_correction_prev_lr_tensor": (
        momentum_correction_after_zero_lr_warmup,
        (1, "nonfinite_param", "optimizer", "aten.reciprocal.default", "0", "optimizer_state"), "prev_lr = 0"),
    "radam_tensor_betas_rectifier_root": (
        radam_tensor_betas_without_rho_guard,
        (2, "nonfinite_param", "optimizer", "aten.sqrt.default", "0", "optimizer_state"), None),
    "activation_scale_buffer_is_not_a_setting": (
        activation_scale_of_a_dead_sensor,
        (None, "nonfinite_param", "optimizer", "aten.div.Tensor", "0", "div_by_zero"), None),
    "schedule_free_quiet_when_warmup_starts_above_zero": (schedule_free_warmup_from_first_step, None, None),
}


def _train(program: Program, guard: Any = None) -> int | None:
    """The plain loop; returns the first step after which a parameter is non-finite (no guard), or None."""
    for step, (x, y) in enumerate(program.batches):
        program.opt.zero_grad()
        F.mse_loss(program.model(x), y).backward()
        program.opt.step()
        if program.sched is not None:
            program.sched.step()
        if guard is None and not all(bool(torch.isfinite(p).all()) for p in program.model.parameters()):
            return step
    return None


class _FirstBad(TorchDispatchMode):
    """Plain torch: the first op that made a non-finite value from finite inputs, and its tensor inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[str, list[torch.Tensor]] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t.detach().clone() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if self.first is None and all(bool(torch.isfinite(t).all()) for t in inputs if t.is_floating_point()):
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if any(not bool(torch.isfinite(t).all()) for t in outs):
                self.first = (str(func), inputs)
        return out


def _first_bad_op(build: Callable[[], Program], step: int) -> tuple[str, list[torch.Tensor]]:
    program = build()
    for s, (x, y) in enumerate(program.batches[:step + 1]):
        program.opt.zero_grad()
        F.mse_loss(program.model(x), y).backward()
        if s == step:
            mode = _FirstBad()
            with mode:
                program.opt.step()
            assert mode.first is not None
            return mode.first
        program.opt.step()
        if program.sched is not None:
            program.sched.step()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("name", list(CASES))
def test_construction_without_nantrace(name: str) -> None:
    build, want, _ = CASES[name]
    program = build()
    bad_step = _train(program)
    if want is None:
        assert bad_step is None
        return
    if want[0] is not None:
        assert bad_step == want[0]
    else:
        assert bad_step is not None
    op, inputs = _first_bad_op(build, bad_step)
    assert op == want[3]
    if name == "schedule_free_weight_sum_tensor":  # 0 / 0: the weight and the group's weight_sum, both from lr = 0
        assert [float(t) for t in inputs] == [0.0, 0.0]
    elif name == "momentum_correction_prev_lr_tensor":  # 1 / prev_lr with the group's prev_lr = 0 (lr at step 0)
        assert [float(t) for t in inputs] == [0.0]
    elif name == "radam_tensor_betas_rectifier_root":  # a negative number computed from betas and t alone
        assert float(inputs[0]) < 0 and inputs[0].numel() == 1
    elif name == "activation_scale_buffer_is_not_a_setting":  # the model's buffer holds an exact 0 (feature 3)
        denominator = inputs[1]
        assert denominator.shape == (6,) and float(denominator[3]) == 0.0 and bool((denominator[:3] > 0).all())
        assert float(inputs[0][:, 3].abs().max()) == 0.0  # the dead feature's weights get no gradient: 0 / 0


@pytest.mark.parametrize("mode", ["skip", "raise"])
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis(name: str, mode: str) -> None:
    build, want, setting = CASES[name]
    program = build()
    guard = nantrace.watch(program.model, program.opt, on_anomaly=mode,
                           config=nantrace.Config(outputs={"print_incidents": False}, dynamics={"early_warnings": False}))
    error = None
    try:
        _train(program, guard)
    except nantrace.NonFiniteError as exc:
        error = exc
    finally:
        guard.close()
    blocking = [i for i in guard.incidents if i.action != "logged"]
    if want is None:
        assert blocking == [] and error is None
        return
    plain_step = _train(build())
    inc = blocking[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (plain_step, *want[1:])
    assert (error is not None) == (mode == "raise")
    if setting is not None:
        assert setting in inc.summary and setting in inc.fix, (inc.summary, inc.fix)
    if want[-1] == "div_by_zero":
        assert "moved off its value" not in inc.summary
