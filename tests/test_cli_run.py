"""``nantrace run SCRIPT [ARGS...]`` and the zero-code mode behind it (nantrace.autowatch).

The main scenario runs as a user runs it: a subprocess on an unmodified training script
written here, with a real failure at a known step. Exit codes and the AutoWatch pairing
are checked in-process (fast).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import nantrace
from conftest import same_state
from nantrace.autowatch import AutoWatch, default_run_dir, run_script
from nantrace.storage.runstore import RunStore

TRAIN_SCRIPT = '''\
import argparse, sys
import torch
import torch.nn.functional as F
from torch import nn


class MaskedMean(nn.Module):
    def forward(self, h, mask):
        return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.pool = MaskedMean()
        self.head = nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.head(self.pool(torch.tanh(self.enc(x)), mask)).squeeze(-1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int)
    parser.add_argument("--empty-at", type=int)
    parser.add_argument("--run-dir")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        x, y, mask = torch.randn(4, 5, 4), torch.randn(4), torch.ones(4, 5)
        if step == args.empty_at:
            mask[2] = 0  # an empty sequence: its masked mean is 0 / 0
        optimizer.zero_grad()
        loss = F.mse_loss(model(x, mask), y)
        loss.backward()
        optimizer.step()
    frameworks = sorted(m for m in ("lightning", "transformers", "accelerate") if m in sys.modules)
    print(f"script done: steps={args.steps} own --run-dir={args.run_dir} frameworks={frameworks}")
'''
DIVISION_LINE = 9

pytestmark = pytest.mark.usefixtures("one_thread")



def _nantrace_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``nantrace run ...`` as a user runs it: a subprocess (``python -m nantrace`` is the console script)."""
    env = dict(os.environ, COLUMNS="100", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "nantrace", "run", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_unmodified_script_is_watched_diagnosed_and_goes_on(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    proc = _nantrace_run("--run-dir", "runs/exp", "train.py", "--steps", "6", "--empty-at", "3",
                         "--run-dir", "the-scripts-own", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # everything after SCRIPT went to the script; nantrace imported no framework; the summary closes stdout
    assert proc.stdout.splitlines() == [
        "script done: steps=6 own --run-dir=the-scripts-own frameworks=[]",
        "nantrace run: watched Net with Adam: 1 incident, 1 update skipped; run directory runs/exp.",
        "Report: nantrace report runs/exp",
    ]
    err = proc.stderr  # the panel, printed by the guard as the incident happens
    for expected in ("nantrace · step 3 · nonfinite_loss · skipped", "aten.div.Tensor", "'pool'", "div_by_zero",
                     f"train.py:{DIVISION_LINE}"):
        assert expected in err, (expected, err)
    store = RunStore(tmp_path / "runs" / "exp", readonly=True)
    assert [r["step"] for r in store.steps()] == list(range(6))
    assert [r["step"] for r in store.steps() if r["skipped"]] == [3]
    [incident] = store.incidents()
    assert (incident.step, incident.kind, incident.op, incident.module, incident.cause, incident.action) == (
        3, "nonfinite_loss", "aten.div.Tensor", "pool", "div_by_zero", "skipped")
    assert incident.source.endswith(f"train.py:{DIVISION_LINE}")
    assert incident.bundle.startswith("runs/exp/incidents/step000003-nonfinite_loss")  # as given: relative to the cwd
    assert (tmp_path / incident.bundle / "diagnosis.json").is_file()
    assert not (tmp_path / "the-scripts-own").exists() and not (tmp_path / "nantrace-runs").exists()


# ---------------------------------------------------------------------- exit codes (in-process)
def _invoke(*args: str):
    from nantrace.cli.main import app

    return CliRunner().invoke(app, ["run", *args], env={"COLUMNS": "200"}, prog_name="nantrace")


def test_script_exit_code_is_preserved(tmp_path):
    script = tmp_path / "three.py"
    script.write_text("import sys\nprint('args', sys.argv[1:], __name__)\nsys.exit(3)\n")
    result = _invoke("--run-dir", str(tmp_path / "r"), str(script), "--on-anomaly", "x", "-v")
    assert result.exit_code == 3
    assert result.stdout.splitlines() == [
        "args ['--on-anomaly', 'x', '-v'] __main__",
        "nantrace run: the script exited with code 3 before any optimizer step over a model it called; "
        "nothing was watched and no run directory was written.",
    ]
    assert not (tmp_path / "r").exists()


def test_sys_exit_with_a_message_exits_1_and_prints_it(tmp_path):
    script = tmp_path / "msg.py"
    script.write_text("import sys\nsys.exit('bad config')\n")
    result = _invoke("--run-dir", str(tmp_path / "r"), str(script))
    assert result.exit_code == 1 and "bad config" in result.stderr


def test_uncaught_exception_prints_the_scripts_traceback_and_exits_1(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("def load():\n    raise FileNotFoundError('data.bin')\n\nload()\n")
    result = _invoke("--run-dir", str(tmp_path / "r"), str(script))
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == f'  File "{script}", line 4, in <module>'  # starts at the script: no runpy frames
    assert "FileNotFoundError: data.bin" in result.stderr


SELF_WATCHING = """\
import torch, nantrace
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
guard = nantrace.watch(model, optimizer, run_dir="own-run", config=nantrace.Config(print_incidents=False))
for step in range(4):
    optimizer.zero_grad()
    loss = model(torch.randn(2, 3)).pow(2).mean() * (float("nan") if step == 2 else 1.0)
    loss.backward()
    optimizer.step()
guard.close()
"""


def test_a_script_that_watches_itself_is_reported_with_its_own_guard(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "selfwatch.py").write_text(SELF_WATCHING)
    result = _invoke("--run-dir", "ours", "selfwatch.py")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "nantrace run: the script watches Linear with SGD itself with nantrace.watch: 1 incident, 1 update skipped; "
        "its run directory own-run.",
        "nantrace run: --run-dir was not used (the script's own guard writes where the script says).",
    ]
    assert (tmp_path / "own-run" / "nantrace.db").is_file() and not (tmp_path / "ours").exists()


def test_a_syntax_error_is_shown_as_python_shows_it_and_nothing_runs(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\ndef f(:\n    pass\n")
    result = _invoke("--run-dir", str(tmp_path / "r"), str(script))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f'  File "{script}", line 2', "    def f(:", "          ^",
                                          "SyntaxError: invalid syntax"]
    assert result.stdout.splitlines() == [
        f"nantrace run: {script} could not be compiled, so nothing ran; no run directory was written."]
    assert not (tmp_path / "r").exists()


def test_a_script_failing_before_any_step_says_nothing_was_watched(tmp_path):
    script = tmp_path / "noimport.py"
    script.write_text("import no_such_module_here\n")
    result = _invoke("--run-dir", str(tmp_path / "r"), str(script))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[1] == f'  File "{script}", line 1, in <module>'  # the script's frame first
    assert "nantrace/" not in result.stderr  # none of nantrace's own frames
    assert result.stdout.splitlines() == [
        "nantrace run: the script raised ModuleNotFoundError (exit code 1) before any optimizer step over a model it "
        "called; nothing was watched and no run directory was written."]
    assert not (tmp_path / "r").exists()


def test_a_script_failing_after_watched_steps_marks_its_run_failed(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(SELF_WATCHING.replace("guard = nantrace.watch(model, optimizer, run_dir=\"own-run\", "
                                            "config=nantrace.Config(print_incidents=False))\n", "")
                      .replace("guard.close()\n", "raise RuntimeError('disk full')\n"))
    result = _invoke("--run-dir", str(tmp_path / "r"), str(script))
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == (
        f"nantrace run: watched Linear with SGD: 1 incident, 1 update skipped; run directory {tmp_path / 'r'}; "
        "the script raised RuntimeError (exit code 1).")
    status = RunStore(tmp_path / "r", readonly=True).status()
    assert (status.state, status.reason, status.last_step) == ("failed", "the script raised RuntimeError: disk full", 3)


def test_missing_script_exits_2_with_a_clear_message(tmp_path):
    result = _invoke(str(tmp_path / "nope.py"))
    assert result.exit_code == 2
    assert f"error: no such script: {tmp_path / 'nope.py'}" in result.stderr.replace("\n", "")


def test_unknown_policy_is_a_usage_error(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    result = _invoke("--on-anomaly", "later", str(script))
    assert result.exit_code == 2 and "unknown policy 'later'; expected one of skip, raise, rollback, pause" in result.output


def test_default_run_dir_is_named_after_the_script(tmp_path, monkeypatch):
    import nantrace.autowatch as autowatch

    monkeypatch.setattr(autowatch.time, "strftime", lambda fmt: "20250102-030405")
    first = default_run_dir("path/to/train.py", root=tmp_path)
    assert first == tmp_path / "train-20250102-030405"
    first.mkdir()
    assert default_run_dir("train.py", root=tmp_path) == tmp_path / "train-20250102-030405-2"
    assert default_run_dir("train.py").parts == ("nantrace-runs", "train-20250102-030405")


# ---------------------------------------------------------------------- AutoWatch (in-process)
class Pool(nn.Module):
    def forward(self, h):
        return h.mean(1)


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, nan_at: int | None,
          scaler=None, autocast: bool = False) -> list[dict]:
    loss_fn = nn.MSELoss()  # a top-level module call too; it owns no parameter
    after = []
    for step in range(steps):
        x, y = torch.randn(4, 3, 4), torch.randn(4, 2)
        if step == nan_at:
            x[1, 0, 0] = float("nan")
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = loss_fn(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        after.append({k: v.clone() for k, v in model.state_dict().items()})
    return after


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), Pool(), nn.Linear(8, 2))


def test_autowatch_pairs_each_optimizer_with_its_model_and_checks_the_first_step(tmp_path):
    quiet = nantrace.Config(print_incidents=False)
    a, b = _net(0), _net(1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.01)
    with AutoWatch(run_dir=tmp_path / "run", config=quiet) as auto:
        before = {k: v.clone() for k, v in a.state_dict().items()}
        after_a = _loop(a, opt_a, 3, nan_at=0)  # the very first step of the first optimizer fails
        _loop(b, opt_b, 2, nan_at=None)
    guard_a, guard_b = auto.guards
    assert (guard_a.root, guard_a.optimizer, guard_b.root, guard_b.optimizer) == (a, opt_a, b, opt_b)
    [incident] = auto.incidents
    # detected and blocked at step 0 (its forward ran before the guard existed: not localised)
    assert (incident.step, incident.kind, incident.action) == (0, "nonfinite_grad", "skipped")
    assert same_state(after_a[0], before) and not same_state(after_a[1], after_a[0])
    assert (guard_a.step, guard_b.step) == (3, 2)
    assert (tmp_path / "run" / "nantrace.db").is_file() and (tmp_path / "run" / "2-Sequential" / "nantrace.db").is_file()
    assert all(g.closed for g in auto.guards)


def test_autowatch_localises_from_the_second_step_on():
    model = _net(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with AutoWatch(config=nantrace.Config(print_incidents=False)) as auto:
        _loop(model, optimizer, 4, nan_at=2)
    [incident] = auto.incidents
    assert (incident.step, incident.kind, incident.phase, incident.cause, incident.action) == (
        2, "nonfinite_input", "data", "nonfinite_input", "skipped")
    assert incident.details["nonfinite_inputs"] == [{"forward": 0, "arg": "args[0]", "samples": [1], "nan": 1, "inf": 0}]


def test_autowatch_hands_the_gradscaler_to_the_guard():
    model = _net(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with AutoWatch(config=nantrace.Config(print_incidents=False)) as auto:
        _loop(model, optimizer, 4, nan_at=2, scaler=scaler, autocast=True)
    [guard] = auto.guards
    assert guard.scaler is scaler and guard.step == 4
    [incident] = auto.incidents
    assert (incident.step, incident.kind, incident.cause, incident.action) == (2, "nonfinite_input", "nonfinite_input", "skipped")
    assert "step" not in scaler.__dict__ and torch.amp.GradScaler.__dict__["step"].__name__ == "step"
    assert not getattr(torch.amp.GradScaler.step, "_nantrace_autowatch", False)


def test_autowatch_notes_an_optimizer_without_a_model_and_leaves_nothing_behind():
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    hooks_before = (dict(module_mod._global_forward_pre_hooks), dict(module_mod._global_forward_hooks),
                    dict(optimizer_mod._global_optimizer_pre_hooks))
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with AutoWatch() as auto:
        (weight ** 2).sum().backward()
        optimizer.step()
    assert auto.guards == [] and auto.notes == [
        "a SGD optimizer steps parameters of no model the script called; it is not watched"]
    assert (dict(module_mod._global_forward_pre_hooks), dict(module_mod._global_forward_hooks),
            dict(optimizer_mod._global_optimizer_pre_hooks)) == hooks_before


def test_run_script_restores_argv_and_path(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""\
        import sys
        assert sys.argv == [%r, "a", "--b"], sys.argv
        assert sys.path[0] == %r
        raise SystemExit(0)
    """ % (str(script), str(tmp_path))))
    argv, path = list(sys.argv), list(sys.path)
    result = run_script(script, ["a", "--b"])
    assert (result.exit_code, result.error, result.message) == (0, None, None)
    assert sys.argv == argv and sys.path == path and result.watch.closed
