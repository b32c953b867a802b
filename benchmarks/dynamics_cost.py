"""Step-time cost of nantrace's training-dynamics statistics (``nantrace.dynamics``).

Variants, each training its own identical copy of the model (same initial weights, same
batches, same order) with AdamW and ``clip_grad_norm_(max_norm=1.0)``, all open at once and
timed in ONE process, interleaved round-robin (the order shuffled every round) so that
machine noise hits every variant alike:

- ``plain``     the loop with nothing hooked (it calls the original ``torch.autograd.backward``
                and ``clip_grad_norm_``, captured before any guard patched them)
- ``guard``     ``nantrace.watch`` with every dynamics statistic off: the guard's own cost
- ``default``   ``nantrace.watch`` with ``Config()`` (per-layer norms every step; update
                ratios and Adam state every 25 steps, activations and logits every 50)
- ``thorough``  ``nantrace.watch`` with ``Config.preset("thorough")`` (everything every step)

Guards write to a run directory (a temporary one unless ``--run-dir``), as most users'
do, so per-layer rows reach SQLite. Reported: the median step time of each variant, and
its ratio to ``plain`` (the median of the per-round ratios, with their interquartile range);
``dynamics`` is ``default / guard``, the statistics' own share. On a busy machine the
end-to-end ratios are noisy; ``in-monitor ms/step`` is the time spent inside the monitors
themselves (``before_update``, ``on_step`` and the forward hooks' reductions, summed and
divided by the steps), which other processes disturb much less.

Usage::

    python benchmarks/dynamics_cost.py                      # tiny GPT, ~3 min on 2 cores
    python benchmarks/dynamics_cost.py --model mlp --rounds 20 --steps-per-round 10
    python benchmarks/dynamics_cost.py --json runs/bench/dynamics_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ORIGINAL_BACKWARD = torch.autograd.backward
ORIGINAL_CLIP = torch.nn.utils.clip_grad_norm_

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import CASES, num_parameters  # noqa: E402

import nantrace  # noqa: E402

VARIANTS = ("plain", "guard", "default", "thorough")
DYNAMICS_OFF = dict(layer_stats_every=0, update_stats_every=0, activation_stats_every=0, optimizer_stats_every=0,
                    logit_stats_every=0, early_warnings=False, clip_stats=False)


def _config(variant: str) -> nantrace.Config | None:
    if variant == "plain":
        return None
    if variant == "guard":
        return nantrace.Config(print_incidents=False, **DYNAMICS_OFF)
    if variant == "default":
        return nantrace.Config(print_incidents=False)
    return nantrace.Config.preset("thorough", print_incidents=False)


class _Timer:
    """Accumulates the wall time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def _time_monitors(guard: Any, timer: _Timer) -> None:
    """Time every monitor's step work, and the reductions its forward hooks run (instance attributes shadow the methods)."""
    for monitor in guard.monitors:
        monitor.before_update = timer.wrap(monitor.before_update)
        monitor.on_step = timer.wrap(monitor.on_step)
        if hasattr(monitor, "_hook"):  # the logit monitor hooks this bound method when it installs
            monitor._hook = timer.wrap(monitor._hook)
        if hasattr(monitor, "_make_hook"):  # the activation monitor builds one hook per module
            make = monitor._make_hook
            monitor._make_hook = lambda index, _make=make: timer.wrap(_make(index))


class Runner:
    """One variant: its model, optimizer, guard (if any) and step times."""

    def __init__(self, variant: str, model_name: str, seed: int, batches: list[Any], run_root: Path) -> None:
        case = CASES[model_name]
        self.variant = variant
        self.case = case
        self.model = case.build(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.batches = batches
        self.i = 0
        self.times: list[float] = []
        config = _config(variant)
        self.guard = None
        self.timer = _Timer()
        if config is not None:
            self.guard = nantrace.watch(self.model, self.optimizer, run_dir=run_root / variant, config=config)
            _time_monitors(self.guard, self.timer)

    def step(self) -> float:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.case.loss(self.model, batch)
        if self.guard is None:
            ORIGINAL_BACKWARD(loss)
            ORIGINAL_CLIP(self.model.parameters(), 1.0)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def run(model_name: str, *, rounds: int, steps_per_round: int, warmup_rounds: int, seed: int,
        run_dir: Path | None, log: Callable[[str], None]) -> dict[str, Any]:
    batches = CASES[model_name].batches(16, seed=seed + 1)
    tmp = None
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="nantrace-dyncost-")
        run_dir = Path(tmp.name)
    runners = {v: Runner(v, model_name, seed, batches, run_dir) for v in VARIANTS}
    order = list(VARIANTS)
    rng = random.Random(seed)
    per_round: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(warmup_rounds + rounds):
            rng.shuffle(order)
            if r == warmup_rounds:
                for runner in runners.values():
                    runner.timer.seconds = 0.0
            for v in order:
                times = [runners[v].step() for _ in range(steps_per_round)]
                if r >= warmup_rounds:
                    runners[v].times.extend(times)
                    per_round[v].append(statistics.median(times))
            if r >= warmup_rounds:
                log(f"round {r - warmup_rounds + 1}/{rounds}: " + "  ".join(
                    f"{v} {per_round[v][-1] * 1e3:.1f}ms" for v in VARIANTS))
        incidents = {v: len(runners[v].guard.incidents) for v in VARIANTS if runners[v].guard is not None}
    finally:
        for runner in runners.values():
            runner.close()
        if tmp is not None:
            tmp.cleanup()

    def ratio_stats(num: str, den: str) -> dict[str, float]:
        ratios = sorted(a / b for a, b in zip(per_round[num], per_round[den]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        return {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}

    return {
        "model": model_name,
        "description": CASES[model_name].description,
        "parameters": num_parameters(runners["plain"].model),
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "median_ms": {v: statistics.median(runners[v].times) * 1e3 for v in VARIANTS},
        "vs_plain": {v: ratio_stats(v, "plain") for v in VARIANTS if v != "plain"},
        "dynamics": ratio_stats("default", "guard"),
        "dynamics_thorough": ratio_stats("thorough", "guard"),
        "in_monitor_ms_per_step": {v: runners[v].timer.seconds / (rounds * steps_per_round) * 1e3 for v in VARIANTS},
        "incidents": incidents,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']}: {result['description']} ({result['parameters'] / 1e6:.2f}M parameters), "
          f"{result['rounds']} rounds x {result['steps_per_round']} steps, torch {result['torch']}, "
          f"{result['threads']} threads")
    print(f"{'variant':<10} {'median ms':>10} {'x plain':>9}   per-round x plain [IQR]")
    for v in VARIANTS:
        ms = result["median_ms"][v]
        if v == "plain":
            print(f"{v:<10} {ms:>10.1f} {1.0:>9.3f}")
            continue
        s = result["vs_plain"][v]
        print(f"{v:<10} {ms:>10.1f} {ms / result['median_ms']['plain']:>9.3f}   {s['median']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}]")
    inside = result["in_monitor_ms_per_step"]
    print("in-monitor ms/step: " + ", ".join(f"{v} {inside[v]:.2f} ({inside[v] / result['median_ms']['plain']:.2%} of a "
                                              f"plain step)" for v in ("default", "thorough")))
    d, t = result["dynamics"], result["dynamics_thorough"]
    print(f"dynamics statistics alone (default / guard): {d['median']:.3f} [{d['q1']:.3f}, {d['q3']:.3f}]; "
          f"thorough / guard: {t['median']:.3f} [{t['q1']:.3f}, {t['q3']:.3f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", choices=sorted(CASES))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--run-dir", type=Path, default=None, help="where the guards write (default: a temporary dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--quiet", action="store_true", help="no per-round lines")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.model, rounds=args.rounds, steps_per_round=args.steps_per_round, warmup_rounds=args.warmup_rounds,
                 seed=args.seed, run_dir=args.run_dir, log=(lambda s: None) if args.quiet else print)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
