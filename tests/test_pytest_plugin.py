"""The pytest plugin, used as a user uses it: an inner pytest session (pytester) whose tests
call the ``nantrace_check`` fixture on a healthy model and on one with log(0) at step 7."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

pytest_plugins = ["pytester"]

INNER = textwrap.dedent('''\
    import pytest
    import torch
    import torch.nn.functional as F
    from torch import nn

    pytestmark = pytest.mark.nantrace(steps=12)


    class LogEnergy(nn.Module):
        def forward(self, x):
            return torch.log(x.pow(2).sum(1, keepdim=True))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
            self.energy = LogEnergy()
            self.head = nn.Linear(17, 3)

        def forward(self, x):
            return self.head(torch.cat([self.body(x), self.energy(x)], 1))


    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        if step == 7:
            x[3] = 0.0
        return x, torch.randint(0, 3, (16,), generator=g)


    def loss_fn(model, b):
        return F.cross_entropy(model(b[0]), b[1])


    def healthy():
        return {"model": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), "data": batch,
                "loss_fn": loss_fn, "num_classes": 3}


    def test_clean(nantrace_check):
        result = nantrace_check(**healthy())
        assert result.ok and result.steps_run == 12  # the module's marker


    @pytest.mark.nantrace(steps=5)
    def test_marker_closest_wins(nantrace_check):
        assert nantrace_check(healthy).steps_run == 5


    def test_log_zero(nantrace_check):
        nantrace_check(model=Net(), data=batch, loss_fn=loss_fn)


    def test_log_zero_expected(nantrace_check):
        result = nantrace_check(model=Net(), data=batch, loss_fn=loss_fn, expect_incident="log_nonpositive")
        [incident] = result.incidents
        assert (incident.step, incident.module, incident.op) == (7, "energy", "aten.log.default")


    def test_expected_but_clean(nantrace_check):
        nantrace_check(healthy, expect_incident=True)
''')
LOG_LINE = INNER.splitlines().index("        return torch.log(x.pow(2).sum(1, keepdim=True))") + 1


def _plugin_args() -> list[str]:
    """Load the plugin explicitly only when the pytest11 entry point is not installed."""
    installed = any(ep.value == "nantrace.testing.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "nantrace.testing.pytest_plugin"]


def test_the_fixture_passes_fails_with_the_diagnosis_and_expects(pytester):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider", *_plugin_args())
    result.assert_outcomes(passed=3, failed=2)
    out = result.stdout.str()
    log_zero = out.split("test_log_zero _")[1].split("_ test_")[0]
    for expected in ("step 7 · nonfinite_loss · skipped", "aten.log.default", "'energy'", "log_nonpositive",
                     f"test_inner.py:{LOG_LINE}", "nantrace check: 12 steps, 1 incident: FAILED"):
        assert expected in log_zero, (expected, log_zero)
    assert "nantrace/check/" not in log_zero and "During handling" not in out  # the diagnosis, no traceback
    assert "expected nantrace check to find an incident; 12 steps ran clean" in out
    result.stdout.fnmatch_lines(["FAILED test_inner.py::test_log_zero*", "FAILED test_inner.py::test_expected_but_clean*"])


def test_the_marker_is_registered_and_checked(pytester):
    pytester.makepyfile(test_inner='''
        import pytest

        @pytest.mark.nantrace(step=5)
        def test_typo(nantrace_check):
            nantrace_check({})
    ''')
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider", *_plugin_args())
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.nantrace got unknown option(s) step; expected steps, seed, policy*"])


def test_loading_the_plugin_imports_nothing_beyond_nantrace():
    """At pytest start-up the plugin costs what ``import nantrace`` costs, nothing more."""
    code = ("import sys, pytest, nantrace; before = set(sys.modules); import nantrace.check.pytest_plugin; "
            "print(sorted(set(sys.modules) - before))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['nantrace.check', 'nantrace.check.pytest_plugin']"
