"""The 0.1 path of the pytest plugin, kept for one release because installed ``pytest11`` entry
points may still name it: the plugin is :mod:`nantrace.check.pytest_plugin`."""

from __future__ import annotations

from ..check.pytest_plugin import MARKER, nantrace_check, pytest_configure

__all__ = ["MARKER", "nantrace_check", "pytest_configure"]
