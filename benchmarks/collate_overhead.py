"""Cost of ValidatingCollate over torch's default_collate on realistic batches.

Usage::

    .venv/bin/python benchmarks/collate_overhead.py [--repeats 30] [--threads N] [--device cpu|cuda]

Prints the median wall time of `default_collate(samples)` and of
`ValidatingCollate(...)(samples)` (collate + validation) for a text batch of
64 x 512 int64 tokens with attention mask and labels, and an image batch of
64 x 3 x 224 x 224 float32 with class labels. With ``--device cuda`` the samples live
on the GPU (as after a GPU-side decode) so the single host transfer per tensor is paid.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from nantrace.data import ValidatingCollate, validate_batch


def text_samples(n: int, seq: int, vocab: int, device: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: seq // 4] = -100  # prompt positions are not supervised
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones(seq, dtype=torch.long, device=device),
                    "labels": labels.to(device)})
    return out


def image_samples(n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, 224, 224, generator=g).to(device), torch.tensor(i % 1000, device=device))
            for i in range(n)]


def paired_medians(base: Callable[[], Any], checked: Callable[[], Any], repeats: int,
                   sync: Callable[[], None]) -> tuple[float, float]:
    """Median ms of each, timed alternately so that machine load drifts hit both alike."""
    for _ in range(3):  # warm-up (allocator, lazy init)
        base()
        checked()
    sync()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((base, times[0]), (checked, times[1])):
            t0 = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def tiny_gpt_step_ms(steps: int) -> float:
    """Median ms of a tiny-GPT AdamW training step (benchmarks/models.py), the yardstick of the figure."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import CASES

    case = CASES["gpt"]
    model = case.build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = case.batches(4)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        case.loss(model, batches[i % len(batches)]).backward()
        opt.step()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--gpt-steps", type=int, default=12,
                        help="tiny-GPT training steps timed in the same run, to express the overhead as a share "
                             "of one (0: skip)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    cases = {
        "text 64x512 int64 (ids, mask, labels)": (text_samples(64, 512, 32000, args.device),
                                                  ValidatingCollate(num_classes=32000)),
        "images 64x3x224x224 float32 + labels": (image_samples(64, args.device),
                                                 ValidatingCollate(num_classes=1000)),
        "images, stats=False (finiteness, labels)": (image_samples(64, args.device),
                                                     ValidatingCollate(num_classes=1000, stats=False)),
    }
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads, "
          f"median of {args.repeats} runs")
    print(f"{'batch':40s} {'default_collate':>16s} {'ValidatingCollate':>18s} {'overhead':>18s} "
          f"{'validate_batch alone':>21s}")
    gpt_ms = tiny_gpt_step_ms(args.gpt_steps) if args.gpt_steps and args.device == "cpu" else None
    rows = []
    for name, (samples, collate) in cases.items():
        base, checked = paired_medians(lambda: default_collate(samples), lambda: collate(samples),
                                       args.repeats, sync)
        assert collate.skipped_batches == 0 and not collate.issues, collate.issues
        batch = default_collate(samples)
        kwargs = {k: collate.validate_kwargs[k] for k in ("num_classes", "stats")}
        alone = statistics.median(
            _timed(lambda: validate_batch(batch, **kwargs), sync) for _ in range(args.repeats))
        extra = checked - base
        rows.append((name, extra, alone))
        print(f"{name:40s} {base:13.2f} ms {checked:15.2f} ms {extra:8.2f} ms ({100 * extra / base:5.1f}%) "
              f"{alone:18.2f} ms")
    if gpt_ms is not None:
        gpt_after = tiny_gpt_step_ms(args.gpt_steps)
        step = statistics.median([gpt_ms, gpt_after])
        print(f"\ntiny-GPT training step in this run: {gpt_ms:.1f} ms before, {gpt_after:.1f} ms after the batches; "
              f"as a share of {step:.1f} ms:")
        for name, extra, alone in rows:
            print(f"  {name:40s} added {100 * extra / step:5.2f}%   validate_batch alone {100 * alone / step:5.2f}%")


if __name__ == "__main__":
    main()
