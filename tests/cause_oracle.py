"""An independent cause oracle: a slow, obviously correct reference for nantrace's diagnosis.

It shares no code with nantrace (nothing is imported from it). Given a training program (an
object with ``model``, ``optimizer``, ``batches``, ``loss_fn(model, batch)`` and optionally
``autocast`` and ``scaler``, e.g. ``scenarios.Setup``), it trains it step by step without
nantrace and, at the first failing step:

1. records every forward ATen op in execution order with its own ``TorchDispatchMode``: the
   op, the innermost running module (its own forward pre/post hooks), the user's source line,
   a full copy of every input and output, and for every tensor input the record that produced
   it (dataflow);
2. records every autograd node that ``backward()`` runs (``Node.register_hook``), with the
   gradients it received and produced, attributed to the forward record whose output carries
   that node as ``grad_fn``;
3. finds the origin by the origin rule of PRODUCT.md: follow the failing value back through
   the records that produced it; the earliest record on that chain that *created* a NaN (no
   NaN among its inputs) is the candidate; if its inputs carried an infinity, follow that
   infinity back: the earliest record that created it from finite inputs by computation is the
   origin; an infinity from an explicit constant (a non-finite Python scalar argument, a
   ``-inf`` buffer or literal) is intentional and the candidate stays the origin. In backward:
   the first node whose received gradients were finite and whose produced gradients were not,
   named by its forward record;
4. decides the cause with the claims of :data:`FORWARD_RULES` / :data:`BACKWARD_RULES`,
   each checked on exactly the elements that went bad, recomputed in float64 (float32 for the
   precision claim).

Usage::

    from cause_oracle import decide
    verdict = decide(setup)          # Verdict(step=3, phase='forward', op='aten.log.default',
                                     #         module='frontend', source='.../x.py:41',
                                     #         cause='log_nonpositive', evidence='...')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Verdict", "decide", "FORWARD_RULES", "BACKWARD_RULES"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)
F64 = torch.float64
LOW_PRECISION = (torch.float16, torch.bfloat16)
F32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class Verdict:
    step: int
    phase: str | None
    op: str | None
    module: str | None
    source: str | None
    """``"/abs/path.py:LINE"`` of the user's code that issued the origin op."""
    cause: str
    evidence: str = ""
    chain: tuple[str, ...] = ()


# ================================================================ recording the forward
@dataclasses.dataclass(eq=False)
class Input:
    snap: torch.Tensor
    """A copy of the tensor as the op received it."""
    producer: "Rec | None"
    """The record that produced this tensor object, ``None`` for a leaf (batch, parameter, buffer, literal)."""


@dataclasses.dataclass(eq=False)
class Rec:
    index: int
    func: Any
    op: str
    module: str | None
    source: str | None
    args: Any
    """Positional arguments, tensors replaced by their copies."""
    kwargs: Any
    inputs: list[Input]
    outs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Copies of the tensor outputs, in order."""
    error: BaseException | None = None

    @property
    def out(self) -> torch.Tensor:
        return self.outs[0]

    def scalars(self) -> list[float]:
        return [a for a in tree_leaves((self.args, self.kwargs))
                if isinstance(a, (int, float)) and not isinstance(a, bool)]


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _has_nan(t: torch.Tensor) -> bool:
    return _is_float(t) and t.numel() > 0 and bool(torch.isnan(t).any())


def _has_inf(t: torch.Tensor) -> bool:
    return _is_float(t) and t.numel() > 0 and bool(torch.isinf(t).any())


def _finite(t: torch.Tensor) -> bool:
    return not _is_float(t) or t.numel() == 0 or bool(torch.isfinite(t).all())


def _op_name(func: Any) -> str:
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def _user_line() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        parts = name.split(os.sep)
        if (not name.startswith(_TORCH_DIR) and name != _THIS and "nantrace" not in parts
                and not frame.f_code.co_filename.startswith("<") and "contextlib.py" != parts[-1]):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class ModuleTracker:
    """The innermost running module of ``root``, by forward pre/post hooks on every submodule."""

    def __init__(self, root: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles: list[Any] = []
        for name, m in root.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(name)))
            self.handles.append(m.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()

    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Recorder(TorchDispatchMode):
    """Every ATen op, its full inputs and outputs, and which record produced each input."""

    def __init__(self, modules: ModuleTracker) -> None:
        super().__init__()
        self.modules = modules
        self.recs: list[Rec] = []
        self.producer: dict[int, Rec] = {}
        self.node_rec: dict[Any, Rec] = {}
        self._keep: list[torch.Tensor] = []   # live outputs: their ids stay unique for the step
        self._pending: list[tuple[torch.Tensor, Rec]] = []

    def resolve(self) -> None:
        # autograd attaches grad_fn after the kernel returns: link outputs to nodes at the next op.
        for t, rec in self._pending:
            if t.grad_fn is not None and t.grad_fn not in self.node_rec:
                self.node_rec[t.grad_fn] = rec
        self._pending = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.resolve()
        live = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        copy = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
        rec = Rec(len(self.recs), func, _op_name(func), self.modules.current(), _user_line(),
                  tree_map(copy, args), tree_map(copy, kwargs),
                  [Input(t.detach().clone(), self.producer.get(id(t))) for t in live])
        self.recs.append(rec)
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            rec.error = exc
            raise
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                rec.outs.append(t.detach().clone())
                self.producer[id(t)] = rec
                self._keep.append(t)
                self._pending.append((t, rec))
        return out


# ============================================================ the origin rule (dataflow)
def _constant_inf(rec: Rec) -> bool:
    """An infinity made on purpose: a non-finite Python scalar argument (``masked_fill(m, -inf)``,
    ``full(.., -inf)``, ``x * float('-inf')``) or a leaf tensor holding one (a ``-inf`` buffer)."""
    if any(not math.isfinite(s) for s in rec.scalars()):
        return True
    return any(_has_inf(i.snap) and i.producer is None for i in rec.inputs)


def _walk(starts: list[Input], has: Callable[[torch.Tensor], bool]) -> list[Rec]:
    """Records on the dataflow chain of ``has``-values reaching ``starts`` that created them
    (none of their tensor inputs had one)."""
    seen: set[int] = set()
    creators: list[Rec] = []
    todo = [i.producer for i in starts if i.producer is not None and has(i.snap)]
    while todo:
        rec = todo.pop()
        if rec.index in seen:
            continue
        seen.add(rec.index)
        feeding = [i for i in rec.inputs if has(i.snap)]
        if not feeding or all(i.producer is None for i in feeding):
            creators.append(rec)
        todo.extend(i.producer for i in feeding if i.producer is not None)
    return sorted(creators, key=lambda r: r.index)


def forward_origin(starts: list[Input]) -> tuple[Rec | None, torch.Tensor | None, list[Rec]]:
    """The origin record of the non-finite values in ``starts``, its bad output mask, and the
    NaN-creating candidate (for the chain)."""
    if any(_has_nan(i.snap) for i in starts):
        candidates = _walk(starts, _has_nan)
        if not candidates:
            return None, None, []
        cand = candidates[0]
        carried = [i for i in cand.inputs if _has_inf(i.snap)]
        if carried or any(not math.isfinite(s) for s in cand.scalars()):
            computed = [r for r in _walk(carried, _has_inf) if not _constant_inf(r)]
            if computed:
                origin = computed[0]
                return origin, ~torch.isfinite(origin.out), [origin, cand]
        return cand, torch.isnan(cand.out), [cand]
    infs = _walk(starts, _has_inf)
    computed = [r for r in infs if not _constant_inf(r)]
    origin = (computed or infs or [None])[0]
    if origin is None:
        return None, None, []
    return origin, ~torch.isfinite(origin.out), [origin]


# ===================================================================== element helpers
def _tensor_arg(rec: Rec, pos: int) -> torch.Tensor | None:
    a = rec.args[pos] if pos < len(rec.args) else None
    return a if isinstance(a, torch.Tensor) else None


def _at(rec: Rec, pos: int, bad: torch.Tensor) -> torch.Tensor:
    """Argument ``pos`` (tensor or scalar) broadcast to the output, at the bad elements, float64."""
    a = rec.args[pos]
    if not isinstance(a, torch.Tensor):
        return torch.full((int(bad.sum()),), float(a), dtype=F64)
    return torch.broadcast_to(a.to(F64), bad.shape)[bad]


def _to(dtype: torch.dtype) -> Callable[[Any], Any]:
    return lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _recompute(rec: Rec, dtype: torch.dtype) -> torch.Tensor | None:
    """The op again on the same (recorded) inputs, in ``dtype``; its first output."""
    kwargs = {k: v for k, v in rec.kwargs.items() if k != "dtype"}
    try:
        with torch.no_grad():
            out = rec.func(*tree_map(_to(dtype), rec.args), **tree_map(_to(dtype), kwargs))
    except Exception:
        return None
    first = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return first[0] if first and first[0].shape == rec.out.shape else None


def _dtype(rec: Rec) -> torch.dtype:
    return rec.out.dtype


def _exceeds(values: torch.Tensor, dtype: torch.dtype) -> bool:
    return values.numel() > 0 and bool(torch.isfinite(values).all()) and bool((values.abs() > torch.finfo(dtype).max).any())


def _precision(rec: Rec, bad: torch.Tensor) -> bool:
    """precision_overflow: the op ran in float16/bfloat16 and its float32 replay is finite there."""
    if _dtype(rec) not in LOW_PRECISION:
        return False
    again = _recompute(rec, torch.float32)
    return again is not None and bool(torch.isfinite(again[bad]).all())


def _overflows(rec: Rec, bad: torch.Tensor) -> bool:
    """The float64 recomputation is finite at the bad elements and beyond the dtype's range."""
    again = _recompute(rec, F64)
    return again is not None and _exceeds(again[bad], _dtype(rec))


def _inf_operands(rec: Rec) -> bool:
    return any(_has_inf(i.snap) for i in rec.inputs) or any(not math.isfinite(s) for s in rec.scalars())


def _is_integer(x: torch.Tensor) -> torch.Tensor:
    return x == torch.floor(x)


# ------------------------------------------------------------ provenance helpers
_TRANSPARENT = {"aten.view.default", "aten.unsqueeze.default", "aten.expand.default", "aten._to_copy.default",
                "aten.clone.default", "aten.detach.default", "aten.squeeze.dim", "aten.reshape.default",
                "aten._unsafe_view.default", "aten.sqrt.default", "aten.pow.Tensor_Scalar", "aten.alias.default",
                "aten.clamp.default", "aten.add.Tensor", "aten.add.Scalar", "aten.add_.Scalar", "aten.mul.Tensor",
                "aten.mul.Scalar", "aten.lift_fresh.default"}
_STATISTICS = {"aten.std.correction", "aten.var.correction", "aten.std_mean.correction", "aten.var_mean.correction",
               "aten.std.dim", "aten.var.dim", "aten.std.default", "aten.var.default"}


def _ancestors(rec: Rec | None, depth: int = 6) -> list[Rec]:
    out: list[Rec] = []
    todo = [(rec, 0)]
    while todo:
        r, d = todo.pop()
        if r is None or r in out or d > depth:
            continue
        out.append(r)
        todo.extend((i.producer, d + 1) for i in r.inputs)
    return out


_MEANS = {"aten.mean.dim", "aten.mean.default", "aten.sum.dim_IntList", "aten.sum.default"}


def _is_square_of(rec: Rec | None) -> bool:
    """``x ** 2`` or ``x * x``: the square inside a root mean square."""
    if rec is None:
        return False
    if rec.op == "aten.pow.Tensor_Scalar" and len(rec.args) > 1 and rec.args[1] == 2:
        return True
    return rec.op == "aten.mul.Tensor" and len(rec.args) > 1 and rec.args[0] is rec.args[1]


def _is_deviation_product(rec: Rec | None) -> bool:
    """``(x - m1) * (x - m2)`` with the same ``x``: Welford's ``delta * (x - mean)``."""
    if rec is None or rec.op != "aten.mul.Tensor" or len(rec.inputs) != 2:
        return False
    subs = [i.producer for i in rec.inputs]
    if any(s is None or s.op != "aten.sub.Tensor" or not s.inputs for s in subs):
        return False
    a, b = (s.inputs[0].snap for s in subs)
    return a.shape == b.shape and bool(torch.equal(a, b))


def _positive_divisor(rec: Rec) -> bool:
    d = rec.args[1] if len(rec.args) > 1 else None
    if isinstance(d, torch.Tensor):
        return d.numel() > 0 and bool(((d > 0) & torch.isfinite(d)).all())
    return isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d) and d > 0


def _statistic_behind(i: Input, hops: int = 0) -> Rec | None:
    """The std/var record a divisor was computed from (through views, casts, sqrt, + eps), if any;
    also the mean of squares of a root mean square (an RMSNorm written by hand). A pooled or running
    statistic is one too: through a division by a positive count or constant (``M2 / n``), a buffer's
    ``copy_``, and a sum whose terms are all >= 0 (every term is then 0 where the sum is), one of them a
    statistic or Welford's ``delta * (x - mean)``; never through a difference."""
    rec = i.producer
    while rec is not None and hops < 64:
        if rec.op in _STATISTICS:
            return rec
        if rec.op in _MEANS and rec.inputs and _is_square_of(rec.inputs[0].producer):
            return rec
        if rec.op in ("aten.stack.default", "aten.cat.default") and rec.inputs:
            # per-group statistics gathered: a statistic only when every gathered piece is one
            pieces = [_statistic_behind(t, hops + 1) for t in rec.inputs]
            return pieces[0] if all(p is not None for p in pieces) else None
        if rec.op in _MEANS and rec.inputs and rec.inputs[0].producer is not None \
                and rec.inputs[0].producer.op in ("aten.stack.default", "aten.cat.default"):
            rec, hops = rec.inputs[0].producer, hops + 1  # a mean of gathered statistics: a pooled one
            continue
        if rec.op == "aten.add.Tensor" and len(rec.inputs) > 1:
            if any(bool((t.snap < 0).any()) for t in rec.inputs):
                return None
            for t in rec.inputs:
                if _is_deviation_product(t.producer):
                    return t.producer
                found = _statistic_behind(t, hops + 1)
                if found is not None:
                    return found
            return None
        if rec.op == "aten.copy_.default" and len(rec.inputs) > 1:
            rec, hops = rec.inputs[1].producer, hops + 1
            continue
        if rec.op == "aten.div.Tensor" and rec.inputs and _positive_divisor(rec) and "rounding_mode" not in rec.kwargs:
            rec, hops = rec.inputs[0].producer, hops + 1
            continue
        if rec.op not in _TRANSPARENT or not rec.inputs:
            return None
        rec, hops = rec.inputs[0].producer, hops + 1
    return None


def _zero_statistic(stat: Rec) -> bool:
    """The statistic, recomputed in float64, is 0 (constant slice) or undefined (one element)."""
    again = _recompute(stat, F64)
    return again is not None and bool(((again == 0) | torch.isnan(again)).any())


def _ignored_label_count(rec: Rec, bad: torch.Tensor) -> bool:
    """0/0 where the divisor counts the targets of an nll_loss that differ from its ignore_index,
    and there are none (every label of the batch is ignored)."""
    num, den = rec.inputs[0], rec.inputs[1] if len(rec.inputs) > 1 else None
    if den is None:
        return False
    counts = [r for r in _ancestors(den.producer, 3) if r.op in ("aten.ne.Scalar",)]
    losses = [r for r in _ancestors(num.producer, 6) if r.op.startswith("aten.nll_loss")]
    for ne in counts:
        labels, value = ne.args[0], ne.args[1]
        for loss in losses:
            target, ignore = loss.args[1], loss.args[4]
            if (ignore == value and target.numel() == labels.numel()
                    and torch.equal(target.flatten(), labels.flatten()) and bool((labels == value).all())):
                return True
    return False


# =============================================================== claims, one per rule
def _log_arg_nonpositive(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 0, b) <= 0).all())


def _log1p_arg(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 0, b) <= -1).all())


def _gamma_pole(r: Rec, b: torch.Tensor) -> bool:
    x = _at(r, 0, b)
    return bool(((x <= 0) & _is_integer(x)).all())


def _xlogy_arg(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 1, b) <= 0).all())


def _negative_base_fractional(r: Rec, b: torch.Tensor) -> bool:
    x = _at(r, 0, b)
    if r.op == "aten.sqrt.default":
        return bool((x < 0).all())
    p = _at(r, 1, b)
    return bool(((x < 0) & ~_is_integer(p)).all())


def _zero_base_negative_power(r: Rec, b: torch.Tensor) -> bool:
    return bool(((_at(r, 0, b) == 0) & (_at(r, 1, b) < 0)).all())


def _rsqrt_negative(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 0, b) < 0).all())


def _zero_argument(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 0, b) == 0).all())


def _divisor_zero(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 1, b) == 0).all())


def _divisor_zero_from_statistic(r: Rec, b: torch.Tensor) -> bool:
    """The zero divisor (or rsqrt/reciprocal argument) is a std/var of a constant or one-element slice."""
    pos = 0 if r.op in ("aten.rsqrt.default", "aten.reciprocal.default") else 1
    if pos >= len(r.inputs) or not bool((_at(r, pos, b) == 0).all()):
        return False
    stat = _statistic_behind(r.inputs[pos])
    return stat is not None and _zero_statistic(stat)


def _inf_over_inf(r: Rec, b: torch.Tensor) -> bool:
    return bool((torch.isinf(_at(r, 0, b)) & torch.isinf(_at(r, 1, b))).all())


def _zero_times_inf(r: Rec, b: torch.Tensor) -> bool:
    x, y = _at(r, 0, b), _at(r, 1, b)
    return bool((((x == 0) & torch.isinf(y)) | (torch.isinf(x) & (y == 0))).all())


def _inf_minus_inf(r: Rec, b: torch.Tensor) -> bool:
    x, y = _at(r, 0, b), _at(r, 1, b)
    alpha = float(r.kwargs.get("alpha", 1))
    sign = -1.0 if r.op.startswith("aten.sub") else 1.0
    return bool((torch.isinf(x) & torch.isinf(y) & (torch.sign(x) != torch.sign(sign * alpha * y))).all())


def _outside_unit(r: Rec, b: torch.Tensor) -> bool:
    x = _at(r, 0, b)
    if r.op.startswith("aten.atanh"):
        return bool((x.abs() >= 1).all())
    return bool((x.abs() > 1).all())


def _acosh_below_one(r: Rec, b: torch.Tensor) -> bool:
    return bool((_at(r, 0, b) < 1).all())


def _rows_all_minus_inf(r: Rec, b: torch.Tensor) -> bool:
    x, dim = r.args[0].to(F64), r.args[1]
    rows = torch.isneginf(x).all(dim=dim, keepdim=True).expand_as(x)
    return bool(rows[b].all())


def _norm_slices(r: Rec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Input slices over which a fused normalisation takes its statistic, and which are bad."""
    x = r.args[0].to(F64)
    bad = ~torch.isfinite(r.out)
    if r.op == "aten.native_layer_norm.default":
        n = math.prod(r.args[1])
        return x.reshape(-1, n), bad.reshape(-1, n).any(1)
    if r.op == "aten.native_group_norm.default":
        groups = r.args[6]
        return x.reshape(x.shape[0] * groups, -1), bad.reshape(x.shape[0] * groups, -1).any(1)
    if r.op.startswith(("aten.native_batch_norm", "aten._native_batch_norm_legit")):
        xs = x.transpose(0, 1).reshape(x.shape[1], -1)
        return xs, bad.transpose(0, 1).reshape(x.shape[1], -1).any(1)
    return None


def _norm_constant_slice(r: Rec, b: torch.Tensor) -> bool:
    got = _norm_slices(r)
    if got is None:
        return False
    x, rows = got
    var = x[rows].var(dim=1, unbiased=False)
    return bool(rows.any()) and bool(((var == 0) | (x[rows].shape[1] == 1)).all())


def _norm_variance_overflow(r: Rec, b: torch.Tensor) -> bool:
    got = _norm_slices(r)
    if got is None:
        return False
    x, rows = got
    return bool(rows.any()) and _exceeds(x[rows].var(dim=1, unbiased=False), _dtype(r))


def _degrees_of_freedom(r: Rec, b: torch.Tensor) -> bool:
    """std/var with nothing left after the correction: N - correction <= 0 elements."""
    x = r.args[0]
    dims = r.args[1] if len(r.args) > 1 and r.args[1] is not None else list(range(x.dim()))
    dims = [dims] if isinstance(dims, int) else dims
    n = math.prod(x.shape[d] for d in dims) if dims else x.numel()
    correction = r.kwargs.get("correction", 1)
    correction = 1 if correction is None else correction
    return n - correction <= 0


def _nll_all_ignored(r: Rec, b: torch.Tensor) -> bool:
    target, ignore = r.args[1], r.args[4]
    return target.numel() > 0 and bool((target == ignore).all())


def _nll_zero_weight(r: Rec, b: torch.Tensor) -> bool:
    target, weight, ignore = r.args[1], r.args[2], r.args[4]
    kept = target[target != ignore]
    return weight is not None and kept.numel() > 0 and float(weight.to(F64)[kept].sum()) == 0.0


def _nll_target_out_of_range(r: Rec, b: torch.Tensor) -> bool:
    logp, target, ignore = r.args[0], r.args[1], r.args[4]
    classes = logp.shape[-1] if logp.dim() == 1 else logp.shape[1]
    kept = target[target != ignore]
    return bool(((kept < 0) | (kept >= classes)).any())


def _ctc_impossible(r: Rec, b: torch.Tensor) -> bool:
    """An alignment cannot exist: an input shorter than its target plus its repeated labels."""
    _, targets, in_lens, tgt_lens = r.args[:4]
    in_lens, tgt_lens = torch.as_tensor(in_lens).tolist(), torch.as_tensor(tgt_lens).tolist()
    bad_items = ~torch.isfinite(r.out) if r.out.dim() else torch.ones(len(in_lens), dtype=torch.bool)
    offsets = [sum(tgt_lens[:i]) for i in range(len(tgt_lens))]
    impossible = []
    for i, (n, m) in enumerate(zip(in_lens, tgt_lens)):
        seq = targets[i, :m].tolist() if targets.dim() == 2 else targets[offsets[i]:offsets[i] + m].tolist()
        repeats = sum(1 for a, c in zip(seq, seq[1:]) if a == c)
        impossible.append(n < m + repeats)
    return all(imp for imp, bad in zip(impossible, bad_items.tolist()) if bad) and any(impossible)


def _probability_outside_unit(r: Rec, b: torch.Tensor) -> bool:
    p, t = r.args[0].to(F64), r.args[1].to(F64)
    return bool(((p < 0) | (p > 1) | (t < 0) | (t > 1)).any())


def _not_positive_definite(r: Rec, b: torch.Tensor) -> bool:
    a = r.args[0].to(F64)
    sym = (a + a.transpose(-1, -2)) / 2
    return bool((torch.linalg.eigvalsh(sym)[..., 0] <= 0).any())


def _singular(r: Rec, b: torch.Tensor) -> bool:
    a = r.args[0].to(F64)
    return bool((torch.linalg.matrix_rank(a) < a.shape[-1]).any())


def _overflow_claim(r: Rec, b: torch.Tensor) -> bool:
    return _overflows(r, b)


def _exponent_beyond_range(r: Rec, b: torch.Tensor) -> bool:
    """exp_overflow: the true magnitude, computed in log space in float64, exceeds the dtype's max
    (also when even float64 overflows: exp(5000))."""
    limit = math.log(torch.finfo(_dtype(r)).max)
    x = _at(r, 0, b)
    if r.op in ("aten.exp.default", "aten.expm1.default"):
        log_mag = x
    elif r.op in ("aten.exp2.default", "aten.special_exp2.default"):
        log_mag = x * math.log(2)
    elif r.op in ("aten.sinh.default", "aten.cosh.default"):
        log_mag = x.abs() - math.log(2)
    elif r.op == "aten.pow.Tensor_Scalar":
        log_mag = _at(r, 1, b) * torch.log(x.abs())
    elif r.op == "aten.pow.Tensor_Tensor":
        log_mag = _at(r, 1, b) * torch.log(x.abs())
    elif r.op == "aten.pow.Scalar":   # pow(base scalar, exponent tensor)
        log_mag = _at(r, 1, b) * math.log(abs(float(r.args[0])))
    else:
        return False
    return bool((log_mag > limit).all())


def _inf_operands_claim(r: Rec, b: torch.Tensor) -> bool:
    return _inf_operands(r)


_LOG = ("aten.log.default", "aten.log2.default", "aten.log10.default")
_EXP = ("aten.exp.default", "aten.exp2.default", "aten.expm1.default", "aten.sinh.default", "aten.cosh.default",
        "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar", "aten.special_exp2.default")
_DIV = ("aten.div.Tensor", "aten.div.Scalar", "aten.div.Tensor_mode", "aten.true_divide.Tensor")
_POW = ("aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor")
_NORMS = ("aten.native_layer_norm.default", "aten.native_group_norm.default", "aten.native_batch_norm.default",
          "aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit_functional.default",
          "aten._native_batch_norm_legit.no_stats")
_NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
ANY = None

# The forward claims, in order: the first whose ops include the origin op and whose claim holds
# on the bad elements names the cause. ANY: every op (the generic rules, last).
FORWARD_RULES: list[tuple[tuple[str, ...] | None, Callable[[Rec, torch.Tensor], bool], str]] = [
    # domain of logarithms
    (_LOG, _log_arg_nonpositive, "log_nonpositive"),
    (("aten.log1p.default",), _log1p_arg, "log_nonpositive"),
    (("aten.lgamma.default", "aten.digamma.default", "aten.polygamma.default"), _gamma_pole, "log_nonpositive"),
    (("aten.xlogy.Tensor",), _xlogy_arg, "log_nonpositive"),
    # roots and powers
    (("aten.sqrt.default",) + _POW, _negative_base_fractional, "sqrt_negative"),
    (("aten.rsqrt.default",), _rsqrt_negative, "sqrt_negative"),
    (_POW, _zero_base_negative_power, "div_by_zero"),
    # division: 0/0 of an ignored-label count, a zero statistic, inf/inf, a zero divisor
    (_DIV, _ignored_label_count, "label_out_of_range"),
    (_DIV + ("aten.rsqrt.default", "aten.reciprocal.default"), _divisor_zero_from_statistic, "zero_variance_norm"),
    (_DIV, _inf_over_inf, "inf_arithmetic"),
    (_DIV, _divisor_zero, "div_by_zero"),
    (("aten.rsqrt.default", "aten.reciprocal.default"), _zero_argument, "div_by_zero"),
    # arithmetic on infinities
    (("aten.mul.Tensor", "aten.mul.Scalar"), _zero_times_inf, "inf_arithmetic"),
    (("aten.add.Tensor", "aten.sub.Tensor", "aten.add.Scalar", "aten.sub.Scalar"), _inf_minus_inf, "inf_arithmetic"),
    # inverse trigonometric / hyperbolic domains
    (("aten.acos.default", "aten.asin.default", "aten.atanh.default"), _outside_unit, "domain_error"),
    (("aten.acosh.default",), _acosh_below_one, "domain_error"),
    # softmax over a fully masked row
    (("aten._softmax.default", "aten._log_softmax.default"), _rows_all_minus_inf, "masked_softmax_all"),
    # normalisations: a constant (or one-element) slice, or a variance beyond the dtype
    (_NORMS, _norm_constant_slice, "zero_variance_norm"),
    (_NORMS, lambda r, b: _precision(r, b), "precision_overflow"),
    (_NORMS, _norm_variance_overflow, "overflow"),
    (("aten.std.correction", "aten.var.correction", "aten.std_mean.correction", "aten.var_mean.correction"),
     _degrees_of_freedom, "zero_variance_norm"),
    # losses with their own domain
    (_NLL, _nll_all_ignored, "label_out_of_range"),
    (_NLL, _nll_zero_weight, "div_by_zero"),
    (_NLL, _nll_target_out_of_range, "label_out_of_range"),
    (("aten._ctc_loss.default", "aten._ctc_loss.Tensor"), _ctc_impossible, "domain_error"),
    (("aten.binary_cross_entropy.default",), _probability_outside_unit, "domain_error"),
    # decompositions
    (("aten.linalg_cholesky_ex.default", "aten.cholesky.default"), _not_positive_definite, "domain_error"),
    (("aten.linalg_inv_ex.default", "aten.linalg_solve_ex.default", "aten.linalg_lu_factor_ex.default"), _singular,
     "domain_error"),
    # generic: any op
    (ANY, lambda r, b: _inf_operands(r) and bool(torch.isnan(r.out[b]).all()) if r.outs else False, "inf_arithmetic"),
    (ANY, lambda r, b: _precision(r, b), "precision_overflow"),
    (_EXP, _exponent_beyond_range, "exp_overflow"),
    (ANY, _overflow_claim, "overflow"),
]


def classify_forward(rec: Rec, bad: torch.Tensor | None) -> tuple[str, str]:
    if bad is None:
        bad = torch.ones_like(rec.out, dtype=torch.bool) if rec.outs else torch.ones((), dtype=torch.bool)
    for ops, claim, cause in FORWARD_RULES:
        if ops is not ANY and rec.op not in ops:
            continue
        try:
            holds = claim(rec, bad)
        except Exception:  # a claim that cannot be evaluated on this op does not hold
            holds = False
        if holds:
            return cause, f"{claim.__name__} holds on {int(bad.sum()) if bad.dim() else 1} bad element(s) of {rec.op}"
    return "unknown", f"no claim holds for {rec.op}"


# ================================================================ backward (autograd nodes)
@dataclasses.dataclass(eq=False)
class NodeRun:
    node: Any
    rec: Rec | None
    received: list[torch.Tensor | None]
    produced: list[torch.Tensor | None]


def _record_backward(loss: torch.Tensor, node_rec: dict[Any, Rec], scaler: Any) -> list[NodeRun]:
    runs: list[NodeRun] = []
    handles = []
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)

        def hook(grad_inputs: Any, grad_outputs: Any, node: Any = node) -> None:
            keep = lambda g: g.detach().clone() if isinstance(g, torch.Tensor) else None  # noqa: E731
            runs.append(NodeRun(node, node_rec.get(node), [keep(g) for g in grad_outputs], [keep(g) for g in grad_inputs]))

        handles.append(node.register_hook(hook))
    try:
        (scaler.scale(loss) if scaler is not None else loss).backward()
    finally:
        for h in handles:
            h.remove()
    return runs


def _grad_bad_positions(run: NodeRun) -> tuple[int, torch.Tensor] | None:
    for k, g in enumerate(run.produced):
        if g is not None and not _finite(g):
            return k, ~torch.isfinite(g)
    return None


def _forward_tensor_args(rec: Rec) -> list[int]:
    return [k for k, a in enumerate(rec.args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


def _leaked_forward_value(rec: Rec, run: NodeRun, k: int, bad: torch.Tensor) -> bool:
    """where_gradient_trap: the forward values there were non-finite although the loss was finite."""
    out_bad = ~torch.isfinite(rec.out)
    if out_bad.shape == bad.shape:
        return bool(out_bad[bad].any())
    return bool(out_bad.any())


# Derivatives in float64 at the recorded inputs: is d out / d input infinite there?
def _d_sqrt(x: torch.Tensor, r: Rec) -> torch.Tensor:
    return 0.5 / torch.sqrt(x)


def _d_pow(x: torch.Tensor, r: Rec) -> torch.Tensor:
    p = float(r.args[1])
    return p * x ** (p - 1)


def _d_acos(x: torch.Tensor, r: Rec) -> torch.Tensor:
    return -1 / torch.sqrt(1 - x * x)


def _d_atanh(x: torch.Tensor, r: Rec) -> torch.Tensor:
    return 1 / (1 - x * x)


DERIVATIVES: dict[str, Callable[[torch.Tensor, Rec], torch.Tensor]] = {
    "aten.sqrt.default": _d_sqrt,
    "aten.pow.Tensor_Scalar": _d_pow,
    "aten.acos.default": _d_acos,
    "aten.asin.default": lambda x, r: -_d_acos(x, r),
    "aten.atanh.default": _d_atanh,
}


def _infinite_derivative(rec: Rec, run: NodeRun, k: int, bad: torch.Tensor) -> bool:
    """grad_singularity: the forward is finite, the derivative evaluated in float64 is infinite."""
    if not _finite(rec.out):
        return False
    args = _forward_tensor_args(rec)
    if not args:
        return False
    x = rec.args[args[0]].to(F64)
    if rec.op in DERIVATIVES:
        d = DERIVATIVES[rec.op](x, rec)
        return d.shape == bad.shape and bool((~torch.isfinite(d[bad])).all())
    # any other op: its Jacobian-vector product in float64, with a gradient of ones
    leaves = [rec.args[j].to(F64).requires_grad_(True) for j in args]
    call = list(rec.args)
    for j, leaf in zip(args, leaves):
        call[j] = leaf
    try:
        with torch.enable_grad():
            out = rec.func(*call, **tree_map(_to(F64), rec.kwargs))
            out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)][0]
            g = torch.autograd.grad(out, leaves[0], torch.ones_like(out), allow_unused=True)[0]
    except Exception:
        return False
    return g is not None and g.shape == bad.shape and bool((~torch.isfinite(g[bad])).all())


def _gradient64(rec: Rec, run: NodeRun) -> torch.Tensor | None:
    """The node's first input gradient recomputed in float64 from the recorded inputs and the
    gradient it received."""
    args = _forward_tensor_args(rec)
    received = run.received[0] if run.received else None
    if not args or received is None:
        return None
    leaves = [rec.args[j].to(F64).requires_grad_(True) for j in args]
    call = list(rec.args)
    for j, leaf in zip(args, leaves):
        call[j] = leaf
    try:
        with torch.enable_grad():
            out = rec.func(*call, **tree_map(_to(F64), rec.kwargs))
            out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)][0]
            grads = torch.autograd.grad(out, leaves, received.to(F64), allow_unused=True)
    except Exception:
        return None
    return next((g for g in grads if g is not None and not _finite(g.to(rec.out.dtype))), None)


def _gradient_precision(rec: Rec, run: NodeRun, k: int, bad: torch.Tensor) -> bool:
    if rec.out.dtype not in LOW_PRECISION:
        return False
    g = _gradient64(rec, run)
    return g is not None and bool(torch.isfinite(g).all()) and bool((g.abs() <= F32_MAX).all())


def _gradient_overflow(rec: Rec, run: NodeRun, k: int, bad: torch.Tensor) -> bool:
    g = _gradient64(rec, run)
    return g is not None and _exceeds(g, rec.out.dtype)


# (claim, cause, phase): the first that holds for the first node that broke names the cause.
BACKWARD_RULES: list[tuple[Callable[[Rec, NodeRun, int, torch.Tensor], bool], str, str]] = [
    (_leaked_forward_value, "where_gradient_trap", "forward"),
    (_infinite_derivative, "grad_singularity", "backward"),
    (_gradient_precision, "precision_overflow", "backward"),
    (_gradient_overflow, "gradient_explosion", "backward"),
]


# ===================================================================== the training loop
def _owner(root: nn.Module, bad: list[str]) -> str | None:
    if not bad:
        return None
    name = bad[0]
    return name.rpartition(".")[0]


def _nonfinite_params(root: nn.Module) -> list[str]:
    return [n for n, p in root.named_parameters() if not _finite(p.detach())]


def _autocast(dtype: torch.dtype | None) -> Any:
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _verdict_forward(step: int, origin: Rec | None, bad: torch.Tensor | None, chain: list[Rec],
                     phase: str = "forward") -> Verdict:
    if origin is None:
        return Verdict(step, phase, None, None, None, "unknown", "no op on the dataflow chain created the value")
    cause, why = classify_forward(origin, bad)
    return Verdict(step, phase, origin.op, origin.module, origin.source, cause, why, tuple(r.op for r in chain))


def _exception_origin(recorder: Recorder) -> tuple[Rec | None, torch.Tensor | None, list[Rec]]:
    failed = next((r for r in recorder.recs if r.error is not None), None)
    if failed is None:
        return None, None, []
    bad_inputs = [i for i in failed.inputs if not _finite(i.snap)]
    if bad_inputs:   # a non-finite value reached an op that validates its input
        return forward_origin(bad_inputs)
    if failed.op == "aten._linalg_check_errors.default" and failed.inputs and failed.inputs[0].producer is not None:
        return failed.inputs[0].producer, None, [failed]
    return failed, None, [failed]


def decide(program: Any, max_steps: int | None = None) -> Verdict | None:
    """Train ``program`` without nantrace; the diagnosis of its first failing step (None: healthy)."""
    model = program.model
    root = getattr(model, "_orig_mod", model)
    opt, scaler = program.optimizer, getattr(program, "scaler", None)
    autocast = getattr(program, "autocast", None)
    stance = getattr(torch.compiler, "set_stance", None)
    with (stance("force_eager") if stance else contextlib.nullcontext()):
        for step, batch in enumerate(program.batches):
            if max_steps is not None and step >= max_steps:
                break
            opt.zero_grad()
            if any(not _finite(t) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)):
                return Verdict(step, "data", None, None, None, "nonfinite_input", "the batch holds NaN/Inf")
            bad_params = _nonfinite_params(root)
            if bad_params:
                return Verdict(step, None, None, _owner(root, bad_params), None, "nonfinite_param",
                               f"{bad_params[0]} is non-finite before the step")
            modules = ModuleTracker(root)
            recorder = Recorder(modules)
            try:
                with recorder, _autocast(autocast):
                    loss = program.loss_fn(model, batch)
                recorder.resolve()
            except Exception:
                origin, bad, chain = _exception_origin(recorder)
                return _verdict_forward(step, origin, bad, chain)
            finally:
                modules.remove()
            if not _finite(loss.detach()):
                start = Input(loss.detach(), recorder.producer.get(id(loss)))
                return _verdict_forward(step, *forward_origin([start]))
            runs = _record_backward(loss, recorder.node_rec, scaler)
            params = [p for p in root.parameters() if p.grad is not None]
            if scaler is not None:
                scaler.unscale_(opt)
            if any(not _finite(p.grad) for p in params):
                if scaler is not None:   # scaled gradients overflowed: calibration, not an incident
                    scaler.step(opt)
                    scaler.update()
                    continue
                return _verdict_backward(step, runs)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            bad_params = _nonfinite_params(root)
            if bad_params:
                return Verdict(step, "optimizer", None, _owner(root, bad_params), None, "optimizer_state",
                               f"the update made {bad_params[0]} non-finite from finite gradients")
    return None


def _verdict_backward(step: int, runs: list[NodeRun]) -> Verdict:
    for run in runs:
        received_ok = all(g is None or _finite(g) for g in run.received)
        pos = _grad_bad_positions(run)
        if not received_ok or pos is None:
            continue
        rec = run.rec
        if rec is None:
            return Verdict(step, "backward", None, None, None, "unknown", f"{run.node.name()} has no forward op")
        k, bad = pos
        for claim, cause, phase in BACKWARD_RULES:
            try:
                holds = claim(rec, run, k, bad)
            except Exception:
                holds = False
            if holds:
                if cause == "where_gradient_trap":   # name the forward op that made the leaked value
                    origin, _, chain = forward_origin([Input(rec.out, rec)])
                    origin = origin or rec
                    return Verdict(step, phase, origin.op, origin.module, origin.source, cause,
                                   f"{rec.op} was non-finite in the forward where its gradient went bad",
                                   tuple(r.op for r in chain))
                return Verdict(step, phase, rec.op, rec.module, rec.source, cause,
                               f"{claim.__name__} holds for {run.node.name()}")
        return Verdict(step, "backward", rec.op, rec.module, rec.source, "unknown", f"no claim holds for {run.node.name()}")
    return Verdict(step, "backward", None, None, None, "unknown", "no node turned finite gradients non-finite")
