"""The command line, run as a user runs it: a subprocess (``python -m nantrace`` runs the
console script's ``main``), stdout and stderr checked apart.

``--help`` texts are compared whole with ``tests/snapshots/help_*.txt`` (regenerate after an
intended change with ``NANTRACE_UPDATE_SNAPSHOTS=1`` and review the diff).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nantrace
from nantrace.storage.runstore import RunStore

SRC = Path(__file__).resolve().parents[1] / "src"
SNAPSHOTS = Path(__file__).parent / "snapshots"
COMMANDS = ("demo", "run", "report", "replay", "check")


def _nantrace(*args: str, cwd: Path | None = None, columns: int = 100, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS=str(columns), PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "nantrace", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def _snapshot(name: str, text: str) -> str:
    path = SNAPSHOTS / name
    if os.environ.get("NANTRACE_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    return path.read_text()


def test_version():
    proc = _nantrace("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"nantrace {nantrace.__version__}"


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_snapshot_at_80_columns(command):
    proc = _nantrace(*([command] if command else []), "--help", columns=80)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == _snapshot(f"help_{command or 'nantrace'}_80.txt", proc.stdout)


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_snapshot_at_120_columns(command):
    from typer.testing import CliRunner

    from nantrace.cli.main import app

    result = CliRunner().invoke(app, [*([command] if command else []), "--help"], prog_name="nantrace",
                                env={"COLUMNS": "120", "TERMINAL_WIDTH": None})
    assert result.exit_code == 0
    assert result.stdout == _snapshot(f"help_{command or 'nantrace'}_120.txt", result.stdout)


def test_help_texts_follow_the_conventions():
    """Usage lines name arguments as NAME / [ARGS]..., flags carry no type, one policy option."""
    texts = {c: (SNAPSHOTS / f"help_{c}_80.txt").read_text() for c in COMMANDS}
    assert " Usage: nantrace report [OPTIONS] RUN_DIR " in texts["report"]
    assert " Usage: nantrace run [OPTIONS] SCRIPT [ARGS]... " in texts["run"]
    assert " Usage: nantrace replay [OPTIONS] BUNDLE_DIR " in texts["replay"]
    assert " Usage: nantrace check [OPTIONS] TARGET " in texts["check"]
    for text in texts.values():
        assert "{" not in text and "<bool>" not in text
        assert "--policy" not in text  # the deprecated alias is hidden
    for command in ("run", "check"):
        assert "--on-anomaly" in texts[command] and "rollback" in texts[command] and "pause" in texts[command]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One demo run (60 steps, the failure at step 30), shared by the tests below."""
    cwd = tmp_path_factory.mktemp("demo")
    proc = _nantrace("demo", "--out", "demo", "--steps", "60", "--fail-at", "30", cwd=cwd)
    return cwd, proc


def test_demo_hits_a_real_failure_and_prints_its_results_on_stdout(demo_run):
    cwd, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for expected in ("step 30 · nonfinite_loss · skipped", "aten._softmax.default", "'blocks.0.attn'",
                     "masked_softmax_all", "nantrace/demo/model.py:25", "Training went on",
                     "Run directory: demo (run store demo/nantrace.db)", "Report: demo/report.html"):
        assert expected in out, expected
    replay_line = next(line for line in out.splitlines() if line.startswith("Reproduce the failure anywhere: "))
    assert " -m nantrace replay demo/incidents/step000030-nonfinite_loss-" in replay_line  # a command that works here
    assert "training" in proc.stderr and "60/60" in proc.stderr  # progress: stderr
    assert "nantrace ·" not in proc.stderr
    store = RunStore(cwd / "demo", readonly=True)
    rows = store.steps()
    assert len(rows) == 60 and [r["step"] for r in rows if r["skipped"]] == [30]
    [incident] = store.incidents()
    assert (incident.step, incident.cause, incident.module) == (30, "masked_softmax_all", "blocks.0.attn")
    assert (cwd / incident.bundle).is_dir()
    assert store.status().state == "finished"


def test_replay_reproduces_the_demo_failure(demo_run):
    cwd, _ = demo_run
    [incident] = RunStore(cwd / "demo", readonly=True).incidents()
    proc = _nantrace("replay", incident.bundle, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert "aten._softmax.default" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "reproduced: same op, module and cause as recorded"


@pytest.mark.parametrize("broken", ["state.pt", "batch.pt"])
def test_replay_of_a_truncated_file_names_it(demo_run, tmp_path, broken):
    cwd, _ = demo_run
    [incident] = RunStore(cwd / "demo", readonly=True).incidents()
    bundle = tmp_path / "bundle"
    shutil.copytree(cwd / incident.bundle, bundle)
    data = (bundle / broken).read_bytes()
    (bundle / broken).write_bytes(data[: len(data) // 2])
    proc = _nantrace("replay", str(bundle))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: '{bundle / broken}' is corrupt or unreadable (truncated or not written by "
                                  "nantrace): ")
    assert "Traceback" not in proc.stderr


def test_report_prints_the_file_it_wrote_on_stdout(demo_run):
    cwd, _ = demo_run
    proc = _nantrace("report", "demo", "-o", "elsewhere/run.html", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "elsewhere/run.html\n"
    assert proc.stderr.startswith("report written in ")
    assert (cwd / "elsewhere" / "run.html").stat().st_size > 100_000


def test_report_of_a_regular_file_says_it_is_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = _nantrace("report", "notes.txt", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ("error: 'notes.txt' is a file, not a run directory; expected the directory given to "
                           "nantrace.watch(run_dir=...), which holds nantrace.db\n")


def test_replay_of_a_regular_file_says_it_is_a_file(tmp_path):
    (tmp_path / "diagnosis.json").write_text("{}")
    proc = _nantrace("replay", "diagnosis.json", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ("error: 'diagnosis.json' is a file, not a bundle directory; expected "
                           "run_dir/incidents/<incident> written by nantrace\n")


def test_demo_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    proc = _nantrace("demo", "--out", str(tmp_path), "--steps", "20", "--fail-at", "5", "--no-report")
    assert proc.returncode == 2
    assert "is not a nantrace run directory" in proc.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_refuses_to_replace_a_run_that_is_not_a_demo(tmp_path):
    store = RunStore(tmp_path / "exp")
    store.set_meta("model_class", "MyTransformer")
    store.close()
    proc = _nantrace("demo", "--out", "exp", "--steps", "20", "--fail-at", "5", "--no-report", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "error: exp holds a nantrace run that is not a demo run (MyTransformer); choose another --out\n"
    assert (tmp_path / "exp" / "nantrace.db").is_file()


def test_demo_rejects_fail_at_beyond_steps(tmp_path):
    proc = _nantrace("demo", "--out", str(tmp_path / "d"), "--steps", "20", "--fail-at", "30")
    assert proc.returncode == 2 and "--fail-at (30) must be below --steps (20)" in proc.stderr


def test_unknown_policy_names_the_four(tmp_path):
    proc = _nantrace("check", "x:y", "--on-anomaly", "later", cwd=tmp_path, columns=200)
    assert proc.returncode == 2
    assert "unknown policy 'later'; expected one of skip, raise, rollback, pause" in proc.stderr


def test_json_output_is_plain_json_on_stdout(demo_run):
    cwd, _ = demo_run
    [incident] = RunStore(cwd / "demo", readonly=True).incidents()
    proc = _nantrace("replay", incident.bundle, "--json", cwd=cwd)
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["cause"] == "masked_softmax_all"
