"""Held-out failures, round 12a: loops that SKIP or CATCH a bad batch and train on, code BEFORE the model's
forward that raises, LONG step code, a -inf a softmax only passes on, tensor settings in an optimizer's param
groups, and running/pooled variances used as divisors; with must-not-fire twins of each mechanism.

Covered: ``if not torch.isfinite(loss): continue`` around an MSLE on a zero sale price; gradient accumulation
whose middle (and whose LAST) micro-batch is skipped; a REAL ``lightning.Trainer`` whose ``training_step``
returns None on a non-finite loss; a hard-example sampler whose weights are all 0 (``torch.multinomial`` on NaN
probabilities, uncaught); a ZCA whitening whose Cholesky fails on a rank-deficient batch, caught by the loop; a
token-id remap (``gather``) past the map's end; a scaled HMM forward algorithm of ~2,400 calls in the loss; a
PPO-style prelude (no-grad pass, behaviour log-probabilities, a GAE loop of ~730 calls) before the policy's
forward; a multiple-instance bag score through ``logsumexp`` of an empty bag (the -inf is only passed on: NaN
derivative) vs a pointer network whose softmax makes the NaN; a polynomial LR decay computed from tensor settings
kept in the param group vs a sparse-training optimizer dividing by a model buffer (the layer's density); a
pooled (Chan/Welford merge) target variance of 0 vs a class count of 0. Must not fire: a siamese step, an
auxiliary scalar made between two forwards, an evaluation forward with grad on (finite metric), an evaluation
loop between steps (its outputs must not be kept alive), a ragged batch whose ``torch.stack`` fails and is
caught (no value's error).

How expectations were derived: each ``Want`` was written from the construction BEFORE nantrace ran, from
shared/API.md's fields and cause table and docs/diagnosis.md's rules (origin = the op that made the first
non-finite value from finite inputs, a ``-inf`` fill being intentional; a backward origin is the forward op
whose derivative made the first non-finite gradient; a skipped loss is ``nonfinite_loss``, action ``logged``, at
the index the next ``optimizer.step()`` takes; a step that raises is ``exception``/``raised``; a zero divisor
made from a param group's tensor settings alone is ``optimizer_state``, one read from a module buffer
``div_by_zero``; a pooled variance stays a statistic through scaling by a count and sums of terms >= 0).
``test_cases_fail_without_nantrace`` checks every construction with plain torch and an oracle written here
(``FirstBad``: a TorchDispatchMode naming the first op that made a non-finite value from finite inputs and this
file's innermost line issuing it; ``node_oracle``: autograd node hooks naming the first node whose gradient
output is non-finite from a finite gradient input).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from heldout_harness import Judge, Program, assert_diagnosis, case_params, describe, same, sgd, snapshot, train
from origin_markers import origin_line
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

HERE = os.path.abspath(__file__)
JUDGE = Judge(__file__)
FAIL_STEP = 3
STEPS = 5

CASES: dict[str, tuple[Callable[[], Program], Want]] = {}
RAISES: dict[str, type[BaseException]] = {}
LOOP: dict[str, str] = {}
"""name -> ``plain`` (the harness's loop), ``skip`` (no backward for a non-finite loss, micro-batch or batch),
``catch`` (the loop catches the exception, zeroes the gradients and trains on)."""
QUIET: dict[str, tuple[Callable[[], Program], str]] = {}
XFAIL: dict[str, str] = {}
"""name[mode] -> why nantrace is still wrong on it (a strict xfail)."""
QUIET_XFAIL: dict[str, str] = {}


def case(name: str, want: Want, loop: str = "plain", raises: type[BaseException] | None = None) -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        assert name not in CASES, name
        CASES[name] = (build, want)
        LOOP[name] = loop
        if raises is not None:
            RAISES[name] = raises
        return build

    return register


def quiet(name: str, loop: str = "skip") -> Callable:
    def register(build: Callable[[], Program]) -> Callable[[], Program]:
        QUIET[name] = (build, loop)
        return build

    return register


def raised(*args: Any) -> Want:
    return Want("exception", *args, action="raised")


def logged(*args: Any) -> Want:
    return Want("nonfinite_loss", *args, action="logged")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ======================================================= 1. loops that skip a non-finite loss and train on
# 1a. House prices, MSLE written by hand (log of the target, log1p of the prediction). One listing in the
#     batch at FAIL_STEP has a sale price of 0 (a transfer between relatives): log(0) = -inf, the squared
#     difference +inf. The loop skips non-finite losses ("bad batch") and trains on.
class PriceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.body(x)).squeeze(-1) * 100.0


def msle_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, price = batch
    pred = model(x)
    log_target = torch.log(price)  # <origin:msle_log>
    return (torch.log1p(pred) - log_target).pow(2).mean()


@case("house_prices_msle_zero_sale_price_loop_skips_nonfinite_loss",
      logged("forward", "aten.log.default", None, "msle_log", "log_nonpositive"), loop="skip")
def _msle() -> Program:
    torch.manual_seed(0)
    model = PriceNet()

    def batch(s: int) -> Any:
        g = _gen(100 + s)
        x = torch.randn(16, 6, generator=g)
        price = torch.rand(16, generator=g) * 400 + 50
        if s == FAIL_STEP:
            price[7] = 0.0
        return x, price

    return Program(model, sgd(model, 1e-3), [batch(s) for s in range(STEPS)], msle_loss)


# 1b. Gradient accumulation over 3 micro-batches, the loop skipping a micro-batch whose loss is non-finite.
#     The model derives "price per square metre" from (price, area) inside its feature block; in the MIDDLE
#     micro-batch of FAIL_STEP one listing has area 0 (a parking lot): x / 0 = inf, the loss inf.
class ListingFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_m2 = x[:, 0] / x[:, 1]  # <origin:per_m2>
        return torch.cat([x, per_m2[:, None]], dim=1)


class RentModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = ListingFeatures()
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).squeeze(-1)


def rent_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _rent_program(bad_micro: int) -> Program:
    torch.manual_seed(0)
    model = RentModel()

    def micro(s: int, m: int) -> Any:
        g = _gen(1000 * s + m)
        x = torch.rand(8, 4, generator=g) + 0.5
        if s == FAIL_STEP and m == bad_micro:
            x[3, 1] = 0.0
        return x, torch.randn(8, generator=g)

    return Program(model, sgd(model, 1e-2), [[micro(s, m) for m in range(3)] for s in range(STEPS)], rent_loss,
                   accum=True)


@case("rent_regression_accumulation_middle_micro_batch_area_zero_skipped",
      logged("forward", "aten.div.Tensor", "features", "per_m2", "div_by_zero"), loop="skip")
def _rent_middle() -> Program:
    return _rent_program(1)


# 1c. The same kind of loop, but the skipped micro-batch is the LAST of the accumulation window: no forward of
#     the model follows it in the step. Per-sample standardisation of a sensor window inside the model with no
#     eps; in the last micro-batch of FAIL_STEP one window is a flat line (the sensor was stuck): 0 / 0.
class WindowStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, sd = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
        return (x - mu) / sd  # <origin:window_std>


class SensorClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = WindowStandardize()
        self.conv = nn.Conv1d(1, 8, 5, padding=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(self.norm(x)[:, None]))
        return self.head(h.mean(-1))


def sensor_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@case("sensor_windows_accumulation_last_micro_batch_flat_window_skipped",
      logged("forward", "aten.div.Tensor", "norm", "window_std", "zero_variance_norm"), loop="skip")
def _sensor_last() -> Program:
    torch.manual_seed(0)
    model = SensorClassifier()

    def micro(s: int, m: int) -> Any:
        g = _gen(2000 * s + m)
        x = torch.randn(6, 32, generator=g)
        if s == FAIL_STEP and m == 2:
            x[4] = 0.25
        return x, torch.randint(0, 3, (6,), generator=g)

    return Program(model, sgd(model, 1e-2), [[micro(s, m) for m in range(3)] for s in range(STEPS)], sensor_loss,
                   accum=True)


# ======================================================= 2. code before the forward that raises
# 2a. Hard-example mining: the sampler draws the batch's rows with probability proportional to each
#     example's last error count. At FAIL_STEP every count is 0 (the model got the pool right): 0 / 0 = NaN
#     probabilities, and torch.multinomial raises. Uncaught.
class PoolClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mined_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y, errors, g = batch
    probs = errors / errors.sum()  # <origin:mining_div>
    idx = torch.multinomial(probs, 8, replacement=True, generator=g)  # <origin:mining_draw>
    return F.cross_entropy(model(x[idx]), y[idx])


@case("hard_example_sampler_all_error_counts_zero_multinomial_nan",
      raised("forward", "aten.div.Tensor", None, "mining_div", "div_by_zero"), raises=RuntimeError)
def _mining() -> Program:
    torch.manual_seed(0)
    model = PoolClassifier()

    def batch(s: int) -> Any:
        g = _gen(300 + s)
        x, y = torch.randn(32, 10, generator=g), torch.randint(0, 4, (32,), generator=g)
        errors = torch.randint(0, 3, (32,), generator=g).float()
        errors[0] = 1.0
        if s == FAIL_STEP:
            errors.zero_()
        return x, y, errors, _gen(400 + s)

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], mined_loss)


# 2b. ZCA whitening of the batch before the forward (Cholesky of the batch covariance, no shrinkage). At
#     FAIL_STEP the batch is rank-deficient (a feature duplicated by a join): cholesky raises; the loop
#     catches "bad batches" and trains on.
def zca_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    xc = x - x.mean(0, keepdim=True)
    cov = xc.T @ xc / (x.shape[0] - 1)
    chol = torch.linalg.cholesky(cov)  # <origin:zca_chol>
    white = torch.linalg.solve_triangular(chol, xc.T, upper=False).T
    return F.cross_entropy(model(white), y)


@case("zca_whitening_cholesky_rank_deficient_batch_caught_by_loop",
      raised("forward", "aten.linalg_cholesky_ex.default", None, "zca_chol", "domain_error"),
      loop="catch", raises=torch.linalg.LinAlgError)
def _zca() -> Program:
    torch.manual_seed(0)
    model = PoolClassifier()

    def batch(s: int) -> Any:
        g = _gen(500 + s)
        x = torch.randn(64, 10, generator=g)
        if s == FAIL_STEP:
            x[:, 9] = x[:, 2]
        return x, torch.randint(0, 4, (64,), generator=g)

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], zca_loss)


# 2c. A tokenizer swap: raw token ids are remapped to the model's reduced vocabulary with a lookup table
#     (gather) before the forward. The shard at FAIL_STEP was tokenized with the newer tokenizer, which has
#     one id more than the table: gather raises on the index. Uncaught.
class BagLM(nn.Module):
    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def remap_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    raw, y, table = batch
    ids = table.gather(0, raw.flatten()).view_as(raw)  # <origin:remap_gather>
    return F.cross_entropy(model(ids), y)


@case("tokenizer_swap_vocab_remap_gather_id_past_table",
      raised("forward", "aten.gather.default", None, "remap_gather", "label_out_of_range"), raises=RuntimeError)
def _remap() -> Program:
    torch.manual_seed(0)
    model = BagLM()
    table = torch.randperm(60, generator=_gen(1)) % 40

    def batch(s: int) -> Any:
        g = _gen(600 + s)
        raw = torch.randint(0, 60, (8, 12), generator=g)
        if s == FAIL_STEP:
            raw[2, 5] = 60
        return raw, torch.randint(0, 2, (8,), generator=g), table

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], remap_loss)


# ======================================================= 3. long step code
# 3a. A scaled HMM forward algorithm in the loss (speech-style alignment of a sensor stream to 4 hidden states),
#     Gaussian emissions computed in probability space, T = 400 frames (~2,400 torch calls). The batch at
#     FAIL_STEP has a glitch frame (value 1e3): every state's density underflows to exactly 0, the scaling
#     constant of that frame is 0, and alpha / c = 0 / 0.
class EmissionNet(nn.Module):
    def __init__(self, states: int = 4) -> None:
        super().__init__()
        self.mu = nn.Linear(3, states)
        self.log_sigma = nn.Linear(3, states)

    def forward(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(ctx), self.log_sigma(ctx).clamp(-2, 2).exp()


def hmm_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    ctx, obs, trans = batch
    mu, sigma = model(ctx)  # (B, K)
    dens = torch.exp(-0.5 * ((obs[:, :, None] - mu[:, None]) / sigma[:, None]) ** 2) / sigma[:, None]
    alpha = torch.full_like(mu, 1.0 / mu.shape[1])
    log_lik = torch.zeros(obs.shape[0])
    for t in range(obs.shape[1]):
        alpha = (alpha @ trans) * dens[:, t]
        c = alpha.sum(-1, keepdim=True)
        alpha = alpha / c  # <origin:hmm_scale>
        log_lik = log_lik + torch.log(c.squeeze(-1))
    return -log_lik.mean() / obs.shape[1]


@case("hmm_scaled_forward_algorithm_400_frames_glitch_frame_underflow",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "hmm_scale", "div_by_zero"))
def _hmm() -> Program:
    torch.manual_seed(0)
    model = EmissionNet()
    trans = torch.full((4, 4), 0.1) + 0.6 * torch.eye(4)

    def batch(s: int) -> Any:
        g = _gen(700 + s)
        obs = torch.randn(4, 400, generator=g)
        if s == FAIL_STEP:
            obs[1, 250] = 1e3
        return torch.randn(4, 3, generator=g), obs, trans

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], hmm_loss)


# 3b. A PPO-style update: a no-grad pass of the policy over the rollout gives the behaviour log-probabilities
#     of the actions taken (log of the gathered probability), then GAE in a Python loop over 48 transitions
#     (~730 calls, within the prelude's 1,024), then the policy's forward with grad and an importance-weighted policy-gradient loss. At
#     FAIL_STEP one action was taken by epsilon-greedy exploration where the policy's probability had
#     underflowed to 0: log(0) = -inf there, the ratio exp(new - old) = inf.
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3))
        self.v = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pi(obs), self.v(obs).squeeze(-1)


def ppo_loss(model: nn.Module, batch: Any, step: int, gamma: float = 0.99, lam: float = 0.95) -> torch.Tensor:
    obs, actions, rewards, dones = batch
    with torch.no_grad():
        logits, values = model(obs)
        probs = torch.softmax(logits, -1)
        old_logp = torch.log(probs.gather(1, actions[:, None]).squeeze(1))  # <origin:ppo_old_logp>
    adv = torch.zeros_like(rewards)
    gae = torch.zeros(())
    for t in reversed(range(len(rewards) - 1)):
        delta = rewards[t] + gamma * values[t + 1] * (1 - dones[t]) - values[t]
        gae = delta + gamma * lam * (1 - dones[t]) * gae
        adv[t] = gae
    logits, values_new = model(obs)
    new_logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    ratio = torch.exp(new_logp - old_logp)
    return -(ratio * adv).mean() + F.mse_loss(values_new, adv + values)


@case("ppo_prelude_behaviour_logprob_of_exploration_action_then_730_call_gae_loop",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "ppo_old_logp", "log_nonpositive"))
def _ppo(rollout: int = 48) -> Program:
    torch.manual_seed(0)
    model = Policy()
    with torch.no_grad():
        model.pi[0].weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        model.pi[0].bias[0] = -3.0  # hidden unit 0 fires only for a large first observation
        model.pi[2].weight[0] *= 0.0
        model.pi[2].weight[0, 0] = 200.0
        model.pi[2].bias[0] = 200.0

    def batch(s: int) -> Any:
        g = _gen(800 + s)
        obs = torch.randn(rollout, 4, generator=g) * 0.5
        actions = torch.randint(0, 3, (rollout,), generator=g)
        if s == FAIL_STEP:
            obs[20] = torch.tensor([10.0, 0.0, 0.0, 0.0])  # a state far outside the visited ones
            actions[20] = 1
        return obs, actions, torch.randn(rollout, generator=g), (torch.rand(rollout, generator=g) < 0.05).float()

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-4), [batch(s) for s in range(STEPS)], ppo_loss)


# 3c. The same update with a rollout of 150 transitions: the GAE loop is ~2,250 calls, so the log is beyond the
#     prelude's documented window (its last 1,024 calls). The right diagnosis is still the log; a replay that
#     cannot see it must not name an op that only received the infinity.
@case("ppo_prelude_behaviour_logprob_then_2250_call_gae_loop_beyond_prelude_window",
      Want("nonfinite_loss", "forward", "aten.log.default", None, "ppo_old_logp", "log_nonpositive"))
def _ppo_long() -> Program:
    return _ppo(150)


# ======================================================= 4. softmax / logsumexp over an all -inf row
# 4a. Multiple-instance learning: a bag's logit is the logsumexp of its instances' scores under an ADDITIVE
#     padding mask (0 / -inf, built with masked_fill); the bag probability sigmoid(logit) goes to BCE. At
#     FAIL_STEP one bag is empty (all padding): logsumexp passes the -inf on, sigmoid makes it 0, the loss is
#     finite; logsumexp's derivative over the all -inf row is exp(-inf - -inf) = NaN.
class InstanceScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def mil_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, valid, y = batch
    scores = model(x)  # (B, N)
    pad = torch.zeros_like(scores).masked_fill(~valid, float("-inf"))
    bag_logit = torch.logsumexp(scores + pad, dim=1)  # <origin:mil_lse>
    return F.binary_cross_entropy(torch.sigmoid(bag_logit), y)


@case("multiple_instance_bag_logsumexp_empty_bag_nan_derivative",
      Want("nonfinite_grad", "backward", "aten.logsumexp.default", None, "mil_lse", "masked_softmax_all"))
def _mil() -> Program:
    torch.manual_seed(0)
    model = InstanceScorer()

    def batch(s: int) -> Any:
        g = _gen(900 + s)
        valid = torch.rand(6, 10, generator=g) < 0.7
        valid[:, 0] = True
        y = torch.randint(0, 2, (6,), generator=g).float()
        if s == FAIL_STEP:
            valid[4] = False
            y[4] = 0.0
        return torch.randn(6, 10, 8, generator=g), valid, y

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], mil_loss)


# 4b. The forward twin: a pointer network (copy attention) masks the source positions that cannot be copied;
#     at FAIL_STEP one example has no copyable position, and the model's softmax makes the NaN itself.
class Pointer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, copyable: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bd,bnd->bn", self.q(query), self.k(keys))
        scores = scores.masked_fill(~copyable, float("-inf"))
        return torch.softmax(scores, -1)  # <origin:pointer_softmax>


class CopyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.pointer = Pointer()

    def forward(self, query: torch.Tensor, keys: torch.Tensor, copyable: torch.Tensor) -> torch.Tensor:
        return self.pointer(query, torch.tanh(self.enc(keys)), copyable)


def copy_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    q, keys, copyable, target = batch
    p = model(q, keys, copyable)
    return -(p.gather(1, target[:, None]).clamp_min(1e-8).log()).mean()


@case("pointer_network_copy_attention_no_copyable_position_forward_nan",
      Want("nonfinite_loss", "forward", "aten._softmax.default", "pointer", "pointer_softmax", "masked_softmax_all"))
def _pointer() -> Program:
    torch.manual_seed(0)
    model = CopyModel()

    def batch(s: int) -> Any:
        g = _gen(950 + s)
        copyable = torch.rand(5, 7, generator=g) < 0.6
        copyable[:, 0] = True
        if s == FAIL_STEP:
            copyable[2] = False
        return torch.randn(5, 8, generator=g), torch.randn(5, 7, 8, generator=g), copyable, torch.zeros(5, dtype=torch.long)

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], copy_loss)


# ======================================================= 5. optimizer settings kept as tensors
# 5a. A hand-written SGD with a polynomial LR decay computed inside step() from tensors kept in the param
#     group (step counter, total steps, power: tensors so the step is capturable). The config's total_steps
#     is 3 and training runs on: at the 4th step 1 - 4/3 < 0 and the power 0.5 of it is NaN.
class PolySGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float, total_steps: int, power: float = 0.5) -> None:
        super().__init__(params, dict(lr=torch.tensor(lr), step=torch.tensor(0.0), total_steps=torch.tensor(float(total_steps)),
                                      power=torch.tensor(power)))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["step"] += 1
            decay = (1 - group["step"] / group["total_steps"]) ** group["power"]  # <origin:poly_pow>
            lr_t = group["lr"] * decay
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(lr_t * p.grad)


class Tabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def tab_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _tab_batches(seed: int) -> list[Any]:
    return [(torch.randn(16, 6, generator=_gen(seed + s)), torch.randint(0, 2, (16,), generator=_gen(seed + 50 + s)))
            for s in range(STEPS)]


@case("poly_decay_sgd_tensor_settings_in_param_group_past_total_steps",
      Want("nonfinite_param", "optimizer", "aten.pow.Tensor_Tensor", "fc1", "poly_pow", "optimizer_state"))
def _poly() -> Program:
    torch.manual_seed(0)
    model = Tabular()
    return Program(model, PolySGD(model.parameters(), lr=0.05, total_steps=3), _tab_batches(1100), tab_loss)


# 5b. The twin: sparse training (RigL-style) whose optimizer scales each layer's update by 1 / the layer's
#     density, a BUFFER of the model written by the pruning schedule between steps. At FAIL_STEP the schedule
#     prunes the adapter layer entirely: density 0, its gradient 0 (masked), 0 / 0 = NaN.
class MaskedLinear(nn.Linear):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.register_buffer("mask", torch.ones_like(self.weight))
        self.register_buffer("density", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.adapter = MaskedLinear(16, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.adapter(F.relu(self.fc1(x)))))


class DensitySGD(torch.optim.Optimizer):
    def __init__(self, layers: list[MaskedLinear], lr: float) -> None:
        super().__init__([m.weight for m in layers], dict(lr=lr))
        self.layers = layers

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p, layer in zip(group["params"], self.layers):
                if p.grad is not None:
                    p.sub_(group["lr"] * (p.grad / layer.density))  # <origin:density_div>


def prune_schedule(model: nn.Module, step: int) -> None:
    if step == FAIL_STEP:
        model.adapter.mask.zero_()
        model.adapter.density.copy_(model.adapter.mask.mean())


@case("sparse_training_update_divided_by_layer_density_buffer_fully_pruned",
      Want("nonfinite_param", "optimizer", "aten.div.Tensor", "adapter", "density_div", "div_by_zero"))
def _sparse() -> Program:
    torch.manual_seed(0)
    model = SparseNet()
    return Program(model, DensitySGD([model.adapter], lr=0.05), _tab_batches(1200),
                   lambda m, b, s: F.cross_entropy(m(b[0]), b[1]), before_step=prune_schedule)


# ======================================================= 6. running / pooled variances as divisors
# 6a. Targets standardised before the forward by a pooled variance of two shards (Chan's parallel merge of
#     Welford statistics, no eps). At FAIL_STEP every target is the capped value: M2 = 0, 0 / 0.
def pooled_std_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    ya, yb = y[:8], y[8:]
    mean_a, mean_b = ya.mean(), yb.mean()
    m2_a, m2_b = ((ya - mean_a) ** 2).sum(), ((yb - mean_b) ** 2).sum()
    delta = mean_b - mean_a
    n = float(len(y))
    m2 = m2_a + m2_b + delta ** 2 * len(ya) * len(yb) / n
    mean = mean_a + delta * len(yb) / n
    y_std = (y - mean) / torch.sqrt(m2 / n)  # <origin:pooled_div>
    return F.mse_loss(model(x).squeeze(-1), y_std)


@case("targets_standardised_by_pooled_welford_variance_capped_shard",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "pooled_div", "zero_variance_norm"))
def _pooled() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def batch(s: int) -> Any:
        g = _gen(1300 + s)
        y = torch.rand(16, generator=g) * 5
        if s == FAIL_STEP:
            y.fill_(5.0)
        return torch.randn(16, 6, generator=g), y

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], pooled_std_loss)


# 6b. The twin: class-balanced weights from the class counts seen so far (counts updated after use). A class
#     that first appears at FAIL_STEP has count 0: total / 0 = inf weight, an inf loss.
class Counts:
    def __init__(self, k: int) -> None:
        self.counts = torch.zeros(k)


def balanced_loss(model: nn.Module, batch: Any, step: int, state: Counts = None) -> torch.Tensor:
    x, y = batch
    weight = (state.counts.sum() + len(y)) / state.counts[y]  # <origin:balanced_div>
    loss = (weight * F.cross_entropy(model(x), y, reduction="none")).mean()
    state.counts += torch.bincount(y, minlength=len(state.counts)).float()
    return loss


@case("class_balanced_weights_from_running_counts_new_class_count_zero",
      Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "balanced_div", "div_by_zero"))
def _balanced() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    state = Counts(4)
    state.counts[:3] = 1.0

    def batch(s: int) -> Any:
        g = _gen(1400 + s)
        y = torch.randint(0, 3, (12,), generator=g)
        if s == FAIL_STEP:
            y[5] = 3
        return torch.randn(12, 6, generator=g), y

    def loss(m: nn.Module, b: Any, s: int) -> torch.Tensor:
        return balanced_loss(m, b, s, state)

    return Program(model, sgd(model), [batch(s) for s in range(STEPS)], loss)


# ======================================================= must not fire (the loops skip non-finite losses)
# q1. SimSiam: two augmented views through the same encoder, one loss (two forwards, no scalar between them).
class SimSiam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.pred = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.enc(x)
        return z, self.pred(z)


def simsiam_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x1, x2 = batch
    z1, p1 = model(x1)
    z2, p2 = model(x2)
    return -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2


def _views(seed: int) -> list[Any]:
    out = []
    for s in range(STEPS):
        base = torch.randn(16, 12, generator=_gen(seed + s))
        out.append((base + 0.1 * torch.randn(16, 12, generator=_gen(seed + 90 + s)),
                    base + 0.1 * torch.randn(16, 12, generator=_gen(seed + 180 + s))))
    return out


@quiet("simsiam_two_views_one_loss_in_a_skipping_loop")
def _simsiam() -> Program:
    torch.manual_seed(0)
    model = SimSiam()
    return Program(model, sgd(model, 0.05), _views(1500), simsiam_loss)


# q2. FixMatch-like consistency: an entropy term (a scalar) is made from the weak view's output BEFORE the
#     strong view's forward, and both enter the loss.
def consistency_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    weak, strong = batch
    p_weak = torch.softmax(model(weak), -1)
    entropy = -(p_weak * torch.log(p_weak + 1e-8)).sum(-1).mean()
    logits_strong = model(strong)
    return F.cross_entropy(logits_strong, p_weak.detach().argmax(-1)) + 0.1 * entropy


@quiet("fixmatch_entropy_scalar_made_between_two_forwards")
def _fixmatch() -> Program:
    torch.manual_seed(0)
    model = PoolClassifier()
    views = [(torch.randn(16, 10, generator=_gen(1600 + s)), torch.randn(16, 10, generator=_gen(1700 + s)))
             for s in range(STEPS)]
    return Program(model, sgd(model, 0.05), views, consistency_loss)


# q3. A validation metric computed every step with grad ON (no torch.no_grad), never backwarded, finite; then
#     the training forward and loss.
def train_with_val_metric(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    (xv, yv), (x, y) = batch
    val_acc = (model(xv).argmax(-1) == yv).float().mean()
    model.last_val = float(val_acc)
    return F.cross_entropy(model(x), y)


@quiet("validation_accuracy_with_grad_on_before_training_forward")
def _valgrad() -> Program:
    torch.manual_seed(0)
    model = PoolClassifier()
    data = [((torch.randn(32, 10, generator=_gen(1800 + s)), torch.randint(0, 4, (32,), generator=_gen(1850 + s))),
             (torch.randn(16, 10, generator=_gen(1900 + s)), torch.randint(0, 4, (16,), generator=_gen(1950 + s))))
            for s in range(STEPS)]
    return Program(model, sgd(model, 0.05), data, train_with_val_metric)


# q4. An evaluation loop between two steps (no_grad, outputs post-processed by the user's code and dropped):
#     nothing of it may stay alive once the next step is done.
EVAL_REFS: list[weakref.ref] = []


def evaluate_between(model: nn.Module, step: int) -> None:
    if step != 2:
        return
    model.eval()
    for i in range(12):
        x = torch.randn(512, 10, generator=_gen(2000 + i))
        logits = model.net[0](x).repeat(1, 16)  # (512, 384) activations of the first layer, as a probe would keep
        scores = torch.softmax(logits, -1)
        top = scores.topk(5, -1).values.sum()
        EVAL_REFS.extend([weakref.ref(logits), weakref.ref(scores)])
        del logits, scores, top
    model.train()


@quiet("evaluation_loop_between_steps_outputs_dropped", loop="plain")
def _evalloop() -> Program:
    torch.manual_seed(0)
    EVAL_REFS.clear()
    model = PoolClassifier()
    data = [(torch.randn(16, 10, generator=_gen(2100 + s)), torch.randint(0, 4, (16,), generator=_gen(2150 + s)))
            for s in range(STEPS)]
    return Program(model, sgd(model, 0.05), data, lambda m, b, s: F.cross_entropy(m(b[0]), b[1]),
                   before_step=evaluate_between)


# q5. A ragged batch: the collate in the step's code stacks variable-length feature rows; at FAIL_STEP the
#     shapes differ, torch.stack raises, and the loop catches "bad batches" and trains on. No value's error.
def ragged_loss(model: nn.Module, batch: Any, step: int) -> torch.Tensor:
    rows, y = batch
    x = torch.stack(rows)
    return F.cross_entropy(model(x), y)


@quiet("ragged_batch_stack_shape_error_caught_by_loop", loop="catch")
def _ragged() -> Program:
    torch.manual_seed(0)
    model = PoolClassifier()

    def batch(s: int) -> Any:
        rows = [torch.randn(10, generator=_gen(2200 + 20 * s + i)) for i in range(8)]
        if s == FAIL_STEP:
            rows[3] = torch.randn(9, generator=_gen(1))
        return rows, torch.randint(0, 4, (8,), generator=_gen(2300 + s))

    return Program(model, sgd(model, 0.05), [batch(s) for s in range(STEPS)], ragged_loss)


# ======================================================= the plain-torch oracle
def _here_line() -> int | None:
    for frame in inspect.stack()[2:]:
        if os.path.abspath(frame.filename) == HERE and frame.function not in ("__torch_dispatch__", "_here_line"):
            return frame.lineno
    return None


def _finite(ts: Any) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


FILLS = {"aten.fill_.Scalar", "aten.masked_fill_.Scalar", "aten.masked_fill.Scalar", "aten.full.default",
         "aten.full_like.default", "aten.copy_.default", "aten.lift_fresh.default", "aten.fill.Scalar"}


class FirstBad(TorchDispatchMode):
    """The first op that made a non-finite floating value from finite inputs, and the first that made a NaN from
    NaN-free inputs, each with this file's innermost line that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[str, int | None] | None = None
        self.first_nan: tuple[str, int | None] | None = None
        self.on = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on and str(func) not in FILLS:
            leaves = tree_leaves((args, kwargs))
            ins = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
            scalars_ok = all(math.isfinite(v) for v in leaves if isinstance(v, float))
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if self.first is None and scalars_ok and _finite(ins) and not _finite(outs):
                self.first = (str(func), _here_line())
            if (self.first_nan is None and not any(bool(t.isnan().any()) for t in ins)
                    and any(bool(t.isnan().any()) for t in outs)):
                self.first_nan = (str(func), _here_line())
        return out


NODES = {"aten.logsumexp.default": "LogsumexpBackward0"}


def node_oracle(loss: torch.Tensor) -> list[str]:
    seen, stack, order = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)

        def hook(grad_inputs: Any, grad_outputs: Any, node: Any = node) -> None:
            if _finite(g for g in grad_outputs if g is not None) and not _finite(g for g in grad_inputs if g is not None):
                order.append(node.name())

        node.register_hook(hook)
        stack.extend(n for n, _ in node.next_functions)
    return order


def plain_run(program: Program, loop: str = "plain") -> dict[str, Any]:
    """The program without nantrace under the oracle: the first failing step (``loss``, ``grads``, ``param`` after
    the update, ``raised``), the oracle's origin, the backward nodes, and every batch/micro-batch that failed."""
    model, opt = program.model, program.optimizer
    result: dict[str, Any] = dict(step=None, what=None)
    failures: list[Any] = []

    def note(step: int, **kw: Any) -> None:
        failures.append(step)
        if result["step"] is None:
            result.update(step=step, **kw)

    for step, batch in enumerate(program.batches):
        if program.before_step is not None:
            with torch.no_grad():
                program.before_step(model, step)
        oracle = FirstBad()
        opt.zero_grad()
        micro = batch if program.accum else [batch]
        try:
            bad = False
            for m, mb in enumerate(micro):
                with oracle:
                    loss = program.loss(model, mb, step)
                if not bool(torch.isfinite(loss).all()):
                    note(step, what="loss", origin=oracle.first, origin_nan=oracle.first_nan, micro=m)
                    bad = True
                    if loop == "skip":
                        continue
                    break
                nodes = node_oracle(loss)
                (loss / len(micro)).backward()
                if not _finite(p.grad for p in model.parameters()):
                    note(step, what="grads", nodes=nodes)
                    bad = True
                    break
            if bad and loop != "skip":
                break
            if bad and not program.accum:
                continue
            with oracle:
                oracle.first = None
                opt.step()
            if not _finite(model.parameters()):
                note(step, what="param", origin=oracle.first)
                break
        except Exception as exc:  # noqa: BLE001 - the construction's own failure
            tb, line = exc.__traceback__, None
            while tb is not None:
                code = tb.tb_frame.f_code
                if os.path.abspath(code.co_filename) == HERE and code.co_name != "__torch_dispatch__":
                    line = tb.tb_lineno
                tb = tb.tb_next
            note(step, what="raised", error=exc, line=line, origin=oracle.first)
            if loop == "catch":
                opt.zero_grad()
                continue
            break
    result["failures"] = failures
    result["params"] = snapshot(model)
    return result


# ======================================================= the loops that train on
@dataclasses.dataclass
class OnRun:
    incidents: list[Any]
    failures: list[int]
    changed: list[bool]
    error: BaseException | None = None


def train_on(program: Program, *, replayable: bool, loop: str) -> OnRun:
    """``skip``: no backward for a non-finite loss (each micro-batch's under ``accum``; a step with no batch
    left calls no ``optimizer.step()``); ``catch``: the exception is caught, the gradients zeroed, the batch
    skipped."""
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    failures: list[int] = []
    changed: list[bool] = []
    try:
        for i, batch in enumerate(program.batches):
            if program.before_step is not None:
                with torch.no_grad():
                    program.before_step(model, i)
            before = snapshot(model)
            opt.zero_grad()
            micro = batch if program.accum else [batch]
            try:
                used = 0
                for mb in micro:
                    loss = loss_fn(model, mb, i)
                    if loop == "skip" and not bool(torch.isfinite(loss).all()):
                        failures.append(i)
                        continue
                    (loss / len(micro)).backward()
                    used += 1
                if used:
                    opt.step()
            except Exception as exc:  # noqa: BLE001 - the user's "skip bad batches"
                if loop != "catch" or isinstance(exc, nantrace.NonFiniteError):
                    raise
                failures.append(i)
                opt.zero_grad()
            changed.append(not same(before, snapshot(model)))
    finally:
        guard.close()
    return OnRun(list(guard.incidents), failures, changed)


# ======================================================= the tests
WHAT = {"nonfinite_loss": "loss", "nonfinite_grad": "grads", "exception": "raised", "nonfinite_param": "param"}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_fail_without_nantrace(name: str) -> None:
    """The construction: without nantrace every step before FAIL_STEP is finite, FAIL_STEP fails as the expected
    kind says (a loop that trains on: only that batch fails), and the oracle names the expected op and line
    (forward, optimizer), node (backward) or the raising line."""
    build, want = CASES[name]
    run = plain_run(build(), LOOP[name])
    assert (run["step"], run["what"]) == (want.step, WHAT[want.kind]), run
    if LOOP[name] != "plain":
        assert run["failures"] == [FAIL_STEP], run["failures"]
    line = origin_line(HERE, want.tag)
    if want.kind == "exception":
        assert type(run["error"]) is RAISES[name], run
        assert run["line"] in (line, origin_line(HERE, "mining_draw")), run
        if want.cause == "div_by_zero":  # a NaN made before the op that raised on it
            assert run["origin"] == (want.op, line), run
        else:
            assert run["origin"] is None and run["line"] == line, run
    elif want.phase == "backward":
        assert run["nodes"][:1] == [NODES[want.op]], run
    elif want.cause == "masked_softmax_all":  # the -inf are fills: the op that made the NaN
        assert run["origin_nan"] == (want.op, line), run
    else:
        assert run["origin"] == (want.op, line), run


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if LOOP[n] == "plain"}, XFAIL))
def test_heldout_diagnosis(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)


@pytest.mark.parametrize("name,mode", case_params({n: None for n in CASES if LOOP[n] != "plain"}, XFAIL))
def test_heldout_trains_on(name: str, mode: str) -> None:
    """The loop goes on past the bad batch: ONE incident naming the origin at FAIL_STEP (the index the next
    ``optimizer.step()`` takes), with the expected action; every other batch's update landed."""
    build, want = CASES[name]
    run = train_on(build(), replayable=mode == "replayable", loop=LOOP[name])
    assert run.failures == [FAIL_STEP], run.failures
    assert run.incidents, "no incident"
    inc = run.incidents[0]
    got = dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
               action=inc.action, line=JUDGE.line(inc.source))
    assert got == JUDGE.want(want), [describe(i) + " | " + i.summary for i in run.incidents]
    assert len(run.incidents) == 1, [describe(i) for i in run.incidents]
    if not any(isinstance(b, list) for b in build().batches):  # whole batch skipped: no update that step
        assert run.changed == [i != FAIL_STEP for i in range(STEPS)], run.changed
    else:
        assert all(run.changed), run.changed


@pytest.mark.parametrize("name", list(QUIET))
def test_quiet_programs_without_nantrace(name: str) -> None:
    build, loop = QUIET[name]
    run = plain_run(build(), "plain")
    if loop == "catch":
        assert run["what"] == "raised" and run["step"] == FAIL_STEP and run["origin"] is None, run
    else:
        assert run["step"] is None, run


@pytest.mark.parametrize("name,mode", case_params(QUIET, QUIET_XFAIL))
def test_quiet_programs(name: str, mode: str) -> None:
    """No incident at all (not even logged), no error; the loop trains as the plain program does; an
    evaluation's dropped outputs are not kept alive past the next step."""
    build, loop = QUIET[name]
    program = build()
    run = train_on(program, replayable=mode == "replayable", loop=loop)
    assert not run.incidents, [describe(i) + " | " + i.summary for i in run.incidents]
    assert run.failures == ([FAIL_STEP] if loop == "catch" else []), run.failures
    reference = plain_run(build(), loop)["params"]
    assert all(torch.equal(a, b) for a, b in zip(snapshot(program.model), reference, strict=True))
    if name == "evaluation_loop_between_steps_outputs_dropped":
        gc.collect()
        alive = [r for r in EVAL_REFS if r() is not None]
        assert EVAL_REFS and not alive, f"{len(alive)} of {len(EVAL_REFS)} evaluation outputs still alive"


# ======================================================= a REAL lightning.Trainer, training_step -> None
LIGHTNING_FAIL = 3


def _lightning_data() -> list[Any]:
    out = []
    for s in range(6):
        g = _gen(2400 + s)
        x = torch.randn(8, 6, generator=g)
        y = torch.randint(0, 2, (8,), generator=g).float()
        if s == LIGHTNING_FAIL:
            x[5] = 30.0  # an unscaled feature row: the click model's logit saturates, p == 1.0 in float32
            y[5] = 0.0
        out.append((x, y))
    return out


def _click_module() -> Any:
    import lightning as L

    class ClickModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
            with torch.no_grad():
                self.net[0].weight.abs_()
                self.net[2].weight.abs_()
            self.skipped: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            p = torch.sigmoid(self(x))
            loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # <origin:click_log>
            if not torch.isfinite(loss):
                self.skipped.append(batch_idx)
                return None
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return ClickModel()


def test_lightning_construction_without_nantrace() -> None:
    """The plain click model: only batch LIGHTNING_FAIL's loss is non-finite, made by the log of 1 - p."""
    model = _click_module()
    for i, (x, y) in enumerate(_lightning_data()):
        oracle = FirstBad()
        with oracle:
            p = torch.sigmoid(model(x))
            loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        assert bool(torch.isfinite(loss)) is (i != LIGHTNING_FAIL)
        if i == LIGHTNING_FAIL:
            assert oracle.first[0] == "aten.log.default" and float(p[5]) == 1.0


@pytest.mark.parametrize("mode", ["zero_intrusive"])
def test_lightning_training_step_returns_none_on_nonfinite_loss(mode: str) -> None:
    """Lightning runs ``optimizer.step(closure)`` for every batch, the skipped one too (its closure returns None,
    no gradient: SGD updates nothing), so the skipped batch is optimizer step LIGHTNING_FAIL. One incident:
    nonfinite_loss, logged, the log in training_step; training reached the end."""
    pytest.importorskip("lightning")
    import lightning as L
    from nantrace.integrations.lightning import NanTraceCallback

    model = _click_module()
    cb = NanTraceCallback(config=nantrace.Config(outputs={"print_incidents": False}))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(model, torch.utils.data.DataLoader(_lightning_data(), batch_size=None))
    assert model.skipped == [LIGHTNING_FAIL]
    assert cb.incidents, "no incident"
    inc = cb.incidents[0]
    got = (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action, JUDGE.line(inc.source))
    assert got == (LIGHTNING_FAIL, "nonfinite_loss", "forward", "aten.log.default", None, "log_nonpositive", "logged",
                   JUDGE.marked("click_log")), [describe(i) + " | " + i.summary for i in cb.incidents]
    assert len(cb.incidents) == 1, [describe(i) for i in cb.incidents]
