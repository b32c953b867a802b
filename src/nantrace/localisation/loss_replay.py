"""Replay of the whole step, loss code included, as one dataflow graph: the model's
forward calls from their captured inputs, then the loss tape re-issued on the *replayed*
outputs, then the backward of the replayed loss into the parameters.

Because the loss code receives the replayed outputs (not copies), the op tracer follows a
bad value from the model into the loss code and back: a NaN born in the model and rejected
by a validating op in the loss is traced to the model; a gradient penalty that calls
``torch.autograd.grad`` on a model input differentiates through the replayed forward as the
real step did. Inputs of the loss code that came from elsewhere (targets, masks) are
copied, so nothing the user holds is touched, and no ``.grad`` is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..capture import floating_tensors
from ..loss_tape import EarlierRef, LossTape, Ref, _snapshot, note_replayed_numbers, tensors_of
from ..storage.tape_codec import OutputRef, PreludeRef
from .rerun import _upcast, autocast_held_off, grad_targets, run_unit
from .tracer import OpRecord, OpTracer, all_finite, replay_site

if TYPE_CHECKING:
    from ..watched import Watched


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor | None
    forward_finite: bool
    grads_finite: bool | None
    error: BaseException | None = None
    """The exception the replay raised (the model's forward, a call of the loss code, or its backward: a gradient
    hook the step's code registered)."""
    model_outputs_finite: bool = True
    """Were the replayed model outputs finite (False: the bad value was born in the model)?"""
    unit_outputs: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    """The replayed outputs of each forward replayed, in order."""
    unit_inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """With ``until``: the replayed value of each floating argument of that forward (in ``floating_tensors``
    order), what the replay handed it in place of the real one."""


class _Decoder:
    def __init__(self, replaced: dict[int, torch.Tensor], shared: set[int],
                 unit_outputs: list[list[torch.Tensor]], externals: dict[int, str], *, copy_all: bool = False) -> None:
        self.copy_all = copy_all
        self.prelude_values: list[list[torch.Tensor]] | None = None
        """The replayed prelude's values, by call (what a bundle's :class:`PreludeRef` names)."""
        """Copy parameters and buffers too (the prelude: code between steps may change them in
        place, weight clipping, an EMA; its replay must never touch the real ones)."""
        self.values: list[list[torch.Tensor]] = []
        self.unit_outputs = unit_outputs
        self.externals = externals
        """The tracer's names for tensors from outside the replayed ops: the loss code's own inputs
        (targets, masks) are the batch's, so a NaN in them is ``nonfinite_input``."""
        self.replaced = replaced
        self.shared = shared
        self.copies: dict[int, torch.Tensor] = {}
        self.leaves: list[torch.Tensor] = []
        self.before_write: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """The loss tape's copies of tensors it received and then wrote in place (``LossTape.before_write``)."""
        self.made_by: Any = None
        """The tracer's provenance table (tensor -> the op that made it), to find a forward's twins in."""
        self.forward_spans: list[tuple[int, int]] = []
        """The tracer's op indices ``(first, last]`` of each forward replayed: what the model's forward (its
        user hooks included) made."""
        self.full_precision = False
        self._claimed: set[int] = set()

    def forward_twin(self, real: torch.Tensor) -> torch.Tensor | None:
        """The replayed value of a real tensor the model's forward made without returning it (a loss term a
        forward hook of the user's computed and stored): the tensor a replayed forward made with the same autograd
        history (node by node, down to the same parameters), preferring one with the same values; None for a
        tensor without history into a replayed forward (the batch's targets, a mask)."""
        node = real.grad_fn
        if node is None or self.made_by is None or not self.forward_spans:
            return None
        table = getattr(self.made_by, "inner", self.made_by)  # exceptions._KeepingLike wraps the table
        spans = self.forward_spans
        kind = node.name()
        candidates = [t for t, info in list(table.items())
                      if t.grad_fn is not None and t.shape == real.shape and t.device == real.device
                      and (t.dtype == real.dtype or self.full_precision) and id(t) not in self._claimed
                      and t is not real and any(lo < info.index <= hi for lo, hi in spans)
                      and t.grad_fn.name() == kind]
        if not candidates:
            return None
        with _disable_current_modes():
            same = [t for t in candidates if t.dtype == real.dtype and torch.equal(
                torch.nan_to_num(t.detach(), 0.5, 1.5, -1.5), torch.nan_to_num(real.detach(), 0.5, 1.5, -1.5))]
        for t in same + [t for t in candidates if not any(t is u for u in same)]:
            if _same_history(node, t.grad_fn):
                self._claimed.add(id(t))
                return t
        return None

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, Ref):
            return self.values[obj.entry][obj.slot]
        if isinstance(obj, PreludeRef):  # a bundle's loss tape names the prelude call that made the tensor
            if self.prelude_values is not None and obj.entry < len(self.prelude_values):
                return self.prelude_values[obj.entry][obj.slot]
            return self(obj.value)
        if isinstance(obj, OutputRef):  # a tape restored from a bundle names the model's outputs by position
            return self.unit_outputs[obj.unit][obj.index]
        if isinstance(obj, torch.Tensor):
            key = id(obj)
            if key in self.replaced:
                return self.replaced[key]
            if not self.copy_all and (key in self.shared or self.externals.get(key, "").startswith(("param:", "buffer:"))):
                return obj  # a model input or parameter: the same object the replayed forward read
            if not self.copy_all and key not in self.copies:
                # not the batch when the model's forward made it (a penalty a user's forward hook stored): the
                # replayed forward made it again, and the loss code's replay reads that twin (one graph)
                twin = self.forward_twin(obj)
                if twin is not None:
                    self.replaced[key] = twin
                    return twin
            copy = self.copies.get(key)
            if copy is None:
                kept = self.before_write.get(key)
                source = kept[1] if kept is not None and kept[0] is obj else obj  # as the calls before its write read it
                with _disable_current_modes():  # the copy is not an op of the step: keep it off the trace
                    copy = source.detach().clone()
                if obj.requires_grad and (copy.is_floating_point() or copy.is_complex()):
                    copy.requires_grad_(True)
                    self.leaves.append(copy)
                self.copies[key] = copy
                # a copy of a parameter or buffer (the prelude copies all) keeps its name: a NaN read from it is the
                # model's state, not the batch
                name = self.externals.get(key, "")
                self.externals[id(copy)] = name if name.startswith(("param:", "buffer:")) else "input"
            return copy
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self(v) for v in obj)
        if isinstance(obj, list):
            return [self(v) for v in obj]
        if isinstance(obj, dict):
            return {k: self(v) for k, v in obj.items()}
        if isinstance(obj, torch.Generator):  # the tape's snapshot stays as taped: every replay draws what the step drew
            return _snapshot(obj)
        return obj


_HOOK_NAME = "register_hook"


def _reissue(tape: LossTape, decode: _Decoder, tracer: OpTracer, *, full_precision: bool = False,
             start: int = 0, stop: int | None = None) -> BaseException | None:
    """Re-issue a tape's calls ``start:stop`` (all by default; they must follow the ones already
    re-issued) under its autocast state and RNG marks, each attributed to its source line; the
    values go to ``decode.values``. Returns the exception a call raised.
    ``full_precision``: with autocast off and float16/bfloat16 arguments taken in float32 (the
    float32 re-run that tells a low-precision overflow from a math error)."""
    contexts: list[Any] = [autocast_held_off()] if full_precision else \
        (tape.autocast.contexts() if tape.autocast is not None else [])
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        marks = dict(tape.rng_marks)
        for index in range(start, len(tape.entries) if stop is None else stop):
            entry = tape.entries[index]
            numbers = None
            if index in marks:
                marks[index].restore()
            tracer.module_override = entry.module
            try:
                args, kwargs = decode(entry.args), decode(entry.kwargs)
                if _HOOK_NAME == getattr(entry.func, "__name__", None) and args and args[0] is entry.args[0]:
                    decode.values.append([])  # the real tensor itself (not replayed): never hooked by a replay
                    continue
                if _HOOK_NAME == getattr(entry.func, "__name__", None) and len(args) > 1 and callable(args[1]):
                    args = (args[0], tracer.modules.owned_hook(args[1], entry.module), *args[2:])
                if full_precision:
                    args, kwargs = _upcast(args), _upcast(kwargs)
                numbers = _host_numbers(entry, decode, tracer) if entry.host else None
                # the call's ops are the entry's line, unless the user's own code runs below it (a custom
                # Function's forward kept as one call): then that code's line
                with replay_site(sys._getframe(), entry.source):
                    out = entry.func(*args, **kwargs)
            except Exception as exc:
                return exc
            finally:
                tracer.module_override = None
                if numbers is not None:
                    numbers[1] = tracer.index
            decode.values.append(tensors_of(out))
    return None


def _host_numbers(entry: Any, decode: _Decoder, tracer: OpTracer) -> list[Any] | None:
    """The replayed tensors the call's plain-number arguments were read off in the step (``x / t.item()``), noted
    for the tracer's provenance table (``loss_tape.note_replayed_numbers``): the call still takes the numbers the step
    took; a cause rule follows a number to the op that made its tensor. None when no source can be replayed."""
    numbers: list[tuple[Any, int, Any, torch.Tensor]] = []
    for host in entry.host:
        source = host.source
        try:
            if isinstance(source, EarlierRef):
                values = decode.prelude_values
                replayed = values[source.entry][source.slot] if values is not None else None
            else:
                replayed = decode(source)
        except (IndexError, KeyError):  # a call the tape no longer holds (kept only up to the step's backward())
            replayed = None
        if isinstance(replayed, torch.Tensor):
            numbers.append((host.key, host.index, host.value, replayed))
    return note_replayed_numbers(tracer.made_by, tracer.index, numbers) if numbers else None


def _replay_prelude(prelude: LossTape, tracer: OpTracer, *, exclude: set[int],
                    before_write: dict[int, Any] | None = None,
                    leaves: list[torch.Tensor] | None = None) -> tuple[dict[int, torch.Tensor], list[list[torch.Tensor]]]:
    """Replay the prelude; map each real output still alive (by id) to its replayed value, except
    the model's own inputs (``exclude``: the replayed forward read the real ones); and the values
    by call (a prelude restored from a bundle has no real tensors to map). ``before_write``: tensors
    the step's code wrote into after the prelude read them, as they were before (``LossTape.before_write``).
    ``leaves``: receives the copies of the parameters the prelude read (a penalty on the weights computed
    before the forward, a Jacobian term), so that the step's replayed backward reaches that branch too."""
    decode = _Decoder({}, set(), [], tracer.externals, copy_all=True)
    decode.before_write = {**(before_write or {}), **getattr(prelude, "before_write", {})}
    error = _reissue(prelude, decode, tracer)
    if leaves is not None:
        leaves.extend(decode.leaves)
    if error is not None:
        raise error
    out: dict[int, torch.Tensor] = {}
    for refs, values in zip(prelude.outputs, decode.values):
        for ref, value in zip(refs, values):
            real = ref()
            if real is not None and id(real) not in exclude:
                out[id(real)] = value
    return out, decode.values


def replay_prelude(prelude: LossTape, tracer: OpTracer) -> None:
    """Re-issue the prelude's calls under ``tracer``; an exception of a call is raised again (the step's
    code raised before the model's forward: ``localisation.exceptions``)."""
    _replay_prelude(prelude, tracer, exclude=set())


def trace_prelude_inputs(prelude: LossTape, inputs: list[torch.Tensor], tracer: OpTracer) -> OpRecord | None:
    """Where the step's own code before the forward made a non-finite model input: replay the
    prelude under ``tracer`` and return the traced op that made the replayed value of the first of
    ``inputs`` (real, non-finite forward arguments) that a prelude call produced; None when none
    did (the batch came so from the data) or the replay of that value is finite."""
    made = {id(ref()) for refs in prelude.outputs for ref in refs if ref() is not None}
    wanted = [t for t in inputs if id(t) in made]
    if not wanted:
        return None
    by_id, _ = _replay_prelude(prelude, tracer, exclude=set())
    tracer.flush()
    for t in wanted:
        replayed = by_id.get(id(t))
        if replayed is not None and not all_finite(replayed):
            return tracer.producer.get(replayed)
    return None


def _unit_input(decode: _Decoder, tape: LossTape | None, value: torch.Tensor) -> torch.Tensor:
    """A replayed forward's argument: an earlier forward's or the loss code's replayed value when one
    made it (one graph, as in the real step), else the real tensor, cut from a graph made outside the
    replay (another guard's model, untaped code)."""
    replayed = _twin_of(decode, tape, value)
    if replayed is not None:
        return replayed
    return value.detach() if value.grad_fn is not None else value


def _twin_of(decode: _Decoder, tape: LossTape | None, real: torch.Tensor) -> torch.Tensor | None:
    """The replayed value of a real tensor the step's code made (by the prelude, by a call the loss tape kept, or
    by the model's forward without returning it: a forward hook's stored penalty)."""
    replayed = decode.replaced.get(id(real))
    if replayed is not None:
        return replayed
    ref = tape.ref_of(real) if tape is not None else None
    if ref is not None and ref.entry < len(decode.values) and ref.slot < len(decode.values[ref.entry]):
        return decode.values[ref.entry][ref.slot]
    if ref is None and id(real) not in decode.copies:
        twin = decode.forward_twin(real)
        if twin is not None:
            decode.replaced[id(real)] = twin
        return twin
    return None


_HISTORY_NODES = 4096
"""How many autograd nodes :func:`_same_history` compares at most (beyond: taken as the same)."""


_CASTS = frozenset({"ToCopyBackward0"})
"""Nodes of a dtype cast: autocast's in the real step, none in the float32 re-run; not a computation."""


def _uncast(node: Any) -> Any:
    while node is not None and node.name() in _CASTS and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    return node


def _same_history(real: Any, replayed: Any) -> bool:
    """Whether two autograd graphs are the same computation, node by node: the same node types with the same
    inputs in the same order (casts aside), down to the same leaves (a parameter's accumulator: the same
    parameter, which the replayed forward reads as the real one did)."""
    pairs: dict[Any, Any] = {}
    stack = [(real, replayed)]
    while stack:
        a, b = stack.pop()
        a, b = _uncast(a), _uncast(b)
        if a is None or b is None:
            if a is not b:
                return False
            continue
        seen = pairs.get(a)
        if seen is not None:
            if seen is not b:
                return False
            continue
        if a.name() != b.name():
            return False
        va, vb = getattr(a, "variable", None), getattr(b, "variable", None)
        if (va is not None or vb is not None) and va is not vb:
            return False
        na, nb = a.next_functions, b.next_functions
        if len(na) != len(nb):
            return False
        pairs[a] = b
        if len(pairs) > _HISTORY_NODES:
            return True
        stack.extend((x[0], y[0]) for x, y in zip(reversed(na), reversed(nb)))
    return True


def replay_step(watched: "Watched", units: list[Any], tape: LossTape | None, tracer: OpTracer, *,
                backward: bool = True, together: bool = False, prelude: LossTape | None = None,
                full_precision: bool = False, until: int | None = None) -> StepResult:
    """Replay the step's forwards and its loss tape in one graph (inside the tracer and a module stack).

    ``prelude``: the step's code before the model's forward, taped; it is replayed too, and the
    loss code receives its replayed values in place of the real ones (advantages normalised
    before the forward are traced to the division that made them, not taken for the batch).
    ``together``: every rank replays in lockstep (FSDP2): the backward runs even from a non-finite
    loss, so that its collectives meet the other ranks'; the result reads as without it.
    ``until``: stop once the forward ``units[until]`` has been replayed (with everything the step ran before it:
    the prelude, the earlier forwards and the loss code's calls before it); its outputs are the last of
    ``unit_outputs``. A forward's failure is then traced in the one graph the real step built up to it: through an
    argument the loss code made from an earlier micro-batch (a temperature, a running standardisation).
    """
    replaced: dict[int, torch.Tensor] = {}
    shared: set[int] = {id(t) for unit in units for t in floating_tensors((unit.args, unit.kwargs))}
    unit_outputs: list[list[torch.Tensor]] = []
    decode = _Decoder(replaced, shared, unit_outputs, tracer.externals)
    decode.made_by, decode.full_precision = tracer.made_by, full_precision
    decode.before_write = {**(getattr(tape, "before_write", {}) if tape is not None else {}),
                           **(getattr(prelude, "before_write", {}) if prelude is not None else {})}  # the earliest copy
    taped = tape is not None and bool(tape.entries)
    done = 0  # the tape's calls re-issued so far
    tracer.twin = functools.partial(_twin_of, decode, tape)  # real tensors held where the replay does not reach
    outputs_finite = True
    with torch.enable_grad():
        if taped and prelude is not None and prelude.usable:
            try:
                by_id, decode.prelude_values = _replay_prelude(prelude, tracer, exclude=shared,
                                                               before_write=decode.before_write, leaves=decode.leaves)
                replaced.update(by_id)
            except Exception:  # noqa: BLE001  the prelude is evidence, not the step: without it, its values count as inputs
                tracer.flush()
        for unit in units:
            # In the real step's order: the loss code's calls made before this forward began (a part of the
            # model called on what the loss code made, a second micro-batch after the first one's loss).
            at = min(getattr(unit, "tape_at", 0), len(tape.entries)) if taped else 0
            if at > done:
                assert tape is not None
                error = _reissue(tape, decode, tracer, full_precision=full_precision, start=done, stop=at)
                if error is not None:
                    return StepResult(None, False, None, error, outputs_finite)
                done = at
            inputs = functools.partial(_unit_input, decode, tape)
            first = tracer.index
            try:
                result = run_unit(watched, unit, backward=False, full_precision=full_precision, inputs=inputs)
            except Exception as exc:
                return StepResult(None, False, None, exc, outputs_finite)
            finally:
                decode.forward_spans.append((first, tracer.index))
            outputs_finite = outputs_finite and result.forward_finite
            unit_outputs.append(list(result.observed))
            for ref, replayed in zip(getattr(unit, "outputs", []), result.observed):
                real = ref()
                if real is not None:
                    replaced[id(real)] = replayed
            if len(unit_outputs) - 1 == until:
                tracer.flush()
                return StepResult(None, outputs_finite, None, None, outputs_finite, unit_outputs,
                                  [inputs(t) for t in floating_tensors((unit.args, unit.kwargs))])
        tracer.flush()
        if not taped:
            return StepResult(None, outputs_finite, None, None, outputs_finite)
        assert tape is not None
        error = _reissue(tape, decode, tracer, full_precision=full_precision, start=done)
        if error is not None:
            return StepResult(None, False, None, error, outputs_finite)
        tracer.flush()
    refs = tape.losses or ([tape.loss] if tape.loss is not None else [])
    if not refs:
        return StepResult(None, outputs_finite, None, None, outputs_finite)
    losses = [decode.values[r.entry][r.slot] for r in refs]
    bad_loss = next((loss for loss in losses if not bool(torch.isfinite(loss.detach()).all())), None)
    if bad_loss is not None and not together:  # gradient accumulation: the first bad micro-batch loss
        return StepResult(bad_loss, False, None, None, outputs_finite)
    loss = losses[0] if len(losses) == 1 else torch.stack([l.reshape(()) for l in losses if l.requires_grad]).sum() \
        if any(l.requires_grad for l in losses) else losses[-1]
    if not backward or not loss.requires_grad:
        return StepResult(bad_loss if bad_loss is not None else loss, bad_loss is None, None, None, outputs_finite)
    leaves = grad_targets(watched, [loss]) + decode.leaves + [
        t for unit in units for t in floating_tensors((unit.args, unit.kwargs)) if t.requires_grad and t.is_leaf]
    if not leaves:
        return StepResult(loss, bad_loss is None, None, None, outputs_finite)
    try:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as exc:  # a gradient hook of the step's code refused a value: the tracer holds what it saw
        return StepResult(loss, bad_loss is None, None, exc, outputs_finite)
    if bad_loss is not None:
        return StepResult(bad_loss, False, None, None, outputs_finite)
    return StepResult(loss, True, all(all_finite(g) for g in grads if g is not None), None,
                      outputs_finite)
