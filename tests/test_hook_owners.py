"""A tensor hook's op belongs to the code that registered the hook (``localisation.modules.ModuleStack``).

A gradient hook the loss code puts on the model's output runs outside the model: its op has module
``None``, like any loss-code op (API.md: ``module`` is None when the op ran outside the model). A hook a
submodule registers in its own forward belongs to that submodule; a hook put on a parameter before
training belongs to the module holding the parameter. Each program is checked without nantrace first:
the hook's division is the first op of the step whose result is non-finite (a dispatch mode of this
file's own that watches the backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heldout_harness import MODES, Judge, Program, assert_diagnosis, sgd, train
from test_programs import Want

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 2
STEPS = 4


def unit_grad(g: torch.Tensor) -> torch.Tensor:
    return g / g.norm()  # <origin:unit_grad>


# 1. the loss code hooks the model's output: a batch with no labelled sample has a zero gradient there
def loss_hooks_output(model: nn.Module, batch: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    x, y, labelled = batch
    logits = model(x)
    logits.register_hook(unit_grad)
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * labelled).sum() / labelled.sum().clamp(min=1)


def _labelled_batches(seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        labelled = torch.ones(8) if step != FAIL_STEP else torch.zeros(8)
        out.append((torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g), labelled))
    return out


def _output_hook() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    return Program(model, sgd(model), _labelled_batches(1), loss_hooks_output)


# 2. a submodule hooks its own hidden state in its forward (a gradient normaliser inside an encoder block)
class NormalisedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        if h.requires_grad:
            h.register_hook(unit_grad)
        return h


class HookedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = NormalisedBlock()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def masked_ce(model: nn.Module, batch: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    x, y, labelled = batch
    ce = F.cross_entropy(model(x), y, reduction="none")
    return (ce * labelled).sum() / labelled.sum().clamp(min=1)


def _block_hook() -> Program:
    torch.manual_seed(0)
    model = HookedNet()
    return Program(model, sgd(model), _labelled_batches(2), masked_ce)


# 3. a hook put on a parameter before training (per-parameter gradient normalisation)
def _parameter_hook() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].weight.register_hook(unit_grad)
    return Program(model, sgd(model), _labelled_batches(3), masked_ce)


CASES: dict[str, tuple[Callable[[], Program], Want]] = {
    "loss_code_hooks_model_output": (_output_hook, Want("nonfinite_grad", "backward", "aten.div.Tensor", None,
                                                        "unit_grad", "zero_variance_norm", step=FAIL_STEP,
                                                        file=__file__)),
    "submodule_hooks_its_hidden_state": (_block_hook, Want("nonfinite_grad", "backward", "aten.div.Tensor", "block",
                                                           "unit_grad", "zero_variance_norm", step=FAIL_STEP,
                                                           file=__file__)),
    "hook_on_a_parameter": (_parameter_hook, Want("nonfinite_grad", "backward", "aten.div.Tensor", "2",
                                                  "unit_grad", "zero_variance_norm", step=FAIL_STEP, file=__file__)),
}


class _FirstNonFinite(TorchDispatchMode):
    """Records the first op whose floating result is not finite."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.first is None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not torch.isfinite(t).all():
                    self.first = str(func)
                    break
        return out


@pytest.mark.parametrize("name", list(CASES))
def test_programs_fail_in_the_hook_without_nantrace(name: str) -> None:
    program = CASES[name][0]()
    for step, batch in enumerate(program.batches):
        program.optimizer.zero_grad()
        loss = program.loss(program.model, batch, step)
        assert torch.isfinite(loss)
        with _FirstNonFinite() as mode:
            loss.backward()
        if step == FAIL_STEP:
            assert mode.first == "aten.div.Tensor"
            return
        assert mode.first is None, (step, mode.first)
        program.optimizer.step()
    raise AssertionError("never failed")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_hook_op_belongs_to_the_code_that_registered_it(name: str, mode: str) -> None:
    build, want = CASES[name]
    assert_diagnosis(train(build(), replayable=mode == "replayable"), want, Judge(__file__))


def test_the_replay_leaves_register_hook_as_it_was() -> None:
    before = torch.Tensor.register_hook
    train(_output_hook(), replayable=False)
    assert torch.Tensor.register_hook is before
