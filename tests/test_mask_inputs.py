"""``-inf`` additive masks passed to or returned by the watched model.

PyTorch's own ``nn.Transformer.generate_square_subsequent_mask`` returns a float mask of 0 and
``-inf``; packed-sequence collators build 4D block masks the same way; RL policies return logits
with ``-inf`` on invalid actions. Such tensors used to make every healthy step "non-finite
input" (blocked, then the run paused after five skips). A tensor whose only non-finite values are
``-inf`` is now a valid input and output (``capture.extremes_ok``); what it does to the loss or
gradients is judged there, and in a diagnosis a ``-inf`` tensor applied by an additive/masking op
is intentional, like a ``-inf`` fill, so a fully masked softmax row is ``masked_softmax_all``.
NaN, ``+inf``, and a ``-inf`` feature that a matmul reads are still the batch's fault.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at

CONFIG = nantrace.Config(outputs={"print_incidents": False})
BAD_STEP = 3
T = 8


class CausalLM(nn.Module):
    """A tiny decoder: ``nn.TransformerEncoder`` with the float causal mask as a forward argument."""

    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tok), mask=mask, is_causal=True))


class PackedAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
        return torch.softmax(scores, -1) @ v  # <origin:softmax>


class PackedLM(nn.Module):
    """Packed sequences with a block mask (0 / -inf) built by the collator and passed in."""

    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = PackedAttention(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(tok), mask))


class MaskedPolicy(nn.Module):
    """Logits with -inf on invalid actions, returned as the model's output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 5)

    def forward(self, obs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.body(obs).masked_fill(~valid, float("-inf"))


def _causal_batches() -> list[tuple]:
    g = torch.Generator().manual_seed(21)
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    return [(torch.randint(0, 30, (4, T), generator=g), mask) for _ in range(6)]


def _causal_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    tok, mask = batch
    logits = model(tok[:, :-1], mask[:-1, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())


def _policy_batches() -> list[tuple]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(6):
        valid = torch.rand(8, 5, generator=g) > 0.4
        valid[:, 0] = True
        out.append((torch.randn(8, 6, generator=g), valid, torch.randn(8, generator=g)))
    return out


def _policy_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    obs, valid, adv = batch
    dist = torch.distributions.Categorical(logits=model(obs, valid))
    actions = torch.zeros(obs.shape[0], dtype=torch.long)  # action 0 is always valid
    return -(dist.log_prob(actions) * adv).mean() - 0.01 * dist.entropy().nan_to_num().mean()


HEALTHY = {"causal_transformer_mask": (CausalLM, _causal_batches, _causal_loss),
           "rl_action_masked_logits": (MaskedPolicy, _policy_batches, _policy_loss)}


def _train(make, batches, loss_fn, *, watched: bool, replayable: bool = False):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=CONFIG) if watched else None
    step_loss = guard.replayable(loss_fn) if guard is not None and replayable else loss_fn
    try:
        for batch in batches():
            opt.zero_grad()
            step_loss(model, batch).backward()
            opt.step()
    finally:
        if guard is not None:
            guard.close()
    return (list(guard.incidents) if guard is not None else []), model.state_dict()


@pytest.mark.parametrize("program", list(HEALTHY))
def test_a_healthy_run_with_minus_inf_masks_trains_as_plain(one_thread, program):
    make, batches, loss_fn = HEALTHY[program]
    incidents, watched = _train(make, batches, loss_fn, watched=True)
    _, plain = _train(make, batches, loss_fn, watched=False)
    assert incidents == []
    for name, value in plain.items():  # every update applied: the same weights as without nantrace
        assert torch.equal(watched[name], value), name


def _packed_batches() -> list[tuple]:
    g = torch.Generator().manual_seed(8)
    out = []
    for step in range(5):
        tok = torch.randint(1, 30, (2, T), generator=g)
        labels = tok.clone()
        mask = torch.triu(torch.full((T, T), float("-inf")), 1).expand(2, T, T).clone()
        if step == BAD_STEP:  # the second pack is not full: its pad queries see nothing
            tok[1, -3:] = 0
            labels[1, -3:] = -100
            mask[1, -3:, :] = float("-inf")
            mask[1, :, -3:] = float("-inf")
        out.append((tok, mask, labels))
    return out


def _packed_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    tok, mask, labels = batch
    return F.cross_entropy(model(tok, mask).flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
def test_a_fully_masked_pad_row_is_a_masked_softmax_not_bad_data(one_thread, replayable):
    incidents, _ = _train(PackedLM, _packed_batches, _packed_loss, watched=True, replayable=replayable)
    assert len(incidents) == 1
    got = incidents[0]
    assert (got.step, got.kind, got.phase, got.op, got.module, got.cause, got.action) == (
        BAD_STEP, "nonfinite_activation", "forward", "aten._softmax.default", "attn", "masked_softmax_all", "skipped")
    assert points_at(got.source, __file__, "softmax")


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "plus_inf", "minus_inf"])
def test_a_bad_feature_is_still_the_batch(one_thread, bad):
    """A NaN, +inf or -inf feature (log of 0 in preprocessing) read by a matmul: the batch's fault."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    with nantrace.watch(model, opt, config=CONFIG) as guard:
        for step in range(5):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            if step == BAD_STEP:
                x[2, 1] = bad
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        incidents = list(guard.incidents)
    assert [(i.step, i.kind, i.cause, i.action) for i in incidents] == [
        (BAD_STEP, "nonfinite_input", "nonfinite_input", "skipped")]
