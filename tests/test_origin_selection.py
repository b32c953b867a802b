"""Which replayed value is taken as the failure, and what a NaN with a zero divisor is called.

Three ways a diagnosis picked the wrong start or cause (found by held-out programs,
``tests/test_heldout_programs_r3b.py``):

- a model output that holds only finite and ``-inf`` values (a log-softmax of masked logits) is
  valid by the capture's own rule (``capture.extremes_ok``), so a replay must not take it for the
  failing output: the NaN output next to it is the failure (``rerun.output_ok``);
- a built-in derivative that computes a 0/0 and masks it to 0 itself (the norm's, under
  ``F.normalize``) returns a finite gradient: its NaN went nowhere and is no origin; the first
  non-finite gradient that reached the parameters is (``origin.backward_start``; checked against
  ``torch.autograd.detect_anomaly``);
- a fused op that divides by a norm that is 0 (``weight_norm`` of a pruned, all-zero row) is
  ``div_by_zero``, not ``domain_error`` (``classify._zero_divisor``).
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

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CONFIG = nantrace.Config(outputs={"print_incidents": False})
BAD_STEP = 2
STEPS = 4
MODES = [pytest.param(False, id="zero_code"), pytest.param(True, id="replayable")]


def _run(model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
         replayable: bool, before_step: Callable[[nn.Module, int], None] | None = None) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nantrace.watch(model, opt, config=CONFIG) as guard:
        step_loss = guard.replayable(loss_fn) if replayable else loss_fn
        for step, batch in enumerate(batches):
            if before_step is not None:
                with torch.no_grad():
                    before_step(model, step)
            opt.zero_grad()
            step_loss(model, batch).backward()
            opt.step()
        return [i for i in guard.incidents if i.action != "logged"]


def _diagnosis(incidents: list[Any]) -> tuple[Any, ...]:
    assert len(incidents) == 1, [(i.kind, i.op, i.cause, i.summary) for i in incidents]
    i = incidents[0]
    return i.step, i.kind, i.phase, i.op, i.module, i.cause, i.action


# ----------------------------------------------------------------- 1. a -inf output is valid
class EntropyHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, h: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(h).masked_fill(~legal, float("-inf"))
        p = F.softmax(logits, dim=-1)
        entropy = -(p * torch.log(p)).sum(-1)  # <origin:entropy_log>
        return F.log_softmax(logits, dim=-1), entropy  # the first output holds -inf where masked: valid


class EntropyPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = EntropyHead()

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.body(obs), legal)


def _policy_batches(masked_from: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(STEPS):
        legal = torch.ones(6, 4, dtype=torch.bool)
        if step >= masked_from:
            legal[2, 3] = False  # an illegal action: p = 0 there
        out.append((torch.randn(6, 6, generator=g), legal, torch.randint(0, 3, (6,), generator=g),
                    torch.randn(6, generator=g)))
    return out


def _entropy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, legal, actions, adv = batch
    logp, ent = model(obs, legal)
    return -(logp.gather(1, actions[:, None]).squeeze(1) * adv).mean() - 0.01 * ent.mean()


@pytest.mark.parametrize("replayable", MODES)
def test_a_minus_inf_output_is_not_the_failing_output(one_thread, replayable):
    """The log-softmax output (finite and -inf) is valid; the NaN entropy is the failure: log(0)."""
    torch.manual_seed(0)
    incidents = _run(EntropyPolicy(), _policy_batches(BAD_STEP), _entropy_loss, replayable=replayable)
    assert _diagnosis(incidents) == (BAD_STEP, "nonfinite_loss", "forward", "aten.log.default", "head",
                                     "log_nonpositive", "skipped")
    assert points_at(incidents[0].source, __file__, "entropy_log")


class MaskedCritic(nn.Module):
    """Returns -inf logits on illegal actions (valid) and a value scaled by a feature norm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8, bias=False)
        self.pi = nn.Linear(8, 4)
        self.v = nn.Linear(8, 1)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        logits = self.pi(h).masked_fill(~legal, float("-inf"))
        radius = torch.sqrt((h * h).sum(-1))  # <origin:radius_sqrt>
        return logits, self.v(h).squeeze(-1) * radius


def _critic_batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(12)
    out = []
    for step in range(STEPS):
        obs = torch.randn(6, 6, generator=g)
        if step == BAD_STEP:
            obs[4] = 0.0  # an all-zero observation: h = 0, sqrt'(0) is infinite
        legal = torch.ones(6, 4, dtype=torch.bool)
        legal[:, 3] = False  # action 3 is never legal: -inf logits at every step
        out.append((obs, legal, torch.randint(0, 3, (6,), generator=g), torch.randn(6, generator=g)))
    return out


def _critic_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, legal, actions, returns = batch
    logits, value = model(obs, legal)
    return F.cross_entropy(logits, actions) + F.mse_loss(value, returns)


@pytest.mark.parametrize("replayable", MODES)
def test_a_minus_inf_output_does_not_hide_a_backward_failure(one_thread, replayable):
    """Outputs finite but for -inf masks replay as finite: the backward is replayed and the
    singular derivative found, instead of the -inf mask being taken for a forward failure."""
    torch.manual_seed(0)
    incidents = _run(MaskedCritic(), _critic_batches(), _critic_loss, replayable=replayable)
    assert _diagnosis(incidents) == (BAD_STEP, "nonfinite_grad", "backward", "aten.sqrt.default", "",
                                     "grad_singularity", "skipped")
    assert points_at(incidents[0].source, __file__, "radius_sqrt")


# --------------------------------------------- 2. a NaN masked inside a derivative is no origin
class SignedSqrtPool(nn.Module):
    def forward(self, f: torch.Tensor) -> torch.Tensor:
        phi = torch.sign(f) * torch.abs(f) ** 0.5  # <origin:signed_sqrt>
        return F.normalize(phi, dim=1)  # the norm's derivative makes 0/0 at a zero row and masks it to 0


class SignedSqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 8, bias=False)
        self.pool = SignedSqrtPool()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.proj(x)))


def _blank_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    out = []
    for step in range(STEPS):
        x = torch.randn(4, 5, generator=g)
        if step == BAD_STEP:
            x[1] = 0.0  # a blank sample: every feature 0
        out.append((x, torch.randint(0, 3, (4,), generator=g)))
    return out


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("replayable", MODES)
def test_a_nan_a_derivative_masks_itself_is_not_the_origin(one_thread, replayable):
    # the independent oracle: autograd's anomaly mode sees the norm's derivative return finite values
    # and PowBackward0 return the first non-finite gradient
    torch.manual_seed(0)
    oracle = SignedSqrtNet()
    with pytest.raises(RuntimeError, match="'PowBackward0' returned nan"), torch.autograd.detect_anomaly(True):
        _ce(oracle, _blank_batches()[BAD_STEP]).backward()

    torch.manual_seed(0)
    incidents = _run(SignedSqrtNet(), _blank_batches(), _ce, replayable=replayable)
    assert _diagnosis(incidents) == (BAD_STEP, "nonfinite_grad", "backward", "aten.pow.Tensor_Scalar", "pool",
                                     "grad_singularity", "skipped")
    assert points_at(incidents[0].source, __file__, "signed_sqrt")


# ------------------------------------------------ 3. a fused division by a zero norm
class WeightNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(5, 6))
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))  # <origin:wn_call>


def _prune(model: nn.Module, step: int) -> None:
    if step == BAD_STEP:  # structured pruning: the direction of one output unit set to 0
        model.fc.parametrizations.weight.original1[2] = 0.0


def _regression_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(14)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


@pytest.mark.parametrize("replayable", MODES)
def test_a_fused_division_by_a_zero_norm_is_div_by_zero(one_thread, replayable):
    """weight_norm: w = g * v / ||v|| = 0 * g / 0 on the pruned row, NaN even in float64; finite once
    the zeros of v move off 0, so a division by zero, not an argument outside a domain."""
    torch.manual_seed(0)
    incidents = _run(WeightNormMLP(), _regression_batches(), lambda m, b: F.mse_loss(m(b[0]), b[1]),
                     replayable=replayable, before_step=_prune)
    assert _diagnosis(incidents) == (BAD_STEP, "nonfinite_loss", "forward", "aten._weight_norm_interface.default",
                                     "fc.parametrizations.weight.0", "div_by_zero", "skipped")
    assert points_at(incidents[0].source, __file__, "wn_call")


def test_the_zero_divisor_check_needs_the_nan_to_go_when_the_zeros_move(one_thread):
    """The evidence behind it: a NaN that disappears once the zeros at the bad elements are moved off 0
    is a division by zero; a NaN that stays (a square root of a negative number next to a zero
    operand) is not, and keeps its domain error."""
    from types import SimpleNamespace

    from nantrace.diagnosis import classify as C
    from nantrace.diagnosis import evidence as ev

    v = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    normalised = SimpleNamespace(func=lambda t: t / t.norm(dim=1, keepdim=True))
    out = normalised.func(v)
    assert C._zero_divisor(normalised, (v,), {}, out.shape, ev.bad_mask(out)) == ("arg0", 2)  # type: ignore[arg-type]

    x, y = torch.tensor([4.0, -3.0]), torch.tensor([1.0, 0.0])
    root = SimpleNamespace(func=lambda a, b: torch.sqrt(a) * (b + 1))
    out = root.func(x, y)
    assert C._zero_divisor(root, (x, y), {}, out.shape, ev.bad_mask(out)) is None  # type: ignore[arg-type]


class _Gate(nn.Module):
    """Scores divided by a per-row scale that can be 0, then taken in by a saturating tanh or a where."""

    def __init__(self, absorb: str) -> None:
        super().__init__()
        self.absorb = absorb
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) / scale  # <origin:gate_div>
        if self.absorb == "tanh":
            return torch.tanh(h)  # inf -> 1: derivative 0, then 0 x inf in the division's backward
        return torch.where(scale > 0, h, torch.zeros_like(h))  # the unselected branch holds the inf


@pytest.mark.parametrize("absorb, cause", [("tanh", "div_by_zero"), ("where", "where_gradient_trap")])
def test_a_forward_value_absorbed_by_a_saturating_op_keeps_its_own_cause(absorb: str, cause: str, one_thread: None) -> None:
    """An infinity a forward op made that never reached the loss, whose derivative (0 x inf) leaks NaN into the
    gradients: a where or mask that dropped it is the where trap; a tanh that saturated it is not, and the op's
    own cause stands (OpRecord.absorbed_by)."""
    torch.manual_seed(0)
    model = _Gate(absorb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(3):
            scale = torch.ones(6, 1)
            if step == 1:
                scale[2] = 0.0
            opt.zero_grad()
            model(torch.randn(6, 4), scale).sum().backward()
            opt.step()
    inc = guard.incidents[0]
    assert (inc.step, inc.kind, inc.phase, inc.op, inc.module, inc.cause) == (
        1, "nonfinite_grad", "forward", "aten.div.Tensor", "", cause), inc.summary
    assert points_at(inc.source, __file__, "gate_div")
