"""Cause classification: from the origin op to one cause code, as a conclusion from evidence.

Each cause is a claim checked on the values that went bad (see :mod:`.evidence`): the
non-finite output elements of the origin op, the operands that produced them, the op
re-run in float64, the derivative in float64 for a backward origin, where a divisor came
from (provenance), and the run's own history (an overflow at the end of a divergence is a
divergence). Family rules make the precise claims (a log argument <= 0, a divisor equal to
0, a constant normalised slice); a generic rule covers any other op (finite inputs and a
non-finite output: re-run in float64 → out of the dtype's range, out of the op's domain, or
a low-precision overflow). ``unknown`` only when the evidence is missing, and the detail then
says which.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..localisation.attention import masked_rows
from ..localisation.origin import Origin
from ..localisation.tracer import OpInfo, OpRecord, dense_parts, tensor_stats
from . import evidence as ev
from .history import Trend, divergence
from .family_rules import (DIV_OPS, EXP_OPS, FORWARD_RULES, LOG_OPS, LOW_PRECISION, NORM_OPS, SOFTMAX_OPS, RuleContext,
                           Verdict, norm_rule)
from .patterns import short_op


@dataclasses.dataclass
class Classification:
    cause: str
    op: str | None
    module: str | None
    source: str | None
    phase: str | None
    detail: str
    dtype: str | None
    stats: list[dict[str, Any]]
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The values behind the verdict (counts, magnitudes, the float64 re-run), for the bundle and the report."""


def _tensor_args(args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args or ()):
        if isinstance(a, torch.Tensor):
            out.append((f"arg{i}", a))
        elif isinstance(a, (list, tuple)):
            out.extend((f"arg{i}[{j}]", t) for j, t in enumerate(a) if isinstance(t, torch.Tensor))
    for k, v in (kwargs or {}).items():
        if isinstance(v, torch.Tensor):
            out.append((k, v))
    return out


def _pointwise(func: Any) -> bool:
    return func is not None and torch.Tag.pointwise in getattr(func, "tags", ())


def classify(origin: Origin, *, observed_in: str, low_precision_finite: bool | None,
             param_modules: dict[str, str], ignored_targets: tuple[int, int] | None = None,
             made_by: Any = None, history: list[dict[str, Any]] | None = None,
             divergence_seen: dict[str, Any] | None = None) -> Classification:
    """The cause of the failure that ``origin`` describes.

    ``observed_in`` is ``"forward"`` (the loss/outputs were non-finite) or ``"backward"``
    (finite forward, non-finite gradients). ``low_precision_finite`` is the verdict of the
    float32 re-run (True: finite there). ``ignored_targets`` is ``(count, ignore_index)``
    when the replay saw an NLL loss whose targets were all ignored; ``made_by`` maps each
    tensor the replay made to its op (provenance); ``history`` is the flight recorder's
    recent steps (loss, gradient norm), used to recognise a divergence; ``divergence_seen`` is
    the live divergence detector's evidence when it had flagged the run before it broke.
    """
    if origin.external is not None:
        ext = origin.external.external or ""
        if ext.startswith("param:") or ext.startswith("buffer:"):
            kind, name = ext.split(":", 1)
            return Classification("nonfinite_param", None, param_modules.get(name), None, None,
                                  f"{name} holds {'NaN' if origin.external.nan else 'Inf'} values", None, [],
                                  {"buffer": name} if kind == "buffer" else {})
        if ext == "input":
            return Classification("nonfinite_input", None, None, None, "data",
                                  "a floating-point tensor of the batch holds "
                                  f"{'NaN' if origin.external.nan else 'Inf'} values", None, [])
    rec = origin.record
    assert rec is not None
    ctx = RuleContext(observed_in, low_precision_finite, ignored_targets, made_by, history or [])
    backward = rec.phase == "backward"
    fwd = rec.forward
    op = fwd.op if backward and fwd is not None else rec.op
    if backward and fwd is not None and fwd.args is not None:
        stats_src = _tensor_args(fwd.args, fwd.kwargs)
    else:
        stats_src = _tensor_args(rec.args, rec.kwargs)
    stats = [tensor_stats(t, name) for name, t in stats_src]
    out_dtype = rec.output.dtype if rec.output is not None else (stats_src[0][1].dtype if stats_src else None)
    dtype = str(out_dtype).removeprefix("torch.") if out_dtype is not None else None
    base = dict(op=op, module=rec.module, source=rec.source, phase="backward" if backward else "forward",
                dtype=dtype, stats=stats)

    if backward:
        cause, detail, facts = _backward_cause(rec, fwd, ctx)
    elif observed_in == "backward" and not _feeds_user_backward(origin):
        # A forward op made a non-finite value that never reached the loss (masked by where/
        # masked_fill); its derivative, 0 × non-finite, leaks it into the gradients. A softmax
        # over fully masked rows keeps its own cause wherever its NaN went (rows the loss ignores).
        cause, detail, facts = _forward_cause(rec, ctx)
        if cause != "masked_softmax_all" and _selected_away(rec):
            cause, detail, facts = "where_gradient_trap", _unselected_detail(rec), {}
        elif cause != "masked_softmax_all":  # a saturating op (tanh, sigmoid, clamp) took it in: the op's own cause
            facts["absorbed_by"] = rec.absorbed_by
    else:
        cause, detail, facts = _forward_cause(rec, ctx)
    cause, detail = _with_history(cause, detail, ctx.history, facts, divergence_seen, backward=backward)
    if (cause == "where_gradient_trap" or "absorbed_by" in facts) and backward and fwd is not None:
        # named by the forward op that made the non-finite value in the unselected branch
        base.update(phase="forward", module=fwd.module, source=fwd.source)
    return Classification(cause=cause, detail=detail, evidence=facts, **base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- forward


def _forward_cause(rec: OpRecord, ctx: RuleContext) -> Verdict:
    short = short_op(rec.op)
    args, kwargs = rec.args or (), rec.kwargs or {}
    out = rec.output
    facts: dict[str, Any] = {}
    if out is None:
        return "unknown", "the origin op's output was not kept, so its values could not be examined", facts
    dtype = out.dtype
    mask = ev.bad_mask(out)
    facts.update(bad=int(mask.sum()), of=out.numel(), nan=int(torch.isnan(out).sum()), inf=int(torch.isinf(out).sum()))
    masked = _fully_masked_attention(rec, args, kwargs, mask, facts)
    if masked is not None:
        return masked

    if not rec.creates_nonfinite or (rec.scalar_nonfinite and rec.out_nan):  # an intentional infinity (a mask) met
        return _with_infinite_operands(rec, short, args, kwargs, out, mask, facts)

    operands = ev.operands_at(args, kwargs, out.shape, mask) if _pointwise(rec.func) else {}
    ref = ev.recompute(rec.func, args, kwargs)
    ref_bad = ref.at(mask)
    if ref_bad is not None:
        facts["float64_finite"] = bool(torch.isfinite(ref_bad).all())
    elif ref.error:
        facts["float64_error"] = ref.error

    if short in NORM_OPS:  # a variance beyond float32 is an overflow whatever the dtype; the op's float64 re-run hides it
        verdict = norm_rule(rec, short, args, kwargs, out, mask, operands, ref_bad, ctx, facts)
        if verdict is not None and verdict[0] == "overflow":
            return verdict
    if dtype in LOW_PRECISION and _fits_float32(ref_bad, ctx.low_precision_finite):
        if ref_bad is not None and not bool(torch.isfinite(ref_bad).all()):
            facts["rounded_upstream"] = True  # the op's own inputs fail in float64 too: nothing overflowed here
            bits = {torch.float16: 11, torch.bfloat16: 8}.get(dtype)
            return "precision_overflow", f"its inputs already carry the rounding: {str(dtype).removeprefix('torch.')} " \
                f"keeps {bits} significant bits", facts
        return "precision_overflow", f"{str(dtype).removeprefix('torch.')} max is {torch.finfo(dtype).max:g}", facts
    if ctx.low_precision_finite:  # the op ran in float32 on values rounded upstream (an upcast after a bf16 sigmoid)
        facts["rounded_upstream"] = True
        return "precision_overflow", (f"it ran in {str(dtype).removeprefix('torch.')} on values already rounded in "
                                      "float16/bfloat16 upstream; the whole step in float32 is finite"), facts

    for family, rule in FORWARD_RULES:
        if short in family:
            verdict = rule(rec, short, args, kwargs, out, mask, operands, ref_bad, ctx, facts)
            if verdict is not None:
                return verdict
    return _generic(rec, short, args, kwargs, out, mask, operands, ref_bad, ref, facts)


def _fits_float32(ref_bad: torch.Tensor | None, float32_rerun_finite: bool | None) -> bool:
    """A low-precision failure is a precision overflow only if float32 would have held the values:
    the float32 re-run of the step was finite, or (without one) the float64 values at the bad elements
    fit float32. The re-run decides when there is one: it also sees a rounding upstream of the op (a
    bfloat16 sigmoid rounded to exactly 1 makes ``log(1 - p)`` = log 0 at the op's own inputs).
    (bfloat16 shares float32's range: a bfloat16 result beyond it is a genuine overflow.)"""
    if float32_rerun_finite is not None:
        return float32_rerun_finite
    if ref_bad is None:
        return False
    return bool(torch.isfinite(ref_bad).all()) and float(ref_bad.abs().max(), ) <= torch.finfo(torch.float32).max \
        if ref_bad.numel() else bool(float32_rerun_finite)


def _fully_masked_rows(short: str, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """For a softmax-family op (softmax, log_softmax, logsumexp): how many of the rows it reduces are all
    ``-inf`` (0 for any other op). ``logsumexp`` takes a list of dimensions; the softmaxes one."""
    if short not in SOFTMAX_OPS or not args or not isinstance(args[0], torch.Tensor) or not args[0].numel():
        return 0
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    dims = [dim] if isinstance(dim, int) else [d for d in (dim or ()) if isinstance(d, int)]
    if not dims or x.dim() == 0:
        return int(bool(torch.isneginf(x).all()))
    return int(torch.isneginf(x).all(dim=tuple(dims)).sum())


def _with_infinite_operands(rec: OpRecord, short: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                            out: torch.Tensor, mask: torch.Tensor, facts: dict[str, Any]) -> Verdict:
    if short in SOFTMAX_OPS and args and isinstance(args[0], torch.Tensor):
        x = args[0]
        rows = _fully_masked_rows(short, args, kwargs)
        facts["fully_masked_rows"] = rows
        if rows:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            dims = [dim] if isinstance(dim, int) else list(dim or ())
            size = math.prod(x.shape[d] for d in dims) if x.dim() and dims else x.numel()
            return "masked_softmax_all", f"{rows} row(s) of {size} entries all -inf", facts
    if short in {"sub", "add", "rsub"}:
        rows = _normaliser_of_masked_rows(rec, args, out.shape, mask & torch.isnan(out))
        if rows:
            facts["fully_masked_rows"] = rows
            return "masked_softmax_all", (f"a log-softmax written out (x - logsumexp(x)) over {rows} row(s) whose "
                                          "entries are all -inf: -inf - (-inf) = NaN"), facts
    if short in DIV_OPS or short in {"sub", "add", "mul", "rsub", "addcmul", "addcdiv", "sum", "mean", "mm", "bmm",
                                     "addmm", "matmul", "baddbmm", "dot", "where", "lerp", "neg", "_softmax",
                                     "_log_softmax", "logsumexp"} or rec.scalar_nonfinite:
        return "inf_arithmetic", _inf_detail(short), facts
    return "inf_arithmetic", f"{short} received infinite operands and produced NaN", facts


_ROW_NORMALISERS = {"logsumexp"}
"""The reduction a hand-written log-softmax subtracts (``x - x.logsumexp(-1, keepdim=True)``, torch.distributions'
``Categorical``): -inf over a row that is entirely -inf. A shift by the row's maximum (``x - x.amax(-1)`` before an
``exp``) stays ``inf_arithmetic``, as the cause matrix and its oracle decide (``tests/cause_matrix.py``
``inf_minus_inf``): the shift is arithmetic on the mask, not yet a normalisation."""
_CARRY = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "clone", "detach", "alias", "_to_copy",
          "contiguous", "neg", "_reshape_alias", "lift_fresh", "flatten"}
"""Ops between such a reduction and the sub/add that reads it which keep its values row for row (a ``neg`` for
``x + (-lse)``)."""


def _normaliser_of_masked_rows(rec: OpRecord, args: tuple[Any, ...], shape: torch.Size, mask: torch.Tensor) -> int:
    """A ``sub``/``add`` whose NaN is ``-inf - (-inf)`` of a log-softmax written out: an operand was computed (through
    views, or a ``neg``) by a logsumexp/amax/max over rows that are entirely -inf, and every bad element of the
    output lies on such a row (``mask``: its NaN elements; a ``-inf`` on a partly masked row is a valid log-probability
    of 0). The number of those rows (0 otherwise). Evidence from provenance: the reduction's own input, read where
    it ran."""
    fwd = rec.forward
    if fwd is None or not mask.any():
        return 0
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for operand, maker in zip(tensors, fwd.parents):
        info = maker
        for _ in range(16):
            if info is None or short_op(info.op) not in _CARRY:
                break
            info = info.parents[0] if info.parents else None
        if info is None or short_op(info.op) not in _ROW_NORMALISERS:
            continue
        flags = _masked_row_flags(info)
        if flags is None or flags.numel() != operand.numel():
            continue
        try:
            at = torch.broadcast_to(flags.reshape(operand.shape), shape)[mask]
        except RuntimeError:
            continue
        if at.numel() and bool(at.all()):
            return int(flags.sum())
    return 0


def _masked_row_flags(info: OpInfo) -> torch.Tensor | None:
    """For a row reduction (logsumexp, amax, max along a dimension), whether each row it reduced was entirely
    -inf, in the reduction's output layout (without its reduced dimensions)."""
    args, kwargs = info.args or (), info.kwargs or {}
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None or not x.is_floating_point() or not x.numel():
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim", None)
    dims = [dim] if isinstance(dim, int) and not isinstance(dim, bool) else \
        [d for d in (dim or ()) if isinstance(d, int)] if isinstance(dim, (list, tuple)) else []
    neginf = torch.isneginf(x.detach())
    if not dims or x.dim() == 0:
        return neginf.all().reshape(())
    return neginf.all(dim=tuple(d % x.dim() for d in dims))


def _fully_masked_attention(rec: OpRecord, args: tuple[Any, ...], kwargs: dict[str, Any], mask: torch.Tensor,
                            facts: dict[str, Any]) -> Verdict | None:
    """A fused attention op (the fast paths of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``,
    ``_masked_softmax``, the ``scaled_dot_product_attention`` kernels) whose bad elements all lie in query rows
    that its mask operand leaves without any key: the softmax inside it ran over a fully masked row, as the slow
    path's ``_softmax`` visibly does. The mask may be boolean, so this holds whether or not an infinity reached
    the op."""
    rows = masked_rows(rec.func, args, kwargs, mask)
    if rows is None or not rows[0] or rows[1] != rows[0]:
        return None
    facts["fully_masked_rows"] = rows[1]
    return "masked_softmax_all", f"{rows[1]} query row(s) whose attention mask hides every key", facts


def _inf_detail(short: str) -> str:
    return {"sub": "inf - inf", "add": "inf + (-inf)", "mul": "0 × inf", "div": "inf / inf"}.get(short, "arithmetic on inf")


def _generic(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
             operands: dict[str, torch.Tensor], ref_bad: torch.Tensor | None, ref: ev.Recompute,
             facts: dict[str, Any]) -> Verdict:
    """Any op: finite inputs, a non-finite output, judged by the float64 re-run."""
    dtype = out.dtype
    name = str(dtype).removeprefix("torch.")
    if ref_bad is None:
        why = f"re-running {short} in float64 failed ({ref.error})" if ref.error else f"{short}'s float64 re-run has another shape"
        return "unknown", f"finite inputs gave non-finite output, but {why}", facts
    finfo = torch.finfo(dtype)
    finite = torch.isfinite(ref_bad)
    if bool(finite.all()):
        big = float(ref_bad.abs().max()) if ref_bad.numel() else 0.0
        facts["float64_abs_max"] = big
        if dtype in LOW_PRECISION and big <= torch.finfo(torch.float32).max:
            return "precision_overflow", f"{name} max is {finfo.max:g}", facts
        if short in EXP_OPS:
            return "exp_overflow", f"the result reaches {ev.fmt(big)} in float64, beyond {name}'s max {finfo.max:.4g}", facts
        if big > finfo.max:
            return "overflow", f"the result reaches {ev.fmt(big)} in float64, beyond {name}'s max {finfo.max:.4g}", facts
        return ("overflow", f"the result is finite in float64 (up to {ev.fmt(big)}) but an intermediate value inside "
                f"{short} overflowed {name}", facts)
    if bool(torch.isnan(ref_bad).any()):
        facts["float64_nan"] = int(torch.isnan(ref_bad).sum())
        zero = _zero_divisor(rec, args, kwargs, out.shape, mask)
        if zero is not None:
            facts["zero_operand"] = zero[0]
            return ("div_by_zero", f"NaN in float64 too, and finite once the {zero[1]} zero(s) of {zero[0]} are moved "
                    f"off 0: {short} divides by a quantity that is 0 there (0/0, e.g. the norm of an "
                    "all-zero vector)", facts)
        empty = _empty_average(short, args, kwargs)
        if empty is not None:
            facts["averaged_elements"] = empty
            return ("div_by_zero", f"NaN in float64 too: {short} averages over {empty} element(s) "
                    f"({'none' if empty == 0 else 'fewer than its correction needs'}), a 0/0", facts)
        summary = _operand_summary(operands)
        return "domain_error", f"NaN in float64 too: an argument outside {short}'s domain{summary}", facts
    zeros = sum(ev.count(v, lambda x: x == 0) for v in operands.values())
    if zeros:
        return "div_by_zero", f"infinite in float64 too, at {zeros} zero operand(s): a pole at 0", facts
    big = max((float(v.abs().max()) for v in operands.values() if v.numel()), default=0.0)
    if short in EXP_OPS:
        return "exp_overflow", f"the result overflows even float64 ({name} max {finfo.max:.4g})", facts
    if big > 1e30 or not operands:
        return "overflow", f"the result overflows even float64{f' (operands up to {ev.fmt(big)})' if big else ''}", facts
    return "domain_error", f"infinite in float64 too: a pole of {short}{_operand_summary(operands)}", facts


_AVERAGES = frozenset({"mean", "nanmean", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
                       "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss"})
"""Reductions that divide by how many elements they average (the loss functions' ``"mean"`` reduction)."""
_SPREADS = frozenset({"var", "std", "var_mean", "std_mean"})
"""Reductions that divide by the count less their correction (Bessel's: n - 1)."""


def _empty_average(short: str, args: Any, kwargs: Any) -> int | None:
    """How many elements a mean-type reduction averaged, when that leaves it nothing to divide by: 0 for a
    mean (or a mean-reduced loss) of an empty selection, the count for a variance whose count does not
    exceed its correction (a single element, n - 1 = 0); ``None`` otherwise. Judged over the whole input:
    an empty mask's mean, a batch with no valid element (docs/diagnosis.md: an empty mean is a division
    by a zero count)."""
    name = short.split(".")[0].lstrip("_")
    if name not in _AVERAGES and name not in _SPREADS:
        return None
    first = next((a for a in (args or ()) if isinstance(a, torch.Tensor)), None)
    if first is None:
        return None
    if name in _AVERAGES:
        reduction = (kwargs or {}).get("reduction", 1)
        if name not in ("mean", "nanmean") and reduction not in (1, "mean"):
            return None  # 'sum' / 'none': nothing divided
        count = int(first.numel()) if name != "nanmean" else int((~torch.isnan(first.detach())).sum())
        dims = _reduced_dims(args, kwargs) if name in ("mean", "nanmean") else None
        if dims is not None and first.dim():  # averaged along some dimensions: the smallest count per output
            count = 1
            for d in dims:
                count *= int(first.shape[d])
        return 0 if count == 0 else None
    correction = (kwargs or {}).get("correction", 1)
    correction = 1 if correction is None else float(correction)
    dims = _reduced_dims(args, kwargs)
    count = int(first.numel()) if not dims or not first.dim() else 1
    if dims and first.dim():
        for d in dims:
            count *= int(first.shape[d])
    return count if count - correction <= 0 else None


def _reduced_dims(args: Any, kwargs: Any) -> list[int] | None:
    """The dimensions a reduction's call reduces (``dim`` positional or keyword), ``None`` for all."""
    dim = (kwargs or {}).get("dim", args[1] if len(args or ()) > 1 and isinstance(args[1], (int, list, tuple)) else None)
    if dim is None:
        return None
    return [dim] if isinstance(dim, int) else list(dim)


_NUDGE = 1e-30
"""Where a zero operand is moved to, in float64, to test for a 0/0: far from float64's smallest normal
even squared, so a norm or a product of two such values stays exact and non-zero."""


def _zero_divisor(rec: OpRecord, args: Any, kwargs: Any, shape: torch.Size,
                  mask: torch.Tensor) -> tuple[str, int] | None:
    """(operand, zeros) when the op's NaN is a division by a quantity that is 0 at the bad elements:
    a floating operand is 0 at every bad element it reaches (positionally, when it broadcasts to the
    output; else anywhere), and the float64 re-run is finite at those elements once its zeros are moved
    to a tiny non-zero value. A fused op that divides by a norm (``_weight_norm_interface`` on a
    pruned, all-zero row) thus reads as a division by zero; a real domain error (acos of 1.5, a
    probability outside [0, 1]) stays NaN when the zeros move, and stays ``domain_error``."""
    named = [(f"arg{i}", a) for i, a in enumerate(args or ())] + list((kwargs or {}).items())
    for index, (name, value) in enumerate(named):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.numel():
            continue
        x = value.detach().to(torch.float64)
        try:
            at_bad = torch.broadcast_to(x, shape)[mask]
            zeros = ev.count(at_bad, lambda v: v == 0)
            if zeros != at_bad.numel():
                continue
        except RuntimeError:  # not positional (a reduction's input, a sparse operand): its (stored) zeros anywhere
            zeros = sum(ev.count(part, lambda v: v == 0) for part in dense_parts(x))
        if not zeros:
            continue
        nudged = _nudged(x)
        if nudged is None:
            continue
        if index < len(args or ()):
            new_args, new_kwargs = tuple(nudged if i == index else a for i, a in enumerate(args)), kwargs
        else:
            new_args, new_kwargs = args, {**kwargs, name: nudged}
        moved = ev.recompute(rec.func, new_args, new_kwargs).at(mask)
        if moved is not None and moved.numel() and bool(torch.isfinite(moved).all()):
            return name, zeros
    return None


def _operand_summary(operands: dict[str, torch.Tensor]) -> str:
    parts = []
    for name, v in operands.items():
        if v.numel() and v.is_floating_point():
            parts.append(f"{name} {ev.fmt(float(v.min()))}..{ev.fmt(float(v.max()))}")
    return f" ({'; '.join(parts)} at the bad elements)" if parts else ""


def _unselected_detail(rec: OpRecord) -> str:
    x = next((a for a in (rec.args or ()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if x is None or rec.output is None:
        return "non-finite values in the branch that was not selected"
    mask = ev.bad_mask(rec.output)
    try:
        vals = torch.broadcast_to(x.detach(), rec.output.shape)[mask].double()
    except RuntimeError:
        vals = x.detach().double().flatten()
    return f"{ev.count(vals, lambda v: v < 0)} negative and {ev.count(vals, lambda v: v == 0)} zero inputs in the unselected branch"


# ------------------------------------------------------------------------------ backward
def _feeds_user_backward(origin: Origin) -> bool:
    """Whether the forward value at the origin went bad and was then used by the user's own
    backward code (a custom Function's backward, a hook) rather than by a built-in derivative:
    no unselected branch is involved, the forward op broke."""
    chain = origin.chain
    after = chain[chain.index(origin.record) + 1:] if origin.record in chain else []
    consumer = next((r for r in after if r.phase == "backward"), None)
    return consumer is not None and consumer.user_code


def _own_op_cause(rec: OpRecord, ctx: RuleContext) -> Verdict:
    """A backward op that derives no forward op (the user's custom backward or hook, or a node
    no traced forward op made), judged as the op itself by the forward rules. A value beyond
    the dtype's range there is a gradient that overflowed."""
    if rec.output is None:  # kept only when the op made its non-finite values itself
        return "unknown", f"{short_op(rec.op)} received non-finite values from outside the replayed ops", {}
    cause, detail, facts = _forward_cause(rec, ctx)
    if cause == "overflow":
        return "gradient_explosion", f"the gradient overflowed in {short_op(rec.op)}: {detail}", facts
    return cause, detail, facts


_SELECTIONS = frozenset({"where", "masked_fill", "masked_scatter", "masked_select", "index", "index_select", "gather",
                         "take", "take_along_dim", "index_put", "scatter", "nan_to_num", "copy", "fill", "logsumexp"})
"""Ops that drop or overwrite values (their non-finite inputs' derivative, 0 × inf, is the where trap), a
``logsumexp`` included: a ``-inf`` term contributes exp(-inf) = 0 to it, the mask of log space. A saturating
op that takes an infinity to a finite value (tanh, sigmoid, a clamp, the reciprocal of ``1 + inf``) is not one."""


def _selected_away(rec: OpRecord) -> bool:
    """Whether a selection (:data:`_SELECTIONS`) is what took ``rec``'s non-finite output out of the
    forward: only then is its derivative's 0 x inf the where trap. Anything else that absorbed it (a
    reciprocal of ``1 + inf``, a tanh, a clamp), or nothing the replay saw, leaves the op's own cause:
    the value was born non-finite there, and no selection is in evidence."""
    return rec.absorbed_by is not None and rec.absorbed_by.rstrip("_") in _SELECTIONS


def _backward_cause(rec: OpRecord, fwd: OpInfo | None, ctx: RuleContext) -> Verdict:
    facts: dict[str, Any] = {}
    if fwd is None:
        return _own_op_cause(rec, ctx)
    short = short_op(fwd.op)
    if fwd.record is not None:
        absorber = fwd.record.absorbed_by
        if _selected_away(fwd.record):
            return "where_gradient_trap", "the forward value was non-finite in the branch that was not selected", facts
        if fwd.record.creates_nonfinite or fwd.record.output is not None:
            # a saturating op (tanh, sigmoid, a clamp) took the forward's non-finite value to a finite one: the
            # value was born in the forward, by the forward op's own cause
            cause, detail, facts = _forward_cause(fwd.record, ctx)
            facts["absorbed_by"] = absorber
            took = f"{absorber} took it to a finite value" if absorber is not None else "it never reached the loss"
            return cause, f"{detail}; {took}, its derivative then met it in the backward", facts
        # else the forward op only passed on a non-finite value it received (a -inf of a mask or of a dynamic
        # program's unreachable states): no value was born there, the NaN is its derivative's, judged at its inputs
    masked = _fully_masked_rows(short, fwd.args or (), fwd.kwargs or {})
    if masked:
        facts["fully_masked_rows"] = masked
        return "masked_softmax_all", (f"{masked} row(s) whose entries are all -inf: the derivative exp(x - lse) is "
                                      "exp(-inf - (-inf)) = NaN there"), facts
    out_dtype = rec.output.dtype if rec.output is not None else None
    if ctx.low_precision_finite:  # the float32 re-run decides: it also sees a rounding upstream of the op
        if out_dtype in LOW_PRECISION:
            return "precision_overflow", f"its gradient overflowed {str(out_dtype).removeprefix('torch.')}", facts
        facts["rounded_upstream"] = True
        return "precision_overflow", (f"the derivative of {short} is non-finite at inputs rounded in float16/bfloat16 "
                                      "upstream; the whole step in float32 is finite"), facts
    d = ev.derivative(fwd.func, fwd.args or (), fwd.kwargs or {})
    if d.error:
        facts["derivative_error"] = d.error
    singular = d.nonfinite
    if singular:
        name, xs, _ = singular[0]
        facts.update(singular_points=int(xs.numel()), argument=name)
        return "grad_singularity", _singular_detail(short, xs), facts
    if short in EXP_OPS:
        return "exp_overflow", "its derivative overflowed", facts
    if short in DIV_OPS:
        return "div_by_zero", "its derivative divides by a (near-)zero denominator squared", facts
    if short in LOG_OPS and d.error:
        return "log_nonpositive", "its derivative 1/x is infinite at 0", facts
    if rec.creates_nonfinite and rec.output is not None:
        # finite operands: an overflow only if the derivative's own op says so (0/0 or x/0 is none)
        cause, detail, own = _own_op_cause(rec, ctx)
        if cause not in _SYMPTOMS and cause != "unknown":
            return cause, f"in the derivative of {short}, {short_op(rec.op)}: {detail}", {**facts, **own}
    dtype = str(out_dtype).removeprefix("torch.") if out_dtype is not None else "its dtype"
    incoming = _incoming_max(rec)
    if incoming is not None:
        facts["incoming_grad_abs_max"] = incoming
    return ("gradient_explosion", f"the derivative of {short} is finite in float64 at its inputs; the gradient through "
            f"it overflowed {dtype}" + (f" (incoming gradient up to {ev.fmt(incoming)})" if incoming else ""), facts)


def _nudged(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` with its zeros moved to :data:`_NUDGE` (of a sparse COO tensor: its stored zeros; ``None`` for
    another layout)."""
    if x.layout == torch.strided:
        return torch.where(x == 0, torch.full_like(x, _NUDGE), x)
    if x.layout != torch.sparse_coo:
        return None
    c = x.coalesce()
    values = c.values()
    return torch.sparse_coo_tensor(c.indices(), torch.where(values == 0, torch.full_like(values, _NUDGE), values),
                                   c.shape, is_coalesced=True)


def _incoming_max(rec: OpRecord) -> float | None:
    """The largest |value| of the finite floating arguments of a backward op (of a sparse one: its stored values)."""
    vals = []
    for a in rec.args or ():
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel():
            parts = [part for part in dense_parts(a.detach()) if part.numel()]
            if parts and all(bool(torch.isfinite(part).all()) for part in parts):
                vals.append(max(float(part.abs().max()) for part in parts))
    return max(vals) if vals else None


def _singular_detail(short: str, xs: torch.Tensor) -> str:
    if not xs.numel():
        return "its derivative is infinite at these inputs"
    zeros = ev.count(xs, lambda v: v == 0)
    ones = ev.count(xs, lambda v: v.abs() == 1)
    if short in {"acos", "asin"} and ones:
        return f"{ones} input(s) at ±1"
    if zeros:
        return f"{zeros} zero inputs"
    return f"input range {ev.fmt(float(xs.min()))}..{ev.fmt(float(xs.max()))}"


# ------------------------------------------------------------------------------- history
def _detected(seen: dict[str, Any] | None) -> Trend | None:
    """The live divergence detector's evidence as a trend (it judged growth rate and fit step by step)."""
    if not seen or "since_step" not in seen or "start_value" not in seen:
        return None
    end = seen.get("last_value", seen.get("value"))
    try:
        series = str(seen.get("series", "loss"))
        steps = int(seen["steps"]) if "steps" in seen else None
        start_step = int(seen["since_step"])
        return Trend(series, start_step, start_step + steps if steps is not None else start_step,
                     float(seen["start_value"]), float(end))
    except (TypeError, ValueError):
        return None


_SYMPTOMS = {"overflow", "exp_overflow", "precision_overflow", "gradient_explosion"}


def _with_history(cause: str, detail: str, history: list[dict[str, Any]], facts: dict[str, Any],
                  seen: dict[str, Any] | None = None, *, backward: bool = False) -> tuple[str, str]:
    """An overflow at the end of a divergence: the summary says what made the values huge, with the growth
    (API.md's ``overflow``: a symptom, the diagnosis says what made the values huge); the cause stays the op's
    (``overflow``, ``exp_overflow``, ``precision_overflow``: ``loss_divergence`` is a finite anomaly's), except
    an overflow in the backward at the end of gradients growing step after step, which is the
    ``gradient_explosion`` itself (gradients grew to inf through a long chain)."""
    if cause not in _SYMPTOMS:
        return cause, detail
    trend = _detected(seen) or (divergence(history) if history else None)
    if trend is None:
        return cause, detail
    facts["divergence"] = trend.to_dict()
    where = f"then {detail}" if detail else "then the values overflowed"
    if backward and trend.cause == "gradient_explosion":
        cause = "gradient_explosion"
    return cause, f"{trend.describe()}; {where}"
