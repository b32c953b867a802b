"""nantrace: find, explain and survive numerical failures in PyTorch training.

Usage::

    import nantrace
    guard = nantrace.watch(model, optimizer, run_dir="runs/nantrace")
    ...  # the training loop, unchanged
    guard.close()

The public names load on first use, so ``import nantrace`` (and the pytest plugin) stays
cheap until something is actually used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "watch": "._watch",
    "Guard": ".guard",
    "Config": ".config",
    "Incident": ".incident",
    "KINDS": ".taxonomy",
    "CAUSES": ".taxonomy",
    "PHASES": ".taxonomy",
    "ACTIONS": ".taxonomy",
    "NonFiniteError": ".errors",
    "replay": "._replay",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from .config import Config
    from .errors import NonFiniteError
    from .guard import Guard
    from .incident import Incident
    from .taxonomy import ACTIONS, CAUSES, KINDS, PHASES
    from ._replay import replay
    from ._watch import watch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nantrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
