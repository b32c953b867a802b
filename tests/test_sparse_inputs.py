"""A model whose forward takes a sparse tensor (a graph network's adjacency, COO or CSR): the step's check reads
its stored values (``capture.StepCapture.note_inputs``: never densified), a healthy run trains as without nantrace,
and a NaN in the features, in the adjacency's stored values, or made by the forward after a sparse product is
diagnosed as in a dense model (``decision.bad_inputs`` names the rows of dim 0 that hold it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

N = 20


class GCN(nn.Module):
    def __init__(self, log_degree: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 3)
        self.log_degree = log_degree

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(adj, self.l1(x)))
        if self.log_degree:  # a degree feature: log of the weighted degree, 0 for an isolated node
            h = h + torch.log(torch.sparse.mm(adj, torch.ones(x.shape[0], 1)))  # <origin:log_degree>
        return self.l2(torch.sparse.mm(adj, h))


def _adjacency(layout: str, isolated: int | None = None, nan_at: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, N, (2, 80), generator=g)
    idx = torch.cat([idx, torch.arange(N).repeat(2, 1)], 1)  # self-loops: every node has a degree
    if isolated is not None:
        idx = idx[:, (idx[0] != isolated)]
    val = torch.rand(idx.shape[1], generator=g) + 0.1
    adj = torch.sparse_coo_tensor(idx, val, (N, N)).coalesce()
    if nan_at is not None:
        adj._values()[nan_at] = float("nan")
    return adj.to_sparse_csr() if layout == "csr" else adj


def _train(model: nn.Module, adjacency: list[torch.Tensor], features: list[torch.Tensor], watched: bool):
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))
    try:
        for adj, x in zip(adjacency, features):
            opt.zero_grad()
            F.cross_entropy(model(adj, x), y).backward()
            opt.step()
    finally:
        if guard is not None:
            guard.close()
    return guard, [p.detach().clone() for p in model.parameters()]


def _features(n: int, nan_step: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(N, 8, generator=g) for _ in range(n)]
    if nan_step is not None:
        xs[nan_step][7, 2] = float("nan")
    return xs


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_healthy_graph_network_trains_as_without_nantrace(layout: str) -> None:
    adj = [_adjacency(layout)] * 4
    torch.manual_seed(0)
    guard, watched = _train(GCN(), adj, _features(4), True)
    torch.manual_seed(0)
    _, plain = _train(GCN(), adj, _features(4), False)
    assert guard.incidents == [] and all(torch.equal(a, b) for a, b in zip(watched, plain))


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("where", ["features", "adjacency"])
def test_a_nan_in_the_batch_is_the_batchs(layout: str, where: str) -> None:
    good, bad = _adjacency(layout), _adjacency(layout, nan_at=5)
    adj = [good, bad if where == "adjacency" else good, good]
    torch.manual_seed(0)
    guard, _ = _train(GCN(), adj, _features(3, 1 if where == "features" else None), True)
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.phase, incident.cause, incident.action) == (
        1, "nonfinite_input", "data", "nonfinite_input", "skipped")
    arg = "args[1]" if where == "features" else "args[0]"
    [seen] = incident.details["nonfinite_inputs"]
    assert seen["arg"] == arg and seen["nan"] == 1
    plain = _adjacency("coo", nan_at=5)
    expected = [7] if where == "features" else [int(plain._indices()[0][5])]
    assert seen["samples"] == expected


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_forward_origin_after_a_sparse_product_is_localised(layout: str) -> None:
    adj = [_adjacency(layout), _adjacency(layout), _adjacency(layout, isolated=4)]
    torch.manual_seed(0)
    guard, _ = _train(GCN(log_degree=True), adj, _features(3), True)
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause) == (
        2, "nonfinite_loss", "forward", "aten.log.default", "", "log_nonpositive")
    assert incident.source.endswith(f"test_sparse_inputs.py:{_line('log_degree')}")


def _line(tag: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# <origin:{tag}>"))


def test_a_loss_code_origin_with_sparse_gradients_is_localised_without_replayable() -> None:
    """Sparse embedding gradients and a NaN made by the loss code (a triplet distance's sqrt at 0): the loss
    tape's replay reads the replayed sparse gradients through their stored values."""
    torch.manual_seed(0)
    emb = nn.Embedding(30, 8, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    guard = nantrace.watch(emb, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    g = torch.Generator().manual_seed(6)
    try:
        for step in range(4):
            a = torch.randint(0, 30, (16,), generator=g)
            p, n = ((a + 1 + torch.randint(0, 29, (16,), generator=g)) % 30 for _ in range(2))  # never a
            if step == 2:
                p[5] = a[5]  # a duplicate pair: the distance is exactly 0
            ea, ep, en = emb(a), emb(p), emb(n)
            d_pos = ((ea - ep) ** 2).sum(-1).sqrt()  # <origin:triplet_sqrt>
            d_neg = ((ea - en) ** 2).sum(-1).sqrt()
            opt.zero_grad()
            torch.relu(d_pos - d_neg + 1.0).mean().backward()
            opt.step()
    finally:
        guard.close()
    [incident] = guard.incidents
    assert (incident.step, incident.kind, incident.phase, incident.op, incident.module, incident.cause) == (
        2, "nonfinite_grad", "backward", "aten.sqrt.default", None, "grad_singularity")
    assert incident.source.endswith(f"test_sparse_inputs.py:{_line('triplet_sqrt')}")
