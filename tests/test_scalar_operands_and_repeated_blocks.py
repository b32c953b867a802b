"""Plain-number operands as evidence, and the first bad value among repeated blocks.

1. ``diagnosis/evidence.operands_at`` reads a Python-number operand (``aten.pow.Scalar``'s base in
   ``theta ** t``, ``torch.div(1.0, t)``'s numerator) as a value broadcast to the output, so the rules that
   read ``arg0``/``arg1`` see it: ``0.0 ** negative`` is a division by zero, not an exponent overflow; a
   non-zero base raised too far stays an exponent overflow (must not fire).
2. ``localisation/origin.backward_start``: backward runs the last block first. When two identical blocks each
   made a non-finite value in the forward and both reach the gradients, the origin is the one that ran first in
   the forward (block 0), not the one the backward met first; a singularity born in the backward of block 1
   alone stays block 1's.

Each construction is checked with plain torch first (what goes non-finite, where, and that the loss is finite
where it should be), then nantrace's diagnosis is compared field by field, in both modes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from heldout_harness import MODES, Judge, Program, assert_diagnosis, sgd, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL = 3
STEPS = 5
JUDGE = Judge(__file__)


def _batches(seed: int, n: int = 8, d: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, d, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(STEPS)]


def _ce(m: nn.Module, batch: tuple[torch.Tensor, ...], s: int) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return F.cross_entropy(m(x), y)


# ----------------------------------------------------------------- 1. a geometric decay whose base is the config's 0
# A retention-style decay per position, gamma ** (-k) (a growing weight for older positions), with gamma from the
# run config. gamma = 0 (a templated value left empty): 0 ** 0 = 1 and 0 ** negative = inf.
class Decay(nn.Module):
    def __init__(self, gamma: float, length: int) -> None:
        super().__init__()
        self.gamma, self.length = gamma, length

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        k = -torch.arange(self.length, dtype=torch.float32) / self.length
        weights = self.gamma ** k  # <origin:decay_pow>
        return h * weights


class DecayNet(nn.Module):
    def __init__(self, gamma: float, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.decay = Decay(gamma, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.decay(torch.tanh(self.inp(x))))


def _decay(gamma: float) -> Program:
    torch.manual_seed(0)
    model = DecayNet(gamma)
    return Program(model, sgd(model), _batches(1501), _ce)


def check_decay_zero_base() -> None:
    k = -torch.arange(8, dtype=torch.float32) / 8
    w = 0.0 ** k
    assert w[0] == 1 and bool(torch.isposinf(w[1:]).all())  # 0 ** negative = inf
    run_loss = _ce(_decay(0.0).model, _batches(1501)[0], 0)
    assert not torch.isfinite(run_loss)


def check_decay_huge_exponent() -> None:
    k = -torch.arange(8, dtype=torch.float32) / 8 * 4000.0
    w = 0.5 ** k
    assert bool(torch.isposinf(w[-1])) and bool(torch.isfinite(w[0]))  # 0.5 ** -3500 overflows float32 (and float64)
    assert not torch.isfinite(_ce(_decay_huge().model, _batches(1501)[0], 0))


class HugeDecay(Decay):
    """The exponent's scale set in its own unit (4000 positions per unit): 0.5 ** -3500 overflows."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        k = -torch.arange(self.length, dtype=torch.float32) / self.length * 4000.0
        weights = self.gamma ** k  # <origin:huge_pow>
        return h * weights


def _decay_huge() -> Program:
    torch.manual_seed(0)
    model = DecayNet(0.5)
    model.decay = HugeDecay(0.5, 8)
    return Program(model, sgd(model), _batches(1501), _ce)


# ----------------------------------------------------------------- 2. an inverse length with a plain-number numerator
# Masked mean pooling written torch.div(1.0, lengths): the batch of step 3 holds an empty sequence (all padding),
# its length is 0, 1 / 0 = inf and 0 * inf = NaN in the pooled row.
class Pool(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        inv = torch.div(1.0, mask.sum(1, keepdim=True))  # <origin:inv_len>
        return (h * mask[..., None]).sum(1) * inv


class PoolNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.pool = Pool()
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.pool(torch.tanh(self.emb(x)), mask))


def _pool_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1502)
    out = []
    for s in range(STEPS):
        x = torch.randn(4, 6, 8, generator=g)
        lengths = torch.randint(1, 7, (4,), generator=g)
        if s == FAIL:
            lengths[2] = 0
        mask = (torch.arange(6)[None] < lengths[:, None]).float()
        out.append((x, torch.randint(0, 4, (4,), generator=g), mask))
    return out


def _pool_loss(m: nn.Module, batch: tuple[torch.Tensor, ...], s: int) -> torch.Tensor:
    x, y, mask = batch
    return F.cross_entropy(m(x, mask), y)


def _pool() -> Program:
    torch.manual_seed(0)
    model = PoolNet()
    return Program(model, sgd(model), _pool_batches(), _pool_loss)


def check_pool() -> None:
    batches = _pool_batches()
    model = _pool().model
    for s, (x, y, mask) in enumerate(batches):
        lengths = mask.sum(1)
        assert bool((lengths == 0).any()) == (s == FAIL)
        assert bool(torch.isfinite(_pool_loss(model, (x, y, mask), s))) == (s != FAIL)
    assert bool(torch.isposinf(torch.div(1.0, torch.zeros(1))).all())


# ----------------------------------------------------------------- 3. two identical blocks, each with a where trap
# Signed square-root ("power") normalisation in every block, written torch.where(h >= 0, h.sqrt(), -(-h).sqrt()):
# each branch is NaN on the other half of the values. The forward and the loss are finite; the derivative of the
# unselected branch is 0 * NaN, so the gradients are NaN. Block 0's NaN was made first (in the forward); the
# backward meets block 1's first.
class SignedSqrt(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(h >= 0, h.sqrt(), -(-h).sqrt())  # <origin:signed_sqrt>


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.power = SignedSqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * self.power(self.lin(x))


class Stack(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


def _stack() -> Program:
    torch.manual_seed(0)
    model = Stack()
    return Program(model, sgd(model), _batches(1503), _ce)


def check_stack() -> None:
    model = _stack().model
    made: list[tuple[str, bool]] = []
    hooks = [m.lin.register_forward_hook(lambda mod, a, out, name=n: made.append((name, bool(torch.isnan(out.sqrt()).any()))))
             for n, m in model.blocks.named_children()]
    loss = _ce(model, _batches(1503)[0], 0)
    for h in hooks:
        h.remove()
    assert made == [("0", True), ("1", True)]  # each block makes its own NaN, block 0 first
    assert bool(torch.isfinite(loss))
    loss.backward()
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.blocks[0].parameters())
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.blocks[1].parameters())


# ----------------------------------------------------------------- 4. a singularity born in block 1's backward only
# An RMS normaliser per block, h / (sqrt(mean(h^2)) + eps), on the block's projection. The model was grown by one
# block, zero-initialised so that its function is unchanged (progressive stacking): block 1's h = 0, the forward is
# finite (0 / eps), and sqrt's derivative at 0 is infinite: 0 / 0 in the backward of block 1 only.
class RMS(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()  # <origin:rms_sqrt>
        return h / (rms + 1e-6)


class RMSBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = RMS()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.lin(x))


class RMSStack(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RMSBlock(d) for _ in range(2))
        self.out = nn.Linear(d, 4)
        with torch.no_grad():
            self.blocks[1].lin.weight.zero_()  # the grown block
            self.blocks[1].lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


def _rms() -> Program:
    torch.manual_seed(0)
    model = RMSStack()
    return Program(model, sgd(model), _batches(1504), _ce)


def check_rms() -> None:
    model = _rms().model
    dead: list[bool] = []
    hooks = [m.lin.register_forward_hook(lambda mod, a, out: dead.append(bool((out == 0).all(-1).any())))
             for m in model.blocks]
    loss = _ce(model, _batches(1504)[0], 0)
    for h in hooks:
        h.remove()
    assert dead == [False, True]  # block 1 only has all-zero rows
    assert bool(torch.isfinite(loss))
    loss.backward()
    assert not bool(torch.isfinite(model.blocks[1].lin.weight.grad).all())


CASES: dict[str, tuple[Callable[[], Program], Callable[[], None], Want]] = {
    "pow_scalar_zero_base_negative_exponent": (
        lambda: _decay(0.0), check_decay_zero_base,
        Want("nonfinite_loss", "forward", "aten.pow.Scalar", "decay", "decay_pow", "div_by_zero", step=0)),
    "pow_scalar_nonzero_base_overflow_stays_exp_overflow": (
        _decay_huge, check_decay_huge_exponent,
        Want("nonfinite_loss", "forward", "aten.pow.Scalar", "decay", "huge_pow", "exp_overflow", step=0)),
    "scalar_numerator_divided_by_zero_length": (
        _pool, check_pool,
        Want("nonfinite_loss", "forward", "aten.div.Tensor", "pool", "inv_len", "div_by_zero", step=FAIL)),
    "two_blocks_where_trap_first_block_named": (
        _stack, check_stack,
        Want("nonfinite_grad", "forward", "aten.sqrt.default", "blocks.0.power", "signed_sqrt", "where_gradient_trap",
             step=0)),
    "backward_singularity_in_block_one_only": (
        _rms, check_rms,
        Want("nonfinite_grad", "backward", "aten.sqrt.default", "blocks.1.norm", "rms_sqrt", "grad_singularity",
             step=0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    """The program does what its comment says, checked with plain torch (no nantrace)."""
    CASES[name][1]()


@pytest.mark.parametrize("name,mode", [(n, m) for n in CASES for m in MODES])
def test_diagnosis(name: str, mode: str) -> None:
    build, _, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, JUDGE)
