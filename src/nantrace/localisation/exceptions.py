"""Failures that raise instead of producing a NaN.

A NaN that reaches an op which validates its input (``binary_cross_entropy``'s "all
elements of input should be between 0 and 1", ``torch.multinomial`` on NaN probabilities,
``torch.distributions`` argument validation), a class index out of range, a decomposition of
a matrix that is not positive definite: the step raises before ``backward()``. The step is
replayed (the model's forwards, then the loss tape) under the op tracer until it raises
again; the evidence decides whether a value caused it:

* the op that raised received NaN/Inf: the origin of that value is found the usual way
  (dataflow back to the op that created it) and classified;
* it received an index outside the dimension it indexes: ``label_out_of_range``;
* its finite inputs were outside its domain (a probability > 1, a non-positive-definite
  matrix), or the message is a value check's: ``domain_error`` at that op.

Anything else (shapes, dtypes, devices, memory, the user's own errors) is not a numerical
failure: no incident, and the exception is left alone.
"""

from __future__ import annotations

import dataclasses
import math
import re
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..capture import floating_tensors
from ..diagnosis.classify import Classification, classify
from ..diagnosis.family_rules import matrix_detail
from ..diagnosis.patterns import explain, short_op
from .loss_replay import replay_step
from .modules import ModuleStack
from .origin import _TRIVIAL, Origin, chain_summary, trace_back
from .rerun import RerunSkipped, output_ok, rerun_scope, run_unit
from .tracer import (CallFailureWatch, FailedOp, InputRef, OpInfo, OpRecord, OpTracer, _all_finite, _is_library, _nan_inf, format_source,
                     tensor_stats)

if TYPE_CHECKING:
    from ..watched import Watched
    from ..incident import Incident

VALUE_CHECKS = re.compile(
    r"between 0 and 1|probability tensor contains|invalid multinomial|to satisfy the constraint|out of bounds|"
    r"index out of range|out of range|device-side assert|positive.definite|singular|could not be completed|"
    r"contains (?:nan|inf)|\bnan\b|\binf\b|non-finite|nonfinite|is not finite|converted to type .* without overflow|"
    r"(?:has|have|must|should) to be (?:greater|larger|less|smaller) than|must be (?:positive|non-negative|"
    r"nonnegative|greater|less)",
    re.IGNORECASE)
NOT_VALUES = re.compile(r"out of memory|size mismatch|shapes? .*cannot|must match|expected scalar type|dtype|"
                        r"on the same device|not implemented|unexpected keyword|missing \d+ required", re.IGNORECASE)
DEVICE_ASSERT = re.compile(r"device-side assert", re.IGNORECASE)
CONSTRAINT = re.compile(
    r"Expected parameter (\w+) .* of distribution (\w+).* to satisfy the constraint (.+?)(?:, but found|$)", re.S)
"""torch.distributions' argument validation: a value check of torch's own, written in Python."""
INDEX_OPS = {"embedding", "nll_loss_forward", "nll_loss2d_forward", "gather", "index_select", "index", "take",
             "scatter", "scatter_add", "index_add", "one_hot", "embedding_bag", "_embedding_bag", "index_put",
             "index_put_", "_index_put_impl_", "_unsafe_index"}
ADVANCED_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"}
"""Ops that take their indices as a list, one optional integer tensor per leading dimension (``x[t]``, ``x[i, j]``)."""


def is_value_message(message: str) -> bool:
    """Does an exception's message read like a value check (not shapes, dtypes or memory)?"""
    return bool(VALUE_CHECKS.search(message)) and not NOT_VALUES.search(message)


def diagnose_exception(watched: "Watched", incident: "Incident", capture: Any, exc: BaseException | None, *,
                       abandoned: bool = False, judged: bool = False) -> bool:
    """Fill ``incident`` (kind ``exception``) from a replay of the step that raised ``exc``.

    Returns False when the evidence says the exception has nothing to do with a value: the
    caller then records no incident.

    ``abandoned`` (``exc`` is None): a training step that ran the model's forward and never reached
    ``backward()`` (nor ``optimizer.step()``): a check written in Python (torch.distributions'
    validation) raised between two taped calls and the loop caught it, so no exception was seen.
    Without the exception, the replay itself must show the bad value: a non-finite value created
    in the step, or a decomposition whose ``info`` reported a singular / non-positive-definite
    matrix. Anything else (an evaluation forward with grad on, healthy values) returns False.

    A step that reached ``backward()`` and raised (or was left) before ``optimizer.step()`` is judged by its
    real loss and gradients first (:func:`_after_backward`), unless ``judged``: the step's check has already
    run on them (an exception raised from inside ``optimizer.step()`` or ``scaler.step()``).
    """
    from .localiser import param_modules

    if not judged and _reached_backward(capture):
        # raised between backward() and optimizer.step() (clip_grad_norm_(error_if_nonfinite=True), the user's own
        # check of the losses): the step's real loss and gradients say whether a value caused it
        seen = _nonfinite_after_backward(watched, capture)
        if seen is None and getattr(exc, "_nantrace_backward", False) and is_value_message(str(exc)):
            # autograd's engine stopped the backward on a value (anomaly mode: "returned nan values"), before
            # the gradients were written: the backward is localised as a non-finite gradient would be
            seen = "nonfinite_grad"
        if seen is not None:
            return _after_backward(watched, incident, capture, exc, seen)
        if abandoned:  # finite loss and gradients: a step left after backward() for a reason of its own
            return False
    checked = _checked_value(exc)
    replay = _replay(watched, capture, checked)
    if capture.calls and _not_the_users(replay.error, exc) and capture.forwards and capture.tape is not None \
            and capture.tape.usable:
        # re-running the replayable call raised an exception of its own (its state moved on since, a check of the
        # replay's): the step's forwards and taped loss code hold what the real call computed (as localiser does)
        if isinstance(replay.error, RerunSkipped):
            incident.details["rerun_skipped"] = str(replay.error)
        else:
            incident.details["replayable_call_raised"] = True
        replay = _replay(watched, capture.without_calls(), checked)
    records, failure, tracer = replay.records, replay.failure(exc), replay.tracer
    replay_error, model_start = replay.error, replay.model_start
    error = exc if exc is not None else replay_error
    decompositions = tracer.failed_decompositions if tracer is not None else []
    if error is None and not abandoned:
        return False
    evidence = _Evidence(param_modules=param_modules(watched), history=incident.history,
                         divergence_seen=incident.details.get("divergence"))
    if tracer is not None:
        evidence.made_by, evidence.ignored_targets = tracer.made_by, tracer.ignored_targets
        evidence.externals = tracer.externals
    rejected = _nonfinite_rejected(replay_error, tracer) if failure is None else None
    if error is None:  # an abandoned step: only the replay's own evidence counts
        return _abandoned(incident, failure, records, evidence, model_start, decompositions, rejected)
    message = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    incident.details["exception"] = message
    incident.transient = False if replay_error is not None or records else None
    cls, origin = _from_evidence(failure, records, evidence, model_start, rejected)
    if cls is None:
        # no value evidence: only a torch op's own value check (or a CUDA assert, which cannot be
        # replayed) makes it an incident; a Python error that mentions "range" or "nan" does not
        message_text = str(error)
        constraint = CONSTRAINT.search(message_text)
        if not is_value_message(message_text) or (
                failure is None and not DEVICE_ASSERT.search(message_text) and constraint is None):
            return False
        if constraint is not None and failure is None:  # finite values outside a distribution's support
            cls = _python_check(constraint, decompositions, replay_error, error, tracer, checked)
        else:
            cls = Classification("unknown", failure.op if failure else None, failure.module if failure else None,
                                 failure.source if failure else None, failure.phase if failure else None,
                                 "the replay did not show which value it was", None, [])
    incident.op, incident.module, incident.source = cls.op, cls.module, cls.source
    incident.phase, incident.cause, incident.input_stats = cls.phase, cls.cause, cls.stats
    if origin is not None:
        incident.chain = chain_summary(origin)
        if failure is not None:
            incident.chain.append({"op": failure.op, "phase": failure.phase, "module": failure.module,
                                   "source": failure.source, "produces": "exception", "origin": False})
    summary, fix = explain(cls.cause, cls.op, module=cls.module, dtype=cls.dtype, detail=cls.detail)
    if cls.op is None and cls.cause == "domain_error":  # a check written in Python (torch.distributions)
        summary = f"A value outside its domain reached torch's argument validation: {cls.detail}."
        fix = ("Keep the parameter inside the distribution's support where it is computed: a scale through "
               "F.softplus(x) + eps (not relu or exp of an unbounded value), probabilities through softmax/sigmoid, "
               "and check the model's outputs for NaN.")
    raised_by = f" {short_op(failure.op)} raised" if failure is not None else " the step raised"
    incident.summary = f"{summary} Then{raised_by} {message}"
    incident.fix = fix
    if cls.evidence:
        incident.details["evidence"] = {k: (str(v) if isinstance(v, float) else v) for k, v in cls.evidence.items()}
    return True


@dataclasses.dataclass
class _Replay:
    """What one replay of the step that raised showed."""

    tracer: OpTracer
    calls: CallFailureWatch
    error: BaseException | None
    model_start: OpRecord | None

    @property
    def records(self) -> list[OpRecord]:
        return list(self.tracer.records)

    def failure(self, exc: BaseException | None) -> FailedOp | None:
        return self.tracer.failure or _same_failure(self.calls.failed, exc)


def _replay(watched: "Watched", capture: Any, checked: torch.Tensor | None) -> _Replay:
    """Replay ``capture``'s step under the op tracer until it raises: its ``replayable`` calls when it has
    any (the loss is inside them), else the model's forwards and the loss tape (or the prelude, for a step that
    died before the model's forward)."""
    from .localiser import externals_of

    units: list[Any] = list(capture.calls) or list(capture.forwards)
    replayable = bool(capture.calls)
    tape = capture.tape if not replayable else None
    externals = externals_of(watched, units)
    model_start: OpRecord | None = None
    with rerun_scope(watched):
        modules = ModuleStack(watched.root)
        tracer = OpTracer(modules, externals)
        if checked is not None:  # the replay's tensors like the value a Python check rejected, kept to find its twin
            tracer.made_by = _KeepingLike(tracer.made_by, checked)
        calls = CallFailureWatch(tracer)
        with modules, tracer, calls:
            if replayable:
                replay_error, outputs_finite, _ = _replay_units(watched, units)
            elif not units and capture.prelude is not None and capture.prelude.failed is not None:
                # the step died before the model's forward: its code up to the call that raised is all there is
                replay_error, outputs_finite = _replay_failed_prelude(capture.prelude, tracer), True
            else:
                step = replay_step(watched, units, tape, tracer, backward=False, prelude=capture.prelude)
                replay_error, outputs_finite = step.error, step.model_outputs_finite
        if not outputs_finite:  # the model's own outputs went bad before any check raised
            model_start = next((r for r in tracer.records if r.phase == "forward" and r.out_nan), None)
    return _Replay(tracer, calls, replay_error, model_start)


def _not_the_users(replayed: BaseException | None, exc: BaseException | None) -> bool:
    """The re-run of a ``replayable`` call raised, and not the real step's exception (another type or message):
    a ``KeyError`` of an input the real call had already popped, an index its state has moved past, a
    :class:`RerunSkipped`."""
    if replayed is None or exc is None:
        return False
    return type(replayed) is not type(exc) or str(replayed) != str(exc)


def _replay_failed_prelude(prelude: Any, tracer: OpTracer) -> BaseException | None:
    """Re-issue the step's code before the model's forward, up to and with the call that raised, under
    ``tracer`` (which records the failed op and what made its arguments); the replay's own exception."""
    from .loss_replay import replay_prelude

    try:
        replay_prelude(prelude, tracer)
    except Exception as exc:  # noqa: BLE001 - expected: the call that raised raises again
        return exc
    finally:
        tracer.flush()
    return None


def _same_failure(failed: FailedOp | None, exc: BaseException | None) -> FailedOp | None:
    """A call of the replay that raised above the dispatcher (a composite's own check), when it is the real step's
    failure again: the same exception type and message."""
    if failed is None or exc is None:
        return None
    return failed if type(failed.error) is type(exc) and str(failed.error) == str(exc) else None


def _reached_backward(capture: Any) -> bool:
    """The step ran ``backward()`` on a loss (the one check the guard keeps, or the loss tape's end)."""
    tape = capture.tape
    return bool(capture.losses) or (tape is not None and bool(tape.losses or tape.loss is not None))


def _nonfinite_after_backward(watched: "Watched", capture: Any) -> str | None:
    """What the step's usual check would see, read now (the step raised before ``optimizer.step()``, where it
    runs): ``nonfinite_loss`` for a non-finite loss that reached ``backward()``, ``nonfinite_grad`` for a
    non-finite gradient of a watched parameter, else None. Gradients still multiplied by an enabled
    GradScaler's scale are the scaler's to judge (an inf there is a skipped step, not a failure)."""
    if any(loss.numel() and not _all_finite(loss) for loss in capture.losses):
        return "nonfinite_loss"
    scaler = watched.scaler
    if watched.sharded or (scaler is not None and scaler.is_enabled() and not watched.unscaled):
        return None
    for p in watched.params:
        g = p.grad
        if g is not None and g.numel() and g.is_floating_point() and not _all_finite(g):
            return "nonfinite_grad"
    return None


def _after_backward(watched: "Watched", incident: "Incident", capture: Any, exc: BaseException | None,
                    seen: str) -> bool:
    """A step that reached ``backward()`` and raised (or was left) before ``optimizer.step()`` with a non-finite
    loss or gradient: localised as the step's check would have (``localiser.localise_incident``: the replay
    of the forwards, the loss code and the backward, the gradient code), recorded as kind ``exception``."""
    from .localiser import localise_incident

    what = "loss" if seen == "nonfinite_loss" else "gradients"
    incident.kind = seen  # what localisation branches on (a loss seen non-finite, or only the gradients)
    incident.summary = f"The step's {what} were non-finite after backward() at step {incident.step}."
    with torch.autograd.set_detect_anomaly(False):  # the user's anomaly mode would stop the replay's backward too
        localise_incident(watched, incident, capture, raised=exc)
    incident.kind = "exception"
    incident.details["observed"] = seen
    if exc is None:
        incident.details["exception"] = None
        incident.details["abandoned"] = ("the step ran backward() and never reached optimizer.step(): an exception "
                                         "raised in Python code between them ended it")
        then = " The step then stopped before optimizer.step()."
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        message = f"{type(exc).__name__}: {first}"
        incident.details["exception"] = message
        if getattr(exc, "_nantrace_backward", False):  # the engine stopped the backward before it wrote them
            incident.details["observed"] = "backward_raised"
            then = f" Then backward() stopped with {message.rstrip('.')} (before any gradient was written)."
        else:
            then = f" Then the step raised {message} before optimizer.step()."
    incident.summary = f"{incident.summary}{then}"
    return True


def _python_check(constraint: re.Match[str], decompositions: list[Any], replay_error: BaseException | None,
                  error: BaseException, tracer: OpTracer | None,
                  checked: torch.Tensor | None = None) -> Classification:
    """A check written in Python (torch.distributions' validation) raised on finite values: name the
    op whose output it read. A decomposition that reported failure through its ``info`` (the
    ``positive_definite`` check's ``cholesky_ex``) is that op; otherwise the op that made the checked
    value (found in the replayed check's frame; when the replay did not raise, as a zero-code replay of
    the loss tape does not, the replayed tensor equal to the value the real check rejected); at least
    the user's line of the call that raised."""
    name, dist, rule = constraint.groups()
    detail = f"the {name} of {dist} violates {rule.strip()}"
    if decompositions:
        return _decomposition(decompositions[-1], detail=f"{detail}: ")
    value, made = _rejected_value(replay_error, tracer)
    if made is not None:
        rule_obj = _checked_constraint(replay_error) or _checked_constraint(error)
        made = _violation_maker(value, made, rule_obj)
        return Classification("domain_error", made.op, made.module, made.source, "forward", detail, None, [])
    return Classification("domain_error", None, None, raising_source(error), "forward", detail, None, [])


def _decomposition(made: Any, detail: str = "") -> Classification:
    """``domain_error`` at a decomposition (Cholesky, inverse, LU, LDL, solve) of a singular or
    non-positive-definite matrix."""
    a = next((x for x in (made.args or ()) if isinstance(x, torch.Tensor)), None)
    facts: dict[str, Any] = {}
    return Classification("domain_error", made.op, made.module, made.source, "forward",
                          detail + matrix_detail(a, facts), str(a.dtype).removeprefix("torch.") if a is not None else None,
                          [tensor_stats(a, "arg0")] if a is not None else [], facts)


def _rejected_value(replay_error: BaseException | None, tracer: OpTracer | None) -> tuple[torch.Tensor | None, Any]:
    """The value a Python check rejected, as the replay made it, and the op that made it: the replayed check's own
    ``value`` (when the replay raised it again), else the replayed twin of the real step's rejected value."""
    value = _checked_value(replay_error)
    if value is not None and tracer is not None and tracer.made_by.get(value) is not None:
        return value, tracer.made_by.get(value)
    if tracer is not None and isinstance(tracer.made_by, _KeepingLike):
        found = tracer.made_by.twin_tensor()
        if found is not None:
            return found, tracer.made_by.get(found)
    return value, None


def _nonfinite_rejected(replay_error: BaseException | None, tracer: OpTracer | None) -> OpRecord | None:
    """A check written in Python rejected a value holding NaN/Inf (Categorical's ``logits - logsumexp`` of a row
    masked entirely to ``-inf``): the record of the op that made it, whose origin is found the usual way (dataflow
    back to the op that created the non-finite value, an op with infinite inputs and a NaN output included);
    None for a finite value outside the support (``domain_error`` at the op that made it: :func:`_python_check`)."""
    value, made = _rejected_value(replay_error, tracer)
    if value is None or made is None or made.record is None:
        return None
    with _disable_current_modes():
        if not value.is_floating_point() or not value.numel() or _all_finite(value.detach()):
            return None
    return made.record


def _checked_value(error: BaseException | None) -> torch.Tensor | None:
    """The value a check written in Python rejected: the ``value`` local of the innermost torch frame
    of ``error``'s traceback (torch.distributions' validation names it so), or None."""
    frame = _check_frame(error)
    return frame.f_locals.get("value") if frame is not None else None


def _check_frame(error: BaseException | None) -> Any:
    """The innermost torch frame of ``error``'s traceback holding a tensor ``value`` (the check's), or None."""
    if error is None or not CONSTRAINT.search(str(error)):
        return None
    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        value = frame.f_locals.get("value") if _is_library(frame.f_code.co_filename) else None
        if isinstance(value, torch.Tensor):
            return frame
    return None


def _checked_constraint(error: BaseException | None) -> Any:
    """The constraint the check applied (``Distribution.__init__``'s ``constraint``, ``_validate_sample``'s
    ``support``), or None."""
    frame = _check_frame(error)
    if frame is None:
        return None
    for name in ("constraint", "support"):
        rule = frame.f_locals.get(name)
        if rule is not None and callable(getattr(rule, "check", None)):
            return rule
    return None


def _violations(rule: Any, t: Any) -> torch.Tensor | None:
    """Where ``t`` violates the elementwise constraint ``rule`` (a bool tensor of ``t``'s shape), or None."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
        return None
    try:
        ok = rule.check(t.detach())
    except Exception:  # noqa: BLE001 - a constraint that cannot judge this tensor: no evidence
        return None
    if not isinstance(ok, torch.Tensor) or ok.shape != t.shape:
        return None
    return ~ok.bool()


def _violation_maker(value: torch.Tensor | None, made: Any, rule: Any) -> Any:
    """The origin rule applied to a constraint violation: the first op whose output violates ``rule`` at the
    rejected elements while the inputs it read there did not. From the op that made the rejected ``value``, walk
    back through an input that already held the same violating values at those elements (an add of 0, a mul by 1,
    a clamp that does not bind, a ``where``: positionally; a stack, cat, view or index: among the values it moved);
    ``softplus(-4000) = 0`` computed a new value and is the origin, as is ``exp`` of a very negative number. A
    constraint that is not elementwise (a simplex, a positive-definite matrix) keeps the walk through views."""
    while rule is not None and hasattr(rule, "base_constraint"):  # independent(positive, 1): judged per element
        rule = rule.base_constraint
    if value is None or rule is None or getattr(rule, "event_dim", 1) != 0:
        return _computed_by(made)
    with _disable_current_modes():
        cur = value.detach()
        bad = _violations(rule, cur)
        if bad is None or not bool(bad.any()):
            return _computed_by(made)
        info = made
        for _ in range(64):
            step = _carried_from(info, cur, bad, rule)
            if step is None:
                return info
            info, cur, bad = step
    return info


def _carried_from(info: Any, cur: torch.Tensor, bad: torch.Tensor, rule: Any) -> Any:
    """``(parent op, its tensor, where it violates)`` for the input of ``info`` that carried ``cur``'s violating
    values at ``bad`` unchanged, or None when ``info`` made them."""
    short = short_op(info.op)
    tensors = [a for a in (info.args or ()) if isinstance(a, torch.Tensor)]
    for a in info.args or ():
        if isinstance(a, (list, tuple)):
            tensors.extend(t for t in a if isinstance(t, torch.Tensor))
    pairs = list(zip(tensors, list(info.parents) + [None] * (len(tensors) - len(info.parents))))
    if short == "copy" and len(pairs) > 1:
        pairs = pairs[1:]  # what a copy_ wrote is its source, not the memory it overwrote
    pointwise = info.func is not None and torch.Tag.pointwise in getattr(info.func, "tags", ())
    values = cur[bad]
    for arg, parent in pairs:
        if parent is None or not arg.is_floating_point():
            continue
        arg = arg.detach()
        if pointwise:
            try:
                wide = torch.broadcast_to(arg, cur.shape)
            except RuntimeError:
                continue
            violated = _violations(rule, wide)
            if violated is None:
                continue
            carried = bad & violated & (wide.to(cur.dtype) == cur)
            if not bool(carried.any()):
                continue
            if arg.shape == cur.shape:
                return parent, arg, carried
            own = _violations(rule, arg)
            return (parent, arg, own) if own is not None else None
        if short in _CARRIERS:
            violated = _violations(rule, arg)
            if violated is None:
                continue
            carried = violated & torch.isin(arg.to(cur.dtype), values)
            if bool(carried.any()):
                return parent, arg, carried
    return None


class _KeepingLike:
    """The tracer's provenance table (``made_by``), which also keeps alive, in the order they were made,
    the replay's tensors with the shape, dtype and device of ``like`` (the value the real step's check
    rejected): a zero-code replay re-issues the loss code's ops but not the check written in Python, so
    the replayed value is found by its values (:meth:`twin`), the replay being the step again."""

    def __init__(self, inner: Any, like: torch.Tensor) -> None:
        self.inner = inner
        self.like = like.detach()
        self.kept: list[torch.Tensor] = []

    def __setitem__(self, t: torch.Tensor, info: Any) -> None:
        self.inner[t] = info
        like = self.like
        if t.shape == like.shape and t.dtype == like.dtype and t.device == like.device:
            self.kept.append(t)

    def __getitem__(self, t: torch.Tensor) -> Any:
        return self.inner[t]

    def __contains__(self, t: object) -> bool:
        return t in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def get(self, t: Any, default: Any = None) -> Any:
        return self.inner.get(t, default)

    def twin(self) -> Any:
        """The op that made the last replayed tensor equal to ``like`` (NaN matching NaN), or None."""
        t = self.twin_tensor()
        return self.inner.get(t) if t is not None else None

    def twin_tensor(self) -> torch.Tensor | None:
        """The last replayed tensor equal to ``like`` (NaN matching NaN), or None."""
        with _disable_current_modes():
            for t in reversed(self.kept):
                if torch.equal(torch.nan_to_num(t.detach(), 0.5, 1.5, -1.5),
                               torch.nan_to_num(self.like, 0.5, 1.5, -1.5)):
                    return t
        return None


def _computed_by(info: OpInfo | None) -> OpInfo | None:
    """The op that computed the values ``info`` made, through views, reshapes, copies and casts
    (``origin._TRIVIAL``): ``exp(x).squeeze(-1)`` was computed by ``exp``."""
    for _ in range(64):
        if info is None or short_op(info.op) not in _VIEWS:
            return info
        parent = _values_parent(info)
        if parent is None:
            return info
        info = parent
    return info


def raising_source(error: BaseException | None) -> str | None:
    """``path:LINE`` of the user's innermost frame in ``error``'s traceback: the call that raised."""
    if error is None:
        return None
    for frame, line in reversed(list(traceback.walk_tb(error.__traceback__))):
        if not _is_library(frame.f_code.co_filename):
            return format_source(frame.f_code.co_filename, line)
    return None


def _abandoned(incident: "Incident", failure: FailedOp | None, records: list[OpRecord], evidence: _Evidence,
               model_start: OpRecord | None, decompositions: list[Any], rejected: OpRecord | None = None) -> bool:
    """Fill ``incident`` for a step abandoned before ``backward()`` from what its replay showed."""
    cls, origin = _from_evidence(failure, records, evidence, model_start, rejected)
    if cls is None and decompositions:
        cls = _decomposition(decompositions[-1])
    if cls is None:
        return False
    incident.details["exception"] = None
    incident.details["abandoned"] = ("the step ran the model's forward and never reached backward() nor "
                                     "optimizer.step(): its exception was raised in Python code and caught by the loop")
    incident.transient = False
    incident.op, incident.module, incident.source = cls.op, cls.module, cls.source
    incident.phase, incident.cause, incident.input_stats = cls.phase, cls.cause, cls.stats
    if origin is not None:
        incident.chain = chain_summary(origin)
    summary, fix = explain(cls.cause, cls.op, module=cls.module, dtype=cls.dtype, detail=cls.detail)
    incident.summary = (f"{summary} The step then stopped before backward(): a value check (e.g. torch.distributions' "
                        "argument validation) raised, and the loop went on without it.")
    incident.fix = fix
    if cls.evidence:
        incident.details["evidence"] = {k: (str(v) if isinstance(v, float) else v) for k, v in cls.evidence.items()}
    return True


def _replay_units(watched: "Watched", units: list[Any]) -> tuple[BaseException | None, bool, list[Any]]:
    """Replay ``guard.replayable`` calls (the loss is inside them) until one raises.

    Whether the watched model's outputs were finite is read from the model's own forwards as they
    return (a forward hook for the replay), not from what the unit returned: a unit is the whole
    loss code, and when it raises (on the model's NaN, in an op that validates it) it returns nothing."""
    finite = [True]

    def outputs(module: Any, args: Any, output: Any) -> None:
        if finite[0]:
            with _disable_current_modes():  # nantrace's own reads: kept off the op trace
                finite[0] = all(output_ok(t) for t in floating_tensors(output))

    handle = watched.root.register_forward_hook(outputs, always_call=False)
    try:
        for unit in units:
            try:
                result = run_unit(watched, unit, backward=False)
            except Exception as err:
                return err, finite[0], []
            finite[0] = finite[0] and result.forward_finite
    finally:
        handle.remove()
    return None, finite[0], []


@dataclasses.dataclass
class _Evidence:
    """What ``classify`` weighs besides the origin, gathered by the replay and the flight recorder.

    The same evidence the NaN path (``localiser``) passes, so that a NaN gets the same cause
    whether it ends in a non-finite loss or in an op (or a Python check) that raises on it."""

    param_modules: dict[str, str]
    made_by: Any = None
    ignored_targets: tuple[int, int] | None = None
    history: list[dict[str, Any]] | None = None
    divergence_seen: dict[str, Any] | None = None
    externals: dict[int, str] | None = None
    """The tracer's names for tensors from outside the replayed ops (parameters, the batch)."""

    def classify(self, origin: Origin) -> Classification:
        """Classify ``origin``, a value first seen in the forward."""
        return classify(origin, observed_in="forward", low_precision_finite=None, param_modules=self.param_modules,
                        ignored_targets=self.ignored_targets, made_by=self.made_by, history=self.history,
                        divergence_seen=self.divergence_seen)


def _from_evidence(failure: FailedOp | None, records: list[OpRecord], evidence: _Evidence,
                   model_start: OpRecord | None = None,
                   rejected: OpRecord | None = None) -> tuple[Classification | None, Origin | None]:
    """``rejected``: the record of the op that made a value holding NaN/Inf that a check written in Python
    (torch.distributions' validation) rejected (:func:`_nonfinite_rejected`); its origin is that value's."""
    bad_inputs = [ref for ref in (failure.inputs if failure else []) if ref.nan or ref.inf]
    if bad_inputs:  # a non-finite value reached a validating op: diagnose that value's origin
        ref = min(bad_inputs, key=lambda r: -1 if r.producer is None else r.producer.index)
        if ref.producer is not None:
            origin = trace_back(ref.producer)
        else:
            origin = Origin(record=None, chain=[], external=ref)
        return evidence.classify(origin), origin
    upstream = _nonfinite_upstream(failure, evidence.externals or {}) if failure is not None else None
    if upstream is not None:  # an integer argument computed from NaN/Inf: a decomposition's info, a cast index
        return evidence.classify(upstream), upstream
    if failure is not None:
        verdict = _index_out_of_range(failure) or _scalar_beyond_dtype(failure) or _outside_domain(failure)
        if verdict is not None:
            return verdict, None
    if rejected is not None:  # a Python check rejected a NaN/Inf value: the origin of that value, as for a NaN loss
        origin = trace_back(rejected)
        return evidence.classify(origin), origin
    created = [r for r in records if r.creates_nonfinite and not r.is_constant]
    if model_start is not None or created:  # NaN made before a check in Python code (torch.distributions) raised
        last = model_start or created[-1]
        origin = trace_back(last) if last.out_nan else Origin(record=last, chain=[last])
        return evidence.classify(origin), origin
    return None, None


_VIEWS = {op.rstrip("_") for op in _TRIVIAL}
"""``origin._TRIVIAL`` as :func:`short_op` spells them (``copy_`` -> ``copy``)."""


_PASS_THROUGH = _VIEWS | {"round", "floor", "ceil", "trunc", "fix", "clamp", "clamp_min", "clamp_max", "clip"}
"""Ops that carry an index's values over from their input (casts, rounding, clamping, views): an
out-of-range index made by them is followed back to what they read."""


_CARRIERS = _VIEWS | {"stack", "cat", "concat", "hstack", "vstack", "index", "index_select", "gather", "take",
                      "take_along_dim", "repeat", "tile", "flip", "roll", "masked_select", "movedim", "diagonal",
                      "expand_as", "broadcast_to"}
"""Ops that move values without computing new ones: a value they carry is found among their inputs' values."""


def _tensor_parents(info: OpInfo | FailedOp) -> list[tuple[torch.Tensor, OpInfo | None]]:
    """Each positional tensor argument of an op with the forward op that made it (``parents`` holds
    them in that order)."""
    tensors = [a for a in (info.args or ()) if isinstance(a, torch.Tensor)]
    parents = list(info.parents) + [None] * (len(tensors) - len(info.parents))
    return list(zip(tensors, parents))


def _nonfinite_operand(info: OpInfo, externals: dict[int, str]) -> Origin | None:
    """The origin of a NaN/Inf that a floating argument of ``info`` held, or None."""
    for position, (arg, maker) in enumerate(_tensor_parents(info)):
        if not arg.is_floating_point() or not arg.numel():
            continue
        nan, inf = _nan_inf(arg)
        if not (nan or inf):
            continue
        if maker is not None and maker.record is not None:
            return trace_back(maker.record)
        external = externals.get(id(arg), "constant" if not nan else "unknown")
        return Origin(record=None, chain=[], external=InputRef(f"arg{position}", nan, inf, None, external))
    return None


def _garbage_index(t: torch.Tensor) -> bool:
    """An integer tensor holding a negative value or one beyond int32: what a cast of NaN/Inf to an
    integer leaves (INT64_MIN on x86, a saturated extreme elsewhere), never a valid index."""
    if not t.numel():
        return False
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return int(lo) < 0 or int(hi) > 2 ** 31 - 1


def _nonfinite_upstream(failure: FailedOp, externals: dict[int, str]) -> Origin | None:
    """The raising op received no NaN/Inf itself, but one of its integer arguments was computed from one:
    the ``info`` code of a decomposition whose matrix held NaN (``_linalg_check_errors`` raises on it), or
    an index made by casting a float that held NaN/Inf (through rounding, clamping and views, to a value
    out of range). The origin is that float's, found as for any op that received NaN; an index out of
    range as a finite value has no such float and stays ``label_out_of_range``."""
    for arg, maker in _tensor_parents(failure):
        if maker is None or arg.is_floating_point() or arg.is_complex() or arg.dtype == torch.bool:
            continue
        decomposition = short_op(maker.op).endswith("_ex")
        if not decomposition and not _garbage_index(arg):
            continue
        cur: OpInfo | None = maker
        for _ in range(32):
            if cur is None:
                break
            found = _nonfinite_operand(cur, externals)
            if found is not None:
                return found
            if decomposition or short_op(cur.op) not in _PASS_THROUGH:
                break
            cur = _values_parent(cur)
    return None


def _values_parent(info: OpInfo) -> OpInfo | None:
    """The op that made the values ``info`` carried over: the source of a ``copy_``, else its first tensor
    argument's."""
    pairs = _tensor_parents(info)
    if short_op(info.op) == "copy" and len(pairs) > 1:
        return pairs[1][1]
    return pairs[0][1] if pairs else None


def _stats(failure: FailedOp) -> list[dict[str, Any]]:
    out = []
    for i, a in enumerate(failure.args):
        if isinstance(a, torch.Tensor):
            out.append(tensor_stats(a, f"arg{i}"))
    return out


def _index_out_of_range(failure: FailedOp) -> Classification | None:
    short = short_op(failure.op)
    if short not in INDEX_OPS:
        return None
    args = failure.args
    if short in {"nll_loss_forward", "nll_loss2d_forward"} and len(args) > 1:
        logits, target = args[0], args[1]
        ignore = args[4] if len(args) > 4 and isinstance(args[4], int) else -100
        classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
        used = target[target != ignore]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= classes):
            bad = int(((used < 0) | (used >= classes)).sum())
            return Classification("label_out_of_range", failure.op, failure.module, failure.source, failure.phase,
                                  f"{bad} target(s) outside [0, {classes}): range {int(used.min())}..{int(used.max())}",
                                  str(logits.dtype).removeprefix("torch."), _stats(failure))
        return None
    if short == "embedding" and len(args) > 1:
        weight, idx = args[0], args[1]
        n = weight.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            return Classification("label_out_of_range", failure.op, failure.module, failure.source, failure.phase,
                                  f"token/class ids range {int(idx.min())}..{int(idx.max())} for an embedding of {n} rows "
                                  "(a tokenizer or label mapping larger than the model's vocabulary)",
                                  str(weight.dtype).removeprefix("torch."), _stats(failure))
        return None
    if short in ADVANCED_INDEX_OPS and len(args) > 1 and isinstance(args[0], torch.Tensor) \
            and isinstance(args[1], (list, tuple)):
        return _advanced_index_out_of_range(failure, args[0], args[1])
    if short == "one_hot" and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        return _one_hot_out_of_range(failure, args[0], args[1] if len(args) > 1 else failure.kwargs.get("num_classes", -1))
    slot = _INDEX_SLOT.get(short)
    if slot is not None and len(args) > slot and isinstance(args[0], torch.Tensor) and isinstance(args[slot], torch.Tensor):
        return _indexed_out_of_range(failure, short, args[0], args[slot], args[1] if slot == 2 else None)
    ints = [a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dtype != torch.bool]
    src = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    dim = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), 0)
    if src is not None and ints:
        size = src.shape[dim] if src.dim() else 1
        idx = ints[0]
        if idx.numel() and (int(idx.min()) < -size or int(idx.max()) >= size):
            return Classification("label_out_of_range", failure.op, failure.module, failure.source, failure.phase,
                                  f"indices range {int(idx.min())}..{int(idx.max())} for a dimension of {size}",
                                  str(src.dtype).removeprefix("torch."), _stats(failure))
    return None


_INDEX_SLOT = {"gather": 2, "scatter": 2, "scatter_add": 2, "scatter_reduce": 2, "index_select": 2, "index_add": 2,
               "take": 1}
"""Where each indexing op takes its index (``gather(self, dim, index)``, ``take(self, index)``): the indexed tensor is
``self``, whatever its dtype (an integer lookup table: a vocabulary remap)."""


def _one_hot_out_of_range(failure: FailedOp, labels: torch.Tensor, classes: Any) -> Classification | None:
    """``F.one_hot(labels, num_classes)``: a negative label (an ignore index such as -100) or one past the classes."""
    if not labels.numel():
        return None
    lo, hi = int(labels.min()), int(labels.max())
    n = classes if isinstance(classes, int) and not isinstance(classes, bool) and classes > 0 else None
    if lo >= 0 and (n is None or hi < n):
        return None
    return Classification("label_out_of_range", failure.op, failure.module, failure.source, failure.phase,
                          f"labels range {lo}..{hi}" + (f" for {n} classes" if n is not None else " (must be >= 0)"),
                          None, _stats(failure))


def _indexed_out_of_range(failure: FailedOp, short: str, src: torch.Tensor, idx: torch.Tensor,
                          dim: Any) -> Classification | None:
    """An index of ``src`` along ``dim`` (``take``: into the flattened tensor) outside its size."""
    if idx.is_floating_point() or idx.dtype == torch.bool or not idx.numel():
        return None
    if short == "take" or not src.dim():
        size, where = src.numel(), f"a tensor of {src.numel()} elements"
    else:
        d = dim if isinstance(dim, int) and not isinstance(dim, bool) else 0
        size, where = src.shape[d], f"dimension {d} of size {src.shape[d]}"
    lo, hi = int(idx.min()), int(idx.max())
    if lo >= -size and hi < size and not (short in {"gather", "scatter", "scatter_add", "scatter_reduce"} and lo < 0):
        return None
    return Classification("label_out_of_range", failure.op, failure.module, failure.source, failure.phase,
                          f"indices range {lo}..{hi} for {where}", str(src.dtype).removeprefix("torch."), _stats(failure))


def _advanced_index_out_of_range(failure: FailedOp, src: torch.Tensor, indices: Sequence[Any]) -> Classification | None:
    """``x[t]`` / ``x[i, j] = v``: the k-th index tensor of the list addresses dimension k of ``x`` (``None`` is a
    full slice there); an integer index outside ``[-size, size)`` of its dimension is what raised. Boolean masks
    (which cover several dimensions) are left to the generic rule."""
    for k, idx in enumerate(indices):
        if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.dtype in (torch.bool, torch.uint8) \
                or not idx.numel() or k >= src.dim():
            continue
        size = src.shape[k]
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -size or hi >= size:
            where = f"dimension {k} of size {size}" if src.dim() > 1 else f"a tensor of {size} elements"
            return Classification("label_out_of_range", failure.op, failure.module, failure.source, failure.phase,
                                  f"indices range {lo}..{hi} for {where}", str(src.dtype).removeprefix("torch."),
                                  _stats(failure))
    return None


def _scalar_beyond_dtype(failure: FailedOp) -> Classification | None:
    """A Python number passed to an op on a tensor whose dtype cannot hold it (``masked_fill(mask,
    -1e9)`` on float16 scores): torch refuses to convert it and raises. Judged on the values: the
    number is finite and beyond the tensor dtype's max. In float16/bfloat16, a number float32 holds
    is a low-precision overflow; beyond float32 too, an overflow."""
    x = next((a for a in failure.args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if x is None:
        return None
    limit = torch.finfo(x.dtype).max
    numbers = [a for a in (*failure.args, *failure.kwargs.values())
               if isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)]
    beyond = [a for a in numbers if abs(a) > limit]
    if not beyond:
        return None
    value = max(beyond, key=abs)
    name = str(x.dtype).removeprefix("torch.")
    low = x.dtype in (torch.float16, torch.bfloat16) and abs(value) <= torch.finfo(torch.float32).max
    detail = f"the constant {value:g} does not fit {name} (max {limit:g})"
    return Classification("precision_overflow" if low else "overflow", failure.op, failure.module, failure.source,
                          failure.phase, detail, name, _stats(failure), {"constant": value, "dtype_max": limit})


def _outside_domain(failure: FailedOp) -> Classification | None:
    """A validating op that raised on finite values outside its domain."""
    short = short_op(failure.op)
    if short == "_linalg_check_errors" and failure.parents and failure.parents[0] is not None:
        return _decomposition(failure.parents[0])  # the decomposition whose info code the check raised on
    if not is_value_message(str(failure.error)):
        return None
    x = next((a for a in failure.args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    detail = str(failure.error).strip().splitlines()[0][:160]
    if x is not None and x.numel() and short in {"binary_cross_entropy", "multinomial", "bernoulli"}:
        xd = x.detach().double()
        detail = (f"{int(((xd < 0) | (xd > 1)).sum())} value(s) outside [0, 1], range "
                  f"{float(xd.min()):.4g}..{float(xd.max()):.4g}")
    dtype = str(x.dtype).removeprefix("torch.") if x is not None else None
    return Classification("domain_error", failure.op, failure.module, failure.source, failure.phase, detail, dtype,
                          _stats(failure))
