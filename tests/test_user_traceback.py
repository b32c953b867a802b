"""Tracebacks for humans (issue 11, item 5): an uncaught NonFiniteError under ``raise``/``pause``
is printed ending in the user's own frames (nantrace's and torch's hook frames hidden), followed
by the diagnosis; other exceptions are printed exactly as Python prints them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import nantrace

    def train(policy, run_dir):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = nantrace.watch(model, opt, on_anomaly="raise" if policy == "other" else policy, run_dir=run_dir,
                               config=nantrace.Config(print_incidents=False))
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(8, 4)
            out = model(x)
            if policy == "other":
                out = model(torch.randn(3, 5))  # an unrelated error: printed as Python prints it
            loss = out.sqrt().sum() if step == 1 else out.pow(2).mean()
            loss.backward()
            opt.step()  # <the user's step line>
        guard.close()

    train(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
''')


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def _frames(stderr: str) -> list[tuple[str, int]]:
    return [(Path(f).name, int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', stderr)]


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if marker in text)


@pytest.mark.parametrize("policy", ["raise", "pause"])
def test_uncaught_nonfinite_error_ends_in_the_users_frames_then_the_diagnosis(tmp_path: Path, policy: str) -> None:
    proc = _run(tmp_path, policy, str(tmp_path / "run"))
    assert proc.returncode == 1
    err = proc.stderr
    assert _frames(err) == [("train.py", _line("train(sys.argv[1]")), ("train.py", _line("<the user's step line>"))], err
    assert "nantrace" + os.sep not in err.split("Traceback")[1].split("NonFiniteError")[0]
    tail = err[err.index("nantrace.errors.NonFiniteError"):].splitlines()
    assert tail[0].startswith("nantrace.errors.NonFiniteError: nantrace: nonfinite_loss at step 1")
    action = {"raise": "raised", "pause": "paused"}[policy]
    header = next(line for line in tail if line.startswith("nantrace diagnosis"))
    assert header.startswith("nantrace diagnosis · step 1 · nonfinite_loss") and header.endswith(f" · {action}")
    assert any(line.startswith("  cause    ") for line in tail), tail
    assert any(line.startswith("  fix      ") for line in tail)
    if policy == "pause":
        assert any(line.startswith("  bundle   ") and "nantrace replay" in line for line in tail), tail


def test_other_exceptions_are_printed_as_python_prints_them(tmp_path: Path) -> None:
    proc = _run(tmp_path, "other")
    assert proc.returncode == 1 and "nantrace diagnosis" not in proc.stderr
    assert _frames(proc.stderr)[-1][0] == "linear.py"  # torch's own frame, where the error was raised, is kept
    assert proc.stderr.rstrip().splitlines()[-1].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")


def test_user_traceback_trims_in_place() -> None:
    """Unit: nantrace frames anywhere and torch frames below the user's last frame go."""
    import torch

    import nantrace
    from nantrace._user_traceback import user_traceback

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, on_anomaly="raise", config=nantrace.Config(print_incidents=False))
    model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    with pytest.raises(nantrace.NonFiniteError) as info:
        opt.step()
    guard.close()
    full = [Path(f.filename).name for f in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert "guard.py" in full and "optimizer.py" in full
    kept = [Path(f.filename).name for f in __import__("traceback").extract_tb(user_traceback(info.value.__traceback__))]
    assert kept == ["test_user_traceback.py"]


PLAIN_SCRIPT = textwrap.dedent('''
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        out = model(torch.randn(8, 4))
        (out.log().sum() if step == 1 else out.pow(2).mean()).backward()
        opt.step()  # <plain step line>
''')


def test_nantrace_run_shows_the_scripts_frames_then_the_diagnosis(tmp_path: Path) -> None:
    from nantrace.autowatch import run_script
    from nantrace.config import Config

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    result = run_script(script, on_anomaly="raise", config=Config(print_incidents=False))
    assert result.exit_code == 1 and result.traceback is not None
    line = next(i for i, text in enumerate(PLAIN_SCRIPT.splitlines(), 1) if "<plain step line>" in text)
    assert _frames(result.traceback) == [("plain.py", line)], result.traceback
    assert "\nnantrace diagnosis · step 1 · nonfinite_loss" in result.traceback
