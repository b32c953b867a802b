"""Replay: leaves training state untouched, writes loadable bundles, reproduces in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from conftest import same_state, snapshot
from nantrace.demo.data import make_batch
from nantrace.demo.model import DemoTransformer


class DropoutBN(nn.Module):
    """Randomness (dropout) and mutable state (BatchNorm running stats) in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(torch.log(self.bn(self.lin(x)).relu())))


def test_replay_leaves_state_and_rng_bit_for_bit_identical(quiet):
    torch.manual_seed(0)
    model = DropoutBN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=quiet)
    captured = {}

    def step_pre_hook(optimizer, args, kwargs):  # runs before the guard's own pre-hook
        captured["state"] = snapshot(model, opt)
        captured["rng"] = torch.get_rng_state()

    handle = opt.register_step_pre_hook(step_pre_hook)
    opt._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(32, 8)).pow(2).mean().backward()
        opt.step()
        if guard.incidents:
            break
    handle.remove()
    guard.close()
    incident = guard.incidents[0]
    assert incident.cause == "log_nonpositive" and incident.op == "aten.log.default" and incident.module == ""
    assert incident.details["ops_replayed"] > 10
    assert same_state(captured["state"], snapshot(model, opt))
    assert torch.equal(captured["rng"], torch.get_rng_state())


def _demo_run(run_dir: Path, steps: int = 12, fail_at: int = 8):
    torch.manual_seed(0)
    model = DemoTransformer(dim=32, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = nantrace.watch(model, opt, run_dir=run_dir,
                           config=nantrace.Config(print_incidents=False, model_factory="tests_factories:small_demo"))
    for step in range(steps):
        tokens, labels = make_batch(step, empty_at=fail_at)
        opt.zero_grad()
        F.cross_entropy(model(tokens), labels).backward()
        opt.step()
    guard.close()
    return guard


def test_bundle_is_complete_atomic_and_loadable_with_weights_only(tmp_path):
    guard = _demo_run(tmp_path)
    [incident] = guard.incidents
    bundle = Path(incident.bundle)
    assert bundle.parent == tmp_path / "incidents" and bundle.name.startswith("step000008-nonfinite_loss-")
    assert sorted(p.name for p in bundle.iterdir()) == ["batch.pt", "diagnosis.json", "env.json", "state.pt"]
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".tmp")]
    state = torch.load(bundle / "state.pt", weights_only=True)
    batch = torch.load(bundle / "batch.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "scaler"} and state["scaler"] is None
    assert torch.equal(batch["forwards"][0]["args"][0], make_batch(8, empty_at=8)[0])
    env = json.loads((bundle / "env.json").read_text())
    assert env["torch_version"] == torch.__version__ and env["model_factory"] == "tests_factories:small_demo"
    diag = json.loads((bundle / "diagnosis.json").read_text())
    assert (diag["op"], diag["module"], diag["cause"]) == ("aten._softmax.default", "blocks.0.attn", "masked_softmax_all")


def test_replay_api_reproduces_the_diagnosis(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    guard = _demo_run(tmp_path)
    again = nantrace.replay(guard.incidents[0].bundle)
    first = guard.incidents[0]
    assert (again.op, again.module, again.source, again.cause, again.phase) == (
        first.op, first.module, first.source, first.cause, first.phase)
    assert again.transient is False


def _cli(*args: str, cwd: Path | None = None, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="110", PYTHONPATH=str(Path(__file__).parent))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "nantrace.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_replay_cli_in_a_fresh_process(tmp_path):
    guard = _demo_run(tmp_path)
    proc = _cli("replay", guard.incidents[0].bundle)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "aten._softmax.default" in out and "blocks.0.attn" in out and "masked_softmax_all" in out
    assert "reproduced: same op, module and cause as recorded" in out


def test_replay_cli_json_output(tmp_path):
    guard = _demo_run(tmp_path)
    proc = _cli("replay", "--json", guard.incidents[0].bundle)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["op"], data["module"], data["cause"], data["step"]) == (
        "aten._softmax.default", "blocks.0.attn", "masked_softmax_all", 8)


@pytest.mark.parametrize("damage, message", [
    ("missing_dir", "does not exist"),
    ("missing_file", "is not a complete nantrace bundle: missing state.pt"),
    ("corrupt_state", "is corrupt or unreadable"),
])
def test_replay_cli_bad_bundle_exits_2_with_a_clear_message(tmp_path, damage, message):
    guard = _demo_run(tmp_path / "run")
    bundle = Path(guard.incidents[0].bundle)
    target = bundle
    if damage == "missing_dir":
        target = tmp_path / "nope"
    elif damage == "missing_file":
        (bundle / "state.pt").unlink()
    else:
        (bundle / "state.pt").write_bytes(b"\x00garbage")
    proc = _cli("replay", str(target))
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_replay_cli_without_a_factory_asks_for_model(tmp_path):
    torch.manual_seed(0)

    class ScriptModel(nn.Module):  # defined in a function: not importable
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x):
            return torch.log(self.lin(x) * 0)

    model = ScriptModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, run_dir=tmp_path, config=nantrace.Config(print_incidents=False))
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    guard.close()
    proc = _cli("replay", guard.incidents[0].bundle)
    assert proc.returncode == 2
    assert "records no importable model factory" in proc.stderr and "--model module:factory" in proc.stderr
