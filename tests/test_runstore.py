"""The SQLite run store: one row per step, every incident, readable live, crash-safe."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch

import nantrace
from nantrace.storage.runstore import DB_NAME, RunStore
from conftest import mlp


def _train(run_dir, steps=12, nan_at=7, config=None):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, run_dir=run_dir, config=config or nantrace.Config(print_incidents=False))
    for step in range(steps):
        x = torch.randn(8, 8)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
    guard.close()
    return guard


def test_one_row_per_step_and_every_incident(tmp_path):
    guard = _train(tmp_path)
    store = RunStore(tmp_path, readonly=True)
    rows = store.steps()
    assert [r["step"] for r in rows] == list(range(12))
    bad = rows[7]
    assert math.isnan(bad["loss"]) and bad["skipped"] and bad["action"] == "skipped"
    assert bad["incident"] == guard.incidents[0].id
    assert all(not r["skipped"] and math.isfinite(r["loss"]) for r in rows if r["step"] != 7)
    assert rows[0]["lr"] == [0.05] and rows[0]["scale"] is None and rows[0]["grad_norm"] > 0
    [incident] = store.incidents()
    assert incident.to_dict() == guard.incidents[0].to_dict()
    meta = store.meta()
    assert meta["model_class"] == "Sequential" and meta["policy"] == "skip" and meta["optimizer_class"] == "SGD"
    assert meta["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def test_nan_is_stored_visibly_not_as_null(tmp_path):
    _train(tmp_path)
    raw = sqlite3.connect(tmp_path / DB_NAME).execute("SELECT loss FROM steps WHERE step = 7").fetchone()[0]
    assert raw == "nan"


def test_wal_mode_and_readable_while_training(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, run_dir=tmp_path, config=nantrace.Config(print_incidents=False))
    reader = None
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(8, 8)).pow(2).mean().backward()
        opt.step()
        if step == 2:
            reader = RunStore(tmp_path, readonly=True)
        if reader is not None:
            assert [r["step"] for r in reader.steps()] == list(range(step + 1))
    guard.close()
    assert sqlite3.connect(tmp_path / DB_NAME).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_killed_process_loses_at_most_the_step_in_flight(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch, nantrace
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        guard = nantrace.watch(model, opt, run_dir={str(tmp_path)!r})
        for step in range(100):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            if step == 41:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    rows = RunStore(tmp_path, readonly=True).steps()
    assert [r["step"] for r in rows] == list(range(42))


@pytest.mark.parametrize("setup, message", [
    ("missing", "does not exist"),
    ("empty", "is not a nantrace run directory: expected nantrace.db inside it"),
    ("corrupt", "is not a readable nantrace run store"),
])
def test_bad_run_dirs_raise_a_clear_error(tmp_path, setup, message):
    path = tmp_path / "run"
    if setup != "missing":
        path.mkdir()
    if setup == "corrupt":
        (path / DB_NAME).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ValueError, match=message):
        RunStore(path, readonly=True)


def test_layer_and_activation_stats_round_trip(tmp_path):
    store = RunStore(tmp_path)
    store.log_layer_stats(3, [(0, 1.5, 2.0, 1e-3), (1, float("nan"), 1.0, None)])
    store.log_activation_stats(3, [(0, 12.5, 0), (1, float("inf"), 4)])
    store.close()
    reader = RunStore(tmp_path, readonly=True)
    (s0, l0, g0, p0, u0), (s1, l1, g1, p1, u1) = reader.layer_stats()
    assert (s0, l0, g0, p0, u0) == (3, 0, 1.5, 2.0, 1e-3)
    assert (s1, l1, p1, u1) == (3, 1, 1.0, None) and math.isnan(g1)
    assert reader.activation_stats() == [(3, 0, 12.5, 0), (3, 1, float("inf"), 4)]


def test_nothing_is_written_without_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _train(None)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------- one run per directory
def _subprocess_run(run_dir, tail: str = "guard.close()", steps: int = 5) -> subprocess.CompletedProcess:
    """A separate process (a second ``python train.py``) training ``steps`` steps into ``run_dir``."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch, nantrace
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        guard = nantrace.watch(model, opt, run_dir={str(run_dir)!r})
        for step in range({steps}):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    """) + tail + "\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_second_run_sets_the_first_aside_instead_of_mixing(tmp_path):
    run = tmp_path / "run"
    first = _subprocess_run(run, steps=7)
    assert first.returncode == 0, first.stderr
    [old_bundle] = [p.name for p in (run / "incidents").iterdir()] if (run / "incidents").exists() else [None]
    second = _subprocess_run(run, steps=3)
    assert second.returncode == 0, second.stderr
    [previous] = (run / "previous").iterdir()
    assert second.stderr.startswith(f"nantrace: {run} held an earlier run; it was moved to {previous} so that runs "
                                    "never mix")
    with RunStore(run, readonly=True) as now, RunStore(previous, readonly=True) as before:
        assert [r["step"] for r in now.steps()] == [0, 1, 2]
        assert [r["step"] for r in before.steps()] == list(range(7))
        assert now.status().state == before.status().state == "finished"
        assert now.get_meta("created") > before.get_meta("created")
    assert old_bundle is None  # a healthy run writes no bundle; only the store moved
    assert sorted(p.name for p in run.iterdir() if not p.name.endswith(("-wal", "-shm"))) == ["nantrace.db", "previous"]


def test_the_same_process_appends_to_its_own_run(tmp_path):
    _train(tmp_path, steps=4, nan_at=None)
    guard = _train(tmp_path, steps=3, nan_at=1)  # a second guard of this process: the same run goes on
    assert not (tmp_path / "previous").exists()
    with RunStore(tmp_path, readonly=True) as store:
        assert [r["step"] for r in store.steps()] == [0, 1, 2, 3]  # steps 0-2 of the second guard replaced 0-2
        assert [i.id for i in store.incidents()] == [guard.incidents[0].id]


def test_a_run_directory_in_use_by_a_live_process_is_refused(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from nantrace.storage.runstore import RunStore
        store = RunStore({str(tmp_path)!r})
        print("open", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "open\n"
        with pytest.raises(ValueError, match=f"run directory '{tmp_path}' is in use: process {child.pid} on .* is "
                                             "writing a run there since .*; give this run its own run_dir"):
            RunStore(tmp_path)
    finally:
        child.kill()
        child.wait()
    assert RunStore(tmp_path, readonly=True).status().state == "interrupted"


def test_a_killed_run_is_reported_interrupted_and_marked_so_when_set_aside(tmp_path):
    killed = _subprocess_run(tmp_path, tail="os.kill(os.getpid(), signal.SIGKILL)", steps=6)
    assert killed.returncode == -signal.SIGKILL
    with RunStore(tmp_path, readonly=True) as store:
        status = store.status()
    assert (status.state, status.last_step) == ("interrupted", 5)
    assert status.reason.startswith("its process (pid ") and status.reason.endswith(
        ") ended without closing the run (killed, or the machine went down)")
    RunStore(tmp_path).close()  # a new run sets it aside, marked in its own store
    [previous] = (tmp_path / "previous").iterdir()
    with RunStore(previous, readonly=True) as store:
        assert store.get_meta("status") == "interrupted" and store.status().last_step == 5


@pytest.mark.parametrize("tail, state, reason", [
    ("raise ValueError('bad shard')", "failed", "the process exited on an uncaught ValueError: bad shard"),
    ("raise KeyboardInterrupt", "interrupted", "stopped with Ctrl-C (KeyboardInterrupt) before the guard was closed"),
    ("pass", "finished", "the process exited without closing the guard"),
    ("guard.close()", "finished", None),
])
def test_how_a_process_ended_is_recorded(tmp_path, tail, state, reason):
    proc = _subprocess_run(tmp_path, tail=tail, steps=2)
    assert proc.returncode in (0, 1, 130, -signal.SIGINT), proc.stderr
    with RunStore(tmp_path, readonly=True) as store:
        status = store.status()
    assert (status.state, status.reason, status.last_step) == (state, reason, 1)
