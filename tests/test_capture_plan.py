"""Lazy capture: which buffers are copied before a forward (issue 13, fixed cost)."""

from __future__ import annotations

import torch
from torch import nn

import nantrace
from nantrace.capture import BufferPlan


class SignFlip(nn.Module):
    """A forward that reads a buffer it also changes: its old value decides the output."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("sign", torch.ones(()))
        self.register_buffer("table", torch.arange(4.0))  # never changed: never copied after the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sign.mul_(-1)
        return torch.log(self.bn(x).sum(1) * 0 + self.sign * x[:, 0] * self.table[1])


def test_only_buffers_the_forward_reads_and_changes_are_copied():
    model = SignFlip()
    plan = BufferPlan(model, enabled=True)
    first = plan.snapshot()
    assert set(first) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "sign", "table"}
    model(torch.randn(8, 4))
    plan.learn()
    # BatchNorm's kernel writes its running statistics without bumping their version counters:
    # only its batch counter shows as changed (harmless: in training mode none of them is read)
    assert plan.mutable == {"bn.num_batches_tracked", "sign"}
    snap = plan.snapshot()
    assert set(snap) == {"sign"}  # BatchNorm in training mode normalises with the batch's statistics
    assert snap["sign"].item() == -1.0 and snap["sign"] is not model.sign
    model.eval()  # in eval mode the running statistics are read: copied again
    assert set(plan.snapshot()) == {"bn.num_batches_tracked", "sign"}
    assert BufferPlan(model, enabled=False).snapshot() is None


def test_a_replay_restores_a_buffer_the_forward_changed_and_reproduces_the_failure():
    torch.manual_seed(0)
    model = SignFlip()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = -torch.ones(8, 4)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    for _ in range(2):  # step 0: sign -1, log(+) finite; step 1: sign +1, log(-) NaN
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    guard.close()
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.op, incident.cause, incident.transient) == (
        1, "nonfinite_loss", "aten.log.default", "log_nonpositive", False)
    assert model.sign.item() == 1.0  # the replay put the buffer back as the step left it
