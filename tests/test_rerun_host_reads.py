"""A number read to the host keeps its provenance in a re-run too (docs/diagnosis.md, provenance).

The step's code reads a tensor to the host (``.item()``, ``float(t)``, ``int(t)``, for a logger or a Python-side
count) and divides by the number. Zero-intrusive, the loss tape notes the read and the replay links the dividing
call to the replayed tensor (``loss_replay._host_numbers``). A ``guard.replayable`` call's re-run, and the re-run of
a model forward, have no tape: there ``rerun._HostReads`` (a torch-function observer pushed under the op tracer for
the unit's own code only) notes each read and each later call taking such a number
(``loss_tape.note_replayed_numbers``), so ``family_rules._read_off`` follows the zero divisor to the op that made it
in every mode:

- a PPO critic's value targets standardised by a return std read for the logger, divided with ``torch.div(...,
  other=std)``: an episode without reward has constant returns, ``zero_variance_norm``;
- a summed token loss divided by the labelled-token count read with ``int()``: a prompt-only batch has every label
  at the ignore index, ``label_out_of_range``;
- a model whose forward standardises its input by ``float(x.std())`` (the number read inside the model): a blank
  frame, ``zero_variance_norm`` in the module;
- must not fire: the std is read to the host and is 0.0, but the divisor is a temperature of 0.0 from the config,
  another number of the same value: ``div_by_zero``, "divided by the scalar 0".

Each construction is checked with plain torch first: the first op making a non-finite value from finite inputs is
the marked one on the marked line, and what it divides by is recomputed directly."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from origin_markers import origin_line, points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 2
STEPS = FAIL + 1
LOG: dict[str, float] = {}
CONFIG = {"temperature": 0.0}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ============================================================ 1. PPO critic, value targets standardised
class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.pi = nn.Linear(16, 3)
        self.v = nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def ppo_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, actions, rewards = batch
    returns = torch.flip(torch.cumsum(torch.flip(rewards, [0]), 0), [0])
    LOG["return_std"] = returns.std().item()
    targets = torch.div(returns - returns.mean(), other=LOG["return_std"])  # <origin:ppo_std>
    logits, values = model(obs)
    logp = F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    return -(logp * (targets - values.detach())).mean() + 0.5 * F.mse_loss(values, targets)


def _ppo_batches() -> list[Any]:
    g = _gen(21)
    out = []
    for step in range(STEPS):
        rewards = torch.zeros(12) if step == FAIL else (torch.rand(12, generator=g) < 0.4).float()
        if step < FAIL:
            rewards[0] = 1.0
        out.append((torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g), rewards))
    return out


def _ppo_check(batch: Any) -> None:
    returns = torch.flip(torch.cumsum(torch.flip(batch[2], [0]), 0), [0])
    assert float(returns.std()) == 0.0


# ============================================================ 2. SFT token loss over a host count
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def sft_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, labels = batch
    n_labelled = int((labels != -100).sum())
    LOG["tokens"] = n_labelled
    logits = model(tokens)
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total / n_labelled  # <origin:sft_count>


def _sft_batches() -> list[Any]:
    g = _gen(22)
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, 20, (2, 6), generator=g)
        labels = torch.randint(0, 20, (2, 6), generator=g)
        labels[:, :2] = -100  # the prompt
        if step == FAIL:
            labels[:] = -100  # the prompt fills the window
        out.append((tokens, labels))
    return out


def _sft_check(batch: Any) -> None:
    assert int((batch[1] != -100).sum()) == 0


# ============================================================ 3. a forward that reads its input's std
class Standardise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = float(x.std())
        return (x - x.mean()) / s  # <origin:fwd_std>


class FrameNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(13)
        self.norm = Standardise()
        self.head = nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def frame_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _frame_batches() -> list[Any]:
    g = _gen(23)
    out = []
    for step in range(STEPS):
        x = torch.full((5, 10), 0.5) if step == FAIL else torch.rand(5, 10, generator=g)  # a blank frame
        out.append((x, torch.randint(0, 4, (5,), generator=g)))
    return out


def _frame_check(batch: Any) -> None:
    assert float(batch[0].std()) == 0.0


# ============================================================ 4. must not fire: a read 0.0, another 0.0 divides
def tempered_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    obs, actions, rewards = batch
    LOG["reward_std"] = rewards.std().item()  # 0.0 at the failing step, but not what is divided by
    logits, _ = model(obs)
    temperature = CONFIG["temperature"] if LOG["reward_std"] == 0.0 else 1.0  # a greedy setting, from the config
    scaled = logits / temperature  # <origin:temp>
    return -(F.log_softmax(scaled, -1).gather(1, actions[:, None]).squeeze(1) * rewards).mean()


def _temp_check(batch: Any) -> None:
    assert float(batch[2].std()) == 0.0 and CONFIG["temperature"] == 0.0


# ============================================================ the cases
@dataclasses.dataclass
class Case:
    model: Callable[[], nn.Module]
    batches: Callable[[], list[Any]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    check: Callable[[Any], None]
    tag: str
    module: str | None
    cause: str
    summary: str


DIV = "aten.div.Tensor"
CASES: dict[str, Case] = {
    "ppo_value_targets_over_return_std_read_for_logger": Case(
        ActorCritic, _ppo_batches, ppo_loss, _ppo_check, "ppo_std", None, "zero_variance_norm",
        "standard deviation (std) (read to the host as the number 0)"),
    "sft_sum_over_labelled_count_read_with_int_prompt_only": Case(
        TinyLM, _sft_batches, sft_loss, _sft_check, "sft_count", None, "label_out_of_range", "ignore_index=-100"),
    "forward_standardises_by_float_of_its_input_std_blank_frame": Case(
        FrameNet, _frame_batches, frame_loss, _frame_check, "fwd_std", "norm", "zero_variance_norm",
        "(read to the host as the number 0)"),
    "zero_temperature_is_not_the_zero_std_read_for_logger": Case(
        ActorCritic, _ppo_batches, tempered_loss, _temp_check, "temp", None, "div_by_zero",
        "divided by the scalar 0"),
}


class FirstBad(TorchDispatchMode):
    """The first op that makes a non-finite value from finite inputs, and this file's line that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None
        self.line: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.op is None:
            fl = lambda t: isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0  # noqa: E731
            ins = [t for t in tree_leaves((args, kwargs)) if fl(t)]
            outs = [t for t in tree_leaves(out) if fl(t)]
            if all(bool(torch.isfinite(t).all()) for t in ins) and any(not bool(torch.isfinite(t).all()) for t in outs):
                self.op = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename != __file__:
                    frame = frame.f_back
                self.line = frame.f_lineno if frame is not None else None
        return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_construction_fails_as_described_without_nantrace(name: str) -> None:
    case = CASES[name]
    model, batches = case.model(), case.batches()
    case.check(batches[FAIL])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(batches):
        opt.zero_grad()
        if step < FAIL:
            loss = case.loss(model, batch)
            assert bool(torch.isfinite(loss)), (name, step)
            loss.backward()
            opt.step()
            continue
        with FirstBad() as first:
            loss = case.loss(model, batch)
        assert not bool(torch.isfinite(loss))
        assert (first.op, first.line) == (DIV, origin_line(__file__, case.tag))


@pytest.mark.parametrize("mode", ["replayable", "zero_intrusive"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_number_read_to_the_host_keeps_its_provenance_in_every_mode(name: str, mode: str) -> None:
    case = CASES[name]
    model, batches = case.model(), case.batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        loss_fn = guard.replayable(case.loss) if mode == "replayable" else case.loss
        for batch in batches:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    assert guard.incidents, "no incident"
    first = guard.incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause) == \
        (FAIL, "nonfinite_loss", "forward", DIV, case.module, case.cause), first.to_dict()
    assert points_at(first.source, __file__, case.tag), first.source
    assert case.summary in first.summary, first.summary
