"""Every optional dependency in one place: is it installed, and what to run when it is not.

Heavy imports happen inside the functions that need them; this module only looks the
packages up (``importlib.util.find_spec``), so importing it costs nothing.

Usage::

    from nantrace._imports import require
    require("lightning")      # ImportError: ... run `pip install 'nantrace[lightning]'`
    import lightning
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["EXTRAS", "is_available", "require"]

EXTRAS: dict[str, str] = {
    "lightning": "lightning",
    "transformers": "hf",
    "accelerate": "hf",
    "tensorboard": "tensorboard",
    "plotly": "report",
    "tokenizers": "tokenizers",
    "safetensors": "all",
}
"""Import name of each optional dependency -> the ``nantrace[...]`` extra that installs it."""


@functools.lru_cache(maxsize=None)
def is_available(package: str) -> bool:
    """True when ``package`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, *, feature: str | None = None) -> None:
    """Raise an ``ImportError`` naming the pip command to run when ``package`` is missing.

    ``feature`` is what needs it (default: ``nantrace[<extra>]``), for the message.
    """
    if package not in EXTRAS:
        raise ValueError(f"nantrace._imports.require: unknown optional dependency {package!r}; "
                         f"expected one of {', '.join(map(repr, sorted(EXTRAS)))}")
    if is_available(package):
        return
    extra = EXTRAS[package]
    what = feature or f"nantrace[{extra}]"
    raise ImportError(f"{what} needs {package!r}, which is not installed: run `pip install 'nantrace[{extra}]'`")
