"""SnapshotManager: last-good state kept in memory or on disk and restored bit for bit."""

from __future__ import annotations

import copy
import fractions
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nantrace.response.rollback import SnapshotManager

WHERE = ("memory", "disk")


class Net(nn.Module):
    """Linear, BatchNorm (buffers), dropout (consumes the torch RNG), linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batches(n: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 8, generator=gen), torch.randint(0, 3, (12,), generator=gen)) for _ in range(n)]


class Setup:
    """Model, optimizer, optional scaler, two schedulers (one added after the manager)."""

    def __init__(self, opt: str = "adam", scaler: bool = False, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(0)
        self.model = Net().to(dtype)
        self.opt = make_optimizer(opt, self.model)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaler else None
        self.warmup = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda e: min(1.0, (e + 1) / 20))
        self.schedulers: list[Any] = [self.warmup]

    def manager(self, **kwargs: Any) -> SnapshotManager:
        mgr = SnapshotManager(self.model, self.opt, scaler=self.scaler, schedulers=[self.warmup], **kwargs)
        decay = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        mgr.add_scheduler(decay)  # created after the manager, like schedulers made after watch()
        self.schedulers.append(decay)
        return mgr

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        # Consume the Python and NumPy generators too (data augmentation does).
        x = (x + 1e-3 * random.random() + 1e-3 * float(np.random.rand())).to(next(self.model.parameters()).dtype)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        for s in self.schedulers:
            s.step()
        return loss.detach().clone()

    def state(self) -> dict[str, Any]:
        """Deep copy of everything a snapshot must bring back."""
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.opt.state_dict()),
            "lr": [g["lr"] for g in self.opt.param_groups],
            "scaler": copy.deepcopy(self.scaler.state_dict()) if self.scaler is not None else None,
            "schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers],
            "rng_torch": torch.get_rng_state(),
            "rng_python": random.getstate(),
            "rng_numpy": np.random.get_state(),
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Bit-for-bit equality of nested states (tensors, arrays, dicts, sequences, scalars)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{path} differs"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} vs {b!r}"


def disk_kwargs(where: str, tmp_path: Path) -> dict[str, Any]:
    return {"where": where, "directory": tmp_path / "snaps"} if where == "disk" else {"where": where}


# --------------------------------------------------------------------------- restore
@pytest.mark.parametrize("use_scaler", [False, True], ids=["noscaler", "scaler"])
@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("where", WHERE)
def test_restore_is_bit_for_bit_and_replays_identically(where: str, opt: str, use_scaler: bool, tmp_path: Path) -> None:
    s = Setup(opt, use_scaler)
    mgr = s.manager(interval=1, **disk_kwargs(where, tmp_path))
    data = batches(10)
    for b in data[:4]:
        s.step(b)
    mgr.snapshot(4)
    at_snapshot = s.state()
    params = list(s.model.parameters())
    ptrs = [p.data_ptr() for p in params]

    reference_losses = [s.step(b) for b in data[4:]]
    after = s.state()
    # Training changed everything the snapshot holds.
    for key in ("model", "optimizer", "lr", "schedulers", "rng_torch"):
        with pytest.raises(AssertionError):
            assert_same(at_snapshot[key], after[key])
    if use_scaler:
        assert at_snapshot["scaler"]["scale"] != after["scaler"]["scale"]

    assert mgr.restore() == 4
    assert_same(at_snapshot, s.state())
    # In place: same parameter objects and storage; the optimizer still holds them.
    assert list(s.model.parameters()) == params and [p.data_ptr() for p in params] == ptrs
    assert all(a is b for a, b in zip(s.opt.param_groups[0]["params"], params))
    assert all(p.grad is None for p in params)

    replay_losses = [s.step(b) for b in data[4:]]
    assert_same(reference_losses, replay_losses, "losses")
    assert_same(after, s.state(), "after replay")
    mgr.close()


@pytest.mark.parametrize("where", WHERE)
def test_snapshot_before_first_step_restores_empty_optimizer_state(where: str, tmp_path: Path) -> None:
    s = Setup("adam", scaler=True)
    mgr = s.manager(**disk_kwargs(where, tmp_path))
    mgr.snapshot(0)
    initial = s.state()
    assert initial["optimizer"]["state"] == {}
    data = batches(4)
    losses = [s.step(b) for b in data]
    assert s.opt.state_dict()["state"]  # Adam state now exists
    mgr.restore()
    assert_same(initial, s.state())
    assert_same(losses, [s.step(b) for b in data], "losses")
    mgr.close()


@pytest.mark.parametrize("where", WHERE)
def test_restore_twice_from_the_same_snapshot(where: str, tmp_path: Path) -> None:
    s = Setup("sgd")
    mgr = s.manager(**disk_kwargs(where, tmp_path))
    data = batches(6)
    for b in data[:2]:
        s.step(b)
    mgr.snapshot(2)
    at_snapshot = s.state()
    for _ in range(2):  # training after the first restore must not alter the stored snapshot
        for b in data[2:]:
            s.step(b)
        assert mgr.restore() == 2
        assert_same(at_snapshot, s.state())
    mgr.close()


@pytest.mark.parametrize("where", WHERE)
def test_optimizer_state_that_appeared_after_the_snapshot(where: str, tmp_path: Path) -> None:
    """A parameter first trained after the snapshot: the optimizer's state layout changed."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.ModuleDict({"a": a, "b": b})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mgr = SnapshotManager(model, opt, **disk_kwargs(where, tmp_path))
    x = torch.randn(3, 4)

    def step(both: bool) -> None:
        opt.zero_grad(set_to_none=True)
        (a(x) + (b(x) if both else 0)).square().sum().backward()
        opt.step()

    step(both=False)  # b has no gradient: no Adam state for it yet
    mgr.snapshot(1)
    expected = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
    for _ in range(2):  # the second round checks that the snapshot was not aliased by the first
        step(both=True)
        step(both=True)
        mgr.restore()
        assert_same(expected, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    mgr.close()


def test_dtype_and_tied_weights_are_kept_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)).double()
    model[1].weight = model[0].weight  # tied
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mgr = SnapshotManager(model, opt)

    def step() -> None:
        opt.zero_grad()
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()

    step()
    mgr.snapshot(1)
    expected = copy.deepcopy(model.state_dict())
    weight = model[0].weight
    step()
    mgr.restore()
    assert model[0].weight is weight and model[1].weight is weight
    assert weight.dtype == torch.float64
    assert_same(expected, model.state_dict())
    assert mgr.nbytes > 0
    mgr.close()


def test_without_optimizer_and_scheduler_state_that_is_not_plain_data(tmp_path: Path) -> None:
    class OddScheduler:
        def __init__(self) -> None:
            self.ratio = fractions.Fraction(1, 3)

        def state_dict(self) -> dict[str, Any]:
            return {"ratio": self.ratio}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.ratio = state["ratio"]

    model = Net()
    odd = OddScheduler()
    mgr = SnapshotManager(model, None, schedulers=[odd], where="disk", directory=tmp_path)
    with pytest.warns(RuntimeWarning, match="schedulers.0"):
        mgr.snapshot(0)
    odd.ratio = fractions.Fraction(2, 3)
    with torch.no_grad():
        model.fc1.weight.add_(1.0)
    before = model.fc1.weight.clone()
    mgr.restore()
    assert odd.ratio == fractions.Fraction(1, 3)
    assert not torch.equal(model.fc1.weight, before)
    mgr.close()


# --------------------------------------------------------------------------- bookkeeping
@pytest.mark.parametrize("where", WHERE)
def test_keep_drops_the_oldest_and_restore_uses_the_newest(where: str, tmp_path: Path) -> None:
    s = Setup("adamw")
    mgr = s.manager(keep=2, interval=10, **disk_kwargs(where, tmp_path))
    data = batches(3)
    states = {}
    for step, b in zip((0, 10, 20), data):
        s.step(b)
        assert mgr.maybe_snapshot(step)
        states[step] = s.state()
    assert mgr.steps == (10, 20) and mgr.last_step == 20
    if where == "disk":
        assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["snapshot-0000000010.pt", "snapshot-0000000020.pt"]
    s.step(data[0])
    assert mgr.restore() == 20
    assert_same(states[20], s.state())
    mgr.close()


def test_keep_one_and_same_step_twice(tmp_path: Path) -> None:
    s = Setup("sgd")
    mgr = s.manager(keep=1, where="disk", directory=tmp_path)
    s.step(batches(1)[0])
    mgr.snapshot(5)
    mgr.snapshot(5)  # retaken: replaces, the file stays
    mgr.snapshot(6)
    assert mgr.steps == (6,)
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot-0000000006.pt"]
    mgr.close()


def test_maybe_snapshot_follows_interval() -> None:
    s = Setup("sgd")
    mgr = s.manager(interval=5, keep=10)
    taken = [step for step in range(13) if mgr.maybe_snapshot(step)]
    assert taken == [0, 5, 10]
    assert not mgr.maybe_snapshot(10)  # already the newest
    assert mgr.steps == (0, 5, 10)
    mgr.close()


def test_restore_without_snapshot_is_a_clear_error() -> None:
    s = Setup()
    mgr = s.manager()
    with pytest.raises(RuntimeError, match="no snapshot has been taken yet"):
        mgr.restore()
    assert mgr.last_step is None


def test_disk_files_load_with_weights_only(tmp_path: Path) -> None:
    s = Setup("adam", scaler=True)
    mgr = s.manager(where="disk", directory=tmp_path)
    s.step(batches(1)[0])
    mgr.snapshot(1)
    payload = torch.load(tmp_path / "snapshot-0000000001.pt", weights_only=True)
    assert payload["step"] == 1 and payload["in_memory"] == []
    assert set(payload["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert payload["rng"]["python"]["internal"] == list(random.getstate()[1])
    assert payload["scaler"]["scale"] == s.scaler.get_scale()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    mgr.close()


def test_state_dict_round_trip_disk(tmp_path: Path) -> None:
    s = Setup("adam")
    first = s.manager(where="disk", directory=tmp_path / "snaps", interval=1)
    data = batches(4)
    s.step(data[0])
    first.snapshot(1)
    s.step(data[1])
    first.snapshot(2)
    at_2 = s.state()
    book = json.loads(json.dumps(first.state_dict()))
    assert [e["step"] for e in book["snapshots"]] == [1, 2]

    # A new manager (a resumed process) adopts the files and restores from them.
    second = SnapshotManager(s.model, s.opt, schedulers=s.schedulers, where="disk", directory=tmp_path / "snaps")
    second.load_state_dict(book)
    assert second.steps == (1, 2) and second.state_dict()["snapshots"] == book["snapshots"]
    s.step(data[2])
    assert second.restore() == 2
    assert_same(at_2, s.state())

    # The same manager: a round trip keeps everything.
    first.load_state_dict(first.state_dict())
    assert first.steps == (1, 2)
    first.close(delete_files=False)

    (tmp_path / "snaps" / "snapshot-0000000001.pt").unlink()
    third = SnapshotManager(s.model, s.opt, where="disk", directory=tmp_path / "snaps")
    with pytest.warns(RuntimeWarning, match="missing"):
        third.load_state_dict(book)
    assert third.steps == (2,)
    with pytest.raises(ValueError, match="where"):
        SnapshotManager(s.model, s.opt).load_state_dict(book)
    second.close()
    third.close()


def test_state_dict_round_trip_memory() -> None:
    s = Setup("sgd")
    mgr = s.manager(interval=1)
    s.step(batches(1)[0])
    mgr.snapshot(1)
    mgr.snapshot(2)
    book = mgr.state_dict()
    assert book["where"] == "memory" and [e["step"] for e in book["snapshots"]] == [1, 2]
    mgr.load_state_dict(json.loads(json.dumps(book)))
    assert mgr.steps == (1, 2)
    fresh = SnapshotManager(s.model, s.opt)
    fresh.load_state_dict(book)  # in-memory snapshots do not outlive their manager
    assert fresh.steps == ()
    mgr.close()


# --------------------------------------------------------------------------- close
def test_close_removes_the_temporary_directory() -> None:
    s = Setup()
    mgr = s.manager(where="disk")
    directory = mgr.directory
    assert directory is not None and directory.is_dir()
    s.step(batches(1)[0])
    mgr.snapshot(1)
    assert any(directory.iterdir())
    mgr.close()
    assert not directory.exists()
    mgr.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        mgr.snapshot(2)


def test_close_in_a_given_directory(tmp_path: Path) -> None:
    s = Setup()
    (tmp_path / "other.txt").write_text("not ours")
    mgr = s.manager(where="disk", directory=tmp_path)
    mgr.snapshot(0)
    mgr.close()
    assert [p.name for p in tmp_path.iterdir()] == ["other.txt"]

    kept = s.manager(where="disk", directory=tmp_path / "new")
    kept.snapshot(3)
    kept.close(delete_files=False)
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["snapshot-0000000003.pt"]

    made = s.manager(where="disk", directory=tmp_path / "made")
    made.snapshot(0)
    made.close()
    assert not (tmp_path / "made").exists()  # it created the directory, it was left empty


def test_memory_close_frees() -> None:
    s = Setup()
    with s.manager() as mgr:
        mgr.snapshot(0)
        assert mgr.nbytes > 0
    assert mgr.closed and mgr.steps == ()


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"interval": 0}, ["interval", "0", ">= 1"]),
        ({"interval": -5}, ["interval", "-5", ">= 1"]),
        ({"interval": 2.5}, ["interval", "2.5", ">= 1"]),
        ({"where": "cloud"}, ["where", "'cloud'", "'memory'", "'disk'"]),
        ({"keep": 0}, ["keep", "0", ">= 1"]),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        SnapshotManager(Net(), None, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_disk_needs_a_writable_directory(tmp_path: Path) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for directory in (a_file, a_file / "sub"):
        with pytest.raises(ValueError) as info:
            SnapshotManager(Net(), None, where="disk", directory=directory)
        message = str(info.value)
        assert "directory" in message and str(directory) in message and "writable directory" in message


def test_bad_types() -> None:
    with pytest.raises(TypeError, match="model"):
        SnapshotManager("not a model", None)  # type: ignore[arg-type]
    mgr = SnapshotManager(Net(), None)
    with pytest.raises(TypeError, match="scheduler"):
        mgr.add_scheduler(object())
    with pytest.raises(ValueError, match="step"):
        mgr.snapshot(-1)
