"""Tracebacks for humans: a ``NonFiniteError`` is shown ending in the user's own frames.

Under ``on_anomaly="raise"``/``"pause"`` the error is raised deep inside nantrace, called from
torch's hook machinery inside ``optimizer.step()`` or ``loss.backward()``. Those frames say
nothing to the user, and a dozen of them push the line that matters (their ``step()`` call)
out of sight. As pytest hides its own frames when it shows a failure, nantrace hides its own
and torch's *below the user's last frame* when a ``NonFiniteError`` is shown, then prints the
diagnosis:

- :func:`user_traceback` trims a traceback chain (``tb_next`` is writable) to the user's frames;
- :func:`install_excepthook` (called by ``nantrace.watch``) turns this on in nantrace's one
  ``sys.excepthook`` (``nantrace.patches``), which hands every other exception to the hook it
  found, untouched;
- ``nantrace run`` trims the same way (``autowatch``).

Usage::

    Traceback (most recent call last):
      File "train.py", line 41, in <module>
        optimizer.step()
    nantrace.errors.NonFiniteError: nantrace: nonfinite_loss at step 812 in aten.log.default ...

    nantrace diagnosis · step 812 · nonfinite_loss · raised
      op       aten.log.default in module 'head'
      source   model.py:27
      cause    log_nonpositive
      fix      Clamp the argument first, ...
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType
from typing import Any

import torch

from .errors import NonFiniteError

__all__ = ["HIDDEN_CODES", "diagnosis_lines", "install_excepthook", "show_nonfinite_error", "user_traceback",
           "without_wrappers"]

_NANTRACE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_USER_CODE_IN_NANTRACE = (_NANTRACE_DIR + "demo" + os.sep,)  # the demo's model is user code


def _internal(tb: TracebackType, *, torch_too: bool) -> bool:
    name = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if name.startswith(_NANTRACE_DIR) and not name.startswith(_USER_CODE_IN_NANTRACE):
        return True
    return torch_too and name.startswith(_TORCH_DIR)


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without nantrace's frames anywhere and without torch's after the user's last frame.

    Relinks the chain in place and returns its new head; unchanged when no user frame is in it.
    """
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    users = [i for i, e in enumerate(entries) if not _internal(e, torch_too=True)]
    if not users:
        return entries[0] if entries else None
    kept = [e for e in entries[: users[-1] + 1] if not _internal(e, torch_too=False)]
    for outer, inner in zip(kept, kept[1:]):
        outer.tb_next = inner
    kept[-1].tb_next = None
    return kept[0]


HIDDEN_CODES: set[Any] = set()
"""Code objects of nantrace's wrappers that pass a user's exception through (``patches``): never
shown in the user's traceback."""


def without_wrappers(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the frames of nantrace's pass-through wrappers (relinked in place)."""
    head = tb
    while head is not None and head.tb_frame.f_code in HIDDEN_CODES:
        head = head.tb_next
    entry = head
    while entry is not None:
        nxt = entry.tb_next
        while nxt is not None and nxt.tb_frame.f_code in HIDDEN_CODES:
            nxt = nxt.tb_next
        entry.tb_next = nxt
        entry = nxt
    return head


def diagnosis_lines(incident: Any) -> list[str]:
    """The diagnosis, a few plain lines to follow the traceback."""
    phase = f" · phase {incident.phase}" if incident.phase else ""
    lines = [f"nantrace diagnosis · step {incident.step} · {incident.kind}{phase} · {incident.action}"]
    if incident.op:
        where = "" if incident.module is None else (" in the model's top-level forward" if incident.module == ""
                                                    else f" in module '{incident.module}'")
        lines.append(f"  op       {incident.op}{where}")
    elif incident.module:
        lines.append(f"  module   {incident.module}")
    if incident.source:
        lines.append(f"  source   {incident.source}")
    lines.append(f"  cause    {incident.cause}")
    lines.append(f"  what     {incident.summary}")
    lines.append(f"  fix      {incident.fix}")
    if incident.bundle:
        lines.append(f"  bundle   {incident.bundle}  (re-run it with: nantrace replay {incident.bundle})")
    return lines


def show_nonfinite_error(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Print an uncaught ``NonFiniteError`` ending in the user's frames, then the diagnosis
    (called by nantrace's one ``sys.excepthook``, ``nantrace.patches.EXCEPTHOOK``)."""
    tb = user_traceback(tb)
    exc.__traceback__ = tb
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(text + "\n" + "\n".join(diagnosis_lines(exc.incident)) + "\n")  # type: ignore[attr-defined]
    sys.stderr.flush()


def install_excepthook() -> None:
    """Show an uncaught ``NonFiniteError`` this way for the rest of the process (idempotent)."""
    from .patches import install_user_traceback

    install_user_traceback()
