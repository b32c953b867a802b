"""Cost of localising one incident, relative to one normal training step, on the tiny GPT.

A genuine overflow is provoked at chosen steps (one attention's qkv weights scaled up, so
q @ k^T overflows float32 and the softmax turns NaN); the guard replays the step under the
op tracer. Reports the median normal step time, the median localisation time, and their ratio.

Usage::

    python benchmarks/localisation_cost.py --incidents 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import CASES  # noqa: E402

import nantrace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--incidents", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=6)
    parser.add_argument("--replayable", action="store_true", help="wrap the loss with guard.replayable")
    args = parser.parse_args()

    case = CASES["gpt"]
    model = case.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False, save_bundle=False,
                                                            episode_gap=2))  # each incident its own episode
    loss_fn = guard.replayable(case.loss) if args.replayable else case.loss
    batches = case.batches(args.incidents * args.steps_between + 4)
    qkv = model.blocks[2].attn.qkv.weight
    step_times: list[float] = []
    localisation: list[float] = []
    diagnoses = set()
    for i, batch in enumerate(batches):
        poison = i >= 4 and (i - 4) % args.steps_between == args.steps_between - 1
        if poison:
            original = qkv.detach().clone()
            with torch.no_grad():
                qkv.mul_(1e21)
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if poison:
            with torch.no_grad():
                qkv.copy_(original)
            incident = guard.incidents[-1]
            localisation.append(incident.details["localisation_seconds"])
            diagnoses.add((incident.op, incident.module, incident.cause))
        elif i >= 2:
            step_times.append(elapsed)
    guard.close()
    step = statistics.median(step_times)
    loc = statistics.median(localisation)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, replayable={args.replayable}")
    print(f"diagnoses: {sorted(diagnoses)}")
    print(f"normal step: median {step * 1e3:.1f} ms over {len(step_times)} steps")
    print(f"localisation: median {loc * 1e3:.1f} ms over {len(localisation)} incidents "
          f"(min {min(localisation) * 1e3:.1f}, max {max(localisation) * 1e3:.1f})")
    print(f"ratio localisation / step: {loc / step:.2f}x")


if __name__ == "__main__":
    main()
