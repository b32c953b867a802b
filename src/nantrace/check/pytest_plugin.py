"""pytest plugin: the ``nantrace_check`` fixture and the ``nantrace`` marker.

Registered through the ``pytest11`` entry point, so installing nantrace is enough. At
pytest start-up it only registers the marker; the check machinery is imported the first
time a test calls the fixture. Nothing else is hooked: other test suites are unaffected.

* ``nantrace_check(spec=None, *, steps=20, seed=0, policy="skip", expect_incident=False,
  **fields) -> CheckResult`` trains the spec (or the ``model=``/``data=``/``loss_fn=``...
  fields) for a few steps under nantrace. Any incident fails the test with the diagnosis
  (op, module, source line, cause, fix) as the failure message; with
  ``expect_incident=True`` (or a cause/kind string) the test fails unless one happens.
* ``@pytest.mark.nantrace(steps=..., seed=..., policy=...)`` on a test, a class or a module
  (``pytestmark``) sets the fixture's defaults there; arguments given to the call win.

Usage::

    import pytest, torch.nn.functional as F

    def test_classifier_is_numerically_stable(nantrace_check):
        nantrace_check(model=Classifier(), data=make_batch, num_classes=10,
                       loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    @pytest.mark.nantrace(steps=100, seed=3)
    def test_longer(nantrace_check):
        nantrace_check("my_project.checks:make_check")

    def test_guard_catches_log_zero(nantrace_check):
        result = nantrace_check(make_broken_check, expect_incident="log_nonpositive")
        assert result.incidents[0].module == "energy"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from .spec import CheckResult

MARKER = "nantrace"
_MARKER_OPTIONS = ("steps", "seed", "policy")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(steps=20, seed=0, policy='skip'): defaults for the nantrace_check fixture in this test, class or module",
    )


@pytest.fixture
def nantrace_check(request: pytest.FixtureRequest) -> Callable[..., "CheckResult"]:
    """A callable that runs a nantrace stability check and fails the test on an incident.

    ``nantrace_check(spec=None, *, steps=20, seed=0, policy="skip", run_dir=None,
    expect_incident=False, **fields) -> CheckResult``; see :mod:`nantrace.check.pytest_plugin`.
    """
    defaults: dict[str, Any] = {}
    for mark in reversed(list(request.node.iter_markers(MARKER))):  # closest marker last, so it wins
        if mark.args:
            pytest.fail(f"@pytest.mark.{MARKER} takes keyword arguments only ({', '.join(_MARKER_OPTIONS)}); "
                        f"got positional {mark.args!r}", pytrace=False)
        unknown = sorted(set(mark.kwargs) - set(_MARKER_OPTIONS))
        if unknown:
            pytest.fail(f"@pytest.mark.{MARKER} got unknown option(s) {', '.join(unknown)}; "
                        f"expected {', '.join(_MARKER_OPTIONS)}", pytrace=False)
        defaults.update(mark.kwargs)

    def check(spec: Any = None, /, **kwargs: Any) -> "CheckResult":
        from .assertions import assert_check

        try:
            return assert_check(spec, **{**defaults, **kwargs})
        except AssertionError as exc:
            message = str(exc)
        pytest.fail(message, pytrace=False)  # outside the except: the diagnosis alone, no chained traceback

    return check
