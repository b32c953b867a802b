"""The loss tape: a record of the few torch calls a step issues between the watched model's
forward and ``backward()`` (the user's loss code), so that a failure born there can be
replayed and localised without ``guard.replayable``.

A ``TorchFunctionMode`` is on the mode stack only in that window (pushed when the model's
forward returns, popped when its next forward starts, when ``backward()`` is called or when
the optimizer steps), so the model's own ops and the optimizer's never pay for it. Each
call is kept as (function, arguments, user's source line); a tensor argument made by an
earlier call on the tape is kept as a reference to that call's output, not as the tensor,
so the tape holds no intermediate alive: only what the loss code received from outside
(the model's outputs, the targets), which the user's own frame holds anyway. A replay
re-issues the calls on copies of those, under the op tracer.

Two more tapes of the same kind: the *prelude* (the step's code before the model's forward) and
the *gradient tape* (from ``backward()``'s return to ``optimizer.step()``: clipping, gradients
normalised or averaged by hand), which also keeps ``param.grad`` reads and writes, so that a
replay can run that code on the replayed gradients (``localisation/gradient_code.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from .capture import AutocastState, RngState
from .detection.param_provenance import WATCHED_DATA, data_touched
from .localisation.tracer import user_source

MAX_ENTRIES = 4096
"""Calls kept per step; a loss computation longer than this is not replayed (said so in the diagnosis). An entry
holds the call and references to its arguments (a value the tape made is named by position, not held), a few
hundred bytes: a loss written as a dynamic program (a hand-written CTC or CRF forward algorithm: utterances x frames
x a handful of calls) or an unrolled rollout runs to a few thousand calls, and each call already pays the mode's
dispatch whether it is kept or not."""
_MODULE_FRAMES = 12
"""Frames a kept call looks through for a running submodule's ``forward``."""
GRADIENT_ENTRIES = 256
"""Calls the gradient tape keeps (the code between ``backward()`` and ``optimizer.step()``)."""
PRELUDE_ENTRIES = 1024
"""Calls the prelude keeps (the step's code before the model's forward); when it fills, it starts
over, so the calls nearest the forward are the ones kept. Long enough for a PPO update's GAE loop or a beam
search between a no-grad pass and the forward (a few hundred calls); what it keeps alive is bounded by
:data:`PRELUDE_ALONE_BYTES`, not by this count."""
PRELUDE_ALONE_BYTES = 256 << 20
"""Bytes of tensors only the prelude keeps alive (arguments of its calls that the program has dropped: an
evaluation loop's outputs between two steps) after which it starts over, checked every
:data:`PRELUDE_CHECK_EVERY` calls."""
PRELUDE_CHECK_EVERY = 128
PRELUDE_RESTARTS = 2
"""Start-overs after which the prelude stops recording until the next step (code that runs long
between two steps, e.g. an evaluation after the last one, pays almost nothing)."""
PRELUDE_SURVIVORS = 256
"""Calls a start-over of the prelude may carry into its new window (at most a quarter of the window): the
calls whose outputs are still alive (the program holds them: a behaviour policy's log-probabilities, a running
statistic, a positional table made early and read by the loss code after a long loop), with every call they
need to be recomputed (their inputs' producers, and every call that read an output that is dead or was written
in place since, so that a write into it is replayed too). Each survivor is re-run once, off the tape and off the
user's RNG, on copies of its inputs, and kept only when it gives back exactly the live value (a random draw or a
value written by untaped code is not kept). Only a start-over does this work; a call kept costs what it did.
The copies the check makes, and the arguments the survivors hold, are bounded by :func:`_survivor_bytes`."""
_SURVIVOR_VISITS = 16
"""At most this many times :data:`PRELUDE_SURVIVORS` calls are walked per start-over, looking for survivors."""


def _survivor_bytes() -> int:
    """Bytes a start-over may spend on survivors: their arguments from outside the tape (which they hold), plus
    the values re-made to check them (freed at once). A quarter of :data:`PRELUDE_ALONE_BYTES`, so that the
    survivors alone never set off another start-over."""
    return PRELUDE_ALONE_BYTES // 4

_READS = frozenset({
    "item", "tolist", "numpy", "dim", "size", "numel", "__len__", "__bool__", "__float__", "__int__", "__index__",
    "__format__", "__repr__", "__str__", "is_floating_point", "is_complex", "data_ptr", "element_size", "nelement",
    "stride", "storage_offset", "is_contiguous", "__hash__", "__eq__", "__ne__", "backward", "register_hook",
    "retain_grad", "__reduce_ex__", "__deepcopy__", "untyped_storage", "_version", "__array__",
})
_NUMBER_READS = frozenset({"item", "tolist", "__float__", "__int__", "__index__"})
"""Host reads that hand the step's code a Python number (or a list of them): the tape notes which tensor each
number came from (:meth:`LossTape._note_read`), so that a kept call taking the number as an argument can be traced
back to the op that made it (``advantages / adv.std().item()``: the divisor 0.0 is a standard deviation)."""
NUMBER_READ_MAX = 64
"""A ``tolist()`` of more elements than this is not noted (a histogram dumped to a log, not a number used again)."""
_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__",
                     "__imod__", "__iand__", "__ior__", "__ixor__"})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad", "register_hook"})
SNAPSHOT_MAX_NUMEL = 1 << 20
SNAPSHOT_MAX_BYTES = 64 << 20
"""At most this much is copied so per step."""
"""A tensor the loss code received and then writes in place (a loss object's class counts, a DINO
centre, a running statistic updated after use) is copied once before its first write, up to this many
elements: a replay must read it as the calls before the write did, not as it is now."""
_HOOKS = frozenset({"register_hook"})
"""A gradient hook the loss code puts on one of its tensors or on a model output (a gradient reversal, a
normalisation of a feature's gradient): kept by the loss tape, so that a replay registers it on the
replayed tensor and its code runs in the replay's backward, as it ran in the real one. Never on a leaf
(a parameter): a replay must not hook the user's tensors."""
_STOPS = frozenset({"backward"})
_PLAIN = frozenset({int, float, bool, str, complex, torch.dtype, torch.device})
_GRAD = torch._C.TensorBase.grad
_DATA = torch._C.TensorBase.data
_HANDLES = (_GRAD, _DATA)
"""Attributes that hand out a tensor that already exists (a gradient, the storage itself): reading
them makes nothing a replay could redo, writing them is a side effect; neither is taped. A ``.data``
taken or assigned of a watched parameter is told to its provenance (:func:`_data_access`)."""
_SIDE_EFFECTS = frozenset({"__set__", "__delete__"})
"""Attribute writes (``p.grad = None``, ``t.data = ...``): effects on the objects themselves, which
a replay must not repeat; never taped."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """A tensor made by an earlier call on the tape: output ``slot`` of call ``entry``."""

    entry: int
    slot: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GradRef:
    """The gradient of ``param`` as ``backward()`` left it: what a gradient tape holds in place of a
    tensor read through ``param.grad`` (a replay hands out the replayed gradient instead)."""

    param: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class OutputRef:
    """Output ``index`` of forward call ``unit`` of the step (the model's outputs): what a tape
    holds in place of the tensor when it must outlive the step (a bundle, a step decided later)."""

    unit: int
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class EarlierRef:
    """A tensor the loss tape's calls did not make but the step's prelude did: output ``slot`` of the prelude's call
    ``entry`` (a number read off it before the model's forward and used by the loss code after it)."""

    entry: int
    slot: int


@dataclasses.dataclass(frozen=True, slots=True)
class HostNumber:
    """A plain-number argument of a kept call that the step's code read off a tensor (``.item()``, ``float(t)``,
    ``int(t)``, ``tolist()``): argument ``key`` (a position, or a keyword; a number inside a list argument keeps the
    list's position) holds ``value``, element ``index`` (flattened) of ``source``: a :class:`Ref` to the kept call
    that made the tensor, an :class:`EarlierRef` to the prelude's, or the tensor itself when no kept call made it.
    The call's arguments keep the number as it was (a replay re-issues exactly what the step ran); this is
    provenance only (``loss_replay._reissue`` resolves it to the replayed tensor, see :func:`note_replayed_numbers`)."""

    key: int | str
    source: Any
    index: int
    value: float | int


@dataclasses.dataclass(slots=True)
class Entry:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    source: str | None
    module: str | None = None
    """The watched model's submodule whose forward issued the call (``self.discriminator(x)`` in the
    loss code), or None for the loss code's own calls."""
    refs: "tuple[Ref, ...] | None" = None
    """The kept calls whose outputs this call read (the :class:`Ref` in its arguments), noted as they were
    encoded; None when not noted (a tape decoded from a bundle): :func:`_refs_in` finds them."""
    host: "tuple[HostNumber, ...] | None" = None
    """The plain numbers among its arguments that the step's code read off a tensor (:class:`HostNumber`); None when
    there are none (or the tape was decoded from a bundle, which does not carry them)."""


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if not name and hasattr(func, "__self__"):
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name


def _snapshot(generator: torch.Generator) -> torch.Generator:
    """A new generator in the state of ``generator`` (the replay draws from it, not from the user's)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def tensors_of(out: Any) -> list[torch.Tensor]:
    """The tensor outputs of a call, in a fixed order (a tensor, or a tuple/list/named tuple of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


_interpreter_stack = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``: per-sample gradients in DP-SGD) is running:
    its tensors are wrapped for the transform and must not outlive it (nothing of nantrace keeps them)."""
    return _interpreter_stack is not None and _interpreter_stack() is not None


class _Untaped:
    """``with untaped():`` nantrace's own work (a guard's hooks) while a tape records: no tape
    takes it in. With two watched models, one model's forward may run inside the other's loss
    code, and its guard's hooks (the extremes of its inputs, say) are not that loss code."""

    depth = 0

    def __enter__(self) -> None:
        _Untaped.depth += 1

    def __exit__(self, *exc: Any) -> None:
        _Untaped.depth -= 1


_UNTAPED = _Untaped()


def untaped() -> _Untaped:
    return _UNTAPED


_GRADIENT_TAPES: "weakref.WeakSet[LossTape]" = weakref.WeakSet()
"""Every live gradient tape (:func:`recording_gradient_tapes`)."""


_TAPES: "weakref.WeakSet[LossTape]" = weakref.WeakSet()
"""Every live tape (:func:`recording_tapes`)."""

_WINDOW = 0
"""Counts the windows after a ``backward()`` (each gradient tape's reset starts one): a parameter's copy one tape took
in the window running now serves the other tape too (:meth:`LossTape._copy_elsewhere`)."""


def recording_tapes() -> list["LossTape"]:
    """The tapes that would keep a call made now (recording, outside nantrace's own work and a
    compiled graph): a custom ``autograd.Function`` the step's code applies is kept by them as one
    call (``patches.FUNCTION_APPLY``), so that a replay recreates its node and runs its backward."""
    if not _TAPES or _Untaped.depth or torch.compiler.is_compiling():
        return []
    return [t for t in _TAPES if t.recording]


def recording_gradient_tapes() -> list["LossTape"]:
    """The gradient tapes recording now: a library call of many small ops on the gradients (a
    ``clip_grad_norm_``) is kept by them as one call (:meth:`LossTape.keep_call`), its own ops untaped."""
    return [t for t in _GRADIENT_TAPES if t.recording] if _GRADIENT_TAPES else []


class _MadeTable:
    """Which kept call made each tensor, by the tensor's identity, without keeping it alive: a weak reference
    beside each entry tells a live tensor from a dead one whose ``id`` was reused. What a weak-keyed dictionary
    does, at a dictionary lookup a call (the tape looks up every tensor argument of every call it keeps)."""

    __slots__ = ("_by_id",)

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, Ref]] = {}

    def get(self, t: torch.Tensor, default: Ref | None = None) -> Ref | None:
        entry = self._by_id.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else default

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def __setitem__(self, t: torch.Tensor, ref: Ref) -> None:
        self._by_id[id(t)] = (weakref.ref(t), ref)

    def __len__(self) -> int:
        return len(self._by_id)

    def drop_from(self, n: int) -> None:
        """Forget the tensors made by calls ``n`` and after (the tape forgot those calls)."""
        self._by_id = {k: v for k, v in self._by_id.items() if v[1].entry < n}


def _tensor_uses(roots: list[Any]) -> dict[int, list[Any]]:
    """Each distinct tensor in ``roots`` (nested tuples, lists and dicts, a few levels deep) -> [tensor, uses]."""
    seen: dict[int, list[Any]] = {}
    stack: list[tuple[Any, int]] = [(r, 0) for r in roots]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            held = seen.get(id(obj))
            if held is None:
                seen[id(obj)] = [obj, 1]
            else:
                held[1] += 1
        elif depth <= 4 and isinstance(obj, (tuple, list)):
            stack.extend((v, depth + 1) for v in obj)
        elif depth <= 4 and isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
    return seen


def _tensors_in(roots: list[Any]) -> list[torch.Tensor]:
    """The distinct tensors in ``roots``."""
    return [held[0] for held in _tensor_uses(roots).values()]


class LossTape(TorchFunctionMode):
    """Records the torch calls of one step's loss code; see the module docstring."""

    def __init__(self, limit: int = MAX_ENTRIES, *, prelude: bool = False, gradients: bool = False) -> None:
        super().__init__()
        self.limit = limit
        self.prelude = prelude
        """A prelude tape: the step's code before the model's forward (advantages normalised, targets
        rescaled, noise drawn). It keeps weak references to its calls' outputs, so that a replay can
        hand its replayed values to the loss tape, which received the real ones as inputs; when full
        it starts over instead of truncating."""
        self.gradients = gradients
        """A gradient tape: the step's code between ``backward()`` and ``optimizer.step()`` (clipping,
        gradient normalisation, noise, a manual average). It tapes ``param.grad`` reads (as
        :class:`GradRef`) and writes, which the other tapes leave alone. No RNG or autocast mark is
        taken (a replay of gradient noise draws other values; finiteness rarely depends on them)."""
        self._grad_of: dict[int, tuple[torch.Tensor, GradRef]] = {}
        """Gradient tape: id of each tensor read through ``param.grad`` -> (the tensor, kept alive so
        the id stays its own until the step ends; its :class:`GradRef`)."""
        if gradients:
            _GRADIENT_TAPES.add(self)
        _TAPES.add(self)
        self.outputs: list[list[Any]] = []
        """Prelude only: weak references to each call's tensor outputs."""
        self._restarts = 0
        self._mark_due = False
        self._generators: dict[int, torch.Generator] = {}
        """Copies of the explicit generators of the call in progress, as they were before it."""
        self.entries: list[Entry] = []
        self.truncated = False
        self.loss: Ref | None = None
        self.losses: list[Ref] = []
        """Every loss ``backward()`` was called on in the step (one per micro-batch under accumulation)."""
        self.failed: tuple[int, BaseException] | None = None
        """(index of the call that raised, the exception), when the taped code raised (the loss code; the
        prelude: code before the model's forward)."""
        self._made = _MadeTable()
        self._numbers: dict[int, tuple[Any, torch.Tensor, int]] = {}
        """``id`` of each Python number a host read handed the step's code -> (the number and the tensor it was read
        off, both kept until the step ends, so that the ``id`` stays the number's; its flat index in the tensor)."""
        self.before_write: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """``id`` of each tensor the loss code received, read and then wrote in place -> (the tensor, a copy
        of it before the first write)."""
        self._read: set[int] = set()
        """``id`` of each tensor a kept call received from outside the tape (what a write may change under it)."""
        self._refs: list[Ref] | None = None
        """The :class:`Ref` met while encoding the call being kept (:meth:`_entry`)."""
        self._received_bytes = 0
        """Bytes of the distinct tensors the kept calls received from outside the tape since the window began: a
        bound on what they can keep alive alone (:meth:`held_alone_bytes`, taken only once this bound passes)."""
        self._snapshot_bytes = 0
        self._param_window = gradients
        """Calls now run after a ``backward()`` of the step (always, for a gradient tape; the loss tape from a
        ``backward()`` to the next forward): a first in-place write into a watched parameter is copied before it
        (:meth:`_before_param_write`)."""
        self._param_storage: dict[tuple[int, Any], list[torch.Tensor]] | None = None
        """The watched parameters by (storage pointer, device), built at the first write that needs it in a step."""
        self._copied_in: dict[int, int] = {}
        """``id`` of each parameter this tape copied -> the window (:data:`_WINDOW`) it was copied in."""
        self._sibling: "weakref.ref[LossTape] | None" = None
        """The loss tape's gradient tape (:meth:`set_sibling`): what tells a gradient written by hand."""
        self.watched_parameters: Callable[[], Any] | None = None
        """The watched model's parameters (a callable); None: found through the recorder that owns this tape."""
        self.earlier: LossTape | None = None
        """The tape of the step's code before this one's (the loss tape's prelude): its reads count as reads."""
        self._recording = False
        self._pushed = False
        """This tape is on the torch-function mode stack (pushed by :meth:`resume`, not yet popped)."""
        self.module_paths: dict[int, str] = {}
        """``id`` of each submodule of the watched model -> its path (set by the recorder for the loss
        tape): the module a kept call ran in (:attr:`Entry.module`)."""
        self.autocast: AutocastState | None = None
        self.rng_marks: list[tuple[int, RngState]] = []
        """(index of the next call, the RNG state) each time recording starts: a replay restores it there, so
        random calls in the loss code (noise, dropout, sampling) draw the same values as the real step."""
        """The autocast state the loss code ran under (taken when recording starts)."""
        self.on_exception: Callable[[BaseException], None] | None = None
        self.last_scalar: tuple[int, torch.Tensor] | None = None
        """(index, output) of the last kept call whose output is a 0-dim floating tensor with grad (a loss, a penalty):
        what a forward's loss was when the step's code went on to another forward without a ``backward()``
        (``StepRecorder``: a loop that skips a non-finite loss)."""

    # ------------------------------------------------------------------ the mode stack
    def resume(self, *, lazy: bool = False) -> None:
        """Start (or go on) recording: the watched model's forward has just returned (the prelude:
        the step has ended). ``lazy``: the RNG and autocast mark is taken at the first call kept, not now
        (a window that usually keeps no call: the code after a ``backward()``)."""
        if not self._pushed:
            # Not "is it on the stack?": inside another mode's handler (backward() called in the loss
            # code) torch has taken the modes off the stack for the call and puts them back after it.
            torch._C._push_on_torch_function_stack(self)
            self._pushed = True
        if self.prelude or lazy:
            self._mark_due = True  # taken at the first call kept: most steps keep none before their forward
        elif not self.gradients:
            self._mark()
        if not self.prelude and not self.gradients:
            if lazy:  # the window after a backward() (StepRecorder._after_backward)
                self._param_window = True
            elif torch.is_grad_enabled():  # the next forward has run (not a no-grad pass inside the window)
                self._param_window = False
        self._recording = True

    def _mark(self) -> None:
        """The autocast state (at the first call) and the RNG state where the next call will be kept."""
        self._mark_due = False
        if not self.entries:
            self.autocast = AutocastState.current()
        if not self.rng_marks or self.rng_marks[-1][0] != len(self.entries):
            self.rng_marks.append((len(self.entries), RngState.current()))

    @property
    def recording(self) -> bool:
        return self._recording

    def pause(self) -> None:
        """Stop recording and leave the mode stack if nothing was pushed above the tape."""
        self._recording = False
        if self._on_top():
            torch._C._pop_torch_function_stack()
            self._pushed = False

    def _on_top(self) -> bool:
        n = torch._C._len_torch_function_stack()
        return n > 0 and torch._C._get_function_stack_at(n - 1) is self

    def _on_stack(self) -> bool:
        n = torch._C._len_torch_function_stack()
        return any(torch._C._get_function_stack_at(i) is self for i in range(n))

    def detach(self) -> None:
        """Leave the mode stack for good (``Guard.close``), even when other modes were pushed above."""
        self._recording = False
        self.reset()
        if not self._on_stack():
            return
        above: list[Any] = []
        while torch._C._len_torch_function_stack() and not self._on_top():
            above.append(torch._C._pop_torch_function_stack())
        if self._on_top():
            torch._C._pop_torch_function_stack()
            self._pushed = False
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)

    def reset(self) -> None:
        """Forget the step's calls (the next step starts a new tape)."""
        self.entries = []
        self.outputs = []
        self._restarts = 0
        self._generators = {}
        self.rng_marks = []
        self.truncated = False
        self.loss = None
        self.losses = []
        self.failed = None
        self.last_scalar = None
        if self.before_write:
            self.before_write = {}
            self._snapshot_bytes = 0
        self._param_storage = None
        self._param_window = self.gradients
        if self._copied_in:
            self._copied_in = {}
        if self.gradients:
            global _WINDOW
            _WINDOW += 1  # a new window after a backward() (or a new step) begins
        if self._read:
            self._read = set()
        self._received_bytes = 0
        if self._grad_of:
            self._grad_of = {}
        if self._numbers:
            self._numbers = {}
        if self._made:  # a fresh table only when the step taped something (most steps of a model-only loss: none)
            self._made = _MadeTable()

    # ------------------------------------------------------------------ recording
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or in_transform():
            # a torch.compile'd loss function is traced by dynamo, not taped (its calls run fused, in the graph);
            # tested first, so that dynamo, which traces this mode too, reads none of the tape's tables. Calls
            # inside a torch.func transform work on its wrapped tensors, which a replay outside it cannot use:
            # what comes out of it (per-sample gradients) enters the tape as the real values
            return func(*args, **kwargs)
        if not self._recording or _Untaped.depth:
            # a tape left on the stack while it does not record (a prelude that stopped) still sees .data
            if WATCHED_DATA and getattr(func, "__self__", None) is _DATA and not _Untaped.depth:
                return _data_access(func, args, kwargs)
            return func(*args, **kwargs)
        handle = getattr(func, "__self__", None)
        if handle in _HANDLES:  # p.grad / t.data read or written (zero_grad, clipping, EMA)
            if handle is _DATA:
                return _data_access(func, args, kwargs)
            if not self.gradients:
                return func(*args, **kwargs)
            return self._gradient_access(func, args, kwargs)
        name = _name(func)
        if name.startswith("_record_function"):  # the profiler's markers (every optimizer.zero_grad())
            return func(*args, **kwargs)
        if name in _STOPS:
            self._recording = False
            return func(*args, **kwargs)
        if self.prelude and name not in _READS and (len(self.entries) >= self.limit or (
                len(self.entries) % PRELUDE_CHECK_EVERY == PRELUDE_CHECK_EVERY - 1
                and self._received_bytes > PRELUDE_ALONE_BYTES and self.held_alone_bytes() > PRELUDE_ALONE_BYTES)):
            if self._restarts >= PRELUDE_RESTARTS:
                self._recording = False
                self.entries, self.outputs, self._made = [], [], _MadeTable()
                return func(*args, **kwargs)
            self._start_over()
        if self._mark_due and name not in _READS:
            self._mark()
        if args and (self._param_window or not self.gradients) \
                and (name in _WRITES or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES)):
            if self._param_window:
                self._before_param_write(args[0], name)
            if not self.gradients and isinstance(args[0], torch.Tensor):
                self._before_write_of(args[0])
        generator = kwargs.get("generator") if kwargs else None
        if generator is not None and isinstance(generator, torch.Generator):  # a replay must draw what this call draws, and leave the user's alone
            self._generators[id(generator)] = _snapshot(generator)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if name not in _READS and len(self.entries) < self.limit:
                # the call that raised is kept (a replay re-issues it to see what it rejected); in the prelude too:
                # a step can die before the model's forward (a timestep index off by one in q_sample)
                self.entries.append(self._entry(func, args, kwargs, user_source(2),
                                          self._running_module()))
                if self.prelude:
                    self.outputs.append([])
                self.failed = (len(self.entries) - 1, exc)
                if self.on_exception is not None:
                    self.on_exception(exc)
            raise
        if name in _HOOKS and not self.prelude and not self.gradients and len(self.entries) < self.limit \
                and args and isinstance(args[0], torch.Tensor) and (args[0] in self._made or args[0].grad_fn is not None):
            self.entries.append(self._entry(func, args, kwargs, user_source(2),
                                      self._running_module()))
            return out
        if name in _READS or name in _SIDE_EFFECTS or not (out is None or isinstance(out, (torch.Tensor, tuple, list))):
            if name in _NUMBER_READS and args:
                note_read(self._numbers, args[0], out)  # (:meth:`_note_read`, without its call)
            return out
        outs = tensors_of(out)
        if out is not None and not outs:
            return out
        if len(self.entries) >= self.limit:
            self.truncated = True
            return out
        index = len(self.entries)
        self.entries.append(self._entry(func, args, kwargs, user_source(2),
                                  self._running_module()))
        self._note_outputs(index, outs)
        return out

    def _note_read(self, t: Any, out: Any) -> None:
        """A host read of ``t`` handed the step's code the number(s) ``out``: note ``t`` under each number's identity
        (:attr:`_numbers`), one dictionary entry a number; which kept call made ``t`` is looked up only when a kept
        call takes the number as an argument (:meth:`_host_number`)."""
        note_read(self._numbers, t, out)

    def _host_numbers(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> "tuple[HostNumber, ...] | None":
        """The arguments of a call being kept (top level, or inside a list or tuple there) that are numbers a host
        read handed the step's code: noted by this tape, or by the prelude before the model's forward (the loss
        tape's :attr:`earlier`). Paid by each call kept after a host read of the step: a type test an argument."""
        found = host_numbers(args, kwargs, self._host_number)
        return tuple(found) if found else None

    def _host_number(self, key: int | str, value: Any, found: "list[HostNumber] | None") -> "list[HostNumber] | None":
        hit = self._numbers.get(id(value))
        if hit is not None and hit[0] is value:
            source = self._source_of(hit[1])
        else:
            earlier = self.earlier
            hit = earlier._numbers.get(id(value)) if earlier is not None and earlier._numbers else None
            if hit is None or hit[0] is not value:
                return found
            source = earlier._source_of(hit[1])
            if isinstance(source, Ref):  # the prelude's numbering: the loss tape's calls do not hold it
                source = EarlierRef(source.entry, source.slot)
        if source is None:
            return found
        found = found if found is not None else []
        found.append(HostNumber(key, source, hit[2], value))
        return found

    def _source_of(self, t: torch.Tensor) -> Any:
        """What a replay resolves the tensor a number was read off to: the kept call that made it, the gradient it
        is, or (a small tensor the code received) the tensor itself."""
        made = self._made.get(t)
        if made is not None:
            return made
        read = self._grad_of.get(id(t)) if self._grad_of else None
        if read is not None and read[0] is t:
            return read[1]
        return t if t.numel() <= NUMBER_READ_MAX else None

    def _before_write_of(self, t: torch.Tensor) -> None:
        """Keep ``t`` as it is before the loss code first writes into it, when the loss code received it
        (no kept call made it) and it is no parameter; :attr:`before_write` is what a replay copies it from."""
        read = id(t) in self._read or (self.earlier is not None and id(t) in self.earlier._read)
        if not read or id(t) in self.before_write or t in self._made or (t.is_leaf and t.requires_grad) \
                or t.numel() > SNAPSHOT_MAX_NUMEL or self._snapshot_bytes > SNAPSHOT_MAX_BYTES:
            return  # only a tensor a kept call read before: a write into one nothing read yet (an EMA) needs none
        with _Untaped():
            self.before_write[id(t)] = (t, t.detach().clone())
        self._snapshot_bytes += t.numel() * t.element_size()

    def _before_param_write(self, first: Any, name: str) -> None:
        """Keep a watched parameter as it is before the first in-place write into it after a ``backward()``
        (``p.add_``, ``p.data.copy_``, a row of either, ``torch._foreach_add_(params, ...)``): the step's code that
        wrote it (SAM's first step, a projection) read it before, and a replay of that code must start from the
        values it read (``gradient_code.replay_parameter_writes``). One copy per parameter and step, under the
        snapshot budget; a write into anything else costs a lookup of its storage."""
        if isinstance(first, torch.Tensor):
            if self._known_gradient(first):  # the common write after a backward(): a gradient scaled by hand
                return
            targets: Any = (first,)
        elif name.startswith("_foreach_") and isinstance(first, (list, tuple)):
            targets = first
        else:
            return
        try:
            with torch._C.DisableTorchFunction():  # the lookups and the copy are no calls of the step
                for t in targets:
                    if not isinstance(t, torch.Tensor) or self._known_gradient(t):
                        continue
                    p = self._watched_parameter(t)
                    if p is None or id(p) in self.before_write:
                        continue
                    if p.numel() > SNAPSHOT_MAX_NUMEL or self._snapshot_bytes > SNAPSHOT_MAX_BYTES:
                        continue
                    kept = self._copy_elsewhere(p)
                    if kept is None:
                        kept = (p, p.detach().clone())
                        self._snapshot_bytes += p.numel() * p.element_size()
                    self.before_write[id(p)] = kept
                    self._copied_in[id(p)] = _WINDOW
        except Exception:  # noqa: BLE001  evidence for a later diagnosis, never the program's failure
            return

    def _known_gradient(self, t: torch.Tensor) -> bool:
        """``t`` was read through ``param.grad`` in this window (a gradient written by hand: no parameter)."""
        if self.gradients:
            read = self._grad_of.get(id(t)) if self._grad_of else None
            return read is not None and read[0] is t
        sibling = self._sibling() if self._sibling is not None else None
        read = sibling._grad_of.get(id(t)) if sibling is not None and sibling._grad_of else None
        return read is not None and read[0] is t

    def set_sibling(self, gradient_tape: "LossTape") -> None:
        """The gradient tape recorded beside this loss tape (its owner's): what tells a gradient written by hand."""
        self._sibling = weakref.ref(gradient_tape)

    def _copy_elsewhere(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The copy of ``p`` another recording tape took before this same write (the loss tape and the gradient tape
        both record after the last ``backward()``): one copy serves both when it was taken in this window."""
        for tape in _TAPES:
            if tape is self or not tape._recording or tape._copied_in.get(id(p)) != _WINDOW:
                continue
            kept = tape.before_write.get(id(p))
            if kept is not None and kept[0] is p:
                return kept
        return None

    def _watched_parameter(self, t: torch.Tensor) -> torch.Tensor | None:
        """The watched parameter whose elements ``t`` lies within (the parameter, ``p.data``, a view of either)."""
        key = _storage_key(t)
        if key is None:
            return None
        table = self._param_storage
        if table is None:
            table = self._param_storage = {}
            for p in self._parameters():
                k = _storage_key(p)
                if k is not None:
                    table.setdefault(k, []).append(p)
        for p in table.get(key, ()):
            if t is p or (t.dtype == p.dtype and _within(t, p)):
                return p
        return None

    def _parameters(self) -> list[torch.Tensor]:
        """The watched model's parameters (:attr:`watched_parameters`, set by the step recorder owning this tape)."""
        return list(self.watched_parameters()) if self.watched_parameters is not None else []

    def _gradient_access(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A gradient tape's ``param.grad``: a read is remembered (the tensor names the parameter's
        gradient from now on), a write is kept as a call (a replay sets the replayed parameter's)."""
        out = func(*args, **kwargs)
        if _name(func) == "__get__":
            if isinstance(out, torch.Tensor) and args and id(out) not in self._grad_of and out not in self._made:
                self._grad_of[id(out)] = (out, GradRef(args[0]))
        elif len(self.entries) < self.limit:
            self.entries.append(self._entry(func, args, kwargs, user_source(3)))
        else:
            self.truncated = True
        return out

    def _running_module(self) -> str | None:
        """The innermost submodule of the watched model whose ``forward`` is running (a frame named
        ``forward`` whose ``self`` is one of them), when the model's paths are known; None in the
        loss code's own calls. Only frames named ``forward`` are opened, a few per call kept."""
        paths = self.module_paths
        if not paths:
            return None
        frame = sys._getframe(2)
        for _ in range(_MODULE_FRAMES):
            if frame is None:
                return None
            if frame.f_code.co_name == "forward" and frame.f_code.co_varnames[:1] == ("self",):
                path = paths.get(id(frame.f_locals.get("self")))
                if path is not None:
                    return path
            frame = frame.f_back
        return None

    def keep_call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                  source: str | None) -> None:
        """Keep ``func(*args, **kwargs)``, which ran untaped and returned ``out``, as one call (a
        ``clip_grad_norm_`` reads and scales every gradient in some 5 ops per parameter: taped op by
        op it would cost more than the step's own check). A replay calls it again on its stand-ins."""
        if len(self.entries) >= self.limit:
            self.truncated = True
            return
        index = len(self.entries)
        self.entries.append(self._entry(func, args, kwargs, source,
                                  None if self.gradients or self.prelude else self._running_module()))
        outs = tensors_of(out)
        self._note_outputs(index, outs)

    def _note_outputs(self, index: int, outs: list[torch.Tensor]) -> None:
        """The outputs of the kept call ``index``: named by position for a replay, the last loss-like scalar noted
        (a 0-dim floating tensor with grad; a metric or a detached copy is none), the prelude's kept weakly."""
        for slot, t in enumerate(outs):
            self._made[t] = Ref(index, slot)
        if outs and outs[0].requires_grad and outs[0].dim() == 0 and outs[0].is_floating_point():
            self.last_scalar = (index, outs[0])
        if self.prelude:
            self.outputs.append([weakref.ref(t) for t in outs])

    def _start_over(self) -> None:
        """A full prelude forgets its calls and goes on: the calls nearest the forward matter, and
        what they read from before now counts as received from outside; except the calls whose outputs are
        still alive (:meth:`_survivors`), which start the new window, renumbered, so that a value made early
        and read by the loss code after a long loop is still replayed."""
        self._restarts += 1
        self._numbers = {}  # numbers read in the window forgotten (and the tensors they were read off, let go)
        try:
            kept = self._survivors()
        except Exception:  # noqa: BLE001  the survivors are a help to a later diagnosis, never the program's failure
            kept = []
        at = {old: new for new, old in enumerate(kept)}
        entries, outputs = self.entries, self.outputs
        self.entries = [Entry(entries[i].func, _renumber(entries[i].args, at), _renumber(entries[i].kwargs, at),
                              entries[i].source, entries[i].module,
                              None if entries[i].refs is None else tuple(_renumber(r, at) for r in entries[i].refs),
                              _renumber_numbers(entries[i].host, at))
                        for i in kept]

        self.outputs = [outputs[i] for i in kept]
        if self.last_scalar is not None:
            self.last_scalar = (at[self.last_scalar[0]], self.last_scalar[1]) if self.last_scalar[0] in at else None
        self.failed = None
        received = _tensors_in([(e.args, e.kwargs) for e in self.entries])  # what the survivors hold from outside
        self._read = {id(t) for t in received}
        self._received_bytes = sum(t.numel() * t.element_size() for t in received if not t.is_nested)
        self.rng_marks = [(len(kept), RngState.current())]  # the survivors draw nothing (checked): no mark before them
        self.autocast = AutocastState.current()
        self._made = _MadeTable()
        for new, refs in enumerate(self.outputs):
            for slot, ref in enumerate(refs):
                t = ref()
                if t is not None:
                    self._made[t] = Ref(new, slot)  # a later call reading it names it: the replay goes on from it

    def _survivors(self) -> list[int]:
        """Indices of the kept calls a start-over carries on (:data:`PRELUDE_SURVIVORS`), in order: each call one of
        whose outputs is still alive, with the calls it needs, when they fit the bounds and re-running them gives
        back exactly the live values. Oldest first: a value made early is the one a start-over would lose.
        What it walks is looked up as the walk needs it (a start-over runs in a healthy step: few allocations)."""
        entries, outputs = self.entries, self.outputs
        n = min(len(entries), len(outputs))
        limit = min(PRELUDE_SURVIVORS, self.limit // 4)
        if not n or limit <= 0:
            return []
        lone_scalar: torch.Tensor | None = None
        if self.last_scalar is not None:  # held by the tape itself, not by the program
            index, scalar = self.last_scalar
            if index < n and sys.getrefcount(scalar) <= 3 + sum(r() is scalar for r in outputs[index]):
                lone_scalar = scalar
        cache: dict[int, list[torch.Tensor | None]] = {}

        def live(i: int) -> list[torch.Tensor | None]:
            got = cache.get(i)
            if got is None:
                got = cache[i] = [None if t is lone_scalar else t for t in (r() for r in outputs[i])]
            return got

        candidates = [i for i in range(n) if any(t is not None for t in live(i))] if lone_scalar is not None else \
            [i for i in range(n) if any(r() is not None for r in outputs[i])]
        if not candidates:
            return []
        kept: set[int] = set()
        check = _SurvivorCheck(self, live)
        try:
            self._choose(candidates, _CallGraph(entries, n), live, limit, kept, check)
        finally:
            check.close()
        return sorted(kept)

    @staticmethod
    def _choose(candidates: list[int], graph: "_CallGraph", live: Callable[[int], list[torch.Tensor | None]],
                limit: int, kept: set[int], check: "_SurvivorCheck") -> None:
        """Add to ``kept`` each candidate's closure that fits the bounds and passes ``check``."""
        visits = _SURVIVOR_VISITS * PRELUDE_SURVIVORS
        for c in candidates:
            if c in kept:
                continue
            closure: set[int] = set()
            stack = [c]
            while stack and visits > 0:
                i = stack.pop()
                if i in kept or i in closure:
                    continue
                visits -= 1
                closure.add(i)
                if len(kept) + len(closure) > limit:
                    break
                stack.extend(graph.deps(i))
                for slot, t in enumerate(live(i)):
                    if t is None or t._version != 0:  # dead, or written in place: whatever wrote into it comes too
                        stack.extend(graph.readers(i, slot))
            if stack or len(kept) + len(closure) > limit:
                if visits <= 0:
                    break
                continue
            if check.run(sorted(closure)):
                kept |= closure

    def _entry(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], source: str | None,
               module: str | None = None) -> Entry:
        """A kept call: its arguments encoded, with the kept calls it read noted on the way."""
        refs = self._refs = []
        entry = Entry(func, self._encode(args), self._encode(kwargs), source, module, tuple(refs),
                      self._host_numbers(args, kwargs) if self._numbers or (
                          self.earlier is not None and self.earlier._numbers) else None)
        self._refs = None
        return entry

    def _encode(self, obj: Any, depth: int = 0) -> Any:
        kind = type(obj)
        if kind in _PLAIN or obj is None:
            return obj
        if kind is torch.Tensor or isinstance(obj, torch.Tensor):
            made = self._made.get(obj)
            if made is not None:
                if self._refs is not None:
                    self._refs.append(made)
                return made
            if id(obj) not in self._read:
                self._read.add(id(obj))
                if self.prelude and not obj.is_nested:
                    self._received_bytes += obj.numel() * obj.element_size()
            read = self._grad_of.get(id(obj)) if self._grad_of else None
            return read[1] if read is not None and read[0] is obj else obj
        if self._generators and isinstance(obj, torch.Generator):
            return self._generators.pop(id(obj), obj)
        if depth > 3:
            return obj
        if kind is tuple or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
            return tuple([self._encode(v, depth + 1) for v in obj])
        if isinstance(obj, list):
            return [self._encode(v, depth + 1) for v in obj]
        if isinstance(obj, dict):
            return {k: self._encode(v, depth + 1) for k, v in obj.items()}
        return obj

    def held_alone_bytes(self) -> int:
        """Bytes of the tensors the kept calls hold as arguments that nothing else references any more (the
        program dropped them; the tape keeps them alive): what keeping these calls costs in memory."""
        seen = _tensor_uses([(e.args, e.kwargs) for e in self.entries])
        total = 0
        for held in seen.values():
            t, uses = held
            # references: one per use in the kept calls, the list above, ``t`` and getrefcount's argument
            if sys.getrefcount(t) <= uses + 3 and not t.is_nested:
                total += t.numel() * t.element_size()
        return total

    def ref_of(self, t: torch.Tensor) -> Ref | None:
        """Which kept call made ``t`` (in the step being recorded), if one did."""
        return self._made.get(t)

    def note_loss(self, loss: torch.Tensor) -> None:
        """The tensor ``backward()`` was called on: where a replay of the tape ends."""
        ref = self._made.get(loss)
        if ref is not None:
            self.loss = ref
            if ref not in self.losses:
                self.losses.append(ref)

    def keep_first(self, n: int) -> None:
        """Forget the calls after the first ``n`` (the code that ran after the step's last ``backward()``
        is the gradient tape's, not the loss code's), with their RNG marks and a failure among them."""
        if len(self.entries) <= n and not (self.truncated and n < self.limit):
            return
        del self.entries[n:]
        del self.outputs[n:]
        self._made.drop_from(n)  # a later call reading one of their outputs must not name a number reused after n
        if n < self.limit:  # the calls up to n were all kept: only the window after them filled the tape
            self.truncated = False
        self.rng_marks = [m for m in self.rng_marks if m[0] < n]
        if self.failed is not None and self.failed[0] >= n:
            self.failed = None
        self._mark_due = False

    def sub_step(self, n: int, loss: Ref) -> "LossTape":
        """A copy of the tape that ends after its first ``n`` calls, at ``loss`` (a loss the step's code made and
        left without ``backward()``): what a replay of that abandoned sub-step re-issues. The tape itself is
        unchanged."""
        part = copy.copy(self)
        part.entries = self.entries[:n]
        part.rng_marks = [m for m in self.rng_marks if m[0] < n]
        part.truncated = False
        part.loss, part.losses = loss, [loss]
        part.failed = self.failed if self.failed is not None and self.failed[0] < n else None
        return part

    def naming_outputs(self, forwards: Sequence[Any]) -> "LossTape":
        """A copy of the tape whose calls name the model's outputs (the logits, often the largest
        tensors of a step) by position instead of holding them: a replay feeds it the replayed
        outputs anyway. What the sync-free mode keeps of a step until the next one has decided it."""
        positions: dict[int, OutputRef] = {}
        for u, record in enumerate(forwards):
            for i, ref in enumerate(getattr(record, "outputs", [])):
                t = ref()
                if t is not None:
                    positions[id(t)] = OutputRef(u, i)
        light = copy.copy(self)
        if positions:
            light.entries = [Entry(e.func, _name_outputs(e.args, positions), _name_outputs(e.kwargs, positions), e.source,
                                   e.module, e.refs,
                                   None if e.host is None else tuple(
                                       dataclasses.replace(h, source=_name_outputs(h.source, positions)) for h in e.host))
                             for e in self.entries]
        return light

    @property
    def usable(self) -> bool:
        if self.prelude or self.gradients:
            return bool(self.entries) and not self.truncated
        return bool(self.entries) and not self.truncated and (self.loss is not None or self.failed is not None)


def _storage_key(t: torch.Tensor) -> tuple[int, Any] | None:
    """(storage pointer, device) of ``t``: a parameter, ``p.data`` and their views share it."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (ptr, t.device) if ptr else None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """(first, last) element offsets of ``t`` in its storage."""
    if not t.numel():
        return t.storage_offset(), t.storage_offset() - 1
    return t.storage_offset(), t.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))


def _within(t: torch.Tensor, p: torch.Tensor) -> bool:
    """The elements of ``t`` lie within those of ``p`` (contiguous), in the same storage."""
    lo, hi = _extent(t)
    plo, phi = _extent(p)
    return plo <= lo and hi <= phi and p.is_contiguous()


def _refs_in(obj: Any, depth: int = 0) -> list[Ref]:
    """The :class:`Ref` arguments of a call (as ``_encode`` nests them)."""
    if isinstance(obj, Ref):
        return [obj]
    if depth > 4:
        return []
    if isinstance(obj, (tuple, list)):
        return [r for v in obj for r in _refs_in(v, depth + 1)]
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in _refs_in(v, depth + 1)]
    return []


def _map_nested(obj: Any, leaf: Callable[[Any], Any], limit: int, depth: int = 0) -> Any:
    """``obj`` with ``leaf`` applied to each value inside its tuples (not named ones), lists and dicts, expanded
    ``limit`` levels deep (a call's arguments as the tape encodes them)."""
    if depth <= limit:
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(_map_nested(v, leaf, limit, depth + 1) for v in obj)
        if isinstance(obj, list):
            return [_map_nested(v, leaf, limit, depth + 1) for v in obj]
        if isinstance(obj, dict):
            return {k: _map_nested(v, leaf, limit, depth + 1) for k, v in obj.items()}
    return leaf(obj)


def _renumber(obj: Any, at: dict[int, int]) -> Any:
    """A call's arguments with each :class:`Ref` pointing at the call's new position (a start-over's survivors)."""
    return _map_nested(obj, lambda v: Ref(at[v.entry], v.slot) if isinstance(v, Ref) else v, 4)


def _renumber_numbers(host: "tuple[HostNumber, ...] | None", at: dict[int, int]) -> "tuple[HostNumber, ...] | None":
    """A survivor's host numbers after a start-over: a number read off a call that was not carried loses its source."""
    if host is None:
        return None
    kept = tuple(dataclasses.replace(h, source=Ref(at[h.source.entry], h.source.slot)) if isinstance(h.source, Ref)
                 else h for h in host if not isinstance(h.source, Ref) or h.source.entry in at)
    return kept or None


def is_number_read(func: Any) -> bool:
    """``func`` is a host read that hands the code a Python number or a list of them (:data:`_NUMBER_READS`)."""
    return _name(func) in _NUMBER_READS


def note_read(table: dict[int, tuple[Any, torch.Tensor, int]], t: Any, out: Any) -> None:
    """A host read of ``t`` (``.item()``, ``float(t)``, ``int(t)``, ``tolist()``: :data:`_NUMBER_READS`) handed the
    code the number(s) ``out``: note ``t`` in ``table`` under each number's identity, as ``id -> (the number, t, its
    flat index in t)``, both kept so that the ``id`` stays the number's (:meth:`LossTape._note_read`; a
    ``replayable`` call's re-run, ``rerun._HostReads``). A ``tolist()`` of more than :data:`NUMBER_READ_MAX`
    elements is not noted."""
    kind = type(out)
    if kind is float or kind is int:
        if isinstance(t, torch.Tensor):
            table[id(out)] = (out, t, 0)
    elif kind is list and isinstance(t, torch.Tensor) and t.numel() <= NUMBER_READ_MAX:
        for i, value in enumerate(_flat_numbers(out)):
            table[id(value)] = (value, t, i)


def host_numbers(args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                 hit: Callable[[int | str, Any, Any], Any]) -> Any:
    """Fold ``hit(key, number, found) -> found`` over a call's plain-number arguments (top level, or inside a list
    or tuple there, keeping the list's position as key; keywords by name), starting from None: what each caller
    looks the numbers up in (:meth:`LossTape._host_numbers`, ``rerun._HostReads``)."""
    found = None
    for key, value in enumerate(args):
        kind = type(value)
        if kind is float or kind is int:
            found = hit(key, value, found)
        elif kind is tuple or kind is list:
            for v in value:
                if type(v) is float or type(v) is int:
                    found = hit(key, v, found)
    if kwargs:
        for key, value in kwargs.items():
            if type(value) is float or type(value) is int:
                found = hit(key, value, found)
    return found


def _flat_numbers(values: Any, depth: int = 0) -> list[Any]:
    """The numbers of a ``tolist()`` in row-major order (the tensor's flat index)."""
    if type(values) is list and depth < 8:
        return [v for item in values for v in _flat_numbers(item, depth + 1)]
    return [values]


_REPLAYED_NUMBERS: dict[int, tuple["weakref.ref[Any]", list[list[Any]]]] = {}
"""id of a replay's provenance table (an op tracer's ``made_by``) -> (a weak reference to it; for each re-issued call
that took host numbers: ``[first, last, [(key, index, value, replayed tensor), ...]]``, the call's ops being the
tracer's op indices ``first < i <= last``)."""


def _table_key(table: Any) -> Any:
    return getattr(table, "inner", table)  # a wrapper of the table (localisation.exceptions) shares its numbers


def note_replayed_numbers(table: Any, first: int, numbers: list[tuple[Any, int, Any, torch.Tensor]]) -> list[Any]:
    """Note that the call a replay is about to re-issue (its ops will be numbered after ``first``) takes host numbers,
    each ``(key, index, value, replayed tensor it was read off)``; returns the record, whose end index the caller sets
    once the call has run (``record[1] = tracer.index``). What :func:`replayed_numbers` looks up."""
    inner = _table_key(table)
    record: list[Any] = [first, None, numbers]
    key = id(inner)
    held = _REPLAYED_NUMBERS.get(key)
    if held is None or held[0]() is not inner:
        held = (weakref.ref(inner, lambda _, key=key: _REPLAYED_NUMBERS.pop(key, None)), [])
        _REPLAYED_NUMBERS[key] = held
    held[1].append(record)
    return record


def replayed_numbers(table: Any, index: int) -> list[tuple[Any, int, Any, torch.Tensor]]:
    """The host numbers (``(key, index, value, replayed tensor)``) taken by the re-issued call whose ops include the op
    numbered ``index`` in the replay whose provenance table is ``table``; empty when none."""
    if table is None or not _REPLAYED_NUMBERS:
        return []
    inner = _table_key(table)
    held = _REPLAYED_NUMBERS.get(id(inner))
    if held is None or held[0]() is not inner:
        return []
    for first, last, numbers in held[1]:
        if first < index and (last is None or index <= last):
            return numbers
    return []


def _same(replayed: Any, real: torch.Tensor) -> bool:
    """``replayed`` holds exactly the values of ``real`` (NaN where it has NaN)."""
    if not isinstance(replayed, torch.Tensor) or replayed.shape != real.shape or replayed.dtype != real.dtype \
            or replayed.device != real.device or real.layout != torch.strided or replayed.layout != torch.strided \
            or real.is_nested or real.is_quantized or real.is_meta:
        return False
    a, b = replayed.detach(), real.detach()
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same = same | (a.isnan() & b.isnan())
    return bool(same.all())


class _CallGraph:
    """Which kept calls each call read (:attr:`Entry.refs`), and which calls read each output (indexed once, when
    a walk first asks)."""

    def __init__(self, entries: list[Entry], n: int) -> None:
        self.entries = entries
        self.n = n
        self._readers: dict[tuple[int, int], list[int]] | None = None

    def _refs(self, j: int) -> Any:
        entry = self.entries[j]
        return entry.refs if entry.refs is not None else _refs_in((entry.args, entry.kwargs))

    def deps(self, i: int) -> list[int]:
        return [r.entry for r in self._refs(i) if r.entry < self.n]

    def readers(self, i: int, slot: int) -> list[int]:
        if self._readers is None:
            index: dict[tuple[int, int], list[int]] = {}
            for j in range(self.n):
                for r in self._refs(j):
                    index.setdefault((r.entry, r.slot), []).append(j)
            self._readers = index
        return self._readers.get((i, slot), [])


class _SurvivorCheck:
    """Re-runs a start-over's candidate survivors (:meth:`LossTape._survivors`) off every tape and mode, without
    gradients, on copies of their arguments from outside the tape and with the user's RNG state put back after,
    and tells whether they give back exactly the live values. Copies and re-made values share one byte budget."""

    def __init__(self, tape: LossTape, live: Callable[[int], list[torch.Tensor | None]]) -> None:
        self.tape = tape
        self.live = live
        self.values: dict[int, list[torch.Tensor]] = {}
        self.copies: dict[int, torch.Tensor] = {}
        self.budget = _survivor_bytes()
        self.rng: RngState | None = None

    def _decode(self, obj: Any, depth: int = 0) -> Any:
        if isinstance(obj, Ref):
            return self.values[obj.entry][obj.slot]
        if isinstance(obj, torch.Tensor):
            copy = self.copies.get(id(obj))
            if copy is None:
                self._spend(obj)
                copy = obj.detach().clone()
                self.copies[id(obj)] = copy
            return copy
        if isinstance(obj, torch.Generator):
            return _snapshot(obj)  # the tape's own snapshot stays as it is, for the replay
        if depth > 4:
            return obj
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._decode(v, depth + 1) for v in obj)
        if isinstance(obj, list):
            return [self._decode(v, depth + 1) for v in obj]
        if isinstance(obj, dict):
            return {k: self._decode(v, depth + 1) for k, v in obj.items()}
        return obj

    def _spend(self, t: torch.Tensor) -> None:
        if t.is_nested or t.layout != torch.strided:
            raise _OverBudget
        self.budget -= t.numel() * t.element_size()
        if self.budget < 0:
            raise _OverBudget

    def run(self, closure: list[int]) -> bool:
        """Re-run the calls ``closure`` (the ones not yet re-run, in order); True, and their values kept for the
        next candidates, when every live output among them comes back equal; False (and nothing kept) else."""
        if self.budget < 0:
            return False
        if self.rng is None:
            self.rng = RngState.current()
        made: dict[int, list[torch.Tensor]] = {}
        budget, copies = self.budget, dict(self.copies)
        try:
            with _Untaped(), _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
                for i in closure:
                    entry = self.tape.entries[i]
                    owner = getattr(entry.func, "__self__", None)
                    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
                        raise _OverBudget  # the user's own code (a custom Function kept as one call): never re-run here
                    self.values.update(made)
                    out = tensors_of(entry.func(*self._decode(entry.args), **self._decode(entry.kwargs)))
                    for t in out:
                        self._spend(t)
                    made[i] = out
                for i, out in made.items():  # after the closure's own writes into them
                    for slot, real in enumerate(self.live(i)):
                        if real is not None and (slot >= len(out) or not _same(out[slot], real)):
                            raise _OverBudget
        except Exception:  # noqa: BLE001  a call that cannot be re-run, or comes back different, is not kept
            for i in made:
                self.values.pop(i, None)
            self.budget, self.copies = budget, copies
            return False
        self.values.update(made)
        return True

    def close(self) -> None:
        """Put the user's RNG state back and let go of every copy."""
        if self.rng is not None:
            self.rng.restore()
        self.values, self.copies = {}, {}


class _OverBudget(Exception):
    """A survivor check stops: over its byte budget, or a value that comes back different."""


def _data_access(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.data`` read or assigned while a tape is on the mode stack: done, and, when ``t`` is a watched
    parameter, told to its provenance with the alias handed out (a write into that alias leaves no mark
    on the parameter itself: :mod:`nantrace.detection.param_provenance`)."""
    out = func(*args, **kwargs)
    if WATCHED_DATA and args and isinstance(args[0], torch.Tensor):
        data_touched(args[0], out if _name(func) == "__get__" and isinstance(out, torch.Tensor) else None)
    return out


def _name_outputs(obj: Any, positions: dict[int, OutputRef]) -> Any:
    return _map_nested(obj, lambda v: positions.get(id(v), v) if isinstance(v, torch.Tensor) else v, 3)


def unread_nograd_forwards(tape: LossTape | None, prelude: LossTape | None, units: Sequence[Any]) -> set[int]:
    """Indices of the step's forwards run under ``torch.no_grad()`` whose outputs never reached the
    step: neither the loss code nor a later forward read them, directly or through the prelude's
    calls (``old.gather(...)`` before the forward). An evaluation pass between two steps, not a
    pseudo-label or a reference log-probability; such a forward is never the step's origin.
    Live tapes name the outputs by identity; a bundle's by :class:`OutputRef` (and the prelude's
    values by ``PreludeRef``)."""
    candidates = [u for u, f in enumerate(units) if not getattr(f, "grad_enabled", True)]
    if not candidates:
        return set()
    made: dict[int, set[int]] = {}  # id of a live tensor -> the no-grad forwards it came from
    for u in candidates:
        for ref in units[u].outputs:
            t = ref() if callable(ref) else None
            if t is not None:
                made[id(t)] = {u}
    from_prelude: list[set[int]] = []  # per prelude call: the no-grad forwards its inputs came from

    def sources(obj: Any, in_prelude: bool, depth: int = 0) -> set[int]:
        if isinstance(obj, OutputRef):
            return {obj.unit}
        if isinstance(obj, torch.Tensor):
            return made.get(id(obj), set())
        if isinstance(obj, Ref):
            return from_prelude[obj.entry] if in_prelude and obj.entry < len(from_prelude) else set()
        if hasattr(obj, "entry") and hasattr(obj, "slot"):  # a bundle's PreludeRef
            return from_prelude[obj.entry] if obj.entry < len(from_prelude) else set()
        found: set[int] = set()
        if depth < 4 and isinstance(obj, (list, tuple)):
            for v in obj:
                found |= sources(v, in_prelude, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for v in obj.values():
                found |= sources(v, in_prelude, depth + 1)
        return found

    for i, entry in enumerate(prelude.entries if prelude is not None else ()):
        came = sources((entry.args, entry.kwargs), True)
        from_prelude.append(came)
        if came and i < len(prelude.outputs):
            for ref in prelude.outputs[i]:
                t = ref()
                if t is not None:
                    made[id(t)] = came
    read: set[int] = set()
    for entry in tape.entries if tape is not None else ():
        read |= sources((entry.args, entry.kwargs), False)
    for f in units:
        if getattr(f, "grad_enabled", True):
            read |= sources((getattr(f, "args", ()), getattr(f, "kwargs", {})), False)
    return set(candidates) - read
