"""A library of numerical-failure scenarios, each a small real model and training loop
built from a failure pattern that users report, with the diagnosis nantrace must give.

Every scenario fails at one step (``FAIL_STEP`` unless said otherwise) of a short loop:
the batches before it are healthy, the failing batch triggers the bug, the batch after it
is healthy again. The line of the user's code that issues the origin op carries a tag
comment ``# <origin:NAME>``; tests find the expected ``source`` from it with
:func:`origin_line`, so editing this file never breaks a test by shifting lines.

Usage::

    from scenarios import SCENARIOS, run
    outcome = run(SCENARIOS["masked_mean_empty_sequence"])
    outcome.incidents[0].op        # 'aten.div.Tensor'

The loss functions take ``(model, batch)``. Scenarios with ``replayable=True`` wrap it with
``guard.replayable`` (origins in the loss function can be found); the others are
zero-intrusive (the loop is exactly what a user writes without nantrace).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nantrace

FAIL_STEP = 3
STEPS = 5
NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------- framework
@dataclasses.dataclass
class Setup:
    """What one scenario trains: the loop in :func:`run` drives it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    autocast: torch.dtype | None = None
    """Run the loss computation under ``torch.autocast("cpu", dtype=...)``."""
    scaler: Any = None


@dataclasses.dataclass(frozen=True)
class Expected:
    """The exact diagnosis of a scenario's incident."""

    kind: str
    phase: str | None
    op: str | None
    module: str | None
    origin: str | None
    """Tag of the ``# <origin:TAG>`` line the source must point at; ``None``: no source."""
    cause: str
    step: int = FAIL_STEP
    action: str = "skipped"
    transient: bool | None = False
    details: tuple[tuple[str, Any], ...] = ()
    """Evidence the incident's ``details`` must hold (e.g. the float32 re-run's verdict)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[], Setup]
    expected: Expected | None
    """``None``: a healthy run, no incident may be reported."""
    replayable: bool = False
    reference: bool = True
    """The textbook rule of the reference finder ("first op, in execution order, whose inputs
    were finite and whose output was not") names the same op and module. False where an
    intentional mask feeds a later NaN, where the bad values come from outside any op
    (input, parameter), where the localiser cannot replay the origin (zero-intrusive loss
    function, transient fault) or where no op is involved (optimizer)."""
    story: str = ""


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, expected: Expected | None, *, replayable: bool = False, reference: bool = True,
             story: str = "") -> Callable[[Callable[[], Setup]], Callable[[], Setup]]:
    def register(build: Callable[[], Setup]) -> Callable[[], Setup]:
        assert name not in SCENARIOS, name
        SCENARIOS[name] = Scenario(name, build, expected, replayable, reference, story)
        return build

    return register


_TAG = re.compile(r"#\s*<origin:([\w-]+)>")


def origin_line(tag: str) -> int:
    """The 1-based line number of the ``# <origin:tag>`` comment in this file."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) for m in _TAG.finditer(line) if m.group(1) == tag]
    if len(hits) != 1:
        raise LookupError(f"origin tag {tag!r} found {len(hits)} times in {__file__}")
    return hits[0]


@dataclasses.dataclass
class Outcome:
    incidents: list[nantrace.Incident]
    unchanged: dict[int, bool]
    """For each step in which an incident was reported: were all parameters left unchanged?"""
    raised: nantrace.NonFiniteError | None
    steps_run: int


def _autocast(dtype: torch.dtype | None) -> Any:
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.shape == y.shape and torch.equal(torch.nan_to_num(x, 1.0, 2.0, 3.0), torch.nan_to_num(y, 1.0, 2.0, 3.0))
               and torch.equal(torch.isnan(x), torch.isnan(y)) for x, y in zip(a, b))


def build(scn: Scenario, seed: int = 0) -> Setup:
    torch.manual_seed(seed)
    return scn.build()


def run(scn: Scenario, *, on_anomaly: str = "skip", config: nantrace.Config | None = None,
        replayable: bool | None = None, run_dir: Any = None) -> Outcome:
    """Train the scenario under ``nantrace.watch`` the way a user's loop would (``replayable``
    overrides the scenario's own choice of wrapping the loss in ``guard.replayable``)."""
    setup = build(scn)
    config = config or nantrace.Config(print_incidents=False)
    guard = nantrace.watch(setup.model, setup.optimizer, setup.scaler, on_anomaly=on_anomaly, config=config,
                           run_dir=run_dir)
    wrap = scn.replayable if replayable is None else replayable
    loss_fn = guard.replayable(setup.loss_fn) if wrap else setup.loss_fn
    unchanged: dict[int, bool] = {}
    raised = None
    steps = 0
    try:
        for step, batch in enumerate(setup.batches):
            setup.optimizer.zero_grad()
            with _autocast(setup.autocast):
                loss = loss_fn(setup.model, batch)
            if setup.scaler is not None:
                setup.scaler.scale(loss).backward()
            else:
                loss.backward()
            before = _params(setup.model)
            seen = len(guard.incidents)
            try:
                if setup.scaler is not None:
                    setup.scaler.step(setup.optimizer)
                    setup.scaler.update()
                else:
                    setup.optimizer.step()  # <origin:optimizer_step>
            except nantrace.NonFiniteError as exc:
                raised = exc
                unchanged[step] = _same(before, _params(setup.model))
                steps = step + 1
                break
            if len(guard.incidents) > seen:
                unchanged[step] = _same(before, _params(setup.model))
            steps = step + 1
    finally:
        guard.close()
    return Outcome(list(guard.incidents), unchanged, raised, steps)


@functools.lru_cache(maxsize=None)
def outcome(name: str) -> Outcome:
    """:func:`run` of a scenario under the default policy, once per test session."""
    return run(SCENARIOS[name])


def _batches(normal: Callable[[], Any], bad: Callable[[], Any], *, fail_step: int = FAIL_STEP,
             steps: int = STEPS) -> list[Any]:
    return [bad() if i == fail_step else normal() for i in range(steps)]


def _sgd(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _xy(b: int = 4, d: int = 8, classes: int = 4, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, d) * scale, torch.randint(0, classes, (b,))


# -------------------------------------------------------------- shared model pieces
class MLP(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 16, out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def ce_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def mse_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def call_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """For models that compute their own loss (Hugging Face style)."""
    return model(*batch)


# =========================================================== forward, inside the model
class ProbClassifier(nn.Module):
    """Returns log-probabilities as log(softmax(x)) instead of log_softmax(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.body(x), dim=-1)
        return torch.log(probs)  # <origin:log_of_softmax>


def smoothed_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logp = model(x)
    target = F.one_hot(y, 4).float() * 0.9 + 0.025  # label smoothing: every class counts
    return -(target * logp).sum(-1).mean()


@scenario("log_of_underflowed_softmax",
          Expected("nonfinite_loss", "forward", "aten.log.default", "", "log_of_softmax", "log_nonpositive"),
          story="log(softmax(x)) instead of log_softmax: large logits underflow a probability to 0")
def _log_of_softmax() -> Setup:
    model = ProbClassifier()
    batches = _batches(lambda: _xy(), lambda: _xy(scale=1e3))  # large logits: softmax underflows to 0
    return Setup(model, _sgd(model), batches, smoothed_nll)


class LogFilterbank(nn.Module):
    """A learnable filterbank on a power spectrum, then log(x + eps) against log(0)."""

    def __init__(self) -> None:
        super().__init__()
        self.filters = nn.Linear(16, 8)
        with torch.no_grad():
            self.filters.weight.abs_()  # non-negative filters on non-negative power...
            self.filters.bias.zero_()

    def forward(self, power: torch.Tensor) -> torch.Tensor:
        return torch.log(self.filters(power) + 1e-6)  # <origin:log_negative>


class AudioNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frontend = LogFilterbank()
        self.head = nn.Linear(8, 4)

    def forward(self, power: torch.Tensor) -> torch.Tensor:
        return self.head(self.frontend(power))


def _spectra(denoised: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    power = torch.rand(4, 16)
    if denoised:
        power[2] -= 5.0  # ...until spectral subtraction makes a frame's power negative
    return power, torch.randint(0, 4, (4,))


@scenario("log_of_negative_filterbank",
          Expected("nonfinite_loss", "forward", "aten.log.default", "frontend", "log_negative", "log_nonpositive"),
          story="log(x + eps) guards log(0), not a negative x: a denoised spectrum with negative power")
def _log_negative() -> Setup:
    model = AudioNet()
    return Setup(model, _sgd(model), _batches(_spectra, lambda: _spectra(denoised=True)), ce_loss)


class MaskedMeanPool(nn.Module):
    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return (h * keep).sum(1) / keep.sum(1)  # <origin:masked_mean>


class TokenClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=0)
        self.pool = MaskedMeanPool()
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = (tokens != 0).unsqueeze(-1).float()
        return self.head(self.pool(self.embed(tokens), keep))


def _tokens(b: int = 4, t: int = 6, empty_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, 16, (b, t))
    tokens[:, -2:] = 0  # some padding in every batch
    if empty_row:
        tokens[1] = 0  # an empty sequence: nothing but padding
    return tokens, torch.randint(0, 2, (b,))


@scenario("masked_mean_empty_sequence",
          Expected("nonfinite_loss", "forward", "aten.div.Tensor", "pool", "masked_mean", "div_by_zero"),
          story="masked mean pooling divides by the number of real tokens, 0 for an empty sequence")
def _masked_mean() -> Setup:
    model = TokenClassifier()
    return Setup(model, _sgd(model), _batches(_tokens, lambda: _tokens(empty_row=True)), ce_loss)


class GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(8, 1)
        self.var = nn.Linear(8, 1)
        with torch.no_grad():
            self.var.weight.mul_(0.1)
            self.var.bias.fill_(4.0)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mean(h), torch.sqrt(self.var(h))  # <origin:sqrt_var>


class GaussianRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = GaussianHead()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.trunk(x))


def gaussian_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    mu, std = model(x)
    return ((y - mu) ** 2 / (2 * std**2) + torch.log(std)).mean()


@scenario("sqrt_of_unconstrained_variance",
          Expected("nonfinite_loss", "forward", "aten.sqrt.default", "head", "sqrt_var", "sqrt_negative"),
          story="a predicted variance without softplus goes negative on an outlier batch; sqrt is NaN")
def _sqrt_var() -> Setup:
    model = GaussianRegressor()
    batches = _batches(lambda: (torch.randn(8, 8), torch.randn(8, 1)), lambda: (torch.randn(8, 8) * 1e3, torch.randn(8, 1)))
    return Setup(model, _sgd(model, 1e-3), batches, gaussian_nll)


class PowerNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x ** 0.5  # <origin:power_norm>


class PowerNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(0.1)
            self.proj.bias.fill_(3.0)
        self.pnorm = PowerNorm()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.pnorm(self.proj(x)))


@scenario("fractional_power_of_negative",
          Expected("nonfinite_loss", "forward", "aten.pow.Tensor_Scalar", "pnorm", "power_norm", "sqrt_negative"),
          story="power normalisation x**0.5 without the signed form, on features that turn negative")
def _power_norm() -> Setup:
    model = PowerNormNet()
    return Setup(model, _sgd(model), _batches(lambda: _xy(), lambda: _xy(scale=100)), ce_loss)


class NaiveAttention(nn.Module):
    """A hand-written softmax without subtracting the maximum."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2)
        e = torch.exp(scores)  # <origin:naive_exp>
        return (e / e.sum(-1, keepdim=True)) @ x


class SeqClassifier(nn.Module):
    def __init__(self, attn: nn.Module, d: int = 8) -> None:
        super().__init__()
        self.attn = attn
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor, *mask: Any) -> torch.Tensor:
        return self.head(self.attn(x, *mask).mean(1))


def _seq(b: int = 2, t: int = 5, d: int = 8, scale: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, t, d) * scale, torch.randint(0, 2, (b,))


@scenario("exp_overflow_naive_softmax",
          Expected("nonfinite_loss", "forward", "aten.exp.default", "attn", "naive_exp", "exp_overflow"),
          story="exp of attention scores near 100 overflows float32; e / e.sum() is then inf / inf")
def _naive_exp() -> Setup:
    model = SeqClassifier(NaiveAttention())
    return Setup(model, _sgd(model), _batches(_seq, lambda: _seq(scale=10)), ce_loss)


class MultiplicativeMaskAttention(nn.Module):
    """Builds the additive mask as ``pad * -inf``: 0 * -inf is NaN at every visible key."""

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        scores = x @ x.transpose(1, 2) / math.sqrt(x.shape[-1])
        if pad is not None:
            scores = scores + pad[:, None, :].float() * float("-inf")  # <origin:mask_times_inf>
        return F.softmax(scores, dim=-1) @ x


def masked_seq_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, pad = batch
    return F.cross_entropy(model(x, pad), y) if pad is not None else F.cross_entropy(model(x), y)


def _padded_seq(pad_last: int = 0, fully_masked_row: bool = False, scale: float = 0.5) -> tuple[Any, ...]:
    x, y = _seq(scale=scale)
    if not pad_last and not fully_masked_row:
        return x, y, None  # the collate returns no mask when nothing is padded
    pad = torch.zeros(x.shape[:2], dtype=torch.bool)
    if pad_last:
        pad[:, -pad_last:] = True
    if fully_masked_row:
        pad[1] = True
    return x, y, pad


@scenario("inf_mask_multiplied",
          Expected("nonfinite_loss", "forward", "aten.mul.Tensor", "attn", "mask_times_inf", "inf_arithmetic"),
          story="additive mask built as mask * -inf: the first padded batch gives 0 * -inf = NaN")
def _mask_times_inf() -> Setup:
    model = SeqClassifier(MultiplicativeMaskAttention())
    return Setup(model, _sgd(model), _batches(_padded_seq, lambda: _padded_seq(pad_last=2)), masked_seq_loss)


class ShiftedSoftmaxAttention(nn.Module):
    """Masks with -inf, then subtracts the row maximum by hand (stable softmax)."""

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = (x @ x.transpose(1, 2)).masked_fill(pad[:, None, :], float("-inf"))
        scores = scores - scores.amax(-1, keepdim=True)  # <origin:inf_minus_inf>
        p = scores.exp()
        return (p / p.sum(-1, keepdim=True)) @ x


@scenario("inf_minus_inf_row_max",
          Expected("nonfinite_loss", "forward", "aten.sub.Tensor", "attn", "inf_minus_inf", "inf_arithmetic",
                   details=(("intentional_inf", True),)),
          reference=False,
          story="x - x.max() on a fully masked row is -inf - (-inf)")
def _inf_minus_inf() -> Setup:
    model = SeqClassifier(ShiftedSoftmaxAttention())
    return Setup(model, _sgd(model), _batches(lambda: _padded_seq(pad_last=1), lambda: _padded_seq(pad_last=1, fully_masked_row=True)),
                 masked_seq_loss)


class MaskedAttention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)).masked_fill(pad[:, None, :], float("-inf"))
        return F.softmax(scores, dim=-1) @ v  # <origin:masked_softmax>


@scenario("fully_masked_attention_row",
          Expected("nonfinite_loss", "forward", "aten._softmax.default", "attn", "masked_softmax", "masked_softmax_all",
                   details=(("intentional_inf", True),)),
          reference=False,
          story="a sequence made only of padding: every key of its rows is masked with -inf")
def _masked_softmax() -> Setup:
    model = SeqClassifier(MaskedAttention())
    return Setup(model, _sgd(model), _batches(lambda: _padded_seq(pad_last=1), lambda: _padded_seq(pad_last=1, fully_masked_row=True)),
                 masked_seq_loss)


class CausalAttention(nn.Module):
    def __init__(self, d: int = 8, t: int = 5) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("causal", torch.full((t, t), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(x.shape[-1]) + self.causal
        return F.softmax(scores, dim=-1) @ v


@scenario("causal_mask_is_not_a_failure", None,
          story="a -inf causal mask (a buffer added to the scores) on normal batches: never reported")
def _causal_ok() -> Setup:
    model = SeqClassifier(CausalAttention())
    return Setup(model, _sgd(model), _batches(_seq, _seq), ce_loss)


@scenario("padding_mask_is_not_a_failure", None,
          story="masked_fill(pad, -inf) where every row keeps a visible key: never reported")
def _padding_ok() -> Setup:
    model = SeqClassifier(MaskedAttention())
    return Setup(model, _sgd(model), _batches(lambda: _padded_seq(pad_last=2), lambda: _padded_seq(pad_last=4)), masked_seq_loss)


class NormFirstNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8, eps=0.0)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)  # <origin:layernorm>
        return self.head(h)


def _constant_row() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _xy()
    x[2] = 0.5  # a constant feature vector (a blank record)
    return x, y


@scenario("layernorm_eps0_constant_input",
          Expected("nonfinite_loss", "forward", "aten.native_layer_norm.default", "norm", "layernorm", "zero_variance_norm"),
          story="LayerNorm(eps=0) on a constant feature vector: 0 / sqrt(0)")
def _layernorm() -> Setup:
    model = NormFirstNet()
    return Setup(model, _sgd(model), _batches(_xy, _constant_row), ce_loss)


class ConvGN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(4, 4, eps=0.0)
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gn(self.conv(x))  # <origin:groupnorm>
        return self.head(torch.relu(h).flatten(1))


def _signal(blank: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 1, 8)
    if blank:
        x[0] = 0.0  # a blank recording: the convolution output is constant per channel
    return x, torch.randint(0, 2, (4,))


@scenario("groupnorm_eps0_blank_signal",
          Expected("nonfinite_loss", "forward", "aten.native_group_norm.default", "gn", "groupnorm", "zero_variance_norm"),
          story="GroupNorm(eps=0) with one channel per group on a blank input")
def _groupnorm() -> Setup:
    model = ConvGN()
    return Setup(model, _sgd(model), _batches(_signal, lambda: _signal(blank=True)), ce_loss)


class RMSNormNoEps(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight  # <origin:rms_rsqrt>


class RMSTokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=0)
        self.norm = RMSNormNoEps()
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)).mean(1))


def _unpadded_tokens(pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, 16, (4, 6))
    if pad:
        tokens[0, -2:] = 0  # padding_idx: its embedding is the zero vector
    return tokens, torch.randint(0, 2, (4,))


@scenario("rsqrt_of_zero_rmsnorm_padding",
          Expected("nonfinite_loss", "forward", "aten.rsqrt.default", "norm", "rms_rsqrt", "zero_variance_norm"),
          story="RMSNorm written without eps; the padding embedding is the zero vector: rsqrt(0) = inf, 0 * inf. "
                "The divisor is a root mean square over a constant (zero) slice: a normalisation without eps")
def _rmsnorm() -> Setup:
    model = RMSTokenNet()
    return Setup(model, _sgd(model), _batches(_unpadded_tokens, lambda: _unpadded_tokens(pad=True)), ce_loss)


class LMWithLoss(nn.Module):
    """Computes its own loss from labels, Hugging Face style."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(tokens))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # <origin:hf_loss>


def _lm_batch(all_ignored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 16, (2, 6))
    labels = tokens.roll(-1, 1)
    labels[:, :3] = -100  # prompt tokens are not trained on
    if all_ignored:
        labels[:] = -100  # a batch of prompts only
    return tokens, labels


@scenario("model_loss_all_labels_ignored",
          Expected("nonfinite_loss", "forward", "aten.nll_loss_forward.default", "", "hf_loss", "label_out_of_range"),
          story="every label of the batch is -100: cross-entropy's mean over zero tokens is 0/0")
def _hf_ignored() -> Setup:
    model = LMWithLoss()
    return Setup(model, _sgd(model), _batches(_lm_batch, lambda: _lm_batch(all_ignored=True)), call_loss)


class LMWithTokenMeanLoss(LMWithLoss):
    """Sums the token losses and divides by the number of trained tokens (Hugging Face's loss
    under gradient accumulation, or a hand-written token mean)."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(tokens))
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum()  # <origin:ce_token_mean>


@scenario("token_mean_loss_all_labels_ignored",
          Expected("nonfinite_loss", "forward", "aten.div.Tensor", "", "ce_token_mean", "label_out_of_range"),
          story="every label is -100 and the summed loss is divided by the count of trained tokens: 0/0")
def _token_mean_ignored() -> Setup:
    model = LMWithTokenMeanLoss()
    return Setup(model, _sgd(model), _batches(_lm_batch, lambda: _lm_batch(all_ignored=True)), call_loss)


def _nan_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _xy()
    x[1, 3] = NAN  # a corrupt record
    return x, y


@scenario("nan_in_input_batch",
          Expected("nonfinite_input", "data", None, None, None, "nonfinite_input"),
          reference=False, story="a NaN in the batch (a corrupt record)")
def _nan_input() -> Setup:
    model = MLP()
    return Setup(model, _sgd(model), _batches(_xy, _nan_batch), ce_loss)


class ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.empty(8))  # forgot to initialise it
        with torch.no_grad():
            self.scale.fill_(1.0)
            self.scale[5] = NAN  # what torch.empty may hold: garbage, here a NaN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ScaledBlock()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@scenario("nan_parameter_before_training",
          Expected("nonfinite_param", None, None, "block", None, "nonfinite_param", step=0, action="raised", transient=None),
          reference=False, story="a parameter created with torch.empty and never initialised")
def _nan_param() -> Setup:
    model = ScaledNet()
    return Setup(model, _sgd(model), _batches(_xy, _xy), ce_loss)


class LateExpert(nn.Module):
    """An expert that receives no tokens until step 2 (its grad is None until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 4)
        self.expert = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, route: bool) -> torch.Tensor:
        out = self.shared(x)
        if route:
            out = out + self.expert(x)
        return out


def routed_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, route = batch
    return F.cross_entropy(model(x, route), y)


def _routed(step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    x, y = _xy()
    if step == 2:
        x[:, 3] = 0.0  # a feature absent from this batch: its weights get exactly zero gradient
    return x, y, step >= 2


@scenario("adam_eps0_update_makes_nan",
          Expected("nonfinite_param", "optimizer", "aten.addcdiv_.default", "expert", "optimizer_step", "optimizer_state",
                   step=2, details=(("parameter", "expert.weight"), ("state", "exp_avg_sq"))),
          reference=False,
          story="Adam with eps=0: a weight with zero gradient gets 0 / sqrt(0) in its first update")
def _adam_eps0() -> Setup:
    model = LateExpert()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    return Setup(model, opt, [_routed(i) for i in range(STEPS)], routed_loss)


# ------------------------------------------------------------- the optimizer's own update
class GatedExpert(nn.Module):
    """A shared layer plus an expert weighted by its gate (0: the expert is not routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 4)
        self.expert = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, gate: float) -> torch.Tensor:
        out = self.shared(x)
        if gate:
            out = out + gate * self.expert(x)
        return out


def gated_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, gate = batch
    return F.mse_loss(model(x, gate).float(), y)


def _gated(gate: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    return torch.randn(16, 8).half(), torch.randn(16, 4) * 30, gate


@scenario("fp16_adam_eps_underflow",
          Expected("nonfinite_param", "optimizer", "aten.addcdiv_.default", "expert", "optimizer_step", "optimizer_state",
                   details=(("parameter", "expert.weight"), ("state", "exp_avg_sq"), ("float32_replay_finite", True))),
          reference=False,
          story="a float16 model with Adam's default eps=1e-8, which rounds to 0 in float16: an expert first routed "
                "with a small gate has gradients whose square underflows, so exp_avg_sq is 0 and m / (0 + 0) is inf")
def _fp16_adam() -> Setup:
    model = GatedExpert().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Setup(model, opt, _batches(lambda: _gated(0.0), lambda: _gated(1e-3)), gated_loss)


class TinyLARS(torch.optim.Optimizer):
    """LARS (You et al., 2017) written the short way: no guard for a zero gradient norm."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, trust_coef: float = 1e-3) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, trust_coef=trust_coef))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local_lr = group["trust_coef"] * p.norm() / p.grad.norm()  # <origin:lars_trust_ratio>
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad * local_lr, alpha=group["lr"])
                p.sub_(buf)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


@scenario("lars_trust_ratio_zero_grad_norm",
          Expected("nonfinite_param", "optimizer", "aten.div.Tensor", "encoder", "lars_trust_ratio", "div_by_zero",
                   details=(("parameter", "encoder.weight"), ("state", "momentum_buffer"))),
          reference=False,
          story="a hand-written LARS divides by the gradient norm, which is 0 for the first layer on an all-zero batch")
def _lars() -> Setup:
    model = Encoder()
    return Setup(model, TinyLARS(model.parameters()), _batches(_xy, lambda: (torch.zeros(4, 8), torch.randint(0, 4, (4,)))),
                 ce_loss)


def resume_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, checkpoint = batch
    if checkpoint is not None:
        model.load_state_dict(checkpoint)  # resume from the checkpoint a diverged run wrote
    return F.cross_entropy(model(x), y)


@scenario("checkpoint_with_nan_loaded_mid_run",
          Expected("nonfinite_param", None, None, "head", None, "nonfinite_param", action="raised", transient=None),
          reference=False,
          story="a checkpoint holding NaN weights is loaded between two steps: not the optimizer's doing")
def _nan_checkpoint() -> Setup:
    model = Encoder()
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint["head.weight"][1, 2] = NAN
    return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                 _batches(lambda: (*_xy(), None), lambda: (*_xy(), checkpoint)), resume_loss)


# ----------------------------------------------------------------- low precision (CPU)
class Fp16Attention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)  # <origin:fp16_scores>
        return F.softmax(scores, dim=-1) @ x


def _half_seq(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(2, 5, 16) * scale).half(), torch.randint(0, 2, (2,))


@scenario("fp16_model_attention_scores_overflow",
          Expected("nonfinite_loss", "forward", "aten.bmm.default", "attn", "fp16_scores", "precision_overflow",
                   details=(("float32_rerun_finite", True),)),
          story="a model held in float16: q @ k^T passes 65504 on large activations (finite in float32)")
def _fp16_model() -> Setup:
    model = SeqClassifier(Fp16Attention(), d=16).half()
    return Setup(model, _sgd(model), _batches(_half_seq, lambda: _half_seq(scale=300)), ce_loss)


@scenario("fp16_autocast_grad_scaler_overflow",
          Expected("nonfinite_loss", "forward", "aten.bmm.default", "attn", "fp16_scores", "precision_overflow",
                   details=(("float32_rerun_finite", True),)),
          story="CPU autocast float16 with a GradScaler: the forward overflows (an incident, not calibration)")
def _fp16_autocast() -> Setup:
    model = SeqClassifier(Fp16Attention(), d=16)
    batches = _batches(lambda: (torch.randn(2, 5, 16), torch.randint(0, 2, (2,))),
                       lambda: (torch.randn(2, 5, 16) * 300, torch.randint(0, 2, (2,))))
    return Setup(model, _sgd(model), batches, ce_loss, autocast=torch.float16, scaler=torch.amp.GradScaler("cpu"))


class HalfVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.mu = nn.Linear(8, 2)
        self.logvar = nn.Linear(8, 2)
        self.dec = nn.Linear(2, 8)
        with torch.no_grad():
            self.mu.weight.mul_(0.01)
            self.mu.bias.zero_()
            self.logvar.weight.zero_()
            self.logvar.weight[:, 0] = 1.0  # log-variance follows the first hidden unit
            self.logvar.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar.clamp_max(8))
        return self.dec(z), mu, logvar


def vae_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = model(x)
    var = logvar.exp()  # <origin:vae_kl_exp>
    kl = -0.5 * (1 + logvar - mu.pow(2) - var).sum(-1).mean()
    return F.mse_loss(recon, x) + kl


def _vae_batch(hot: bool = False) -> torch.Tensor:
    x = torch.randn(4, 8) * 0.5
    if hot:
        x = x * 40  # an unnormalised batch: log-variance reaches ~12, exp(12) > 65504
    return x.half()


@scenario("fp16_vae_kl_exp_overflow",
          Expected("nonfinite_loss", "forward", "aten.exp.default", None, "vae_kl_exp", "precision_overflow",
                   details=(("float32_rerun_finite", True),)),
          replayable=True,
          story="a float16 VAE: exp(logvar) in the KL term passes 65504 (finite in float32)")
def _fp16_vae() -> Setup:
    model = HalfVAE()
    with torch.no_grad():
        model.enc.weight.abs_()  # keep the first hidden unit alive and positive on the large batch
    model = model.half()
    return Setup(model, _sgd(model, 1e-4), _batches(_vae_batch, lambda: _vae_batch(hot=True)), vae_loss)


PROTOTYPES = torch.randn(4, 16) * 4


def prototype_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x) @ PROTOTYPES.T  # <origin:proto_mm>
    return F.cross_entropy(logits.float(), y)


@scenario("fp16_scaler_prototype_matmul_in_loss",
          Expected("nonfinite_loss", "forward", "aten.mm.default", None, "proto_mm", "precision_overflow"),
          story="CPU autocast float16 with a GradScaler, zero-intrusive: the loss code's prototype product "
                "overflows 65504 (the loss tape is noted at GradScaler.scale)")
def _fp16_proto() -> Setup:
    model = nn.Sequential(nn.Linear(8, 16))
    batches = _batches(lambda: _xy(d=8), lambda: _xy(d=8, scale=3e4))
    return Setup(model, _sgd(model), batches, prototype_loss, autocast=torch.float16,
                 scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))


def poisson_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    rate = F.relu(model(x))
    log_rate = torch.log(rate)  # <origin:poisson_log>
    return (rate - y * log_rate).mean()


class RateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc.weight.fill_(0.05)
            self.fc.bias.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@scenario("bf16_autocast_log_of_zero_rate",
          Expected("nonfinite_loss", "forward", "aten.log.default", None, "poisson_log", "log_nonpositive",
                   details=(("float32_rerun_finite", False),)),
          replayable=True,
          story="bfloat16 autocast, but a genuine math error: relu'd Poisson rate of 0; float32 re-run fails too")
def _bf16_log() -> Setup:
    model = RateNet()
    batches = _batches(lambda: (torch.randn(4, 8), torch.rand(4, 1) * 3),
                       lambda: (-torch.ones(4, 8) * 100, torch.rand(4, 1) * 3))
    return Setup(model, _sgd(model, 1e-3), batches, poisson_nll, autocast=torch.bfloat16)


# --------------------------------------------------------- compiled and transient
class SmallLogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.sigmoid(self.fc(x))
        return torch.log(probs)  # <origin:compiled_log>


@scenario("compiled_model_log_of_zero",
          Expected("nonfinite_loss", "forward", "aten.log.default", "", "compiled_log", "log_nonpositive"),
          story="torch.compile'd model (aot_eager): the replay runs eagerly and still names the op and line")
def _compiled() -> Setup:
    model = SmallLogNet()
    compiled = torch.compile(model, backend="aot_eager")
    batches = _batches(lambda: (torch.randn(4, 8), torch.rand(4, 4)),
                       lambda: (torch.randn(4, 8) * 1e4, torch.rand(4, 4)))  # sigmoid underflows to 0
    return Setup(compiled, _sgd(model), batches, lambda m, b: -(b[1] * m(b[0])).mean())


class FlakyLayer(nn.Module):
    """Produces a NaN on its fourth call only, like a bit flip on a faulty device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        if self.calls == FAIL_STEP + 1:
            h = h.clone()
            h.view(-1)[3] = NAN
        return h


class FlakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flaky = FlakyLayer()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.flaky(x)))


@scenario("transient_fault_not_reproduced",
          Expected("nonfinite_loss", "forward", None, "", None, "unknown", transient=True),
          reference=False, story="a NaN that an identical re-run of the step does not reproduce")
def _transient() -> Setup:
    model = FlakyNet()
    return Setup(model, _sgd(model), _batches(_xy, _xy), ce_loss)


# ============================================== forward, inside the loss function
def bce_by_hand(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    p = torch.sigmoid(model(x)).squeeze(-1)
    pos = y * torch.log(p)
    neg = (1 - y) * torch.log(1 - p)  # <origin:bce_log>
    return -(pos + neg).mean()


class LogitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _binary(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8) * scale
    return x, torch.tensor([1.0, 0.0, 1.0, 0.0])


@scenario("bce_by_hand_saturated_sigmoid",
          Expected("nonfinite_loss", "forward", "aten.log.default", None, "bce_log", "log_nonpositive"),
          replayable=True,
          story="binary cross-entropy written as log(p) + log(1 - p): sigmoid rounds to 1.0, log(0)")
def _bce() -> Setup:
    model = LogitNet()
    return Setup(model, _sgd(model), _batches(_binary, lambda: _binary(scale=100)), bce_by_hand)


def ignore_index_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, ignore_index=-100)  # <origin:ce_ignored>


def _maybe_ignored(all_ignored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _xy()
    y[0] = -100
    if all_ignored:
        y[:] = -100
    return x, y


@scenario("cross_entropy_all_ignored_in_loss_fn",
          Expected("nonfinite_loss", "forward", "aten.nll_loss_forward.default", None, "ce_ignored", "label_out_of_range"),
          replayable=True, story="every target equals ignore_index: mean over zero elements")
def _ce_ignored() -> Setup:
    model = MLP()
    return Setup(model, _sgd(model), _batches(_maybe_ignored, lambda: _maybe_ignored(all_ignored=True)), ignore_index_ce)


@scenario("cross_entropy_all_ignored_zero_intrusive",
          Expected("nonfinite_loss", "forward", "aten.nll_loss_forward.default", None, "ce_ignored", "label_out_of_range"),
          story="same failure without guard.replayable: the loss tape replays the loss code")
def _ce_ignored_zi() -> Setup:
    return _ce_ignored()


def masked_policy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, valid, action, advantage = batch
    logits = model(obs).masked_fill(~valid, float("-inf"))
    logp = F.log_softmax(logits, dim=-1)  # <origin:policy_log_softmax>
    return -(logp.gather(1, action[:, None]).squeeze(1) * advantage).mean()


def _policy_batch(no_valid_action: bool = False) -> tuple[torch.Tensor, ...]:
    obs = torch.randn(4, 8)
    valid = torch.ones(4, 4, dtype=torch.bool)
    valid[:, 3] = False
    if no_valid_action:
        valid[2] = False  # a terminal state with no legal action
    return obs, valid, torch.randint(0, 3, (4,)), torch.randn(4)


@scenario("policy_all_actions_masked",
          Expected("nonfinite_loss", "forward", "aten._log_softmax.default", None, "policy_log_softmax", "masked_softmax_all",
                   details=(("intentional_inf", True),)),
          replayable=True, reference=False,
          story="invalid actions masked with -inf; a state where no action is valid")
def _policy() -> Setup:
    model = MLP()
    return Setup(model, _sgd(model), _batches(_policy_batch, lambda: _policy_batch(no_valid_action=True)), masked_policy_loss)


def dirichlet_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    x, p = batch
    alpha = F.relu(model(x))  # should be softplus(...) + 1e-3
    norm = torch.lgamma(alpha.sum(-1))
    per_class = torch.lgamma(alpha)  # <origin:dirichlet_lgamma>
    return -(norm - per_class.sum(-1) + ((alpha - 1) * torch.log(p)).sum(-1)).mean()


class ConcentrationNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[0] = 0.05  # only the first concentration depends on the input
            self.fc.bias.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@scenario("lgamma_of_zero_concentration",
          Expected("nonfinite_loss", "forward", "aten.lgamma.default", None, "dirichlet_lgamma", "log_nonpositive"),
          replayable=True, story="Dirichlet NLL with relu'd concentrations: lgamma(0) = inf")
def _lgamma() -> Setup:
    model = ConcentrationNet()
    p = lambda: F.softmax(torch.randn(4, 3), -1)  # noqa: E731
    outlier = lambda: torch.cat([torch.full((1, 8), -100.0), torch.randn(3, 8)])  # noqa: E731
    batches = _batches(lambda: (torch.randn(4, 8), p()), lambda: (outlier(), p()))
    return Setup(model, _sgd(model, 1e-3), batches, dirichlet_nll)


def token_mean_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, mask = batch
    per_token = F.mse_loss(model(x), y, reduction="none").mean(-1)
    return (per_token * mask).sum() / mask.sum()  # <origin:token_mean>


def _masked_regression(empty: bool = False) -> tuple[torch.Tensor, ...]:
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    mask = (torch.rand(6) > 0.3).float()
    mask[0] = 1.0
    if empty:
        mask[:] = 0.0  # no supervised token in this batch
    return x, y, mask


@scenario("loss_normalised_by_zero_count",
          Expected("nonfinite_loss", "forward", "aten.div.Tensor", None, "token_mean", "div_by_zero"),
          replayable=True, story="a masked loss divided by mask.sum(), which is 0 for a batch with no labels")
def _token_mean() -> Setup:
    model = MLP()
    return Setup(model, _sgd(model), _batches(_masked_regression, lambda: _masked_regression(empty=True)), token_mean_loss)


def exponential_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    margin = y * model(x).squeeze(-1)
    return torch.exp(-margin).mean()  # <origin:exp_loss>


@scenario("exponential_loss_overflow_float32",
          Expected("nonfinite_loss", "forward", "aten.exp.default", None, "exp_loss", "exp_overflow"),
          replayable=True, story="AdaBoost-style exp(-y f(x)) on a badly misclassified outlier: exp(>88) in float32")
def _exp_loss() -> Setup:
    model = LogitNet()
    signs = lambda: torch.tensor([1.0, -1.0] * 4)  # noqa: E731
    return Setup(model, _sgd(model), _batches(lambda: (torch.randn(8, 8), signs()), lambda: (torch.randn(8, 8) * 3000, signs())),
                 exponential_loss)


def _inf_dict_batch(bad: bool = False) -> dict[str, torch.Tensor]:
    x, y = _xy()
    if bad:
        x[0, 0] = INF  # a sensor value that overflowed upstream
    return {"x": x, "y": y}


def dict_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


@scenario("inf_in_input_batch_replayable",
          Expected("nonfinite_input", "data", None, None, None, "nonfinite_input"),
          replayable=True, reference=False, story="an Inf in a dict batch, with guard.replayable")
def _inf_input() -> Setup:
    model = MLP()
    return Setup(model, _sgd(model), _batches(_inf_dict_batch, lambda: _inf_dict_batch(bad=True)), dict_ce)


# ======================================================================== backward
class SafeSqrtFeatures(nn.Module):
    """A learned scale, then a 'safe' sqrt that selects 0 for negative values."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        return torch.where(h > 0, torch.sqrt(h), 0.0)  # <origin:where_sqrt>


class WhereNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = SafeSqrtFeatures()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _counts(missing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(4, 8) * 10  # non-negative counts
    if missing:
        x[1, 2] = -1.0  # the data set's "missing" sentinel
    return x, torch.randint(0, 4, (4,))


@scenario("where_sqrt_gradient_trap",
          Expected("nonfinite_grad", "forward", "aten.sqrt.default", "features", "where_sqrt", "where_gradient_trap"),
          story="torch.where(h > 0, sqrt(h), 0): the forward is finite, the gradient of the unselected sqrt is NaN")
def _where_sqrt() -> Setup:
    model = WhereNet()
    return Setup(model, _sgd(model), _batches(_counts, lambda: _counts(missing=True)), ce_loss)


def entropy_bonus_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    p = F.softmax(logits, dim=-1)
    plogp = torch.where(p > 0, p * torch.log(p), 0.0)  # <origin:where_log>
    return F.cross_entropy(logits, y) + 0.01 * plogp.sum(-1).mean()


@scenario("where_log_entropy_gradient_trap",
          Expected("nonfinite_grad", "forward", "aten.log.default", None, "where_log", "where_gradient_trap"),
          replayable=True,
          story="entropy as where(p > 0, p log p, 0): log(0) in the unselected branch makes the gradient NaN")
def _where_log() -> Setup:
    model = MLP()
    return Setup(model, _sgd(model), _batches(_xy, lambda: _xy(scale=1e3)), entropy_bonus_loss)


class PairDistance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # <origin:pair_sqrt>


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.distance = PairDistance()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.distance(self.enc(a), self.enc(b))


def contrastive_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    a, b, same = batch
    d = model(a, b)
    return (same * d**2 + (1 - same) * F.relu(2.0 - d) ** 2).mean()


def _pairs(duplicate: bool = False) -> tuple[torch.Tensor, ...]:
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    if duplicate:
        b[2] = a[2]  # the same image twice in a positive pair
    return a, b, torch.tensor([1.0, 0.0, 1.0, 0.0])


@scenario("sqrt_distance_of_identical_pair",
          Expected("nonfinite_grad", "backward", "aten.sqrt.default", "distance", "pair_sqrt", "grad_singularity"),
          story="Euclidean distance as sqrt(sum(d^2)) of a duplicated pair: d sqrt/dx is infinite at 0")
def _pair_sqrt() -> Setup:
    model = Siamese()
    return Setup(model, _sgd(model), _batches(_pairs, lambda: _pairs(duplicate=True)), contrastive_loss)


class AngleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos = torch.tanh(self.fc(x))
        return torch.acos(cos)  # <origin:acos>


class AngleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.angle = AngleHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.angle(x)


@scenario("acos_at_one_saturated_tanh",
          Expected("nonfinite_grad", "backward", "aten.acos.default", "angle", "acos", "grad_singularity"),
          story="acos of a cosine that saturates to exactly 1.0: the derivative -1/sqrt(1-x^2) is infinite")
def _acos() -> Setup:
    model = AngleNet()
    batches = _batches(lambda: (torch.randn(4, 8) * 0.3, torch.rand(4, 1)), lambda: (torch.randn(4, 8) * 100, torch.rand(4, 1)))
    return Setup(model, _sgd(model), batches, mse_loss)


def rmse_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.sqrt(F.mse_loss(model(x), y))  # <origin:rmse>


class BiasFreeRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _regression(perfect: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if perfect:
        return torch.zeros(4, 8), torch.zeros(4, 2)  # an all-padding batch: prediction == target
    return torch.randn(4, 8), torch.randn(4, 2)


@scenario("rmse_loss_at_perfect_fit",
          Expected("nonfinite_grad", "backward", "aten.sqrt.default", None, "rmse", "grad_singularity"),
          replayable=True, story="RMSE as sqrt(mse) reaches 0 exactly: an infinite derivative")
def _rmse() -> Setup:
    model = BiasFreeRegressor()
    return Setup(model, _sgd(model), _batches(_regression, lambda: _regression(perfect=True)), rmse_loss)


@scenario("rmse_loss_at_perfect_fit_zero_intrusive",
          Expected("nonfinite_grad", "backward", "aten.sqrt.default", None, "rmse", "grad_singularity"),
          story="same without guard.replayable: the gradient arriving at the model's output is already NaN; the loss "
                "tape replays the loss code's backward")
def _rmse_zi() -> Setup:
    return _rmse()


def triplet_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    anchor, positive, negative = (model(t) for t in batch)
    sq_pos = ((anchor - positive) ** 2).sum(-1)
    sq_neg = ((anchor - negative) ** 2).sum(-1)
    d_pos = sq_pos ** 0.5  # <origin:triplet_pow>
    d_neg = sq_neg.clamp_min(1e-12) ** 0.5
    return F.relu(d_pos - d_neg + 1.0).mean()


def _triplets(collapsed: bool = False) -> tuple[torch.Tensor, ...]:
    a, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    if collapsed:
        p[1] = a[1]  # the positive is the anchor itself
    return a, p, n


@scenario("pow_half_distance_at_zero_in_loss_fn",
          Expected("nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", None, "triplet_pow", "grad_singularity"),
          replayable=True, story="a triplet loss with distances as x ** 0.5: infinite derivative at distance 0")
def _triplet() -> Setup:
    model = MLP(out=8)
    return Setup(model, _sgd(model), _batches(_triplets, lambda: _triplets(collapsed=True)), triplet_loss)


class DeepChain(nn.Module):
    """Twelve bias-free linear layers initialised with a gain of 1e3 (meant: 1)."""

    def __init__(self, depth: int = 12, d: int = 4, gain: float = 1e3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(depth))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.eye(d) * gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # <origin:chain_layer>
        return x


def _tiny(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(2, 4) * scale + scale, torch.zeros(2, 4)


# The output is 1e36 * x and the gradient at the output 2 * out / 8; backward multiplies it by
# 1e3 per layer. Healthy batches (x ~ 1e-34): at most ~5e34, finite. The bad batch (x ~ 3e-20):
# out ~ 3e16, finite loss ~ 1e33; the gradient reaches ~1e37 after 7 layers and overflows in the
# 8th from the top, layers.4, whose backward computes the gradient of its input.


@scenario("gradient_explosion_deep_chain",
          Expected("nonfinite_grad", "backward", "aten.mm.default", "layers.4", "chain_layer", "gradient_explosion"),
          story="a deep chain with a huge init gain: the forward stays finite, its backward overflows float32")
def _explosion() -> Setup:
    model = DeepChain()
    batches = _batches(lambda: _tiny(1e-34), lambda: _tiny(2e-20))
    return Setup(model, torch.optim.SGD(model.parameters(), lr=1e-6), batches, mse_loss)
