"""``nantrace check``: the CI smoke test, run as a user runs it (a subprocess) on target
modules written here, with real failures at known steps; the contract errors in-process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import assert_unhooked
from nantrace.check import CheckSpec, CheckStepError, CheckUsageError, load_target, run_check, step_ranges

TARGET = textwrap.dedent('''\
    import torch
    import torch.nn.functional as F
    from torch import nn


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


    def batch(step, silent_at=7, nan_at=None, bad_label_at=None):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        if step == silent_at:
            x[3] = 0.0  # an all-zero record: log(0) in LogEnergy
        if step == nan_at:
            x[5, 2] = float("nan")
        if step == bad_label_at:
            y[2] = 9
        return x, y


    def loss_fn(model, b):
        return F.cross_entropy(model(b[0]), b[1])


    def make_check():
        return {"model": Net(), "data": batch, "loss_fn": loss_fn, "num_classes": 3}


    def healthy():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        return {"model": model, "data": batch, "loss_fn": loss_fn, "num_classes": 3}


    def bad_data():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        data = lambda step: batch(step, silent_at=None, nan_at=3, bad_label_at=5)
        return {"model": model, "data": data, "loss_fn": loss_fn, "num_classes": 3}


    def no_model():
        return {"data": batch, "loss_fn": loss_fn}
''')
LOG_LINE = TARGET.splitlines().index("        return torch.log(x.pow(2).sum(1, keepdim=True))") + 1

SRC = Path(__file__).resolve().parents[1] / "src"


def _nantrace(tmp_path: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``nantrace check ...`` as a user does (``python -m nantrace`` is the console script); only
    this repository's ``src`` is put on PYTHONPATH, so ``cwd`` on sys.path is the command's doing."""
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "nantrace", "check", *args], capture_output=True, text=True,
                          cwd=cwd or tmp_path, env=env, timeout=300)


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "energy_check.py"
    path.write_text(TARGET)
    return path


# ------------------------------------------------------------------ as a user runs it


def test_a_healthy_model_passes(tmp_path, target):
    elsewhere = tmp_path / "ci"
    elsewhere.mkdir()
    proc = _nantrace(tmp_path, f"{target}:healthy", cwd=elsewhere)  # path/to/file.py:function, default 50 steps
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "nantrace check: 50 steps, 0 incidents: OK" in text
    assert "nantrace ·" not in text  # no incident panel


def test_log_of_zero_at_step_7_fails_with_the_diagnosis(tmp_path, target):
    proc = _nantrace(tmp_path, "energy_check:make_check", "--steps", "20")  # module:function from the cwd
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == ""  # the report is the result: all of it on stdout
    text = proc.stdout
    for expected in ("step 7 · nonfinite_loss · skipped", "aten.log.default", "'energy'", "log_nonpositive",
                     f"energy_check.py:{LOG_LINE}", "clamp", "nantrace check: 20 steps, 1 incident: FAILED"):
        assert expected in text, (expected, text)
    assert text.count("nantrace · step") == 1


def test_json_reports_data_incidents(tmp_path, target):
    proc = _nantrace(tmp_path, "energy_check:bad_data", "--steps", "10", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert (result["ok"], result["exit_code"], result["steps_run"]) == (False, 1, 10)
    assert result["verdict"] == "nantrace check: 10 steps, 2 incidents: FAILED"
    got = [(i["step"], i["phase"], i["cause"], i["details"]["path"], i["details"]["sample_indices"], i["action"])
           for i in result["incidents"]]
    assert got == [(3, "data", "nonfinite_input", "batch[0]", [5], "skipped"),
                   (5, "data", "label_out_of_range", "batch[1]", [2], "skipped")]


@pytest.mark.parametrize("name, message", [
    ("foo", "TARGET must be module:function; got 'foo'"),
    ("energy_check:no_model", "no_model() returned a dict without 'model'; expected keys model, data, loss_fn"),
])
def test_bad_target_exits_2_with_what_was_expected(tmp_path, target, name, message):
    proc = _nantrace(tmp_path, name)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_on_anomaly_is_the_option_and_policy_a_deprecated_alias(tmp_path, target):
    proc = _nantrace(tmp_path, "energy_check:make_check", "--steps", "9", "--policy", "pause", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "nantrace: --policy is deprecated; use --on-anomaly (the same option as in `nantrace run` and nantrace.watch)"]
    result = json.loads(proc.stdout)
    assert (result["on_anomaly"], result["steps_run"]) == ("pause", 8)
    assert result["stopped"] == "on_anomaly=pause: stopped at step 7 (nonfinite_loss, log_nonpositive)"
    assert [(i["step"], i["action"]) for i in result["incidents"]] == [(7, "paused")]


def test_a_factory_that_raises_shows_the_users_frames_only(tmp_path, target):
    target.write_text(TARGET + "\n\ndef broken():\n    raise KeyError('vocab_size')\n")
    proc = _nantrace(tmp_path, "energy_check:broken")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[:2] == ["Traceback (most recent call last):", f'  File "{target}", line {len(TARGET.splitlines()) + 4}, '
                                                                "in broken"]
    assert lines[-1] == "error: broken() raised KeyError: 'vocab_size'"
    assert "nantrace" not in "\n".join(lines[:-1])  # no frame of nantrace's own


# ------------------------------------------------------------------ in-process: the contract


@pytest.fixture
def on_path(target, monkeypatch):
    monkeypatch.chdir(target.parent)
    monkeypatch.syspath_prepend(str(target.parent))
    yield
    sys.modules.pop("energy_check", None)


@pytest.mark.parametrize("name, message", [
    ("nosuchmodule_xyz:make", "cannot import module 'nosuchmodule_xyz' from TARGET 'nosuchmodule_xyz:make': "
                              "no module named 'nosuchmodule_xyz'"),
    ("energy_check:missing", "'energy_check' has no attribute 'missing'"),
    ("energy_check:batch", "batch() must take no required arguments; it requires 'step'"),
    ("energy_check:", "TARGET must be module:function; got 'energy_check:' (a file works"),
    ("no/such/file.py:make", "no such file: no/such/file.py"),
    ("energy-check:make", "'energy-check' in 'energy-check:make' is not a module name"),
])
def test_target_errors(on_path, name, message):
    with pytest.raises(CheckUsageError) as info:
        run_check(name, steps=1)
    assert message in str(info.value)


def test_import_error_in_the_target_carries_the_traceback(tmp_path, monkeypatch):
    (tmp_path / "broken_check.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckUsageError, match="importing 'broken_check' failed: RuntimeError: no GPU here") as info:
        run_check("broken_check:make", steps=1)
    assert "broken_check.py\", line 2" in info.value.detail


@pytest.mark.parametrize("returned, message", [
    ("None", "make() returned None; expected a nantrace.check.CheckSpec or a dict with keys model, data, loss_fn"),
    ("{'model': Net(), 'data': [1], 'loss_fn': loss_fn, 'optimiser': None}",
     "make() returned a dict with unknown key(s) 'optimiser'"),
    ("{'model': 3, 'data': [1], 'loss_fn': loss_fn}",
     "make() returned an invalid spec: CheckSpec.model must be a torch.nn.Module; got int"),
    ("{'model': Net(), 'data': torch.zeros(3), 'loss_fn': loss_fn}", "got a Tensor (wrap a single batch in a list"),
    ("{'model': Net(), 'data': [1], 'loss_fn': lambda batch: 0}", "CheckSpec.loss_fn must accept two arguments"),
    ("CheckSpec(model=Net(), data=[torch.randn(4, 8)], loss_fn=lambda m, b: m(b))",
     "loss_fn(model, batch) must return a scalar tensor; got a tensor of shape (4, 3)"),
    ("{'model': Net(), 'data': [], 'loss_fn': loss_fn}", "data yielded no batch"),
])
def test_contract_violations_say_what_was_expected(on_path, target, returned, message):
    target.write_text(TARGET + f"\nfrom nantrace.check import CheckSpec\n\ndef make():\n    return {returned}\n")
    with pytest.raises(CheckUsageError) as info:
        run_check("energy_check:make", steps=2)
    assert message in str(info.value)


def test_policy_raise_stops_at_the_first_incident_and_leaves_nothing_hooked(on_path):
    from energy_check import Net, batch, loss_fn

    model = Net()
    result = run_check({"model": model, "data": batch, "loss_fn": loss_fn}, steps=20, on_anomaly="raise")
    assert (result.steps_run, result.exit_code, result.on_anomaly) == (8, 1, "raise")
    [incident] = result.incidents
    assert (incident.step, incident.action, incident.op, incident.module) == (7, "raised", "aten.log.default", "energy")
    assert result.stopped == "on_anomaly=raise: stopped at step 7 (nonfinite_loss, log_nonpositive)"
    assert_unhooked(model)


def test_policy_raise_stops_at_a_bad_batch(on_path):
    from energy_check import bad_data

    result = run_check(bad_data, steps=10, on_anomaly="raise")
    assert result.steps_run == 4 and result.verdict == "nantrace check: 4 steps, 1 incident: FAILED"
    [incident] = result.incidents
    assert (incident.step, incident.phase, incident.cause, incident.action) == (3, "data", "nonfinite_input", "raised")
    assert result.stopped == "on_anomaly=raise: the batch of step 3 failed validation (nonfinite_input)"


def test_one_shot_data_that_runs_out_is_reported_not_failed(on_path):
    from energy_check import batch, healthy

    spec = healthy()
    spec["data"] = (batch(s, silent_at=None) for s in range(4))
    result = run_check(spec, steps=10)
    assert result.ok and result.steps_run == 4
    assert result.stopped == "the data ran out after 4 of 10 steps"
    assert result.verdict == "nantrace check: 4 steps, 0 incidents: OK"


def test_a_crash_in_the_loss_is_a_step_error(on_path):
    from energy_check import healthy

    def loss_fn(model, b):
        if b[0].shape[0] == 2:
            raise IndexError("token id out of range")
        return model(b[0]).sum()

    spec = {**healthy(), "data": [(torch.randn(4, 8), None), (torch.randn(2, 8), None)], "loss_fn": loss_fn}
    with pytest.raises(CheckStepError, match="at step 1: IndexError: token id out of range") as info:
        run_check(spec, steps=5)
    assert info.value.step == 1 and isinstance(info.value.__cause__, IndexError)

    def data(step):
        if step == 2:
            raise FileNotFoundError("shard-0002.bin")
        return torch.randn(4, 8), torch.zeros(4, dtype=torch.long)

    with pytest.raises(CheckStepError, match="the data raised at step 2: FileNotFoundError: shard-0002.bin"):
        run_check({**healthy(), "data": data}, steps=5)


def test_the_seed_fixes_the_run_and_the_rngs_are_restored(on_path):
    from energy_check import healthy

    built = []

    def factory():
        spec = healthy()
        built.append(spec["model"])
        return spec

    random.seed(123)
    torch.manual_seed(123)
    expected = (random.random(), torch.rand(1).item())
    random.seed(123)
    torch.manual_seed(123)
    for _ in range(2):
        result = run_check(factory, steps=3, seed=5)
        assert result.ok and result.target.endswith("factory")
    assert (random.random(), torch.rand(1).item()) == expected
    first, second = (m.state_dict() for m in built)
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("on_anomaly, steps_run, action", [("skip", 9, "skipped"), ("rollback", 9, "rolled_back"),
                                                          ("raise", 8, "raised"), ("pause", 8, "paused")])
def test_the_four_policies_of_watch(on_path, on_anomaly, steps_run, action):
    from energy_check import make_check

    result = run_check(make_check, steps=9, on_anomaly=on_anomaly)
    assert (result.steps_run, [(i.step, i.action) for i in result.incidents]) == (steps_run, [(7, action)])


def test_run_check_policy_keyword_is_a_deprecated_alias(on_path):
    from energy_check import healthy

    with pytest.deprecated_call(match="run_check\\(policy=...\\) is deprecated; pass on_anomaly=..."):
        result = run_check(healthy, steps=2, policy="raise")
    assert result.on_anomaly == "raise" and result.ok


def test_check_spec_validates_its_fields():
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        CheckSpec(model=torch.nn.Linear(2, 2), data=[1], loss_fn=lambda m, b: b, num_classes=0)
    with pytest.raises(TypeError, match="autocast must be a floating torch.dtype"):
        CheckSpec(model=torch.nn.Linear(2, 2), data=[1], loss_fn=lambda m, b: b, autocast=torch.int8)
    with pytest.raises(CheckUsageError, match="not a bare model"):
        run_check(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(CheckUsageError, match="unknown on_anomaly policy 'later'; expected one of skip, raise, "
                                              "rollback, pause"):
        run_check({}, on_anomaly="later")


def test_load_target_imports_a_file_without_shadowing_a_module(target):
    fn = load_target(f"{target}:make_check")
    assert fn.__name__ == "make_check" and fn.__module__ == "_nantrace_target_energy_check"
    assert "energy_check" not in sys.modules


def test_ranges():
    assert step_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert step_ranges([4]) == "4"
