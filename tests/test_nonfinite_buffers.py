"""A buffer that is already non-finite when a step reads it (nantrace.localisation.localiser._settle_state_read).

The optimizer never steps a buffer: the model's or the step's own code writes it (a running statistic, a
centering vector, an input normaliser) or a checkpoint loads it. The check reads parameters, not buffers, so such
a state is found by the replay, which ends at the buffer. API.md's ``nonfinite_param`` covers "a parameter or
buffer": the incident's kind is ``nonfinite_param`` (not the loss it made non-finite), its module holds the
buffer, and skipping the update cannot repair it: the policy's action for that state (``raised`` under ``skip``),
with a fix that says how buffers are written.

Patterns, each checked first in plain torch (the buffer is finite at the step before and non-finite when the
failing step begins; the parameters are finite):
- an RL observation normaliser whose running variance takes the unbiased variance of an epoch's last batch of
  one row (NaN), written by the loss code after the forward;
- a DINO-style centering buffer updated with the teacher's mean output over the whole batch, one step of which
  held a corrupted crop that the loss code drops from the loss (not from the update);
- a frozen BatchNorm backbone in eval mode whose checkpoint holds a NaN running variance, loaded before
  ``watch()`` (found by the buffers' check at ``watch()``, docs/escalation.md, with its own summary);
- negative: the same normaliser with a batch of two rows stays quiet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
              pytest.mark.usefixtures("one_thread")]

MODES = ("zero_intrusive", "replayable")


@dataclasses.dataclass
class Program:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    buffer: str
    """The buffer that goes non-finite (its dotted name)."""


class RunningNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("running_var", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.running_mean) / torch.sqrt(self.running_var + 1e-5)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        self.running_mean.lerp_(x.mean(0), 0.1)
        self.running_var.lerp_(x.var(0), 0.1)  # unbiased: NaN for a batch of one row


class ValueNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.obs_norm = RunningNorm(5)
        self.body = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body(self.obs_norm(obs)).squeeze(-1)


def _normaliser(last_batch: int) -> Program:
    torch.manual_seed(0)
    model = ValueNet()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(n, 5, generator=g) * 2 + 1, torch.randn(n, generator=g)) for n in (8, 8, last_batch, 8, 8)]

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        out = F.mse_loss(m(b[0]), b[1])
        m.obs_norm.update(b[0])
        return out

    return Program(model, torch.optim.Adam(model.parameters(), lr=1e-3), batches, loss, "obs_norm.running_var")


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 24), nn.GELU())
        self.head = nn.Linear(24, 10)
        self.register_buffer("center", torch.zeros(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _dino_center() -> Program:
    torch.manual_seed(0)
    model = Student()
    teacher = nn.Linear(6, 10)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(16, 6, generator=g) for _ in range(5)]
    batches[2][3, 1] = float("nan")  # a corrupted crop: the teacher's output for it is NaN

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(x)
            target = F.softmax((t - m.center) / 0.04, dim=-1)
            m.center.mul_(0.9).add_(t.mean(0), alpha=0.1)  # the update sees the bad crop; the loss drops it
        keep = torch.isfinite(x).all(-1)  # the loop drops corrupted crops from the loss
        return -(target[keep] * F.log_softmax(m(x[keep]) / 0.1, dim=-1)).sum(-1).mean()

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, loss, "center")


class FrozenBNClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x).mean((2, 3)))


def _frozen_bn() -> Program:
    torch.manual_seed(0)
    model = FrozenBNClassifier()
    model.stem[1].running_var[5] = float("nan")  # the checkpoint's statistics
    model.stem.requires_grad_(False)
    model.stem.eval()  # fine-tuning the head: the backbone's BatchNorm uses its running statistics
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    return Program(model, torch.optim.SGD(model.head.parameters(), lr=0.1), batches,
                   lambda m, b: F.cross_entropy(m(b[0]), b[1]), "stem.1.running_var")


CASES: dict[str, tuple[Callable[[], Program], int, str]] = {
    # name: (build, the failing step, the module holding the buffer)
    "observation_normaliser_unbiased_variance_of_one_row": (lambda: _normaliser(1), 3, "obs_norm"),
    "dino_center_updated_before_the_loss_drops_a_corrupted_crop": (_dino_center, 3, ""),
    "frozen_batchnorm_backbone_checkpoint_nan_running_var": (_frozen_bn, 0, "stem.1"),
}


def _named_buffer(model: nn.Module, name: str) -> torch.Tensor:
    return dict(model.named_buffers())[name]


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    """Plain torch: the buffer is finite before every step until the failing one begins, and that step's loss is
    non-finite; the parameters are finite throughout."""
    build, fail, _ = CASES[name]
    program = build()
    model, opt = program.model, program.optimizer
    for step, batch in enumerate(program.batches):
        finite_buffer = bool(torch.isfinite(_named_buffer(model, program.buffer)).all())
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        opt.zero_grad()
        loss = program.loss(model, batch)
        if step == fail:
            assert not finite_buffer and not torch.isfinite(loss)
            return
        assert finite_buffer and torch.isfinite(loss)
        loss.backward()
        opt.step()
    raise AssertionError("the program never failed")


def _train(program: Program, mode: str, **watch: Any) -> tuple[Any, BaseException | None]:
    model, opt = program.model, program.optimizer
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}), **watch)
    loss_fn = guard.replayable(program.loss) if mode == "replayable" else program.loss
    error = None
    try:
        for batch in program.batches:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    except nantrace.NonFiniteError as exc:
        error = exc
    finally:
        guard.close()
    return guard, error


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_the_buffer_is_named_and_the_run_stops(name: str, mode: str) -> None:
    build, fail, module = CASES[name]
    program = build()
    guard, error = _train(program, mode)
    [incident] = guard.incidents
    got = (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause, incident.action)
    assert got == (fail, "nonfinite_param", None, None, module, "nonfinite_param", "raised"), incident.summary
    if fail > 0:  # found by the replay (at step 0, by the buffers' check at watch())
        assert incident.summary.startswith(f"A buffer was already non-finite before step {fail}: {program.buffer} holds")
        assert "not stepped by the optimizer" in incident.fix
    assert program.buffer in incident.summary
    assert error is not None and error.incident is incident  # skipping cannot repair it: the run stops


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_is_still_called_a_parameter(mode: str) -> None:
    program = _normaliser(8)
    with torch.no_grad():
        program.model.body[2].weight[0, 3] = float("nan")
    guard, error = _train(program, mode)
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.cause, incident.module, incident.action) == (
        0, "nonfinite_param", "nonfinite_param", "body.2", "raised")
    assert "buffer" not in incident.summary.split(":")[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_normaliser_with_two_rows_stays_quiet(mode: str) -> None:
    guard, error = _train(_normaliser(2), mode)
    assert guard.incidents == [] and error is None
