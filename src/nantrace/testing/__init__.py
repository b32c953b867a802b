"""Test utilities that are not the CI check: ``host_reads`` (counts every device-to-host read,
to test the one-read-per-step promise).

Also the 0.1 names of the check's test helpers, kept for one release: the check lives in
``nantrace.check`` (``from nantrace.check import assert_check``; the pytest plugin is
``nantrace.check.pytest_plugin``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_TEST_STEPS", "assert_check"]

DEFAULT_TEST_STEPS = 20


def assert_check(*args: Any, **kwargs: Any) -> Any:
    """``nantrace.check.assert_check`` (this import path is deprecated)."""
    import warnings

    from ..check.assertions import assert_check as _assert_check

    warnings.warn("nantrace.testing.assert_check moved to nantrace.check.assert_check", DeprecationWarning, stacklevel=2)
    return _assert_check(*args, **kwargs)
