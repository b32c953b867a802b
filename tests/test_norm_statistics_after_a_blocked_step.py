"""A blocked step leaves the norm layers' running statistics as the last applied step left them.

A training-mode BatchNorm averages each batch into its running mean and variance *in the forward*, before any
check can judge the step. A NaN that reaches it (a NaN in the batch, a sqrt of a negative before the norm)
leaves them NaN; skipping the update alone would leave every later evaluation-mode forward NaN. nantrace keeps a
copy of them after each applied step (``capture.RunningStatistics``) and puts back the ones a blocked step left
non-finite. The diagnosis is the op that made the NaN, never the buffer that only received it (the running
statistics a training-mode batch norm writes are no input of it: ``tracer._running_statistics_written``).

Each program is checked without nantrace first: its running statistics turn NaN at the failing step. With
nantrace, the run must end exactly as a plain run that never saw the failing batch (parameters and running
statistics, bit for bit), and its evaluation-mode output must be finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import origin_line

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]
FAIL_STEP, STEPS = 2, 5
QUIET = nantrace.Config(outputs={"print_incidents": False})


class CountFeatures(nn.Module):
    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(counts - 1.0)  # <origin:sqrt_counts>


def _tabular() -> nn.Module:
    return nn.Sequential(CountFeatures(), nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _tabular_batch(step: int, g: torch.Generator) -> torch.Tensor:
    counts = 1.0 + 5.0 * torch.rand(16, 4, generator=g)
    if step == FAIL_STEP:
        counts[3, 2] = 0.0  # a count of zero: sqrt(-1)
    return counts


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def _image_batch(step: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(8, 1, 6, 6, generator=g)
    if step == FAIL_STEP:
        x[5, 0, 2, 3] = float("nan")  # a dead pixel decoded as NaN
    return x


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], tuple[Any, ...], list[str]]] = {
    "sqrt_of_a_zero_count_before_a_batchnorm": (
        _tabular, _tabular_batch, ("nonfinite_loss", "forward", "aten.sqrt.default", "0", "sqrt_counts", "sqrt_negative"),
        ["2.running_mean", "2.running_var"]),
    "nan_pixel_through_two_batchnorm2d": (
        SmallCNN, _image_batch, ("nonfinite_input", "data", None, None, None, "nonfinite_input"),
        ["features.1.running_mean", "features.1.running_var", "features.4.running_mean", "features.4.running_var"]),
}


def _batches(make: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [make(step, g) for step in range(STEPS)]


def _train(build: Callable[[], nn.Module], batches: list[torch.Tensor], *, watch: bool,
           leave_out: int | None = None) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=QUIET) if watch else None
    targets = torch.Generator().manual_seed(2)
    for step, x in enumerate(batches):
        y = torch.randn(x.shape[0], 1, generator=targets)
        if step == leave_out:
            continue
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    if guard is not None:
        guard.close()
    return model, guard


@pytest.mark.parametrize("name", list(CASES))
def test_the_running_statistics_turn_nan_without_nantrace(name: str) -> None:
    build, make, _, stats = CASES[name]
    model, _ = _train(build, _batches(make)[:FAIL_STEP + 1], watch=False)
    state = model.state_dict()
    assert all(not torch.isfinite(state[s]).all() for s in stats)


@pytest.mark.parametrize("name", list(CASES))
def test_a_blocked_step_puts_back_the_running_statistics_it_poisoned(name: str) -> None:
    build, make, (kind, phase, op, module, tag, cause), stats = CASES[name]
    batches = _batches(make)
    watched, guard = _train(build, batches, watch=True)
    [incident] = guard.incidents
    got = (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause, incident.action)
    assert got == (FAIL_STEP, kind, phase, op, module, cause, "skipped"), incident.summary
    if tag is not None:
        assert incident.source.endswith(f":{origin_line(__file__, tag)}")
    assert incident.details["running_statistics_restored"] == stats
    reference, _ = _train(build, batches, watch=False, leave_out=FAIL_STEP)  # never saw the failing batch
    got_state, want_state = watched.state_dict(), reference.state_dict()
    for key, value in want_state.items():
        if key.endswith("num_batches_tracked"):
            assert int(got_state[key]) == int(value) + 1  # the blocked forward still counted its batch
        else:
            assert torch.equal(got_state[key], value), key
    watched.eval()
    with torch.no_grad():
        assert torch.isfinite(watched(batches[0])).all()


def test_only_a_model_with_running_statistics_keeps_a_copy() -> None:
    """A model without norm statistics pays nothing (no copy is kept); one with them keeps one from ``watch()``."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    guard = nantrace.watch(plain, torch.optim.SGD(plain.parameters(), lr=0.1), config=QUIET)
    assert guard.running_stats is None
    guard.close()
    model = _tabular()
    guard = nantrace.watch(model, torch.optim.SGD(model.parameters(), lr=0.05), config=QUIET)
    assert guard.running_stats is not None
    guard.close()
