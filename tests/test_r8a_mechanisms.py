"""The mechanisms behind round 8a's fixes (docs/diagnosis.md), each on programs of other shapes than r8a's.

1. Absorption follows the producer chain (``tracer._name_absorber``): a forward infinity read only through ops
   that keep it infinite (``1 + e``, ``0.5 * e``) before a saturating op takes it to a finite value keeps the
   forward op's own cause; only a selection seen on that chain makes the where trap (``classify._selected_away``).
2. A ``replayable`` call whose re-run ends at a NaN already in the program's state (a memory bank written after
   use, an attribute rebound between steps) is inconclusive: the step is diagnosed from its forwards, loss tape
   and prelude instead (``localiser._met_earlier_state``).
3. Parameters non-finite at the check though no update changed them since ``watch()``: the step's own forward
   may have written them (a data-dependent initialisation, through ``p.data`` or ``torch.no_grad``), so the
   failure the step shows is replayed (``triage.PARAMS_WITHOUT_UPDATE``; the replay links ``p`` to the op that
   wrote its memory, ``tracer.OpTracer.wrote_into``, and an overwrite does not read its destination,
   ``tracer._OVERWRITES``); a replay that reads them non-finite before any op made them so says
   ``nonfinite_param`` and the policy's action (``localiser.settle_parameter_writes``).

Each case asserts the first blocking incident's step, kind, phase, op, module, source line, cause and action.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

FAIL = 2
STEPS = 4


@dataclasses.dataclass
class Program:
    """A training script: model, optimizer, batches, ``loss(model, batch)``, code run before each step's batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    before_step: Callable[[int], None] | None = None
    after_watch: Callable[[nn.Module], None] | None = None
    """Code the script runs once between ``watch()`` and its first step (a weight surgery, a late load)."""


@dataclasses.dataclass(frozen=True)
class Want:
    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    cause: str
    step: int = FAIL
    action: str = "skipped"


@dataclasses.dataclass
class Run:
    incidents: list[Any]
    error: BaseException | None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def train(program: Program, *, replayable: bool) -> Run:
    """The loop under nantrace (on_anomaly="skip"); an exception ends it as it would end the script."""
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_fn = guard.replayable(program.loss) if replayable else program.loss
    if program.after_watch is not None:
        program.after_watch(model)
    error = None
    try:
        for step, batch in enumerate(program.batches):
            if program.before_step is not None:
                program.before_step(step)
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the script dies here
        error = exc
    finally:
        guard.close()
    return Run(list(guard.incidents), error)


def plain(program: Program) -> nn.Module:
    """The program without nantrace, each step whose loss or gradients are non-finite not applied."""
    model, opt = program.model, program.optimizer
    if program.after_watch is not None:
        program.after_watch(model)
    for step, batch in enumerate(program.batches):
        if program.before_step is not None:
            program.before_step(step)
        opt.zero_grad()
        loss = program.loss(model, batch)
        loss.backward()
        if bool(torch.isfinite(loss)) and all(p.grad is None or bool(torch.isfinite(p.grad).all())
                                              for p in model.parameters()):
            opt.step()
    return model


def check(run: Run, want: Want) -> None:
    """The first blocking incident is the expected one, pointing at the marked line."""
    blocking = [i for i in run.incidents if i.action != "logged"]
    assert blocking, ("no incident", repr(run.error))
    inc = blocking[0]
    got = (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause, inc.action)
    assert got == (want.step, want.kind, want.phase, want.op, want.module, want.cause, want.action), inc.summary
    if want.tag is None:
        assert inc.source is None, inc.source
    else:
        assert points_at(inc.source, __file__, want.tag), inc.source
    if want.action == "raised":
        assert isinstance(run.error, nantrace.NonFiniteError) and run.error.incident is inc
    else:
        assert run.error is None, repr(run.error)


# ============================================================ 1. absorption follows the producer chain
class HandSigmoidGRUCell(nn.Module):
    """A GRU cell ported from NumPy: sigmoid(z) = 1 / (1 + exp(-z))."""

    def __init__(self, n_in: int, n_hidden: int) -> None:
        super().__init__()
        self.x2h = nn.Linear(n_in, 3 * n_hidden)
        self.h2h = nn.Linear(n_hidden, 3 * n_hidden)

    @staticmethod
    def sigmoid(z: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 + torch.exp(-z))  # <origin:gru_exp>

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        xr, xu, xn = self.x2h(x).chunk(3, dim=1)
        hr, hu, hn = self.h2h(h).chunk(3, dim=1)
        r, u = self.sigmoid(xr + hr), self.sigmoid(xu + hu)
        n = torch.tanh(xn + r * hn)
        return (1 - u) * n + u * h


class SensorGRU(nn.Module):
    def __init__(self, n_in: int = 4, n_hidden: int = 12) -> None:
        super().__init__()
        self.n_hidden = n_hidden
        self.cell = HandSigmoidGRUCell(n_in, n_hidden)
        self.head = nn.Linear(n_hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.n_hidden)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h).squeeze(-1)


def _gru_sigmoid() -> Program:
    """A sensor recorded in raw counts (~3e4) at step 2: gate pre-activations of -thousands, exp(-z) = inf, and
    the reciprocal of 1 + inf is 0: a finite gate; the exp's derivative is 0 x inf."""
    torch.manual_seed(0)
    model = SensorGRU()
    g = _gen(880)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 5, 4, generator=g)
        if step == FAIL:
            x[3] = torch.rand(5, 4, generator=g) * 3e4
        return x, torch.randn(6, generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.01), [batch(s) for s in range(STEPS)],
                   lambda m, b: F.mse_loss(m(b[0]), b[1]))


class VarianceHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.body(x).unbind(-1)
        return mu, logvar


def bounded_variance_penalty(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    mu, logvar = model(x)
    penalty = torch.tanh(0.5 * torch.exp(logvar))  # <origin:penalty_exp>
    return F.mse_loss(mu, y) + 0.1 * penalty.mean()


def _loss_tanh_chain() -> Program:
    """In the loss code: a variance penalty bounded by tanh of a scaled exp. An unscaled row at step 2 makes
    logvar > 88: exp = inf, 0.5 * inf = inf, tanh(inf) = 1, a finite loss; the exp's derivative is 0 x inf."""
    torch.manual_seed(0)
    model = VarianceHead()
    g = _gen(881)
    probe = torch.zeros(1, 5)
    with torch.no_grad():
        for _ in range(200):  # an input direction that raises logvar at init
            d = torch.randn(5, generator=g)
            if float(model(d[None])[1] - model(probe)[1]) > 0.05:
                break

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 5, generator=g)
        if step == FAIL:
            x[2] = d * 1e5
        return x, torch.randn(8, generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), [batch(s) for s in range(STEPS)],
                   bounded_variance_penalty)


class GatedLogFeature(nn.Module):
    """Log-compressed sensor counts with a learned per-channel gain, kept only where positive:
    ``where(h > 0, 2 * log(h), 0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(6))

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        h = counts * self.gain
        return torch.where(h > 0, 2.0 * torch.log(h), torch.zeros_like(h))  # <origin:gated_log>


class LogFeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = GatedLogFeature()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.feat(x)).squeeze(-1)


def _where_through_chain() -> Program:
    """The control: a sensor drops out at step 2 (counts 0): log(0) = -inf, doubled (still -inf), then dropped
    by a where. A selection on the chain is the where trap."""
    torch.manual_seed(0)
    model = LogFeatureNet()
    g = _gen(882)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.rand(8, 6, generator=g) * 50 + 1
        if step == FAIL:
            counts[3, 2] = 0.0
        return counts, torch.randn(8, generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=1e-3), [batch(s) for s in range(STEPS)],
                   lambda m, b: F.mse_loss(m(b[0]), b[1]))


ABSORPTION = {
    "gru_hand_written_sigmoid_reciprocal_absorbs_exp_through_add": (
        _gru_sigmoid, Want("nonfinite_grad", "forward", "aten.exp.default", "cell", "gru_exp", "exp_overflow")),
    "loss_code_tanh_absorbs_exp_through_mul": (
        _loss_tanh_chain, Want("nonfinite_grad", "forward", "aten.exp.default", None, "penalty_exp", "exp_overflow")),
    "where_drops_log_zero_through_mul_is_still_the_trap": (
        _where_through_chain, Want("nonfinite_grad", "forward", "aten.log.default", "feat", "gated_log",
                                   "where_gradient_trap")),
}


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_intrusive", "replayable"])
@pytest.mark.parametrize("name", list(ABSORPTION))
def test_absorption_is_judged_by_what_took_the_value_in(name: str, replayable: bool) -> None:
    build, want = ABSORPTION[name]
    check(train(build(), replayable=replayable), want)


# ============================================ 2. a replayable re-run that meets state written or made before it
class MemoryBankLoss:
    """Instance discrimination against a memory bank of normalised features; after use, the bank is replaced by
    one holding the batch's features (rebound, not written in place)."""

    def __init__(self, size: int = 32, dim: int = 6, temperature: float = 0.1) -> None:
        self.bank = F.normalize(torch.randn(size, dim, generator=_gen(883)), dim=1)
        self.temperature = temperature

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seqs, index = batch
        f = model(seqs)
        z = f / f.norm(dim=1, keepdim=True)  # <origin:bank_norm>
        logits = z @ self.bank.t() / self.temperature
        loss = F.cross_entropy(logits, index)
        self.bank = self.bank.index_copy(0, index, z.detach())
        return loss


class SequenceEncoder(nn.Module):
    """A bias-free GRU and projection: an all-zero sequence encodes to exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 8, batch_first=True, bias=False)
        self.proj = nn.Linear(8, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.rnn(x)
        return self.proj(h[-1])


def _memory_bank() -> Program:
    """At step 2 one sequence is all padding: its feature is 0, 0 / ||0|| = NaN, and the NaN row goes into the
    bank after use (a re-run of the call reads it there)."""
    torch.manual_seed(0)
    model = SequenceEncoder()
    g = _gen(884)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(5, 7, 3, generator=g)
        if step == FAIL:
            x[1] = 0.0
        return x, torch.randperm(32, generator=g)[:5]

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), [batch(s) for s in range(STEPS)],
                   MemoryBankLoss())


class EpochMarginLoss:
    """Per-class margins from the previous epoch's mean confidence (accumulated in place after use, divided at
    the epoch boundary, between two steps), subtracted from the true class's logit."""

    def __init__(self, n_classes: int) -> None:
        self.n_classes = n_classes
        self.margins = torch.zeros(n_classes)
        self.sums = torch.zeros(n_classes)
        self.counts = torch.zeros(n_classes)

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        logits = logits - self.margins[y][:, None] * F.one_hot(y, self.n_classes)
        loss = F.cross_entropy(logits, y)
        with torch.no_grad():
            conf = logits.softmax(-1).gather(1, y[:, None]).squeeze(1)
            self.sums.index_add_(0, y, conf)
            self.counts.index_add_(0, y, torch.ones_like(conf))
        return loss

    def next_epoch(self) -> None:
        self.margins = 0.5 * self.sums / self.counts  # <origin:margin_div>
        self.sums.zero_()
        self.counts.zero_()


def _epoch_margins() -> Program:
    """A 1-D conv classifier; class 3 never occurs in the first 2-step epoch: its margin is 0 / 0 at the boundary
    before step 2, where a class-3 sample arrives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    margins = EpochMarginLoss(4)
    g = _gen(885)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 3, (8,), generator=g)
        if step == FAIL:
            y[5] = 3
        return torch.randn(8, 2, 10, generator=g), y

    def before(step: int) -> None:
        if step == FAIL:
            margins.next_epoch()

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), [batch(s) for s in range(STEPS)], margins,
                   before_step=before)


STALE_STATE = {
    "gru_memory_bank_written_after_use_padding_sequence": (
        _memory_bank, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "bank_norm", "zero_variance_norm")),
    "conv_epoch_margins_rebound_between_steps_absent_class": (
        _epoch_margins, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "margin_div", "div_by_zero")),
}


@pytest.mark.parametrize("replayable", [True, False], ids=["replayable", "zero_intrusive"])
@pytest.mark.parametrize("name", list(STALE_STATE))
def test_a_rerun_that_meets_state_from_before_it_falls_back_to_the_tape(name: str, replayable: bool) -> None:
    build, want = STALE_STATE[name]
    run = train(build(), replayable=replayable)
    check(run, want)
    if replayable:
        assert "replayable_call_read_later_state" in run.incidents[0].details


# ============================================ 3. parameters written by the step's own forward
class DataInitStandardize(nn.Module):
    """Per-feature standardisation whose scale and shift are initialised from the first batch, in the forward,
    through ``.data``, guarded by a bool buffer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.shift = nn.Parameter(torch.zeros(d))
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.ready):
            with torch.no_grad():
                self.scale.data.copy_(torch.rsqrt(x.var(0)))  # <origin:init_rsqrt>
                self.shift.data.copy_(-x.mean(0))
                self.ready.fill_(True)
        return (x + self.shift) * self.scale


class TabularRegressor(nn.Module):
    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.norm = DataInitStandardize(d)
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x)).squeeze(-1)


def _standardize_init() -> Program:
    """The first batch's 'is_holiday' column is all 0: var = 0, rsqrt = inf, (0 + 0) * inf = NaN at step 0."""
    torch.manual_seed(0)
    model = TabularRegressor()
    g = _gen(886)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 5, generator=g)
        x[:, 4] = (torch.rand(16, generator=g) < (0.0 if step == 0 else 0.4)).float()
        return x, torch.randn(16, generator=g)

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.01), [batch(s) for s in range(3)],
                   lambda m, b: F.mse_loss(m(b[0]), b[1]))


class ActNorm2d(nn.Module):
    """Glow's per-channel ActNorm, initialised from the first batch under ``torch.no_grad()`` (a marked write),
    guarded by an int64 buffer."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.scale = nn.Parameter(torch.ones(1, c, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int(self.initialized) == 0:
            with torch.no_grad():
                self.loc.copy_(-x.mean(dim=(0, 2, 3), keepdim=True))
                self.scale.copy_(1 / x.std(dim=(0, 2, 3), keepdim=True))  # <origin:actnorm2d_init>
                self.initialized.fill_(1)
        return self.scale * (x + self.loc)


class ImageFlowHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actnorm = ActNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.actnorm(x))


def _actnorm2d_init() -> Program:
    """RGBA images whose alpha channel is fully opaque (constant 1) in the first batch: std = 0, 1 / 0 = inf and
    inf * (1 - 1) = NaN at step 0."""
    torch.manual_seed(0)
    model = ImageFlowHead()
    g = _gen(887)

    def batch(step: int) -> torch.Tensor:
        x = torch.rand(4, 4, 6, 6, generator=g)
        if step == 0:
            x[:, 3] = 1.0
        return x

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.01), [batch(s) for s in range(3)],
                   lambda m, b: m(b).pow(2).mean())


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _tagger_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(888)
    return [(torch.randint(0, 20, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]


def _late_load() -> Program:
    """A checkpoint with a NaN in the head loaded after watch() and before the first step, with no integration
    to record the load: the parameters were non-finite before the step."""
    torch.manual_seed(0)
    model = Tagger()
    corrupt = {k: v.clone() for k, v in model.state_dict().items()}
    corrupt["head.weight"][1, 2] = float("nan")
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), _tagger_batches(),
                   lambda m, b: F.cross_entropy(m(b[0]), b[1]), after_watch=lambda m: m.load_state_dict(corrupt))


def _data_surgery() -> Program:
    """Vocabulary surgery through ``.data`` (no mark on the tensor) after watch(): the new rows are the mean of
    an empty selection, NaN; the first batch reads them."""
    torch.manual_seed(0)
    model = Tagger()

    def surgery(m: nn.Module) -> None:
        m.emb.weight.data[:] = m.emb.weight.data[torch.zeros(20, dtype=torch.bool)].mean(0)

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), _tagger_batches(),
                   lambda m, b: F.cross_entropy(m(b[0]), b[1]), after_watch=surgery)


FORWARD_WRITES = {
    "tabular_standardize_data_init_through_data_bool_flag": (
        _standardize_init, Want("nonfinite_loss", "forward", "aten.rsqrt.default", "norm", "init_rsqrt",
                                "zero_variance_norm", step=0)),
    "actnorm2d_data_init_under_no_grad_int64_flag": (
        _actnorm2d_init, Want("nonfinite_loss", "forward", "aten.reciprocal.default", "actnorm", "actnorm2d_init",
                              "zero_variance_norm", step=0)),
}
WRITTEN_BEFORE = {
    "checkpoint_loaded_after_watch_unrecorded": (
        _late_load, Want("nonfinite_param", None, None, "head", None, "nonfinite_param", step=0, action="raised")),
    "embedding_surgery_through_data_after_watch": (
        _data_surgery, Want("nonfinite_param", None, None, "emb", None, "nonfinite_param", step=0, action="raised")),
}


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_intrusive", "replayable"])
@pytest.mark.parametrize("name", list(FORWARD_WRITES))
def test_parameters_the_step_itself_wrote_are_its_failure_not_a_loaded_state(name: str, replayable: bool) -> None:
    """The step's own op is named, the step is skipped (not raised), and the run ends with the weights of a plain
    run that skipped the failing updates: the replays put back what the replayed forward wrote."""
    build, want = FORWARD_WRITES[name]
    program = build()
    run = train(program, replayable=replayable)
    check(run, want)
    assert run.incidents[0].details.get("params_nonfinite_without_update") is True
    reference = plain(build()).state_dict()
    got = program.model.state_dict()
    same = [torch.equal(torch.nan_to_num(reference[k].float(), 1.0, 2.0, 3.0), torch.nan_to_num(got[k].float(), 1.0, 2.0, 3.0))
            for k in reference]
    assert all(same), [k for k, s in zip(reference, same) if not s]


@pytest.mark.parametrize("name", list(WRITTEN_BEFORE))
def test_parameters_written_before_the_step_stay_nonfinite_param(name: str) -> None:
    """No update and no recorded load since watch(), but the replay reads the parameters non-finite before any
    op of the step made them so: the state the step started from, raised as the policy says for it."""
    build, want = WRITTEN_BEFORE[name]
    check(train(build(), replayable=False), want)
