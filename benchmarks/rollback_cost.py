"""Cost of rollback snapshots: ``SnapshotManager.snapshot()`` against one training step.

For each model: the median time of one AdamW training step (zero_grad, forward, loss,
backward, step), of ``snapshot()`` with ``where="memory"`` and ``where="disk"`` (the first
``keep`` snapshots apart: they allocate the buffers that later ones reuse; the very first
is shown), of ``restore()``, the
size of one snapshot, and the amortised cost per step when a snapshot is taken every
``--interval`` steps (snapshot median / interval, as a fraction of the step).

Models: ``gpt`` is the tiny GPT of ``benchmarks/models.py`` (~3.3M parameters);
``gpt25m`` the same architecture with d_model 512 and 8 layers (~25M parameters), same
batches (8 x 128 tokens). Disk snapshots go to ``--dir`` (default: the system temp
directory), with an ``fsync`` each, as in real use.

Usage::

    python benchmarks/rollback_cost.py                       # both models, ~2-4 min on 2 cores
    python benchmarks/rollback_cost.py --models gpt --rounds 5 --json runs/bench/rollback.json

    # prints, per model (figures here are illustrative):
    #  model   params  step ms  where   snapshot ms (first)  restore ms  MB/snapshot  x step  per step @100
    #  gpt     3.3M      190.0  memory          6.1 (  9.0)         5.0         39.6   0.032       0.03%
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
from models import CASES, TinyGPT, num_parameters  # noqa: E402

from nantrace.response.rollback import SnapshotManager  # noqa: E402

MODELS: dict[str, Any] = {
    "gpt": CASES["gpt"].make_model,
    "gpt25m": lambda: TinyGPT(vocab=512, d_model=512, n_layers=8, n_heads=8, max_len=128),
}


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Rounds of: one training step, one snapshot per mode, one restore per mode (interleaved,
    so that machine noise hits the step and the snapshots alike)."""
    case = CASES["gpt"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS[name]().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = [(x.to(device), y.to(device)) for x, y in case.batches(4, seed=1)]
    cursor = 0

    def timed(fn: Any) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    def train_step() -> None:
        nonlocal cursor
        batch = batches[cursor % len(batches)]
        cursor += 1
        optimizer.zero_grad(set_to_none=True)
        case.loss(model, batch).backward()
        optimizer.step()

    for _ in range(2):  # warm-up; also creates AdamW's state, which snapshots include
        train_step()

    tmp = tempfile.TemporaryDirectory(prefix="nantrace-rollback-bench-", dir=args.dir)
    managers = {
        "memory": SnapshotManager(model, optimizer, where="memory", keep=2, interval=args.interval),
        "disk": SnapshotManager(model, optimizer, where="disk", directory=tmp.name, keep=2, interval=args.interval),
    }
    first: dict[str, list[float]] = {w: [] for w in managers}
    for step in range(2):  # the first `keep` snapshots allocate the buffers later ones reuse
        for where, mgr in managers.items():
            first[where].append(timed(functools.partial(mgr.snapshot, step)))
    step_s: list[float] = []
    snap_s: dict[str, list[float]] = {w: [] for w in managers}
    restore_s: dict[str, list[float]] = {w: [] for w in managers}
    for rnd in range(args.rounds):
        step_s.append(timed(train_step))
        for where, mgr in managers.items():
            snap_s[where].append(timed(functools.partial(mgr.snapshot, 2 + rnd)))
        for where, mgr in managers.items():
            restore_s[where].append(timed(mgr.restore))
    result: dict[str, Any] = {
        "model": name,
        "parameters": num_parameters(model),
        "device": str(device),
        "step_ms": median_ms(step_s),
        "step_samples_ms": [s * 1e3 for s in step_s],
        "where": {},
    }
    for where, mgr in managers.items():
        snapshot_ms = median_ms(snap_s[where])
        result["where"][where] = {
            "snapshot_ms": snapshot_ms,
            "first_snapshot_ms": first[where][0] * 1e3,
            "snapshot_samples_ms": [s * 1e3 for s in snap_s[where]],
            "restore_ms": median_ms(restore_s[where]),
            "restore_samples_ms": [s * 1e3 for s in restore_s[where]],
            "bytes_per_snapshot": mgr.nbytes / len(mgr.steps),
            "snapshot_over_step": snapshot_ms / result["step_ms"],
            "amortised_over_step": snapshot_ms / args.interval / result["step_ms"],
        }
        mgr.close()
    tmp.cleanup()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,gpt25m", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--rounds", type=int, default=7,
                        help="rounds per model: one training step, one snapshot and one restore per mode")
    parser.add_argument("--interval", type=int, default=100, help="snapshot interval for the amortised figure")
    parser.add_argument("--dir", default=None, help="parent directory of the disk snapshots (default: system temp)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="write every raw figure here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")

    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "disk_dir": args.dir or tempfile.gettempdir(),
    }
    print(f"torch {env['torch']}, {env['device']}, {env['threads']} threads; disk snapshots in {env['disk_dir']}; "
          f"{args.rounds} rounds, interval {args.interval}; medians")
    header = (f"{'model':7} {'params':>7} {'step ms':>8}  {'where':6} {'snapshot ms':>11} {'(first)':>8} "
              f"{'restore ms':>10} {'MB/snapshot':>11} {'x step':>7} {'per step @' + str(args.interval):>14}")
    print(header)
    results = []
    for name in names:
        r = bench_model(name, args, device)
        results.append(r)
        for where, w in r["where"].items():
            print(f"{name:7} {r['parameters'] / 1e6:6.1f}M {r['step_ms']:8.1f}  {where:6} {w['snapshot_ms']:11.1f} "
                  f"{w['first_snapshot_ms']:8.1f} {w['restore_ms']:10.1f} {w['bytes_per_snapshot'] / 2**20:11.1f} "
                  f"{w['snapshot_over_step']:7.3f} {100 * w['amortised_over_step']:13.2f}%")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"env": env, "interval": args.interval, "results": results}, indent=2))
        print(f"raw figures: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
