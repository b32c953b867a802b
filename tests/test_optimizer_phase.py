"""The optimizer phase (issue 11, item 3): an update that makes a parameter or the optimizer
state non-finite is caught at its own step, named (parameter, state tensor, op, cause) and does
not survive under any policy; a parameter corrupted between steps is ``nonfinite_param`` with
phase ``None``, never blamed on the optimizer."""

from __future__ import annotations

import math
import os

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
