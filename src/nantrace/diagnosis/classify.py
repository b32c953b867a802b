"""Cause classification: from the origin op, its inputs and the differential re-runs to
one cause code of the public taxonomy, with the values that justify it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..localisation.origin import Origin
from ..localisation.tracer import OpRecord, tensor_stats
from .patterns import short_op

LOG_OPS = {"log", "log2", "log10", "log1p", "lgamma", "digamma", "polygamma", "xlogy", "special_xlog1py"}
DIV_OPS = {"div", "reciprocal", "rsqrt", "remainder", "fmod", "floor_divide", "true_divide"}
EXP_OPS = {"exp", "expm1", "exp2", "sinh", "cosh", "pow", "special_exp2", "ldexp"}
SOFTMAX_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"}
NORM_OPS = {
    "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_group_norm", "batch_norm", "layer_norm", "group_norm",
    "instance_norm", "rms_norm", "_fused_rms_norm",
}
SINGULAR_OPS = {"sqrt", "pow", "norm", "linalg_vector_norm", "acos", "asin", "atan2", "cdist", "_cdist_forward",
                "_euclidean_dist", "rsqrt", "frobenius_norm", "linalg_norm"}
ARITH_OPS = {"add", "sub", "mul", "div", "addcmul", "addcdiv", "rsub", "sum", "mean", "mm", "bmm", "addmm",
             "matmul", "baddbmm", "dot", "where", "lerp", "neg"}
NLL_OPS = {"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "cross_entropy_loss"}
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


def _tensor_args(record_args: tuple[Any, ...] | None, record_kwargs: dict[str, Any] | None) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(record_args or ()):
        if isinstance(a, torch.Tensor):
            out.append((f"arg{i}", a))
    for k, v in (record_kwargs or {}).items():
        if isinstance(v, torch.Tensor):
            out.append((k, v))
    return out


def _scalar_args(record_args: tuple[Any, ...] | None) -> list[Any]:
    return [a for a in (record_args or ()) if not isinstance(a, torch.Tensor)]


def _fully_masked_rows(x: torch.Tensor, dim: int) -> int:
    return int(torch.isneginf(x).all(dim=dim).sum())


def classify(origin: Origin, *, observed_in: str, low_precision_finite: bool | None,
             param_modules: dict[str, str], ignored_targets: tuple[int, int] | None = None) -> Classification:
    """The cause of the failure that ``origin`` describes.

    ``observed_in`` is ``"forward"`` (the loss/outputs were non-finite) or ``"backward"``
    (finite forward, non-finite gradients). ``low_precision_finite`` is the result of the
    float32 re-run: True when it was finite there. ``ignored_targets`` is ``(count,
    ignore_index)`` when the replay saw an NLL loss whose targets were all ignored.
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
    backward = rec.phase == "backward"
    fwd = rec.forward
    op = fwd.op if backward and fwd is not None else rec.op
    short = short_op(op)
    if backward and fwd is not None and fwd.args is not None:
        stats_src = _tensor_args(fwd.args, fwd.kwargs)
    else:
        stats_src = _tensor_args(rec.args, rec.kwargs)
    stats = [tensor_stats(t, name) for name, t in stats_src]
    out_dtype = rec.output.dtype if rec.output is not None else (stats_src[0][1].dtype if stats_src else None)
    dtype = str(out_dtype).removeprefix("torch.") if out_dtype is not None else None
    phase = "backward" if backward else "forward"
    base = dict(op=op, module=rec.module, source=rec.source, phase=phase, dtype=dtype, stats=stats)

    def result(cause: str, detail: str) -> Classification:
        return Classification(cause=cause, detail=detail, **base)  # type: ignore[arg-type]

    first = stats[0] if stats else {}
    if low_precision_finite and out_dtype in LOW_PRECISION:
        limit = torch.finfo(out_dtype).max
        return result("precision_overflow", f"{dtype} max is {limit:g}")
    if observed_in == "backward" and not backward:
        # The forward made a non-finite value that never reached the loss (masked by where/
        # masked_fill); its derivative, 0 × non-finite, leaks it into the gradients.
        return result("where_gradient_trap", f"{first.get('negatives', 0)} negative and {first.get('zeros', 0)} zero inputs in the unselected branch")
    if backward and fwd is not None and fwd.record is not None:
        return result("where_gradient_trap", "the forward value was non-finite in the branch that was not selected")

    if not backward:
        if short in SOFTMAX_OPS and rec.args:
            x = rec.args[0]
            dim = rec.args[1] if len(rec.args) > 1 and isinstance(rec.args[1], int) else -1
            rows = _fully_masked_rows(x, dim) if isinstance(x, torch.Tensor) else 0
            if rows:
                return result("masked_softmax_all", f"{rows} row(s) of {x.shape[dim]} entries all -inf")
        if short in NLL_OPS and rec.args and len(rec.args) > 1:
            target = rec.args[1]
            ignore = rec.args[4] if len(rec.args) > 4 else -100
            n = int(target.numel())
            ignored = int((target == ignore).sum())
            if n and ignored == n:
                return result("label_out_of_range", f"all {n} targets equal ignore_index={ignore}")
            return result("label_out_of_range", f"targets range {int(target.min())}..{int(target.max())}")
        if short in LOG_OPS:
            neg, zero = first.get("negatives", 0), first.get("zeros", 0)
            floor = -1 if short == "log1p" else 0
            return result("log_nonpositive", f"{zero} zeros and {neg} negatives in its input" if floor == 0
                          else f"input min {first.get('min')}")
        if short in NORM_OPS:
            eps = next((a for a in reversed(_scalar_args(rec.args)) if isinstance(a, float)), None)
            return result("zero_variance_norm", f"eps={eps}" if eps is not None else "constant input")
        if short in DIV_OPS:
            denom = stats[1] if short in {"div", "remainder", "fmod", "floor_divide", "true_divide"} and len(stats) > 1 else first
            if rec.in_inf and rec.out_nan and not denom.get("zeros"):
                return result("inf_arithmetic", "inf / inf")
            if short == "div" and ignored_targets is not None and len(stats) >= 2 and all(
                    st.get("zeros") == st.get("numel") for st in stats[:2]):
                # 0/0 after a loss summed over no label: the labels are the cause, not the division
                n, ignore = ignored_targets
                return result("label_out_of_range", f"all {n} labels equal ignore_index={ignore}, so the count divided by is 0")
            if short == "div" and len(stats) == 1:
                scal = _scalar_args(rec.args)
                if scal and scal[0] == 0:
                    return result("div_by_zero", "divided by the scalar 0")
            return result("div_by_zero", f"{denom.get('zeros', 0)} zeros in the denominator")
        if short == "sqrt" or (short == "pow" and _fractional_exponent(rec) and first.get("negatives")):
            if first.get("negatives"):
                return result("sqrt_negative", f"{first.get('negatives')} negative inputs, min {first.get('min'):.4g}")
        if short in EXP_OPS and rec.out_inf and rec.creates_nonfinite:
            return result("exp_overflow", f"input max {first.get('max', float('nan')):.4g}, {dtype} max {torch.finfo(out_dtype).max:.4g}"
                          if out_dtype is not None and out_dtype.is_floating_point else "")
        if short in {"acos", "asin"} and rec.out_nan:
            return result("unknown", "argument outside [-1, 1]")
        if (rec.in_inf or rec.scalar_nonfinite) and rec.out_nan and short in ARITH_OPS:
            # the infinity may be a tensor input or an explicit scalar operand (mask * -inf)
            return result("inf_arithmetic", _inf_detail(short))
        if rec.creates_nonfinite and rec.out_inf:
            return result("unknown", f"overflowed {dtype} ({torch.finfo(out_dtype).max:.4g} max) from finite inputs"
                          if out_dtype is not None and out_dtype.is_floating_point else "overflow")
        return result("unknown", "")

    # backward origin: finite inputs, non-finite derivative
    if short in SINGULAR_OPS:
        z = first.get("zeros", 0)
        return result("grad_singularity", f"{z} zero inputs" if z else f"input range {first.get('min')}..{first.get('max')}")
    if short in EXP_OPS and rec.out_inf:
        return result("exp_overflow", "its derivative overflowed")
    if short in DIV_OPS:
        return result("div_by_zero", "its derivative divides by a zero denominator")
    if short in LOG_OPS:
        return result("log_nonpositive", f"{first.get('zeros', 0)} zeros in its input")
    if short in NORM_OPS:
        return result("zero_variance_norm", "its derivative divides by a zero standard deviation")
    if rec.out_inf or rec.out_nan:
        return result("gradient_explosion", f"the gradient through {short} overflowed {dtype}")
    return result("unknown", "")


def _fractional_exponent(rec: OpRecord) -> bool:
    scal = [a for a in _scalar_args(rec.args) if isinstance(a, (int, float))]
    return bool(scal) and float(scal[0]) != int(float(scal[0]))


def _inf_detail(short: str) -> str:
    return {"sub": "inf - inf", "add": "inf + (-inf)", "mul": "0 × inf", "div": "inf / inf"}.get(short, "arithmetic on inf")
