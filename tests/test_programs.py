"""Failures shaped like real training programs (issue 11), all zero-intrusive: the loop is
exactly what a user writes, with ``nantrace.watch(model, optimizer)`` (or a callback, or
``nantrace run``) added and no ``guard.replayable``.

Each program is written the way people write these models and losses (a VAE, a small GPT,
a focal loss, a label-smoothed loss, a denoising-score-matching diffusion loss, an RL
policy gradient, an HF ``Trainer`` subclass with its own ``compute_loss``, a Lightning
module with the loss in ``training_step``). Each fails at one step of a short run; the line
of this file that issues the origin op carries a ``# <origin:TAG>`` comment, and the test
asserts the exact diagnosis: step, kind, phase, ATen op, module, cause, action, source line,
and that the parameters were left unchanged by the blocked step. Failures that raise keep
their exception: same type, same message as the same program run without nantrace.
Exceptions that have nothing to do with a value are not incidents.

``tests/program_figures.py`` runs every case and prints the figures issue 11 asks for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]

FAIL_STEP = 3
STEPS = 5
QUIET = dict(config=None)  # replaced per run (a Config is not reusable across guards by contract)

_TAG = re.compile(r"#\s*<origin:([\w-]+)>")


def origin_line(tag: str, path: str = __file__) -> int:
    """The 1-based line of the ``# <origin:tag>`` comment in ``path`` (this file by default)."""
    with open(path, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) for m in _TAG.finditer(line) if m.group(1) == tag]
    if len(hits) != 1:
        raise LookupError(f"origin tag {tag!r} found {len(hits)} times in {path}")
    return hits[0]


def quiet() -> nantrace.Config:
    return nantrace.Config(print_incidents=False)


# ============================================================================ harness
@dataclasses.dataclass(frozen=True)
class Want:
    """The diagnosis a case must get."""

    kind: str
    phase: str | None
    op: str | None
    module: str | None
    tag: str | None
    """``# <origin:TAG>`` of the line the source must point at (in ``file``)."""
    cause: str
    step: int = FAIL_STEP
    action: str = "skipped"
    file: str = __file__


@dataclasses.dataclass
class Run:
    incidents: list[Any]
    unchanged: dict[int, bool]
    """Steps with an incident (or that raised): were all parameters left as they were?"""
    error: BaseException | None = None
    steps_run: int = 0
    error_step: int | None = None


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(torch.nan_to_num(x, 1.0, 2.0, 3.0), torch.nan_to_num(y, 1.0, 2.0, 3.0))
        and torch.equal(torch.isnan(x), torch.isnan(y)) for x, y in zip(a, b))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any],
          step_loss: Callable[[nn.Module, Any, int], torch.Tensor], *, watch: bool = True,
          with_block: bool = False) -> Run:
    """A plain training loop. ``watch``: one ``nantrace.watch`` line before it (``with_block``:
    as ``with nantrace.watch(...) as guard:`` around the loop). An exception ends the run and
    is kept in ``Run.error``, as it would have ended the script."""
    run = Run([], {})
    state = {"before": None, "step": None}

    def loop(guard: Any) -> None:
        for step, batch in enumerate(batches):
            state["before"], state["step"] = _params(model), step
            seen = len(guard.incidents) if guard is not None else 0
            optimizer.zero_grad()
            loss = step_loss(model, batch, step)
            loss.backward()
            optimizer.step()
            if guard is not None and len(guard.incidents) > seen:
                run.unchanged[step] = _same(state["before"], _params(model))
            run.steps_run = step + 1

    guard = None
    try:
        if not watch:
            loop(None)
        elif with_block:
            with nantrace.watch(model, optimizer, config=quiet()) as guard:
                loop(guard)
        else:
            guard = nantrace.watch(model, optimizer, config=quiet())
            try:
                loop(guard)
            finally:
                guard.close()
    except Exception as exc:  # the script would have died here
        run.error, run.error_step = exc, state["step"]
        run.unchanged[state["step"]] = _same(state["before"], _params(model))
    run.incidents = list(guard.incidents) if guard is not None else []
    return run


CASES: dict[str, Callable[[Path], tuple[Run, Want | None]]] = {}
"""name -> a function running the program (given a temporary directory) and returning what
happened and the diagnosis it must get (``None``: it must get none)."""


def case(name: str) -> Callable:
    def register(fn: Callable) -> Callable:
        assert name not in CASES, name
        CASES[name] = fn
        return fn

    return register


def _source_line(source: str | None, file: str) -> int | None:
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    # a relative path is relative to where the program ran (a script's own directory here)
    candidates = [path] if os.path.isabs(path) else [path, os.path.join(os.path.dirname(file), path)]
    if not path or not any(os.path.exists(c) and os.path.samefile(c, file) for c in candidates):
        return -1
    return int(line)


def verdict(run: Run, want: Want) -> dict[str, bool]:
    """Per-figure verdicts of one case (used by the test and by program_figures.py)."""
    main = [i for i in run.incidents if i.action != "logged"]
    inc = main[0] if main else None
    step_ok = inc is not None and inc.step == want.step and inc.kind == want.kind
    want_line = origin_line(want.tag, want.file) if want.tag else None
    return {
        "alarm": step_ok,
        "op": inc is not None and inc.op == want.op,
        "cause": inc is not None and inc.cause == want.cause,
        "source": inc is not None and _source_line(inc.source, want.file) == want_line,
        "module": inc is not None and inc.module == want.module,
        "phase": inc is not None and inc.phase == want.phase,
        "action": inc is not None and inc.action == want.action,
        "transient": inc is not None and inc.transient is False,
        "protected": bool(run.unchanged) and all(run.unchanged.values()) and (want.step in run.unchanged),
    }


def describe(inc: Any) -> str:
    if inc is None:
        return "no incident"
    return (f"step={inc.step} kind={inc.kind} phase={inc.phase} op={inc.op} module={inc.module!r} "
            f"cause={inc.cause} action={inc.action} source={inc.source}")


def check(run: Run, want: Want) -> Any:
    """Assert the exact diagnosis; returns the incident."""
    main = [i for i in run.incidents if i.action != "logged"]
    assert len(main) == 1, [describe(i) + " | " + i.summary for i in run.incidents] or "no incident"
    inc = main[0]
    assert "localisation_error" not in inc.details, inc.details["localisation_error"]
    got = dict(step=inc.step, kind=inc.kind, phase=inc.phase, op=inc.op, module=inc.module, cause=inc.cause,
               action=inc.action)
    exp = dict(step=want.step, kind=want.kind, phase=want.phase, op=want.op, module=want.module, cause=want.cause,
               action=want.action)
    assert got == exp, f"{describe(inc)}\n  summary: {inc.summary}"
    if want.tag is None:
        assert inc.source is None, inc.source
    else:
        assert _source_line(inc.source, want.file) == origin_line(want.tag, want.file), (
            f"{inc.source} is not the '# <origin:{want.tag}>' line {origin_line(want.tag, want.file)} of {want.file}")
    assert inc.summary and inc.fix
    # every program here fails deterministically: an identical re-run of the step reproduces it
    assert inc.transient is False, f"transient={inc.transient}: {inc.summary}"
    # the blocked step did not change the weights
    assert run.unchanged.get(want.step) is True, run.unchanged
    return inc


# ==================================================================================
# 1. A conditional VAE (Kingma & Welling, with a conditioning vector). The conditioning
#    features are raw (unnormalised); one batch carries an outlier that drives the
#    encoder's log-variance head to ~100.
# ==================================================================================
class CVAE(nn.Module):
    def __init__(self, x_dim: int = 16, c_dim: int = 3, hidden: int = 32, z_dim: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(x_dim + c_dim, hidden), nn.ReLU())
        self.fc_mu = nn.Linear(hidden, z_dim)
        self.fc_logvar = nn.Linear(hidden, z_dim)
        self.decoder = nn.Sequential(nn.Linear(z_dim, hidden), nn.ReLU(), nn.Linear(hidden, x_dim))

    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)  # <origin:vae_std>
        eps = torch.randn_like(std)
        return mu + eps * std

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.encoder(torch.cat([x, c], dim=1))
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        z = self.reparameterize(mu, logvar)
        return torch.sigmoid(self.decoder(z)), mu, logvar


def vae_loss(recon_x: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    bce = F.binary_cross_entropy(recon_x, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())  # <origin:vae_kl>
    return (bce + kld) / x.size(0)


def _vae_batches(outlier: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x = torch.rand(8, 16, generator=g)  # pixels in [0, 1]
        c = torch.rand(8, 3, generator=g)
        if step == FAIL_STEP:
            c[2] = outlier  # a record whose metadata was never normalised
        out.append((x, c))
    return out


def _vae_run(outlier: float, **kw: Any) -> Run:
    torch.manual_seed(0)
    model = CVAE()
    with torch.no_grad():  # a checkpoint whose log-variance head leans on the conditioning features
        model.fc_logvar.weight.abs_()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x, c = batch
        recon, mu, logvar = m(x, c)
        return vae_loss(recon, x, mu, logvar)

    return train(model, optimizer, _vae_batches(outlier), step_loss, **kw)


VAE_KL_OUTLIER = 450.0     # logvar ~ 100-150: exp(logvar) overflows float32, exp(0.5 logvar) does not
VAE_STD_OUTLIER = 1000.0    # logvar > 178: even the reparameterisation's exp(0.5 logvar) overflows


@case("vae_kl_logvar_exp_overflow")
def _vae_kl(tmp: Path) -> tuple[Run, Want]:
    return _vae_run(VAE_KL_OUTLIER), Want("nonfinite_loss", "forward", "aten.exp.default", None, "vae_kl", "exp_overflow")


@case("vae_decoder_bce_receives_nan")
def _vae_bce(tmp: Path) -> tuple[Run, Want]:
    # std = inf -> z = +-inf -> the decoder's Linear makes inf - inf = NaN -> sigmoid(NaN) -> BCE raises
    return _vae_run(VAE_STD_OUTLIER), Want("exception", "forward", "aten.exp.default", "", "vae_std", "exp_overflow",
                                          action="raised")


# ==================================================================================
# 2. A small GPT (nanoGPT-shaped): token + position embeddings, pre-LN blocks with causal
#    self-attention (masked_fill(-inf) + softmax) and a GELU MLP, final LayerNorm, head
#    tied to the token embedding.
# ==================================================================================
VOCAB, BLOCK, D_MODEL, N_HEAD = 32, 8, 16, 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.c_proj = nn.Linear(D_MODEL, D_MODEL)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(D_MODEL, dim=2)
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        allowed = self.bias[:, :, :T, :T]
        if attention_mask is not None:  # key padding: 1 = real token, 0 = padding
            allowed = allowed & attention_mask[:, None, None, :].bool()
        att = att.masked_fill(~allowed, float("-inf"))
        att = F.softmax(att, dim=-1)  # <origin:gpt_softmax>
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D_MODEL)
        self.wpe = nn.Embedding(BLOCK, D_MODEL)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # <origin:gpt_wte>
        for block in self.h:
            x = block(x, attention_mask)
        return self.lm_head(self.ln_f(x))


def _tokens(g: torch.Generator, b: int = 4) -> torch.Tensor:
    return torch.randint(1, VOCAB - 2, (b, BLOCK + 1), generator=g)


def _gpt(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


# (a) a hand-written cross-entropy with a naive log-sum-exp (no max subtracted)
SEPARATOR = VOCAB - 1  # "=" : markdown rules are long runs of it


def naive_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    log_z = torch.log(torch.exp(logits).sum(dim=-1, keepdim=True))  # <origin:gpt_naive_lse>
    log_probs = logits - log_z
    return -log_probs.gather(-1, targets[..., None]).mean()


@case("gpt_handwritten_cross_entropy_overflow")
def _gpt_naive(tmp: Path) -> tuple[Run, Want]:
    model, optimizer = _gpt()
    with torch.no_grad():  # a pretrained checkpoint: the separator's embedding has grown large
        model.wte.weight[SEPARATOR] = torch.linspace(-1.0, 1.0, D_MODEL) * 12.0
    g = torch.Generator().manual_seed(2)
    batches = []
    for step in range(STEPS):
        seq = _tokens(g)
        if step == FAIL_STEP:
            seq[1, :] = SEPARATOR  # a document with a long "==========" rule
        batches.append(seq)

    def step_loss(m: nn.Module, seq: torch.Tensor, step: int) -> torch.Tensor:
        x, y = seq[:, :-1], seq[:, 1:]
        logits = m(x)
        return naive_cross_entropy(logits.view(-1, VOCAB), y.reshape(-1))

    return train(model, optimizer, batches, step_loss), Want("nonfinite_loss", "forward", "aten.exp.default", None,
                                                             "gpt_naive_lse", "exp_overflow")


# (b) labels outside the vocabulary: an EOS id appended by a tokenizer whose vocabulary is larger
def gpt_lm_loss(model: nn.Module, seq: torch.Tensor) -> torch.Tensor:
    x, y = seq[:, :-1], seq[:, 1:]
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))  # <origin:gpt_ce>


@case("gpt_label_out_of_vocabulary")
def _gpt_label(tmp: Path) -> tuple[Run, Want]:
    model, optimizer = _gpt()
    g = torch.Generator().manual_seed(3)
    batches = []
    for step in range(STEPS):
        seq = _tokens(g)
        if step == FAIL_STEP:
            seq[2, -1] = VOCAB  # the new tokenizer's <|endoftext|> id, one past the model's vocabulary
        batches.append(seq)
    return (train(model, optimizer, batches, lambda m, s, i: gpt_lm_loss(m, s)),
            Want("exception", "forward", "aten.nll_loss_forward.default", None, "gpt_ce", "label_out_of_range",
                 action="raised"))


@case("gpt_input_token_out_of_vocabulary")
def _gpt_input(tmp: Path) -> tuple[Run, Want]:
    model, optimizer = _gpt()
    g = torch.Generator().manual_seed(4)
    batches = []
    for step in range(STEPS):
        seq = _tokens(g)
        if step == FAIL_STEP:
            seq[0, 3] = VOCAB + 5  # an id from a bigger tokenizer, now an *input* token
        batches.append(seq)
    return (train(model, optimizer, batches, lambda m, s, i: gpt_lm_loss(m, s)),
            Want("exception", "forward", "aten.embedding.default", "wte", "gpt_wte", "label_out_of_range",
                 action="raised"))


# (c) a fully masked attention row: left padding + causal mask
@case("gpt_fully_masked_attention_row")
def _gpt_masked(tmp: Path) -> tuple[Run, Want]:
    model, optimizer = _gpt()
    g = torch.Generator().manual_seed(5)
    batches = []
    for step in range(STEPS):
        seq = _tokens(g)
        mask = torch.ones_like(seq)
        mask[:, -1] = 0  # right padding: every query still sees the real tokens before it
        if step == FAIL_STEP:
            mask[1] = 1
            mask[1, :2] = 0  # a left-padded sample: query 0 may only look at key 0, a pad
        batches.append((seq, mask))

    def step_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        seq, mask = batch
        x, y, am = seq[:, :-1], seq[:, 1:].clone(), mask[:, :-1]
        y[mask[:, 1:] == 0] = -100
        logits = m(x, attention_mask=am)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)

    return train(model, optimizer, batches, step_loss), Want("nonfinite_loss", "forward", "aten._softmax.default",
                                                             "h.0.attn", "gpt_softmax", "masked_softmax_all")


# ==================================================================================
# 3. Hand-written losses on a classifier: a sigmoid focal loss (RetinaNet) and a
#    label-smoothed cross-entropy, each taking log of a probability that underflows.
# ==================================================================================
class Classifier(nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 32, classes: int = 5) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def sigmoid_focal_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float = 0.25, gamma: float = 2.0) -> torch.Tensor:
    p = torch.sigmoid(logits)
    p_t = p * targets + (1 - p) * (1 - targets)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    loss = -alpha_t * (1 - p_t) ** gamma * torch.log(p_t)  # <origin:focal_log>
    return loss.sum() / targets.sum().clamp(min=1.0)


def label_smoothed_ce(logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    n = logits.size(-1)
    probs = F.softmax(logits, dim=-1)
    log_probs = torch.log(probs)  # <origin:smooth_log>
    true_dist = torch.full_like(log_probs, smoothing / (n - 1))
    true_dist.scatter_(1, target[:, None], 1.0 - smoothing)
    return torch.mean(torch.sum(-true_dist * log_probs, dim=-1))


def _classification(seed: int, outlier_scale: float, multilabel: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        x = torch.randn(8, 12, generator=g)
        if step == FAIL_STEP:
            x[4] *= outlier_scale  # a sample recorded in different units
        if multilabel:
            y = (torch.rand(8, 5, generator=g) < 0.3).float()
        else:
            y = torch.randint(0, 5, (8,), generator=g)
        out.append((x, y))
    return out


@case("focal_loss_log_of_saturated_sigmoid")
def _focal(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    batches = _classification(6, 2000.0, multilabel=True)
    return (train(model, optimizer, batches, lambda m, b, i: sigmoid_focal_loss(m(b[0]), b[1])),
            Want("nonfinite_loss", "forward", "aten.log.default", None, "focal_log", "log_nonpositive"))


@case("label_smoothing_log_of_underflowed_softmax")
def _smooth(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    batches = _classification(7, 2000.0, multilabel=False)
    return (train(model, optimizer, batches, lambda m, b, i: label_smoothed_ce(m(b[0]), b[1])),
            Want("nonfinite_loss", "forward", "aten.log.default", None, "smooth_log", "log_nonpositive"))


# ==================================================================================
# 4. Diffusion: a denoising-score-matching loss on the DDPM schedule. The linear beta
#    schedule starts at 0 (meant: 1e-4), so alpha_bar[0] == 1 and sigma_0 = sqrt(1 - 1) = 0.
# ==================================================================================
T_STEPS = 50


class ScoreNet(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.t_embed = nn.Embedding(T_STEPS, hidden)
        self.inp = nn.Linear(d, hidden)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, d))

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x_t) + self.t_embed(t))


@case("diffusion_dsm_target_divides_by_zero_sigma")
def _diffusion(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    model = ScoreNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
    betas = torch.linspace(0.0, 0.02, T_STEPS)  # should start at 1e-4
    alpha_bar = torch.cumprod(1.0 - betas, dim=0)
    g = torch.Generator().manual_seed(8)
    batches = []
    for step in range(STEPS):
        x0 = torch.randn(16, 8, generator=g)
        t = torch.randint(1, T_STEPS, (16,), generator=g)
        if step == FAIL_STEP:
            t[5] = 0  # the sampler reaches the first timestep
        batches.append((x0, t))

    def step_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        x0, t = batch
        noise = torch.randn_like(x0)
        a = alpha_bar[t][:, None]
        sigma = (1.0 - a).sqrt()
        x_t = a.sqrt() * x0 + sigma * noise
        score = m(x_t, t)
        target = -noise / sigma  # <origin:dsm_target>
        return (sigma**2 * (score - target) ** 2).sum(-1).mean()  # lambda(t) = sigma_t^2 weighting

    return train(model, optimizer, batches, step_loss), Want("nonfinite_loss", "forward", "aten.div.Tensor", None,
                                                             "dsm_target", "div_by_zero")


# ==================================================================================
# 5. RL policy gradient: a Boltzmann (softmax-over-Q) policy written by hand, sampled with
#    torch.distributions.Categorical; and REINFORCE sampling with torch.multinomial under an
#    annealed temperature.
# ==================================================================================
class BoltzmannPolicy(nn.Module):
    def __init__(self, obs_dim: int = 6, actions: int = 4, tau: float = 0.05) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, actions))
        self.tau = tau

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        q = self.q(obs)
        w = torch.exp(q / self.tau)  # <origin:boltzmann_exp>
        return w / w.sum(dim=-1, keepdim=True)


def _rl_batches(seed: int, big_reward_step: int | None = FAIL_STEP) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        obs = torch.randn(8, 6, generator=g)
        if step == big_reward_step:
            obs[3] *= 80.0  # an environment whose observation is not clipped
        out.append((obs, torch.randn(8, generator=g)))
    return out


def policy_gradient_step(policy: nn.Module, batch: Any, step: int) -> torch.Tensor:
    obs, advantage = batch
    probs = policy(obs)
    dist = torch.distributions.Categorical(probs=probs)
    actions = dist.sample()
    return -(dist.log_prob(actions) * advantage).mean()


def _rl_policy(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    policy = BoltzmannPolicy()
    return policy, torch.optim.Adam(policy.parameters(), lr=3e-4)


@case("rl_categorical_on_nan_probs_with_guard")
def _rl_categorical(tmp: Path) -> tuple[Run, Want]:
    policy, optimizer = _rl_policy()
    run = train(policy, optimizer, _rl_batches(9), policy_gradient_step, with_block=True)
    return run, Want("exception", "forward", "aten.exp.default", "", "boltzmann_exp", "exp_overflow", action="raised")


class LogitPolicy(nn.Module):
    def __init__(self, obs_dim: int = 6, actions: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, 32), nn.Tanh(), nn.Linear(32, actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.body(obs)


def annealed_temperature(step: int, start: float = 1.0, steps_to_zero: int = FAIL_STEP) -> float:
    return max(0.0, start * (1.0 - step / steps_to_zero))  # meant: a floor such as 0.05


@case("rl_multinomial_on_nan_probs")
def _rl_multinomial(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    policy = LogitPolicy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)

    def reinforce(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
        obs, advantage = batch
        logits = m(obs)
        probs = F.softmax(logits / annealed_temperature(step), dim=-1)  # <origin:anneal_div>
        actions = torch.multinomial(probs, 1).squeeze(1)
        logp = torch.log(probs.gather(1, actions[:, None]).squeeze(1))
        return -(logp * advantage).mean()

    return (train(policy, optimizer, _rl_batches(10, big_reward_step=None), reinforce),
            Want("exception", "forward", "aten.div.Tensor", None, "anneal_div", "div_by_zero", action="raised"))


# PPO: the rollout re-evaluates the policy under no_grad (a second forward per step), the
# update takes exp(new_logp - old_logp) without clamping the log-ratio. One stored action was
# taken by an exploration override while the old policy gave it log-probability ~ -150.
@case("ppo_ratio_exp_overflow_two_forwards")
def _ppo(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    policy = LogitPolicy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(13)
    batches = []
    for step in range(STEPS):
        obs = torch.randn(8, 6, generator=g)
        actions = torch.randint(0, 4, (8,), generator=g)
        old_logp = -torch.rand(8, generator=g) * 2.0
        advantages = torch.randn(8, generator=g)
        if step == FAIL_STEP:
            old_logp[6], advantages[6] = -150.0, -1.0
        batches.append((obs, actions, old_logp, advantages))

    def ppo_loss(m: nn.Module, batch: Any, step: int, clip: float = 0.2) -> torch.Tensor:
        obs, actions, old_logp, advantages = batch
        with torch.no_grad():  # value of the rollout's entropy for the logs, as PPO code does
            entropy = torch.distributions.Categorical(logits=m(obs)).entropy().mean()
        logp = F.log_softmax(m(obs), dim=-1).gather(1, actions[:, None]).squeeze(1)
        ratio = torch.exp(logp - old_logp)  # <origin:ppo_ratio>
        surr1 = ratio * advantages
        surr2 = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
        return -torch.min(surr1, surr2).mean() - 0.0 * entropy

    return train(policy, optimizer, batches, ppo_loss), Want("nonfinite_loss", "forward", "aten.exp.default", None,
                                                             "ppo_ratio", "exp_overflow")


# ==================================================================================
# 5b. Gaussian-process regression: the exact marginal likelihood with a Cholesky of the
#     kernel matrix. The noise is parametrised as exp(log_noise) with a tiny init; a batch
#     with duplicated inputs makes K singular.
# ==================================================================================
class RBFKernelGP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_lengthscale = nn.Parameter(torch.tensor(0.0))
        self.log_outputscale = nn.Parameter(torch.tensor(0.0))
        self.log_noise = nn.Parameter(torch.tensor(-30.0))  # meant: a GreaterThan(1e-4) constraint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d2 = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
        k = self.log_outputscale.exp() * torch.exp(-0.5 * d2 / self.log_lengthscale.exp() ** 2)
        return k + self.log_noise.exp() * torch.eye(x.size(0))


def gp_nll(k: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    chol = torch.linalg.cholesky(k)  # <origin:gp_cholesky>
    alpha = torch.cholesky_solve(y[:, None], chol)
    return 0.5 * (y[None, :] @ alpha).squeeze() + torch.log(torch.diagonal(chol)).sum()


@case("gp_cholesky_of_singular_kernel")
def _gp(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    model = RBFKernelGP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(14)
    batches = []
    for step in range(STEPS):
        x = torch.rand(12, 2, generator=g) * 4
        if step == FAIL_STEP:
            x[5:8] = x[4]  # the same site measured four times
        batches.append((x, torch.sin(x).sum(-1)))
    return (train(model, optimizer, batches, lambda m, b, i: gp_nll(m(b[0]), b[1])),
            Want("exception", "forward", "aten.linalg_cholesky_ex.default", None, "gp_cholesky", "domain_error",
                 action="raised"))


# ==================================================================================
# 5c. WGAN-GP: the critic's gradient penalty is computed in the loss code with
#     torch.autograd.grad(create_graph=True); a ReLU critic is flat (gradient exactly 0) at
#     interpolates far outside the data, and the hand-written norm sqrt(sum(g**2)) has an
#     infinite derivative at 0.
# ==================================================================================
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad():
            self.net[0].bias.fill_(-1.0)  # units inactive around 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def wgan_gp_critic_loss(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor,
                        lambda_gp: float = 10.0) -> torch.Tensor:
    interp = (eps * real + (1 - eps) * fake).requires_grad_(True)
    out = critic(interp)
    grads = torch.autograd.grad(out.sum(), interp, create_graph=True)[0]
    grad_norm = torch.sqrt(torch.sum(grads**2, dim=1))  # <origin:gp_norm>
    penalty = ((grad_norm - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + lambda_gp * penalty


@case("wgan_gp_gradient_norm_at_zero")
def _wgan(tmp: Path) -> tuple[Run, Want]:
    torch.manual_seed(0)
    critic = Critic()
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    g = torch.Generator().manual_seed(15)
    batches = []
    for step in range(STEPS):
        real = torch.randn(8, 4, generator=g) + 3.0
        fake = torch.randn(8, 4, generator=g) + 3.0
        eps = torch.rand(8, 1, generator=g)
        if step == FAIL_STEP:
            fake[2], eps[2] = 0.0, 0.0  # a collapsed generator sample at the origin, eps = 0
        batches.append((real, fake, eps))
    return (train(critic, optimizer, batches, lambda m, b, i: wgan_gp_critic_loss(m, *b)),
            Want("nonfinite_grad", "backward", "aten.sqrt.default", None, "gp_norm", "grad_singularity"))


# ==================================================================================
# 6. Unrelated exceptions: no incident, the exception exactly as without nantrace.
# ==================================================================================
def _unrelated(step_loss: Callable, *, with_block: bool = False, gpt: bool = False, **kw: Any) -> tuple[Run, None]:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        if gpt:
            model, optimizer = _gpt()
            g = torch.Generator().manual_seed(11)
            return model, optimizer, [_tokens(g) for _ in range(STEPS)]
        torch.manual_seed(0)
        model = Classifier()
        return model, torch.optim.SGD(model.parameters(), lr=1e-2), _classification(12, 1.0, multilabel=False)

    return train(*build(), step_loss, with_block=with_block, **kw), None


def _shape_mismatch_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    logits = m(x)
    onehot = F.one_hot(y, 5).float()
    if step == FAIL_STEP:
        # the class count written by hand, the model has 5: a shape error. (``F.one_hot(y, 4)`` of labels up to 4 is
        # a label outside [0, num_classes) instead, an incident by the contract: tests/test_index_errors.py.)
        onehot = onehot[:, :4]
    return ((logits.softmax(-1) - onehot) ** 2).sum(-1).mean()  # Brier score


def _gpt_shape_loss(m: nn.Module, seq: torch.Tensor, step: int) -> torch.Tensor:
    logits = m(seq[:, :-1])
    targets = seq[:, 1:] if step != FAIL_STEP else seq  # forgot to shift this time
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _key_error_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    metrics = {"ce": F.cross_entropy(m(x), y)}
    if step == FAIL_STEP:
        return metrics["loss"]
    return metrics["ce"]


def _tuple_index_loss(m: nn.Module, batch: Any, step: int) -> torch.Tensor:
    x, y = batch
    logits = m(x)
    weights = batch[2] if step == FAIL_STEP else None  # the sample weights this collate never returns
    return F.cross_entropy(logits, y, weight=weights)


UNRELATED = {
    "unrelated_shape_mismatch_in_loss": lambda tmp: _unrelated(_shape_mismatch_loss),
    "unrelated_shape_mismatch_in_gpt_loss_with_masks": lambda tmp: _unrelated(_gpt_shape_loss, gpt=True),
    "unrelated_key_error_with_guard": lambda tmp: _unrelated(_key_error_loss, with_block=True),
    "unrelated_tuple_index_error_with_guard": lambda tmp: _unrelated(_tuple_index_loss, with_block=True),
}
for _name, _fn in UNRELATED.items():
    case(_name)(_fn)


# ==================================================================================
# 7. Hugging Face Trainer with its own compute_loss (the loss is outside the model).
# ==================================================================================
HF_BATCH, HF_ACCUMULATE = 4, 2


def _hf_case(tmp: Path, on_anomaly: str = "skip") -> tuple[Run, Want]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from nantrace.integrations.hf import NanTraceCallback

    class Tokens(torch.utils.data.Dataset):
        """Token ids with a per-token loss mask (prompt tokens 0, answer tokens 1); the samples of
        the second micro-batch of optimizer step FAIL_STEP are prompts with no answer."""

        def __len__(self) -> int:
            return HF_BATCH * HF_ACCUMULATE * STEPS

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 64, (16,), generator=g)
            loss_mask = torch.zeros(16)
            first_bad = HF_BATCH * (HF_ACCUMULATE * FAIL_STEP + 1)
            if not first_bad <= i < first_bad + HF_BATCH:
                loss_mask[8:] = 1.0
            return {"input_ids": ids, "loss_mask": loss_mask}

    class WeightedLMTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss_mask = inputs.pop("loss_mask")
            outputs = model(input_ids=inputs["input_ids"])
            logits = outputs.logits[:, :-1]
            labels = inputs["input_ids"][:, 1:]
            mask = loss_mask[:, 1:]
            per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
            loss = (per_token * mask.reshape(-1)).sum() / mask.sum()  # <origin:hf_masked_mean>
            return (loss, outputs) if return_outputs else loss

    class ParamRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.after: list[list[torch.Tensor]] = []

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.after.append(_params(model))

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=HF_BATCH,
        gradient_accumulation_steps=HF_ACCUMULATE, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        disable_tqdm=True, train_sampling_strategy="sequential", learning_rate=1e-3, remove_unused_columns=False,
    )
    cb = NanTraceCallback(on_anomaly=on_anomaly, config=quiet())
    recorder = ParamRecorder()
    trainer = WeightedLMTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb, recorder])
    run = Run([], {})
    try:
        trainer.train()
    except Exception as exc:
        run.error = exc
    finally:
        cb.close()
    run.incidents = list(cb.incidents)
    run.steps_run = len(recorder.after)
    if len(recorder.after) > FAIL_STEP:
        run.unchanged[FAIL_STEP] = _same(recorder.after[FAIL_STEP], recorder.after[FAIL_STEP - 1])
    return run, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "hf_masked_mean", "div_by_zero")


case("hf_trainer_custom_compute_loss_masked_mean")(_hf_case)


# ==================================================================================
# 8. Lightning: a heteroscedastic regressor whose Gaussian NLL is written in training_step.
# ==================================================================================
def _lightning_case(tmp: Path) -> tuple[Run, Want]:
    pytest.importorskip("lightning")
    import lightning as L

    from nantrace.integrations.lightning import NanTraceCallback

    class Regression(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8 * STEPS

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(6, generator=g), torch.randn((), generator=g)
            if i == 8 * FAIL_STEP + 5:
                x = x * 500.0  # a reading from a sensor that reports in different units
            return x, y

    class HeteroscedasticRegressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
            self.mean = nn.Linear(32, 1)
            self.log_var = nn.Linear(32, 1)
            with torch.no_grad():
                self.log_var.weight.copy_(-self.log_var.weight.abs())

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.body(x)
            return self.mean(h).squeeze(-1), self.log_var(h).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            mu, log_var = self(x)
            nll = 0.5 * (log_var + (y - mu) ** 2 / torch.exp(log_var))  # <origin:gauss_nll>
            loss = nll.mean()
            self.log("train_nll", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class ParamRecorder(L.Callback):
        def __init__(self) -> None:
            self.after: list[tuple[int, list[torch.Tensor]]] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.after.append((trainer.global_step, _params(pl_module)))

    model = HeteroscedasticRegressor()
    cb = NanTraceCallback(config=quiet())
    recorder = ParamRecorder()
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, recorder])
    run = Run([], {})
    try:
        trainer.fit(model, torch.utils.data.DataLoader(Regression(), batch_size=8))
    except Exception as exc:
        run.error = exc
    run.incidents = list(cb.incidents)
    run.steps_run = trainer.global_step
    at = {s: p for s, p in recorder.after}
    if FAIL_STEP + 1 in at and FAIL_STEP in at:
        run.unchanged[FAIL_STEP] = _same(at[FAIL_STEP + 1], at[FAIL_STEP])
    return run, Want("nonfinite_loss", "forward", "aten.div.Tensor", None, "gauss_nll", "div_by_zero")


case("lightning_training_step_gaussian_nll")(_lightning_case)


# ==================================================================================
# 9. Scripts that crash: the uncaught exception, python's traceback, then the diagnosis.
# ==================================================================================
SCRIPT = '''\
import sys
import torch
from torch import nn
{watch_import}

class BoltzmannPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, obs):
        q = self.q(obs)
        w = torch.exp(q / 0.05)  # <origin:script_exp>
        return w / w.sum(dim=-1, keepdim=True)

torch.manual_seed(0)
torch.set_num_threads(1)
policy = BoltzmannPolicy()
optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
{watch_line}
g = torch.Generator().manual_seed(9)
for step in range(5):
    obs = torch.randn(8, 6, generator=g)
    advantage = torch.randn(8, generator=g)
    if step == 3:
        obs[3] *= 80.0
    optimizer.zero_grad()
    dist = torch.distributions.Categorical(probs=policy(obs))
    actions = dist.sample()
    loss = -(dist.log_prob(actions) * advantage).mean()
    loss.backward()
    optimizer.step()
    print(f"step {{step}} loss {{loss.item():.3f}}", flush=True)
'''


def _write_script(tmp: Path, watched: bool) -> Path:
    path = tmp / ("train_watched.py" if watched else "train.py")
    path.write_text(SCRIPT.format(
        watch_import="import nantrace" if watched else "",
        watch_line=f"guard = nantrace.watch(policy, optimizer, run_dir={str(tmp / 'run')!r})" if watched else ""))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(nantrace.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["COLUMNS"] = "160"
    return env


def _script_result(cmd: list[str], tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=120)


_PLAIN: list[subprocess.CompletedProcess] = []


def _plain_script_result() -> subprocess.CompletedProcess:
    """The bare script (no nantrace), run once per session."""
    if not _PLAIN:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            _PLAIN.append(_script_result([sys.executable, str(_write_script(Path(tmp), watched=False))], Path(tmp)))
    return _PLAIN[0]


def _script_case(tmp: Path, under_run: bool) -> tuple[Run, Want, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    from nantrace.storage.runstore import RunStore

    plain = _plain_script_result()
    if under_run:
        script = _write_script(tmp, watched=False)
        proc = _script_result([sys.executable, "-m", "nantrace.cli.main", "run", "--run-dir", str(tmp / "run"),
                               str(script)], tmp)
    else:
        script = _write_script(tmp, watched=True)
        proc = _script_result([sys.executable, str(script)], tmp)
    incidents = RunStore(tmp / "run", readonly=True).incidents() if (tmp / "run").exists() else []
    run = Run(incidents, {FAIL_STEP: True})  # the script died before any update of that step
    return run, Want("exception", "forward", "aten.exp.default", "", "script_exp", "exp_overflow", action="raised",
                     file=str(script)), plain, proc


case("script_uncaught_categorical_excepthook")(lambda tmp: _script_case(tmp, under_run=False)[:2])
case("script_uncaught_categorical_nantrace_run")(lambda tmp: _script_case(tmp, under_run=True)[:2])


# ============================================================================ the tests
DIAGNOSED = [n for n in CASES if not n.startswith(("unrelated_", "script_", "hf_", "lightning_"))]


def _baseline_error(name: str, tmp: Path) -> BaseException | None:
    """The exception the same program raises without nantrace."""
    fn = CASES[name]
    real_watch = nantrace.watch

    class _NoGuard:  # nantrace.watch replaced by nothing: the bare program
        incidents: list[Any] = []

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

        def close(self):
            return None

    nantrace.watch = lambda *a, **k: _NoGuard()  # type: ignore[assignment]
    try:
        run, _ = fn(tmp)
    finally:
        nantrace.watch = real_watch  # type: ignore[assignment]
    return run.error


@pytest.mark.parametrize("name", DIAGNOSED)
def test_program_diagnosis(name: str, tmp_path: Path) -> None:
    run, want = CASES[name](tmp_path)
    assert want is not None
    if want.kind == "exception":
        baseline = _baseline_error(name, tmp_path / "bare")
        assert baseline is not None, "the program does not fail without nantrace"
        assert run.error is not None and run.error_step == want.step, (run.error, run.error_step)
        assert type(run.error) is type(baseline) and str(run.error) == str(baseline), (run.error, baseline)
        assert not isinstance(run.error, nantrace.NonFiniteError)
    else:
        assert run.error is None, repr(run.error)
        assert run.steps_run == STEPS  # the skipped step did not stop training
    inc = check(run, want)
    if inc.op is not None:
        assert inc.input_stats, "no statistics of the origin op's inputs"
    if want.kind == "exception":
        assert inc.details.get("exception", "").startswith(type(run.error).__name__), inc.details.get("exception")


@pytest.mark.parametrize("name", list(UNRELATED))
def test_unrelated_exception_is_not_an_incident(name: str, tmp_path: Path) -> None:
    run, _ = CASES[name](tmp_path)
    baseline = _baseline_error(name, tmp_path / "bare")
    assert baseline is not None and run.error is not None
    assert type(run.error) is type(baseline) and str(run.error) == str(baseline), (run.error, baseline)
    assert run.error_step == FAIL_STEP
    assert run.incidents == [], [describe(i) + " | " + i.summary for i in run.incidents]


def test_hf_trainer_custom_compute_loss(tmp_path: Path) -> None:
    run, want = _hf_case(tmp_path)
    assert run.error is None, repr(run.error)
    assert run.steps_run == STEPS
    check(run, want)


def test_lightning_training_step_loss(tmp_path: Path) -> None:
    run, want = _lightning_case(tmp_path)
    assert run.error is None, repr(run.error)
    assert run.steps_run == STEPS
    check(run, want)


@pytest.mark.parametrize("under_run", [False, True], ids=["excepthook", "nantrace-run"])
def test_crashing_script_prints_traceback_then_diagnosis(under_run: bool, tmp_path: Path) -> None:
    run, want, plain, proc = _script_case(tmp_path, under_run)
    # the bare script dies at step 3 with Categorical's validation error
    assert plain.returncode == 1 and "ValueError: Expected parameter probs" in plain.stderr, plain.stderr[-2000:]
    assert proc.returncode == plain.returncode, (proc.returncode, proc.stderr[-3000:])
    assert "step 2 loss" in proc.stdout and "step 3 loss" not in proc.stdout
    err = proc.stderr
    # Python's report of the exception, unchanged ...
    plain_last = plain.stderr.strip().splitlines()[-1]
    assert "Traceback (most recent call last)" in err and plain_last in err, err[-3000:]
    # ... ending in the user's frames (no nantrace frame in the traceback) ...
    tb = err[err.index("Traceback (most recent call last)"):err.index(plain_last)]
    assert "nantrace" not in tb.replace(str(tmp_path), ""), tb
    # ... then the diagnosis, after it
    after = err[err.index(plain_last) + len(plain_last):]
    assert "exception" in after and "step 3" in after, f"no diagnosis after the traceback:\n{err[-3000:]}"
    check(run, want)


def test_every_case_is_zero_intrusive() -> None:
    assert "replayable" not in Path(__file__).read_text().replace("no ``guard.replayable``", "").replace(
        "no `guard.replayable`", "").split("# ============================================================================ the tests")[0]
