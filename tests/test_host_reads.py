"""Real host reads per training step, counted where a value reaches Python (not calls to
``measure()``): the guard adds exactly one per step on one process, under DDP and under
FSDP2, in the steady state (see nantrace.testing.host_reads for what is intercepted)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.testing.host_reads import HOST_COPY, HostReadCounter

from test_distributed import _torchrun

SENTINEL = "tolist@nantrace/detection/sentinel.py"
"""The step's one read on one process: the sentinel's vector, as a list."""
SENTINEL_RANKS = "numpy@nantrace/detection/sentinel.py"
"""The step's one read on several ranks: the sentinel's vector and the all-reduced agreement, as one array."""


@pytest.mark.parametrize("expr, how", [
    ("t[0].item()", "item"), ("t.tolist()", "tolist"), ("bool(t[0])", "__bool__"), ("float(t[0])", "__float__"),
    ("int(t[0])", "__int__"), ("t.numpy()", "numpy"), ("np.asarray(t)", "__array__"), ("[0, 1][t[0].long()]", "__index__"),
    ("torch.equal(t, t)", "aten.equal.default"), ("t.nonzero()", "aten.nonzero.default"),
    ("t[t > 1]", "aten.index.Tensor(bool mask)"), ("torch.allclose(t, t)", "aten.allclose.default"),
    ("t.masked_select(t > 1)", "aten.masked_select.default"), ("torch.unique(t)", "aten._unique2.default"),
    ("(t > 0).any().item() and t.sum().item()", "item"),
])
def test_the_counter_sees_every_way_a_value_reaches_python(expr, how):
    t = torch.tensor([1.5, 2.0])
    with HostReadCounter() as reads:
        eval(expr, {"t": t, "torch": torch, "np": np})
    assert {e.how for e in reads.events} == {how}
    assert reads.count == (2 if " and " in expr else 1)
    assert all(e.where == "<string>:1" for e in reads.events)  # attributed to the code that asked


def test_the_counter_skips_host_memory_and_leaves_torch_as_it_was():
    t = torch.tensor([1.0, 2.0])
    setattr(t, HOST_COPY, True)
    before = torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__
    with HostReadCounter() as reads:
        t.tolist()
        torch.ones(3).add_(1)  # no read
    assert reads.count == 0
    assert (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__) == before


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[tuple[int, list[str]]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    with HostReadCounter() as reads:
        for _ in range(steps):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            reads.reset()
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            ours = [f"{e.how}@{e.where.rsplit(':', 1)[0]}" for e in reads.events if e.where.startswith("nantrace/")]
            out.append((reads.count, ours))
    return out


def test_one_process_one_read_per_step_with_the_default_preset():
    """60 steps cover every sampled statistic of the default preset (every 25 / 50 steps)."""
    reference, reference_opt = _mlp()
    plain = _train(reference, reference_opt, steps=60)
    model, opt = _mlp()
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    watched = _train(model, opt, steps=60)
    guard.close()
    assert guard.incidents == [] and guard.step == 60
    assert [ours for _, ours in watched] == [[SENTINEL]] * 60
    # every other read is AdamW's own (its CPU step counter), there with or without nantrace
    assert [n for n, _ in watched] == [n + 1 for n, _ in plain]
    # and the training is the same, bit for bit (weights and BatchNorm statistics)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("scenario", ["ddp_reads", "fsdp_reads"])
def test_one_read_per_step_on_two_gloo_ranks(tmp_path, scenario):
    results = _torchrun(tmp_path, scenario)
    for res in results:
        assert res["incidents"] == 0 and res["sharded"] is (scenario == "fsdp_reads")
        plain = [s for s in res["steps"] if not s["watched"]]
        watched = [s for s in res["steps"] if s["watched"]]
        assert (len(plain), len(watched)) == (4, 12)
        assert all(s["nantrace"] == [] for s in plain)
        assert [s["nantrace"] for s in watched] == [[SENTINEL_RANKS]] * 12
        # the training's own reads (AdamW's CPU step counter, the wrapper's) are the same with nantrace
        assert {s["total"] for s in watched} == {plain[-1]["total"] + 1}
