"""Diagnosis of models trained with activation checkpointing (``torch.utils.checkpoint``).

Reentrant checkpointing (``use_reentrant=True``, long the default of LLM code bases and of
Hugging Face's ``gradient_checkpointing_enable``) refuses ``torch.autograd.grad``, which the
replay differentiates with: a backward origin used to end as ``unknown``. The replay now runs
checkpointed functions inline (``localisation/rerun.py``); the diagnosis must be the one an
uncheckpointed model gets, in both checkpointing modes, with and without ``replayable``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nantrace
from origin_markers import points_at

BAD_STEP = 3


class SoftGate(nn.Module):
    """sqrt(mean(x^2)) with no eps: finite at 0 in the forward, an infinite derivative there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x ** 2).mean(-1, keepdim=True))  # <origin:gate>


class QKNorm(nn.Module):
    """x / ||x|| with no eps: 0/0 on an all-zero row in the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)  # <origin:qknorm>


class Block(nn.Module):
    def __init__(self, d: int, origin: str) -> None:
        super().__init__()
        self.gate = SoftGate()
        self.qknorm = QKNorm()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.origin = origin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.origin == "forward":
            return x + self.mlp(self.qknorm(x))
        return x + self.mlp(x) * torch.tanh(self.gate(x))


class TinyLM(nn.Module):
    """Embedding (padding row 0 is all zeros), two checkpointed blocks, a head: the shape of a
    small GPT trained with gradient checkpointing."""

    def __init__(self, origin: str, reentrant: bool, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.blocks = nn.ModuleList([Block(d, origin) for _ in range(2)])
        self.out = nn.Linear(d, vocab)
        # bound once, as transformers' gradient_checkpointing_enable() does
        self._checkpoint = functools.partial(checkpoint, use_reentrant=reentrant)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok)
        for block in self.blocks:
            x = self._checkpoint(block, x)
        return self.out(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(25)
    out = []
    for step in range(5):
        tok = torch.randint(1, 20, (3, 6), generator=g)
        if step == BAD_STEP:
            tok[1, 3:] = 0  # a padded tail: all-zero embeddings
        out.append((tok, torch.randint(1, 20, (3, 6), generator=g)))
    return out


EXPECTED = {
    # backward origin: both blocks see the zero rows; in backward order blocks.1's sqrt fails first
    "backward": dict(kind="nonfinite_grad", phase="backward", op="aten.sqrt.default", module="blocks.1.gate",
                     cause="grad_singularity", marker="gate"),
    # forward origin: the first block's normalisation divides 0 by 0
    "forward": dict(kind="nonfinite_loss", phase="forward", op="aten.div.Tensor", module="blocks.0.qknorm",
                    cause="zero_variance_norm", marker="qknorm"),
}


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("origin", ["backward", "forward"])
def test_checkpointed_blocks_are_diagnosed_like_plain_ones(one_thread, origin, reentrant, replayable):
    torch.manual_seed(0)
    model = TinyLM(origin, reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = nantrace.Config(outputs={"print_incidents": False})

    def loss_fn(tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tok).flatten(0, 1), tgt.flatten())

    with nantrace.watch(model, opt, config=config) as guard:
        step_loss = guard.replayable(loss_fn) if replayable else loss_fn
        for tok, tgt in _batches():
            opt.zero_grad()
            step_loss(tok, tgt).backward()
            opt.step()
        incidents = list(guard.incidents)
    assert len(incidents) == 1
    got = incidents[0]
    want = EXPECTED[origin]
    assert (got.step, got.kind, got.phase, got.op, got.module, got.cause, got.action) == (
        BAD_STEP, want["kind"], want["phase"], want["op"], want["module"], want["cause"], "skipped")
    assert points_at(got.source, __file__, want["marker"])
