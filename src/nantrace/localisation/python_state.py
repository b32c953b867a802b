"""Keeping the Python state a re-run can reach as it was (:func:`python_state_kept`).

A re-run of the user's code (a ``replayable`` loss function, a forward of the model) runs it a second
time; code that keeps state between calls in plain Python (a loss object's history list, a dict of
per-task losses, a ``deque`` of recent values, a counter on a nested object, a ``nonlocal`` or
``global`` rebound) would otherwise leave the re-run's traces behind, and the run would train
differently from one that was never diagnosed.

Before the re-run the state it can reach is snapshotted: from the function (its bound ``self``, its
closure cells, the globals its code names, its defaults, the function it wraps), from a callable
object, a module, and the call's arguments, through containers (``list``, ``dict`` and its
subclasses, ``set``, ``deque``, tuples) and the attributes of the user's own objects, to a bounded
depth and size. The code that runs is followed too: for an object of the user's class (a loss object called,
a method's ``self``, a module) the user-defined functions of its class and bases (``__call__``, ``forward``,
the helpers it calls through ``self``) are visited like a plain function (the globals their code names,
closures, defaults). An iterator the call can reach is a position in a stream: a ``list`` / ``tuple`` /
``range`` iterator's position is kept and put back (``__reduce__`` / ``__setstate__``); any other (a
generator, a DataLoader's iterator) cannot be, and :attr:`Snapshot.unrestorable` names it, so that the call
is not re-run (``rerun.run_unit``). Afterwards, whether the re-run returned or raised, what changed is put back
IN PLACE: the same list object keeps its identity and gets its contents back, an attribute or cell is rebound
to the object it held, an attribute the re-run added is removed.

Never copied nor restored: tensors' values (``rerun.WriteGuard`` puts back what was written in place),
a module's parameters, buffers, submodule table and hooks (only the plain attributes of the user's
own module classes are kept), and objects of torch, nantrace, the standard library or installed
packages (an optimizer, a scaler, a logger, a thread's queue: their state is not the user's code's, or
is restored elsewhere, or is shared with other threads); only their binding is kept. A container
larger than :data:`MAX_CONTAINER` (or past the overall budget) is not copied: it is fingerprinted, and
when the re-run changed it, :attr:`Snapshot.not_kept` says so.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

MAX_DEPTH = 12
"""Containers and objects nested deeper than this below a root are not visited."""
MAX_CONTAINER = 100_000
"""A container with more entries than this is fingerprinted, not copied."""
MAX_ENTRIES = 1_000_000
"""At most this many entries copied over all containers of one snapshot."""
MAX_OBJECTS = 20_000
"""At most this many containers, objects and functions visited by one snapshot."""

_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, slice, type, types.ModuleType,
          torch.Tensor, torch.dtype, torch.device, torch.Generator, types.CodeType, types.BuiltinFunctionType)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # _parameters, _buffers, _modules, the hook tables, training
_FOREIGN_TOPS = frozenset({"torch", "nantrace", "builtins", "numpy", "_pytest", "pytest", "pluggy"})
_EMPTY = object()
_SEEKABLE = frozenset({type(iter([])), type(iter(())), type(iter(range(1))), type(iter(range(1 << 64))),
                       type(reversed([]))})
"""Iterators whose position ``__reduce__`` gives and ``__setstate__`` puts back."""


@functools.lru_cache(maxsize=4096)
def _foreign_module(name: str) -> bool:
    """Code of torch, nantrace, the standard library or an installed package, not the user's."""
    top = name.partition(".")[0]
    if not top or top in _FOREIGN_TOPS or top in getattr(sys, "stdlib_module_names", ()):
        return True
    file = getattr(sys.modules.get(name), "__file__", None) or ""
    parts = file.replace("\\", "/").split("/")
    return "site-packages" in parts or "dist-packages" in parts


def _foreign(cls_or_fn: Any) -> bool:
    return _foreign_module(getattr(cls_or_fn, "__module__", None) or "")


def _code_names(code: types.CodeType, depth: int = 0) -> set[str]:
    """The global names a function's code (and the code of the functions defined in it) can read or rebind."""
    names = set(code.co_names)
    if depth < 4:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= _code_names(const, depth + 1)
    return names


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Snapshot:
    """The reachable Python state, taken by :meth:`take`, put back by :meth:`restore`."""

    def __init__(self) -> None:
        self._restores: list[Any] = []  # callables, run newest first
        self._checks: list[Any] = []  # fingerprints of containers too large to copy: (describe, before, now)
        self._seen: set[int] = set()
        self._queue: collections.deque[tuple[Any, int, bool]] = collections.deque()
        self._global_names: dict[int, set[str]] = {}  # per globals dict: the names already kept
        self._keep_alive: list[Any] = []  # ids are stable only while the objects live
        self._entries = 0
        self._objects = 0
        self._unreadable: list[str] = []
        self.not_kept: list[str] = []
        """What the re-run changed and could not be put back (a container too large to copy)."""
        self.truncated = False
        """The snapshot stopped at its object budget: state beyond it was not visited."""
        self.unrestorable: list[str] = []
        """Iterators and generators the call can reach and a re-run could advance for good (their type names)."""

    # ------------------------------------------------------------------ taking
    def take(self, roots: Sequence[Any], owners: Sequence[Any] = ()) -> "Snapshot":
        """Visit ``owners`` (a function's bound ``self``, a callable object: their attributes are kept even
        when their class is not the user's) and ``roots``."""
        for owner in owners:
            self._visit(owner, 0, force=True)
        for root in roots:
            self._visit(root, 0)
        while self._queue:  # breadth first: the state nearest the call is kept before the budget runs out
            obj, depth, force = self._queue.popleft()
            try:
                self._process(obj, depth, force)
            except Exception as exc:  # an object of the user's that refuses to be read (a __getattr__ that raises)
                self._unreadable.append(f"{type(obj).__name__}: {type(exc).__name__}: {exc}")
        return self

    def _first(self, obj: Any) -> bool:
        if id(obj) in self._seen:
            return False
        if self._objects >= MAX_OBJECTS:
            self.truncated = True
            return False
        self._seen.add(id(obj))
        self._keep_alive.append(obj)
        self._objects += 1
        return True

    def _visit(self, obj: Any, depth: int, force: bool = False) -> None:
        if not isinstance(obj, _ATOMS) and depth <= MAX_DEPTH:
            self._queue.append((obj, depth, force))

    def _process(self, obj: Any, depth: int, force: bool) -> None:
        if not self._first(obj):
            return
        if _is_iterator(obj) and _foreign(type(obj)):  # a user's iterator class keeps its position in its attributes
            self._iterator(obj, depth)
            return
        if isinstance(obj, (list, dict, set, collections.deque)):
            self._container(obj, depth)
            if not _foreign(type(obj)):  # a user's subclass of list / dict may carry attributes too
                self._attributes(obj, depth)
            return
        if isinstance(obj, (tuple, frozenset)):
            for item in obj:
                self._visit(item, depth + 1)
            return
        if isinstance(obj, types.MethodType):
            self._visit(obj.__self__, depth + 1, force=force)
            self._visit(obj.__func__, depth + 1)
            return
        if isinstance(obj, types.FunctionType):
            self._function(obj, depth)
            return
        if isinstance(obj, functools.partial):
            self._visit(obj.func, depth + 1, force=force)
            self._visit(obj.args, depth + 1)
            self._visit(obj.keywords, depth + 1)
            return
        if isinstance(obj, nn.Module):
            self._module(obj, depth)
            return
        wrapped = getattr(obj, "__wrapped__", None) if _foreign(type(obj)) else None
        if wrapped is not None:  # a decorator's object around the user's function
            self._visit(wrapped, depth + 1)
        if force or not _foreign(type(obj)) or isinstance(obj, types.SimpleNamespace):
            self._attributes(obj, depth)
            self._class_code(obj, depth)

    def _class_code(self, obj: Any, depth: int) -> None:
        """The user-defined functions of ``obj``'s class and bases (``__call__``, ``forward``, its helpers): what runs
        when the object is called, visited like a plain function (the globals its code names, closures, defaults)."""
        for fn in _class_functions(type(obj)):
            self._visit(fn, depth + 1)

    def _iterator(self, obj: Any, depth: int) -> None:
        """A list / tuple / range iterator: its position is kept (and the sequence it walks visited); any other
        iterator or generator is noted in :attr:`unrestorable`."""
        if type(obj) not in _SEEKABLE:
            self.unrestorable.append(type(obj).__qualname__)
            return
        reduced = obj.__reduce__()
        if len(reduced) < 3:  # exhausted: a re-run cannot advance it
            return
        self._restores.append(functools.partial(_reseek, obj, reduced[2]))
        for part in reduced[1]:
            self._visit(part, depth + 1)

    def _container(self, obj: Any, depth: int) -> None:
        size = len(obj)
        if size > MAX_CONTAINER or self._entries + size > MAX_ENTRIES:
            self._fingerprint(obj)
            return
        self._entries += size
        if isinstance(obj, dict):
            items = list(obj.items())
            self._restores.append(functools.partial(_refill_dict, obj, items))
            values = [v for _, v in items]
        elif isinstance(obj, set):
            values = list(obj)
            self._restores.append(functools.partial(_refill_set, obj, values))
        else:
            values = list(obj)
            self._restores.append(functools.partial(_refill_sequence, obj, values))
        for value in values:
            self._visit(value, depth + 1)

    def _fingerprint(self, obj: Any) -> None:
        def mark(o: Any) -> tuple[Any, ...]:
            if isinstance(o, dict):
                last = next(reversed(o), _EMPTY) if o else _EMPTY
                return len(o), id(last), id(o.get(last)) if last is not _EMPTY else None
            if isinstance(o, (list, collections.deque)):
                return len(o), id(o[0]) if o else None, id(o[-1]) if o else None
            return (len(o),)

        self._checks.append((obj, mark, mark(obj)))

    def _attributes(self, obj: Any, depth: int, skip: frozenset[str] = frozenset()) -> None:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            kept = {k: v for k, v in state.items() if k not in skip}
            self._restores.append(functools.partial(_rebind, state, kept, skip))
            for value in kept.values():
                self._visit(value, depth + 1)
        for slot in _slots(type(obj)):
            descriptor = getattr(type(obj), slot, None)
            if not hasattr(descriptor, "__set__"):
                continue
            try:
                value = descriptor.__get__(obj, type(obj))
            except AttributeError:
                value = _EMPTY
            self._restores.append(functools.partial(_reslot, obj, descriptor, value))
            if value is not _EMPTY:
                self._visit(value, depth + 1)

    def _module(self, module: nn.Module, depth: int) -> None:
        """A module's plain attributes, when its class is the user's (a call counter, a list of outputs a
        LightningModule appends to); its tensors, submodule table and hook tables are left alone. Its submodules
        are visited whatever their class (a wrapper of torch around the user's module), and so are its forward hooks
        (a replayed forward runs them again: a hook appending a penalty to its closure's list)."""
        if not _foreign(type(module)):
            self._attributes(module, depth, skip=_MODULE_INTERNALS)
            self._class_code(module, depth)
        for hooks in (module._forward_pre_hooks, module._forward_hooks):  # a user's hook keeps state in its closure
            for hook in list(hooks.values()):
                if _users_hook(hook):  # nantrace's own (the guard's recorder, the part hooks) keep theirs
                    self._visit(hook, depth + 1)
        for child in module._modules.values():
            if child is not None:
                self._visit(child, depth + 1)

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:  # functools.wraps: the user's function it wraps
            self._visit(wrapped, depth + 1)
        foreign = _foreign(fn)
        if foreign and not (fn.__module__ or "").startswith("nantrace"):
            return
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                value = _EMPTY
            if not foreign:  # a nantrace wrapper's own cells are not the user's state: only what they hold is
                self._restores.append(functools.partial(_recell, cell, value))
            if value is not _EMPTY:
                self._visit(value, depth + 1)
        if foreign:
            return
        space = fn.__globals__
        if id(space) not in self._global_names:
            self._keep_alive.append(space)
        names = self._global_names.setdefault(id(space), set())
        fresh = _code_names(fn.__code__) - names
        names |= fresh
        if fresh:
            bound = {name: space.get(name, _EMPTY) for name in fresh}
            self._restores.append(functools.partial(_reglobal, space, bound))
            for value in bound.values():
                if value is not _EMPTY:
                    self._visit(value, depth + 1)
        self._visit(fn.__defaults__, depth + 1)
        self._visit(fn.__kwdefaults__, depth + 1)

    # ------------------------------------------------------------------ restoring
    def restore(self) -> None:
        """Put back what changed, newest snapshot first; note what changed and could not be put back."""
        for restore in reversed(self._restores):
            try:
                restore()
            except Exception as exc:  # a container of the user's that refuses (a read-only mapping): say so
                self.not_kept.append(f"{type(restore.args[0]).__name__}: {type(exc).__name__}: {exc}")
        for note in self._unreadable:
            self.not_kept.append(f"not read: {note}")
        for name in dict.fromkeys(self.unrestorable):
            self.not_kept.append(f"{name}: the re-run may have advanced it (its position cannot be put back)")
        if self.truncated:
            self.not_kept.append(f"state past the first {MAX_OBJECTS} objects was not visited")
        for obj, mark, before in self._checks:
            if mark(obj) != before:
                self.not_kept.append(f"{type(obj).__name__} of {len(obj)} entries (over the copy limit)")
        self._restores.clear()
        self._checks.clear()
        self._keep_alive.clear()
        self._seen.clear()
        self._global_names.clear()


def _is_iterator(obj: Any) -> bool:
    """An iterator or generator (its type defines ``__next__``), not a file (whose position is the file's)."""
    return hasattr(type(obj), "__next__") and not isinstance(obj, io.IOBase)


@functools.lru_cache(maxsize=1024)
def _class_functions(cls: type) -> tuple[types.FunctionType, ...]:
    """The functions the user's classes in ``cls.__mro__`` define: methods, static and class methods, properties."""
    found: list[types.FunctionType] = []
    for klass in cls.__mro__:
        if _foreign(klass):
            continue
        for value in list(vars(klass).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                found.extend(f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType))
            elif isinstance(value, types.FunctionType):
                found.append(value)
    return tuple(found)


@functools.lru_cache(maxsize=1024)
def _slots(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        if _foreign(klass):
            continue
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def _refill_dict(d: dict[Any, Any], items: list[tuple[Any, Any]]) -> None:
    now = list(d.items())
    if len(now) == len(items) and all(a is c and b is e for (a, b), (c, e) in zip(now, items)):
        return
    d.clear()
    for key, value in items:  # item by item: a Counter's update() would add
        d[key] = value


def _refill_set(s: set[Any], values: list[Any]) -> None:
    if len(s) == len(values) and {id(v) for v in s} == {id(v) for v in values}:
        return
    s.clear()
    s.update(values)


def _users_hook(hook: Any) -> bool:
    """A hook the user's code registered: its function (through a ``functools.partial``) and, for a bound method,
    its object are not of torch, nantrace or an installed package."""
    target = hook.func if isinstance(hook, functools.partial) else hook
    owner = getattr(target, "__self__", None)
    if owner is not None and _foreign(type(owner)):
        return False
    function = getattr(target, "__func__", target)
    return not (callable(function) and _foreign(function))


def _refill_sequence(seq: Any, values: list[Any]) -> None:
    if _same(list(seq), values):
        return
    if isinstance(seq, list):
        seq[:] = values
    else:  # a deque keeps its maxlen
        seq.clear()
        seq.extend(values)


def _rebind(state: dict[str, Any], kept: dict[str, Any], skip: frozenset[str]) -> None:
    for key in [k for k in state if k not in kept and k not in skip]:
        del state[key]
    for key, value in kept.items():
        if state.get(key, _EMPTY) is not value:
            state[key] = value


def _reslot(obj: Any, descriptor: Any, value: Any) -> None:
    try:
        now = descriptor.__get__(obj, type(obj))
    except AttributeError:
        now = _EMPTY
    if now is value:
        return
    if value is _EMPTY:
        descriptor.__delete__(obj)
    else:
        descriptor.__set__(obj, value)


def _reseek(it: Any, position: Any) -> None:
    reduced = it.__reduce__()
    if len(reduced) >= 3 and reduced[2] == position:
        return
    if len(reduced) < 3:  # the re-run exhausted it: CPython forgets the sequence then, no position to go back to
        raise ValueError("the re-run exhausted it; its position cannot be put back")
    it.__setstate__(position)


def _recell(cell: types.CellType, value: Any) -> None:
    try:
        now = cell.cell_contents
    except ValueError:
        now = _EMPTY
    if now is value:
        return
    if value is _EMPTY:
        del cell.cell_contents
    else:
        cell.cell_contents = value


def _reglobal(space: dict[str, Any], bound: dict[str, Any]) -> None:
    for name, value in bound.items():
        now = space.get(name, _EMPTY)
        if now is value:
            continue
        if value is _EMPTY:
            space.pop(name, None)  # a global the re-run created
        else:
            space[name] = value


def callable_owner(fn: Any) -> Any:
    """The object whose state a call of ``fn`` belongs to: a method's ``self``, a callable object itself;
    None for a plain function, a class, or a module (whose plain attributes are visited as a root)."""
    owner = getattr(fn, "__self__", None)
    if owner is None and not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        owner = fn
    if owner is None or isinstance(owner, (type, types.ModuleType, nn.Module)):
        return None
    return owner


def snapshot_of(fn: Any, *roots: Any) -> Snapshot:
    """The Python state that calling ``fn`` (with ``roots``: its arguments) can reach, as it is now."""
    owner = callable_owner(fn)
    return Snapshot().take([fn, *roots], [owner] if owner is not None else [])


@contextlib.contextmanager
def python_state_kept(fn: Any, *roots: Any) -> Iterator[Snapshot]:
    """Snapshot the Python state that calling ``fn`` (with ``roots``: its arguments) can reach; put it back
    in place on exit, whether the block returned or raised. ``Snapshot.not_kept`` then lists what changed
    and could not be put back."""
    snapshot = snapshot_of(fn, *roots)
    try:
        yield snapshot
    finally:
        snapshot.restore()


__all__ = ["MAX_CONTAINER", "MAX_DEPTH", "MAX_ENTRIES", "MAX_OBJECTS", "Snapshot", "callable_owner",
           "python_state_kept", "snapshot_of"]
