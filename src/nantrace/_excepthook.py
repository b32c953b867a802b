"""Diagnoses a step that crashed the script: a reference-counted wrapper around
``sys.excepthook``, active only while at least one guard is open.

Most failures that raise are seen where they happen (the model's forward, the loss tape);
this catches the rest, e.g. a check written in Python (``torch.distributions`` argument
validation) that raises on a NaN the step made. Python's own report of the exception is
printed first, then the diagnosis.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

ExceptionListener = Callable[[BaseException], None]


class _ExceptHook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[int, ExceptionListener] = {}
        self._previous: Callable[..., Any] | None = None

    def add(self, key: int, listener: ExceptionListener) -> None:
        with self._lock:
            self._listeners[key] = listener
            if self._previous is None:
                self._previous = sys.excepthook
                sys.excepthook = self._hook

    def remove(self, key: int) -> None:
        with self._lock:
            self._listeners.pop(key, None)
            if not self._listeners and self._previous is not None:
                if sys.excepthook is self._hook:
                    sys.excepthook = self._previous
                self._previous = None

    @property
    def installed(self) -> bool:
        return self._previous is not None

    def _hook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous = self._previous or sys.__excepthook__
        previous(exc_type, exc, tb)
        for listener in list(self._listeners.values()):
            try:
                listener(exc)
            except Exception:  # the process is ending: never hide the user's exception behind ours
                pass


EXCEPTHOOK = _ExceptHook()
