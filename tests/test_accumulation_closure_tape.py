"""Gradient accumulation whose last micro-batch runs inside ``optimizer.step(closure)`` (Lightning's automatic
optimisation with ``accumulate_grad_batches``): the calls taped after the first micro-batch's ``backward()`` (the
next batch's transfer, ``x.to(...)``, which returns its input) are dropped when the step begins
(``LossTape.keep_first``), and so are the tape's records of the tensors they made: the closure's calls, numbered
anew from there, must read the batch as what it is, never as an output of a dropped call (before the fix, the
replay indexed past the tape: "IndexError", cause unknown).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nantrace

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]


def _cox_loss(risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(time, descending=True)
    risk, event = risk[order], event[order]
    log_cum = torch.logcumsumexp(risk, 0)
    return -((risk - log_cum) * event).sum() / event.sum()  # <origin:cox_div>


def _run(censored_step: int | None) -> tuple[list, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(5):
            micro = []
            for k in range(2):
                x, t = torch.randn(16, 5, generator=g), torch.rand(16, generator=g) + 0.1
                e = torch.zeros(16) if (step == censored_step and k == 1) else (torch.rand(16, generator=g) < 0.7).float()
                micro.append((x, t, e))
            opt.zero_grad()
            x, t, e = (v.to(torch.float32) for v in micro[0])  # the framework's batch transfer
            (_cox_loss(model(x).squeeze(-1), t, e) / 2).backward()
            x2, t2, e2 = (v.to(torch.float32) for v in micro[1])  # taped after the first backward()

            def closure() -> torch.Tensor:
                loss = _cox_loss(model(x2).squeeze(-1), t2, e2) / 2
                loss.backward()
                return loss

            opt.step(closure)
    finally:
        guard.close()
    return guard.incidents, [p.detach().clone() for p in model.parameters()]


def test_the_closure_micro_batch_is_replayed_from_its_own_calls() -> None:
    incidents, params = _run(3)
    [incident] = incidents
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause,
            incident.action) == (3, "nonfinite_loss", "forward", "aten.div.Tensor", None, "div_by_zero", "skipped")
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# <origin:cox_div>"))
    assert incident.source.endswith(f"test_accumulation_closure_tape.py:{line}")
    assert "localisation_error" not in incident.details and all(bool(torch.isfinite(p).all()) for p in params)


def test_a_run_without_censored_batches_is_quiet() -> None:
    incidents, _ = _run(None)
    assert incidents == []
