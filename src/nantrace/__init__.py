"""nantrace: find, explain and survive numerical failures in PyTorch training.

Usage::

    import nantrace
    guard = nantrace.watch(model, optimizer, run_dir="runs/nantrace")
    ...  # the training loop, unchanged
    guard.close()
"""

from .config import Config
from .errors import NonFiniteError
from .guard import Guard
from .watch import watch
from .incident import ACTIONS, CAUSES, KINDS, PHASES, Incident
from .replay import replay

__version__ = "0.1.0"

__all__ = [
    "ACTIONS",
    "CAUSES",
    "Config",
    "Guard",
    "Incident",
    "KINDS",
    "NonFiniteError",
    "PHASES",
    "__version__",
    "replay",
    "watch",
]
