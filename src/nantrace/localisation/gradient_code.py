"""Replaying the step's code between ``backward()`` and ``optimizer.step()``: the gradient tape.

Clipping, a gradient normalised or averaged by hand, noise added to it, the unscaling of a
GradScaler: code that reads and writes ``param.grad`` after the backward. When the step's
gradients are non-finite while its forward, loss and backward replay finite, this is where
they went bad, and without a replay of it the failure would read as a transient fault.

The replay hands the tape the replayed gradients in place of the real ones: each watched
parameter's ``.grad`` is set, for the replay only, to a copy of its replayed gradient (what
``backward()`` left there), the tape's calls are re-issued under the op tracer, and the real
gradients are put back whatever happens. A call that wrote ``param.grad = ...`` writes the
stand-in, never the real one.

A step may also write its gradients with no ``backward()`` at all (per-sample gradients from a
``torch.func`` transform scaled by hand, an evolution-strategies estimate from fitness-weighted noise):
then the code that made them ran before the optimizer's step with no forward of the model to end the
prelude, and the prelude's kept calls are replayed on their real inputs instead
(:func:`replay_written_gradients`).

The same code may write the parameters themselves (SAM's ``first_step``, weight noise, a max-norm projection): a
parameter non-finite at the check that such a write filled is traced to the op that made the value it carried
(:func:`localise_parameter_writes`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..loss_tape import GradRef, LossTape
from .loss_replay import _Decoder, _reissue, _replay_prelude
from .tracer import _OVERWRITES, OpRecord, OpTracer, all_finite, written_tensors

if TYPE_CHECKING:
    from ..watched import Watched


@dataclasses.dataclass
class GradientCodeResult:
    """What the replayed gradient code made of the replayed gradients."""

    finite: bool
    """Every parameter's gradient finite after the code (as ``optimizer.step()`` would read it)."""
    bad: list[str]
    """Names of the parameters whose gradient the code made non-finite."""
    start: OpRecord | None
    """The traced op that made the first of those gradients non-finite (where the origin search starts)."""
    error: BaseException | None = None
    """What a call of the code raised when re-issued (then nothing is concluded)."""


class _GradientDecoder(_Decoder):
    """The loss tape's decoder, with each :class:`GradRef` read as the stand-in gradient."""

    def __init__(self, stand_ins: dict[int, torch.Tensor], externals: dict[int, str]) -> None:
        super().__init__({}, set(), [], externals)
        self.stand_ins = stand_ins

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, GradRef):
            stand_in = self.stand_ins.get(id(obj.param))
            return stand_in if stand_in is not None else super().__call__(obj.param.grad)
        return super().__call__(obj)


def replayed_gradients(total: dict[int, torch.Tensor], grads: dict[int, torch.Tensor] | None) -> None:
    """Add one replayed unit's gradients into ``total`` (a step of several forwards accumulates them)."""
    for key, g in (grads or {}).items():
        have = total.get(key)
        total[key] = g.detach() if have is None else have + g.detach()


def replay_gradient_code(watched: "Watched", tape: LossTape, grads: dict[int, torch.Tensor],
                         tracer: OpTracer) -> GradientCodeResult:
    """Re-issue ``tape`` (a gradient tape) on copies of ``grads`` (the replayed gradients by
    parameter ``id``) under ``tracer`` (entered here), and judge the gradients it leaves."""
    named = [(name, p) for name, p in watched.root.named_parameters() if p.requires_grad]
    stand_ins = {id(p): grads[id(p)].detach().clone() for _, p in named if id(p) in grads}  # the replay's own
    real = [(p, p.grad) for _, p in named]
    try:
        for _, p in named:
            p.grad = stand_ins.get(id(p))
        decode = _GradientDecoder(stand_ins, tracer.externals)
        with tracer.modules, tracer, torch.no_grad():
            error = _reissue(tape, decode, tracer)
            tracer.flush()
        if error is not None:
            return GradientCodeResult(False, [], None, error)
        final = [(name, p.grad) for name, p in named]
    finally:
        for p, g in real:
            p.grad = g
    bad = [(name, g) for name, g in final if g is not None and not all_finite(g)]
    start = next((tracer.producer.get(g) for _, g in bad if tracer.producer.get(g) is not None), None)
    if start is None and bad:
        start = next((r for r in tracer.records if r.creates_nonfinite), tracer.records[0] if tracer.records else None)
    return GradientCodeResult(not bad, [name for name, _ in bad], start)


def _finite(t: torch.Tensor) -> bool:
    """Every value of ``t`` finite (one host read per stored part)."""
    return all_finite(t)


def replay_written_gradients(watched: "Watched", prelude: LossTape, tracer: OpTracer) -> GradientCodeResult:
    """Re-issue the prelude's kept calls (the step's code, which wrote ``param.grad`` itself: no ``backward()``
    ran) on copies of their real inputs under ``tracer`` (entered here), and find where the gradients went bad.

    The search starts at the op that made the replayed value of the first non-finite gradient that a kept call
    made (``p.grad = (g * factor).mean(0)``, or an in-place write into ``p.grad``), else at the first op that
    created a non-finite value. Nothing of the user's is touched: the prelude's replay works on copies."""
    bad = [(name, p.grad) for name, p in watched.root.named_parameters()
           if p.grad is not None and not _finite(p.grad)]
    try:
        with tracer.modules, tracer, torch.enable_grad():  # as the prelude's own replay in a step's
            by_id, _ = _replay_prelude(prelude, tracer, exclude=set())
            tracer.flush()
    except Exception as exc:  # noqa: BLE001  the user's code raised on re-run: nothing is concluded
        return GradientCodeResult(False, [], None, exc)
    replayed = [by_id.get(id(g)) for _, g in bad]
    made = [r for r in replayed if r is not None and not _finite(r.detach())]
    start = next((tracer.producer.get(r) for r in made if tracer.producer.get(r) is not None), None)
    if start is None:
        start = next((r for r in tracer.records if r.creates_nonfinite), None)
    return GradientCodeResult(start is None, [name for name, _ in bad], start)


# ----------------------------------------------------------------------------- parameters written by the step's code
# A parameter non-finite at the step's check is taken by the triage for written between steps (a checkpoint loaded, an
# in-place write) or before training. The step's own code after a backward() may have written it instead: SAM's
# first_step climbing to w + rho * g / ||g|| before the second pass, weight noise added by hand, a max-norm projection
# of the weights. That code is on the step's tapes (the loss tape keeps what runs after one backward() up to the next
# forward, the gradient tape what runs after the last backward() up to optimizer.step()); replayed on stand-ins of the
# parameters under the op tracer, it shows the op whose non-finite value its write carried into the parameter.

_READS_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
                               "randint_like", "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided"})
"""Ops that read only a tensor's shape, dtype and device (noise drawn ``randn_like(p)``): their result is known even
where the tensor's values are not."""


_FROM_OUTSIDE = frozenset(("",))
"""The sources of a value the replay received from outside (a gradient, the batch): no parameter's name is empty."""


@dataclasses.dataclass
class ParameterWrites:
    """What a replay of the step's code after ``backward()`` shows about the parameters it wrote."""

    written: list[str]
    """Names of the non-finite parameters that the taped code writes in place (``p.add_``, ``p.data.copy_``)."""
    param: str | None = None
    """The first of them that a replayed write filled with a non-finite value."""
    start: OpRecord | None = None
    """Where the origin search starts: the op that made the value that write carried in (or the write itself, when
    the parameter's value before it is known finite)."""
    normalised_own: set[int] = dataclasses.field(default_factory=set)
    """``id`` of each traced record whose first operand (what a division divides) was computed from the values of the
    parameter :attr:`param` itself, and its divisor (when a tensor) from those values alone (a standardisation, a row
    divided by its norm): a division there normalises the parameter's own values, not an update by a gradient's norm."""
    tainted: set[int] = dataclasses.field(default_factory=set)
    """``id`` of each traced record that read a value the replay cannot know (a tensor the code wrote in place whose
    value before the write no tape keeps): an origin among them proves nothing."""
    error: BaseException | None = None
    replayed: int = 0


@dataclasses.dataclass
class _Write:
    param: str
    record: OpRecord | None
    operands: list[torch.Tensor]
    """The values the write carried in that were non-finite (not the parameter it wrote into)."""
    known_finite_before: bool
    """The parameter's value before the write is known to the replay and was finite there."""


def _key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (str(t.device), ptr) if ptr else None


def _is_write(func: Any) -> bool:
    """A call that writes its first argument in place (the tape's own rule for a write, ``LossTape._before_write_of``)."""
    from ..loss_tape import _NOT_WRITES, _WRITES, _name

    name = _name(func)
    return name in _WRITES or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES)


def _destinations(entry: Any) -> list[Any]:
    """What a taped call writes in place: its first argument for an in-place call (a tensor, or each element of a list
    of them: ``clip_grad_norm_(params)``), and any ``out=`` tensor."""
    found: list[Any] = []
    if entry.args and _is_write(entry.func):
        first = entry.args[0]
        found.extend(first if isinstance(first, (list, tuple)) else [first])
    out = entry.kwargs.get("out") if isinstance(entry.kwargs, dict) else None
    if out is not None:
        found.extend(out if isinstance(out, (list, tuple)) else [out])
    return found


class _ParamSpace:
    """The watched parameters by the memory they occupy, so that ``p``, ``p.data`` and a view of either are found."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named = named
        self.by_key: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
        for name, p in named:
            key = _key(p)
            if key is not None:
                self.by_key.setdefault(key, []).append((name, p))

    def owner(self, t: Any) -> tuple[str, torch.Tensor] | None:
        """The parameter whose elements ``t`` lies within (``t`` itself, ``p.data``, a row of it), or None."""
        if not isinstance(t, torch.Tensor):
            return None
        key = _key(t)
        for name, p in self.by_key.get(key, []) if key is not None else []:
            if t is p or (t.dtype == p.dtype and _within(t, p)):
                return name, p
        return None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """(first, last) element offsets of ``t`` in its storage."""
    if not t.numel():
        return t.storage_offset(), t.storage_offset() - 1
    last = t.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.storage_offset(), last


def _within(t: torch.Tensor, p: torch.Tensor) -> bool:
    lo, hi = _extent(t)
    plo, phi = _extent(p)
    return plo <= lo and hi <= phi and p.is_contiguous()


class _WindowDecoder(_GradientDecoder):
    """The tapes' decoder for this replay: parameters (and ``p.data``, views of them) read as their stand-ins, gradients
    read through ``param.grad`` as copies of the current ones, anything else received from outside as a copy; a copy of
    a tensor the code writes in place with no kept value from before the write is marked unknown."""

    def __init__(self, params: _ParamSpace, stand_ins: dict[int, torch.Tensor], grads: dict[int, torch.Tensor],
                 externals: dict[int, str], unknown: set[int], tainted: set[tuple[str, int]]) -> None:
        super().__init__(grads, externals)
        self.params = params
        self.replaced = stand_ins
        self.unknown = unknown
        self.tainted = tainted

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) not in self.replaced:
            owner = self.params.owner(obj)
            if owner is not None:  # p.data, a row of p: the same elements of the stand-in
                p = owner[1]
                stand_in = self.replaced[id(p)]
                return stand_in.as_strided(obj.shape, obj.stride(),
                                           stand_in.storage_offset() + obj.storage_offset() - p.storage_offset())
            fresh = id(obj) not in self.copies
            value = super().__call__(obj)
            if fresh and id(obj) in self.unknown and isinstance(value, torch.Tensor):
                key = _key(value)
                kept = self.before_write.get(id(obj))
                if key is not None and not (kept is not None and kept[0] is obj):
                    self.tainted.add(key)
            return value
        return super().__call__(obj)


class _WriteWatch(TorchDispatchMode):
    """Above the op tracer during the replay: notes each write into a parameter's stand-in, and which values depend on
    what the replay cannot know (the parameters' and other tensors' values before a write no tape kept)."""

    def __init__(self, tracer: OpTracer, names: dict[tuple[str, int], str], tainted: set[tuple[str, int]]) -> None:
        super().__init__()
        self.tracer = tracer
        self.names = names
        """Storage of each parameter's stand-in -> the parameter's name."""
        self.tainted = tainted
        self.tainted_records: set[int] = set()
        self.writes: list[_Write] = []
        self.touched: set[str] = set()
        """Every parameter the replay wrote into."""
        self.derived: dict[tuple[str, int], frozenset[str]] = {k: frozenset((n,)) for k, n in names.items()}
        """Storage of each value the replay made (and of each stand-in) -> the parameters whose values it was computed
        from, with :data:`_FROM_OUTSIDE`'s mark when it read a value from outside the replay too (a gradient, the batch)."""
        self.operand_of: dict[int, tuple[frozenset[str], frozenset[str] | None]] = {}
        """``id`` of each traced record of an op of two or more operands -> where its first operand (a division's
        numerator, a normalisation's input) and its second, when a tensor (the divisor), came from."""

    def _sources(self, t: torch.Tensor) -> frozenset[str]:
        key = _key(t)
        got = self.derived.get(key) if key is not None else None
        return got if got is not None else _FROM_OUTSIDE

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        short = func._schema.name.split("::")[-1]
        written = written_tensors(func, args, kwargs)
        with _disable_current_modes():  # the watch's own reads are no ops of the step
            reads = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if short in _OVERWRITES:  # the destination's old values are replaced, not read
                reads = [t for t in reads if not any(t is w for w in written)]
            if short in _READS_SHAPE_ONLY:
                reads = []
            unknown_in = any(_key(t) in self.tainted for t in reads)
            from_reads = frozenset().union(*(self._sources(t) for t in reads))
            operands = None  # an op of two or more operands: what it divides or normalises (a reciprocal has none)
            if len(args) > 1 and isinstance(args[0], torch.Tensor) and short not in _READS_SHAPE_ONLY:
                operands = (self._sources(args[0]),
                            self._sources(args[1]) if isinstance(args[1], torch.Tensor) else None)
            targets = [(self.names[k], t, k in self.tainted, _finite(t)) for t in written
                       if t.is_floating_point() and t.numel() and (k := _key(t)) in self.names]
        seen = len(self.tracer.records)
        out = func(*args, **kwargs)
        made = self.tracer.records[seen:]
        with _disable_current_modes():
            if unknown_in:
                self.tainted_records.update(id(r) for r in made)
            if operands is not None:
                self.operand_of.update((id(r), operands) for r in made)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not any(t is w for w in written) and (k := _key(t)) is not None:
                    (self.tainted.add if unknown_in else self.tainted.discard)(k)
                    self.derived[k] = from_reads
            for t in written:
                if unknown_in and (k := _key(t)) is not None:
                    self.tainted.add(k)
                if (k := _key(t)) is not None:
                    self.derived[k] = self._sources(t) | from_reads
            for name, t, unknown, finite_before in targets:
                self.touched.add(name)
                if _finite(t):
                    continue
                carried = [x for x in reads if x.is_floating_point() and x.numel() and not any(x is w for w in written)
                           and not _finite(x)]
                self.writes.append(_Write(name, made[-1] if made else None, carried, not unknown and finite_before))
        return out


def _window_tapes(capture: Any) -> list[LossTape]:
    """The step's tapes that hold code run after a ``backward()``: the loss tape (what ran after one backward() up to
    the next forward: SAM's first_step before its second pass) and the gradient tape (after the last one)."""
    tapes = []
    loss_tape = getattr(capture, "tape", None)
    if loss_tape is not None and loss_tape.usable and loss_tape.losses:
        tapes.append(loss_tape)
    grad_tape = getattr(capture, "gradient_tape", None)
    if grad_tape is not None and grad_tape.usable:
        tapes.append(grad_tape)
    return tapes


def replay_parameter_writes(watched: "Watched", capture: Any, bad: list[str], tracer: OpTracer) -> ParameterWrites | None:
    """Re-issue the step's taped code after ``backward()`` (:func:`_window_tapes`) on stand-ins of the parameters under
    ``tracer`` (entered here, with a :class:`_WriteWatch` above it), when it writes in place into one of the non-finite
    parameters ``bad``; None when it writes into none of them (they were written elsewhere: between steps).

    The stand-ins hold the parameters' current values: no tape keeps a parameter's value from before a write, so every
    value read from a parameter the code writes (and from any other tensor it writes with no kept copy) is unknown, and
    what is computed from it too; the watch marks the traced records that read such values."""
    from ..loss_tape import _GRAD, _name

    named = list(watched.root.named_parameters())
    space = _ParamSpace(named)
    bad_set = set(bad)
    tapes = _window_tapes(capture)
    written: set[str] = set()  # parameters the code writes in place (their values before it are unknown)
    unknown: set[int] = set()  # ids of other tensors it writes in place
    grads_written: set[int] = set()  # ids of the parameters whose gradient it writes
    for tape in tapes:
        for entry in tape.entries:
            if getattr(entry.func, "__self__", None) is _GRAD and _name(entry.func) == "__set__" and entry.args:  # p.grad = ...
                grads_written.add(id(entry.args[0]))
            for dest in _destinations(entry):
                if isinstance(dest, GradRef):
                    grads_written.add(id(dest.param))
                elif isinstance(dest, torch.Tensor):
                    owner = space.owner(dest)
                    if owner is not None:
                        written.add(owner[0])
                        grads_written.add(id(owner[1]))  # a list of parameters: their gradients (clipping)
                    else:
                        unknown.add(id(dest))
    if not (written & bad_set):
        return None
    kept: dict[int, torch.Tensor] = {}  # a parameter's value from before the code's first write, where a tape kept it
    for tape in tapes:
        for key, (t, before) in (getattr(tape, "before_write", None) or {}).items():
            if key not in kept and any(t is p for _, p in named):
                kept[key] = before
    with _disable_current_modes():
        stand_ins = {id(p): kept.get(id(p), p.detach()).clone() for _, p in named}
        grads = {id(p): p.grad.detach().clone() for _, p in named if p.grad is not None}
    externals = {id(stand_ins[id(p)]): f"param:{name}" for name, p in named}
    tracer.externals.update(externals)
    tainted: set[tuple[str, int]] = set()
    for name, p in named:
        if (name in written or name in bad_set) and id(p) not in kept:  # its value before the code's write is unknown
            tainted.add(_key(stand_ins[id(p)]))  # type: ignore[arg-type]
        if id(p) in grads_written and id(p) in grads:
            tainted.add(_key(grads[id(p)]))  # type: ignore[arg-type]
    names = {_key(stand_ins[id(p)]): name for name, p in named}
    watch = _WriteWatch(tracer, names, tainted)  # type: ignore[arg-type]
    result = ParameterWrites(sorted(written & bad_set, key=[n for n, _ in named].index))
    copies: dict[int, torch.Tensor] = {}
    try:
        with tracer.modules, tracer, watch, torch.no_grad():
            for tape in tapes:
                decode = _WindowDecoder(space, stand_ins, grads, tracer.externals, unknown, tainted)
                decode.copies = copies  # a tensor both tapes received is one copy
                decode.before_write = dict(getattr(tape, "before_write", {}) or {})
                error = _reissue(tape, decode, tracer)
                result.replayed += len(tape.entries)
                if error is not None:
                    result.error = error
                    return result
            tracer.flush()
    except Exception as exc:  # noqa: BLE001  the user's code raised on re-run: nothing is concluded
        result.error = exc
        return result
    result.tainted = watch.tainted_records
    result.written = [n for n in result.written if n in watch.touched]
    if not result.written:
        return None  # the calls the scan took for writes wrote into none of them (a clip writes the gradients)
    for write in watch.writes:
        if write.param not in bad_set:
            continue
        producers = [tracer.producer.get(x) for x in write.operands]
        if write.known_finite_before and write.record is not None:
            start = write.record  # the write itself, or what it carried in: the origin rule follows its inputs
        else:
            start = next((r for r in producers if r is not None), None)
            if start is None and not write.operands:
                continue  # it wrote into a value already non-finite (unknown before the write) and carried none in
        result.param, result.start = write.param, start
        own = frozenset((write.param,))
        result.normalised_own = {r for r, (num, div) in watch.operand_of.items()
                                 if write.param in num and (div is None or div == own)}
        break
    return result


def localise_parameter_writes(watched: "Watched", incident: Any, capture: Any) -> None:
    """Diagnose parameters found non-finite at the step's check that the triage took for written between steps
    (``triage.PARAMS_WRITTEN_UNSEEN``) from a replay of the step's code after ``backward()``
    (:func:`replay_parameter_writes`). When a write of that code filled a non-finite parameter with a value an op of
    the replay made, from values the replay knows, that op is the origin: its op, line and cause, phase ``optimizer``
    (the weights went bad in the step's update, before ``optimizer.step()``), module the one holding the parameter.
    Otherwise (no such write, a value that came in non-finite, an op that read values no tape kept) the triage's
    ``nonfinite_param`` stands, and the details say what the replay showed."""
    from .localiser import externals_of
    from .modules import ModuleStack
    from .rerun import rerun_scope

    bad = [str(b["name"]) for b in incident.details.get("nonfinite_params") or []] or [
        name for name, p in watched.root.named_parameters() if not _finite(p.detach())]
    tracer = OpTracer(ModuleStack(watched.root), externals_of(watched, []))
    with rerun_scope(watched):  # held while the evidence reads the stand-ins, which the scope puts back on exit
        _conclude_parameter_writes(watched, incident, tracer, replay_parameter_writes(watched, capture, bad, tracer))


def _conclude_parameter_writes(watched: "Watched", incident: Any, tracer: OpTracer, found: ParameterWrites | None) -> None:
    """Write what the replay of the step's parameter writes showed into ``incident`` (:func:`localise_parameter_writes`)."""
    from ..diagnosis.classify import classify
    from ..diagnosis.patterns import explain
    from .localiser import _apply, param_modules
    from .origin import trace_back

    if found is None:
        return  # the step's code wrote none of them: written between steps, as the triage says
    incident.details["parameter_writes_replayed"] = found.replayed
    said = f"the step's code after backward() writes into {', '.join(found.written[:3])}, but "
    if found.error is not None:
        incident.details["parameter_writes_error"] = f"{type(found.error).__name__}: {found.error}"
        return
    if found.param is None:
        incident.details["parameter_writes"] = said + "its replay carries no non-finite value into them"
        return
    origin = trace_back(found.start) if found.start is not None else None
    own = origin is not None and origin.external is not None and (origin.external.external or "").startswith("param:")
    if origin is None or origin.record is None or (origin.external is not None and not own):
        incident.details["parameter_writes"] = said + "the value it wrote came in non-finite from outside that code"
        return
    if origin.intentional_inf or (origin.record.scalar_nonfinite and origin.record.creates_nonfinite):
        # a NaN or inf literal written by hand (p[i] = float("nan"), a fill): a corrupted value put there, no op made it
        incident.details["parameter_writes"] = said + "the value it wrote is a non-finite literal, no op made it"
        return
    if own or id(origin.record) in found.tainted:
        incident.details["parameter_writes"] = (said + f"the value it wrote was computed ({origin.record.op}) from "
                                                "values no tape keeps from before the write (the parameters' own)")
        return
    cls = classify(origin, observed_in="gradient_code", low_precision_finite=None, param_modules=param_modules(watched),
                   made_by=tracer.made_by, history=incident.history, divergence_seen=incident.details.get("divergence"))
    if cls.cause in ("nonfinite_param", "nonfinite_input"):
        return
    if cls.cause == "zero_variance_norm" and id(origin.record) in found.normalised_own:
        # what it divides was computed from the written parameter's own values (a weight standardisation, a row
        # divided by its norm): a normalisation of constant data, as the same division in a forward
        cls.evidence["normalised_parameter_values"] = found.param
    elif cls.cause == "zero_variance_norm":
        # a weight update divided by a zero norm or std (of this step's gradient, of the batch): a zero divisor, as in
        # the optimizer's own update (docs/diagnosis.md); zero_variance_norm names a normalisation of constant data
        cls.cause = "div_by_zero"
        cls.evidence["zero_divisor_of_a_constant"] = True
    _apply(incident, cls, origin, replayable=False)
    incident.phase = "optimizer"
    incident.module = found.param.rpartition(".")[0]
    incident.transient = False
    incident.details["parameters_written_by_step_code"] = found.written
    names = ", ".join(found.written[:3]) + (f" and {len(found.written) - 3} more" if len(found.written) > 3 else "")
    summary, fix = explain(cls.cause, cls.op, dtype=cls.dtype, detail=cls.detail,
                           where=" in the step's code between backward() and optimizer.step()")
    incident.summary = (f"At step {incident.step} the step's own code after backward() and before optimizer.step() "
                        f"wrote non-finite values into {names}. {summary}")
    incident.fix = (f"{fix} The weights were written before optimizer.step(), so skipping the update cannot repair "
                    "them: restore them (a checkpoint, or the copy the code keeps) once the cause is fixed.")
