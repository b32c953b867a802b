"""Cost of the loss tape (the record of the loss code kept for a zero-intrusive diagnosis).

Times the same loss code with and without the tape recording it, interleaved, on small
tensors so that the per-call cost of the mode is what is measured (not the arithmetic), and
reports it per call and per step for three loss codes of increasing length, next to the
tiny GPT's step measured in the same run.

Usage::

    python benchmarks/tape_cost.py --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from models import CASES  # noqa: E402

from nantrace.loss_tape import LossTape  # noqa: E402


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the tiny GPT's: 3 calls
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def vae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # ~12 calls
    mu, logvar = out.chunk(2, dim=-1)
    recon = F.mse_loss(mu, y.unsqueeze(-1).float().expand_as(mu))
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()
    return recon + kl


def focal(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # ~20 calls, a hand-written loss
    logp = out - out.logsumexp(-1, keepdim=True)
    p = logp.exp()
    onehot = F.one_hot(y.reshape(-1) % out.shape[-1], out.shape[-1]).reshape(p.shape).float()
    pt = (p * onehot).sum(-1)
    lpt = (logp * onehot).sum(-1)
    loss = -((1 - pt) ** 2) * lpt
    mask = (y >= 0).float()
    return (loss * mask).sum() / mask.sum().clamp_min(1)


LOSSES = {"cross_entropy (3 calls)": cross_entropy, "vae (12 calls)": vae, "focal (20 calls)": focal}


def _time(fn, out: torch.Tensor, y: torch.Tensor, tape: LossTape | None, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        if tape is not None:
            tape.resume()
        loss = fn(out, y)
        if tape is not None:
            tape.note_loss(loss)
            tape.pause()
            tape.reset()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    out = torch.randn(2, 4, 8, requires_grad=True)
    y = torch.randint(0, 8, (2, 4))
    tape = LossTape()
    counts = {}
    for name, fn in LOSSES.items():
        tape.resume()
        tape.note_loss(fn(out, y))
        tape.pause()
        counts[name] = len(tape.entries)
        tape.reset()
    rows = {name: ([], []) for name in LOSSES}
    for _ in range(args.rounds):
        for name, fn in LOSSES.items():
            plain, taped = rows[name]
            plain.append(_time(fn, out, y, None, args.repeat))
            taped.append(_time(fn, out, y, tape, args.repeat))
    case = CASES["gpt"]
    model = case.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = case.batches(8)
    steps = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        opt.zero_grad()
        case.loss(model, batch).backward()
        opt.step()
        if i >= 2:
            steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny GPT step median {step * 1e3:.1f} ms")
    print("| loss code | calls taped | added per step (median of rounds) | per call | share of a tiny-GPT step |")
    print("|---|---|---|---|---|")
    for name, (plain, taped) in rows.items():
        added = statistics.median(t - p for t, p in zip(taped, plain))
        print(f"| {name} | {counts[name]} | {added * 1e6:.0f} µs | {added / max(counts[name], 1) * 1e6:.1f} µs | "
              f"{added / step * 100:.2f} % |")


if __name__ == "__main__":
    main()
