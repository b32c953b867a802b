"""Every process-wide change nantrace makes, declared in one place.

nantrace changes nothing outside the objects it is given except what :data:`DECLARED` lists.
Each entry is installed while something needs it and removed when the last user closes;
:func:`installed` says what is in place right now.

How patches live with other tools that patch the same function (a profiler, another debugger):

- a patch wraps *whatever is there when it is installed* and keeps that function for good, so a
  layer of ours always calls on to the function it wrapped, never to the module attribute (which
  may be a later tool's wrapper around us: calling it would recurse forever);
- it is removed only while it is still on top (the module attribute is our wrapper); when another
  tool wrapped it since, our layer stays in that tool's chain as a pass-through that notifies
  nobody, is reused when a guard opens again, and leaves at its next call once that tool has
  put it back on top;
- a layer notifies only once per call, however many of our layers a chain holds;
- a tool that, closing, puts back what it found before we wrapped it drops our layer: the guard
  calls :meth:`FunctionPatch.ensure` at each step, which wraps again.

So tools may stack in any order and close in any order.

Usage::

    >>> from nantrace import patches
    >>> guard = nantrace.watch(model, optimizer)
    >>> patches.installed()
    ['torch.autograd.backward (1 listener)', 'sys.excepthook (1 listener)', ...]
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["BACKWARD", "CLIP_FUNCTIONS", "DATA_LOADER_NEXT", "DECLARED", "EXCEPTHOOK", "FUNCTION_APPLY", "VALUE_CHECK_FUNCTIONS", "AttributePatch", "Declared", "FunctionPatch",
           "PatchUnit", "install_user_traceback", "installed", "patch_attribute"]


@dataclasses.dataclass(frozen=True)
class Declared:
    """One process-wide change: what is changed, why, and while when."""

    target: str
    purpose: str
    lifetime: str


DECLARED: tuple[Declared, ...] = (
    Declared("torch.autograd.backward",
             "sees each scalar loss that ``loss.backward()`` runs on: the step's loss check and the end of the "
             "loss tape, without a change to the loop", "while a guard is open"),
    Declared("sys.excepthook",
             "one hook: diagnoses a step whose exception ended the script, and shows an uncaught "
             "NonFiniteError ending in the user's frames followed by the diagnosis",
             "diagnosis while a guard is open; the NonFiniteError display from the first watch(on_anomaly="
             "'raise'|'pause') to the end of the process"),
    Declared("torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_, "
             "torch.nn.utils.clip_grads_with_norm_",
             "the clipping monitor sees the pre-clip norm (Config.dynamics.clip_stats); while a gradient tape records, "
             "the clip is kept on it as one call", "while a clip monitor is attached"),
    Declared("torch.distributions.distribution.Distribution.__init__ and ._validate_sample (the class)",
             "sees the ValueError torch.distributions' validation raises from Python, so a step whose loop catches "
             "it is still diagnosed", "while a guard is open"),
    Declared("torch.autograd.function._SingleLevelFunction.apply (added to the class, which inherits it)",
             "a custom autograd.Function applied by the step's code is kept by the loss tape as one call, so a "
             "replay runs its backward", "while a guard is open"),
    Declared("torch.utils.data.dataloader._BaseDataLoaderIter.__next__ (the class)",
             "a DataLoader without worker processes makes the batch in the main process: its Dataset's and "
             "collate_fn's torch calls are kept off the step's tapes (the batch is what it yields)",
             "while a guard with a tape is open"),
    Declared("optimizer.step on the watched optimizer instance",
             "an exception escaping the update (a decomposition inside a K-FAC or Shampoo step) is undone and "
             "diagnosed; the wrapper passes it on unchanged", "while the guard's update check is open"),
    Declared("torch.optim.optimizer's global step pre-hooks (one per guard, moved to the front)",
             "a user's global step pre-hook (a tooling library's gradient rewrite) runs inside the watched "
             "optimizer's step after the guard's check, and is checked as the optimizer's code",
             "while the guard is open"),
    Declared("torch.optim.optimizer's global step post-hooks (one per guard, kept at the end)",
             "a user's global step post-hook (a weight clip, a unit-norm projection) writes the parameters after the "
             "watched optimizer's update: the guard checks the update after it, and undoes a non-finite one",
             "from the first step of the watched optimizer that meets a user's global post-hook until the guard "
             "closes"),
    Declared("GradScaler.scale, .unscale_, .step on the watched scaler instance",
             "the scaled loss, whether gradients were unscaled, and the decision before scaler.step",
             "while the guard watching that scaler is open"),
    Declared("torch.amp.GradScaler.step (the class)",
             "``nantrace run`` finds the optimizer and scaler of an unmodified script", "while ``nantrace run`` watches"),
    Declared("torch.optim.Optimizer.__init__ (the class)",
             "``nantrace run`` learns of each optimizer the script creates, so that the model's first forward under "
             "it is captured (the first step localised like any other)", "while ``nantrace run`` watches"),
    Declared("torch.Tensor.register_hook (the class)",
             "a replay marks each tensor hook registered during it with the module that registered it (the op a "
             "hook issues belongs to the code that put it there)", "while a replay runs"),
    Declared("gc.get_referrers(optimizer) (read only)",
             "on_anomaly='rollback' finds the LR schedulers driving the optimizer, to restore them with it "
             "(or declare them: guard.add_scheduler)", "once, at the first healthy step"),
    Declared("marker attributes",
             "``_nantrace_scaled`` on GradScaler.scale's output (its backward is not a second loss); "
             "``_nantrace_version`` on the guard's own buffer copies; ``_nantrace_seen`` on an exception already "
             "diagnosed; ``_nantrace_replayable`` on guard.replayable's wrapper; ``_nantrace_patch`` on our wrappers",
             "for the object's life"),
)
"""The whole list. A change to nantrace that patches anything else adds it here."""


class FunctionPatch:
    """A module-level function wrapped while at least one listener needs it.

    ``wrap(original, patch)`` builds the wrapper: it calls ``original`` (the function it wrapped,
    never the module attribute) and hands what it saw to ``patch.listeners()``.
    """

    def __init__(self, target: str, wrap: Callable[[Callable[..., Any], "FunctionPatch"], Callable[..., Any]]) -> None:
        self.target = target
        self._module, _, self._attr = target.rpartition(".")
        self._wrap = wrap
        self._lock = threading.RLock()
        self._listeners: dict[Any, Callable[..., Any]] = {}
        self._layers: list[Callable[..., Any]] = []  # ours, oldest first; a buried one stays a pass-through
        self._local = threading.local()

    # ------------------------------------------------------------ listeners
    def add(self, key: Any, listener: Callable[..., Any]) -> None:
        with self._lock:
            if not self._listeners:
                self._activate()
            self._listeners[key] = listener

    def remove(self, key: Any) -> None:
        with self._lock:
            if self._listeners.pop(key, None) is not None and not self._listeners:
                self._deactivate()

    def has(self, key: Any) -> bool:
        return key in self._listeners

    def listeners(self) -> list[Callable[..., Any]]:
        """The listeners to notify for this call: none inside a call already notified (nested layers)."""
        if getattr(self._local, "depth", 0) > 1:
            return []
        return list(self._listeners.values())

    @property
    def installed(self) -> bool:
        return bool(self._listeners)

    # ------------------------------------------------------------ the wrapper chain
    def enter(self) -> None:
        """Count a call into one of this patch's layers (a layer notifies only outside another)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def leave(self) -> None:
        self._local.depth -= 1

    def ensure(self) -> None:
        """Put a layer back if another tool's clean-up dropped ours from the chain (it restored what
        it had found before we wrapped it); cheap enough to call once per step."""
        if not self._listeners:
            return
        if self._layers and self._in_place():
            return
        with self._lock:
            if self._listeners:
                self._activate()

    def _in_place(self) -> bool:
        """Our newest layer is in the chain the attribute holds."""
        return _reaches(getattr(self._owner(), self._attr, None), self._layers[-1])

    def tidy(self) -> None:
        """Called by an idle layer: if another tool has since put it back on top, leave the chain."""
        if self._listeners or not self._layers:
            return
        with self._lock:
            if not self._listeners and self._layers:
                self._deactivate()

    def _owner(self) -> Any:
        if self._module == "sys":
            return sys
        owner = sys.modules.get(self._module)  # a dict look-up: ``ensure`` asks once per step
        if owner is not None:
            return owner
        try:
            return importlib.import_module(self._module)
        except ImportError:  # ``package.module.Class``: a class's attribute
            module, _, cls = self._module.rpartition(".")
            return getattr(importlib.import_module(module), cls)

    def _activate(self) -> None:
        owner = self._owner()
        current = getattr(owner, self._attr, None)
        if current is None:
            return
        for i, layer in enumerate(self._layers):
            if _reaches(current, layer):  # a layer of ours is still in the chain (another tool wrapped it)
                self._layers.append(self._layers.pop(i))  # the one to check for first from now on
                return
        layer = self._wrap(current, self)
        layer._nantrace_patch = self.target  # type: ignore[attr-defined]
        layer._nantrace_original = current  # type: ignore[attr-defined]
        setattr(owner, self._attr, layer)
        self._layers.append(layer)

    def _deactivate(self) -> None:
        owner = self._owner()
        current = getattr(owner, self._attr, None)
        if self._layers and current is self._layers[-1]:
            setattr(owner, self._attr, self._layers.pop()._nantrace_original)  # type: ignore[attr-defined]
        # otherwise another tool wrapped us since: our layer stays in its chain, passing calls through

    def __repr__(self) -> str:
        return f"<FunctionPatch {self.target} listeners={len(self._listeners)} layers={len(self._layers)}>"


def _reaches(function: Any, layer: Any) -> bool:
    """``function`` is ``layer`` or wraps it (``functools.wraps``'s ``__wrapped__``, our ``_nantrace_original``)."""
    for _ in range(32):
        if function is layer:
            return True
        function = getattr(function, "__wrapped__", None) or getattr(function, "_nantrace_original", None)
        if function is None:
            return False
    return False


# ------------------------------------------------------------------ torch.autograd.backward
def _wrap_backward(original: Callable[..., Any], patch: FunctionPatch) -> Callable[..., Any]:
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        patch.enter()
        try:
            listeners = patch.listeners()
            after = []
            if listeners and isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and \
                    tensors.is_floating_point() and not getattr(tensors, "_nantrace_scaled", False):
                for listener in listeners:
                    then = listener(tensors)
                    if then is not None:
                        after.append(then)
            elif not listeners:
                patch.tidy()
            try:
                result = original(tensors, *args, **kwargs)
            except Exception as exc:
                for then in after:  # autograd's engine raised (anomaly mode's NaN check, a hook's own check)
                    failed = getattr(then, "failed", None)
                    if failed is not None:
                        failed(exc)
                raise
            for then in after:
                then()
            return result
        finally:
            patch.leave()

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    backward.__doc__, backward.__name__, backward.__qualname__ = original.__doc__, original.__name__, original.__qualname__
    backward.__module__ = original.__module__
    return backward


BACKWARD = FunctionPatch("torch.autograd.backward", _wrap_backward)
"""Listeners: ``(loss) -> None | (() -> None)``, for each scalar floating loss ``backward()`` runs on;
a callable returned runs when that backward has returned, and its ``failed(exc)`` method, where it has
one, when the backward raised ``exc``."""


# ------------------------------------------------------------------ sys.excepthook
_USER_TRACEBACK = "nonfinite-error-display"


def _wrap_excepthook(original: Callable[..., Any], patch: FunctionPatch) -> Callable[..., Any]:
    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        patch.enter()
        try:
            listeners = patch.listeners()
            from .errors import NonFiniteError

            if isinstance(exc, NonFiniteError) and patch.has(_USER_TRACEBACK) and listeners:
                from ._user_traceback import show_nonfinite_error

                show_nonfinite_error(exc_type, exc, tb)
            else:
                from ._user_traceback import without_wrappers

                original(exc_type, exc, without_wrappers(tb))
            for listener in listeners:
                try:
                    listener(exc)
                except Exception:  # the process is ending: never hide the user's exception behind ours
                    pass
            if not listeners:
                patch.tidy()
        finally:
            patch.leave()

    excepthook.__wrapped__ = original  # type: ignore[attr-defined]
    return excepthook


EXCEPTHOOK = FunctionPatch("sys.excepthook", _wrap_excepthook)
"""Listeners: ``(exception) -> None`` for an uncaught exception (after Python's report of it)."""


def install_user_traceback() -> None:
    """Show an uncaught ``NonFiniteError`` ending in the user's frames, then the diagnosis (for the
    rest of the process: the error usually ends the script after its guard closed)."""
    EXCEPTHOOK.add(_USER_TRACEBACK, lambda exc: None)


# ------------------------------------------------------------------ gradient clipping
def _clip_wrapper(kind: str) -> Callable[[Callable[..., Any], FunctionPatch], Callable[..., Any]]:
    def wrap(original: Callable[..., Any], patch: FunctionPatch) -> Callable[..., Any]:
        from .dynamics.clipping import clipping_wrapper

        wrapper = clipping_wrapper(original, patch, kind)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    return wrap


CLIP_FUNCTIONS: tuple[FunctionPatch, ...] = (
    FunctionPatch("torch.nn.utils.clip_grad_norm_", _clip_wrapper("norm")),
    FunctionPatch("torch.nn.utils.clip_grad.clip_grad_norm_", _clip_wrapper("norm")),
    FunctionPatch("torch.nn.utils.clip_grads_with_norm_", _clip_wrapper("with_norm")),
)
"""Listeners: ``(params, max_norm, norm_type, total_norm) -> None`` after each clipping call."""


# ------------------------------------------------------------------ value checks written in Python
def _wrap_value_check(original: Callable[..., Any], patch: FunctionPatch) -> Callable[..., Any]:
    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        patch.enter()
        try:
            return original(*args, **kwargs)
        except ValueError as exc:
            for listener in patch.listeners():
                listener(exc)
            raise
        finally:
            patch.leave()

    return checked


def _hide_value_check_frames() -> None:
    from ._user_traceback import HIDDEN_CODES

    HIDDEN_CODES.add(_wrap_value_check(lambda: None, None).__code__)  # type: ignore[arg-type]


_hide_value_check_frames()

VALUE_CHECK_FUNCTIONS: tuple[FunctionPatch, ...] = (
    FunctionPatch("torch.distributions.distribution.Distribution.__init__", _wrap_value_check),
    FunctionPatch("torch.distributions.distribution.Distribution._validate_sample", _wrap_value_check),
)
"""torch.distributions' argument and sample validation (on by default): it raises ``ValueError`` from
Python, between two ops, where no tape or hook of the guard's sees it. Listeners: ``(exception) -> None``
as it leaves the check (a loop that catches it and trains on still gets the step diagnosed)."""


# ------------------------------------------------------------------ torch.autograd.Function.apply
class ClassMethodPatch(FunctionPatch):
    """A classmethod of a class wrapped while at least one listener needs it; ``wrap(original, patch)``
    gets the underlying function (called with the class first). When the class does not define it
    itself (it inherits it), the wrapper is added to the class and calls the inherited one; removing
    it deletes it again."""

    def _activate(self) -> None:
        owner = self._owner()
        raw = owner.__dict__.get(self._attr)
        if self._layers and self._in_place():
            return
        if isinstance(raw, classmethod):
            func = raw.__func__
        elif raw is None:
            attr = self._attr

            def func(cls: Any, *args: Any, **kwargs: Any) -> Any:
                return getattr(super(owner, cls), attr)(*args, **kwargs)

            from ._user_traceback import HIDDEN_CODES

            HIDDEN_CODES.add(func.__code__)
        else:
            return
        layer = self._wrap(func, self)
        layer._nantrace_patch = self.target  # type: ignore[attr-defined]
        layer._nantrace_original = raw  # type: ignore[attr-defined]
        setattr(owner, self._attr, classmethod(layer))
        self._layers.append(layer)

    def _deactivate(self) -> None:
        owner = self._owner()
        raw = owner.__dict__.get(self._attr)
        if self._layers and isinstance(raw, classmethod) and raw.__func__ is self._layers[-1]:
            original = self._layers.pop()._nantrace_original  # type: ignore[attr-defined]
            if original is None:
                delattr(owner, self._attr)
            else:
                setattr(owner, self._attr, original)

    def _in_place(self) -> bool:
        raw = self._owner().__dict__.get(self._attr)
        return isinstance(raw, classmethod) and getattr(raw.__func__, "_nantrace_patch", None) == self.target


def _wrap_function_apply(original: Callable[..., Any], patch: FunctionPatch) -> Callable[..., Any]:
    from .localisation.tracer import user_source
    from .loss_tape import recording_tapes, untaped

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        tapes = recording_tapes()
        if not tapes:
            return original(cls, *args, **kwargs)
        with untaped():  # its forward's ops are the Function's, not the step's code
            out = original(cls, *args, **kwargs)
        source = user_source(2)
        for tape in tapes:
            tape.keep_call(cls.apply, args, kwargs, out, source)
        return out

    apply.__wrapped__ = original  # type: ignore[attr-defined]
    apply.__doc__, apply.__qualname__ = original.__doc__, original.__qualname__
    from ._user_traceback import HIDDEN_CODES

    HIDDEN_CODES.add(apply.__code__)  # an error in a Function's forward shows the user's frames, not this one
    return apply


FUNCTION_APPLY = ClassMethodPatch("torch.autograd.function._SingleLevelFunction.apply", _wrap_function_apply)
"""A custom ``autograd.Function`` applied by the step's code (a straight-through estimator, a blackbox
solver, a gradient reversal in the loss code) is kept by the recording tapes as one call: taped op by op,
its forward's ops would replay without its node, so its backward, the user's code, would never run.
Added to ``_SingleLevelFunction`` (which inherits ``apply`` from C), where ``Function.apply`` reaches it
through ``super()`` at call time: an alias taken before the guard opened (``grad_reverse = GradReverse.apply``
at import) goes through it too. Listeners: none are called; the patch is on while a guard is open."""


def _wrap_loader_next(original: Callable[..., Any], patch: FunctionPatch) -> Callable[..., Any]:
    @functools.wraps(original)
    def __next__(self: Any) -> Any:  # noqa: N807 - the method it stands for
        from .loss_tape import untaped  # (loss_tape imports this module)

        with untaped():  # the Dataset's and collate_fn's torch calls make the batch: they are not the step's code
            return original(self)

    return __next__


def _hide_loader_frames() -> None:
    from ._user_traceback import HIDDEN_CODES

    HIDDEN_CODES.add(_wrap_loader_next(lambda self: None, None).__code__)  # type: ignore[arg-type]


_hide_loader_frames()

DATA_LOADER_NEXT = FunctionPatch("torch.utils.data.dataloader._BaseDataLoaderIter.__next__", _wrap_loader_next)
"""A ``DataLoader`` with ``num_workers=0`` runs the Dataset's ``__getitem__`` and the ``collate_fn`` in the main
process, between one step and the next forward, where the prelude's tape records: what they compute is the
batch, so they run untaped (a NaN they make is ``nonfinite_input``, phase ``data``, as from a worker process).
Listeners: none are called; the patch is on while a guard with a tape is open."""


# ------------------------------------------------------------------ attributes of one object
class AttributePatch:
    """One attribute of one object (a GradScaler instance's method, a class's method) replaced by a wrapper.

    The wrapper must pass calls through once its owner has closed: :meth:`remove` puts the original
    back only while the wrapper is still what the object holds.
    """

    _live: "weakref.WeakSet[AttributePatch]" = weakref.WeakSet()

    def __init__(self, owner: Any, name: str, wrapper: Callable[..., Any], *, purpose: str) -> None:
        self._owner = owner
        self.name = name
        self.purpose = purpose
        self.label = f"{type(owner).__name__ if not isinstance(owner, type) else owner.__name__}.{name}"
        in_dict = vars(owner) if not isinstance(owner, type) else owner.__dict__
        self._had_own = name in in_dict
        self._original = in_dict.get(name)
        self._wrapper = wrapper
        wrapper._nantrace_patch = self.label  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)
        AttributePatch._live.add(self)

    @property
    def original(self) -> Any:
        """What the object held before (``None`` when the attribute came from its class)."""
        return self._original

    def remove(self) -> None:
        if self._owner is None:
            return
        in_dict = vars(self._owner) if not isinstance(self._owner, type) else self._owner.__dict__
        if in_dict.get(self.name) is self._wrapper:
            if self._had_own:
                setattr(self._owner, self.name, self._original)
            else:
                delattr(self._owner, self.name)
        self._owner = None
        AttributePatch._live.discard(self)

    def __repr__(self) -> str:
        return f"<AttributePatch {self.label}>"


def patch_attribute(owner: Any, name: str, wrapper: Callable[..., Any], *, purpose: str) -> AttributePatch:
    """Replace ``owner.name`` with ``wrapper`` (declared in :data:`DECLARED`); ``.remove()`` undoes it."""
    return AttributePatch(owner, name, wrapper, purpose=purpose)


# ------------------------------------------------------------------ a guard's patches, as a unit
class PatchUnit:
    """The patches one owner (a guard) holds, installed together and removed together."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self._functions: list[FunctionPatch] = []
        self._attributes: list[AttributePatch] = []

    def listen(self, patch: FunctionPatch | Iterable[FunctionPatch], listener: Callable[..., Any]) -> None:
        for p in (patch,) if isinstance(patch, FunctionPatch) else patch:
            p.add(self.key, listener)
            self._functions.append(p)

    def attribute(self, owner: Any, name: str, wrapper: Callable[..., Any], *, purpose: str) -> AttributePatch:
        handle = patch_attribute(owner, name, wrapper, purpose=purpose)
        self._attributes.append(handle)
        return handle

    def remove(self) -> None:
        """Remove every patch of the unit (idempotent)."""
        for p in self._functions:
            p.remove(self.key)
        self._functions.clear()
        for handle in reversed(self._attributes):
            handle.remove()
        self._attributes.clear()


def installed() -> list[str]:
    """What nantrace has patched in this process right now, one line each."""
    out = []
    for p in (BACKWARD, EXCEPTHOOK, *CLIP_FUNCTIONS, *VALUE_CHECK_FUNCTIONS, FUNCTION_APPLY, DATA_LOADER_NEXT):
        if p.installed:
            out.append(f"{p.target} ({len(p._listeners)} listener{'s' if len(p._listeners) != 1 else ''})")
    out.extend(sorted(f"{h.label} ({h.purpose})" for h in list(AttributePatch._live)))
    return out
