"""Precision fallback: repeated fp16 overflows in one module pin it to float32 under autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from conftest import assert_unhooked


class Attention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return F.softmax(scores, dim=-1) @ x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = Attention()
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.attn(x).mean(1))


LARGE = {3, 5, 7}


@pytest.mark.parametrize("dtype", [torch.float16])
def test_module_falls_back_to_float32_after_repeated_overflows(dtype):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, precision_fallback_after=2))
    for step in range(9):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 5, 16, generator=g) * (400.0 if step in LARGE else 1.0)
        y = torch.randint(0, 2, (2,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
    guard.close()
    got = [(i.step, i.cause, i.module, i.op, i.action) for i in guard.incidents]
    assert got == [
        (3, "precision_overflow", "attn", "aten.bmm.default", "skipped"),
        (5, "precision_overflow", "attn", "aten.bmm.default", "skipped"),
    ], "step 7's large batch runs in float32 and trains normally"
    assert "precision_fallback" not in guard.incidents[0].details
    note = guard.incidents[1].details["precision_fallback"]
    assert note == "after 2 float16/bfloat16 overflows, nantrace now runs module 'attn' in float32 outside autocast for the rest of the run"
    assert note in guard.incidents[1].fix
    assert guard.precision.pinned == ["attn"]
    assert_unhooked(model, opt)


def test_fallback_is_off_with_zero():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, precision_fallback_after=0))
    for step in range(9):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 5, 16, generator=g) * (400.0 if step in LARGE else 1.0)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().sum()
        loss.backward()
        opt.step()
    guard.close()
    # one origin (the same op in the same module) three times: one incident of the episode, counted
    assert [(i.step, i.details["count"], i.details["steps"]) for i in guard.incidents] == [(3, 3, [3, 5, 7])]
    assert guard.precision.pinned == []
