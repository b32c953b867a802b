"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``: the recommender and
NLP staple, trained with SGD, Adagrad or SparseAdam) are read through the values they store.

The replays' finiteness checks and statistics (the model's replay, the optimizer's update replay) read
every tensor through its dense parts (``localisation/tracer.py dense_parts``: a sparse COO tensor's
coalesced values, a compressed one's values, a nested one's components), so a sparse gradient neither
breaks a replay (``aminmax`` / comparisons / storage access have no sparse kernel) nor changes what the
evidence says: an entry the sparse gradient stores with value 0 is a zero the update divides by.

Each pattern is checked in plain torch first (``_Oracle``, a dispatch mode written here: the step, the
first op that made a non-finite value from finite inputs, the autograd node it ran for, the module
running it), then diagnosed by nantrace in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nantrace
from nantrace.localisation.tracer import dense_parts, has_nan, readable, tensor_stats
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

MODES = ("zero_intrusive", "replayable")


@dataclass
class Program:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


# ------------------------------------------------------------------ 1. fastText with Adagrad, eps=0
# A bag-of-words classifier (fastText style: a sparse EmbeddingBag, a linear head) over documents padded to
# a fixed length with token 0, whose padding is switched off by per-sample weights of 0. Padding rows are
# IN the sparse gradient, with value 0 (0 * the bag's gradient). Adagrad with eps=0: the update of that row
# is 0 / (sqrt(0) + 0) at the first step.
class FastText(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, d, mode="sum", sparse=True)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens, per_sample_weights=weights))


def _fasttext(eps: float) -> Program:
    torch.manual_seed(0)
    model = FastText()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, eps=eps)
    g = torch.Generator().manual_seed(10)
    batches = []
    for _ in range(4):
        lengths = torch.randint(2, 7, (6,), generator=g)
        tokens = torch.randint(1, 50, (6, 8), generator=g)
        weights = (torch.arange(8) < lengths[:, None]).float()
        tokens[weights == 0] = 0  # <pad>
        weights = weights / lengths[:, None]  # a mean over the real tokens
        batches.append((tokens, weights, torch.randint(0, 3, (6,), generator=g)))
    return Program(model, opt, batches, lambda m, b: F.cross_entropy(m(b[0], b[1]), b[2]))


# ------------------------------------------------------------------ 2. metric learning on sparse item embeddings
# Item-to-item retrieval trained with a triplet loss over hand-written Euclidean distances; the sampler draws
# positives from the anchor's session, which at step 2 holds the anchor itself (a repeated view): the distance
# sqrt(sum((a - p)^2)) is sqrt(0) = 0, finite, and its derivative is infinite there.
class L2Distance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # <origin:distance>


class ItemRetrieval(nn.Module):
    def __init__(self, items: int = 40, d: int = 8) -> None:
        super().__init__()
        self.items = nn.Embedding(items, d, sparse=True)
        self.metric = L2Distance()

    def forward(self, anchor: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        a, p, n = self.items(anchor), self.items(pos), self.items(neg)
        return F.relu(self.metric(a, p) - self.metric(a, n) + 10.0).mean()


def _retrieval() -> Program:
    torch.manual_seed(0)
    model = ItemRetrieval()
    g = torch.Generator().manual_seed(20)
    batches = []
    for step in range(4):
        anchor = torch.randint(0, 40, (8,), generator=g)
        pos = (anchor + torch.randint(1, 39, (8,), generator=g)) % 40
        if step == 2:
            pos[3] = anchor[3]  # the session's repeated view
        batches.append((anchor, pos, torch.randint(0, 40, (8,), generator=g)))
    return Program(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, lambda m, b: m(*b))


# ------------------------------------------------------------------ 3. Poisson matrix factorisation, plain SGD
# Non-negative (NMF-style) user and item factors in sparse embeddings, a Poisson likelihood on the log rate,
# plain SGD without projecting the factors back onto >= 0: a step pushes factors below 0, and a later batch's
# rate u.i is negative, whose log the model's forward takes.
class PoissonMF(nn.Module):
    def __init__(self, users: int = 12, items: int = 12, d: int = 4) -> None:
        super().__init__()
        self.user = nn.Embedding(users, d, sparse=True)
        self.item = nn.Embedding(items, d, sparse=True)
        nn.init.uniform_(self.user.weight, 0.1, 0.6)
        nn.init.uniform_(self.item.weight, 0.1, 0.6)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        rate = (self.user(u) * self.item(i)).sum(-1)
        return torch.log(rate)  # <origin:log_rate>


def _poisson_mf() -> Program:
    torch.manual_seed(0)
    model = PoissonMF()
    g = torch.Generator().manual_seed(30)
    batches = [(torch.randint(0, 12, (16,), generator=g), torch.randint(0, 12, (16,), generator=g),
                torch.randint(0, 2, (16,), generator=g).float()) for _ in range(6)]

    def loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        log_rate = m(b[0], b[1])
        return (log_rate.exp() - b[2] * log_rate).sum()  # the Poisson likelihood of the batch

    return Program(model, torch.optim.SGD(model.parameters(), lr=0.25), batches, loss)


# ------------------------------------------------------------------ 4. quiet: SparseAdam on a two-tower model
class TwoTower(nn.Module):
    def __init__(self, users: int = 30, items: int = 30, d: int = 8) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(items, d, mode="mean", sparse=True)
        self.item = nn.Embedding(items, d, sparse=True)

    def forward(self, history: torch.Tensor, offsets: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        return (self.user(history, offsets) * self.item(cand)).sum(-1)


def _two_tower_sparse_adam() -> Program:
    torch.manual_seed(0)
    model = TwoTower()
    g = torch.Generator().manual_seed(40)
    batches = []
    for _ in range(5):
        lengths = torch.randint(1, 5, (8,), generator=g)
        history = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        batches.append((history, offsets, torch.randint(0, 30, (8,), generator=g),
                        torch.randint(0, 2, (8,), generator=g).float()))
    return Program(model, torch.optim.SparseAdam(list(model.parameters()), lr=0.01), batches,
                   lambda m, b: F.binary_cross_entropy_with_logits(m(b[0], b[1], b[2]), b[3]))


BUILD: dict[str, Callable[[], Program]] = {
    "fasttext_padding_rows_adagrad_eps0": lambda: _fasttext(0.0),
    "item_retrieval_triplet_distance_of_a_repeated_view": _retrieval,
    "poisson_mf_sgd_negative_rate": _poisson_mf,
    "quiet_fasttext_adagrad_default_eps": lambda: _fasttext(1e-10),
    "quiet_two_tower_sparse_adam": _two_tower_sparse_adam,
}
# step, kind, phase, op, module, cause, source tag (None: the optimizer.step() line)
WANT: dict[str, tuple[int, str, str, str, str, str, str] | None] = {
    "fasttext_padding_rows_adagrad_eps0":
        (0, "nonfinite_param", "optimizer", "aten.div.Tensor", "embed", "optimizer_state", "opt_step"),
    "item_retrieval_triplet_distance_of_a_repeated_view":
        (2, "nonfinite_grad", "backward", "aten.sqrt.default", "metric", "grad_singularity", "distance"),
    "poisson_mf_sgd_negative_rate":
        (None, "nonfinite_loss", "forward", "aten.log.default", "", "log_nonpositive", "log_rate"),
    "quiet_fasttext_adagrad_default_eps": None,
    "quiet_two_tower_sparse_adam": None,
}


# ------------------------------------------------------------------ the plain-torch oracle
def _bad(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return False
    x = t.detach()
    if x.layout == torch.sparse_coo:  # what the sparse tensor stands for
        x = x.coalesce().values()
    return bool((~torch.isfinite(x)).any())


class _Oracle(TorchDispatchMode):
    """The first op whose floating inputs were finite and after which an output or an argument it wrote
    is not: its name, stage, the autograd node it ran for, and the innermost module running (forward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.in_optimizer = False
        self.first: dict[str, Any] | None = None
        self.hooks: list[Any] = []

    def __enter__(self) -> "_Oracle":
        self.hooks = [nn.modules.module.register_module_forward_pre_hook(self._enter),
                      nn.modules.module.register_module_forward_hook(self._leave)]
        return super().__enter__()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module)))

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self.stack.pop()

    def __exit__(self, *exc: Any) -> None:
        for h in self.hooks:
            h.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        finite_in = not any(_bad(t) for t in ins)
        out = func(*args, **kwargs)
        if self.first is None and finite_in and any(_bad(t) for t in [*tree_leaves(out), *ins]):
            node = torch._C._current_autograd_node()
            stage = "optimizer" if self.in_optimizer else "backward" if node is not None else "forward"
            self.first = dict(op=f"aten.{func._schema.name.split('::')[1]}.{func._overloadname or 'default'}",
                              stage=stage, node=None if node is None else node.name(),
                              module=next((n for n in reversed(self.stack) if n is not None), None))
        return out


def _plain(name: str) -> dict[str, Any]:
    """Train the program in plain torch: the first step where the loss, a (sparse) gradient or a parameter after
    the update is non-finite, what it was, the oracle's first op, and the final parameters."""
    p = BUILD[name]()
    for step, batch in enumerate(p.batches):
        oracle = _Oracle(p.model)
        p.optimizer.zero_grad()
        with oracle:
            loss = p.loss(p.model, batch)
            bad_loss = _bad(loss)
            loss.backward()
            grads = {n: q.grad for n, q in p.model.named_parameters() if q.grad is not None}
            bad_grad = any(_bad(g) for g in grads.values())
            oracle.in_optimizer = True
            p.optimizer.step()
        bad_params = [n for n, q in p.model.named_parameters() if _bad(q)]
        if bad_loss or bad_grad or bad_params:
            what = "loss" if bad_loss else "grad" if bad_grad else "param"
            return dict(step=step, what=what, first=oracle.first, bad_params=bad_params, grads=grads,
                        params=None)
    return dict(step=None, what=None, first=None, bad_params=[], grads=None,
                params={n: q.detach().clone() for n, q in p.model.named_parameters()})


def _train(name: str, mode: str) -> tuple[list[Any], dict[str, torch.Tensor]]:
    p = BUILD[name]()
    guard = nantrace.watch(p.model, p.optimizer, config=nantrace.Config(outputs={"print_incidents": False}))
    loss_of = guard.replayable(p.loss) if mode == "replayable" else p.loss
    try:
        for batch in p.batches:
            p.optimizer.zero_grad()
            loss = loss_of(p.model, batch)
            loss.backward()
            p.optimizer.step()  # <origin:opt_step>
    finally:
        guard.close()
    return guard.incidents, {n: q.detach().clone() for n, q in p.model.named_parameters()}


# ------------------------------------------------------------------ the constructions, in plain torch
def test_constructions_fail_as_described() -> None:
    ft = _plain("fasttext_padding_rows_adagrad_eps0")
    assert (ft["step"], ft["what"], ft["bad_params"][:1]) == (0, "param", ["embed.weight"])
    grad = ft["grads"]["embed.weight"]
    assert grad.layout == torch.sparse_coo
    stored = grad.coalesce()
    pad = (stored.indices()[0] == 0).nonzero().flatten()
    assert pad.numel() == 1 and bool((stored.values()[pad] == 0).all())  # the <pad> row is stored, with value 0
    assert int((stored.values() == 0).all(-1).sum()) == 1  # and is the only all-zero stored row
    assert ft["first"]["op"] == "aten.div.Tensor" and ft["first"]["stage"] == "optimizer", ft["first"]

    ret = _plain("item_retrieval_triplet_distance_of_a_repeated_view")
    assert (ret["step"], ret["what"]) == (2, "grad"), ret
    assert ret["first"]["stage"] == "backward" and ret["first"]["node"] == "SqrtBackward0", ret["first"]
    assert ret["grads"]["items.weight"].layout == torch.sparse_coo

    mf = _plain("poisson_mf_sgd_negative_rate")
    assert mf["what"] == "loss" and mf["step"] is not None and mf["step"] > 0, mf
    assert mf["first"] == dict(op="aten.log.default", stage="forward", node=None, module=""), mf["first"]

    for quiet in ("quiet_fasttext_adagrad_default_eps", "quiet_two_tower_sparse_adam"):
        run = _plain(quiet)
        assert run["step"] is None, (quiet, run)


def _want(name: str) -> tuple[Any, ...] | None:
    want = WANT[name]
    if want is not None and want[0] is None:  # the step comes from the plain run
        want = (_plain(name)["step"], *want[1:])
    return want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(BUILD))
def test_sparse_gradient_programs_are_diagnosed(name: str, mode: str) -> None:
    want = _want(name)
    incidents, params = _train(name, mode)
    if want is None:  # quiet: no incident, and training is bit for bit what it is without nantrace
        assert not incidents, [(i.kind, i.cause, i.summary) for i in incidents]
        plain = _plain(name)["params"]
        assert all(torch.equal(params[n], plain[n]) for n in plain)
        return
    assert incidents, "no incident"
    first = incidents[0]
    got = (first.step, first.kind, first.phase, first.op, first.module, first.cause)
    assert got == want[:6], (got, first.summary)
    assert points_at(first.source, __file__, want[6]), first.source
    assert first.action == "skipped"


# ------------------------------------------------------------------ the helper itself
def test_dense_parts_read_what_a_tensor_stores() -> None:
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 2, 2]]), torch.tensor([0.0, 1.0, float("nan")]), (5,))
    assert not coo.is_coalesced()
    (values,) = dense_parts(coo)  # duplicates summed: 1 + nan
    assert values.tolist()[0] == 0.0 and has_nan(coo) and readable(coo)
    stats = tensor_stats(coo, "x")
    assert (stats["shape"], stats["numel"], stats["zeros"], stats["nan"]) == ([5], 2, 1, 1)  # a stored zero only
    csr = torch.tensor([[0.0, 2.0], [float("inf"), 0.0]]).to_sparse_csr()
    assert [v.tolist() for v in dense_parts(csr)] == [[2.0, float("inf")]]
    dense = torch.ones(3)
    assert dense_parts(dense)[0] is dense
