"""Synthetic data for the demo: variable-length token sequences labelled by which half
of the vocabulary dominates. One record was emptied by a cleaning step upstream."""

from __future__ import annotations

import torch


def make_batch(step: int, *, batch: int = 16, max_len: int = 32, vocab: int = 64, empty_at: int | None = None,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded with 0, and labels. At ``empty_at`` one record has no tokens left."""
    g = generator or torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(4, max_len + 1, (batch,), generator=g)
    if step == empty_at:
        lengths[5] = 0
    tokens = torch.randint(1, vocab, (batch, max_len), generator=g)
    positions = torch.arange(max_len)[None, :]
    tokens = tokens.masked_fill(positions >= lengths[:, None], 0)
    low = ((tokens > 0) & (tokens < vocab // 2)).sum(1)
    high = (tokens >= vocab // 2).sum(1)
    labels = (high > low).long()
    return tokens, labels
