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
from collections.abc import Callable
from typing import Any

import torch

from ..localisation.origin import Origin
from ..localisation.tracer import OpInfo, OpRecord, tensor_stats
from . import evidence as ev
from .history import Trend, divergence
from .patterns import short_op

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


@dataclasses.dataclass
class _Context:
    observed_in: str
    low_precision_finite: bool | None
    ignored_targets: tuple[int, int] | None
    made_by: Any
    history: list[dict[str, Any]]


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


def _scalars(args: tuple[Any, ...] | None) -> list[Any]:
    return [a for a in (args or ()) if isinstance(a, (int, float)) and not isinstance(a, bool)]


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
            name = ext.split(":", 1)[1]
            return Classification("nonfinite_param", None, param_modules.get(name), None, None,
                                  f"{name} holds {'NaN' if origin.external.nan else 'Inf'} values", None, [])
        if ext == "input":
            return Classification("nonfinite_input", None, None, None, "data",
                                  "a floating-point tensor of the batch holds "
                                  f"{'NaN' if origin.external.nan else 'Inf'} values", None, [])
    rec = origin.record
    assert rec is not None
    ctx = _Context(observed_in, low_precision_finite, ignored_targets, made_by, history or [])
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
    elif observed_in == "backward":
        # A forward op made a non-finite value that never reached the loss (masked by where/
        # masked_fill); its derivative, 0 × non-finite, leaks it into the gradients.
        cause, detail, facts = "where_gradient_trap", _unselected_detail(rec), {}
    else:
        cause, detail, facts = _forward_cause(rec, ctx)
    cause, detail = _with_history(cause, detail, ctx.history, facts, divergence_seen)
    if cause == "where_gradient_trap" and backward and fwd is not None:
        # named by the forward op that made the non-finite value in the unselected branch
        base.update(phase="forward", module=fwd.module, source=fwd.source)
    return Classification(cause=cause, detail=detail, evidence=facts, **base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- forward
Verdict = tuple[str, str, dict[str, Any]]


def _forward_cause(rec: OpRecord, ctx: _Context) -> Verdict:
    short = short_op(rec.op)
    args, kwargs = rec.args or (), rec.kwargs or {}
    out = rec.output
    facts: dict[str, Any] = {}
    if out is None:
        return "unknown", "the origin op's output was not kept, so its values could not be examined", facts
    dtype = out.dtype
    mask = ev.bad_mask(out)
    facts.update(bad=int(mask.sum()), of=out.numel(), nan=int(torch.isnan(out).sum()), inf=int(torch.isinf(out).sum()))

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
        verdict = _norm_rule(rec, short, args, kwargs, out, mask, operands, ref_bad, ctx, facts)
        if verdict is not None and verdict[0] == "overflow":
            return verdict
    if dtype in LOW_PRECISION and _fits_float32(ref_bad, ctx.low_precision_finite):
        return "precision_overflow", f"{str(dtype).removeprefix('torch.')} max is {torch.finfo(dtype).max:g}", facts

    for family, rule in _FORWARD_RULES:
        if short in family:
            verdict = rule(rec, short, args, kwargs, out, mask, operands, ref_bad, ctx, facts)
            if verdict is not None:
                return verdict
    return _generic(rec, short, args, kwargs, out, mask, operands, ref_bad, ref, facts)


def _fits_float32(ref_bad: torch.Tensor | None, float32_rerun_finite: bool | None) -> bool:
    """A low-precision failure is a precision overflow only if float32 would have held the values:
    the float32 re-run of the step was finite, or the float64 values at the bad elements fit float32.
    (bfloat16 shares float32's range: a bfloat16 result beyond it is a genuine overflow.)"""
    if float32_rerun_finite is False:
        return False
    if ref_bad is None:
        return bool(float32_rerun_finite)
    return bool(torch.isfinite(ref_bad).all()) and float(ref_bad.abs().max(), ) <= torch.finfo(torch.float32).max \
        if ref_bad.numel() else bool(float32_rerun_finite)


def _with_infinite_operands(rec: OpRecord, short: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                            out: torch.Tensor, mask: torch.Tensor, facts: dict[str, Any]) -> Verdict:
    if short in SOFTMAX_OPS and args and isinstance(args[0], torch.Tensor):
        x = args[0]
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        rows = int(torch.isneginf(x).all(dim=dim).sum())
        facts["fully_masked_rows"] = rows
        if rows:
            return "masked_softmax_all", f"{rows} row(s) of {x.shape[dim]} entries all -inf", facts
    if short in DIV_OPS or short in {"sub", "add", "mul", "rsub", "addcmul", "addcdiv", "sum", "mean", "mm", "bmm",
                                     "addmm", "matmul", "baddbmm", "dot", "where", "lerp", "neg", "_softmax",
                                     "_log_softmax", "logsumexp"} or rec.scalar_nonfinite:
        return "inf_arithmetic", _inf_detail(short), facts
    return "inf_arithmetic", f"{short} received infinite operands and produced NaN", facts


def _inf_detail(short: str) -> str:
    return {"sub": "inf - inf", "add": "inf + (-inf)", "mul": "0 × inf", "div": "inf / inf"}.get(short, "arithmetic on inf")


def _arg_of(short: str, operands: dict[str, torch.Tensor]) -> torch.Tensor | None:
    key = "arg1" if short in {"xlogy", "polygamma", "special_xlog1py"} else "arg0"
    return operands.get(key)


def _producer(ctx: _Context, t: Any, hops: int = 4) -> OpInfo | None:
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
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
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
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
    raw, d = _divisor(short, args, operands)
    if isinstance(raw, (int, float)):
        return ("div_by_zero", "divided by the scalar 0", facts) if raw == 0 else None
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
    both = num is not None and bool(((num == 0) & (d == 0)).any())
    if both and ctx.ignored_targets is not None:
        n, ignore = ctx.ignored_targets
        return "label_out_of_range", f"all {n} labels equal ignore_index={ignore}, so the count divided by is 0", facts
    prod = _producer(ctx, raw)
    kind = short_op(prod.op) if prod is not None else None
    stat = _statistic(ctx, raw)
    if stat is not None and stat[0] in {"std", "var", "norm", "rms"}:
        slices = _constant_slices(stat[1])
        if slices is not None:
            facts["constant_slices"] = slices
        label = {"std": "standard deviation", "var": "variance", "norm": "norm", "rms": "root mean square"}[stat[0]]
        return ("zero_variance_norm",
                f"the divisor is a {label} ({short_op(stat[1].op)}) that is 0 on {zeros} element(s): the slice it was "
                "computed over is constant (or has one element), and no eps was added", facts)
    if stat is not None and stat[0] == "count":
        return "div_by_zero", f"the divisor is a count ({short_op(stat[1].op)} of a mask) that is 0: a mean over no element", facts
    what = f", made by {kind.lstrip('_')}" if kind else ""
    zero_over_zero = " (0/0)" if both else ""
    return "div_by_zero", f"{zeros} zeros in the denominator{zero_over_zero}{what}", facts


def _first_tensor(info: OpInfo) -> torch.Tensor | None:
    return next((a for a in (info.args or ()) if isinstance(a, torch.Tensor)), None)


def _statistic(ctx: _Context, t: Any) -> tuple[str, OpInfo] | None:
    """What kind of statistic computed the divisor ``t``: a std/variance/norm/root mean square
    (a normalisation), a count of a mask (an empty mean), or None. Looks through views, casts,
    eps additions and roots."""
    if ctx.made_by is None or not isinstance(t, torch.Tensor):
        return None
    info = ctx.made_by.get(t)
    for _ in range(6):
        if info is None:
            return None
        kind = short_op(info.op)
        if kind in STAT_OPS:
            return ("std" if kind.startswith("std") else "var"), info
        if kind in {"linalg_vector_norm", "norm", "frobenius_norm", "_cdist_forward", "cdist"}:
            return "norm", info
        if kind in {"sum", "mean", "count_nonzero"}:
            if _is_count(info):
                return "count", info
            inner = _parent(info)
            if inner is not None and _is_square(inner):
                return "rms", inner
            return None
        if kind not in PASS_THROUGH:
            return None
        info = _parent(info)
    return None


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
               operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
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
                 operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
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
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
    if not rec.out_inf or rec.out_nan:
        return None
    if short in {"pow", "float_power"} and "arg0" in operands and bool((operands["arg0"] == 0).any()):
        return None  # 0 ** negative: a division by zero (the root rule)
    limit = torch.finfo(out.dtype).max
    x = operands.get("arg0")
    where = f"input max {ev.fmt(float(x.max()))}, " if x is not None and x.numel() else ""
    return "exp_overflow", f"{where}{str(out.dtype).removeprefix('torch.')} max {limit:.4g}", facts


def _norm_rule(rec: OpRecord, short: str, args: Any, kwargs: Any, out: torch.Tensor, mask: torch.Tensor,
               operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None:
        return None
    eps = next((a for a in reversed(_scalars(args)) if isinstance(a, float)), None)
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
               operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
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
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
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
                 operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
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
              operands: dict[str, torch.Tensor], ref_bad: Any, ctx: _Context, facts: dict[str, Any]) -> Verdict | None:
    if not rec.out_inf:
        return None
    return ("domain_error", "an alignment that cannot exist: an input sequence shorter than its target (plus the blanks "
            "between repeated labels), so the likelihood is 0 and the loss infinite", facts)


_Rule = Callable[..., "Verdict | None"]
_FORWARD_RULES: tuple[tuple[set[str], _Rule], ...] = (
    (NLL_OPS, _nll_rule),
    (LOG_OPS, _log_rule),
    (DIV_OPS, _div_rule),
    (ROOT_OPS, _root_rule),
    (set(DOMAIN_OPS), _domain_rule),
    (EXP_OPS, _exp_rule),
    (NORM_OPS, _norm_rule),
    (STAT_OPS, _stat_rule),
    (LINALG_OPS, _linalg_rule),
    (CTC_OPS, _ctc_rule),
)


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
def _backward_cause(rec: OpRecord, fwd: OpInfo | None, ctx: _Context) -> Verdict:
    facts: dict[str, Any] = {}
    if fwd is None:
        return "gradient_explosion", f"the gradient through {short_op(rec.op)} overflowed", facts
    short = short_op(fwd.op)
    if fwd.record is not None:
        return "where_gradient_trap", "the forward value was non-finite in the branch that was not selected", facts
    d = ev.derivative(fwd.func, fwd.args or (), fwd.kwargs or {})
    if d.error:
        facts["derivative_error"] = d.error
    singular = d.nonfinite
    if singular:
        name, xs, _ = singular[0]
        facts.update(singular_points=int(xs.numel()), argument=name)
        return "grad_singularity", _singular_detail(short, xs), facts
    out_dtype = rec.output.dtype if rec.output is not None else None
    if ctx.low_precision_finite and out_dtype in LOW_PRECISION:
        return "precision_overflow", f"its gradient overflowed {str(out_dtype).removeprefix('torch.')}", facts
    if short in EXP_OPS:
        return "exp_overflow", "its derivative overflowed", facts
    if short in DIV_OPS:
        return "div_by_zero", "its derivative divides by a (near-)zero denominator squared", facts
    if short in LOG_OPS and d.error:
        return "log_nonpositive", "its derivative 1/x is infinite at 0", facts
    dtype = str(out_dtype).removeprefix("torch.") if out_dtype is not None else "its dtype"
    incoming = _incoming_max(rec)
    if incoming is not None:
        facts["incoming_grad_abs_max"] = incoming
    return ("gradient_explosion", f"the derivative of {short} is finite in float64 at its inputs; the gradient through "
            f"it overflowed {dtype}" + (f" (incoming gradient up to {ev.fmt(incoming)})" if incoming else ""), facts)


def _incoming_max(rec: OpRecord) -> float | None:
    vals = [float(a.detach().abs().max()) for a in (rec.args or ()) if isinstance(a, torch.Tensor)
            and a.is_floating_point() and a.numel() and bool(torch.isfinite(a).all())]
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
                  seen: dict[str, Any] | None = None) -> tuple[str, str]:
    """An overflow at the end of a divergence is the divergence: say so, with the growth."""
    if cause not in _SYMPTOMS:
        return cause, detail
    trend = _detected(seen) or (divergence(history) if history else None)
    if trend is None:
        return cause, detail
    facts["divergence"] = trend.to_dict()
    where = f"then {detail}" if detail else "then the values overflowed"
    return trend.cause, f"{trend.describe()}; {where}"
