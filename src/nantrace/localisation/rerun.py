"""Re-running one captured unit of a step (a model forward, or a whole ``replayable`` loss
call), with its backward, deterministically, leaving training state exactly as found.

(Named *re-run* to keep it apart from the *bundle replay*, ``nantrace replay`` /
``nantrace.replay`` in ``_replay.py``, which re-executes a whole saved step in a fresh process.)

The replay restores the RNG and buffers recorded before the unit ran, re-enters the same
autocast state, and computes gradients with ``torch.autograd.grad`` so that no ``.grad``
is touched. Afterwards RNG, buffers and parameter dtypes are put back bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakTensorKeyDictionary

from ..capture import CallRecord, ForwardRecord, RngState, extremes_ok_on_host, floating_tensors
from ..loss_tape import host_numbers, is_number_read, note_read, note_replayed_numbers, untaped
from ..module_hooks import mode_changes_numerics
from .python_state import Snapshot, snapshot_of
from .tracer import OpTracer, dense_parts, replay_site, written_tensors

if TYPE_CHECKING:
    from ..watched import Watched

Unit = ForwardRecord | CallRecord


@dataclasses.dataclass
class UnitResult:
    """What one replayed unit produced."""

    observed: list[torch.Tensor]
    forward_finite: bool
    grads_finite: bool | None
    output_grads_finite: bool | None
    error: str | None = None
    grads: dict[int, torch.Tensor] | None = None
    """The replayed gradient of each parameter (by ``id``) when the backward ran: what ``backward()``
    left in ``.grad`` for this unit, before any code of the step changed it."""
    python_state_not_kept: list[str] | None = None
    """Python state the re-run changed and could not put back (``python_state.Snapshot.not_kept``)."""


@dataclasses.dataclass
class RerunNotes:
    """What the re-runs of one :func:`rerun_scope` could not leave as they found it, for the incident's
    ``details`` (``with rerun_scope(watched) as notes: ...; incident.details.update(notes.details)``)."""

    python_state_not_kept: list[str] = dataclasses.field(default_factory=list)
    deferred: list[Snapshot] = dataclasses.field(default_factory=list, repr=False)
    """Snapshots taken before the scope's forward re-runs, put back when the scope ends (a later unit of the
    same replay may read what a forward left: a model that keeps its last features as an attribute)."""
    writes: "WriteGuard | None" = dataclasses.field(default=None, repr=False)
    """The scope's :class:`WriteGuard` (None under FSDP2): what puts back a ``replayable`` call's arguments that a
    re-run starts from their values at the call's entry (:func:`_entry_values`)."""

    def put_back(self, snapshot: Snapshot) -> None:
        snapshot.restore()
        self.python_state_not_kept.extend(n for n in snapshot.not_kept if n not in self.python_state_not_kept)

    @property
    def details(self) -> dict[str, Any]:
        return {"python_state_not_kept": list(self.python_state_not_kept)} if self.python_state_not_kept else {}


class RerunSkipped(Exception):
    """A ``replayable`` call was not re-run: it can reach an iterator or generator whose position a re-run would
    advance for good (a DataLoader's iterator, a generator: ``python_state.Snapshot.unrestorable``). The message
    says which; the step is then diagnosed from its forwards and tapes."""


_SCOPES: list[RerunNotes] = []
"""The open :func:`rerun_scope`s, innermost last: where :func:`run_unit` notes what it could not keep."""


@contextlib.contextmanager
def rerun_scope(watched: "Watched") -> Iterator[RerunNotes]:
    """Save RNG and buffers, mark the guard as replaying; restore everything on exit, including
    every tensor from before the replay that the replayed code wrote in place (:class:`WriteGuard`).
    Each unit re-run in it puts the Python state it reached back itself (:func:`run_unit`); what could
    not be is noted in the :class:`RerunNotes` it yields."""
    notes = RerunNotes()
    _SCOPES.append(notes)
    rng = RngState.current(host=True)  # Python's and NumPy's streams too: a replayable call's re-run draws from them
    buffers = {n: b.detach().clone() for n, b in watched.root.named_buffers()}
    was_training = watched.root.training
    writes = WriteGuard() if not watched.sharded else contextlib.nullcontext()
    notes.writes = writes if isinstance(writes, WriteGuard) else None
    try:
        with watched.replay(), _eager(), _checkpoint_inline(), _silenced(), writes, untaped():  # never the step's code
            yield notes
    finally:
        _SCOPES.remove(notes)
        while notes.deferred:
            notes.put_back(notes.deferred.pop())
        if isinstance(writes, WriteGuard):
            writes.restore()
        watched.root.train(was_training)
        with torch.no_grad():
            for n, b in watched.root.named_buffers():
                if n in buffers and b.shape == buffers[n].shape:
                    b.copy_(buffers[n])
        rng.restore()


class WriteGuard(TorchDispatchMode):
    """Keeps a replay's in-place writes from outlasting it: the first time an op writes in place
    into a tensor the replay did not make (a parameter a forward updates itself, MoCo's momentum
    key encoder; an EMA teacher outside the watched model that a replayed loss function updates; a
    tensor of the user's that the loss code fills), its value is kept, and :meth:`restore` puts it
    back. Tensors the replay made (every op's output) are its own to write. A write into a view
    keeps the view's base. Off under FSDP2, whose collectives write into buffers they resize."""

    def __init__(self) -> None:
        super().__init__()
        self.made: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kept_ids: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for t in written_tensors(func, args, kwargs):
            self._keep(t)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[t] = True
        return out

    def _keep(self, t: torch.Tensor) -> None:
        base = t._base if t._is_view() and t._base is not None else t
        if base in self.made or id(base) in self._kept_ids or not base.numel():
            return
        self._kept_ids.add(id(base))
        self.kept.append((base, base.detach().clone()))

    def restore(self) -> None:
        """Put back every tensor the replay wrote in place, newest write first."""
        with torch.no_grad():
            for t, value in reversed(self.kept):
                if t.shape == value.shape:
                    t.copy_(value)
        self.kept.clear()
        self._kept_ids.clear()


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """No echo of the user's code during a replay: its prints, log records and warnings were
    already emitted once, by the real step."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Run ``torch.compile``d code eagerly, so hooks and the tracer see every op."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield


class _Inline:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` during a replay: the checkpointed
    function runs directly, with its graph kept."""

    @staticmethod
    def apply(function: Any, _preserve_rng_state: bool, *args: Any) -> Any:
        return function(*args)


@contextlib.contextmanager
def _checkpoint_inline() -> Iterator[None]:
    """Run reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``, the default
    of many LLM code bases) inline during a replay. Its backward refuses ``torch.autograd.grad``,
    which the replay differentiates with, and it re-runs the forward under the backward, where the
    tracer would see the ops a second time. A replay saves no memory that way anyway."""
    from torch.utils import checkpoint

    original = getattr(checkpoint, "CheckpointFunction", None)
    if original is None:
        yield
        return
    checkpoint.CheckpointFunction = _Inline  # type: ignore[attr-defined,assignment]
    try:
        yield
    finally:
        checkpoint.CheckpointFunction = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def float32_model(root: nn.Module) -> Iterator[None]:
    """Temporarily hold low-precision parameters and buffers in float32 (exact round trip)."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in list(root.parameters()) + list(root.buffers()):
        if t.dtype in (torch.float16, torch.bfloat16):
            saved.append((t, t.data))
            t.data = t.data.float()
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data


def _upcast(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_upcast(v) for v in obj)
    return obj


@contextlib.contextmanager
def autocast_held_off() -> Iterator[None]:
    """Autocast off for the block, including every autocast the replayed code enters itself (a
    ``training_step`` or ``compute_loss`` that opens its own ``torch.autocast``, a model whose
    forward does): the float32 re-run must run every op in float32, or a bfloat16 rounding would
    read as a math error. Each such autocast object is left as it was (a decorator reuses one)."""
    cls = torch.amp.autocast_mode.autocast
    original = cls.__enter__

    def enter_disabled(self: Any) -> Any:
        enabled = self._enabled
        self._enabled = False
        try:
            return original(self)
        finally:
            self._enabled = enabled

    outer = [torch.autocast("cpu", enabled=False)]
    if torch.cuda.is_available():
        outer.append(torch.autocast("cuda", enabled=False))
    with contextlib.ExitStack() as stack:
        for ctx in outer:
            stack.enter_context(ctx)
        cls.__enter__ = enter_disabled  # type: ignore[method-assign]
        try:
            yield
        finally:
            cls.__enter__ = original  # type: ignore[method-assign]


def grad_targets(watched: "Watched", roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters a replay differentiates: the watched ones; under FSDP2 the parameters the
    replayed graph actually used (the unsharded ones FSDP gathered), found by walking the graph
    from ``roots``. ``torch.autograd.grad`` on them reads this rank's own gradients, before any
    reduction, and leaves every ``.grad`` (and so FSDP's reduce-scatter) alone."""
    if not watched.sharded:
        return [p for p in watched.params if p.requires_grad]
    found: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node
        if isinstance(leaf, nn.Parameter) and leaf.requires_grad:
            found.setdefault(id(leaf), leaf)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return list(found.values())


def output_ok(t: torch.Tensor) -> bool:
    """A replayed output judged by the capture's own rule (``capture.extremes_ok``): its maximum is
    finite (no NaN, no +inf); ``-inf`` entries (a log-softmax of masked logits, ``-inf`` logits on
    invalid actions) are valid. An output the real step accepted is never the failing one."""
    parts = [part for part in dense_parts(t.detach()) if part.numel()]  # a sparse output: the values it stores
    if not parts:
        return True
    return extremes_ok_on_host([float(v) for part in parts for v in torch.aminmax(part)])  # (min, max) pairs


def _finite(t: torch.Tensor) -> bool:
    """Whether every value ``t`` holds is finite: a sparse gradient (``nn.Embedding(sparse=True)``) is read
    through the values it stores (:func:`~.tracer.dense_parts`)."""
    return all(bool(torch.isfinite(part).all()) for part in dense_parts(t))


def run_unit(watched: "Watched", unit: Unit, *, full_precision: bool = False, backward: bool = True,
             together: bool = False, inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> UnitResult:
    """Replay one unit from its recorded state. Call inside :func:`rerun_scope`.

    A ``replayable`` call that can reach an iterator or generator whose position cannot be put back is not re-run:
    :class:`RerunSkipped` is raised before any of its code runs. Python's ``random`` and NumPy's global stream
    start from the real call's entry states and are put back afterwards, like torch's generators.

    The Python state the unit's code can reach (a ``replayable`` function's bound object, closure cells,
    the globals it names, its arguments; the plain attributes of the user's module classes) is
    snapshotted first and put back in place, whether the re-run returned or raised (``python_state.py``):
    a loss object's history list keeps its identity and gets its contents back. A ``replayable`` call's
    state is put back as soon as it returns (each re-run of it meets what the real call met); a forward's
    when the :func:`rerun_scope` ends (the replayed loss code may read what the replayed forward left on
    the model). Tensors written in place are :class:`WriteGuard`'s.

    ``together``: every rank replays in lockstep (FSDP2), so the backward runs whatever this
    rank finds (its all-gathers must meet the other ranks'); the result reads as without it.
    ``inputs``: what each tensor argument is replaced with (the whole step's replay links a
    forward to the replayed values it was called on); by default an argument made by a graph
    (another forward's output) is detached from it: the unit's backward starts from the gradients
    recorded at its outputs and must not run into the real step's freed graph.
    """
    code = unit.fn if isinstance(unit, CallRecord) else _callee(watched, unit)
    snapshot = snapshot_of(code, unit.args, unit.kwargs)
    if isinstance(unit, CallRecord) and snapshot.unrestorable and not together:  # (lockstep: every rank must run it)
        reached = ", ".join(dict.fromkeys(snapshot.unrestorable))
        raise RerunSkipped(f"the call can advance an iterator it reaches: {reached}")
    scope = _SCOPES[-1] if _SCOPES else RerunNotes()
    # the call draws from Python's / NumPy's streams: _run_unit starts it from the real call's entry states
    # (unit.rng); the states from before the re-run are put back after it
    host = RngState.current(host=True) if isinstance(unit, CallRecord) else None
    try:
        result = _run_unit(watched, unit, full_precision=full_precision, backward=backward, together=together,
                           inputs=inputs)
    finally:  # returned or raised
        if host is not None:
            host.restore()
        if isinstance(unit, CallRecord) or not _SCOPES:
            scope.put_back(snapshot)  # a re-run of the call starts from the state the real call met, every time
        else:
            scope.deferred.append(snapshot)
    if snapshot.not_kept:
        result.python_state_not_kept = list(snapshot.not_kept)
    return result


def _entry_values(unit: CallRecord) -> None:
    """Give each argument a ``replayable`` call wrote in place (``rewards.sub_(mean).div_(std)`` on the batch's
    tensor) its value at the call's entry (:attr:`CallRecord.entry_values`), so that its re-run reads what the real
    call read, not what it left. Written with every dispatch mode off (the op tracer sees no op of the re-run's
    own: the argument stays the step's input), after the scope's :class:`WriteGuard` has kept the value it had,
    which it puts back when the scope ends. Without a guard (FSDP2) the argument is left as it is."""
    scope = _SCOPES[-1] if _SCOPES else None
    writes = scope.writes if scope is not None else None
    if writes is None or not unit.entry_values:
        return
    with _disable_current_modes(), torch.no_grad():
        for t, before in unit.entry_values:
            if t.shape == before.shape and t.dtype == before.dtype:
                writes._keep(t)
                t.copy_(before)


def _run_unit(watched: "Watched", unit: Unit, *, full_precision: bool, backward: bool, together: bool,
              inputs: Callable[[torch.Tensor], torch.Tensor] | None) -> UnitResult:
    unit.rng.restore()
    if isinstance(unit, CallRecord):
        _entry_values(unit)
    if unit.buffers:
        with torch.no_grad():
            for n, b in watched.root.named_buffers():
                if n in unit.buffers and b.shape == unit.buffers[n].shape:
                    b.copy_(unit.buffers[n])
    args, kwargs = unit.args, unit.kwargs
    if isinstance(unit, CallRecord):  # the dicts and lists it received, as copies: each re-run pops from its own
        from ..step_capture import entry_copy

        args, kwargs = tuple(entry_copy(a) for a in args), {k: entry_copy(v) for k, v in kwargs.items()}
    args, kwargs = tree_map_only(torch.Tensor, inputs or _cut, (args, kwargs))
    if full_precision:
        args, kwargs = _upcast(args), _upcast(kwargs)
    contexts: list[Any] = [autocast_held_off()] if full_precision else unit.autocast.contexts()
    with contextlib.ExitStack() as stack, torch.set_grad_enabled(getattr(unit, "grad_enabled", True)):
        for ctx in contexts:
            stack.enter_context(ctx)
        stack.enter_context(replay_site(sys._getframe(), getattr(unit, "call_site", None)))
        tracer = _tracing()
        # the unit's own code only: not its backward, nor nantrace's checks after it; and never over a module whose
        # fused path any torch-function mode turns off (a TransformerEncoderLayer's fast path would not replay)
        if tracer is not None and not mode_changes_numerics(watched.root):
            stack.enter_context(_HostReads(tracer))
        if isinstance(unit, CallRecord):
            result = unit.fn(*args, **kwargs)
        elif getattr(unit, "substitutes", None):  # the call ran on fast weights (functional_call): so does its replay
            subs = tree_map_only(torch.Tensor, inputs or _cut, dict(unit.substitutes))
            result = torch.func.functional_call(_callee(watched, unit), subs, tuple(args), kwargs, strict=False)
        else:
            result = _callee(watched, unit)(*args, **kwargs)
    observed = floating_tensors(result)
    forward_finite = all(output_ok(t) for t in observed)
    if together and backward:
        return _backward_together(watched, unit, observed, forward_finite, full_precision)
    if not forward_finite or not backward:
        return UnitResult(observed, forward_finite, None, None)
    params = grad_targets(watched, observed)
    roots, grad_outputs = _roots(unit, observed, full_precision)
    output_grads_finite = all(_finite(g) for g in grad_outputs) if grad_outputs else None
    if output_grads_finite is False:
        return UnitResult(observed, True, None, False)
    if not roots:
        return UnitResult(observed, True, None, output_grads_finite, error="no gradient to replay")
    grads = torch.autograd.grad(roots, params, grad_outputs=grad_outputs, allow_unused=True)
    grads_finite = all(_finite(g) for g in grads if g is not None)
    return UnitResult(observed, True, grads_finite, output_grads_finite,
                      grads={id(p): g for p, g in zip(params, grads) if g is not None})


def _tracing() -> OpTracer | None:
    """The op tracer the unit is re-run under (the innermost one on the dispatch mode stack), if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, OpTracer):
            return mode
    return None


class _HostReads(TorchFunctionMode):
    """Keeps the provenance of the numbers a re-run's code reads to the host, as the loss tape does for the
    zero-intrusive replay: each ``.item()`` / ``float(t)`` / ``int(t)`` / ``tolist()`` notes the replayed tensor
    it read under the number's identity (``loss_tape.note_read``), and a later call taking such a number as an
    argument (``adv / adv.std().item()``, ``torch.tensor(n)``) has its ops (the tracer's op indices it spans) noted
    with (the number, that tensor) in the tracer's provenance table (``loss_tape.note_replayed_numbers``), where
    ``family_rules._read_off`` and ``_read_back`` follow a zero divisor to the op that made it. Under the op tracer
    only, for the time of one unit's re-run (the table dies with it): nothing runs on a healthy step."""

    def __init__(self, tracer: OpTracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.numbers: dict[int, tuple[Any, torch.Tensor, int]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        found = host_numbers(args, kwargs, self._hit) if self.numbers else None
        if not found:
            out = func(*args, **kwargs)
            if args and is_number_read(func):
                note_read(self.numbers, args[0], out)
            return out
        tracer = self.tracer
        record = note_replayed_numbers(tracer.made_by, tracer.index, found)
        try:
            return func(*args, **kwargs)
        finally:
            record[1] = tracer.index

    def _hit(self, key: int | str, value: Any, found: list[Any] | None) -> list[Any] | None:
        hit = self.numbers.get(id(value))
        if hit is None or hit[0] is not value:
            return found
        found = found if found is not None else []
        found.append((key, hit[2], value, hit[1]))  # (key, flat index, number, the replayed tensor read)
        return found


def _cut(value: torch.Tensor) -> torch.Tensor:
    return value.detach() if value.grad_fn is not None else value


def _callee(watched: "Watched", unit: ForwardRecord) -> Any:
    """What a recorded forward called: the watched model, or the part of it the loss code called."""
    path = getattr(unit, "module", "")
    return watched.root.get_submodule(path) if path else watched.root


def _roots(unit: Unit, observed: list[torch.Tensor], full_precision: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """What the unit's backward starts from: a replayable call's scalar loss, or the forward's
    outputs with the gradients that reached them in the real step."""
    if isinstance(unit, CallRecord):
        return [t for t in observed if t.requires_grad and t.numel() == 1][:1], None
    recorded = dict(unit.output_grads)
    roots, grad_outputs = [], []
    for i, t in enumerate(observed):
        if i in recorded and t.requires_grad:
            g = recorded[i]
            roots.append(t)
            grad_outputs.append(g.float() if full_precision and g.dtype != t.dtype else g.to(t.dtype))
    return roots, grad_outputs


def _backward_together(watched: "Watched", unit: Unit, observed: list[torch.Tensor], forward_finite: bool,
                       full_precision: bool) -> UnitResult:
    """The backward of a lockstep replay: always run (non-finite values included), judged afterwards
    exactly as :func:`run_unit` judges a replay on its own."""
    roots, grad_outputs = _roots(unit, observed, full_precision)
    output_grads_finite = None if grad_outputs is None or not grad_outputs else all(
        _finite(g) for g in grad_outputs)
    grads_finite = None
    targets = grad_targets(watched, roots) if roots else []
    if targets:
        grads = torch.autograd.grad(roots, targets, grad_outputs=grad_outputs, allow_unused=True)
        grads_finite = all(_finite(g) for g in grads if g is not None)
    if not forward_finite:
        return UnitResult(observed, False, None, None)
    if output_grads_finite is False:
        return UnitResult(observed, True, None, False)
    if not roots:
        return UnitResult(observed, True, None, output_grads_finite, error="no gradient to replay")
    return UnitResult(observed, True, grads_finite, output_grads_finite)
