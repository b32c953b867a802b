"""The check as an assertion, for pytest or unittest.

Importing this module does not import the check machinery; that happens on the first
call. The pytest plugin (:mod:`nantrace.check.pytest_plugin`, registered through the
``pytest11`` entry point) wraps `assert_check` as the ``nantrace_check`` fixture.

Usage::

    from nantrace.check import assert_check

    def test_my_model_trains_stably():
        result = assert_check(model=MyNet(), data=batches, loss_fn=my_loss, steps=20)
        assert result.steps_run == 20

    def test_the_guard_catches_log_of_zero():
        result = assert_check(make_bad_check, expect_incident="log_nonpositive")
        assert result.incidents[0].op == "aten.log.default"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import CheckResult

__all__ = ["DEFAULT_TEST_STEPS", "assert_check"]

DEFAULT_TEST_STEPS = 20
"""Steps a check runs in a test unless told otherwise (fewer than the CLI's 50: tests add up)."""


def assert_check(
    spec: Any = None,
    /,
    *,
    steps: int = DEFAULT_TEST_STEPS,
    seed: int = 0,
    policy: str = "skip",
    run_dir: Any = None,
    expect_incident: bool | str = False,
    width: int = 100,
    **fields: Any,
) -> "CheckResult":
    """Run ``nantrace.check.run_check`` and assert its outcome; return the `CheckResult`.

    `spec` is a ``CheckSpec``, a dict, a function returning one (called after seeding) or a
    ``"module:function"`` target; or leave it out and pass the spec's fields as keywords
    (``model=``, ``data=``, ``loss_fn=``, ``optimizer=``, ``num_classes=``, ``scaler=``,
    ``autocast=``, ``lr_scheduler=``, ``config=``). By default any incident fails: the
    ``AssertionError`` carries every diagnosis and the verdict. With
    ``expect_incident=True`` it is the other way round: the check must find an incident;
    with ``expect_incident="<cause or kind>"`` one of them must have that cause (or kind).
    A spec that breaks the contract raises ``nantrace.check.CheckUsageError``; an exception
    in the training step raises ``nantrace.check.CheckStepError`` (chained to the original).
    """
    from .run import run_check

    if spec is not None and fields:
        raise TypeError(f"pass either a spec or its fields as keywords, not both (got spec and {', '.join(fields)})")
    if not isinstance(expect_incident, (bool, str)):
        raise TypeError(f"expect_incident must be a bool or a cause/kind string; got {expect_incident!r}")
    result = run_check(spec if spec is not None else dict(fields), steps=steps, seed=seed, on_anomaly=policy, run_dir=run_dir)
    if expect_incident is False:
        if not result.ok:
            raise AssertionError(result.report_text(width))
        return result
    if result.ok:
        raise AssertionError(f"expected nantrace check to find an incident"
                             f"{'' if expect_incident is True else f' with cause {expect_incident!r}'}; "
                             f"{result.steps_run} steps ran clean ({result.verdict})")
    if isinstance(expect_incident, str) and not any(expect_incident in (i.cause, i.kind) for i in result.incidents):
        found = ", ".join(sorted({f"{i.cause} ({i.kind})" for i in result.incidents}))
        raise AssertionError(f"expected an incident with cause {expect_incident!r}; found {found}\n\n"
                             + result.report_text(width))
    return result
