"""The op-family rules of the cause classifier: for each family of ATen ops (log, division,
roots, domain functions, exponentials, normalisations, statistics, NLL, linear algebra, CTC), a
rule that checks its precise claim on the bad elements (a log argument <= 0, a divisor equal to
0, a constant normalised slice with eps = 0, ...) and returns a verdict, or ``None`` to fall
through to the classifier's generic rule (``classify.py``). Causes and fixes as text live in
``patterns.py``; the evidence helpers in ``evidence.py``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..localisation.tracer import OpInfo, OpRecord
from ..loss_tape import replayed_numbers
from . import evidence as ev
from .patterns import short_op

__all__ = ["FORWARD_RULES", "LOW_PRECISION", "RuleContext", "Verdict", "matrix_detail", "norm_rule", "scalars"]

LOG_OPS = {"log", "log2", "log10", "log1p", "lgamma", "digamma", "polygamma", "xlogy", "special_xlog1py", "mvlgamma",
           "special_entr", "logit"}
DIV_OPS = {"div", "reciprocal", "rsqrt", "remainder", "fmod", "floor_divide", "true_divide"}
EXP_OPS = {"exp", "expm1", "exp2", "sinh", "cosh", "pow", "special_exp2", "ldexp", "float_power"}
ROOT_OPS = {"sqrt", "pow", "float_power", "rsqrt"}
DOMAIN_OPS = {"acos": (-1.0, 1.0), "asin": (-1.0, 1.0), "atanh": (-1.0, 1.0), "acosh": (1.0, math.inf),
              "erfinv": (-1.0, 1.0), "arccos": (-1.0, 1.0), "arcsin": (-1.0, 1.0)}
SOFTMAX_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax", "logsumexp"}
NORM_OPS = {
    "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_group_norm", "batch_norm", "layer_norm", "group_norm",
    "instance_norm", "rms_norm", "_fused_rms_norm",
}
STAT_OPS = {"std", "var", "std_mean", "var_mean"}
LINALG_OPS = {"linalg_cholesky_ex", "cholesky", "linalg_inv_ex", "inverse", "linalg_solve_ex", "_linalg_slogdet",
              "logdet", "linalg_eigh", "_linalg_eigh", "_linalg_svd", "cholesky_solve", "cholesky_inverse",
              "linalg_lu_factor_ex", "triangular_solve", "linalg_solve_triangular", "_linalg_det", "det",
              "linalg_cholesky", "linalg_inv", "pinverse"}
CTC_OPS = {"_ctc_loss", "ctc_loss"}
NLL_OPS = {"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "cross_entropy_loss"}
# ops that only move or view data: provenance looks through them
PASS_THROUGH = {"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "clone", "contiguous", "alias",
                "_to_copy", "detach", "t", "transpose", "permute", "slice", "select", "expand_as", "lift_fresh",
                "clamp_min", "clamp", "add", "sqrt", "pow", "abs", "to", "view_as", "flatten"}
LOW_PRECISION = {torch.float16, torch.bfloat16}

Verdict = tuple[str, str, dict[str, Any]]
"""(cause, detail, facts): what a rule concluded."""



@dataclasses.dataclass
class RuleContext:
    observed_in: str
    low_precision_finite: bool | None
    ignored_targets: tuple[int, int] | None
    made_by: Any
    history: list[dict[str, Any]]


def scalars(args: tuple[Any, ...] | None) -> list[Any]:
    return [a for a in (args or ()) if isinstance(a, (int, float)) and not isinstance(a, bool)]


def _arg_of(short: str, operands: dict[str, torch.Tensor]) -> torch.Tensor | None:
    key = "arg1" if short in {"xlogy", "polygamma", "special_xlog1py"} else "arg0"
    return operands.get(key)


def _producer(ctx: RuleContext, t: Any, hops: int = 4) -> OpInfo | None:
    """The op that computed ``t``, looking through views, casts and eps additions."""
    if ctx.made_by is None or not isinstance(t, torch.Tensor):
        return None
    info = ctx.made_by.get(t)
    seen = 0
    while info is not None and seen < hops and short_op(info.op) in PASS_THROUGH:
        nxt = _parent(info)
        if nxt is None:
            break
        info, seen = nxt, seen + 1
    return info


def _parent(info: OpInfo) -> OpInfo | None:
    """The op that made ``info``'s first tensor argument."""
    return info.parents[0] if info.parents else None


def _log_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    x = _arg_of(short, operands)
    if x is None:
        return None
    if short == "log1p":
        outside = x <= -1
    elif short in {"lgamma", "digamma", "polygamma", "mvlgamma"}:
        outside = (x <= 0) & (x == torch.round(x))
    elif short == "logit":
        outside = (x <= 0) | (x >= 1)
    else:
        outside = x <= 0
    if not bool(outside.any()):
        return None
    zeros, neg = ev.count(x, lambda v: v == 0), ev.count(x, lambda v: v < 0)
    facts.update(arg_zeros=zeros, arg_negatives=neg, arg_min=float(x.min()))
    src_index = 1 if short in {"xlogy", "polygamma", "special_xlog1py"} else 0
    prod = _producer(ctx, args[src_index] if len(args) > src_index else None)
    came = f", made by {short_op(prod.op).lstrip('_')}" if prod is not None and short_op(prod.op) not in {short} else ""
    if short == "log1p":
        return "log_nonpositive", f"{int(outside.sum())} argument(s) ≤ -1, min {ev.fmt(float(x.min()))}{came}", facts
    if short in {"lgamma", "digamma", "polygamma", "mvlgamma"}:
        return "log_nonpositive", f"{int(outside.sum())} argument(s) at non-positive integers (poles){came}", facts
    return "log_nonpositive", f"{zeros} zeros and {neg} negatives in its input{came}", facts


def _divisor(short: str, args: Any, operands: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor | None]:
    if short in {"reciprocal", "rsqrt"}:
        return (args[0] if args else None), operands.get("arg0")
    raw = args[1] if len(args) > 1 else None
    if isinstance(raw, (int, float)):
        return raw, None
    return raw, operands.get("arg1")


def _div_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    raw, d = _divisor(short, args, operands)
    read: torch.Tensor | None = None
    if isinstance(raw, (int, float)):
        if raw != 0:
            return None
        read = _read_off(ctx, rec, raw)
        if read is None:
            return "div_by_zero", "divided by the scalar 0", facts
        facts["divisor_read_to_host"] = True
        zeros = 1
    else:
        if d is None:
            return None
        zeros = ev.count(d, lambda v: v == 0)
        facts["divisor_zeros"] = zeros
        if short == "rsqrt":
            if ev.count(d, lambda v: v < 0):
                return "sqrt_negative", f"{ev.count(d, lambda v: v < 0)} negative inputs, min {ev.fmt(float(d.min()))}", facts
        if not zeros:
            return None  # a tiny divisor: the generic rule calls the overflow
    num = operands.get("arg0") if short not in {"reciprocal", "rsqrt"} else None
    both = num is not None and (bool((num == 0).any()) if read is not None else bool(((num == 0) & (d == 0)).any()))
    if both and ctx.ignored_targets is not None:
        n, ignore = ctx.ignored_targets
        return "label_out_of_range", f"all {n} labels equal ignore_index={ignore}, so the count divided by is 0", facts
    source = read if read is not None else raw
    prod = _producer(ctx, source)
    kind = short_op(prod.op) if prod is not None else None
    stat = _statistic(ctx, source)
    host = " (read to the host as the number 0)" if read is not None else ""
    on = f"0 on {zeros} element(s)" if read is None else "0"
    if stat is not None and stat[0] == "distance":
        diff = _difference_of(stat[1])
        if diff is not None and _reaches(ctx, args[0] if args and short not in {"reciprocal", "rsqrt"} else None, diff):
            facts["normalised_difference"] = True
            return ("zero_variance_norm", f"the divisor is the norm ({short_op(stat[1].op)}) of the difference it divides"
                    f"{host}, {on}: that difference is all zeros, and no eps was added", facts)
        facts["distance"] = True
        return ("div_by_zero", f"the divisor is a distance ({short_op(stat[1].op)} of a difference of two values){host} "
                f"that is {on}: two points coincide", facts)
    if stat is not None and stat[0] in _SPREAD_KINDS:
        slices = _constant_slices(stat[1]) if short_op(stat[1].op) in STAT_OPS or not stat[2] else None
        if slices is not None:
            facts["constant_slices"] = slices
        label = {"std": "standard deviation", "var": "variance", "norm": "norm", "rms": "root mean square"}[stat[0]]
        if stat[3]:
            label = f"product or multiple of {label}s"
            facts["scaled_statistic"] = True
        elif stat[2]:
            label = f"pooled or running {label}"
            facts["pooled_statistic"] = True
        # a std/variance is 0 on a constant slice; a norm or root mean square only on an all-zero one
        why = ("the slice it was computed over is constant (or has one element)" if stat[0] in {"std", "var"}
               else "the vector it was computed over is all zeros")
        if stat[2] and not stat[3]:
            why = ("every value it was pooled or accumulated over is the same (each of its non-negative terms is 0)"
                   if stat[0] in {"std", "var"} else "every vector it was accumulated over is all zeros")
        return ("zero_variance_norm",
                f"the divisor is a {label} ({short_op(stat[1].op)}){host} that is {on}: {why}, and no eps was added", facts)
    if stat is not None and stat[0] == "count":
        return ("div_by_zero", f"the divisor is a count ({short_op(stat[1].op)} of a mask){host} that is 0: a mean over "
                "no element", facts)
    if read is not None:
        return "div_by_zero", f"divided by the scalar 0, read to the host off {kind.lstrip('_') if kind else 'a tensor'}", facts
    what = f", made by {kind.lstrip('_')}" if kind else ""
    zero_over_zero = " (0/0)" if both else ""
    return "div_by_zero", f"{zeros} zeros in the denominator{zero_over_zero}{what}", facts


def _read_off(ctx: RuleContext, rec: OpRecord, value: float | int) -> torch.Tensor | None:
    """The replayed tensor that the op's zero plain-number divisor was read off in the step (``x / t.item()``: the
    tape noted the read, the replay the call that took the number, ``loss_tape.replayed_numbers``), when the
    replayed tensor holds that number there; None when the number came from no tensor the replay made (a
    literal, a setting) or which one is unclear."""
    found = [n for n in replayed_numbers(ctx.made_by, rec.index) if n[2] == value]
    preferred = [n for n in found if n[0] in (1, "other")] or found  # the divisor's argument of div / true_divide
    if not preferred or len({id(n[3]) for n in preferred}) != 1:
        return None
    _, index, _, t = preferred[0]
    t, index = _piece(ctx, t, index)
    return t if _holds(t, index, value) else None


def _piece(ctx: RuleContext, t: torch.Tensor, index: int) -> tuple[torch.Tensor, int]:
    """The tensor and index element ``index`` of ``t`` (flattened) was made from, when ``t`` gathers several along
    its first dimension (``torch.stack([x.mean(), x.std()]).tolist()``: the second number is the std's)."""
    for _ in range(4):
        info = ctx.made_by.get(t) if ctx.made_by is not None else None
        args = info.args if info is not None else None
        if not args or short_op(info.op) not in {"stack", "cat"} or not isinstance(args[0], (list, tuple)):
            break
        dim = args[1] if len(args) > 1 else (info.kwargs or {}).get("dim", 0)
        if dim != 0:
            break
        for piece in args[0]:
            if not isinstance(piece, torch.Tensor):
                return t, index
            if index < piece.numel():
                t = piece
                break
            index -= piece.numel()
        else:
            break
    return t, index


def _holds(t: torch.Tensor, index: int, value: float | int) -> bool:
    """Element ``index`` of ``t`` (flattened) is ``value`` (a number truncated by ``int()`` is not the tensor's)."""
    if t.is_complex() or index >= t.numel():
        return False
    return bool(t.detach().reshape(-1)[index] == value)


def _reaches(ctx: RuleContext, t: Any, target: OpInfo, limit: int = 256) -> bool:
    """``t`` was computed from the output of ``target`` (its provenance reaches that op)."""
    if ctx.made_by is None or not isinstance(t, torch.Tensor):
        return False
    stack, seen = [ctx.made_by.get(t)], set()
    while stack and len(seen) < limit:
        info = stack.pop()
        if info is None or id(info) in seen:
            continue
        if info is target:
            return True
        seen.add(id(info))
        stack.extend(info.parents)
    return False


def _first_tensor(info: OpInfo) -> torch.Tensor | None:
    return next((a for a in (info.args or ()) if isinstance(a, torch.Tensor)), None)


def _statistic(ctx: RuleContext, t: Any) -> tuple[str, OpInfo, bool, bool] | None:
    """What kind of statistic computed the divisor ``t``: a std/variance/norm/root mean square
    (a normalisation), a distance (the norm of a difference of two values), a count of a mask (an empty
    mean), or None; with the op that computed it, whether the divisor combines it with other values (a
    pooled or running statistic) and whether it is a product or positive multiple of statistics
    (``|z_i| |z_j|``, ``2 |z|``). Looks through views, casts, eps additions, roots and powers, scaling by a
    positive count or constant, products of non-negative statistics of one kind, sums and means of
    non-negative terms one of which is a statistic (a pooled variance, a running mean of variances),
    Welford's update ``M2 + delta * (x - mean)``, and a number read to the host and made a tensor again;
    never through a difference."""
    if ctx.made_by is None or not isinstance(t, torch.Tensor):
        return None
    found = _StatWalk(ctx.made_by).of(ctx.made_by.get(t))
    if found is None:
        return None
    if found.combined and found.kind in _MEASURE_KINDS and not _zero_somewhere(found.info):
        return None  # the zero comes from elsewhere (an underflowing scale): not a zero statistic
    return found.kind, found.info, found.combined, found.scaled


_SPREAD_KINDS = frozenset({"std", "var", "norm", "rms"})
_MEASURE_KINDS = _SPREAD_KINDS | {"distance"}
"""Non-negative statistics of the data: spreads, and distances (the norm of a difference of two values, zero
where two points coincide: ``div_by_zero``, unless what it divides is that very difference)."""
_VARIANCE_KINDS = frozenset({"std", "var"})
"""Spreads about a mean: the only statistics that stay statistics through a division by a value computed from
the data (``M2 / n`` of a running variance). A norm divided by the sum of norms is a share (an importance weight,
a probability), and its zero is that of a probability: ``div_by_zero``."""
_NORM_STATS = frozenset({"linalg_vector_norm", "norm", "frobenius_norm", "_cdist_forward", "cdist"})
_REDUCTIONS = frozenset({"sum", "mean", "count_nonzero"})
_WALK_DEPTH = 64
_WALK_NODES = 512


@dataclasses.dataclass
class _Stat:
    kind: str
    info: OpInfo
    combined: bool = False
    """Reached through a scaling or a sum of several terms, not the statistic's own value."""
    scaled: bool = False
    """Reached through a product of statistics or a positive multiple of one only (``|z_i| |z_j|``, ``2 |z|``): the
    same normalisation written another way, not a pooled statistic."""


def _family(kind: str) -> str:
    return "spread" if kind in _SPREAD_KINDS else kind


class _StatWalk:
    """Provenance of a divisor as a statistic (see :func:`_statistic`): a memoised walk over the
    ops that made it, each step justified by the values the op received (a scale > 0, terms >= 0),
    so that a divisor equal to 0 means the statistic found is 0 there."""

    def __init__(self, table: Any = None) -> None:
        self.memo: dict[tuple[int, bool], _Stat | None] = {}
        self.visits = 0
        self.table = table
        """The replay's provenance table (tensor -> the op that made it): where a number read to the host leads."""

    def of(self, info: OpInfo | None, depth: int = 0, summed: bool = False) -> _Stat | None:
        if info is None or depth > _WALK_DEPTH or self.visits > _WALK_NODES:
            return None
        key = (id(info), summed)
        if key not in self.memo:
            self.visits += 1
            self.memo[key] = None
            self.memo[key] = self._of(info, depth, summed)
        return self.memo[key]

    def _of(self, info: OpInfo, depth: int, summed: bool) -> _Stat | None:
        kind = short_op(info.op)
        if kind in STAT_OPS:
            return _Stat("std" if kind.startswith("std") else "var", info)
        if kind in _NORM_STATS:
            return _Stat("distance" if _is_distance(info) else "norm", info)
        if kind in _REDUCTIONS:
            inner = _parent(info)
            if inner is not None and _is_square(inner):  # squares first: all-zero squares look like a 0/1 mask
                return _Stat("distance" if _is_distance(inner) else "rms", inner)
            below = self.of(inner, depth + 1, True) if kind != "count_nonzero" else None
            if below is not None and below.kind in _SPREAD_KINDS:  # a mean of variances: a pooled variance
                return dataclasses.replace(below, combined=True, scaled=False)
            if _is_count(info):
                return _Stat("count", info)
            return dataclasses.replace(below, combined=True, scaled=False) if below is not None else None
        if summed and (_is_square(info) or _is_deviation_product(info)):
            # a term of an accumulation: (x - m)^2 or Welford's delta * (x - mean_new) is a variance's
            # sum of squares; (a - b)^2 of two values a squared distance's; a square of anything else a root mean square's
            if _is_deviation_product(info) or _centred_square(info):
                return _Stat("var", info, True)
            return _Stat("distance" if _is_distance(info) else "rms", info, True)
        if kind in {"stack", "cat"} and info.parents:  # per-group statistics gathered (then pooled by a mean)
            found = [self.of(p, depth + 1, summed) for p in info.parents]
            return _combine(found, True) if all(f is not None for f in found) else None  # type: ignore[arg-type]
        if kind == "copy" and len(info.parents) > 1:  # a running buffer written with ``buf.copy_(new)``
            return self.of(info.parents[1], depth + 1, summed)
        if kind == "add":
            return self._sum(info, depth, summed)
        if kind in {"mul", "div", "true_divide"}:
            return self._scaled(info, kind, depth, summed)
        if kind in {"mm", "bmm"} and _outer_product(info):  # a column times a row: |z|[:, None] @ |z|[None, :]
            return self._scaled(info, "mul", depth, summed)
        if self.table is not None and not any(p is not None for p in info.parents):
            read = self._read_back(info)  # made from a number the step's code had read to the host: torch.tensor(s)
            if read is not None:
                return self.of(read, depth + 1, summed)
        if kind in PASS_THROUGH:
            return self.of(_parent(info), depth + 1, summed)
        return None

    def _read_back(self, info: OpInfo) -> OpInfo | None:
        """The op that made the tensor a number was read off, when ``info`` (an op made from no tensor of the
        replay) made its output from that one number (``torch.tensor(std.item())``, ``torch.full(shape, n)``)."""
        numbers = replayed_numbers(self.table, info.index)
        if len({id(n[3]) for n in numbers}) != 1:
            return None
        _, index, value, t = numbers[0]
        if not _holds(t, index, value) or not any(
                (isinstance(a, torch.Tensor) and 0 < a.numel() <= 64 and not a.is_complex() and bool((a == value).all()))
                or (isinstance(a, (int, float)) and not isinstance(a, bool) and a == value) for a in (info.args or ())):
            return None
        return self.table.get(t)

    def _sum(self, info: OpInfo, depth: int, summed: bool) -> _Stat | None:
        """``a + b (+ eps)``: every term >= 0 (so a zero sum is zero in every term), one of them a statistic."""
        alpha = (info.kwargs or {}).get("alpha", 1)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
            return None
        if any(not (math.isfinite(s) and s >= 0) for s in scalars((info.args or ())[1:])):
            return None  # adding a negative constant: a difference
        terms = [a for a in (info.args or ()) if isinstance(a, torch.Tensor)]
        if any(not _nonnegative(a) for a in terms):
            return None
        several = len(terms) > 1
        found = [self.of(p, depth + 1, summed or several) for p in info.parents]
        return _combine([f for f in found if f is not None], several)

    def _scaled(self, info: OpInfo, kind: str, depth: int, summed: bool) -> _Stat | None:
        """A statistic times or divided by a positive constant or count (``M2 / n``, ``var * count``, ``2 |z|``), or a
        product of non-negative statistics of one kind (``|z_i| |z_j|``, ``std_a * std_b``): zero only where one of
        them is, the same normalisation however its divisor is written."""
        args = info.args or ()
        if kind != "mul":
            if (info.kwargs or {}).get("rounding_mode") is not None or not args or not isinstance(args[0], torch.Tensor):
                return None  # floor division, or a constant divided by the value: not a scaling of it
            den = args[1] if len(args) > 1 else None
            if not (_positive(den) if isinstance(den, torch.Tensor) else
                    isinstance(den, (int, float)) and not isinstance(den, bool) and math.isfinite(den) and den > 0):
                return None
            below = self.of(_parent(info), depth + 1, summed)
            if below is None or (isinstance(den, torch.Tensor) and not _whole(den) and below.kind not in _VARIANCE_KINDS):
                return None  # a norm over a sum of norms: a share, not a statistic of the data
            return dataclasses.replace(below, combined=True, scaled=below.scaled or not below.combined)
        if any(not (math.isfinite(s) and s > 0) for s in scalars(args)):
            return None
        factors = [a for a in args if isinstance(a, torch.Tensor)]
        found: list[_Stat] = []
        for a, p in zip(factors, info.parents):
            f = self.of(p, depth + 1, summed)
            if f is not None and f.kind in _MEASURE_KINDS and _nonnegative(a):
                found.append(f)  # a statistic times a count, a constant or another statistic (n_c * var_c, |z_i| |z_j|)
            elif _positive(a):
                continue  # a scale (a count of a non-empty selection included)
            elif f is not None and f.kind == "count" and _nonnegative(a):
                found.append(f)  # a count that is 0 somewhere: the product's zero is the count's
            else:
                return None  # a factor that is 0 (or negative) somewhere and no statistic
        product = _combine(found, True)
        if product is None or product.kind not in _MEASURE_KINDS:
            return product
        return dataclasses.replace(product, scaled=all(f.scaled or not f.combined for f in found))


def _outer_product(info: OpInfo) -> bool:
    """A matrix product over an inner dimension of 1: every element is the product of one element of each side."""
    tensors = [a for a in (info.args or ()) if isinstance(a, torch.Tensor)]
    return len(tensors) == 2 and tensors[0].dim() >= 2 and tensors[0].shape[-1] == 1


def _combine(found: list[_Stat], combined: bool) -> _Stat | None:
    """The statistic several terms or factors share: ``None`` if there is none or they disagree
    (a count and a variance). The statistic's own op is preferred to a term of an accumulation."""
    if not found or len({_family(f.kind) for f in found}) > 1:
        return None
    best = next((f for f in found if short_op(f.info.op) in STAT_OPS | _NORM_STATS), found[0])
    return dataclasses.replace(best, combined=best.combined or combined, scaled=best.scaled and not combined)


def _nonnegative(t: torch.Tensor) -> bool:
    if t.dtype == torch.bool:
        return True
    return not t.is_complex() and not bool((t.detach() < 0).any())


def _positive(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool or not t.numel():
        return False
    x = t.detach()
    return bool(((x > 0) & torch.isfinite(x) if x.is_floating_point() else x > 0).all())


def _whole(t: torch.Tensor) -> bool:
    """Integer-valued (a count: a number of elements, of tokens, of steps), whatever its dtype."""
    if not t.is_floating_point():
        return True
    x = t.detach()
    return bool((x == torch.round(x)).all())


def _centred_square(info: OpInfo) -> bool:
    """``(x - m)^2`` where ``m`` is a mean-type value of the data (a reduction's output, or a statistic): a squared
    deviation. A squared difference of two data values (the distance between two points) is not one."""
    parent = _parent(info)
    if parent is None or short_op(parent.op) != "sub" or len(parent.parents) < 2:
        return False
    return _centring(parent)


_TO_DIFFERENCE = frozenset({"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "clone", "contiguous",
                            "alias", "_to_copy", "detach", "t", "transpose", "permute", "slice", "select", "expand_as",
                            "to", "view_as", "flatten", "abs", "square", "pow", "mul"})


def _difference_of(info: OpInfo | None) -> OpInfo | None:
    """The subtraction ``a - b`` of two values of the data (not a centring ``x - mean``) whose norm, or square, the
    statistic ``info`` is: through views, ``abs``, powers and an eps added (``|a - b + eps|``, ``pairwise_distance``)."""
    node = _parent(info) if info is not None else None
    for _ in range(8):
        if node is None:
            return None
        kind = short_op(node.op)
        if kind in {"sub", "rsub"}:
            tensors = [a for a in (node.args or ()) if isinstance(a, torch.Tensor)]
            if len(tensors) < 2 or len(node.parents) < 2 or _mean_type(node.parents[0]) or _centring(node):
                return None  # a shift by a constant, or a deviation of or from a mean (Chan's delta): not a distance
            return node
        if kind in _TO_DIFFERENCE and (kind != "mul" or _is_square(node)) or (
                kind == "add" and len([a for a in (node.args or ()) if isinstance(a, torch.Tensor)]) == 1):
            node = _parent(node)
            continue
        return None
    return None


def _is_distance(info: OpInfo) -> bool:
    """The statistic ``info`` (a norm, or a square summed) measures the gap between two values of the data: the norm
    of their difference, or a norm of two point sets (``cdist``)."""
    if short_op(info.op) in _NORM_STATS and len([a for a in (info.args or ()) if isinstance(a, torch.Tensor)]) >= 2:
        return True
    return _difference_of(info) is not None


def _centring(sub: OpInfo) -> bool:
    """The subtraction ``sub`` takes away a mean-type value of the data (a reduction's output, a statistic, a running
    buffer): ``x - mean`` is a deviation."""
    return _mean_type(sub.parents[1] if len(sub.parents) > 1 else None)


def _mean_type(centre: OpInfo | None) -> bool:
    """A value a replayed op made that is mean-like (a reduction's output, a statistic, a running buffer's update)."""
    if centre is None:
        return False
    kind = short_op(centre.op)
    while kind in PASS_THROUGH and _parent(centre) is not None:
        centre = _parent(centre)
        kind = short_op(centre.op)
    return kind in _REDUCTIONS or kind in STAT_OPS or kind in {"copy", "lerp", "add", "div", "mul"}


def _is_deviation_product(info: OpInfo) -> bool:
    """``(x - m1) * (x - m2)``: Welford's update of a sum of squared deviations (``delta * (x - mean)``,
    the mean before and after ``x``), or a squared deviation written as a product."""
    if short_op(info.op) != "mul" or len(info.parents) != 2 or any(p is None for p in info.parents):
        return False
    a, b = info.parents
    if short_op(a.op) != "sub" or short_op(b.op) != "sub":
        return False
    xa, xb = (a.args or (None,))[0], (b.args or (None,))[0]
    if not isinstance(xa, torch.Tensor) or not isinstance(xb, torch.Tensor):
        return False
    return xa is xb or (xa.shape == xb.shape and xa.dtype == xb.dtype and bool(torch.equal(xa, xb)))


def _zero_somewhere(info: OpInfo) -> bool:
    """The statistic's op, run again on what it received, is 0 (or undefined) somewhere."""
    if info.func is None or getattr(info.func, "_schema", None) is None or info.func._schema.is_mutable:
        return True
    try:
        with torch.no_grad():
            out = info.func(*(info.args or ()), **(info.kwargs or {}))
    except Exception:  # noqa: BLE001 - an op that cannot be re-run: keep the provenance's word
        return True
    first = next((o for o in tree_leaves(out) if isinstance(o, torch.Tensor)), None)
    if first is None or not first.is_floating_point():
        return True
    return bool(((first == 0) | torch.isnan(first)).any())


def _is_square(info: OpInfo) -> bool:
    kind = short_op(info.op)
    args = info.args or ()
    if kind == "pow" and len(args) > 1 and args[1] == 2:
        return True
    if kind == "square":
        return True
    return kind == "mul" and len(args) > 1 and args[0] is args[1]


def _is_count(info: OpInfo) -> bool:
    src = next((a for a in (info.args or ()) if isinstance(a, torch.Tensor)), None)
    if src is None:
        return False
    if src.dtype == torch.bool or not src.is_floating_point():
        return True
    x = src.detach()
    return bool(((x == 0) | (x == 1)).all())


def _constant_slices(info: OpInfo) -> int | None:
    """How many slices the statistic ran over were constant (or of one element)."""
    src = _first_tensor(info)
    if src is None or not src.is_floating_point():
        return None
    dims = next((a for a in (info.args or ())[1:] if isinstance(a, (list, tuple)) or isinstance(a, int)), None)
    x = src.detach().double()
    try:
        if dims is None:
            return int(bool((x == x.flatten()[0]).all()))
        dims = [dims] if isinstance(dims, int) else list(dims)
        spread = x.amax(dim=dims) - x.amin(dim=dims)
        return int((spread == 0).sum())
    except (RuntimeError, IndexError):
        return None


def _root_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
               operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    base = operands.get("arg0")
    if base is None:
        return None
    if short in {"pow", "float_power"}:
        exponent = args[1] if len(args) > 1 else None
        frac = (isinstance(exponent, float) and exponent != int(exponent)) or (
            isinstance(exponent, torch.Tensor) and "arg1" in operands and bool((operands["arg1"] != torch.round(operands["arg1"])).any()))
        negexp = (isinstance(exponent, (int, float)) and exponent < 0) or (
            "arg1" in operands and bool((operands["arg1"] < 0).any()))
        if frac and bool((base < 0).any()):
            n = ev.count(base, lambda v: v < 0)
            return "sqrt_negative", f"{n} negative base(s) raised to a fractional power, min {ev.fmt(float(base.min()))}", facts
        if negexp and bool((base == 0).any()):
            return "div_by_zero", f"{ev.count(base, lambda v: v == 0)} zero base(s) raised to a negative power", facts
        return None
    neg = ev.count(base, lambda v: v < 0)
    if neg:
        return "sqrt_negative", f"{neg} negative inputs, min {ev.fmt(float(base.min()))}", facts
    if short == "rsqrt" and ev.count(base, lambda v: v == 0):
        return "div_by_zero", f"{ev.count(base, lambda v: v == 0)} zeros in its input", facts
    return None


def _domain_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
                 operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    x = operands.get("arg0")
    lo, hi = DOMAIN_OPS[short]
    if x is None:
        return None
    outside = (x < lo) | (x > hi) if short in {"acos", "asin", "arccos", "arcsin", "acosh"} else (x <= lo) | (x >= hi)
    if not bool(outside.any()):
        return None
    facts.update(arg_min=float(x.min()), arg_max=float(x.max()))
    return ("domain_error", f"{int(outside.sum())} argument(s) outside [{ev.fmt(lo)}, {ev.fmt(hi)}], range "
            f"{ev.fmt(float(x.min()))}..{ev.fmt(float(x.max()))}", facts)


def _exp_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    if not rec.out_inf or rec.out_nan:
        return None
    if short in {"pow", "float_power"} and "arg0" in operands and bool((operands["arg0"] == 0).any()):
        return None  # 0 ** negative: a division by zero (the root rule)
    limit = torch.finfo(out.dtype).max
    x = operands.get("arg0")
    where = f"input max {ev.fmt(float(x.max()))}, " if x is not None and x.numel() else ""
    return "exp_overflow", f"{where}{str(out.dtype).removeprefix('torch.')} max {limit:.4g}", facts


def norm_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
               operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None:
        return None
    eps = next((a for a in reversed(scalars(args)) if isinstance(a, float)), None)
    groups = _norm_groups(short, args, x)
    if groups is None:
        return None
    g = groups.double()
    n = g.shape[-1]
    amax = float(g.abs().max()) if g.numel() else 0.0
    finfo = torch.finfo(torch.float32 if x.dtype in LOW_PRECISION else x.dtype)  # half types accumulate in float32
    facts.update(eps=eps, input_abs_max=amax, slice_size=n)
    if amax > math.sqrt(finfo.max) / max(n, 1) ** 0.5:
        return ("overflow", f"input values up to {ev.fmt(amax)}: their variance (~{ev.fmt(amax * amax)}) exceeds "
                f"{str(x.dtype).removeprefix('torch.')}'s max {finfo.max:.4g}; the input is not constant", facts)
    spread = g.amax(dim=-1) - g.amin(dim=-1) if n else torch.zeros(0)
    constant = int((spread == 0).sum()) if n > 1 else g.shape[0]
    facts["constant_slices"] = constant
    if constant and (eps is None or eps == 0 or eps < finfo.tiny):
        what = "one element each" if n <= 1 else "constant"
        return "zero_variance_norm", f"{constant} of {g.shape[0]} normalised slices {what}, eps={eps}", facts
    return None


def _norm_groups(short: str, args: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The normalised slices of ``x`` as rows of a 2-D tensor."""
    xd = x.detach()
    try:
        if short in {"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"}:
            shape = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [xd.shape[-1]]
            k = len(shape)
            return xd.reshape(-1, int(torch.tensor(xd.shape[-k:]).prod()) if k else 1)
        if short == "native_group_norm":
            groups = args[-2] if len(args) >= 2 and isinstance(args[-2], int) else 1
            return xd.reshape(xd.shape[0] * groups, -1)
        if "batch_norm" in short:
            training = next((a for a in args if isinstance(a, bool)), True)
            if not training:
                return None
            return xd.transpose(0, 1).reshape(xd.shape[1], -1)
    except (RuntimeError, IndexError):
        return None
    return None


def _stat_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
               operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    """std/var of too few elements: the correction makes its divisor 0 (or negative)."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None or not rec.out_nan:
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    correction = kwargs.get("correction", 1)
    correction = 1 if correction is None else correction
    dims = list(range(x.dim())) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    n = 1
    for d in dims:
        n *= x.shape[d]
    facts.update(elements=n, correction=correction)
    if n - correction <= 0:
        return ("zero_variance_norm", f"{short} over {n} element(s) with correction={correction}: the divisor n - "
                f"correction is {n - correction} (a batch or slice too small for an unbiased statistic)", facts)
    return None


def _nll_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return None
    target = args[1]
    weight = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
    ignore = args[4] if len(args) > 4 and isinstance(args[4], int) else -100
    n = int(target.numel())
    valid = target != ignore
    if n and not bool(valid.any()):
        return "label_out_of_range", f"all {n} targets equal ignore_index={ignore}", facts
    classes = args[0].shape[1] if args[0].dim() > 1 else args[0].shape[0]
    used = target[valid]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= classes):
        return "label_out_of_range", f"targets range {int(used.min())}..{int(used.max())} for {classes} classes", facts
    if weight is not None and used.numel():
        total = float(weight.double()[used.long()].sum())
        facts["target_weight_sum"] = total
        if total == 0:
            return ("div_by_zero", f"every label is valid, but the class weights of all {used.numel()} targets are 0: "
                    "the weighted mean divides by a total weight of 0", facts)
    return None


def _linalg_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
                 operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    return "domain_error", matrix_detail(args[0] if args else None, facts), facts


def matrix_detail(a: Any, facts: dict[str, Any]) -> str:
    """Why a decomposition of ``a`` fails: its smallest eigenvalue (symmetric) or its determinant."""
    detail = "a singular or non-positive-definite matrix"
    if a is not None and a.dim() >= 2 and a.shape[-1] == a.shape[-2]:
        try:
            ad = a.detach().double()
            if bool(torch.allclose(ad, ad.transpose(-1, -2))):
                low = float(torch.linalg.eigvalsh(ad).min())
                facts["min_eigenvalue"] = low
                detail = f"its smallest eigenvalue is {ev.fmt(low)}: the matrix is not positive definite"
            else:
                det = float(torch.linalg.det(ad).abs().min())
                facts["min_abs_det"] = det
                detail = f"|det| = {ev.fmt(det)}: the matrix is singular"
        except RuntimeError:
            pass
    return detail


def _ctc_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: RuleContext, facts: dict[str, Any]) -> Verdict | None:
    if not rec.out_inf:
        return None
    return ("domain_error", "an alignment that cannot exist: an input sequence shorter than its target (plus the blanks "
            "between repeated labels), so the likelihood is 0 and the loss infinite", facts)


Rule = Callable[..., "Verdict | None"]
FORWARD_RULES: tuple[tuple[set[str], Rule], ...] = (
    (NLL_OPS, _nll_rule),
    (LOG_OPS, _log_rule),
    (DIV_OPS, _div_rule),
    (ROOT_OPS, _root_rule),
    (set(DOMAIN_OPS), _domain_rule),
    (EXP_OPS, _exp_rule),
    (NORM_OPS, norm_rule),
    (STAT_OPS, _stat_rule),
    (LINALG_OPS, _linalg_rule),
    (CTC_OPS, _ctc_rule),
)
