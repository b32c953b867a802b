"""Count the host reads a piece of code makes: every way a tensor's value reaches Python.

On an accelerator each such read waits for the device's queue to drain, so "one host read
per step" is a property worth a test. This counter works on the CPU too (where a read costs
nothing and ``torch.cuda.set_sync_debug_mode`` sees nothing): it intercepts the read itself,
not its cost.

Two layers, so that no path is missed and none is counted twice:

- the Python entry points of :class:`torch.Tensor` that hand a value to Python: ``item``,
  ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``__complex__``,
  ``numpy``, ``__array__``, and ``cpu`` / ``to("cpu")`` of a tensor that lives elsewhere;
- a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees the ATen ops which
  read a value on the way (``aten._local_scalar_dense``, behind ``item``/``bool``/``float``
  and their C++ callers; ``aten.equal``, ``aten.allclose``, ``aten.is_nonzero``),
  the ops whose output size depends on values (``nonzero``, ``masked_select``, ``unique``, a
  boolean-mask index), and copies from a device to the CPU.

A read that starts in one layer is counted once (the outermost call). Reads of host memory
by design are not counted: pinned tensors (the target of an asynchronous device-to-host
copy), tensors tagged with :data:`HOST_COPY`, and nantrace's own reads of such memory
(:func:`nantrace.dynamics._readback.host_value`, a finished :class:`DeferredRead`).

Usage::

    from nantrace.testing.host_reads import HostReadCounter

    with HostReadCounter() as reads:
        train_one_step()
    print(reads.count, reads.events)   # 1 [('tolist', 'nantrace/detection/sentinel.py:...')]
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..dynamics._readback import reading_host_memory

__all__ = ["HOST_COPY", "HostReadCounter", "ReadEvent"]

HOST_COPY = "_nantrace_host_copy"
"""Attribute set on a CPU tensor that receives an asynchronous device-to-host copy."""

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy", "__array__")
_DISPATCH_READS = frozenset({
    "aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default", "aten.allclose.default",
})
_DATA_DEPENDENT = frozenset({
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.nonzero_static.default",
})


@dataclasses.dataclass(frozen=True)
class ReadEvent:
    """One counted read: how it happened and where (the first frame outside torch and this module)."""

    how: str
    where: str


class _Local(threading.local):
    depth = 0


class HostReadCounter(TorchDispatchMode):
    """Context manager counting host reads in the current thread (see the module docstring).

    ``count`` is the number of reads, ``events`` what each was. ``reset()`` starts again
    (e.g. once per training step).
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[ReadEvent] = []
        self._local = _Local()
        self._originals: dict[str, Callable[..., Any]] = {}
        self._thread = threading.get_ident()

    @property
    def count(self) -> int:
        return len(self.events)

    def reset(self) -> None:
        self.events.clear()

    # ------------------------------------------------------------------ patching
    def __enter__(self) -> "HostReadCounter":
        for name in _METHODS:
            original = getattr(torch.Tensor, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        for name in ("cpu", "to"):
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap_transfer(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
            self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return counter._counted(name, t, original, t, *args, **kwargs)

        read.__name__ = name
        return read

    def _wrap_transfer(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def transfer(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if t.device.type == "cpu" or not _to_cpu(name, args, kwargs) or kwargs.get("non_blocking"):
                return original(t, *args, **kwargs)
            return counter._counted(f"{name}(cpu)", t, original, t, *args, **kwargs)

        transfer.__name__ = name
        return transfer

    def _counted(self, how: str, t: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        local = self._local
        if local.depth == 0 and threading.get_ident() == self._thread and isinstance(t, torch.Tensor) \
                and not _host_memory(t) and not reading_host_memory():
            self.events.append(ReadEvent(how, _caller()))
        local.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            local.depth -= 1

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        how = None
        if name in _DISPATCH_READS or name in _DATA_DEPENDENT:
            how = name
        elif name == "aten.index.Tensor" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())):
            how = "aten.index.Tensor(bool mask)"
        elif name in ("aten._to_copy.default", "aten.copy_.default"):
            how = _device_to_host(name, args, kwargs)
        first = args[0] if args else None
        if how is None or not isinstance(first, torch.Tensor):
            return func(*args, **kwargs)
        return self._counted(how, first, func, *args, **kwargs)


def _to_cpu(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name == "cpu":
        return True
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    return target is not None and not isinstance(target, torch.dtype) and torch.device(target).type == "cpu"


def _device_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """A blocking copy from an accelerator to the CPU, seen as an ATen op."""
    if name == "aten._to_copy.default":
        src = args[0] if args else None
        dst = kwargs.get("device")
        to_host = dst is not None and torch.device(dst).type == "cpu"
    else:
        dst, src = (args + (None, None))[:2]
        to_host = isinstance(dst, torch.Tensor) and dst.device.type == "cpu" and not _host_memory(dst)
    if not isinstance(src, torch.Tensor) or src.device.type in ("cpu", "meta") or not to_host:
        return None
    if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return None
    return f"{name}(device→cpu)"


def _host_memory(t: torch.Tensor) -> bool:
    """Host memory that an asynchronous copy fills: reading it never waits for a device."""
    if getattr(t, HOST_COPY, False):
        return True
    if t.device.type != "cpu" or not torch.cuda.is_available():
        return False
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False


def _caller() -> str:
    """The first frame outside torch and this module: the code that asked for the value. A frame of
    nantrace's pass-through wrappers (``_user_traceback.HIDDEN_CODES``: the wrapped ``optimizer.step``,
    ``Function.apply``) does not count: what the wrapped function reads is its own."""
    from .._user_traceback import HIDDEN_CODES

    frame = sys._getframe(2)
    here = __file__
    while frame is not None:
        path = frame.f_code.co_filename
        if path != here and f"{_SEP}torch{_SEP}" not in path and frame.f_code not in HIDDEN_CODES:
            return f"{_short(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_SEP = "/" if sys.platform != "win32" else "\\"


def _short(path: str) -> str:
    for marker in (f"{_SEP}nantrace{_SEP}", f"{_SEP}tests{_SEP}", f"{_SEP}benchmarks{_SEP}"):
        if marker in path:
            return marker.strip(_SEP) + _SEP + path.split(marker, 1)[1]
    return path
