"""The pattern library: for each cause (and, where it matters, each op family) one
sentence that explains the failure and one concrete fix.

Kept as data so it is easy to read, extend and test. Templates may use these fields:
``{op}`` (short op name, e.g. ``log``), ``{where}`` (" in module 'x'" or " in the loss
function"), ``{dtype}``, ``{detail}`` (values seen, from the classifier), ``{max}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Pattern:
    cause: str
    ops: tuple[str, ...]  # short op names this entry is specific to; () = any op
    summary: str
    fix: str


PATTERNS: tuple[Pattern, ...] = (
    Pattern("nonfinite_input", (), "The batch itself carries non-finite values{detail}.",
            "Validate batches before the model (nantrace.data.ValidatingCollate) and find the sample that "
            "produced them: typically a division by a zero std in normalisation or a corrupt record."),
    Pattern("label_out_of_range", ("nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss2d", "cross_entropy"),
            "{op} got targets it cannot use{detail}: with reduction='mean' the loss is 0/0.",
            "Check the labels against num_classes and ignore_index; drop batches in which every target is "
            "ignored, or use reduction='sum' divided by max(count, 1)."),
    Pattern("label_out_of_range", ("div",), "The loss divides its sum over labels by the number of labels used, and "
            "none was used{where}{detail}.",
            "Every label of the batch is the ignore index (e.g. prompt-only samples after masking): drop or re-pack "
            "such batches before training, or divide by max(count, 1)."),
    Pattern("div_by_zero", ("nll_loss_forward", "nll_loss2d_forward", "nll_loss", "cross_entropy"),
            "{op} divided by a total class weight of 0{where}{detail}.",
            "Give every class that can appear as a target a positive weight, or skip batches whose targets all have "
            "weight 0 (reduction='sum' divided by max(total weight, eps))."),
    Pattern("label_out_of_range", (), "A class index is outside [0, num_classes){detail}.",
            "Check the label mapping and num_classes; validate labels with nantrace.data.validate_batch."),
    Pattern("nonfinite_param", (), "A parameter or buffer was already non-finite before this step{detail}.",
            "Look at how the weights were created or loaded: an uninitialised tensor (torch.empty), a corrupted "
            "checkpoint, or an earlier update that went unchecked. Re-initialise or reload that tensor."),
    Pattern("log_nonpositive", ("_log_softmax", "log_softmax"), "{op} produced a non-finite value{where}{detail}.",
            "Use log_softmax on finite logits (not log(softmax(x))) and keep masks finite."),
    Pattern("log_nonpositive", (), "{op} of an argument outside its domain{where}{detail}.",
            "Clamp the argument first, e.g. x.clamp_min(torch.finfo(x.dtype).tiny).{op}() or {op}(x + eps); for "
            "log of probabilities use log_softmax / F.logsigmoid instead of log(softmax(...)) / log(sigmoid(...))."),
    Pattern("div_by_zero", ("rsqrt",), "rsqrt of zero{where}{detail}.",
            "Add an epsilon inside the root: torch.rsqrt(x + eps)."),
    Pattern("div_by_zero", ("div",), "A division by zero{where}{detail}.",
            "Guard the denominator: x / y.clamp_min(eps) (or y + eps for non-negative y), and find why it is "
            "zero (an empty mask, a zero count, a zero norm)."),
    Pattern("div_by_zero", (), "{op} divided by zero{where}{detail}.",
            "Guard the denominator: x / y.clamp_min(eps) (or y + eps for non-negative y), and find why it is "
            "zero (an empty mask, a zero count, a zero norm)."),
    Pattern("sqrt_negative", ("pow",), "A fractional power of a negative number{where}{detail}.",
            "Raise only non-negative values: x.clamp_min(0) ** p, or x.abs() ** p * x.sign() if the sign matters."),
    Pattern("sqrt_negative", (), "sqrt of a negative number{where}{detail}.",
            "Clamp before the root: torch.sqrt(x.clamp_min(0) + eps); a variance computed as E[x²]-E[x]² can go "
            "slightly negative in floating point."),
    Pattern("grad_singularity", ("sqrt", "norm", "linalg_vector_norm", "cdist", "_cdist_forward"),
            "The forward of {op} is finite but its derivative is infinite here{where}{detail}.",
            "Add eps inside the root so the derivative stays finite at 0: torch.sqrt(x + eps), or "
            "(x.pow(2).sum(-1) + eps).sqrt() instead of x.norm(dim=-1)."),
    Pattern("grad_singularity", ("acos", "asin"), "The derivative of {op} is infinite at ±1{where}{detail}.",
            "Clamp the argument strictly inside the domain: x.clamp(-1 + eps, 1 - eps) with eps ≈ 1e-6."),
    Pattern("grad_singularity", ("pow",), "x**p with p < 1 has an infinite derivative at 0{where}{detail}.",
            "Add eps before the power: (x + eps) ** p, or clamp x away from zero."),
    Pattern("grad_singularity", ("atan2",), "atan2(0, 0) has no derivative{where}{detail}.",
            "Add a small epsilon to the arguments or mask the (0, 0) points out before atan2."),
    Pattern("grad_singularity", (), "The forward of {op} is finite but its derivative is infinite here{where}{detail}.",
            "Move the argument away from the singular point (add eps or clamp)."),
    Pattern("exp_overflow", ("exp", "expm1"), "exp overflowed {dtype}{where}{detail}.",
            "Subtract the maximum before exponentiating (logsumexp / softmax do this), clamp the argument "
            "(x.clamp_max(80) for float32, 11 for float16), or work in log space."),
    Pattern("exp_overflow", ("pow",), "A power overflowed {dtype}{where}{detail}.",
            "Bound the base or exponent, or compute in log space: torch.exp(p * torch.log(x))."),
    Pattern("exp_overflow", (), "{op} overflowed {dtype}{where}{detail}.",
            "Bound the argument before {op} or rewrite it in log space."),
    Pattern("precision_overflow", ("mm", "bmm", "addmm", "matmul", "linear", "baddbmm", "_scaled_dot_product_flash_attention",
                                   "_scaled_dot_product_efficient_attention", "convolution"),
            "{op} overflowed {dtype} ({max} max) but is finite in float32{where}{detail}.",
            "Run this module in bfloat16 instead of float16 (same range as float32), scale the inputs down before "
            "the product (e.g. divide q by sqrt(d) before q@k^T), or keep the module in float32 under autocast."),
    Pattern("precision_overflow", (), "{op} overflowed {dtype} ({max} max) but is finite in float32{where}{detail}.",
            "Use bfloat16 instead of float16, keep this op in float32 (torch.autocast(..., enabled=False) around it), "
            "or rescale its inputs."),
    Pattern("masked_softmax_all", (), "{op} over a row in which every entry is -inf (fully masked){where}{detail}.",
            "Fill masks with torch.finfo(dtype).min instead of -inf, or give every query at least one visible key "
            "(e.g. drop empty sequences, or zero the output of empty rows with torch.where)."),
    Pattern("inf_arithmetic", (), "{op} combined infinities (inf - inf, 0 * inf or inf / inf){where}{detail}.",
            "Keep masks finite (torch.finfo(dtype).min) or apply them with masked_fill/where instead of arithmetic."),
    Pattern("zero_variance_norm", ("std", "var", "std_mean", "var_mean"),
            "{op} was computed over too few elements{where}{detail}.",
            "Use correction=0 (unbiased=False) or make sure every slice has at least two elements (batch size > 1, "
            "no single-token sequences), and add eps before dividing by it."),
    Pattern("zero_variance_norm", ("div",), "A normalisation divided by a statistic that is zero{where}{detail}.",
            "Add eps to the statistic before dividing, x / (x.std(dim) + eps), and skip constant slices (padding rows, "
            "one-sample batches) or mask them out."),
    Pattern("zero_variance_norm", (), "{op} normalised a constant input with eps = 0{where}{detail}.",
            "Use a positive eps (1e-5 is the PyTorch default) so a zero variance does not divide by zero."),
    Pattern("where_gradient_trap", (), "{op} produced non-finite values in the branch torch.where/masking did not select{where}; "
            "its gradient there is 0 × non-finite = NaN{detail}.",
            "Make the unselected branch safe before the op: torch.where(mask, f(torch.where(mask, x, safe_value)), other) "
            "(the 'double where' trick)."),
    Pattern("overflow", ("native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                         "_native_batch_norm_legit_functional", "_fused_rms_norm", "rms_norm"),
            "{op} was fed values so large that the variance it computes overflowed {dtype}{where}{detail}.",
            "The input was anything but constant, so eps will not help: find what made the activations huge (a "
            "learning rate too high or a diverging run, a missing normalisation before this layer, unnormalised "
            "inputs); lower the LR, lengthen warmup or clip gradients."),
    Pattern("overflow", (), "{op} produced values beyond the range of {dtype} from finite inputs{where}{detail}.",
            "This is almost always a symptom: find what made the values huge (a diverging run: lower the learning "
            "rate, lengthen warmup, clip gradients; unnormalised inputs: normalise them), or compute this op in "
            "float64 / log space if the magnitudes are genuine."),
    Pattern("domain_error", ("acos", "asin", "atanh", "acosh", "erfinv"),
            "{op} got an argument outside its domain{where}{detail}.",
            "Clamp the argument into the domain first, e.g. x.clamp(-1 + eps, 1 - eps) for acos/asin/atanh; "
            "rounding makes cosine similarities and normalised dot products exceed ±1 slightly."),
    Pattern("domain_error", ("_ctc_loss", "ctc_loss"), "CTC found no valid alignment{where}{detail}.",
            "Make every input sequence at least as long as its target (plus one blank between repeated labels), "
            "drop such samples, or use F.ctc_loss(..., zero_infinity=True)."),
    Pattern("domain_error", ("linalg_cholesky_ex", "cholesky", "linalg_inv_ex", "inverse", "linalg_solve_ex",
                             "_linalg_slogdet", "logdet", "linalg_eigh", "_linalg_eigh", "_linalg_svd", "_linalg_det"),
            "{op} of a matrix outside its domain{where}{detail}.",
            "Add jitter to the diagonal before the decomposition (A + eps * I, eps ≈ 1e-6 × mean of the diagonal), "
            "or parametrise the matrix so that it stays positive definite (L @ L.T + eps * I)."),
    Pattern("domain_error", (), "{op} got an argument outside its domain{where}{detail}.",
            "Bound the argument into the op's domain before calling it (clamp, or transform it, e.g. sigmoid for a "
            "probability), and find which values left it."),
    Pattern("gradient_explosion", (), "Gradients exploded{detail} through a long chain, with no single domain error.",
            "Clip gradients (torch.nn.utils.clip_grad_norm_), lower the learning rate or lengthen warmup, and check "
            "initialisation and normalisation of deep/recurrent paths."),
    Pattern("loss_divergence", (), "The loss spiked{detail}.",
            "Lower the learning rate or lengthen warmup, clip gradients, and look at the batch of this step; "
            "repeated spikes call for a smaller LR or higher Adam eps."),
    Pattern("scaler_collapse", (), "The GradScaler is collapsing: {detail}.",
            "Gradients overflow at every scale: look for a real non-finite value (not an fp16 range problem), or "
            "switch to bfloat16 autocast, which needs no scaler."),
    Pattern("optimizer_state", (), "The optimizer update produced non-finite values from finite gradients{detail}.",
            "Raise Adam's eps (1e-8 underflows in float16; use ≥1e-6 or keep optimizer state in float32) and "
            "check the learning rate."),
    Pattern("unknown", (), "A non-finite value appeared{where}{detail}, and its cause could not be established.",
            "Re-run with on_anomaly='pause' to keep a bundle and replay it with `nantrace replay`."),
    # training dynamics (early warnings, nantrace.dynamics): logged, nothing blocked
    Pattern("update_too_large", (), "Updates are too large for the weights they change{detail}: ‖Δθ‖/‖θ‖ stayed far "
            "above the usual 1e-3 (a learning rate too high for this layer).",
            "Lower the learning rate (or this layer's param-group LR) or lengthen warmup; healthy runs keep "
            "‖Δθ‖/‖θ‖ around 1e-3 and well below 1e-1."),
    Pattern("vanishing_gradient", (), "A layer stopped receiving gradient{detail}: its gradient collapsed by orders of "
            "magnitude relative to the other layers.",
            "Look for dead ReLUs (a large negative bias, LR spike) or saturated sigmoid/tanh on the path to this layer: "
            "use LeakyReLU/GELU, normalisation, residual connections or a lower learning rate."),
    Pattern("lr_schedule_mismatch", (), "The learning rate that ran is not the schedule that was declared{detail}.",
            "Step the scheduler once per optimizer step (not per epoch, not per micro-batch), after optimizer.step(), "
            "and check warmup_steps/total_steps and the peak LR passed to it."),
    Pattern("clip_threshold", (), "Gradient clipping is miscalibrated{detail}.",
            "Set max_norm from the run's own pre-clip norms (nantrace suggests a high quantile of the healthy ones): "
            "clipping should catch the rare spike, not fire on every step."),
    Pattern("logit_saturation", (), "The classifier's logits saturate{detail}: softmax probabilities round to 0 and 1, "
            "so gradients vanish for confident rows and low precision overflows.",
            "Use label smoothing (F.cross_entropy(..., label_smoothing=0.1)), weight decay on the head, a z-loss or "
            "logit soft-capping, or a lower learning rate."),
)


# An op that overflowed at the end of a divergence: the divergence is the cause, the op where it broke.
AT_END_OF_DIVERGENCE: dict[str, Pattern] = {p.cause: p for p in (
    Pattern("loss_divergence", (), "Training diverged before {op} overflowed{where}{detail}.",
            "The overflow is a symptom of the divergence: lower the peak learning rate or lengthen warmup, clip "
            "gradients (clip_grad_norm_), and check the schedule; nantrace's early warning flags such growth before "
            "it overflows."),
    Pattern("gradient_explosion", (), "Gradients exploded before {op} overflowed{where}{detail}.",
            "Clip gradients (torch.nn.utils.clip_grad_norm_), lower the learning rate or lengthen warmup, and check "
            "initialisation and normalisation of deep/recurrent paths."),
)}


NONFINITE_BUFFER = Pattern("nonfinite_param", (), "A buffer was already non-finite before this step{detail}.",
                           "A buffer is not stepped by the optimizer: the model's code or the step's own code writes "
                           "it (a running statistic, an EMA, an input normaliser's update) or a checkpoint loads it. "
                           "Find the write that made it non-finite in the steps before (a variance of a batch of one "
                           "row, a division by a count of zero, an average with a NaN) and guard it; then reload or "
                           "reset the buffer (e.g. module.reset_running_stats()).")
"""``nonfinite_param`` when what was non-finite is a buffer (``explain(buffer=True)``)."""

PRECISION_ROUNDING = Pattern(
    "precision_overflow", (),
    "{op} failed on a value that rounded in {dtype} (a sigmoid that rounds to exactly 1, a variance that cancels "
    "to 0 or below); the step replayed in float32 is finite{where}{detail}.",
    "Compute this part in float32 (.float() before it, or torch.autocast(..., enabled=False) around it), or use a "
    "form that does not round: logsigmoid / binary_cross_entropy_with_logits instead of log(sigmoid(x)), "
    "a two-pass variance instead of E[x^2] - E[x]^2.")
"""``precision_overflow`` where nothing overflowed: a rounding upstream of the op (its own inputs give
the same non-finite value in float64), told apart by ``explain(..., rounded=True)``."""


def lookup(cause: str, op: str | None = None) -> Pattern:
    """The most specific pattern for this cause and op (falls back to the cause's generic entry)."""
    short = short_op(op)
    generic = None
    for p in PATTERNS:
        if p.cause != cause:
            continue
        if p.ops and short in p.ops:
            return p
        if not p.ops and generic is None:
            generic = p
    if generic is None:
        raise KeyError(f"no pattern for cause {cause!r}")
    return generic


def short_op(op: str | None) -> str:
    """``aten.log.default`` → ``log``; ``aten.sqrt_.default`` → ``sqrt``."""
    if not op:
        return ""
    name = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
    return name.rstrip("_") if not name.startswith("_") else name


def explain(cause: str, op: str | None = None, *, module: str | None = None,
            dtype: str | None = None, detail: str = "", max_value: str = "", diverged: bool = False,
            where: str | None = None, rounded: bool = False, buffer: bool = False) -> tuple[str, str]:
    """(summary, fix) for a diagnosis, filled in from the pattern library.

    ``module`` is only meaningful once the op is localised (``op`` not None); ``where`` names the
    place instead (" in the code between ...") when the op ran in neither the model nor the loss code.
    """
    if rounded and cause == "precision_overflow":
        p = PRECISION_ROUNDING
    elif buffer and cause == "nonfinite_param":
        p = NONFINITE_BUFFER
    elif diverged and op is not None and cause in AT_END_OF_DIVERGENCE:
        p = AT_END_OF_DIVERGENCE[cause]
    else:
        p = lookup(cause, op)
    if where is not None:
        pass
    elif op is None:
        where = ""
    elif module is None:
        where = " in the loss function (outside the model)"
    elif module == "":
        where = " in the model's top-level forward"
    else:
        where = f" in module '{module}'"
    fields: dict[str, Any] = {
        "op": short_op(op).lstrip("_") or "an op",  # "_softmax" reads as "softmax"
        "where": where,
        "dtype": dtype or "its dtype",
        "detail": f" ({detail})" if detail else "",
        "max": max_value or "its",
    }
    return p.summary.format(**fields), p.fix.format(**fields)
