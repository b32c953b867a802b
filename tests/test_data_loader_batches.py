"""A ``DataLoader`` without worker processes makes its batch in the main process, between one step and the next
forward, where the prelude's tape records (``patches.DATA_LOADER_NEXT``): the Dataset's ``__getitem__`` and the
``collate_fn`` run untaped, so a NaN they make is the batch's (``nonfinite_input``, phase ``data``), as when a
worker process made it; the same division written in the training loop stays the step's code (its op and line).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nantrace
from nantrace import patches

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

MODES = ("zero_intrusive", "replayable")


class Frames(Dataset):
    """Images standardised one by one in ``__getitem__`` (item 13 is a blank frame: std 0)."""

    def __init__(self, standardise_here: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(32, 12, generator=g)
        self.x[13] = 0.5
        self.y = torch.randint(0, 3, (32,), generator=g)
        self.standardise_here = standardise_here

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.standardise_here:
            x = (x - x.mean()) / x.std()
        return x, self.y[i]


def _train(mode: str, standardise_here: bool, workers: int = 0) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    step_loss = guard.replayable(loss_fn) if mode == "replayable" else loss_fn
    try:
        for x, y in DataLoader(Frames(standardise_here), batch_size=8, num_workers=workers):
            if not standardise_here:
                x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)  # <origin:loop_std>
            opt.zero_grad()
            step_loss(x, y).backward()
            opt.step()
    finally:
        guard.close()
    return guard.incidents


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_the_dataset_makes_is_the_batchs(mode: str) -> None:
    [incident] = _train(mode, standardise_here=True)
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause,
            incident.action) == (1, "nonfinite_input", "data", None, None, "nonfinite_input", "skipped")


@pytest.mark.parametrize("mode", MODES)
def test_the_same_division_in_the_loop_is_the_steps_code(mode: str) -> None:
    [incident] = _train(mode, standardise_here=False)
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.cause) == (
        1, "nonfinite_input", "forward", "aten.div.Tensor", "zero_variance_norm")
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# <origin:loop_std>"))
    assert incident.source.endswith(f"test_data_loader_batches.py:{line}")


def test_the_patch_is_on_only_while_a_guard_is_open() -> None:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    before = _BaseDataLoaderIter.__next__
    model = nn.Linear(2, 2)
    guard = nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _BaseDataLoaderIter.__next__ is not before and any("DataLoaderIter" in p for p in patches.installed())
    guard.close()
    assert _BaseDataLoaderIter.__next__ is before and not any("DataLoaderIter" in p for p in patches.installed())
