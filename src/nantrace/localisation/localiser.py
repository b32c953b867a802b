"""From an incident seen by the sentinel to an exact diagnosis.

Replays the failing step's captured units under the op tracer, finds the origin by the
origin rule, re-runs in float32 when low precision was involved (overflow vs. a genuine
math error), treats a failure the identical replay does not reproduce as transient, and
writes op, module, source, cause, summary, fix, input statistics and chain into the
incident. Costs nothing until an incident happens.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import TYPE_CHECKING, Any

import torch

from ..capture import CallRecord, ForwardRecord, StepCapture, floating_tensors
from ..diagnosis.classify import LOW_PRECISION, Classification, classify
from ..diagnosis.patterns import explain
from ..diagnosis.triage import PARAMS_WITHOUT_UPDATE, PARAMS_WRITTEN_UNSEEN, Finding
from ..response.policies import action_for
from ..taxonomy import Action
from .modules import ModuleStack
from .origin import Origin, backward_start, chain_summary, trace_back
from ..loss_tape import unread_nograd_forwards
from .gradient_code import localise_parameter_writes, replay_gradient_code, replay_written_gradients, replayed_gradients
from .loss_replay import replay_step, trace_prelude_inputs
from .rerun import RerunSkipped, float32_model, output_ok, rerun_scope, run_unit
from .tracer import OpRecord, OpTracer, _storage_key, all_finite

if TYPE_CHECKING:
    from ..watched import Watched
    from ..incident import Incident
    from .lockstep import Lockstep


class NotReplayable(Exception):
    """The user's forward raised when re-run from the captured state; ``__cause__`` is its exception."""


def localise_incident(watched: "Watched", incident: "Incident", capture: StepCapture, *,
                      lockstep: "Lockstep | None" = None, raised: BaseException | None = None) -> None:
    """Fill in ``incident`` from a replay of the step; never raises into the training loop.

    ``lockstep``: every rank runs this replay together (FSDP2, ``lockstep.py``): each unit is
    replayed forward and backward on every rank, and rank-dependent choices are agreed.
    ``raised``: the exception the real step raised (a gradient hook of the user's refusing a NaN
    gradient stopped its backward): a replay that raises it again reproduced the step up to its
    failure, and what it traced until then is the evidence (:func:`raised_again`).
    """
    start = time.perf_counter()
    abandoned = incident.details.get("abandoned_forward")
    if isinstance(abandoned, int) and abandoned < len(capture.forwards) and capture.tape is not None \
            and capture.forwards[abandoned].abandoned_loss is not None:
        capture = capture.abandoned_sub_step(abandoned)  # the sub-step the loop left: its forwards and loss code
    try:
        try:
            _localise(watched, incident, capture, lockstep, raised)
        except NotReplayable:
            if not (capture.calls and capture.forwards and capture.tape is not None and capture.tape.usable
                    and lockstep is None):
                raise
            # re-running the replayable call raised (its state moved on since): the step's taped loss code did not
            incident.details["replayable_call_raised"] = True
            _localise(watched, incident, capture.without_calls(), lockstep, raised)
        except RerunSkipped as skipped:  # re-running the call would advance an iterator of the user's for good
            incident.details["rerun_skipped"] = str(skipped)
            if not (capture.forwards and capture.tape is not None and capture.tape.usable and lockstep is None):
                raise
            _localise(watched, incident, capture.without_calls(), lockstep, raised)  # the forwards and tapes
    except RerunSkipped as exc:
        incident.summary = f"{incident.summary} The step was not replayed to name the origin: {exc}."
    except NotReplayable as exc:
        cause = exc.__cause__
        incident.details["not_replayable"] = f"{type(cause).__name__}: {cause}"
        incident.summary = (f"{incident.summary} The step could not be replayed to name the origin: re-running the model "
                            f"raised {type(cause).__name__}: {cause} (side effects, state changed since, or data-dependent "
                            "control flow make the re-run differ from the real step).")
    except Exception as exc:  # a diagnosis that fails must not take the training run down, nor hide
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
        incident.details["localisation_error"] = f"{type(exc).__name__}: {exc}{at}"
        if incident.cause == "unknown":
            incident.summary = (f"{incident.summary} nantrace's own localisation failed ({type(exc).__name__}: {exc}); "
                                "the bundle keeps the step for `nantrace replay`.")
    finally:
        incident.details["localisation_seconds"] = round(time.perf_counter() - start, 4)
    settle_parameter_writes(watched, incident)
    _settle_state_read(watched, incident)


def _settle_state_read(watched: "Watched", incident: "Incident") -> None:
    """The replay found the step reading a parameter or buffer that was already non-finite (a buffer the
    triage does not read: a normaliser's running variance an earlier step's code wrote NaN): skipping the update
    cannot repair it, so the incident gets the policy's action for that state, as the check's own finding would."""
    if incident.kind != "nonfinite_param" or incident.cause != "nonfinite_param" or incident.phase is not None \
            or incident.action != Action.SKIPPED or incident.details.get(PARAMS_WITHOUT_UPDATE):
        return
    finding = Finding(incident.step, "nonfinite_param", None, "nonfinite_param", incident.module, incident.summary,
                      incident.fix)
    incident.action = action_for(watched.policy, finding, finite_trouble=False, config=watched.config)


def settle_parameter_writes(watched: "Watched", incident: "Incident") -> None:
    """Judge parameters that were non-finite at the step's check though no update had changed them since
    ``watch()`` read them finite (``triage.PARAMS_WITHOUT_UPDATE``), from the replay's verdict.

    The replay starts from the step's captured state and re-runs its code: when it shows the step's own
    code making the failure (a data-dependent initialisation dividing by the std of a constant column and
    writing the result into the parameters), that op is the diagnosis and the parameters are its effect.
    When it reads them non-finite before any op of the step made them so, or establishes nothing, they were
    written before the step (a load after ``watch()`` that no integration recorded, an in-place write):
    the incident is the check's ``nonfinite_param``, with the policy's action for it (skipping cannot
    repair them)."""
    if not incident.details.get(PARAMS_WITHOUT_UPDATE):
        return
    bad = [str(b["name"]) for b in incident.details.get("nonfinite_params") or []]
    names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") or "parameters"
    if incident.cause not in ("unknown", "nonfinite_param"):
        incident.summary = (f"{incident.summary} The step's own code also wrote non-finite values into {names} "
                            "(finite when watch() read them); skipping the update does not undo that.")
        return
    incident.kind, incident.cause = "nonfinite_param", "nonfinite_param"
    incident.phase = incident.op = incident.source = None
    incident.transient = None
    if bad:
        incident.module = bad[0].rpartition(".")[0]
    incident.summary, incident.fix = explain("nonfinite_param", detail=(
        f"{names}: no update has changed the parameters since watch() read them finite, and the replay of the step "
        "does not show its own code making them so: they were written before it (a load, an in-place write)"))
    if incident.action == Action.SKIPPED:  # not escalated: the policy's action for a state the update cannot repair
        finding = Finding(incident.step, "nonfinite_param", None, "nonfinite_param", incident.module, incident.summary,
                          incident.fix)
        incident.action = action_for(watched.policy, finding, finite_trouble=False, config=watched.config)


def externals_of(watched: "Watched", units: list[Any]) -> dict[int, str]:
    ext: dict[int, str] = {}
    for name, p in watched.root.named_parameters():
        ext[id(p)] = f"param:{name}"
    for name, b in watched.root.named_buffers():
        ext[id(b)] = f"buffer:{name}"
    for unit in units:
        for t in floating_tensors((unit.args, unit.kwargs)):
            ext[id(t)] = "input"
    return ext


def param_modules(watched: "Watched") -> dict[str, str]:
    names = [n for n, _ in watched.root.named_parameters()] + [n for n, _ in watched.root.named_buffers()]
    return {n: n.rpartition(".")[0] for n in names}


def _is_low_precision(watched: "Watched", unit: Any) -> bool:
    if unit.autocast.low_precision:
        return True
    if any(p.dtype in LOW_PRECISION for p in watched.params):
        return True
    return any(t.dtype in LOW_PRECISION for t in floating_tensors((unit.args, unit.kwargs)))


def _saw_low_precision(tracer: OpTracer | None) -> bool:
    """A value the replay traced was float16/bfloat16 (autocast entered inside the replayed call or
    the model's forward, not around it)."""
    return tracer is not None and (tracer.saw_low_precision or any(
        r.output is not None and r.output.dtype in LOW_PRECISION for r in tracer.records))


def _unmasked_minus_inf(tracer: OpTracer, observed: list[torch.Tensor]) -> int | None:
    """The first output that passes the capture's rule (finite or ``-inf``) but holds a ``-inf`` no
    mask made: the replay traces it to an op (a log of 0, an overflow), not to a ``-inf`` fill or a
    mask passed in. The capture could not tell it from a mask; the replay can."""
    for i, t in enumerate(observed):
        if not t.numel() or not output_ok(t) or not bool(torch.isneginf(t.detach()).any()):
            continue
        rec = tracer.producer.get(t)
        if rec is not None and not trace_back(rec).intentional_inf:
            return i
    return None


def _tape_low_precision(watched: "Watched", tape: Any, units: list[Any]) -> bool:
    """The loss code ran under autocast, or the model or its inputs are float16/bfloat16."""
    return bool(tape.autocast is not None and tape.autocast.low_precision) or any(
        _is_low_precision(watched, unit) for unit in units)


def _localise(watched: "Watched", incident: "Incident", capture: StepCapture, lockstep: "Lockstep | None",
              raised: BaseException | None = None) -> None:
    if incident.details.get(PARAMS_WRITTEN_UNSEEN):  # nonfinite_param: did the step's code after backward() write them?
        localise_parameter_writes(watched, incident, capture)
        return
    if _gradients_written_by_step_code(incident, capture):
        _localise_written_gradients(watched, incident, capture)
        return
    units: list[Any] = list(capture.calls) or list(capture.forwards)
    if not units:
        incident.details["localisation"] = "nothing to replay: no forward of the watched model ran in this step"
        return
    replayable = isinstance(units[0], CallRecord)
    compiled = hasattr(watched.model, "_orig_mod")
    # Were the model's outputs finite in the real step? (None: not checked.) When they were
    # not, the gradients recorded at the outputs came back from a non-finite loss and say
    # nothing about the loss function.
    outputs_finite = None if capture.outputs_ok is None else bool(capture.outputs_ok)
    externals = externals_of(watched, units)
    observed_in: str | None = None
    start: OpRecord | None = None
    origin: Origin | None = None
    failing_unit: Any = None
    loss_error: str | None = None
    tracer: OpTracer | None = None
    finite32: bool | None = None
    minus_inf_output: int | None = None  # the failing output held only a -inf no mask made
    tape = capture.tape if not replayable else None
    # The loss was non-finite while the model's outputs were finite: the loss code is where it began.
    loss_side = incident.kind == "nonfinite_loss" and outputs_finite is True and tape is not None and tape.usable
    together = lockstep is not None
    unread = set() if together else unread_nograd_forwards(capture.tape, capture.prelude, units)
    unit_grads: dict[int, torch.Tensor] = {}  # the step's gradients as backward() left them, replayed
    gradient_code = None
    with rerun_scope(watched) as notes:
        for index, unit in enumerate(units):
            if observed_in is not None:  # found (lockstep only): keep replaying with the other ranks
                run_unit(watched, unit, together=True)
                continue
            if index in unread:  # an evaluation pass between steps: nothing of the step came from it
                continue
            modules = ModuleStack(watched.root)
            tracer = OpTracer(modules, externals)
            try:
                with modules, tracer:
                    result = run_unit(watched, unit, together=together)
                    tracer.flush()
            except RerunSkipped:
                raise
            except Exception as exc:  # the user's code raised on re-run: the step cannot be replayed, unless it
                found = _evidence_of_raise(exc, raised, tracer)  # raised as the real step did: then it reproduced it
                if found is None:
                    raise NotReplayable(exc) from exc
                (observed_in, start), failing_unit = found, unit
                _note_raised_again(incident, exc)
                incident.details["replayed_unit"] = index
                break
            replayed_gradients(unit_grads, result.grads)
            if not result.forward_finite:
                observed_in = "forward"
                bad = [t for t in result.observed if not output_ok(t)]  # NaN or +inf: a -inf mask is valid
                start = next((tracer.producer.get(t) for t in bad if tracer.producer.get(t) is not None), None)
            elif (minus_inf_output := _unmasked_minus_inf(tracer, result.observed)) is not None:
                observed_in = "forward"
                start = tracer.producer.get(result.observed[minus_inf_output])
            elif loss_side:
                continue
            elif result.output_grads_finite is False and outputs_finite is not False:
                observed_in = "loss_function"
            elif result.grads_finite is False:
                observed_in = "backward"
                start = backward_start(tracer.records)
            else:
                continue
            failing_unit = unit
            incident.details["replayed_unit"] = index
            if not together:
                break
        if observed_in == "forward" and not together and _after_step_code(tape, units, failing_unit):
            # the failing forward ran after other code of the step (an earlier micro-batch's forward and loss code):
            # trace it in the one graph the step built up to it, where its arguments have their producers
            retraced = _in_step_order(watched, capture, units, failing_unit, minus_inf_output)
            if retraced is not None:
                tracer, start = retraced
                incident.details["replayed_in_step_order"] = True
        wants_tape = observed_in in (None, "loss_function") and tape is not None and tape.usable \
            and outputs_finite is not False
        if together:  # one rank's wish replays the loss code on every rank; the others discard it
            assert lockstep is not None
            wants_tape = wants_tape and lockstep.diagnose
            able = tape is not None and tape.usable and bool(tape.losses or tape.loss is not None)
            if lockstep.any(wants_tape) and not lockstep.any(not able):
                side_tracer = OpTracer(ModuleStack(watched.root), externals)
                with side_tracer.modules, side_tracer:
                    side = replay_step(watched, units, tape, side_tracer, together=True, prelude=capture.prelude)
                if not wants_tape:
                    side_tracer = None
            elif wants_tape:
                incident.details["loss_code"] = "not replayed: another rank could not replay its loss code"
                wants_tape = False
        if wants_tape:
            # The model replays finite: the failure was born in the loss code. Replay the whole step,
            # forwards and loss tape in one graph, then its backward into the parameters.
            assert tape is not None
            if together:
                tracer, taped = side_tracer, side
            else:
                modules = ModuleStack(watched.root)
                tracer = OpTracer(modules, externals)
                with modules, tracer:
                    taped = replay_step(watched, units, tape, tracer, prelude=capture.prelude)
            incident.details["loss_code_replayed"] = len(tape.entries)
            again = _evidence_of_raise(taped.error, raised, tracer) if taped.error is not None else None
            if again is not None:
                (observed_in, start), failing_unit = again, tape
                _note_raised_again(incident, taped.error)
            elif taped.error is not None:
                loss_error = f"{type(taped.error).__name__}: {taped.error}"
                incident.details["loss_code_error"] = loss_error
            elif not taped.forward_finite and taped.loss is not None:
                observed_in, failing_unit = "forward", tape
                start = tracer.producer.get(taped.loss)
            elif taped.grads_finite is False:
                observed_in, failing_unit = "backward", tape
                start = backward_start(tracer.records)
        elif observed_in == "loss_function" and tape is not None:
            incident.details["loss_code"] = ("not replayable: " + ("more than the tape's limit of calls"
                                             if tape.truncated else "the loss code left no tape"))
        grad_tape = capture.gradient_tape
        if observed_in is None and loss_error is None and not together and not watched.sharded \
                and incident.kind == "nonfinite_grad" and grad_tape is not None and grad_tape.usable and unit_grads:
            # Forward, loss and backward replay finite: the code between backward() and step() is left.
            # Fresh names: the shared table also holds ids of the earlier replays' copies, long dead, which
            # a tensor made now (a NaN scalar written into a gradient) may reuse.
            tracer = OpTracer(ModuleStack(watched.root), externals_of(watched, units))
            gradient_code = replay_gradient_code(watched, grad_tape, unit_grads, tracer)
            incident.details["gradient_code_replayed"] = len(grad_tape.entries)
            again = _evidence_of_raise(gradient_code.error, raised, tracer) if gradient_code.error is not None else None
            if again is not None:
                observed_in, start, failing_unit = "gradient_code", again[1], None
                _note_raised_again(incident, gradient_code.error)
            elif gradient_code.error is not None:
                incident.details["gradient_code_error"] = f"{type(gradient_code.error).__name__}: {gradient_code.error}"
            elif not gradient_code.finite:
                observed_in, start, failing_unit = "gradient_code", gradient_code.start, None
                incident.details["gradient_code_made_nonfinite"] = gradient_code.bad
        incident.details["ops_replayed"] = tracer.ops_seen if tracer is not None else 0
        if together and observed_in is not None and failing_unit is not None and failing_unit is not tape \
                and watched.config.localisation.precision_check and _is_low_precision(watched, failing_unit):
            incident.details["float32_rerun"] = "not run: under FSDP2 the replay runs on every rank together"
        elif observed_in is not None and failing_unit is not None and failing_unit is not tape and watched.config.localisation.precision_check \
                and (_is_low_precision(watched, failing_unit) or _saw_low_precision(tracer)):
            try:
                with float32_model(watched.root):
                    r32 = run_unit(watched, failing_unit, full_precision=True, backward=observed_in == "backward")
                finite32 = r32.forward_finite and r32.grads_finite is not False and (
                    minus_inf_output is None or bool(torch.isfinite(r32.observed[minus_inf_output]).all()))
            except Exception as exc:  # the step's own exception, raised again in float32: not finite there either
                if not raised_again(exc, raised):
                    raise
                finite32 = False
            incident.details["float32_rerun_finite"] = finite32
        elif observed_in is not None and failing_unit is tape and not together \
                and watched.config.localisation.precision_check and tape is not None \
                and (_tape_low_precision(watched, tape, units) or _saw_low_precision(tracer)):
            # the loss code failed (zero-code mode): replay the whole step, forwards and tape, in float32
            with float32_model(watched.root):
                t32 = replay_step(watched, units, tape, OpTracer(ModuleStack(watched.root), externals),
                                  prelude=capture.prelude, full_precision=True)
            finite32 = t32.error is None and t32.forward_finite and t32.grads_finite is not False
            incident.details["float32_rerun_finite"] = finite32
    incident.details.update(notes.details)  # Python state the re-runs could not leave as they found it

    if observed_in is None and replayable and not together and capture.forwards and capture.tape is not None \
            and capture.tape.usable:
        # The replayable call, re-run, is finite: a loss function that keeps state between calls (a running
        # history, a counter) computes something else the second time. The step's own taped loss code does not.
        incident.details["replayable_call_finite"] = True
        _localise(watched, incident, capture.without_calls(), lockstep, raised)
        return
    if observed_in is None:
        if loss_error is not None or (tape is not None and tape.truncated):
            _loss_code_not_replayed(incident, loss_error)
            return
        if not replayable and incident.kind == "nonfinite_loss" and outputs_finite:
            _in_loss_function(incident)
            return
        _not_reproduced(incident, compiled)
        return
    incident.transient = False
    if observed_in == "loss_function":
        summary = (f"The gradient arriving at the model's outputs is already non-finite at step {incident.step}: "
                   "it arose in the loss computation outside the model.")
        incident.phase = incident.phase or "backward"
        incident.module = None
        incident.summary = summary
        incident.fix = ("Wrap the loss computation with guard.replayable(loss_fn) so nantrace can replay it "
                        "and name the op and line.")
        return
    if start is None:
        incident.details["localisation"] = "the non-finite value was observed but no traced op produced it"
        return
    origin = trace_back(start)
    if isinstance(failing_unit, CallRecord) and not together \
            and (_met_earlier_state(origin) or _origin_read_earlier_state(origin, tracer)) \
            and capture.forwards and capture.tape is not None and capture.tape.usable:
        # The re-run of the replayable call ended at a NaN that was in the program's state before it began and
        # did not come in through its arguments, or its origin op read such state (a temperature an earlier call
        # stored on the loss object): the real call (or code before it) put it there, so the re-run read other
        # values than the real call did. The step's forwards and taped code hold the real call's.
        incident.details["replayable_call_read_later_state"] = str(origin.record.op if origin.record else None)
        _localise(watched, incident, capture.without_calls(), lockstep, raised)
        return
    if origin.external is not None and origin.external.external == "input" and not together \
            and isinstance(failing_unit, (ForwardRecord, CallRecord)) and (
                (capture.prelude is not None and capture.prelude.usable) or _after_step_code(tape, units, failing_unit)):
        made = _made_before_forward(watched, capture, units, failing_unit)
        if made is not None:
            origin, tracer = made
            if incident.kind in ("nonfinite_loss", "nonfinite_grad", "nonfinite_activation") \
                    and _feeds_model(capture, failing_unit):
                # what went bad first in the step's dataflow is the model's input (a -inf there passed the capture's
                # mask rule; the replay shows an op made it, no mask): as for an input made bad in the prelude
                incident.kind = "nonfinite_input"
    if origin.external is not None and origin.external.external == "input" and _prelude_forgot_calls(capture):
        # no kept call made it, but the step's code before the forward ran more calls than the prelude keeps: the
        # batch is blamed only when the prelude saw all of that code (as for _made_before_forward)
        _received_from_untaped_code(incident, origin)
        return
    cls = classify(origin, observed_in=observed_in, low_precision_finite=finite32, param_modules=param_modules(watched),
                   ignored_targets=tracer.ignored_targets if tracer is not None else None,
                   made_by=tracer.made_by if tracer is not None else None, history=incident.history,
                   divergence_seen=incident.details.get("divergence"))
    _apply(incident, cls, origin, replayable=replayable)
    if observed_in == "gradient_code" and cls.cause not in ("nonfinite_param", "nonfinite_input"):
        _in_gradient_code(incident, cls, gradient_code.bad if gradient_code is not None else [])


def _gradients_written_by_step_code(incident: "Incident", capture: StepCapture) -> bool:
    """Whether the step's non-finite gradients were written by its own code, not by a backward of the model: no
    ``replayable`` call, no forward of the model under grad mode (a forward under ``torch.no_grad()`` makes no
    gradient: an evolution strategy's evaluation of its candidates) and no ``backward()`` seen. Per-sample gradients
    from a ``torch.func`` transform (whose calls nothing records), an evolution-strategies estimate, a gradient
    written by hand: the code that wrote ``p.grad`` ran with no forward to end the prelude, which taped it."""
    if incident.kind != "nonfinite_grad" or capture.calls or capture.losses:
        return False
    if capture.tape is not None and (capture.tape.losses or capture.tape.loss is not None):
        return False
    return not any(getattr(f, "grad_enabled", True) for f in capture.forwards)


def _localise_written_gradients(watched: "Watched", incident: "Incident", capture: StepCapture) -> None:
    """Diagnose gradients the step's own code wrote (:func:`_gradients_written_by_step_code`) from a replay of the
    prelude's kept calls on their real inputs (``gradient_code.replay_written_gradients``); when it shows no op of
    that code making them non-finite, or cannot run, say so and conclude nothing."""
    prelude = capture.prelude
    said = "no backward() ran: the step's own code wrote the gradients, and "
    if prelude is None or not prelude.usable:  # nothing taped, or more calls than the prelude keeps (it then stops)
        incident.details["localisation"] = said + "it was not taped (no call, or more than the prelude keeps)"
        return
    tracer = OpTracer(ModuleStack(watched.root), externals_of(watched, []))
    with rerun_scope(watched):
        written = replay_written_gradients(watched, prelude, tracer)
    incident.details["gradient_code_replayed"] = len(prelude.entries)
    incident.details["ops_replayed"] = tracer.ops_seen
    if written.error is not None:
        incident.details["gradient_code_error"] = f"{type(written.error).__name__}: {written.error}"
        return
    origin = trace_back(written.start) if written.start is not None else None
    if origin is None:
        incident.details["localisation"] = said + "its replay is finite"
        return
    if origin.external is not None and origin.external.external == "input":
        # it received them non-finite from code no tape sees (inside a torch.func transform): no op of it to name
        incident.details["localisation"] = said + "it received them non-finite from code that was not taped " \
            "(inside a torch.func transform, say)"
        return
    cls = classify(origin, observed_in="gradient_code", low_precision_finite=None, param_modules=param_modules(watched),
                   made_by=tracer.made_by, history=incident.history, divergence_seen=incident.details.get("divergence"))
    _apply(incident, cls, origin, replayable=False)
    incident.transient = False
    incident.details["gradients_written_by_step_code"] = written.bad
    if cls.cause not in ("nonfinite_param", "nonfinite_input"):
        _in_gradient_code(incident, cls, written.bad, written=True)


def raised_again(error: BaseException | None, raised: BaseException | None) -> bool:
    """Whether a replay raised the real step's own exception: the same type and message (a gradient hook of the
    user's refusing the NaN gradient again, anomaly mode's check again). Such a replay reproduced the step up to
    its failure; it is no sign that the step cannot be replayed."""
    return error is not None and raised is not None and type(error) is type(raised) and str(error) == str(raised)


def _evidence_of_raise(error: BaseException | None, raised: BaseException | None,
                       tracer: OpTracer) -> tuple[str, OpRecord] | None:
    """(where the failure was observed, where the origin search starts) in a replay that raised the real step's
    exception again: the first live backward op with a non-finite output (a hook refused the gradient it reached),
    else the last forward op that made one; None when the exception is another one, or the replay traced no
    non-finite value before it (then it is not about a value the replay can show)."""
    if not raised_again(error, raised):
        return None
    tracer.flush()
    start = backward_start(tracer.records)
    if start is not None:
        return "backward", start
    made = [r for r in tracer.records if r.phase == "forward"]
    return ("forward", made[-1]) if made else None


def _note_raised_again(incident: "Incident", error: BaseException | None) -> None:
    """Say in the incident that its replay stopped where the real step did, with the same exception."""
    incident.details["replay_raised_again"] = f"{type(error).__name__}: {error}"


def _after_step_code(tape: Any, units: list[Any], unit: Any) -> bool:
    """Whether ``unit`` (a recorded forward) ran after code of the step that the loss tape kept or after another
    forward: its arguments may be values the step made (a temperature from the first micro-batch's logits, a
    micro-batch standardised by the previous one's statistics), which a replay of the forward alone takes for the
    batch."""
    if not isinstance(unit, ForwardRecord) or tape is None or not tape.usable:
        return False
    return unit is not units[0] or getattr(unit, "tape_at", 0) > 0


def _replay_until(watched: "Watched", capture: StepCapture, units: list[Any], unit: Any) -> tuple[OpTracer, Any] | None:
    """The step replayed in its real order up to and including the forward ``unit``, under one fresh tracer (the
    prelude, the earlier forwards and the loss code's calls before it: ``loss_replay.replay_step(until=...)``):
    (tracer, its ``StepResult``), or None when that replay raised. Call inside ``rerun_scope``."""
    index = next(i for i, u in enumerate(units) if u is unit)
    tracer = OpTracer(ModuleStack(watched.root), externals_of(watched, units))
    with tracer.modules, tracer:
        step = replay_step(watched, units, capture.tape, tracer, backward=False, prelude=capture.prelude, until=index)
    if step.error is not None or len(step.unit_outputs) != index + 1:
        return None
    return tracer, step


def _in_step_order(watched: "Watched", capture: StepCapture, units: list[Any], unit: Any,
                   minus_inf_output: int | None) -> tuple[OpTracer, OpRecord] | None:
    """(tracer, where the origin search starts) for the failing forward ``unit`` replayed in the step's real order
    (:func:`_replay_until`), so that an argument the step made before it is traced to the op that made it and the
    provenance rules see that op (a divisor that is the std of an earlier micro-batch's logits); None when that
    replay fails or does not show the failure."""
    replayed = _replay_until(watched, capture, units, unit)
    if replayed is None:
        return None
    tracer, step = replayed
    outputs = step.unit_outputs[-1]
    if minus_inf_output is not None:
        bad = outputs[minus_inf_output:minus_inf_output + 1]
    else:
        bad = [t for t in outputs if not output_ok(t)]
    start = next((tracer.producer.get(t) for t in bad if tracer.producer.get(t) is not None), None)
    return (tracer, start) if start is not None else None


def _met_earlier_state(origin: Origin) -> bool:
    """Whether the trace ends at a NaN that existed before the replay began and that is neither the
    model's state (a parameter or buffer: ``nonfinite_param``) nor an argument of the replayed unit (the
    batch, or a value the prelude made): state the replayed code reads by itself (a loss object's
    attribute, a queue it keeps). When a ``replayable`` call is re-run, that state is as the real call
    left it, written after use or rebound since, so the re-run proves nothing about the real call."""
    ext = origin.external.external if origin.external is not None else None
    return ext is not None and ext != "input" and not ext.startswith(("param:", "buffer:"))


def _origin_read_earlier_state(origin: Origin, tracer: OpTracer | None) -> bool:
    """Whether the origin op read a tensor that no op of the replay made and that is neither the model's state
    (a parameter, a buffer) nor an argument of the replayed unit: state the replayed code found by itself (an
    attribute of the loss object, a global). A ``replayable`` call re-run reads it as the real step left it, after
    the real call (and later calls) updated it, so the re-run's operands may not be the real call's (see
    :func:`_met_earlier_state`)."""
    rec = origin.record
    if tracer is None or rec is None or rec.func is None or rec.phase != "forward":
        return False
    written = {i for i, arg in enumerate(rec.func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write}
    operands = [a for i, a in enumerate(rec.args or ()) if i not in written] + list((rec.kwargs or {}).values())
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() and tracer.made_by.get(t) is None
               and id(t) not in tracer.externals for t in operands)


def _made_before_forward(watched: "Watched", capture: StepCapture, units: list[Any],
                         unit: Any) -> tuple[Origin, OpTracer] | None:
    """The origin of a non-finite model input that the step's own code made before the forward
    (features standardised by the batch's std, boxes encoded, targets rescaled), found by replaying
    the prelude, and, for a forward that ran after loss code of the step (the second micro-batch's,
    standardised by the first one's statistics in the loss code between them), the step in its real
    order up to it: the batch itself is blamed only when no taped call made that input."""
    if unit is None:
        return None
    bad = [t for t in floating_tensors((unit.args, unit.kwargs)) if not all_finite(t)]
    made = None
    if _after_step_code(capture.tape, units, unit):
        with rerun_scope(watched):
            made = _made_in_step(watched, capture, units, unit, bad)
    if made is None:
        with rerun_scope(watched):
            made = _made_in_prelude(watched, capture, unit, bad)
    if made is None:
        return None
    tracer, start = made
    origin = trace_back(start)
    return (origin, tracer) if origin.external is None and origin.record is not None else None


def _feeds_model(capture: StepCapture, unit: Any) -> bool:
    """Whether a non-finite argument of ``unit`` that the step's own code made is an input of a model forward: a
    forward's argument is; a ``replayable`` call's argument only where the step passed it (or a view of it) to a
    forward of the model. One the call only used in its loss (the batch's rewards, normalised in place) made the
    loss non-finite, not the model's input."""
    if not isinstance(unit, CallRecord):
        return True
    bad = {_storage_key(t) for t in floating_tensors((unit.args, unit.kwargs)) if not all_finite(t)}
    bad.discard(None)
    return any(_storage_key(t) in bad for f in capture.forwards for t in floating_tensors((f.args, f.kwargs)))


def _prelude_forgot_calls(capture: StepCapture) -> bool:
    """Whether the step's code before the model's forward ran more calls than the prelude keeps (its last
    ``PRELUDE_ENTRIES``; it started over, or stopped recording, this step): a tensor no kept call made may then have
    been made by a call it forgot, so it is no longer evidence that the value came with the batch."""
    return capture.prelude is not None and getattr(capture.prelude, "_restarts", 0) > 0


def _received_from_untaped_code(incident: "Incident", origin: Origin) -> None:
    """The trace ends at a non-finite tensor that no replayed op made, received by ``origin.record`` (a forward
    argument or a value the loss code read) in a step whose prelude forgot calls (:func:`_prelude_forgot_calls`):
    it may have been made by the step's code before the forward that was not taped, or come with the batch. No op,
    module, line or phase can be named, and no op downstream of it is blamed for only receiving it: cause
    ``unknown``, saying which evidence is missing and naming the argument. The kind is the triage's."""
    from ..loss_tape import PRELUDE_ENTRIES

    ref, rec = origin.external, origin.record
    assert ref is not None
    values = "NaN" if ref.nan else "Inf"
    receiver = f"{ref.position} of {rec.op}" + (f" at {rec.source}" if rec is not None and rec.source else "") \
        if rec is not None else ref.position
    incident.op = incident.module = incident.source = incident.phase = None
    incident.cause = "unknown"
    incident.chain = chain_summary(origin)
    incident.details["received_from_untaped_code"] = {"argument": ref.position, "op": rec.op if rec else None,
                                                      "source": rec.source if rec else None, "values": values}
    incident.details["localisation"] = (
        f"{receiver} received {values} values that no replayed op made, and the step's code before the model's "
        f"forward ran more torch calls than the prelude keeps (its last {PRELUDE_ENTRIES}): they came from code that "
        "was not taped (beyond the prelude's window), or with the batch; which, and the op that made them, cannot be "
        "established")
    incident.summary = (f"At step {incident.step} {receiver} received {values} values from outside the replayed code: "
                        "the step's code before the model's forward ran more torch calls than nantrace's prelude keeps "
                        f"({PRELUDE_ENTRIES}), so the op that made them could not be replayed and named.")
    incident.fix = ("Wrap the step's computation, the code before the model's forward included, with "
                    "guard.replayable(fn) so nantrace can replay it whole and name the op and line; or check the "
                    "value where that code makes it (torch.isfinite) before it reaches the loss.")


def _made_in_prelude(watched: "Watched", capture: StepCapture, unit: Any,
                     bad: list[torch.Tensor]) -> tuple[OpTracer, OpRecord] | None:
    """(tracer, the traced op of the replayed prelude that made the first of ``bad``), or None. Call inside
    ``rerun_scope``."""
    if capture.prelude is None:
        return None
    tracer = OpTracer(ModuleStack(watched.root), externals_of(watched, [unit]))  # fresh: see the gradient code's
    with tracer.modules, tracer:
        start = trace_prelude_inputs(capture.prelude, bad, tracer)
    return (tracer, start) if start is not None else None


def _made_in_step(watched: "Watched", capture: StepCapture, units: list[Any], unit: Any,
                  bad: list[torch.Tensor]) -> tuple[OpTracer, OpRecord] | None:
    """(tracer, the traced op that made the replayed value of the first of ``bad``, real non-finite arguments of
    the forward ``unit``) in the step replayed in its real order up to that forward (:func:`_replay_until`);
    None when no op of the replay made one non-finite (the batch came so). Call inside ``rerun_scope``."""
    replayed = _replay_until(watched, capture, units, unit)
    if replayed is None:
        return None
    tracer, step = replayed
    wanted = {id(t) for t in bad}
    real = floating_tensors((unit.args, unit.kwargs))
    for t, value in zip(real, step.unit_inputs):
        made = tracer.producer.get(value) if id(t) in wanted and not all_finite(value) else None
        if made is not None:
            return tracer, made
    return None


def _apply(incident: "Incident", cls: Classification, origin: Origin, *, replayable: bool) -> None:
    if cls.cause in ("nonfinite_input", "nonfinite_param") and incident.kind in ("nonfinite_loss", "nonfinite_grad",
                                                                                  "nonfinite_activation"):
        # what was non-finite first is the batch itself (a target, a mask) or the model's state, not the loss
        incident.kind = cls.cause
    incident.op = cls.op
    incident.module = cls.module
    incident.source = cls.source
    incident.phase = cls.phase
    incident.cause = cls.cause
    incident.input_stats = cls.stats
    incident.chain = chain_summary(origin)
    if cls.evidence:
        incident.details["evidence"] = _plain(cls.evidence)
    rounded = bool(cls.evidence.get("rounded_upstream"))
    low = cls.dtype in ("float16", "bfloat16")
    summary, fix = explain(cls.cause, cls.op, module=cls.module, dtype=cls.dtype if low or not rounded else "float16/bfloat16",
                           detail=cls.detail,
                           max_value=f"{torch.finfo(getattr(torch, cls.dtype)).max:g}" if cls.dtype in ("float16", "bfloat16") else "",
                           diverged="divergence" in cls.evidence, rounded=rounded, buffer="buffer" in cls.evidence)
    if cls.cause == "nonfinite_param" and cls.detail:
        what = "buffer" if "buffer" in cls.evidence else "parameter"
        summary = f"A {what} was already non-finite before step {incident.step}: {cls.detail}."
    incident.summary = summary
    incident.fix = fix
    if origin.intentional_inf:
        incident.details["intentional_inf"] = True


def _plain(facts: dict[str, Any]) -> dict[str, Any]:
    """Evidence as JSON-ready values (non-finite floats as strings)."""
    out: dict[str, Any] = {}
    for key, value in facts.items():
        if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
            out[key] = str(value)
        elif isinstance(value, dict):
            out[key] = _plain(value)
        else:
            out[key] = value
    return out


def _in_loss_function(incident: "Incident") -> None:
    """The loss was non-finite while the model's outputs were finite, and the model replays
    finite: the loss function made it, and without ``replayable`` it cannot be replayed."""
    incident.transient = None
    incident.phase = "forward"
    incident.module = None
    incident.summary = (f"The loss is non-finite at step {incident.step} while the model's outputs were finite (and are "
                        "finite again when the model is replayed): it arose in the loss computation outside the model.")
    incident.fix = ("Wrap the loss computation with guard.replayable(loss_fn) so nantrace can replay it "
                    "and name the op and line.")


def _in_gradient_code(incident: "Incident", cls: Classification, bad: list[str], *, written: bool = False) -> None:
    """The origin is an op of the code that made the step's gradients outside autograd's backward: between
    ``backward()`` and ``optimizer.step()`` (the gradients were finite when the backward returned: the replay says
    so), or, ``written``, the step's own code that wrote ``p.grad`` with no ``backward()`` at all. Phase
    ``backward`` (the step's gradients are what went bad), no module (no forward was running)."""
    incident.phase = "backward"
    incident.module = None
    names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") or "them"
    where = " in the step's code that wrote the gradients" if written \
        else " in the code between backward() and optimizer.step()"
    summary, fix = explain(cls.cause, cls.op, dtype=cls.dtype, detail=cls.detail, where=where)
    if written:
        lead = (f"No backward() of the model ran at step {incident.step}: the step's own code wrote the gradients "
                f"(p.grad = ...) and made {names} non-finite.")
    else:
        lead = (f"The gradients were finite when backward() returned at step {incident.step}; the code between "
                f"backward() and optimizer.step() made {names} non-finite.")
    incident.summary = f"{lead} {summary}"
    incident.fix = fix


def _loss_code_not_replayed(incident: "Incident", error: str | None) -> None:
    """The model replays finite but the loss code could not be replayed: say so, never "transient"."""
    incident.transient = None
    why = f"re-running it raised {error}" if error else "it issued more torch calls than the tape keeps"
    incident.summary = (f"The model's forward replays finite at step {incident.step}, so the failure began in the loss "
                        f"code outside the model, but the loss code could not be replayed ({why}).")
    incident.fix = ("Wrap the loss computation with guard.replayable(loss_fn) so nantrace can replay it whole, or "
                    "replay the bundle with `nantrace replay` to inspect the step.")


def _not_reproduced(incident: "Incident", compiled: bool) -> None:
    if compiled:
        incident.transient = None
        incident.details["compiled_only"] = True
        incident.summary = (f"The failure at step {incident.step} does not reproduce when the step is replayed in eager "
                            "mode: it comes from the torch.compile'd graph (a fused kernel's numerics or a compiler bug).")
        incident.fix = ("Confirm with torch.compile(..., backend='aot_eager') to bisect compiler stages, and run the "
                        "failing region eagerly (torch.compiler.disable) until it is fixed.")
        return
    incident.transient = True
    incident.summary = (f"The failure at step {incident.step} did not reproduce on an identical re-run (same batch, "
                        "weights and RNG): a transient fault such as a nondeterministic kernel, a race or a hardware error.")
    incident.fix = ("Skipping the step was the right response; if it recurs, run the hardware diagnostics (e.g. "
                    "nvidia-smi -q, DCGM) and enable torch.use_deterministic_algorithms(True) to rule out nondeterminism.")
