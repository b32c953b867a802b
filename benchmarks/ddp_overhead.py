"""Step-time overhead of nantrace on DistributedDataParallel: two gloo processes on the CPU.

Each launch is a real ``torchrun --nproc-per-node 2`` job: both ranks build the same model
(identical weights), wrap it in DDP, train it with AdamW on their own synthetic batches and
time every step on rank 0 (the all-reduce makes the ranks move in lockstep). Two variants:

- ``plain``     DDP as is: zero_grad, forward, loss, backward (with the all-reduce), step
- ``nantrace``  the same loop under ``nantrace.watch(ddp_model, optimizer)`` with defaults:
                the comm hook checking local gradients before the all-reduce, the fused
                check, and the one small all-reduce per step that makes every rank agree

A DDP comm hook cannot be removed once registered, so the variants cannot share a process:
launches alternate instead (plain, nantrace, nantrace, plain, ...), round after round, and
ratios are taken per round and over all steps. Each rank uses one thread, so the two
processes fit two cores without oversubscription. The final weights of the two variants
are compared: the guard must not change training.

Usage::

    python benchmarks/ddp_overhead.py                       # tiny GPT, 8 rounds, ~6 min on 2 idle cores
    python benchmarks/ddp_overhead.py --model mlp --rounds 12 --steps 40
    python benchmarks/ddp_overhead.py --json runs/bench/ddp.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("plain", "nantrace")
DEFAULT_STEPS = {"gpt": 8, "cnn": 20, "mlp": 40}


# =========================================================================== worker (one rank)
def worker(model_name: str, variant: str, steps: int, warmup: int, seed: int, out: str) -> None:
    """Run on every rank by torchrun; rank 0 writes the step times and a weight digest."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from models import CASES

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    case = CASES[model_name]
    model = case.build(seed)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    guard = None
    if variant == "nantrace":
        import nantrace

        guard = nantrace.watch(ddp, opt)
        if not guard.checks_local_grads:
            raise RuntimeError("nantrace did not install its DDP local-gradient check")
    batches = case.batches(8, seed=seed + 1 + rank)
    times: list[float] = []
    cpu: list[float] = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        case.loss(ddp, batch).backward()
        opt.step()
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= warmup:
            times.append(t1 - t0)
            cpu.append(c1 - c0)
    incidents = len(guard.incidents) if guard is not None else 0
    if guard is not None:
        guard.close()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "cpu": cpu, "weights": digest.hexdigest(),
                                         "incidents": incidents}))
    dist.barrier()
    del ddp, opt, guard, model
    dist.destroy_process_group()


# =========================================================================== parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_name: str, variant: str, *, steps: int, warmup: int, seed: int, timeout: int) -> dict[str, Any]:
    """One torchrun job of two ranks; returns rank 0's step times."""
    from overhead import TIMING_MALLOC_ENV

    with tempfile.TemporaryDirectory(prefix="nantrace-ddp-bench-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", **TIMING_MALLOC_ENV)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(Path(__file__).resolve()), "--worker", "--model", model_name, "--variant", variant,
               "--steps", str(steps), "--warmup", str(warmup), "--seed", str(seed), "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"torchrun ({variant}) failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def run(model_name: str, *, rounds: int, steps: int, warmup: int, seed: int, timeout: int,
        quiet: bool = False) -> dict[str, Any]:
    """Alternate launches of every variant for ``rounds`` rounds; summarise like overhead.py."""
    from overhead import summarise

    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    weights: dict[str, set[str]] = {v: set() for v in VARIANTS}
    incidents = 0
    loads: list[float] = []
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            res = launch(model_name, v, steps=steps, warmup=warmup, seed=seed, timeout=timeout)
            times[v].append(res["times"])
            cpu[v].append(sum(res["cpu"]))
            weights[v].add(res["weights"])
            incidents += res["incidents"]
            loads.append(os.getloadavg()[0])
        if not quiet:
            meds = {v: statistics.median(times[v][-1]) * 1e3 for v in VARIANTS}
            print(f"round {r + 1}/{rounds}: " + "  ".join(f"{v} {m:.1f} ms" for v, m in meds.items())
                  + f"  (× {meds['nantrace'] / meds['plain']:.3f}, load {loads[-1]:.1f})", flush=True)
    summary = summarise(times)
    summary["nantrace"]["cpu_ratio"] = sum(cpu["nantrace"]) / sum(cpu["plain"])
    return {
        "model": model_name,
        "rounds": rounds,
        "steps_per_launch": steps,
        "warmup": warmup,
        "summary": summary,
        "identical_weights": len(weights["plain"]) == 1 and weights["plain"] == weights["nantrace"],
        "incidents": incidents,
        "load_average_median": statistics.median(loads),
        "load_average_max": max(loads),
        "raw_times": times,
    }


def print_report(res: dict[str, Any]) -> None:
    s = res["summary"]
    print(f"\nDDP, 2 gloo processes × 1 thread, model {res['model']}, {res['rounds']} rounds × "
          f"{res['steps_per_launch']} steps per launch; load average median {res['load_average_median']:.1f} "
          f"(max {res['load_average_max']:.1f})")
    print(f"{'variant':<10} {'median ms':>10} {'× plain: medians':>17} {'per round [95% CI]':>26} {'× plain: means':>15}")
    for v in VARIANTS:
        row = s[v]
        ci = row.get("per_round_ratio_ci95")
        ci_txt = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[n/a]"
        print(f"{v:<10} {row['median_ms']:>10.1f} {row['ratio_of_medians']:>17.3f} "
              f"{row['per_round_ratio_median']:>8.3f} {ci_txt:>17} {row['ratio_of_means']:>15.3f}")
    print(f"CPU time (rank 0) × plain: {s['nantrace']['cpu_ratio']:.3f}")
    print(f"final weights identical across variants and launches: {res['identical_weights']}; "
          f"incidents raised: {res['incidents']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt", choices=sorted(DEFAULT_STEPS), help="benchmark model (default gpt)")
    p.add_argument("--rounds", type=int, default=8, help="launches per variant, alternating (default 8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per launch (default: gpt 8, cnn 20, mlp 40)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every launch (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=600, help="seconds before one launch counts as hung")
    p.add_argument("--json", default=None, help="write the summary and every step time here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or (args.steps is not None and args.steps < 1):
        p.error("--rounds and --steps must be at least 1, --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    steps = args.steps or DEFAULT_STEPS[args.model]
    if args.worker:
        worker(args.model, args.variant, steps, args.warmup, args.seed, args.out)
        return 0
    res = run(args.model, rounds=args.rounds, steps=steps, warmup=args.warmup, seed=args.seed, timeout=args.timeout)
    print_report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["identical_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
