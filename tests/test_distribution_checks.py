"""torch.distributions' checks and hand-written log-softmaxes (localisation/exceptions, diagnosis/classify).

Mechanisms:

* a Python check (a distribution's argument validation) that rejects a value holding NaN/Inf: the origin of that
  value by the usual non-finite path (dataflow back to the op that made the NaN, an op with -inf operands and a
  NaN output included), classified as a NaN loss would be (``exceptions._nonfinite_rejected``);
* ``x - logsumexp(x)`` over a row that is entirely -inf: ``masked_softmax_all``, like a ``log_softmax`` of it
  (``classify._normaliser_of_masked_rows``); a shift by the row's maximum (``x - amax(x)`` before an ``exp``) and a
  difference of two masked tensors with no row reduction stay ``inf_arithmetic`` (the cause matrix's
  ``inf_minus_inf`` and its oracle);
* a finite value outside a distribution's support: ``domain_error`` at the first op whose output violates the
  constraint where its inputs held no such value: an add of 0, a non-binding clamp, a stack/cat only carry it
  (``exceptions._violation_maker``).

Each construction is checked with plain torch (``test_construction``): the step at which it fails, how, and the
op and line that made the bad value (a dispatch mode of this file).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import distributions as D
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from heldout_harness import Judge, Program, assert_diagnosis, sgd, steps, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread", "distributions_validate")]  # an earlier torch.compile turns it off

FAIL = 2
JUDGE = Judge(__file__)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ 1. a masked Categorical inside the model
class Policy(nn.Module):
    def __init__(self, validate: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        self.validate = validate

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> D.Categorical:
        logits = self.net(obs).masked_fill(~legal, float("-inf"))
        return D.Categorical(logits=logits, validate_args=self.validate)  # <origin:policy_cat>


class Agent(nn.Module):
    def __init__(self, validate: bool = True) -> None:
        super().__init__()
        self.policy = Policy(validate)
        self.value = nn.Linear(6, 1)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[D.Categorical, torch.Tensor]:
        return self.policy(obs, legal), self.value(obs).squeeze(-1)


def _legal_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        legal = torch.rand(8, 4, generator=g) > 0.5
        legal[:, 1] = True
        return torch.randn(8, 6, generator=g), legal, torch.ones(8, dtype=torch.long)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, legal, act = normal(s)
        legal[3] = False  # a game-over state: no legal move
        return obs, legal, act

    return steps(normal, bad, FAIL, 4)


def a2c_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, legal, act = batch
    dist, value = model(obs, legal)
    return -(dist.log_prob(act) * (1.0 - value.detach())).mean() + value.pow(2).mean()


def _agent(validate: bool) -> Program:
    torch.manual_seed(0)
    model = Agent(validate)
    return Program(model, sgd(model), _legal_batches(1601), a2c_loss)


# ------------------------------------------------------------------ 2. hand-written log-softmaxes
class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _candidate_batches(seed: int) -> list[Any]:
    g = _gen(seed)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = torch.rand(10, 6, generator=g) > 0.3
        valid[:, 0] = True
        return torch.randn(10, 5, generator=g), valid, torch.zeros(10, dtype=torch.long)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, valid, target = normal(s)
        valid[6] = False  # a query whose candidates were all filtered out
        return x, valid, target

    return steps(normal, bad, FAIL, 4)


def listwise_lse_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, valid, target = batch
    s = model(x).masked_fill(~valid, float("-inf"))
    logp = s - torch.logsumexp(s, dim=1, keepdim=True)  # <origin:lse_sub>
    return -logp.gather(1, target[:, None]).mean()


def listwise_amax_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, valid, target = batch
    s = model(x).masked_fill(~valid, float("-inf"))
    z = s - s.amax(-1).unsqueeze(-1)  # <origin:amax_sub>
    p = z.exp() / z.exp().sum(-1, keepdim=True)
    return -torch.log(p.gather(1, target[:, None]) + 1e-9).mean()


def ratio_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, valid, target = batch
    new = model(x).masked_fill(~valid, float("-inf"))
    old = (model(x).detach() * 0.9).masked_fill(~valid, float("-inf"))
    log_ratio = new - old  # <origin:ratio_sub>
    return log_ratio.gather(1, target[:, None]).exp().mean()


def _scorer(loss: Callable) -> Program:
    torch.manual_seed(0)
    model = Scorer()
    return Program(model, sgd(model), _candidate_batches(1602), loss)


# ------------------------------------------------------------------ 3. a concentration that underflowed to 0
class TopicEncoder(nn.Module):
    """Two heads of Dirichlet concentrations (shared / private topics), concatenated, plus an eps of 0."""

    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.shared = nn.Linear(12, 3)
        self.private = nn.Linear(12, 2)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.softplus(self.shared(x))  # <origin:topic_softplus>
        b = F.softplus(self.private(x)).clamp(max=1e4)
        return torch.cat([a, b], -1) + self.eps


def topic_loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    alpha = model(x)
    q = D.Dirichlet(alpha)
    return -q.entropy().mean() + 0.1 * alpha.mean()


def _topic() -> Program:
    torch.manual_seed(0)
    model = TopicEncoder()
    with torch.no_grad():
        model.shared.weight.fill_(-0.05)
        model.shared.bias.fill_(0.5)
    g = _gen(1603)

    def normal(s: int) -> torch.Tensor:
        return torch.rand(8, 12, generator=g)

    def bad(s: int) -> torch.Tensor:
        x = normal(s)
        x[5] = 5e3  # raw word counts instead of frequencies
        return x

    return Program(model, sgd(model, 1e-3), steps(normal, bad, FAIL, 4), topic_loss)


class KumaraswamyLikeActor(nn.Module):
    """A Beta actor whose two concentrations are stacked by Beta itself: the first one underflows."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Linear(4, 1)
        self.c0 = nn.Linear(4, 1)

    def forward(self, obs: torch.Tensor) -> D.Beta:
        c1 = F.softplus(self.c1(obs)).squeeze(-1)  # <origin:beta_c1>
        c0 = F.softplus(self.c0(obs)).squeeze(-1) + 0.5
        return D.Beta(c1 * 1.0, c0)


def beta_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, act = batch
    return -model(obs).log_prob(act).mean()


def _beta() -> Program:
    torch.manual_seed(0)
    model = KumaraswamyLikeActor()
    with torch.no_grad():
        model.c1.weight.fill_(0.1)
        model.c1.bias.fill_(1.0)
    g = _gen(1604)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 4, generator=g), torch.rand(8, generator=g) * 0.8 + 0.1

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        obs, act = normal(s)
        obs[2] = -4000.0  # an unscaled sensor reading
        return obs, act

    return Program(model, sgd(model, 1e-3), steps(normal, bad, FAIL, 4), beta_loss)


# ------------------------------------------------------------------ 4. NEGATIVE: a finite value of the wrong sign
class SignedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(3, 1)
        self.s = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> D.Normal:
        scale = torch.tanh(self.s(x))  # <origin:tanh_scale>
        return D.Normal(self.mu(x).squeeze(-1), scale.clamp(max=5.0).squeeze(-1))


def regression_nll(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    return -model(x).log_prob(y).mean()


def _signed() -> Program:
    torch.manual_seed(0)
    model = SignedScale()
    with torch.no_grad():
        model.s.weight.fill_(0.5)
        model.s.bias.fill_(2.0)
    g = _gen(1605)

    def normal(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(6, 3, generator=g), torch.randn(6, generator=g)

    def bad(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = normal(s)
        x[1] = -4.0  # a centred feature where the model expects [0, 1]: tanh(-4) < 0 (no NaN anywhere)
        return x, y

    return Program(model, sgd(model, 1e-3), steps(normal, bad, FAIL, 4), regression_nll)


def _raised(op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want("exception", "forward", op, module, tag, cause, step=FAIL, action="raised")


def _loss(op: str, module: str | None, tag: str, cause: str) -> Want:
    return Want("nonfinite_loss", "forward", op, module, tag, cause, step=FAIL)


CASES: dict[str, tuple[Callable[[], Program], Want, str]] = {
    # (build, diagnosis, what plain torch sees: "nan" = the first NaN-making op, "support" = the op that made the
    # rejected finite value)
    "categorical_in_model_all_actions_masked_raises":
        (lambda: _agent(True), _raised("aten.sub.Tensor", "policy", "policy_cat", "masked_softmax_all"), "nan"),
    "categorical_in_model_all_actions_masked_validation_off":
        (lambda: _agent(False), _loss("aten.sub.Tensor", "policy", "policy_cat", "masked_softmax_all"), "nan"),
    "listwise_x_minus_logsumexp_all_candidates_filtered":
        (lambda: _scorer(listwise_lse_loss), _loss("aten.sub.Tensor", None, "lse_sub", "masked_softmax_all"), "nan"),
    "listwise_x_minus_amax_then_exp_all_candidates_filtered":
        (lambda: _scorer(listwise_amax_loss), _loss("aten.sub.Tensor", None, "amax_sub", "inf_arithmetic"), "nan"),
    "negative_masked_log_ratio_no_row_reduction_stays_inf_arithmetic":
        (lambda: _scorer(ratio_loss), _loss("aten.sub.Tensor", None, "ratio_sub", "inf_arithmetic"), "nan"),
    "dirichlet_softplus_underflow_carried_by_cat_and_add_of_zero":
        (_topic, _raised("aten.softplus.default", "", "topic_softplus", "domain_error"), "support"),
    "beta_softplus_underflow_carried_by_view_mul_one_and_stack":
        (_beta, _raised("aten.softplus.default", "", "beta_c1", "domain_error"), "support"),
    "negative_normal_scale_of_wrong_sign_is_domain_error_at_tanh":
        (_signed, _raised("aten.tanh.default", "", "tanh_scale", "domain_error"), "support"),
}


# ------------------------------------------------------------------ plain-torch construction checks
class _Where(TorchDispatchMode):
    """Records, for the first op that qualifies (:meth:`hit`), its name, the innermost module and this file's line."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.found: tuple[str, str | None, int | None] | None = None

    def __enter__(self) -> "_Where":
        self._hooks = (nn.modules.module.register_module_forward_pre_hook(self._push),
                       nn.modules.module.register_module_forward_hook(self._pop))
        return super().__enter__()

    def _push(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), "?"))

    def _pop(self, module: nn.Module, args: Any, out: Any) -> None:
        self.stack.pop()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _where(self) -> tuple[str | None, int | None]:
        frame, line = sys._getframe(), None
        while frame is not None:
            if frame.f_code.co_filename == __file__ and frame.f_code.co_name not in ("_where", "__torch_dispatch__") \
                    and line is None:
                line = frame.f_lineno
            frame = frame.f_back
        mods = [n for n in self.stack if n != "?"]
        return (mods[-1] if mods else None), line

    def hit(self, ins: list[torch.Tensor], nums: list[float], outs: list[torch.Tensor]) -> bool:
        raise NotImplementedError

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        ins = [t.detach().clone() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
        nums = [x for x in flat if isinstance(x, float)]
        out = func(*args, **kwargs)
        if self.found is None:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if self.hit(ins, nums, outs):
                self.found = (str(func), *self._where())
        return out


class FirstNaN(_Where):
    """The first op whose output holds a NaN its inputs did not."""

    def hit(self, ins: list[torch.Tensor], nums: list[float], outs: list[torch.Tensor]) -> bool:
        return any(bool(t.isnan().any()) for t in outs) and not any(bool(t.isnan().any()) for t in ins) \
            and all(math.isfinite(x) or math.isinf(x) for x in nums)


class FirstMaker(_Where):
    """The first op whose output holds one of ``rejected`` (the values <= 0 a positivity check refused) that none of
    its inputs (nor its scalar arguments) held: the op that computed it rather than carried it."""

    def __init__(self, model: nn.Module, rejected: torch.Tensor) -> None:
        super().__init__(model)
        self.rejected = rejected

    def hit(self, ins: list[torch.Tensor], nums: list[float], outs: list[torch.Tensor]) -> bool:
        for t in outs:
            made = t[torch.isin(t, self.rejected)]
            if not made.numel():
                continue
            held = torch.zeros_like(made, dtype=torch.bool)
            for i in ins:
                held |= torch.isin(made, i.flatten().to(made.dtype))
            held |= torch.isin(made, torch.tensor(nums, dtype=made.dtype)) if nums else held
            if not bool(held.all()):
                return True
        return False


def _rejected_by_torch(exc: ValueError) -> torch.Tensor:
    """The values <= 0 of the tensor torch.distributions' check rejected (its ``value`` local)."""
    tb, value = exc.__traceback__, None
    while tb is not None:
        local = tb.tb_frame.f_locals.get("value")
        if isinstance(local, torch.Tensor) and "distributions" in tb.tb_frame.f_code.co_filename:
            value = local
        tb = tb.tb_next
    assert value is not None
    value = value.detach()
    return value[value <= 0].unique()


def _plain(build: Callable[[], Program], probe: str) -> tuple[int | None, str | None, tuple[Any, ...] | None]:
    """The step at which the program fails without nantrace ("raised" / "loss"), and the op, module and line of the
    first bad value at that step from a re-run from the same state."""
    program = build()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        opt.zero_grad()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        how, rejected = None, None
        try:
            loss = program.loss(model, batch, step)
            if not bool(torch.isfinite(loss)):
                how = "loss"
            else:
                loss.backward()
        except ValueError as exc:
            how = "raised"
            rejected = _rejected_by_torch(exc) if probe == "support" else None
        if how is not None:
            model.load_state_dict(state)
            mode = FirstNaN(model) if probe == "nan" else FirstMaker(model, rejected)
            try:
                with mode:
                    program.loss(model, batch, step)
            except ValueError:
                pass
            return step, how, mode.found
        opt.step()
    return None, None, None


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    build, want, probe = CASES[name]
    step, how, found = _plain(build, probe)
    assert (step, how) == (FAIL, "raised" if want.kind == "exception" else "loss"), (step, how)
    assert found == (want.op, want.module, JUDGE.marked(want.tag)[1]), found


@pytest.mark.parametrize("mode", ["zero_intrusive", "replayable"])
@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis(name: str, mode: str) -> None:
    build, want, _ = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)
