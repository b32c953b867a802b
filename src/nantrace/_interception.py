"""Sees the loss without touching the user's loop: a reference-counted wrapper around
``torch.autograd.backward`` (which ``Tensor.backward`` calls), active only while at least
one guard is open, and removed when the last one closes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

LossListener = Callable[[torch.Tensor], None]


class _BackwardInterceptor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[int, LossListener] = {}
        self._original: Callable[..., Any] | None = None
        self._patched: Callable[..., Any] = self._backward  # one bound object, so `is` can find it again

    def add(self, key: int, listener: LossListener) -> None:
        with self._lock:
            self._listeners[key] = listener
            if self._original is None:
                self._original = torch.autograd.backward
                torch.autograd.backward = self._patched  # type: ignore[assignment]

    def remove(self, key: int) -> None:
        with self._lock:
            self._listeners.pop(key, None)
            if not self._listeners and self._original is not None:
                if torch.autograd.backward is self._patched:
                    torch.autograd.backward = self._original  # type: ignore[assignment]
                self._original = None

    @property
    def installed(self) -> bool:
        return self._original is not None

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        original = self._original or torch.autograd.backward
        loss = tensors if isinstance(tensors, torch.Tensor) else None
        if (
            loss is not None
            and loss.numel() == 1
            and loss.is_floating_point()
            and not getattr(loss, "_nantrace_scaled", False)
        ):
            for listener in list(self._listeners.values()):
                listener(loss)
        return original(tensors, *args, **kwargs)


INTERCEPTOR = _BackwardInterceptor()
