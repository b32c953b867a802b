"""A NaN that ends in an exception (a value check that raises) gets the same diagnosis as one
that ends in a NaN loss, however the loop meets the exception.

The value checks raise from Python code (``torch.distributions``' argument validation, in the
loss code or inside the model's forward) or from an op (``torch.multinomial``). The loop lets the
exception leave a ``with guard:`` block, closes the guard in ``try/finally`` as it propagates, or
catches it and trains on; the loss code is called as is (zero-code) or through
``guard.replayable``. Each run must record exactly one incident, with the origin of the NaN, and
leave the user's exception as it was. Exceptions that have nothing to do with a value (a shape
mismatch, a missing key) record nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

FAIL_STEP = 2
STEPS = 5


@dataclasses.dataclass
class Program:
    """A small training program: its model, optimizer, batches and loss code (``loss_fn(model, batch)``)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    batches: list[Any]
    loss_fn: Callable[..., torch.Tensor]
    """``loss_fn(model, batch, check=True)``: ``check=False`` leaves the value check out, so the same
    NaN ends in a NaN loss instead of an exception."""
    fail_step: int = FAIL_STEP


@dataclasses.dataclass(frozen=True)
class Want:
    """The diagnosis a failing program must get (kind ``exception``, action ``raised``)."""

    op: str
    module: str | None
    cause: str
    tag: str
    python_check: bool
    """The value check is Python code in the loss code: the zero-code guard sees it only while it propagates."""


# ---------------------------------------------------------------- PPO: observations normalised without eps
class ObsNorm(nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs - obs.mean(0, keepdim=True)) / obs.std(0, keepdim=True)  # <origin:obs_norm>


class GaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.obs_norm = ObsNorm()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.mu = nn.Linear(32, 2)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(self.body(self.obs_norm(obs))), self.log_std.exp()


def ppo_loss(model: nn.Module, batch: Any, check: bool = True, clip: float = 0.2) -> torch.Tensor:
    obs, act, adv, old_logp = batch
    mu, std = model(obs)
    dist = torch.distributions.Normal(mu, std, validate_args=check)  # (another test may turn the default off)
    ratio = torch.exp(dist.log_prob(act).sum(-1) - old_logp)
    return -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()


def ppo() -> Program:
    """A rollout at step ``FAIL_STEP`` has a dead sensor (constant 0): its std is 0, the normalised value 0/0."""
    torch.manual_seed(0)
    model = GaussianPolicy()
    g = torch.Generator().manual_seed(1)
    batches = []
    for step in range(STEPS):
        obs = torch.randn(16, 6, generator=g)
        if step == FAIL_STEP:
            obs[:, 2] = 0.0
        batches.append((obs, torch.randn(16, 2, generator=g), torch.randn(16, generator=g),
                        -2.0 + 0.1 * torch.randn(16, generator=g)))
    return Program(model, torch.optim.Adam(model.parameters(), lr=3e-4), batches, ppo_loss)


# ---------------------------------------------------------------- VAE: the log of a raw linear variance
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.mu = nn.Linear(32, 4)
        self.var = nn.Linear(32, 4)
        with torch.no_grad():
            self.var.bias.fill_(1.0)  # positive on normalised inputs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mu(h), torch.log(self.var(h))  # <origin:vae_logvar>


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 10))
        self.validate = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encoder(x)
        std = torch.exp(0.5 * logvar)
        posterior = torch.distributions.Normal(mu, std, validate_args=self.validate)  # a check inside the forward
        return self.decoder(posterior.rsample()), mu, logvar


def vae_loss(model: nn.Module, x: torch.Tensor, check: bool = True) -> torch.Tensor:
    model.validate = check
    recon, mu, logvar = model(x)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()
    return nn.functional.mse_loss(recon, x) + kl


def vae() -> Program:
    """At step ``FAIL_STEP`` a batch arrives unnormalised (raw units): the linear variance turns negative."""
    torch.manual_seed(0)
    model = VAE()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(16, 10, generator=g) * (300.0 if step == FAIL_STEP else 0.05) for step in range(STEPS)]
    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, vae_loss)


# ---------------------------------------------------------------- a policy over items: log of raw rates
class RateHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 5)
        with torch.no_grad():
            self.linear.bias.fill_(2.0)  # positive rates on normalised inputs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(self.linear(h))  # <origin:log_rates>


class ItemPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = RateHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def categorical_loss(model: nn.Module, batch: Any, check: bool = True) -> torch.Tensor:
    x, action, reward = batch
    dist = torch.distributions.Categorical(logits=model(x), validate_args=check)
    return -(dist.log_prob(action) * reward).mean()


def multinomial_loss(model: nn.Module, batch: Any, check: bool = True) -> torch.Tensor:
    x, action, reward = batch
    log_probs = torch.log_softmax(model(x), -1)
    action = torch.multinomial(log_probs.exp(), 1) if check else action[:, None]  # an op that validates its input
    return -(log_probs.gather(1, action).squeeze(1) * reward).mean()


def item_policy(loss_fn: Callable[..., torch.Tensor]) -> Callable[[], Program]:
    def build() -> Program:
        """At step ``FAIL_STEP`` the features arrive unscaled: some linear rates turn negative."""
        torch.manual_seed(0)
        model = ItemPolicy()
        g = torch.Generator().manual_seed(3)
        batches = [(torch.randn(32, 8, generator=g) * (500.0 if step == FAIL_STEP else 0.05),
                    torch.randint(0, 5, (32,), generator=g), torch.randn(32, generator=g)) for step in range(STEPS)]
        return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches, loss_fn)
    return build


# ------------------------------------------ SFT: a batch whose labels are all masked, domains sampled by loss
VOCAB = 12


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def sft_loss(model: nn.Module, batch: Any, check: bool = True) -> torch.Tensor:
    tokens, labels, domain_losses = batch
    logits = model(tokens)
    summed = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    loss = summed / (labels != -100).sum()  # <origin:sft_mean>
    if check:  # the next batch's domain, drawn in proportion to the losses (a value check on its input)
        torch.multinomial(torch.softmax(torch.cat([domain_losses, loss.detach()[None]]), 0), 1)
    return loss


def sft() -> Program:
    """At step ``FAIL_STEP`` every answer was truncated away: all labels are -100, the mean 0/0."""
    torch.manual_seed(0)
    model = TinyLM()
    g = torch.Generator().manual_seed(5)
    batches = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4, 10), generator=g)
        labels = tokens.clone()
        labels[:, : 10 if step == FAIL_STEP else 6] = -100  # the prompt is not trained on
        batches.append((tokens, labels, torch.tensor([2.0, 2.5])))
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, sft_loss)


# ------------------------------------- a diverging classifier whose loss code samples through a naive softmax
class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def naive_softmax_loss(model: nn.Module, batch: Any, check: bool = True) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    e = logits.exp()  # <origin:naive_exp>
    probs = e / e.sum(-1, keepdim=True)  # no max subtracted: exp overflows once the logits pass ~88
    if check:
        torch.multinomial(probs, 1)  # e.g. a sampled auxiliary target
    return F.cross_entropy(logits, y) + 1e-3 * probs.max(-1).values.mean()  # a confidence penalty


def diverging() -> Program:
    """A learning rate far too high: the loss grows ×2.7 a step until exp overflows at the last step."""
    torch.manual_seed(0)
    model = Classifier()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=g), torch.randint(0, 5, (32,), generator=g)) for _ in range(STEPS)]
    return Program(model, torch.optim.SGD(model.parameters(), lr=8.0, momentum=0.9), batches, naive_softmax_loss,
                   fail_step=4)


# ---------------------------------------------------------------- failures that are not about a value
def regression_program(loss_fn: Callable[..., torch.Tensor]) -> Callable[[], Program]:
    def build() -> Program:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        g = torch.Generator().manual_seed(4)
        batches = []
        for step in range(STEPS):
            width = 3 if step == FAIL_STEP else 2  # a batch of the wrong task, under another key
            batch = {"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, width, generator=g)}
            if step == FAIL_STEP:
                batch["target"] = batch.pop("y")
            batches.append(batch)
        return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches, loss_fn)
    return build


def mse_on_mismatched_shape(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    y = batch.get("y", batch.get("target"))
    return (model(batch["x"]) - y).pow(2).mean()  # (16, 2) - (16, 3) at the failing step


def mse_on_missing_key(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).pow(2).mean()  # KeyError at the failing step


NUMERICAL: dict[str, tuple[Callable[[], Program], Want]] = {
    "ppo_obsnorm_dead_sensor": (ppo, Want("aten.div.Tensor", "obs_norm", "zero_variance_norm", "obs_norm", True)),
    "vae_log_linear_variance": (vae, Want("aten.log.default", "encoder", "log_nonpositive", "vae_logvar", False)),
    "policy_categorical_log_rates": (item_policy(categorical_loss),
                                     Want("aten.log.default", "head", "log_nonpositive", "log_rates", True)),
    "policy_multinomial_log_rates": (item_policy(multinomial_loss),
                                     Want("aten.log.default", "head", "log_nonpositive", "log_rates", False)),
    # the evidence the NaN path weighs too: labels all ignored, the run's history
    "sft_all_labels_masked": (sft, Want("aten.div.Tensor", None, "label_out_of_range", "sft_mean", False)),
    "diverging_naive_softmax": (diverging, Want("aten.exp.default", None, "exp_overflow", "naive_exp", False)),
}
UNRELATED: dict[str, Callable[[], Program]] = {
    "shape_mismatch": regression_program(mse_on_mismatched_shape),
    "missing_key": regression_program(mse_on_missing_key),
}


# ---------------------------------------------------------------- the loops
def _quiet() -> nantrace.Config:
    return nantrace.Config(outputs={"print_incidents": False})


def _train_step(prog: Program, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> None:
    prog.opt.zero_grad()
    loss = loss_fn(prog.model, batch)
    loss.backward()
    prog.opt.step()


def _loss_code(guard: nantrace.Guard, prog: Program, replayable: bool) -> Callable[[nn.Module, Any], torch.Tensor]:
    return guard.replayable(prog.loss_fn) if replayable else prog.loss_fn


def loop_with_guard(prog: Program, replayable: bool) -> tuple[nantrace.Guard, BaseException, int]:
    """``with nantrace.watch(...) as guard:`` around the loop; the exception leaves the block."""
    step = 0
    with pytest.raises(Exception) as raised:
        with nantrace.watch(prog.model, prog.opt, config=_quiet()) as guard:
            loss_fn = _loss_code(guard, prog, replayable)
            for step, batch in enumerate(prog.batches):
                _train_step(prog, loss_fn, batch)
    return guard, raised.value, step


def loop_try_finally(prog: Program, replayable: bool) -> tuple[nantrace.Guard, BaseException, int]:
    """The guard is closed in ``finally`` while the exception propagates to the caller."""
    step = 0
    guard = nantrace.watch(prog.model, prog.opt, config=_quiet())
    loss_fn = _loss_code(guard, prog, replayable)
    with pytest.raises(Exception) as raised:
        try:
            for step, batch in enumerate(prog.batches):
                _train_step(prog, loss_fn, batch)
        finally:
            guard.close()
    return guard, raised.value, step


def loop_caught(prog: Program, replayable: bool) -> tuple[nantrace.Guard, BaseException, int]:
    """The loop catches the exception, skips the batch and trains on; the guard is closed at the end."""
    guard = nantrace.watch(prog.model, prog.opt, config=_quiet())
    loss_fn = _loss_code(guard, prog, replayable)
    failures: list[tuple[int, BaseException]] = []
    for step, batch in enumerate(prog.batches):
        try:
            _train_step(prog, loss_fn, batch)
        except Exception as exc:  # log it and go on
            failures.append((step, exc))
    guard.close()
    assert len(failures) == 1, failures
    assert all(bool(torch.isfinite(p).all()) for p in prog.model.parameters())
    return guard, failures[0][1], failures[0][0]


def loop_caught_stop(prog: Program, replayable: bool) -> tuple[nantrace.Guard, BaseException, int]:
    """The loop catches the exception and stops training (``break``); the guard is closed afterwards,
    when no exception is in flight any more."""
    guard = nantrace.watch(prog.model, prog.opt, config=_quiet())
    loss_fn = _loss_code(guard, prog, replayable)
    failure: tuple[int, BaseException] | None = None
    try:
        for step, batch in enumerate(prog.batches):
            try:
                _train_step(prog, loss_fn, batch)
            except Exception as exc:  # log it and stop
                failure = (step, exc)
                break
    finally:
        guard.close()
    assert failure is not None
    return guard, failure[1], failure[0]


LOOPS = {"with_guard": loop_with_guard, "try_finally": loop_try_finally, "caught": loop_caught,
         "caught_stop": loop_caught_stop}


def baseline_exception(build: Callable[[], Program]) -> tuple[BaseException, int]:
    """The exception the program raises without nantrace, and the step."""
    prog = build()
    for step, batch in enumerate(prog.batches):
        try:
            _train_step(prog, prog.loss_fn, batch)
        except Exception as exc:
            return exc, step
    raise AssertionError("the program does not fail without nantrace")


def user_frames(exc: BaseException) -> list[tuple[str, int | None]]:
    """The frames of this file in ``exc``'s traceback below the loop that caught it (a
    ``replayable`` wrapper's frame, in nantrace, left out)."""
    return [(f.name, f.lineno) for f in traceback.extract_tb(exc.__traceback__)[1:] if f.filename == __file__]


def assert_unchanged(exc: BaseException, baseline: BaseException) -> None:
    """The same type and message as without nantrace, raised from the same user code."""
    assert type(exc) is type(baseline) and str(exc) == str(baseline), (exc, baseline)
    assert not isinstance(exc, nantrace.NonFiniteError)
    assert user_frames(exc) == user_frames(baseline) != []


def _cases() -> list[Any]:
    cases = []
    for name, (_, want) in NUMERICAL.items():
        for loop in LOOPS:
            for replayable in (False, True):
                cases.append(pytest.param(name, loop, replayable,
                                          id=f"{name}-{loop}-{'replayable' if replayable else 'zero_code'}"))
    return cases


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("name, loop, replayable", _cases())
def test_a_nan_that_ends_in_an_exception_gets_its_origin_and_cause(name: str, loop: str, replayable: bool,
                                                                  one_thread: None) -> None:
    """One incident at the failing step naming the NaN's origin (not the check that raised), and
    the user's exception unchanged."""
    build, want = NUMERICAL[name]
    baseline, baseline_step = baseline_exception(build)
    prog = build()  # built after the baseline ran: build() seeds the global RNG the VAE samples from
    assert baseline_step == prog.fail_step
    guard, exc, step = LOOPS[loop](prog, replayable)
    assert step == prog.fail_step
    assert_unchanged(exc, baseline)
    assert len(guard.incidents) == 1, [(i.step, i.kind, i.cause) for i in guard.incidents]
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        prog.fail_step, "exception", "forward", want.op, want.module, want.cause, "raised"), inc.summary
    assert points_at(inc.source, __file__, want.tag)
    # a Python check of torch.distributions' is seen as it raises (patches.VALUE_CHECK_FUNCTIONS), even when caught
    assert inc.details["exception"].startswith(type(exc).__name__)


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("name", list(UNRELATED))
def test_an_exception_that_is_not_about_a_value_records_nothing(name: str, replayable: bool, loop: str,
                                                               one_thread: None) -> None:
    build = UNRELATED[name]
    baseline, _ = baseline_exception(build)
    guard, exc, step = LOOPS[loop](build(), replayable)
    assert step == FAIL_STEP
    assert_unchanged(exc, baseline)
    assert guard.incidents == [], [(i.step, i.kind, i.cause, i.summary) for i in guard.incidents]


@pytest.mark.parametrize("name", list(NUMERICAL))
def test_the_exception_path_and_the_nan_path_agree_on_the_cause(name: str, one_thread: None) -> None:
    """Without the value check the same NaN ends in a NaN loss, diagnosed by the NaN path: the
    exception path must name the same op, module, line and cause."""
    build, want = NUMERICAL[name]
    prog = build()
    guard = nantrace.watch(prog.model, prog.opt, config=_quiet())
    loss_fn = guard.replayable(functools.partial(prog.loss_fn, check=False))
    try:
        for batch in prog.batches:
            _train_step(prog, loss_fn, batch)
    finally:
        guard.close()
    [inc] = guard.incidents
    assert (inc.step, inc.op, inc.module, inc.cause, inc.action) == (
        prog.fail_step, want.op, want.module, want.cause, "skipped"), inc.summary
    assert points_at(inc.source, __file__, want.tag)


# ------------------------------- a covariance that is not positive definite: a Python check reads cholesky_ex's info
class BatchDensity(nn.Module):
    """Scores the batch under a Gaussian fitted to it (the batch's own covariance)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        mvn = torch.distributions.MultivariateNormal(  # <origin:mvn_in_model>
            z.mean(0), covariance_matrix=torch.cov(z.t()), validate_args=True)
        return -mvn.log_prob(z).mean()


class DensityModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
        self.density = BatchDensity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.density(self.embed(x))


def density_in_model_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def density_program() -> Program:
    """At step ``FAIL_STEP`` the last, partial batch has 3 samples for 4 features: the covariance is singular."""
    torch.manual_seed(0)
    model = DensityModel()
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(3 if step == FAIL_STEP else 32, 6, generator=g) for step in range(STEPS)]
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches, density_in_model_loss)


def mvn_loss_code(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    z = model(x)
    mvn = torch.distributions.MultivariateNormal(z.mean(0), covariance_matrix=torch.cov(z.t()),  # <origin:mvn_loss>
                                                 validate_args=True)
    return -mvn.log_prob(z).mean()


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_python_check_on_a_failed_decomposition_names_the_decomposition(replayable: bool, loop: str,
                                                                          one_thread: None) -> None:
    """torch.distributions' ``positive_definite`` check raises ValueError on finite values after
    ``linalg_cholesky_ex`` returned a non-zero ``info``: the incident names that decomposition, the
    module it ran in and the user's line, not just the message."""
    build = density_program
    baseline, _ = baseline_exception(build)
    guard, exc, step = LOOPS[loop](build(), replayable)
    assert step == FAIL_STEP
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.linalg_cholesky_ex.default", "density", "domain_error", "raised"), \
        inc.summary
    assert points_at(inc.source, __file__, "mvn_in_model")
    assert "PositiveDefinite" in inc.details["exception"] and "not positive definite" in inc.summary


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_failed_decomposition_in_the_loss_code_of_a_step_caught_by_the_loop(replayable: bool,
                                                                              one_thread: None) -> None:
    """The same check in the loss code, the loop catches the ValueError and stops: zero-code, nantrace
    never saw it raise (Python code between two taped calls); close() replays the step that never
    reached backward() and finds the decomposition whose ``info`` was non-zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(3 if step == FAIL_STEP else 32, 6, generator=g) for step in range(STEPS)]
    prog = Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches, mvn_loss_code)
    guard, exc, step = loop_caught_stop(prog, replayable)
    assert step == FAIL_STEP and isinstance(exc, ValueError)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.linalg_cholesky_ex.default", None, "domain_error", "raised"), \
        inc.summary
    assert points_at(inc.source, __file__, "mvn_loss")


def rates_loss_with_own_check(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Poisson rate model whose loss code checks the rates itself (not torch.distributions)."""
    rates = model(x).squeeze(-1)
    log_rates = torch.log(rates)  # <origin:own_check_log>
    if not bool(torch.isfinite(log_rates).all()):
        raise FloatingPointError("non-positive Poisson rate")
    return (rates - x[:, 0] * log_rates).mean()


def poisson_rates() -> Program:
    """At step ``FAIL_STEP`` a batch arrives in raw units: the unbounded rate turns negative."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(5)
    batches = [torch.rand(16, 3, generator=g) * (400.0 if step == FAIL_STEP else 1.0) for step in range(STEPS)]
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches, rates_loss_with_own_check)


def test_a_users_own_check_caught_by_the_loop_is_diagnosed_at_close(one_thread: None) -> None:
    """A check written by the user raises from Python, where no hook of nantrace's sees it, and the loop
    catches it and stops: close() replays the step that never reached backward() and finds the bad value."""
    baseline, baseline_step = baseline_exception(poisson_rates)
    guard, exc, step = loop_caught_stop(poisson_rates(), False)
    assert step == baseline_step == FAIL_STEP
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.log.default", None, "log_nonpositive", "raised"), inc.summary
    assert points_at(inc.source, __file__, "own_check_log")
    assert inc.details["exception"] is None and "abandoned" in inc.details  # never seen raising


def test_a_step_left_before_backward_with_healthy_values_records_nothing(one_thread: None) -> None:
    """A forward under grad mode that never reaches backward() (an evaluation that forgot no_grad, a
    loop that stops on an error of its own) is not a numerical failure: close() replays it, finds no
    bad value, and records nothing."""
    prog = ppo()
    guard = nantrace.watch(prog.model, prog.opt, config=_quiet())
    for batch in prog.batches[:FAIL_STEP]:
        _train_step(prog, prog.loss_fn, batch)
    mu, std = prog.model(prog.batches[-1][0])  # grad on, training mode, no backward
    torch.distributions.Normal(mu, std, validate_args=True)
    guard.close()
    assert guard.incidents == []


@pytest.mark.parametrize("message, value", [
    ("Length of all samples has to be greater than 0, but found an element in 'lengths' that is <= 0", True),
    ("scale must be positive", True),
    ("probability tensor contains either `inf`, `nan` or element < 0", True),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)", False),
    ("Expected all tensors to be on the same device", False),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
])
def test_which_messages_read_as_a_value_check(message, value):
    from nantrace.localisation.exceptions import is_value_message

    assert is_value_message(message) is value


# =============================================================== the value behind the value an op raised on
# A raising op that received no NaN itself may still have been handed one: inside a decomposition's matrix
# (it raises on the integer ``info`` the decomposition made), or cast to an integer index (a NaN or -inf
# cast to int64 is INT64_MIN). The origin of that NaN is the diagnosis; finite values outside the op's
# domain (a singular matrix, a label out of range) stay domain_error / label_out_of_range at the op.
class RootFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)  # <origin:kernel_sqrt>


class KernelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = RootFeatures()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.features(x))


def kernel_cholesky_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    z = model(x)
    k = z @ z.t() + torch.eye(len(z))
    chol = torch.linalg.cholesky(k)  # <origin:kernel_cholesky>
    return (torch.cholesky_solve(y[:, None], chol) * y[:, None]).mean() + chol.diagonal().log().mean()


def kernel_program(*, singular: bool = False) -> Program:
    """At ``FAIL_STEP`` a feature is negative: sqrt makes NaN, the kernel matrix is NaN and Cholesky raises.
    ``singular``: the model has no bias and the batch is blank instead: the kernel is finite and singular."""
    torch.manual_seed(0)
    model = KernelNet()
    g = torch.Generator().manual_seed(11)
    batches = []
    for step in range(STEPS):
        x = torch.rand(8, 5, generator=g)
        if step == FAIL_STEP:
            x[3, 1] = -1.0
        batches.append((x, torch.randn(8, generator=g)))
    if singular:
        model = nn.Sequential(nn.Linear(5, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))
        batches[FAIL_STEP][0].zero_()
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches,
                   singular_gram_loss if singular else kernel_cholesky_loss)


def singular_gram_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    z = model(x)
    chol = torch.linalg.cholesky(z.t() @ z)  # <origin:gram_cholesky>
    return chol.diagonal().log().sum() + (z.sum(1) - y).pow(2).mean()


@pytest.mark.parametrize("loop", ["try_finally", "caught"])
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_decomposition_of_a_nan_matrix_names_the_origin_of_the_nan(replayable: bool, loop: str,
                                                                     one_thread: None) -> None:
    """linalg.cholesky raises through ``_linalg_check_errors`` on the integer ``info`` of a matrix that holds
    NaN: the NaN's origin (sqrt of a negative feature, in the model) is the diagnosis, not the decomposition."""
    baseline, _ = baseline_exception(kernel_program)
    guard, exc, step = LOOPS[loop](kernel_program(), replayable)
    assert step == FAIL_STEP and isinstance(exc, torch.linalg.LinAlgError)
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.sqrt.default", "features", "sqrt_negative", "raised"), inc.summary
    assert points_at(inc.source, __file__, "kernel_sqrt")


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_decomposition_of_a_finite_singular_matrix_is_still_a_domain_error(replayable: bool,
                                                                             one_thread: None) -> None:
    """Negative: a finite Gram matrix of a blank batch is singular (all zero): Cholesky's own domain error."""
    build = functools.partial(kernel_program, singular=True)
    baseline, _ = baseline_exception(build)
    guard, exc, step = loop_try_finally(build(), replayable)
    assert step == FAIL_STEP
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.linalg_cholesky_ex.default", None, "domain_error", "raised"), \
        inc.summary
    assert points_at(inc.source, __file__, "gram_cholesky")


def share_target_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The class is the share of successes, bucketed: 0 trials make 0/0, a NaN cast to int64."""
    x, successes, trials = batch
    share = successes / trials  # <origin:share_div>
    return F.cross_entropy(model(x), (share * 3).trunc().long())


class LogBucket(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.n = n
        self.emb = nn.Embedding(n, 4)

    def forward(self, sizes: torch.Tensor) -> torch.Tensor:
        bucket = torch.log(sizes).ceil().long().clamp(max=self.n - 1)  # <origin:size_log>
        return self.emb(bucket).mean(1)


class SizeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.size = LogBucket()
        self.head = nn.Linear(4, 3)

    def forward(self, sizes: torch.Tensor) -> torch.Tensor:
        return self.head(self.size(sizes))


def share_program(*, finite_out_of_range: bool = False) -> Program:
    """At ``FAIL_STEP`` an item has 0 trials (0/0 = NaN). ``finite_out_of_range``: instead, a share of -0.4
    (a refund counted as a negative success): the bucket is -1, a finite value out of range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(12)
    batches = []
    for step in range(STEPS):
        trials = torch.randint(5, 30, (10,), generator=g).float()
        successes = torch.floor(trials * torch.rand(10, generator=g) * 0.9)
        if step == FAIL_STEP:
            if finite_out_of_range:
                successes[4] = -0.4 * trials[4]
            else:
                successes[4], trials[4] = 0.0, 0.0
        batches.append((torch.randn(10, 6, generator=g), successes, trials))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches, share_target_loss)


def size_program() -> Program:
    """At ``FAIL_STEP`` an item of size 0: log(0) = -inf, its bucket INT64_MIN, and the embedding raises."""
    torch.manual_seed(0)
    model = SizeModel()
    g = torch.Generator().manual_seed(13)
    batches = []
    for step in range(STEPS):
        sizes = 1.0 + torch.rand(6, 5, generator=g) * 500
        if step == FAIL_STEP:
            sizes[1, 2] = 0.0
        batches.append((sizes, torch.randint(0, 3, (6,), generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches,
                   lambda m, b, check=True: F.cross_entropy(m(b[0]), b[1]))


@pytest.mark.parametrize("loop", ["try_finally", "caught"])
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_target_cast_from_nan_names_the_op_that_made_the_nan(replayable: bool, loop: str, one_thread: None) -> None:
    """cross_entropy raises on a target of INT64_MIN: the NaN share it was cast from (after trunc) is followed
    back to the division that made it."""
    baseline, _ = baseline_exception(share_program)
    guard, exc, step = LOOPS[loop](share_program(), replayable)
    assert step == FAIL_STEP and isinstance(exc, IndexError)
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.div.Tensor", None, "div_by_zero", "raised"), inc.summary
    assert points_at(inc.source, __file__, "share_div")


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_an_embedding_index_cast_from_minus_inf_names_the_log(replayable: bool, one_thread: None) -> None:
    """An embedding raises on an index of INT64_MIN: the -inf it was cast from (through ceil and clamp) is
    followed back to the log of 0 in the model."""
    baseline, _ = baseline_exception(size_program)
    guard, exc, step = loop_try_finally(size_program(), replayable)
    assert step == FAIL_STEP and isinstance(exc, IndexError)
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.log.default", "size", "log_nonpositive", "raised"), inc.summary
    assert points_at(inc.source, __file__, "size_log")


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_finite_label_out_of_range_is_still_label_out_of_range(replayable: bool, one_thread: None) -> None:
    """Negative: the target -1 was cast from a finite share (-0.4 * 3, truncated): no NaN behind it, so the
    label itself is the diagnosis."""
    build = functools.partial(share_program, finite_out_of_range=True)
    baseline, _ = baseline_exception(build)
    guard, exc, step = loop_try_finally(build(), replayable)
    assert step == FAIL_STEP and isinstance(exc, IndexError)
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.nll_loss_forward.default", None, "label_out_of_range", "raised"), \
        inc.summary
    assert "-1" in inc.summary


# ============================================== a NaN from the batch reaching a Python check in replayable loss code
def gaussian_nll_checked(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return -torch.distributions.Normal(model(x).squeeze(-1), 1.0, validate_args=True).log_prob(y).mean()


def missing_value_program() -> Program:
    """At ``FAIL_STEP`` a feature of the batch is missing (NaN): the model's output is NaN and Normal's
    validation raises on it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(14)
    batches = []
    for step in range(STEPS):
        x = torch.randn(12, 4, generator=g)
        if step == FAIL_STEP:
            x[5, 2] = float("nan")
        batches.append((x, torch.randn(12, generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches, gaussian_nll_checked)


@pytest.mark.parametrize("loop", ["try_finally", "caught"])
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_nan_batch_rejected_by_a_check_in_the_loss_code_is_the_batchs(replayable: bool, loop: str,
                                                                       one_thread: None) -> None:
    """The model's outputs were NaN (from the batch) before the loss code raised: with ``replayable`` the
    unit that raised returned nothing, so the model's outputs are judged as its forward returns them."""
    baseline, _ = baseline_exception(missing_value_program)
    guard, exc, step = LOOPS[loop](missing_value_program(), replayable)
    assert step == FAIL_STEP and isinstance(exc, ValueError)
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.source, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "data", None, None, None, "nonfinite_input", "raised"), inc.summary


# =================================================== a finite value rejected by a Python check, through a view
class ScaleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc.bias.fill_(0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(h)).flatten()  # <origin:scale_relu>


class HeteroscedasticNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 8)
        self.mu = nn.Linear(8, 1)
        self.scale_head = ScaleHead()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mu(h).flatten(), self.scale_head(h)


def heteroscedastic_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    mu, scale = model(x)
    return -torch.distributions.Normal(mu, scale, validate_args=True).log_prob(y).mean()


def scale_program() -> Program:
    """At ``FAIL_STEP`` one input drives the scale head below 0: its ReLU is exactly 0 (finite), viewed by
    ``flatten``, and Normal's validation in the loss code rejects the scale."""
    torch.manual_seed(0)
    model = HeteroscedasticNet()
    g = torch.Generator().manual_seed(15)
    with torch.no_grad():  # the input whose hidden state points against the scale head's weight
        w = model.scale_head.fc.weight[0] @ model.body.weight
        raw = -3.0 * w / w.pow(2).sum()
    batches = []
    for step in range(STEPS):
        x = 0.05 * torch.randn(10, 3, generator=g)
        if step == FAIL_STEP:
            x[6] = raw
        batches.append((x, torch.randn(10, generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), batches, heteroscedastic_nll)


@pytest.mark.parametrize("loop", ["try_finally", "caught"])
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_finite_value_rejected_through_a_view_names_the_op_that_computed_it(replayable: bool, loop: str,
                                                                             one_thread: None) -> None:
    """The rejected scale is ``relu(...).flatten()``: the op named is the ReLU that computed the values, not the
    view; zero-code, where the replayed loss code does not raise, the replayed tensor equal to the rejected
    value is found among the replay's tensors."""
    baseline, _ = baseline_exception(scale_program)
    guard, exc, step = LOOPS[loop](scale_program(), replayable)
    assert step == FAIL_STEP and isinstance(exc, ValueError)
    assert_unchanged(exc, baseline)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.relu.default", "scale_head", "domain_error", "raised"), inc.summary
    assert points_at(inc.source, __file__, "scale_relu")
    assert "GreaterThan(lower_bound=0.0)" in inc.summary


# ================================================== raised after backward(), before optimizer.step()
class Magnitude(nn.Module):
    """Appends each row's Euclidean norm, written out by hand."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, torch.sqrt(h.pow(2).sum(-1, keepdim=True))], -1)  # <origin:magnitude_sqrt>


class MagnitudeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6, bias=False)
        self.magnitude = Magnitude()
        self.head = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.magnitude(self.embed(x))).squeeze(-1)


def magnitude_program() -> Program:
    """At ``FAIL_STEP`` a blank row (all 0): its norm is sqrt(0), whose derivative is infinite; the gradients
    are NaN (the forward and the loss finite)."""
    torch.manual_seed(0)
    model = MagnitudeNet()
    g = torch.Generator().manual_seed(16)
    batches = []
    for step in range(STEPS):
        x = torch.randn(8, 4, generator=g)
        if step == FAIL_STEP:
            x[2] = 0.0
        batches.append((x, torch.randn(8, generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches,
                   lambda m, b, check=True: F.mse_loss(m(b[0]), b[1]))


def _clipped_step(prog: Program, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> None:
    prog.opt.zero_grad()
    loss_fn(prog.model, batch).backward()
    torch.nn.utils.clip_grad_norm_(prog.model.parameters(), 1.0, error_if_nonfinite=True)
    prog.opt.step()


def _after_backward_loop(prog: Program, replayable: bool, step_fn: Callable[..., None], *,
                         catch: bool) -> tuple[nantrace.Guard, list[tuple[int, BaseException]], list[bool]]:
    """Train with ``step_fn``; ``catch``: an exception is caught, the gradients zeroed and the batch skipped
    (else the loop stops there). Returns the guard, the failures and, per batch run, whether the weights changed."""
    guard = nantrace.watch(prog.model, prog.opt, config=_quiet())
    loss_fn = _loss_code(guard, prog, replayable)
    failures: list[tuple[int, BaseException]] = []
    changed: list[bool] = []
    try:
        for step, batch in enumerate(prog.batches):
            before = [p.detach().clone() for p in prog.model.parameters()]
            try:
                step_fn(prog, loss_fn, batch)
            except Exception as exc:  # noqa: BLE001 - the user's "skip bad batches"
                failures.append((step, exc))
                prog.opt.zero_grad()
                if not catch:
                    break
            finally:
                changed.append(any(not torch.equal(a, b) for a, b in zip(before, prog.model.parameters())))
    finally:
        guard.close()
    return guard, failures, changed


@pytest.mark.parametrize("catch", [False, True], ids=["stops", "trains_on"])
@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_clip_grad_norm_raising_on_a_nan_gradient_names_the_backward_origin(replayable: bool, catch: bool,
                                                                            one_thread: None) -> None:
    """clip_grad_norm_(error_if_nonfinite=True) raises between backward() and optimizer.step(): the clip wrapper
    notes it and the step's gradients, still the NaN ones, are localised as the NaN-gradient path does (the
    derivative of sqrt at 0, in the module whose forward ran it), recorded as kind exception; a loop that
    catches it trains on, the next update landing."""
    guard, failures, changed = _after_backward_loop(magnitude_program(), replayable, _clipped_step, catch=catch)
    assert [s for s, _ in failures] == [FAIL_STEP] and isinstance(failures[0][1], RuntimeError)
    assert "non-finite" in str(failures[0][1])
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "backward", "aten.sqrt.default", "magnitude", "grad_singularity", "raised"), \
        inc.summary
    assert points_at(inc.source, __file__, "magnitude_sqrt")
    assert inc.details["exception"].startswith("RuntimeError") and inc.details["observed"] == "nonfinite_grad"
    assert changed == ([i != FAIL_STEP for i in range(STEPS)] if catch else [True] * FAIL_STEP + [False])


class LogIntensity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # <origin:intensity_log>


def intensity_program() -> Program:
    """At ``FAIL_STEP`` a dark pixel (intensity 0): log(0) = -inf, and the loss is infinite."""
    torch.manual_seed(0)
    model = nn.Sequential(LogIntensity(), nn.Linear(5, 1))
    g = torch.Generator().manual_seed(17)
    batches = []
    for step in range(STEPS):
        x = 0.1 + torch.rand(8, 5, generator=g)
        if step == FAIL_STEP:
            x[3, 0] = 0.0
        batches.append((x, torch.randn(8, 1, generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-2), batches,
                   lambda m, b, check=True: F.mse_loss(m(b[0]), b[1]))


def _checked_after_backward(prog: Program, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> None:
    prog.opt.zero_grad()
    loss = loss_fn(prog.model, batch)
    loss.backward()
    if not bool(torch.isfinite(loss)):  # the trainer's own check, as detectron2's
        raise FloatingPointError(f"loss became {loss.item()}")
    prog.opt.step()


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_users_own_check_after_backward_is_diagnosed_at_close(replayable: bool, one_thread: None) -> None:
    """The user's own FloatingPointError after backward() is raised where no hook of nantrace's sees it; the loop
    stops and close() finds a step that reached backward() and not optimizer.step() with a non-finite loss: it
    is localised as the step's check would have (the log of 0 in the model)."""
    guard, failures, changed = _after_backward_loop(intensity_program(), replayable, _checked_after_backward,
                                                    catch=False)
    assert [s for s, _ in failures] == [FAIL_STEP] and isinstance(failures[0][1], FloatingPointError)
    [inc] = guard.incidents
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action) == (
        FAIL_STEP, "exception", "forward", "aten.log.default", "0", "log_nonpositive", "raised"), inc.summary
    assert points_at(inc.source, __file__, "intensity_log")
    assert inc.details["exception"] is None and "abandoned" in inc.details
    assert inc.details["observed"] == "nonfinite_loss"


def test_a_step_left_after_backward_with_finite_values_records_nothing(one_thread: None) -> None:
    """Negative: an error of the user's own after backward() (nothing about a value) with a finite loss and
    gradients: close() finds nothing to diagnose."""
    prog = intensity_program()

    def step_fn(prog: Program, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> None:
        prog.opt.zero_grad()
        loss_fn(prog.model, batch).backward()
        raise KeyError("metrics_writer")

    prog.batches = prog.batches[:FAIL_STEP]
    guard, failures, _ = _after_backward_loop(prog, False, step_fn, catch=False)
    assert [s for s, _ in failures] == [0]
    assert guard.incidents == []
