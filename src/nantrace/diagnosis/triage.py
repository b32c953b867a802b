"""First diagnosis from the sentinel's figures alone: which kind of incident, in which
phase, and a provisional cause. Localisation (a replay of the step) refines op, module,
source and cause afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..detection.divergence import Divergence, DivergenceDetector
from ..detection.sentinel import StepHealth
from ..detection.spikes import RobustSpikeDetector
from .patterns import explain


@dataclasses.dataclass
class Finding:
    step: int
    kind: str
    phase: str | None
    cause: str
    module: str | None
    summary: str
    fix: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    benign: bool = False
    """True when the update itself is unaffected (logged, never blocks)."""


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def triage(
    health: StepHealth,
    *,
    step: int,
    scaler_active: bool,
    loss_spikes: RobustSpikeDetector | None,
    grad_spikes: RobustSpikeDetector | None,
    last_applied: int | None,
    divergence: DivergenceDetector | None = None,
    lr: float | None = None,
    params_read: int | None = None,
) -> Finding | None:
    """Classify the step; ``None`` when it is healthy (or a normal GradScaler calibration skip).

    ``divergence`` judges the growth rate of loss and gradient norm from the first step (``lr``,
    the first param group's learning rate, is its evidence); it sees every step, finite or not.
    ``params_read``: the last step whose check read every parameter finite, where the checks in
    between knew them finite from their provenance (``None``: every check reads them).
    """
    diverging = divergence.update(step, health.loss, health.grad_norm, lr) if divergence is not None else None
    finding = _nonfinite(health, step=step, scaler_active=scaler_active, last_applied=last_applied,
                         params_read=params_read)
    if finding is not None:
        evidence = divergence.evidence() if divergence is not None else None
        if evidence is not None and finding.kind != "nonfinite_param":
            finding.details["divergence"] = evidence
            finding.summary += (f" It ends a divergence: the {'loss' if evidence.get('series') == 'loss' else 'gradient norm'}"
                                f" had grown {evidence.get('factor', float('nan')):.3g}× since step {evidence.get('since_step')}.")
        return finding
    if not health.grads_finite:
        return None  # the GradScaler's own calibration: it skips this step and lowers the scale
    spike = loss_spikes.update(health.loss) if loss_spikes is not None and health.loss is not None else None
    boom = grad_spikes.update(health.grad_norm) if grad_spikes is not None and health.grad_norm is not None else None
    if diverging is not None:
        return _divergence_finding(diverging, step)
    if spike is not None:
        detail = f"{spike.value:.4g} against a median of {spike.median:.4g} over the last {spike.window} steps, {spike.ratio:.1f}×, robust z = {spike.zscore:.1f}"
        summary, fix = explain("loss_divergence", detail=detail)
        return Finding(step, "loss_spike", "forward", "loss_divergence", None, summary, fix,
                       details={"value": spike.value, "median": spike.median, "ratio": spike.ratio, "zscore": spike.zscore})
    if boom is not None:
        detail = f"to a norm of {boom.value:.4g} against a median of {boom.median:.4g} over the last {boom.window} steps, {boom.ratio:.1f}×, robust z = {boom.zscore:.1f}"
        summary, fix = explain("gradient_explosion", detail=detail)
        return Finding(step, "grad_explosion", "backward", "gradient_explosion", None, summary, fix,
                       details={"value": boom.value, "median": boom.median, "ratio": boom.ratio, "zscore": boom.zscore})
    return None


def _divergence_finding(d: Divergence, step: int) -> Finding:
    """A diverging run as a finding, with the growth, the learning rate and the schedule as evidence."""
    g = d.growth
    details: dict[str, Any] = {
        "divergence": {"series": g.series, "since_step": g.since_step, "steps": g.steps, "start_value": g.start_value,
                       "value": g.value, "factor": g.factor, "per_step": g.per_step, "r2": g.r2,
                       "continuing": d.continuing, "lr": d.lr, "lr_at_start": d.lr_at_start, "lr_trend": d.lr_trend,
                       "grad_norm_before": d.norm_before},
    }
    if d.other is not None:
        details["divergence"]["other"] = {"series": d.other.series, "since_step": d.other.since_step,
                                          "factor": d.other.factor}
    phase = "forward" if d.cause == "loss_divergence" else "backward"
    return Finding(step, d.kind, phase, d.cause, None, d.summary(step), d.fix(), details=details)


PARAMS_WRITTEN_UNSEEN = "params_nonfinite_write_unseen"
"""``Finding.details`` key of a ``nonfinite_param`` finding made from the check's figures alone (phase ``None``): the
parameters are taken for written between steps or before training, which the figures cannot tell from a write of the
step's own code after ``backward()`` (SAM's ``first_step``, weight noise, a max-norm projection); the localiser replays
that code when its tapes hold writes into them (:func:`nantrace.localisation.gradient_code.localise_parameter_writes`)."""

PARAMS_WITHOUT_UPDATE = "params_nonfinite_without_update"
"""``Finding.details`` key: the parameters are non-finite at the step's check though no update has landed
since ``watch()`` read them finite; the finding is what else the step shows, and the replay decides whether
the step's own code made them so (:func:`nantrace.localisation.localiser.settle_parameter_writes`)."""


def _nonfinite(health: StepHealth, *, step: int, scaler_active: bool, last_applied: int | None,
               params_read: int | None = None) -> Finding | None:
    """The finding for a step whose sentinel figures hold a non-finite value (``None`` otherwise)."""
    if not health.params_finite and last_applied is None:
        # No update has landed since watch() read every parameter finite (else the checkpoint gate named them at
        # the first step): the run's own code wrote them, in this step (a data-dependent initialisation in the
        # forward) or before it. A failure of the step's computation (its loss, outputs or gradients) is then the
        # finding, and its replay tells the two apart; a non-finite batch is no computation of the step, and the
        # parameters' finding stands next to it.
        shown = _step_failure(health, step=step, scaler_active=scaler_active)
        if shown is not None and not shown.benign and shown.kind != "nonfinite_input":
            shown.details[PARAMS_WITHOUT_UPDATE] = True
            return shown
    if not health.params_finite:
        # An update that makes parameters non-finite is caught and undone at its own step
        # (response/update_check.py): parameters that are non-finite here were made so between
        # steps (a checkpoint loaded mid-run, an in-place write) or before training.
        details: dict[str, Any] = {"last_update": last_applied} if last_applied is not None else {}
        if last_applied is None:
            detail = ""
        elif params_read is None or params_read >= last_applied:
            detail = (f"the update of step {last_applied} left it finite, so it changed between steps: a checkpoint "
                      "loaded mid-run or an in-place write")
        else:
            details["params_last_read"] = params_read
            detail = (f"every parameter was read finite at step {params_read} and each update since was proven "
                      "finite, so it changed between steps, by a write that leaves no mark on the tensor (an in-place "
                      "op through .data, a fused kernel outside the optimizer) or a checkpoint loaded into it")
        summary, fix = explain("nonfinite_param", detail=detail)
        details[PARAMS_WRITTEN_UNSEEN] = True  # the step's own code after backward() may have written them: replayed
        return Finding(step, "nonfinite_param", None, "nonfinite_param", None, summary, fix, details=details)
    return _step_failure(health, step=step, scaler_active=scaler_active)


def _step_failure(health: StepHealth, *, step: int, scaler_active: bool) -> Finding | None:
    """The finding for the step's own non-finite figures besides its parameters: the batch, the loss, the
    model's outputs, the gradients (``None`` when they are finite, or for a GradScaler's calibration skip)."""
    if not health.inputs_finite:
        summary, fix = explain("nonfinite_input", detail="in the tensors passed to the model's forward")
        return Finding(step, "nonfinite_input", "data", "nonfinite_input", None, summary, fix)
    if not health.loss_finite:
        inside = not health.outputs_finite
        where = "inside the model (its outputs were already non-finite)" if inside else "in the loss computation (the model's outputs were finite)"
        return Finding(step, "nonfinite_loss", "forward", "unknown", "" if inside else None,
                       f"The loss is {_fmt(health.loss)} at step {step}; the first non-finite value arose {where}.",
                       explain("unknown")[1])
    if not health.outputs_finite:
        return Finding(step, "nonfinite_activation", "forward", "unknown", "",
                       f"The model's outputs hold non-finite values at step {step}, but the loss and gradients are finite.",
                       "Look for outputs that the loss masks out (padding positions, ignored classes): they are "
                       "harmless now but will poison any loss that reads them.", benign=health.grads_finite)
    if not health.grads_finite:
        if scaler_active:
            return None  # the GradScaler's own calibration: it skips this step and lowers the scale
        seen = (f"The loss is finite ({_fmt(health.loss)}) but gradients are non-finite at step {step}: "
                "the first non-finite value arose in backward.") if health.loss is not None else (
                f"Gradients are non-finite at step {step}; no loss was seen through backward() in this step, "
                "so whether the forward was already non-finite is unknown.")
        return Finding(step, "nonfinite_grad", "backward" if health.loss is not None else None, "unknown", None,
                       seen, explain("unknown")[1])
    return None
