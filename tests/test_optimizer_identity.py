"""The update replay sees the parameters the real step saw (``diagnosis/update_replay.py``).

A hand-written optimizer often knows a parameter by its identity: a dict keyed by the parameter (``{emb.weight:
counts}``), a dict keyed by ``id(p)`` (parameter names for a "no trust ratio on biases" rule), ``p is
self.row_param``. The replay of a failed update steps the optimizer's own parameter objects (their values and
gradients kept and put back bit for bit), so it takes the branch the real step took and names its op. When a
replay does not reproduce the failure at all (a fault that does not happen twice), the incident claims no
cause: ``unknown``, with what was missing in its details.

Every construction is checked with plain torch first (``_plain_first_nonfinite``): the step whose update first
made a parameter non-finite, and the first op of that update that made a non-finite value from finite inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from nantrace.diagnosis.update_replay import replay_update

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

FAIL_STEP, STEPS = 2, 4
CONFIG = dict(outputs={"print_incidents": False}, dynamics={"early_warnings": False})


# ----------------------------------------------------------------------------- programs
class TokenModel(nn.Module):
    """Token embeddings and a head; counts the tokens of the epoch it trains on."""

    def __init__(self, vocab: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 6)
        self.head = nn.Linear(6, 1)
        self.register_buffer("token_counts", torch.ones(vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.token_counts.index_add_(0, tokens, torch.ones(len(tokens)))
        return self.head(self.emb(tokens)).squeeze(-1)


class RowCountSGD(torch.optim.Optimizer):
    """SGD whose embedding rows step by ``lr / count`` of their token; the counts are found through a dict
    keyed by the parameter itself (a tensor hashes by identity)."""

    def __init__(self, params: Any, row_counts: dict[torch.Tensor, torch.Tensor], lr: float = 0.1,
                 floor: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr))
        self.row_counts, self.floor = row_counts, floor

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                counts = self.row_counts.get(p)
                if counts is not None:
                    p.add_(p.grad / counts.clamp_min(self.floor)[:, None], alpha=-group["lr"])  # <origin:row_count>
                else:
                    p.add_(p.grad, alpha=-group["lr"])


class NamedTrustSGD(torch.optim.Optimizer):
    """LARS-like SGD: weights (not biases, found by name through ``id(p)``) step by the trust ratio
    ``||w|| / ||g||``, with no guard for a zero gradient."""

    def __init__(self, model: nn.Module, lr: float = 0.05) -> None:
        super().__init__(model.parameters(), dict(lr=lr))
        self.names = {id(p): n for n, p in model.named_parameters()}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.names[id(p)].endswith("weight"):
                    ratio = p.norm() / p.grad.norm()  # <origin:trust_ratio>
                    p.add_(p.grad * ratio, alpha=-group["lr"])
                else:
                    p.add_(p.grad, alpha=-group["lr"])


_FAULTS: list[float] = []
"""Fault injection for resilience tests: a fault is consumed by the one update it corrupts."""


class FaultInjectedSGD(torch.optim.Optimizer):
    """SGD whose update a fault-injection harness corrupts once (a flaky device): not reproducible."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        scale = 1.0 + (_FAULTS.pop() if _FAULTS else 0.0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * scale, alpha=-group["lr"])


@dataclass
class Program:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    before_step: Callable[[int], None] = lambda step: None


def _token_program(floor: float) -> Program:
    torch.manual_seed(0)
    model = TokenModel()
    opt = RowCountSGD(model.parameters(), {model.emb.weight: model.token_counts}, floor=floor)
    g = torch.Generator().manual_seed(5)

    def before(step: int) -> None:
        if step == FAIL_STEP:  # a new epoch: the counts are per epoch
            model.token_counts.zero_()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 24, (8,), generator=g), torch.randint(0, 2, (8,), generator=g).float()

    return Program(model, opt, batch, lambda m, b: F.binary_cross_entropy_with_logits(m(b[0]), b[1]), before)


def row_counts_reset() -> Program:
    return _token_program(floor=0.0)


def row_counts_floored() -> Program:
    return _token_program(floor=1.0)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def trust_ratio_padding_batch() -> Program:
    model = _mlp()
    g = torch.Generator().manual_seed(7)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 4, generator=g)
        if step == FAIL_STEP:  # a batch of padding rows only: the first layer's weight gets no gradient
            x = torch.zeros(6, 4)
        return x, torch.randn(6, 1, generator=g)

    return Program(model, NamedTrustSGD(model), batch, lambda m, b: F.mse_loss(m(b[0]), b[1]))


def injected_fault() -> Program:
    model = _mlp()
    g = torch.Generator().manual_seed(9)

    def before(step: int) -> None:
        _FAULTS.clear()
        if step == FAIL_STEP:
            _FAULTS.append(float("inf"))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)

    return Program(model, FaultInjectedSGD(model.parameters(), lr=0.05), batch, lambda m, b: F.mse_loss(m(b[0]), b[1]),
                   before)


# ----------------------------------------------------------------------------- plain torch
def _nonfinite(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())


class _FirstMade(TorchDispatchMode):
    """The first op whose tensor inputs were finite and whose output (or in-place target) was not."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        finite_in = not any(_nonfinite(t) for t in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if self.op is None and finite_in and any(_nonfinite(t) for t in tree_leaves((out, args))):
            self.op = str(func)
        return out


def _plain_first_nonfinite(make: Callable[[], Program]) -> tuple[int, str | None] | None:
    """Without nantrace: the step whose update first made a parameter non-finite and the op that did."""
    prog = make()
    for step in range(STEPS):
        prog.before_step(step)
        prog.optimizer.zero_grad()
        loss = prog.loss(prog.model, prog.batch(step))
        assert torch.isfinite(loss), "the loss must stay finite: the update is what fails"
        loss.backward()
        assert all(not _nonfinite(p.grad) for p in prog.model.parameters() if p.grad is not None)
        watch = _FirstMade()
        with watch:
            prog.optimizer.step()
        if any(_nonfinite(p) for p in prog.model.parameters()):
            return step, watch.op
    return None


def _train(make: Callable[[], Program]) -> nantrace.Guard:
    prog = make()
    guard = nantrace.watch(prog.model, prog.optimizer, config=nantrace.Config(**CONFIG))
    try:
        for step in range(STEPS):
            prog.before_step(step)
            prog.optimizer.zero_grad()
            prog.loss(prog.model, prog.batch(step)).backward()
            prog.optimizer.step()
    finally:
        guard.close()
    assert all(not _nonfinite(p) for p in prog.model.parameters()), "the bad update must have been undone"
    return guard


# ----------------------------------------------------------------------------- the diagnosis
CASES = {
    # program, plain-torch (step, first op), expected (step, kind, phase, op, module, cause, transient)
    "param_keyed_dict_row_counts_reset": (
        row_counts_reset, (FAIL_STEP, "aten.div.Tensor"),
        (FAIL_STEP, "nonfinite_param", "optimizer", "aten.div.Tensor", "emb", "div_by_zero", False)),
    "id_keyed_names_trust_ratio_zero_gradient": (
        trust_ratio_padding_batch, (FAIL_STEP, "aten.div.Tensor"),
        (FAIL_STEP, "nonfinite_param", "optimizer", "aten.div.Tensor", "0", "div_by_zero", False)),
    "fault_not_reproduced_claims_no_cause": (
        injected_fault, (FAIL_STEP, "aten.mul.Tensor"),
        (FAIL_STEP, "nonfinite_param", "optimizer", None, "0", "unknown", True)),
    "param_keyed_dict_counts_floored_quiet": (row_counts_floored, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_construction_without_nantrace(name: str) -> None:
    make, plain, _ = CASES[name]
    assert _plain_first_nonfinite(make) == plain


@pytest.mark.parametrize("name", list(CASES))
def test_diagnosis(name: str) -> None:
    make, _, want = CASES[name]
    guard = _train(make)
    got = [(i.step, i.kind, i.phase, i.op, i.module, i.cause, i.transient) for i in guard.incidents]
    assert got == ([want] if want is not None else [])
    if want is None:
        return
    inc = guard.incidents[0]
    assert inc.action == "skipped"
    if want[5] == "unknown":  # no positive cause without evidence; the details say what was missing
        assert "stayed finite" in inc.details["missing"] and "stayed finite" in inc.summary
    else:
        marker = {"aten.div.Tensor": "<origin:row_count>" if "row" in name else "<origin:trust_ratio>"}[want[3]]
        path, _, line = inc.source.rpartition(":")
        assert path.endswith("test_optimizer_identity.py")
        assert marker in open(__file__).read().splitlines()[int(line) - 1]


# ----------------------------------------------------------------------------- the replay leaves nothing behind
class ReplacingOptimizer(torch.optim.Optimizer):
    """Knows its special parameter by identity; gives it new data (``p.data = ...``), drops its gradient,
    keeps a nested list in its state and appends to a list kept in its group; divides by a zero buffer."""

    def __init__(self, params: Any, special: torch.Tensor, divisor: torch.Tensor) -> None:
        super().__init__(params, dict(lr=0.1, history=[]))
        self.special, self.divisor = special, divisor

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["history"].append(group["lr"])
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("trace", []).append(p.grad.clone())
                state["count"] = state.get("count", 0) + 1
                if p is self.special:
                    state["trace"][0].mul_(2)
                    p.grad.add_(1.0)
                    p.data = p.data - group["lr"] * p.grad / self.divisor
                    p.grad = None
                else:
                    p.add_(p.grad, alpha=-group["lr"])


def _snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[Any]:
    out: list[Any] = []
    for p in params:
        out.append((p.dtype, p.data_ptr(), p.detach().clone(), p.grad, None if p.grad is None else p.grad.clone()))
    out.append(copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]))
    out.append([[id(p) for p in g["params"]] for g in opt.param_groups])
    out.append(copy.deepcopy({id(p): s for p, s in opt.state.items()}))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                                                                         b.view(torch.uint8) if b.dtype != torch.bool else b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_replay_on_the_real_parameters_leaves_them_bit_identical(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    special, other = nn.Parameter(torch.randn(3, 4).to(dtype)), nn.Parameter(torch.randn(4).to(dtype))
    divisor = torch.tensor([1.0, 0.0, 2.0, 1.0]).to(dtype)
    opt = ReplacingOptimizer([special, other], special, divisor)
    for p in (special, other):
        p.grad = torch.randn_like(p)
    opt.step()  # state and group history exist; the special parameter is now non-finite: start over
    with torch.no_grad():
        special.copy_(torch.randn(3, 4).to(dtype))
    special.grad, other.grad = torch.randn_like(special), torch.randn_like(other)
    grad_objects = (special.grad, other.grad)
    before = _snapshot(opt, [special, other])
    divisor_before = divisor.clone()

    replay = replay_update(opt, special)

    assert replay.reproduced and replay.op == "aten.div.Tensor" and replay.cause == "div_by_zero"
    if dtype == torch.float16:
        assert replay.float32_finite is False  # a zero divisor stays one in float32
    assert (special.grad, other.grad) == grad_objects  # the same gradient objects, not equal copies
    assert _same(before, _snapshot(opt, [special, other])), "parameters, gradients, state and groups must be as before"
    assert _same(divisor, divisor_before)
