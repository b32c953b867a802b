"""Benchmark models shared by nantrace's benchmarks: small, deterministic, no downloads.

Each model comes as a :class:`BenchCase`: a builder for the module (same weights for a
given seed), a fixed list of synthetic batches (same for a given seed), and the loss
function the training loop applies to the model's output. Nothing here uses dropout or
any other randomness inside the step, so two copies trained on the same batches stay
identical, whatever tool watches them.

Usage::

    from models import CASES
    case = CASES["gpt"]
    model = case.build(seed=0)
    batches = case.batches(n=8, seed=1)
    loss = case.loss(model, batches[0])
    loss.backward()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BenchCase", "CASES", "MLP", "SmallCNN", "TinyGPT"]

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- tiny GPT
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out with plain ops (matmul, mask, softmax)."""

    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLPBlock(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLPBlock(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, blocks, final LN, LM head."""

    def __init__(self, vocab: int = 512, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, max_len: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, max_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.apply(_init_gpt)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_gpt(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------- CNN / MLP
class SmallCNN(nn.Module):
    """Three conv + BatchNorm + ReLU stages with pooling, then a linear classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()

        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.features = nn.Sequential(
            stage(3, 32), nn.MaxPool2d(2),    # 32x32 -> 16x16
            stage(32, 64), nn.MaxPool2d(2),   # 16x16 -> 8x8
            stage(64, 128), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    """``depth`` Linear(width, width) + ReLU layers and a linear head."""

    def __init__(self, width: int = 512, depth: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


# --------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One benchmark model: how to build it, feed it and compute its loss."""

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def build(self, seed: int = 0) -> nn.Module:
        """The model with weights fixed by ``seed`` (identical across calls)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.make_model()

    def batches(self, n: int, seed: int = 1) -> list[Batch]:
        """``n`` synthetic batches, fixed by ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        return [self.make_batch(gen) for _ in range(n)]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(model(x), y)


def _gpt_batch(gen: torch.Generator, *, batch: int = 8, seq: int = 128, vocab: int = 512) -> Batch:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _image_batch(gen: torch.Generator, *, batch: int = 32, classes: int = 10) -> Batch:
    return torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, classes, (batch,), generator=gen)


def _vector_batch(gen: torch.Generator, *, batch: int = 64, width: int = 512, classes: int = 10) -> Batch:
    return torch.randn(batch, width, generator=gen), torch.randint(0, classes, (batch,), generator=gen)


CASES: dict[str, BenchCase] = {
    "gpt": BenchCase(
        name="gpt",
        description="tiny GPT: 4 layers, d_model 256, 4 heads, seq 128, batch 8, vocab 512",
        make_model=TinyGPT,
        make_batch=_gpt_batch,
        loss_fn=_lm_loss,
    ),
    "cnn": BenchCase(
        name="cnn",
        description="small CNN: 3x (conv3x3 + BN + ReLU) + pooling + linear, 32x32x3, batch 32, 10 classes",
        make_model=SmallCNN,
        make_batch=_image_batch,
        loss_fn=F.cross_entropy,
    ),
    "mlp": BenchCase(
        name="mlp",
        description="MLP: 4x Linear(512, 512) + ReLU + linear head, batch 64, 10 classes",
        make_model=MLP,
        make_batch=_vector_batch,
        loss_fn=F.cross_entropy,
    ),
}


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(name: str) -> dict[str, Any]:
    case = CASES[name]
    return {"name": name, "description": case.description, "parameters": num_parameters(case.build())}
