"""``nantrace check``: a numerical-stability smoke test for CI, as a library call.

A *check spec* says what to train: a model, its data, a loss function (and optionally an
optimizer, a GradScaler, an autocast dtype, an LR scheduler). `run_check` trains it for a
few steps on the CPU with a fixed seed under :func:`nantrace.watch`, validates every batch
with :func:`nantrace.data.validate_batch`, and returns a `CheckResult`: every incident
(numerical or data) with its full diagnosis, and the verdict. Everything of the check lives
in this package: the contract (``spec.py``), the run (``run.py``), the assertion for tests
(``assertions.py``: ``assert_check``) and the pytest plugin (``pytest_plugin.py``: the
``nantrace_check`` fixture); ``nantrace/cli/check.py`` is the command line's glue.

Importing this package imports none of it (the pytest plugin loads at every pytest start):
each name loads on first use.

Usage::

    # stability_check.py
    import torch, torch.nn.functional as F
    from nantrace.check import CheckSpec

    def make_check() -> CheckSpec:
        model = MyNet()
        data = lambda step: (torch.randn(32, 8), torch.randint(0, 3, (32,)))
        return CheckSpec(model=model, data=data, num_classes=3,
                         loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))

    $ nantrace check stability_check:make_check --steps 50
    nantrace check: 50 steps, 0 incidents: OK

    >>> from nantrace.check import run_check
    >>> result = run_check("stability_check:make_check", steps=50)
    >>> result.ok, result.exit_code, result.verdict
    (True, 0, 'nantrace check: 50 steps, 0 incidents: OK')
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CHECK_POLICIES": ".spec",
    "DEFAULT_STEPS": ".spec",
    "CheckResult": ".spec",
    "CheckSpec": ".spec",
    "CheckStepError": ".spec",
    "CheckUsageError": ".spec",
    "load_target": ".spec",
    "resolve_spec": ".spec",
    "step_ranges": ".spec",
    "user_traceback": ".spec",
    "run_check": ".run",
    "DEFAULT_TEST_STEPS": ".assertions",
    "assert_check": ".assertions",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .assertions import DEFAULT_TEST_STEPS, assert_check
    from .run import run_check
    from .spec import (CHECK_POLICIES, DEFAULT_STEPS, CheckResult, CheckSpec, CheckStepError, CheckUsageError,
                       load_target, resolve_spec, step_ranges, user_traceback)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nantrace.check' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
