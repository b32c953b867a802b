"""The 0.1 name of the check's test helpers, kept for one release: use ``nantrace.check``
(``from nantrace.check import assert_check``); the pytest plugin is ``nantrace.check.pytest_plugin``.
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
