"""The optimizer phase (issue 11, item 3): an update that makes a parameter or the optimizer
state non-finite is caught at its own step, named (parameter, state tensor, op, cause) and does
not survive under any policy; a parameter corrupted between steps is ``nonfinite_param`` with
phase ``None``, never blamed on the optimizer."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
import scenarios
from nantrace.response.update_bounds import StateBound, next_state_bound, update_risk
from nantrace.response.update_check import UpdateCheck
from scenarios import SCENARIOS, STEPS, TinyLARS

OPTIMIZER_BORN = ["adam_eps0_update_makes_nan", "fp16_adam_eps_underflow", "lars_trust_ratio_zero_grad_norm"]
_STEP_LINE = next(i for i, text in enumerate(open(__file__, encoding="utf-8"), 1) if text.rstrip().endswith("# <step-line>"))
POLICY_ACTION = {"skip": "skipped", "raise": "raised", "pause": "paused", "rollback": "rolled_back"}


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[dict[str, object]]]:
    """Weights and optimizer state, copied (tensors cloned)."""
    weights = [p.detach().clone() for p in model.parameters()]
    state = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()} if p in opt.state else None
             for p in model.parameters()]
    return weights, state


def _bitwise(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                         b.view(-1).view(torch.uint8) if b.numel() else b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b))
    return a == b


def _train(name: str, policy: str, config: nantrace.Config | None = None) -> tuple[nantrace.Guard, dict[int, bool], list]:
    """The scenario's loop, checking weights AND optimizer state bit for bit around every step."""
    scn = SCENARIOS[name]
    setup = scenarios.build(scn)
    guard = nantrace.watch(setup.model, setup.optimizer, on_anomaly=policy,
                           config=config or nantrace.Config(print_incidents=False, early_warnings=False))
    kept: dict[int, bool] = {}
    snaps = []
    try:
        for step, batch in enumerate(setup.batches):
            setup.optimizer.zero_grad()
            setup.loss_fn(setup.model, batch).backward()
            before = _state(setup.model, setup.optimizer)
            snaps.append(before)
            seen = len(guard.incidents)
            try:
                setup.optimizer.step()  # <step-line>
            except nantrace.NonFiniteError:
                kept[step] = _bitwise(before, _state(setup.model, setup.optimizer))
                break
            if len(guard.incidents) > seen:
                kept[step] = _bitwise(before, _state(setup.model, setup.optimizer))
    finally:
        guard.close()
    return guard, kept, snaps


@pytest.mark.parametrize("policy", ["skip", "raise", "pause"])
@pytest.mark.parametrize("name", OPTIMIZER_BORN)
def test_update_made_non_finite_is_caught_at_its_step_and_undone(name: str, policy: str) -> None:
    exp = SCENARIOS[name].expected
    guard, kept, _ = _train(name, policy)
    assert [(i.step, i.kind, i.phase, i.op, i.module, i.cause, i.action, i.transient) for i in guard.incidents] == [
        (exp.step, exp.kind, "optimizer", exp.op, exp.module, exp.cause, POLICY_ACTION[policy], False)]
    inc = guard.incidents[0]
    path, _, line = inc.source.rpartition(":")
    if exp.origin == "optimizer_step":  # inside torch's optimizer: the user's line that called step()
        assert os.path.samefile(path, __file__) and int(line) == _STEP_LINE
    else:  # a hand-written optimizer: its own line
        assert os.path.samefile(path, scenarios.__file__) and int(line) == scenarios.origin_line(exp.origin)
    for key, value in exp.details:
        assert inc.details[key] == value, key
    assert kept == {exp.step: True}, "weights and optimizer state must be bit for bit as before the failing update"
    assert guard.step == (STEPS if policy == "skip" else exp.step + 1)


@pytest.mark.parametrize("name", OPTIMIZER_BORN)
def test_rollback_restores_the_snapshot_and_trains_on(name: str) -> None:
    exp = SCENARIOS[name].expected
    cfg = nantrace.Config(print_incidents=False, early_warnings=False, rollback_interval=1)
    guard, kept, snaps = _train(name, "rollback", cfg)
    assert [(i.step, i.phase, i.cause, i.action) for i in guard.incidents] == [(exp.step, "optimizer", exp.cause, "rolled_back")]
    assert guard.incidents[0].details["restored_to_step"] == exp.step  # the snapshot taken before this very update
    assert kept == {exp.step: True} and guard.step == STEPS


def test_optimizer_state_that_alone_turns_non_finite_is_its_own_kind() -> None:
    """float16 Adam state: g² overflows exp_avg_sq to inf while the weights stay finite (m / inf = 0)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, early_warnings=False))
    opt.zero_grad()
    (model(torch.full((3, 4), 40.0, dtype=torch.float16)).float().pow(2).sum() * 4).backward()  # |g| ≈ 1e4: g² > 65504
    before = _state(model, opt)
    opt.step()
    guard.close()
    inc = guard.incidents[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.cause, inc.action) == (
        0, "optimizer_state", "optimizer", "aten.addcmul_.default", "precision_overflow", "skipped")
    assert inc.details["state"] == "exp_avg_sq" and inc.details["float32_replay_finite"] is True
    assert inc.details["nonfinite_params"] == [] and {s["state"] for s in inc.details["nonfinite_state"]} == {"exp_avg_sq"}
    assert _bitwise(before, _state(model, opt)) and opt.state == {} or all(not s for s in opt.state.values())


# ----------------------------------------------------------------- corrupted between steps
def _write_nan(model: nn.Module) -> None:
    with torch.no_grad():
        model.head.weight[0, 1] = float("nan")  # a user's in-place write between two steps


def _load_nan_checkpoint(model: nn.Module) -> None:
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad["head.weight"][2, 0] = float("inf")
    model.load_state_dict(bad)


@pytest.mark.parametrize("corrupt", [_write_nan, _load_nan_checkpoint], ids=["in_place_write", "checkpoint_load"])
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.AdamW(ps, lr=1e-3), lambda ps: TinyLARS(ps)],
                         ids=["adamw_proven", "lars_checked"])
@pytest.mark.parametrize("policy", ["skip", "raise", "rollback"])
def test_parameter_corrupted_between_steps_is_never_blamed_on_the_optimizer(corrupt, make_opt, policy) -> None:
    torch.manual_seed(0)
    model = scenarios.Encoder()
    opt = make_opt(model.parameters())
    guard = nantrace.watch(model, opt, on_anomaly=policy, config=nantrace.Config(print_incidents=False))
    raised = None
    for step in range(4):
        if step == 2:
            corrupt(model)
        opt.zero_grad()
        x, y = scenarios._xy()
        F.cross_entropy(model(x), y).backward()
        try:
            opt.step()
        except nantrace.NonFiniteError as exc:
            raised = exc
            break
    guard.close()
    want = {"skip": "raised", "raise": "raised", "rollback": "rolled_back"}[policy]  # skipping cannot repair it
    assert [(i.step, i.kind, i.phase, i.cause, i.module, i.action) for i in guard.incidents] == [
        (2, "nonfinite_param", None, "nonfinite_param", "head", want)]
    assert guard.incidents[0].details["last_update"] == 1 and "between steps" in guard.incidents[0].summary
    assert (raised is None) == (policy == "rollback")
    if policy == "rollback":
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ------------------------------------------------------------------------ what it costs
def test_proven_updates_copy_nothing_and_checked_ones_hold_one_copy() -> None:
    torch.manual_seed(0)
    for make_opt, proven in ((lambda ps: torch.optim.AdamW(ps, lr=1e-3), True), (lambda ps: TinyLARS(ps), False)):
        model = scenarios.Encoder()
        opt = make_opt(model.parameters())
        guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
        for _ in range(3):
            opt.zero_grad()
            x, y = scenarios._xy()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        check = guard.update_check
        assert check is not None and check.finite_after_update is True
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert check.held_bytes == (0 if proven else 2 * weights), check.last_reasons  # weights + momentum buffers
        assert (check.last_reasons == []) == proven
        guard.close()
        assert not opt._optimizer_load_state_dict_post_hooks, "close() removes the load_state_dict hook"


def test_loaded_optimizer_state_is_checked_once_then_proven_again() -> None:
    torch.manual_seed(0)
    model = scenarios.Encoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    reasons = []
    for step in range(4):
        if step == 2:
            opt.load_state_dict(opt.state_dict())
        opt.zero_grad()
        x, y = scenarios._xy()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        reasons.append(list(guard.update_check.last_reasons))
    guard.close()
    assert reasons[0] == reasons[1] == reasons[3] == []
    assert reasons[2] == ["the optimizer state was not produced under watch (loaded or pre-existing)"]


# ----------------------------------------------------------------------------- the bound
def _adam_group(dtype: torch.dtype = torch.float32, **hyper) -> tuple[torch.optim.Optimizer, dict]:
    opt = torch.optim.Adam([nn.Parameter(torch.ones(3, dtype=dtype))], **hyper)
    return opt, opt.param_groups[0]


@pytest.mark.parametrize("case, reason", [
    (dict(), None),
    (dict(eps=0.0), "eps=0.0 is not a positive normal float32"),
    (dict(dtype=torch.float16), "float16 parameters and state"),
    (dict(betas=(1.0, 0.999)), "betas=(1.0, 0.999) outside [0, 1)"),
    (dict(grad=1e20), "the update's bound"),
    (dict(state=None), "the optimizer state was not produced under watch"),
    (dict(grad=math.nan), "no finite gradient and parameter norms"),
])
def test_update_risk(case: dict, reason: str | None) -> None:
    dtype = case.pop("dtype", torch.float32)
    grad, state = case.pop("grad", 10.0), case.pop("state", 0.0)
    opt, group = _adam_group(dtype)
    group.update(case)  # set after construction: torch refuses some of these values up front
    got = update_risk(opt, group, grad=grad, param=100.0, state=state)
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got
    sgd = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    assert update_risk(sgd, sgd.param_groups[0], grad=5.0, param=1.0, state=0.0) is None
    lars = TinyLARS([nn.Parameter(torch.ones(2))])
    assert update_risk(lars, lars.param_groups[0], grad=5.0, param=1.0, state=0.0) == \
        "TinyLARS's update rule is not one nantrace can bound"


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=10.0, eps=1e-30, weight_decay=1e3),
    lambda ps: torch.optim.AdamW(ps, lr=1e3, eps=1e-20, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e6, momentum=0.99, nesterov=True, weight_decay=10.0),
], ids=["adam", "adamw_amsgrad", "sgd_nesterov"])
def test_a_proven_update_is_finite_even_at_extreme_settings(make) -> None:
    """The bound against the real update: whenever it says "proven", the update stays finite."""
    gen = torch.Generator().manual_seed(0)
    proven = 0
    for scale in (1e-30, 1.0, 1e8, 1e12, 1e17):
        p = nn.Parameter(torch.randn(64, generator=gen) * scale)
        opt = make([p])
        bound = StateBound.for_optimizer(opt)
        for _ in range(5):
            p.grad = torch.randn(64, generator=gen) * scale
            group = opt.param_groups[0]
            g, w = float(p.grad.norm()), float(p.detach().norm())
            if update_risk(opt, group, grad=g, param=w, state=bound.value) is not None:
                break
            opt.step()
            proven += 1
            tensors = [p] + [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
            assert all(bool(torch.isfinite(t).all()) for t in tensors), scale
            bound.value = next_state_bound(opt, group, grad=g, param=w, state=bound.value)
    assert proven >= 5  # the bound is not vacuous: it proves updates at these extreme settings too


def test_check_can_be_turned_off() -> None:
    model = scenarios.Encoder()
    guard = nantrace.watch(model, TinyLARS(model.parameters()), config=nantrace.Config(check_updates=False, print_incidents=False))
    assert guard.update_check is not None and not guard.update_check.enabled
    guard.close()


def test_update_check_alone() -> None:
    """The core without a guard: check, catch, undo (the shape docs/benchmarks.md measures)."""
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = TinyLARS([p])
    check = UpdateCheck(opt, [p], ["w"])
    p.grad = torch.zeros(2)
    check.before_update(grad_norm=0.0, param_norm=2.3)
    opt.step()
    failure = check.after_update()
    assert failure is not None and failure.param_name == "w" and failure.nonfinite_state[0]["state"] == "momentum_buffer"
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0])) and p not in opt.state
    check.close()


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_update_check_under_a_grad_scaler(policy: str) -> None:
    """scaler.step(optimizer): the update runs inside the scaler's step; the check still catches it."""
    torch.manual_seed(0)
    model = scenarios.Encoder()
    opt = TinyLARS(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = nantrace.watch(model, opt, scaler, on_anomaly=policy, config=nantrace.Config(print_incidents=False))
    kept = None
    for step in range(3):
        opt.zero_grad()
        x, y = (torch.zeros(4, 8), torch.randint(0, 4, (4,))) if step == 1 else scenarios._xy()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        before = _state(model, opt)
        try:
            scaler.step(opt)
        except nantrace.NonFiniteError:
            kept = _bitwise(before, _state(model, opt))
            break
        scaler.update()
        if step == 1:
            kept = _bitwise(before, _state(model, opt))
    guard.close()
    assert [(i.step, i.phase, i.op, i.cause, i.action) for i in guard.incidents] == [
        (1, "optimizer", "aten.div.Tensor", "div_by_zero", POLICY_ACTION[policy])]
    assert kept is True
    assert guard.step == (3 if policy == "skip" else 2)


def test_a_nan_learning_rate_from_a_scheduler_is_named(one_thread):
    """A cosine schedule whose decay divides by total_steps - warmup_steps = 0 sets lr = NaN at the
    end of the warm-up: the update is undone at its step and the incident names the lr, not only the
    op that met it (the op's tensors were all finite)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warmup = total = 3

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / (total - warmup) if total != warmup else float("nan")
        return 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    g = torch.Generator().manual_seed(1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for _ in range(5):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
        incident = guard.incidents[0]
    assert (incident.step, incident.kind, incident.phase, incident.cause, incident.action) == (
        3, "nonfinite_param", "optimizer", "optimizer_state", "skipped")
    assert "lr = nan" in incident.summary and "scheduler" in incident.fix


class _NoEpsRMSProp(torch.optim.Optimizer):
    """A hand-written RMSProp without eps: p -= lr * g / sqrt(acc)."""

    def __init__(self, params, lr: float = 1e-3, rho: float = 0.5) -> None:
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "acc" not in st:
                    st["acc"] = torch.zeros_like(p)
                st["acc"].mul_(group["rho"]).add_(p.grad * p.grad, alpha=1 - group["rho"])
                p.sub_(group["lr"] * p.grad / st["acc"].sqrt())  # origin: rmsprop


def test_a_state_that_decayed_to_zero_in_an_optimizer_without_eps_is_its_state(one_thread):
    """A dead input column gives its weights exactly-zero gradients: the accumulator decays to exactly
    0 and the update is 0 / 0. The denominator is the optimizer's state (not this step's gradient, as
    in LARS): ``optimizer_state``, with a fix that says to add an eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = _NoEpsRMSProp(model.parameters())
    g = torch.Generator().manual_seed(10)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False},
                                                           response={"skip_budget": 0})) as guard:
        for _ in range(200):
            x = torch.randn(16, 4, generator=g)
            x[:, 2] = 0.0  # a dead sensor
            opt.zero_grad()
            F.mse_loss(model(x), x.sum(-1, keepdim=True)).backward()
            opt.step()
            if guard.incidents:
                break
        incident = guard.incidents[0]
    assert (incident.kind, incident.phase, incident.op, incident.module, incident.cause, incident.action) == (
        "nonfinite_param", "optimizer", "aten.div.Tensor", "0", "optimizer_state", "skipped")
    assert "acc" in incident.fix and "eps" in incident.fix


@pytest.mark.parametrize("impl, op", [
    (dict(foreach=False), "aten.addcdiv_.default"),
    (dict(foreach=True), "aten._foreach_addcdiv_.ScalarList"),
    (dict(fused=True), "aten._fused_adamw_.default"),
], ids=["for_loop", "foreach", "fused"])
def test_an_update_kernel_that_writes_its_arguments_is_named(one_thread, impl, op):
    """AdamW with eps=0 on an embedding's padding row (its gradient is always zero): 0/0 in the
    update. The foreach and fused kernels return nothing and write the parameters in place: the
    replay of the update still names them (``update_replay._written``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0, **impl)
    g = torch.Generator().manual_seed(1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for _ in range(2):
            x = torch.randint(0, 10, (8, 3), generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.randn(8, 1, generator=g)).backward()
            opt.step()
        incident = next(i for i in guard.incidents if i.action != "logged")
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause,
            incident.action) == (0, "nonfinite_param", "optimizer", op, "0", "optimizer_state", "skipped"), \
        incident.summary


class _EpsFreeAdafactorRow(torch.optim.Optimizer):
    """A factored second moment without eps: p -= lr * g * rsqrt_(row mean of g**2), in place."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                r = (p.grad * p.grad).mean(dim=-1, keepdim=True)
                r.rsqrt_()
                p.sub_(group["lr"] * p.grad * r)


def test_an_in_place_root_of_a_zero_is_a_division_by_zero(one_thread):
    """``rsqrt_`` overwrites its zeros with inf: the replay counts them before the op runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 1))
    opt = _EpsFreeAdafactorRow(model.parameters())
    g = torch.Generator().manual_seed(1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        x = torch.randint(0, 10, (8, 3), generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.randn(8, 1, generator=g)).backward()
        opt.step()
        incident = next(i for i in guard.incidents if i.action != "logged")
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module) == (
        0, "nonfinite_param", "optimizer", "aten.rsqrt_.default", "0"), incident.summary
    assert incident.cause == "div_by_zero" and "zeros in the denominator" in incident.summary, incident.summary


def test_a_failed_update_is_undone_in_every_parameter_group(one_thread):
    """Two groups; the head's learning rate turns NaN (a schedule's 0/0) while the trunk's update is
    proven finite: the whole step is undone, the trunk's weights and momentum included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(3):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if step == 2:
                opt.param_groups[1]["lr"] = float("nan")
                before = [p.detach().clone() for p in model.parameters()]
                momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            opt.step()
        (incident,) = [i for i in guard.incidents if i.action != "logged"]
    assert (incident.step, incident.kind, incident.phase, incident.action) == (2, "nonfinite_param", "optimizer", "skipped")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(momentum, model.parameters()))


def test_a_group_added_after_watch_is_checked_not_proven(one_thread):
    """``add_param_group`` after ``watch()``: the step's gradient norm does not cover the new group, so
    its update is never taken as proven; a NaN gradient of it is caught at the update and undone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        opt.add_param_group({"params": [extra]})
        for step in range(3):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            (nn.functional.mse_loss(model(x), y) + extra.sum()).backward()
            if step == 2:
                extra.grad.fill_(float("nan"))  # the step's check reads only the parameters watched at watch()
            opt.step()
        incidents = [i for i in guard.incidents if i.action != "logged"]
    (incident,) = incidents
    assert (incident.step, incident.kind, incident.phase, incident.action) == (2, "nonfinite_param", "optimizer", "skipped")
    assert torch.equal(extra.detach(), torch.ones(3) - 0.05 * 2)  # the two healthy updates only
    assert any("add_param_group" in r for r in guard.update_check.last_reasons)


# ---------------------------------------------------------------- what a bad operand of the update is made of
def _watched_run(model, opt, steps: int = 3, seed: int = 1, *, policy: str = "skip", config=None):
    """A regression loop under the guard; returns the guard (closed) and the first exception raised, if any."""
    g = torch.Generator().manual_seed(seed)
    guard = nantrace.watch(model, opt, on_anomaly=policy,
                           config=config or nantrace.Config(outputs={"print_incidents": False}))
    error = None
    try:
        for _ in range(steps):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = exc
    finally:
        guard.close()
    return guard, error


def _blocking(guard: nantrace.Guard) -> list:
    return [i for i in guard.incidents if i.action != "logged"]


def _here(tag: str) -> str:
    line = next(i for i, text in enumerate(open(__file__, encoding="utf-8"), 1) if text.rstrip().endswith(f"# <{tag}>"))
    return f"{os.path.relpath(__file__)}:{line}"


def _same_place(source: str | None, tag: str) -> bool:
    if source is None:
        return False
    where, _, line = source.rpartition(":")
    mine, _, want = _here(tag).rpartition(":")
    return os.path.samefile(where, mine) and line == want


class _BiasCorrectedRMS(torch.optim.Optimizer):
    """RMSProp with Adam's bias correction, written by hand: v / (1 - beta**t)."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.99, eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, beta=beta, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["v"] = 0, torch.zeros_like(p)
                st["t"] += 1
                st["v"].mul_(group["beta"]).addcmul_(p.grad, p.grad, value=1 - group["beta"])
                v_hat = st["v"] / (1 - group["beta"] ** st["t"])  # <bias-correction>
                p.addcdiv_(p.grad, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])


def test_a_zero_divisor_made_from_the_settings_alone_is_the_settings(one_thread):
    """beta = 1 ("no decay", a sweep's end point): the bias correction 1 - beta**t is a plain number 0 that no
    gradient, parameter or state tensor feeds, so 0 / 0 is the settings' doing (``optimizer_state``), and the
    incident names the setting that, moved off its value alone, makes the update finite. eps is set: no fix
    about eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    guard, error = _watched_run(model, _BiasCorrectedRMS(model.parameters(), beta=1.0), steps=2)
    inc = _blocking(guard)[0]
    assert error is None
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        0, "nonfinite_param", "optimizer", "aten.div.Tensor", "0", "optimizer_state", "skipped")
    assert _same_place(inc.source, "bias-correction"), inc.source
    assert "beta = 1" in inc.summary and "beta = 1" in inc.fix and "eps" not in inc.fix, (inc.summary, inc.fix)
    assert "lr =" not in inc.summary  # only the setting that alone repairs it


def test_an_eps0_adam_whose_second_moment_is_zero_stays_its_state(one_thread):
    """The negative of the test above: torch's Adam with eps=0 on a zero gradient divides by sqrt(v) + 0, an
    element-wise function of its state: ``optimizer_state`` with the eps fix, and no setting blamed by the
    counterfactual (no plain number of the update was 0: moving lr or betas does not repair it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.zero_()  # the first layer's gradient is exactly 0 at step 0
    guard, _ = _watched_run(model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0, foreach=False), steps=1)
    inc = _blocking(guard)[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        0, "nonfinite_param", "optimizer", "aten.addcdiv_.default", "0", "optimizer_state", "skipped")
    assert "exp_avg_sq" in inc.summary and "positive eps" in inc.fix and "moved off its value" not in inc.summary


class _NormalisedMomentum(torch.optim.Optimizer):
    """Normalised SGD with momentum (no eps): p -= lr * buf / ||buf||."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.sub_(buf / buf.norm(), alpha=group["lr"])  # <normalised-momentum>


def test_a_norm_of_this_steps_update_is_a_division_by_zero_even_without_an_eps_key(one_thread):
    """The divisor is a norm over this step's update (the momentum buffer the gradient just entered): a layer
    in front of a zero-initialised one has an all-zero gradient at step 0, ||buf|| = 0, ``div_by_zero`` (the
    group has no ``eps`` key, which used to turn any divisor with dataflow from the state into the state's
    fault)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.zero_()
    guard, _ = _watched_run(model, _NormalisedMomentum(model.parameters()), steps=1)
    inc = _blocking(guard)[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        0, "nonfinite_param", "optimizer", "aten.div.Tensor", "0", "div_by_zero", "skipped")
    assert _same_place(inc.source, "normalised-momentum"), inc.source
    assert "norm or sum of this step's update" in inc.summary and "Guard that division" in inc.fix


class _RootPreconditioned(torch.optim.Optimizer):
    """A full-matrix preconditioner on the rows of a 2-d weight: (sum of G G^T + eps I)^(-1/2) G, its square root
    taken by eigendecomposition; a 1-d parameter gets plain SGD, and ``root_of`` chooses what is rooted."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-12, root_of: str = "state") -> None:
        super().__init__(params, dict(lr=lr, eps=eps))
        self.root_of = root_of

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.ndim < 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                if self.root_of == "gradient":  # a plain bug: a root of the raw gradient, no state involved
                    p.sub_(p.grad.sqrt(), alpha=group["lr"])  # <root-of-gradient>
                    continue
                st = self.state[p]
                if not st:
                    st["stat"] = torch.zeros(p.shape[0], p.shape[0])
                st["stat"].add_(p.grad @ p.grad.mT)
                evals, evecs = torch.linalg.eigh(st["stat"] + group["eps"] * torch.eye(p.shape[0]))
                inv_root = evecs @ torch.diag(evals.sqrt().reciprocal()) @ evecs.mT  # <root-of-state>
                p.sub_(inv_root @ p.grad, alpha=group["lr"])


def _rank_deficient_run(root_of: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 24), nn.Tanh(), nn.Linear(24, 1))  # 24 rows, rank <= 4 after one batch
    return _watched_run(model, _RootPreconditioned(model.parameters(), root_of=root_of), steps=1)


def test_a_root_of_the_optimizers_state_left_negative_by_rounding_is_its_state(one_thread):
    """A low-rank statistics matrix kept as state: its zero eigenvalues come out slightly negative, and an eps of
    1e-12 does not dominate the rounding; sqrt of them is NaN. The negative argument is computed from the state:
    ``optimizer_state`` (not ``sqrt_negative``), naming the state tensor."""
    guard, _ = _rank_deficient_run("state")
    inc = _blocking(guard)[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        0, "nonfinite_param", "optimizer", "aten.sqrt.default", "0", "optimizer_state", "skipped")
    assert _same_place(inc.source, "root-of-state"), inc.source
    assert "negative inputs" in inc.summary and "stat" in inc.summary and "epsilon" in inc.fix


def test_a_root_of_this_steps_gradient_stays_a_negative_square_root(one_thread):
    """The negative of the test above: the same optimizer taking the root of the raw gradient (no state on the
    way): ``sqrt_negative``."""
    guard, _ = _rank_deficient_run("gradient")
    inc = _blocking(guard)[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        0, "nonfinite_param", "optimizer", "aten.sqrt.default", "0", "sqrt_negative", "skipped")
    assert _same_place(inc.source, "root-of-gradient"), inc.source


class _ScaledNoiseSGD(torch.optim.Optimizer):
    """SGD whose step size is lr / scale with the scale a numpy number from a schedule (numpy divides by 0
    with a warning, to inf)."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr, scale=np.float64(1.0)))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            size = group["lr"] / group["scale"]
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-size)  # <scaled-step>


def test_a_non_finite_plain_number_argument_is_the_settings(one_thread):
    """A group setting becomes 0 mid-run (a schedule's end point): the op's tensors are finite, its ``alpha`` is
    -inf. A non-finite plain-number argument is a bad input, not an overflow: ``optimizer_state``, naming the
    argument and the setting."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _ScaledNoiseSGD(model.parameters())
    scales = np.linspace(1.0, 0.0, 3)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(), np.errstate(divide="ignore"):
        warnings.simplefilter("ignore")
        with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
            for step in range(3):
                opt.param_groups[0]["scale"] = scales[step]
                opt.zero_grad()
                F.mse_loss(model(torch.randn(16, 4, generator=g)), torch.randn(16, 1, generator=g)).backward()
                opt.step()
    inc = _blocking(guard)[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        2, "nonfinite_param", "optimizer", "aten.add_.Tensor", "0", "optimizer_state", "skipped")
    assert _same_place(inc.source, "scaled-step"), inc.source
    assert "alpha = -inf" in inc.summary and "scale = 0" in inc.summary and "overflow" not in inc.summary


class _NewtonCholesky(torch.optim.Optimizer):
    """A Gauss-Newton step on a 2-d weight's rows: solve (sum of G G^T + damping I) x = G by Cholesky."""

    def __init__(self, params, lr: float = 0.05, damping: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, damping=damping))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.ndim < 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                st = self.state[p]
                if not st:
                    st["curvature"] = torch.zeros(p.shape[0], p.shape[0])
                st["curvature"].mul_(0.5).add_(p.grad @ p.grad.mT)
                damped = st["curvature"] + group["damping"] * torch.eye(p.shape[0])
                chol = torch.linalg.cholesky(damped)  # <newton-cholesky>
                p.sub_(torch.cholesky_solve(p.grad, chol), alpha=group["lr"])


def test_an_exception_raised_inside_the_optimizers_step_is_diagnosed(one_thread):
    """The step itself raises (a Cholesky of a rank-deficient curvature kept as state, no damping): an incident
    of kind ``exception``, phase ``optimizer``, naming the decomposition whose ``info`` reported the failure,
    the parameter's module and the line; what the step had written before raising is undone, and the user's
    exception propagates unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 24), nn.Tanh(), nn.Linear(24, 1))
    biases_first = [{"params": [model[0].bias, model[2].bias]}, {"params": [model[0].weight, model[2].weight]}]
    opt = _NewtonCholesky(biases_first)
    before = [p.detach().clone() for p in model.parameters()]
    guard, error = _watched_run(model, opt, steps=1)
    assert isinstance(error, torch.linalg.LinAlgError) and not isinstance(error, nantrace.NonFiniteError)
    (inc,) = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        0, "exception", "optimizer", "aten.linalg_cholesky_ex.default", "0", "domain_error", "raised")
    assert _same_place(inc.source, "newton-cholesky"), inc.source
    assert "damping = 0" in inc.summary and "damping" in inc.fix and inc.details["exception"].startswith("_LinAlgError")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the biases had been stepped before it raised
    assert guard.step == 1  # the call counted


def test_a_step_that_raises_for_another_reason_is_no_incident(one_thread):
    """The negative: damping set, the decomposition succeeds, and the optimizer then fails on a shape of its own
    making; no value caused it, so no incident, and the exception propagates as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 24), nn.Tanh(), nn.Linear(24, 1))
    opt = _NewtonCholesky(model.parameters(), damping=1e-3)
    opt.state[model[0].weight]["curvature"] = torch.zeros(3, 3)  # wrong shape: a mis-loaded checkpoint
    guard, error = _watched_run(model, opt, steps=1)
    assert isinstance(error, RuntimeError) and guard.incidents == []


class _NoneUnsafeSGD(torch.optim.Optimizer):
    """SGD that reads every parameter's gradient without checking for None (SGD-HD does)."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def test_a_blocked_update_of_an_optimizer_that_needs_every_gradient_is_skipped_cleanly(one_thread):
    """The guard blocks an update by setting the gradients aside; an optimizer that reads them unconditionally
    then raises inside step(). That update was not to happen anyway: the step ends as skipped, the weights are
    as before it, and training goes on (the error is not the user's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _NoneUnsafeSGD(model.parameters())
    g = torch.Generator().manual_seed(1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(4):
            x = torch.randn(16, 4, generator=g)
            if step == 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.mse_loss(model(x), torch.randn(16, 1, generator=g)).backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if step == 1:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                assert all(p.grad is not None for p in model.parameters())  # given back after the step
    assert [(i.step, i.kind, i.action) for i in _blocking(guard)] == [(1, "nonfinite_input", "skipped")]
    assert guard.step == 4 and all(torch.isfinite(p).all() for p in model.parameters())


class _RunawayLR(torch.optim.Optimizer):
    """An optimizer that writes its own learning rate (x1e45 from its second step: a runaway schedule inside step())."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, updates=0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group["updates"] >= 1:
                group["lr"] *= 1e45
            group["updates"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad * group["lr"])


def test_undoing_a_failed_update_also_undoes_the_settings_its_step_wrote(one_thread):
    """step() writes the group's lr and a counter; the update it makes overflows at step 1 and is undone: the
    weights, and the group's lr and counter too, are as before the step (a skipped update leaves the optimizer
    as it was)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _RunawayLR(model.parameters())
    g = torch.Generator().manual_seed(1)
    cfg = nantrace.Config(outputs={"print_incidents": False}, detection={"detect_divergence": False})
    seen = []
    with nantrace.watch(model, opt, config=cfg) as guard:
        for step in range(2):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(16, 4, generator=g)), torch.randn(16, 1, generator=g)).backward()
            group = opt.param_groups[0]
            settings = (group["lr"], group["updates"])
            opt.step()
            seen.append((settings, (group["lr"], group["updates"])))
    (inc,) = _blocking(guard)
    assert (inc.step, inc.kind, inc.phase, inc.cause, inc.action) == (1, "nonfinite_param", "optimizer", "overflow", "skipped")
    assert seen[1][1] == seen[1][0] == (0.01, 1), seen


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_the_step_wrapper_is_transparent_to_lr_schedulers_and_removed_on_close(one_thread, scheduler_first):
    """The guard sees an exception escaping optimizer.step() through a wrapper on the instance (declared by its
    patch label): an LR scheduler made before watch() does not warn that the step was overridden, one made
    after can still wrap it, and close() leaves the optimizer's attributes as they were."""
    from nantrace import patches

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler_first else None
    held = dict(vars(opt))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
        assert any(line.startswith("SGD.step") for line in patches.installed())
        if sched is None:
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            sched.step()
        guard.close()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025) and guard.step == 2 and guard.incidents == []
    assert not any(line.startswith("SGD.step") for line in patches.installed())
    if scheduler_first:
        assert vars(opt).get("step") is held["step"]
