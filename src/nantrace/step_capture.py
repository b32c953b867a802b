"""Step capture: what the guard keeps of each training step while it runs, so that a failing
step can be checked and replayed: the model's forward calls (inputs, RNG, autocast, mutable
buffers), their outputs' gradients, the loss code's tape, the loss itself, and the cheap
finiteness flags of inputs and outputs.

:class:`StepRecorder` owns the step's :class:`~nantrace.capture.StepCapture`; the guard
installs its hooks (the model's forward pre/post hooks, the loss seen through
``backward()`` or ``GradScaler.scale``) and starts a fresh capture after each step.

Usage (inside the guard)::

    recorder = StepRecorder(watched, on_exception=guard.note_exception)
    model.register_forward_pre_hook(recorder.forward_pre, with_kwargs=True)
    ...
    capture = recorder.capture           # read by the decision and the localiser
    recorder.reset()                     # after the step
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from .capture import (AutocastState, BufferPlan, CallRecord, ForwardRecord, InputPolicy, RngState, StepCapture,
                      floating_tensors)
from .localisation.tracer import user_source
from .loss_tape import GRADIENT_ENTRIES, PRELUDE_ENTRIES, SNAPSHOT_MAX_NUMEL, LossTape, in_transform, untaped
from .module_hooks import hook_changes_numerics
from .watched import Watched

__all__ = ["StepRecorder"]

F = TypeVar("F", bound=Callable[..., Any])

NOGRAD_FORWARDS = 4
"""At most this many forwards of the watched model under ``torch.no_grad()`` are kept per step, for
the replay (inputs, RNG, buffers); an evaluation loop between two steps keeps no more than that."""

_RECORDERS: "weakref.WeakSet[StepRecorder]" = weakref.WeakSet()
"""Every live guard's recorder: with two or more, a loss is booked only by the guards whose model
its graph reaches (``StepRecorder._reaches_model``)."""


def _parameters_of(root_ref: "weakref.ref[nn.Module]") -> list[torch.Tensor]:
    """The watched model's parameters, while it lives (what a tape recognises a write into a parameter by)."""
    root = root_ref()
    return list(root.parameters()) if root is not None else []


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (each in-place write moves it), -1 for a tensor without one (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return -1


_GRAPH_WALK_LIMIT = 100_000

_PARTS_RETRY = 64
"""A backward that reaches no watched parameter, with nothing of the model captured, walks its graph
again only after this many such backwards (another model's loss, a model frozen for a phase)."""

_PRELUDES: "weakref.WeakSet[LossTape]" = weakref.WeakSet()
"""Every live guard's prelude tape: a watched model's forward ends them all (see ``forward_pre``)."""


class StepRecorder:
    """Records one step at a time of the watched model and loss code."""

    def __init__(self, watched: Watched, *, on_exception: Callable[[BaseException], None]) -> None:
        self.watched = watched
        cfg = watched.config
        self.tape = LossTape() if cfg.localisation.record_loss_code else None
        """The loss code's tape (``Config.localisation.record_loss_code``), or ``None``."""
        self.prelude = LossTape(PRELUDE_ENTRIES, prelude=True) if cfg.localisation.record_loss_code else None
        """The tape of the step's code before the model's forward (from the end of the previous
        step), so a value the loss code receives from there can be traced to the call that made it."""
        self.gradient_tape = LossTape(GRADIENT_ENTRIES, gradients=True) if cfg.localisation.record_loss_code else None
        """The tape of the step's code between ``backward()`` and ``optimizer.step()`` (clipping, a
        gradient normalised or averaged by hand), so gradients it made non-finite are traced to it."""
        self.buffers = BufferPlan(watched.root, cfg.localisation.snapshot_buffers)
        self._parts_root: "weakref.ref[nn.Module] | None" = None
        self._part_handles: list[Any] = []
        self._parts_retry = 0  # steps until a backward with nothing captured may walk its graph again
        self._parts_seen = False  # a step has called a part from outside the model's forward
        self._on_exception: Callable[[], Callable[[BaseException], None] | None] = (
            weakref.WeakMethod(on_exception) if hasattr(on_exception, "__self__") else lambda: on_exception
        )  # the guard owns the recorder: hold its method weakly, so a dropped guard is freed at once
        if self.tape is not None:
            self.tape.on_exception = self._exception
            self.tape.module_paths = {id(m): name for name, m in watched.root.named_modules() if name}
        if self.prelude is not None:
            self.prelude.on_exception = self._exception  # a step that dies before the model's forward
            _PRELUDES.add(self.prelude)
            if self.tape is not None:
                self.tape.earlier = self.prelude  # a tensor the prelude read and the loss code then writes
        root_ref = weakref.ref(watched.root)
        for tape in (self.tape, self.gradient_tape):
            if tape is not None:  # what a write into a parameter after backward() is recognised by (LossTape.before_write)
                tape.watched_parameters = functools.partial(_parameters_of, root_ref)
        if self.tape is not None and self.gradient_tape is not None:
            self.tape.set_sibling(self.gradient_tape)
        _RECORDERS.add(self)
        self._backward_end = _BackwardEnd(self)
        self._probe = _first_parameter_slot(watched.root)
        self._input_policy = InputPolicy()
        self.capture = self._new_capture()
        """What has been captured of the step in progress."""

    def _exception(self, exc: BaseException) -> None:
        callback = self._on_exception()
        if callback is not None:
            callback(exc)

    def _new_capture(self) -> StepCapture:
        self._nograd_kept = 0
        self._nograd: ForwardRecord | None = None
        self._resume: list[LossTape] = []
        self._depth = 0  # forwards of the model or its parts running now
        self._parts_used = False  # a part was called from outside the model's forward in this step
        self._loss_end: int | None = None  # the loss tape's length when the step's last backward() began
        self._backward_since_forward = True  # a backward() ran since the last forward of the model began
        if self.tape is not None:
            self.tape.reset()
        if self.prelude is not None:
            self.prelude.reset()
        if self.gradient_tape is not None:
            self.gradient_tape.reset()
        capture = StepCapture(tape=self.tape, prelude=self.prelude, gradient_tape=self.gradient_tape)
        capture.input_policy = self._input_policy
        return capture

    def reset(self) -> None:
        """Start the next step's capture."""
        if self._parts_used:
            self._parts_seen = True  # the script calls parts from outside (some steps or all): they stay hooked
        elif self._part_handles and not self._parts_seen and any(f.grad_enabled and not f.module
                                                                 for f in self.capture.forwards):
            self._unhook_parts()  # the step's code calls the model itself, not its parts
        self.capture = self._new_capture()

    def swap(self, capture: StepCapture) -> StepCapture:
        """Put ``capture`` in place of the step in progress and return the one it replaces (the
        sync-free mode books a step one step late, from that step's own capture)."""
        current, self.capture = self.capture, capture
        return current

    @property
    def active(self) -> bool:
        """Something of the step was captured (a forward of the watched model or a ``replayable`` call)."""
        return bool(self.capture.calls) or any(f.grad_enabled for f in self.capture.forwards)

    @property
    def prelude_failed(self) -> bool:
        """The step's code raised before the model's forward, in a taped call (the prelude kept it)."""
        return self.prelude is not None and self.prelude.failed is not None

    @property
    def in_forward(self) -> bool:
        """A forward of the watched model (or of a part called from the step's code) is running."""
        return self._depth > 0

    def pause_tape(self) -> None:
        if self.prelude is not None:
            self.prelude.pause()
        if self.tape is not None:
            self.tape.pause()
        if self.gradient_tape is not None:
            self.gradient_tape.pause()

    def quiet(self, owner: Any) -> Any:
        """Keep ``owner.zero_grad()`` (an optimizer's or a module's) off the prelude: it only reads
        and writes ``.grad`` once per parameter, nothing a replay needs, and every such access would
        pass through the tape's mode. Returns a handle whose ``remove()`` undoes it."""
        return _QuietMethod(owner, "zero_grad", self)

    def start_prelude(self) -> None:
        """The previous step has ended: tape what the next one does before the model's forward."""
        if self.prelude is not None and not self.watched.closed:
            self.prelude.resume()

    # ------------------------------------------------------------ the model's forward
    def forward_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if in_transform():
            return
        self._depth += 1
        self._begin(args, kwargs, "")

    def forward_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if in_transform():
            return
        self._depth = max(self._depth - 1, 0)
        self._end(output)

    def part_pre(self, path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A part of the watched model is called (hooked by :meth:`watch_parts`): recorded only when
        no forward of the model or of another part is running, i.e. when the step's code called it
        directly (``model.query_encoder(q)`` in a ``compute_loss``, ``self.encoder(x)`` in a
        ``training_step``, ``model.encode(x)`` calling its encoder)."""
        if _in_backward() or in_transform():  # a checkpointed part recomputed by the backward; a torch.func transform's call
            return
        self._depth += 1
        if self._depth == 1:
            self._parts_used = True
            self._begin(args, kwargs, path)

    def part_post(self, path: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _in_backward() or in_transform():
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self._end(output)

    def watch_parts(self, root: nn.Module) -> None:
        """Hook the parts of ``root`` that loss code may call without calling ``root``: its children,
        and the members of its ``ModuleList``/``ModuleDict`` containers at any depth (layer stacks a
        layer-wise distillation or an early-exit loss runs one by one). Inside the model's own forward
        the hooks only count calls (about 2 µs a call); they are taken off after the first step that
        ran the model's forward and called no part from outside it (unless an earlier step did), and
        put back if a later step's backward reaches the model with nothing of it captured
        (:meth:`on_loss`), for good."""
        self._parts_root = weakref.ref(root)
        self._hook_parts()

    def _hook_parts(self) -> None:
        root = self._parts_root() if self._parts_root is not None else None
        if root is None or self._part_handles:
            return
        parts = _callable_parts(root)
        for path, part in dict((id(m), (p, m)) for p, m in reversed(parts)).values():  # a module shared by two paths: its first
            self._part_handles.append(part.register_forward_pre_hook(functools.partial(self.part_pre, path),
                                                                     with_kwargs=True))
            self._part_handles.append(part.register_forward_hook(functools.partial(self.part_post, path),
                                                                 with_kwargs=True, always_call=True))

    def _unhook_parts(self) -> None:
        for handle in self._part_handles:
            handle.remove()
        self._part_handles = []

    @property
    def parts_hooked(self) -> bool:
        """Calls of the model's parts from outside its forward are being recorded."""
        return bool(self._part_handles)

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any], path: str) -> None:
        if not torch.is_grad_enabled():  # taping goes on after it where it was going on before it
            self._resume = [t for t in (self.prelude, self.tape) if t is not None and t.recording]
        self.pause_tape()  # the model's own ops are replayed from its inputs, not taped
        if len(_PRELUDES) > 1:
            # Another guard's prelude ends here too: a watched model's forward belongs to its own
            # guard's step (two watched models, a GAN's), not to the code before another's forward.
            # The other guards' loss tapes keep recording: D(G(z)) is part of G's loss code.
            for prelude in list(_PRELUDES):
                if prelude is not self.prelude:
                    prelude.pause()
        if self.watched.closed or self.watched.replaying:
            return
        grad = torch.is_grad_enabled()
        if not grad:
            self._nograd = None
            if self._nograd_kept >= NOGRAD_FORWARDS:
                return
            self._nograd_kept += 1
        if grad:
            if self.tape is not None and self.capture.forwards and not self._backward_since_forward:
                self._note_abandoned()
            self._backward_since_forward = False
        with untaped():  # this guard's work, not another guard's loss code
            record = ForwardRecord(args=args, kwargs=kwargs, rng=RngState.current(), autocast=AutocastState.current(),
                                   buffers=self.buffers.snapshot(), grad_enabled=grad, call_site=user_source(3),
                                   module=path, tape_at=len(self.tape.entries) if self.tape is not None else 0)
            if not path:
                record.substitutes = self._substitutes()
            self.capture.forwards.append(record)
            if not grad:
                self._nograd = record
            elif self.watched.config.detection.check_inputs and not path:  # a part's input may be another part's output
                self.capture.note_inputs(floating_tensors((args, kwargs)))

    def _note_abandoned(self) -> None:
        """Another forward begins with no ``backward()`` since the last one under grad: keep the last scalar the
        step's code made from that one's outputs (its loss, perhaps left by a loop that skips a non-finite loss).
        A siamese step (two forwards, one loss) keeps nothing: no scalar was made between them."""
        last = next((f for f in reversed(self.capture.forwards) if f.grad_enabled), None)
        scalar = self.tape.last_scalar if self.tape is not None else None
        if last is None or scalar is None or scalar[0] < last.tape_at or last.abandoned_loss is not None:
            return
        ref = self.tape.ref_of(scalar[1])
        if ref is not None and self._reaches_model(scalar[1]):  # not another model's loss (a GAN's D on G(z).detach())
            last.abandoned_loss = (ref, scalar[1].detach())
            self.capture.abandoned = True

    def _substitutes(self) -> dict[str, torch.Tensor] | None:
        """The tensors standing in for the model's parameters right now (``torch.func.functional_call``
        swaps them into the modules for the call), or ``None``. One identity test per forward (the first
        parameter's slot still holds it); all of them are compared only when it does not."""
        probe = self._probe
        if probe is None:
            return None
        module, name, param = probe
        held = module._parameters.get(name)
        if held is param:
            return None
        if isinstance(held, nn.Parameter):  # the user replaced the parameter itself (no functional_call stand-in):
            self._probe = (module, name, held)  # probe the new one, so later forwards pay one test again
            return None
        registered = dict(zip(self.watched.param_names, map(id, self.watched.params)))
        current = dict(self.watched.root.named_parameters(remove_duplicate=False))
        return {n: t for n, t in current.items() if registered.get(n) not in (None, id(t))} or None

    def _end(self, output: Any) -> None:
        if output is None and sys.exc_info()[1] is not None:  # the forward raised (an always-called hook)
            self._exception(sys.exc_info()[1])  # type: ignore[arg-type]
            return
        if self.watched.closed or self.watched.replaying:
            return
        if not torch.is_grad_enabled():
            self._after_nograd(output)
            return
        if not self.capture.forwards:
            return
        record = self.capture.forwards[-1]
        with untaped():
            self.buffers.learn()
            outputs = floating_tensors(output)
            if self.tape is not None:
                record.outputs = [weakref.ref(t) for t in outputs]
            if self.watched.config.detection.check_outputs:
                self.capture.note_outputs(outputs)
            if self.watched.config.localisation.keep_output_grads:
                for i, t in enumerate(outputs):
                    if t.requires_grad:
                        t.register_hook(functools.partial(_keep_grad, record, i))
        if self.tape is not None:
            self.tape.resume()

    def _after_nograd(self, output: Any) -> None:
        """A forward under ``torch.no_grad()`` returned: its outputs are named for the loss replay,
        and the tape that was recording when it began records again (the loss code around a
        pseudo-label pass; the code between two steps around an evaluation pass)."""
        record, self._nograd = self._nograd, None
        if record is not None and self.tape is not None:
            with untaped():
                record.outputs = [weakref.ref(t) for t in floating_tensors(output)]
        resume, self._resume = self._resume, []
        for tape in resume:
            tape.resume()

    # ------------------------------------------------------------ the loss
    def on_loss(self, loss: torch.Tensor) -> Callable[[], None] | None:
        """A scalar loss ``backward()`` runs on (``nantrace.patches.BACKWARD``); returns what to do
        when that backward has returned (start the gradient tape) or raised (note the exception)."""
        if self.watched.closed or self.watched.replaying:
            return None
        if self.active and (len(_RECORDERS) < 2 or self._reaches_model(loss)):
            self._backward_since_forward = True
            self.record_loss(loss)
            return self._backward_end
        elif not self.active and self._parts_root is not None and not self._part_handles:
            self._parts_retry -= 1
            if self._parts_retry <= 0:
                self._parts_retry = _PARTS_RETRY
                if self._reaches_model(loss):  # the model's parts are called directly: record them from now on
                    self._parts_seen = True
                    self._hook_parts()
                    self.record_loss(loss)  # this step's loss is still checked
        return None

    def _backward_raised(self, exc: BaseException) -> None:
        """The step's ``backward()`` raised: autograd's engine stopped it (anomaly mode's check of a
        node's outputs, a gradient hook's check). Marked as raised by the backward, so that its
        diagnosis localises the backward, and noted now: outside any forward, safe to replay."""
        with contextlib.suppress(AttributeError, TypeError):
            exc._nantrace_backward = True  # type: ignore[attr-defined]
        self._exception(exc)

    def _after_backward(self) -> None:
        """``backward()`` has returned: tape the step's code from here to ``optimizer.step()``
        (after the last backward of an accumulating step: each backward starts it over)."""
        tape = self.gradient_tape
        if tape is not None and not self.watched.closed:
            tape.reset()
            tape.resume()
        if self.tape is not None and not self.watched.closed:
            # Under gradient accumulation the next micro-batch's code runs from here to its forward (a
            # statistic of the last micro-batch, a temperature passed in): the loss tape keeps it, in order.
            # What follows the last backward() instead is dropped when the optimizer steps (end_step_code).
            self.tape.resume(lazy=True)

    def end_step_code(self) -> None:
        """The optimizer steps: the step's code has ended. The tapes pause, and the loss tape forgets the
        calls made after the last ``backward()`` (clipping, logging: the gradient tape's)."""
        self.pause_tape()
        keep = self._loss_end
        if not self._backward_since_forward and self.tape is not None and self.capture.forwards:
            self._note_abandoned()  # the step's last forward went without backward() (a skipped last micro-batch)
            self._backward_since_forward = True
            left = self.capture.forwards[-1].abandoned_loss
            if left is not None and keep is not None:
                keep = max(keep, left[0].entry + 1)  # its loss code is the abandoned sub-step's, not gradient code
        if self.tape is not None and keep is not None:
            self.tape.keep_first(keep)

    def _reaches_model(self, loss: torch.Tensor) -> bool:
        """Whether ``loss``'s graph reaches a parameter of the watched model. With several guards
        alive (a GAN's generator and discriminator), the discriminator's loss reads ``G(z).detach()``:
        the generator's forward ran, but that loss is not the generator's step."""
        params = {id(p) for p in self.watched.params}
        stack = [loss.grad_fn] if loss.grad_fn is not None else []
        seen: set[int] = set()
        while stack and len(seen) < _GRAPH_WALK_LIMIT:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf its gradient goes to
            if variable is not None and id(variable) in params:
                return True
            stack.extend(fn for fn, _ in node.next_functions)
        return bool(stack)  # a graph too large to walk: count it, as a single guard would

    def record_loss(self, loss: torch.Tensor) -> None:
        """The step's loss (also from ``GradScaler.scale``): the loss code ends here."""
        if self.tape is not None:
            self.tape.note_loss(loss)
            self.tape.pause()
            self._loss_end = len(self.tape.entries)
        if self.watched.config.detection.check_loss and not self.watched.replaying:
            self.capture.losses.append(loss.detach())

    def replayable(self, fn: F) -> F:
        """Wrap the loss computation so that the whole call can be replayed (``guard.replayable``)."""
        recorder_ref = weakref.ref(self)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            recorder = recorder_ref()
            if recorder is None or recorder.watched.closed or recorder.watched.replaying or not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            # the record keeps the call's dict and list arguments as received (shallow copies): a call that pops
            # its inputs (HF's ``inputs.pop("labels")``) or appends to a list re-runs from what it read
            record = CallRecord(fn=fn, args=tuple(entry_copy(a) for a in args),
                                kwargs={k: entry_copy(v) for k, v in kwargs.items()},
                                rng=RngState.current(host=True),  # + random, numpy
                                autocast=AutocastState.current(), buffers=recorder.buffers.snapshot())
            recorder.capture.calls.append(record)
            received = recorder._received(args, kwargs)
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                recorder._keep_entry_values(record, received)
                # A check written in Python (torch.distributions' validation) raises outside any op the
                # tape sees: note it here, so a loop that catches it still gets its diagnosis.
                recorder._exception(exc)
                raise
            recorder._keep_entry_values(record, received)
            if isinstance(result, torch.Tensor):
                record.loss = result.detach()
            return result

        wrapper._nantrace_replayable = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    def _received(self, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        """A ``replayable`` call begins: its tensor arguments count as received by the step's taped code, so that the
        tapes copy one before the call first writes into it in place (``LossTape.before_write``), even where no call
        read it first (``x.sub_(m)``). Returns (argument, its version counter, its value now when a write of the
        step's code before the call was already copied: the tapes copy a tensor once a step, so the call's own write
        would not be); usually no copy at all."""
        prelude, tape = self.prelude, self.tape
        if prelude is None:
            return []
        received: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        with untaped():
            tensors = floating_tensors((args, kwargs))
            written = [t.before_write for t in (prelude, tape) if t is not None and t.before_write]
            for t in tensors:
                prelude._read.add(id(t))  # the loss tape reads its prelude's receipts as its own
                now = None
                if written and any(id(t) in kept for kept in written) and t.numel() <= SNAPSHOT_MAX_NUMEL:
                    now = t.detach().clone()
                received.append((t, _version(t), now))
        return received

    def _keep_entry_values(self, record: CallRecord,
                           received: list[tuple[torch.Tensor, int, torch.Tensor | None]]) -> None:
        """The call has returned (or raised): keep, for each argument it wrote in place (its version counter moved),
        its value at the call's entry (:attr:`CallRecord.entry_values`), from the copy the tapes took before its
        first write."""
        if not received:
            return
        entry: list[tuple[torch.Tensor, torch.Tensor]] = []
        with untaped():
            written = [t.before_write for t in (self.prelude, self.tape) if t is not None and t.before_write]
            for t, version, now in received:
                if _version(t) == version:
                    continue
                if now is not None:
                    entry.append((t, now))
                    continue
                for kept in written:
                    copy = kept.get(id(t))
                    if copy is not None and copy[0] is t:
                        entry.append((t, copy[1]))
                        break
        record.entry_values = entry or None

    def close(self) -> None:
        self._unhook_parts()
        self._parts_root = None
        _RECORDERS.discard(self)
        if self.prelude is not None:
            _PRELUDES.discard(self.prelude)
            self.prelude.on_exception = None
            self.prelude.detach()
        if self.tape is not None:
            self.tape.on_exception = None
            self.tape.detach()
        if self.gradient_tape is not None:
            self.gradient_tape.detach()
        self.capture = StepCapture()


ENTRY_COPY_MAX = 4096
"""A dict or list argument of a ``replayable`` call with more entries than this is kept as it is, not copied."""

_USER_CONTAINERS = frozenset({collections.UserDict, collections.UserList})


def entry_copy(value: Any) -> Any:
    """A shallow copy of ``value`` when it is a dict or a list (or a subclass, ``UserDict``/``UserList``: an HF
    ``BatchEncoding``) of at most :data:`ENTRY_COPY_MAX` entries, else ``value`` itself: the container a
    ``replayable`` call received, as it was at the call's entry. No tensor is copied (the entries are the same
    objects), well under a microsecond for a batch dict; what the call then pops from it or appends to it stays
    out of the copy, so the call's re-run (``rerun._run_unit``, which feeds a fresh copy of it each time) reads
    what the real call read. A container that cannot be copied (a subclass refusing ``copy.copy``) is kept as it is."""
    cls = type(value)
    if cls is dict or cls is list:
        return value.copy() if len(value) <= ENTRY_COPY_MAX else value
    if not isinstance(value, (dict, list)) and _USER_CONTAINERS.isdisjoint(cls.__mro__):
        return value  # (their ABC's isinstance would cost more than the copy)
    try:
        if len(value) > ENTRY_COPY_MAX:
            return value
        return copy.copy(value)
    except Exception:  # noqa: BLE001 - the user's container class: the call is then recorded with it as it is
        return value


_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (it recomputes checkpointed
    modules from there)."""
    return _graph_task is not None and _graph_task() != -1


_MAX_PARTS = 512
"""At most this many parts are hooked (a very deep stack of layer lists: the shallowest first)."""


def _callable_parts(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the parts of ``root`` that a script calls on their own: the direct children
    that are not containers, and every member of a ``ModuleList``/``ModuleDict`` anywhere below
    ``root`` (``model.encoder.layers[i]``), shallowest first; never a module that a hook would move off
    a fused path (:mod:`nantrace.module_hooks`)."""
    parts: list[tuple[str, nn.Module]] = []
    untouchable = hook_changes_numerics(root)  # a hook there would change what the user's step computes
    level: list[tuple[str, nn.Module]] = [("", root)]
    while level and len(parts) < _MAX_PARTS:
        below: list[tuple[str, nn.Module]] = []
        for prefix, module in level:
            container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
            for name, child in module.named_children():
                path = f"{prefix}.{name}" if prefix else name
                if (container or module is root) and not isinstance(child, (nn.ModuleList, nn.ModuleDict)) \
                        and id(child) not in untouchable:
                    parts.append((path, child))
                below.append((path, child))
        level = below
    return parts[:_MAX_PARTS]


def _first_parameter_slot(root: nn.Module) -> tuple[nn.Module, str, torch.Tensor] | None:
    """(module, name, parameter) of the model's first parameter: where a ``functional_call`` substitution
    shows (the slot holds another tensor while the call runs)."""
    for module in root.modules():
        for name, param in module._parameters.items():
            if param is not None:
                return module, name, param
    return None


class _BackwardEnd:
    """What :meth:`StepRecorder.on_loss` hands the backward patch: called when the backward has
    returned, ``failed(exc)`` when it raised (held weakly: a dropped guard is freed at once)."""

    __slots__ = ("_recorder",)

    def __init__(self, recorder: StepRecorder) -> None:
        self._recorder = weakref.ref(recorder)

    def __call__(self) -> None:
        recorder = self._recorder()
        if recorder is not None:
            recorder._after_backward()

    def failed(self, exc: BaseException) -> None:
        recorder = self._recorder()
        if recorder is not None:
            recorder._backward_raised(exc)


def _keep_grad(record: ForwardRecord, index: int, grad: torch.Tensor) -> None:
    record.output_grads.append((index, grad.detach()))


class _QuietMethod:
    """An instance-level wrapper of ``owner.<name>`` that pauses the prelude around the call."""

    def __init__(self, owner: Any, name: str, recorder: StepRecorder) -> None:
        self.owner, self.name = owner, name
        self.had_own = name in getattr(owner, "__dict__", {})
        original = getattr(owner, name)
        recorder_ref = weakref.ref(recorder)

        @functools.wraps(original)
        def quiet(*args: Any, **kwargs: Any) -> Any:
            rec = recorder_ref()
            prelude = rec.prelude if rec is not None else None
            if prelude is None or not prelude.recording:
                return original(*args, **kwargs)
            prelude.pause()
            try:
                return original(*args, **kwargs)
            finally:
                prelude.resume()

        self.wrapper = quiet
        self.original = original
        owner.__dict__[name] = quiet  # an instance attribute (nn.Module's __setattr__ would keep it the same way)

    def remove(self) -> None:
        """Put the method back (if nothing replaced the wrapper since)."""
        if self.owner.__dict__.get(self.name) is self.wrapper:
            if self.had_own:
                self.owner.__dict__[self.name] = self.original
            else:
                del self.owner.__dict__[self.name]
