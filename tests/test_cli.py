"""The command line, run as a user runs it: a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nantrace
from nantrace.storage.runstore import RunStore


def _nantrace(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("nantrace")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "nantrace.cli.main"]
    env = dict(os.environ, COLUMNS="100")
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_version():
    proc = _nantrace("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"nantrace {nantrace.__version__}"


def test_help_lists_the_commands():
    proc = _nantrace("--help")
    assert proc.returncode == 0
    for command in ("check", "demo", "replay", "report", "run"):
        assert command in proc.stdout


def test_demo_hits_a_real_failure_blocks_it_and_goes_on(tmp_path):
    out = tmp_path / "demo"
    proc = _nantrace("demo", "--out", str(out), "--steps", "60", "--fail-at", "30", "--no-report", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    for expected in ("step 30 · nonfinite_loss · skipped", "aten._softmax.default", "'blocks.0.attn'",
                     "masked_softmax_all", "nantrace/demo/model.py:25", "Training went on", "nantrace replay"):
        assert expected in text, expected
    store = RunStore(out, readonly=True)
    rows = store.steps()
    assert len(rows) == 60 and [r["step"] for r in rows if r["skipped"]] == [30]
    [incident] = store.incidents()
    assert (incident.step, incident.cause, incident.module) == (30, "masked_softmax_all", "blocks.0.attn")
    assert Path(incident.bundle).is_dir()


def test_demo_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    proc = _nantrace("demo", "--out", str(tmp_path), "--steps", "20", "--fail-at", "5", "--no-report")
    assert proc.returncode == 2
    assert "is not a nantrace run directory" in proc.stderr
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_rejects_fail_at_beyond_steps(tmp_path):
    proc = _nantrace("demo", "--out", str(tmp_path / "d"), "--steps", "20", "--fail-at", "30")
    assert proc.returncode == 2 and "--fail-at (30) must be below --steps (20)" in proc.stderr
