"""Step-time overhead of nantrace on DistributedDataParallel: two gloo processes on the CPU.

One real ``torchrun --nproc-per-node 2`` job. On every rank two copies of the same model
(identical weights) are wrapped in DDP, each with its own AdamW, and trained on the same
per-rank synthetic batches:

- ``plain``     DDP as is: zero_grad, forward, loss, backward (with the all-reduce), step;
                its backward calls the original ``torch.autograd.backward``, so nothing of
                nantrace runs in its steps
- ``nantrace``  the other copy under ``nantrace.watch(ddp_model, optimizer)`` with defaults,
                attached once for the whole run: the comm hook checking local gradients
                before the all-reduce, the fused check, and the one small all-reduce per
                step that makes every rank agree

Blocks of steps alternate between the copies round after round (the first variant
alternating too), so machine noise hits both alike; rank 0 times every step (the all-reduce
keeps the ranks in lockstep). Each rank uses one thread, so the two processes fit two cores.
At the end the two copies' weights are compared: the guard must not change training.

Usage::

    python benchmarks/ddp_overhead.py                       # tiny GPT, 20 rounds x 4 steps, ~4 min on 2 idle cores
    python benchmarks/ddp_overhead.py --model mlp --rounds 40 --steps 20
    python benchmarks/ddp_overhead.py --json runs/bench/ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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
DEFAULT_STEPS = {"gpt": 4, "cnn": 10, "mlp": 20}


# =========================================================================== worker (one rank)
def worker(model_name: str, rounds: int, steps: int, warmup: int, seed: int, out: str) -> None:
    """Run on every rank by torchrun; rank 0 writes the step times and the weight comparison."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    original_backward = torch.autograd.backward  # before nantrace can patch it
    from models import CASES

    import nantrace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    case = CASES[model_name]
    models = {v: case.build(seed) for v in VARIANTS}
    ddps = {v: DDP(m) for v, m in models.items()}
    opts = {v: torch.optim.AdamW(ddps[v].parameters(), lr=3e-4) for v in VARIANTS}
    guard = nantrace.watch(ddps["nantrace"], opts["nantrace"])
    if not guard.checks_local_grads:
        raise RuntimeError("nantrace did not install its DDP local-gradient check")
    batches = case.batches(8, seed=seed + 1 + rank)
    cursor = {v: 0 for v in VARIANTS}

    def step(v: str) -> tuple[float, float]:
        batch = batches[cursor[v] % len(batches)]
        cursor[v] += 1
        t0, c0 = time.perf_counter(), time.process_time()
        opts[v].zero_grad(set_to_none=True)
        loss = case.loss(ddps[v], batch)
        if v == "plain":
            original_backward(loss)
        else:
            loss.backward()
        opts[v].step()
        return time.perf_counter() - t0, time.process_time() - c0

    for v in VARIANTS:
        for _ in range(warmup):
            step(v)
    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            pairs = [step(v) for _ in range(steps)]
            times[v].append([p[0] for p in pairs])
            cpu[v].append(sum(p[1] for p in pairs))
    incidents = len(guard.incidents)
    guard.close()
    identical = all(torch.equal(a, b) for a, b in zip(models["plain"].parameters(), models["nantrace"].parameters()))
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "cpu": cpu, "identical_weights": identical,
                                         "incidents": incidents, "guard_steps": guard.step}))
    dist.barrier()
    del ddps, opts, guard, models
    dist.destroy_process_group()


# =========================================================================== parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model_name: str, *, rounds: int, steps: int, warmup: int, seed: int, timeout: int) -> dict[str, Any]:
    """One torchrun job of two ranks; the summary of rank 0's step times, like overhead.py's."""
    from overhead import TIMING_MALLOC_ENV, summarise

    with tempfile.TemporaryDirectory(prefix="nantrace-ddp-bench-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", **TIMING_MALLOC_ENV)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(Path(__file__).resolve()), "--worker", "--model", model_name, "--rounds", str(rounds),
               "--steps", str(steps), "--warmup", str(warmup), "--seed", str(seed), "--out", out]
        load_before = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        load_after = os.getloadavg()[0]
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"torchrun failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
        res = json.loads(Path(out).read_text())
    summary = summarise(res["times"])
    summary["nantrace"]["cpu_ratio"] = sum(res["cpu"]["nantrace"]) / sum(res["cpu"]["plain"])
    return {
        "model": model_name,
        "rounds": rounds,
        "steps_per_block": steps,
        "warmup": warmup,
        "summary": summary,
        "identical_weights": res["identical_weights"],
        "incidents": res["incidents"],
        "guard_steps": res["guard_steps"],
        "load_average": [load_before, load_after],
        "raw_times": res["times"],
    }


def print_report(res: dict[str, Any]) -> None:
    s = res["summary"]
    load = res["load_average"]
    print(f"\nDDP, 2 gloo processes × 1 thread, model {res['model']}, {res['rounds']} rounds × "
          f"{res['steps_per_block']} steps per variant block, interleaved; 1-min load average {load[0]:.1f} "
          f"before, {load[1]:.1f} after")
    print(f"{'variant':<10} {'median ms':>10} {'× plain: medians':>17} {'per round [95% CI]':>26} {'× plain: means':>15}")
    for v in VARIANTS:
        row = s[v]
        ci = row.get("per_round_ratio_ci95")
        ci_txt = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[n/a]"
        print(f"{v:<10} {row['median_ms']:>10.1f} {row['ratio_of_medians']:>17.3f} "
              f"{row['per_round_ratio_median']:>8.3f} {ci_txt:>17} {row['ratio_of_means']:>15.3f}")
    print(f"CPU time (rank 0) × plain: {s['nantrace']['cpu_ratio']:.3f}")
    print(f"final weights identical with and without nantrace: {res['identical_weights']}; "
          f"incidents: {res['incidents']}; steps seen by the guard: {res['guard_steps']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt", choices=sorted(DEFAULT_STEPS), help="benchmark model (default gpt)")
    p.add_argument("--rounds", type=int, default=20, help="rounds; each runs one block of every variant (default 20)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per block (default: gpt 4, cnn 10, mlp 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before the first round (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds before the torchrun job counts as hung")
    p.add_argument("--json", default=None, help="write the summary and every step time here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or (args.steps is not None and args.steps < 1):
        p.error("--rounds and --steps must be at least 1, --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    steps = args.steps or DEFAULT_STEPS[args.model]
    if args.worker:
        worker(args.model, args.rounds, steps, args.warmup, args.seed, args.out)
        # Results are written and the process group destroyed: skip interpreter finalisation,
        # where gloo's C++ threads have been seen to abort a rank at exit after a clean run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    res = run(args.model, rounds=args.rounds, steps=steps, warmup=args.warmup, seed=args.seed, timeout=args.timeout)
    print_report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["identical_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
