"""Where the guard's fixed per-step cost goes: each hook timed on its own.

The guard's hooks (``Guard._forward_pre`` etc.) are wrapped with a timer at class level
before ``nantrace.watch`` installs them, then ``--steps`` steps of each model are trained;
the table gives the median microseconds per step spent in each hook, and the median
plain step measured in the same process with the guard closed (the same model and
batches). Timings on a shared machine move with its load: read the ratios between hooks,
not the absolute figures, and record ``uptime`` beside them.

Usage::

    python benchmarks/fixed_cost.py --models mlp,cnn --steps 200
    python benchmarks/fixed_cost.py --models mlp,cnn --steps 200 --detail     # and the parts inside the hooks
    # model  plain step   forward_pre  forward_post  on_loss  decide  prepare  finish_step (monitors)  total  share
    # mlp      6.9 ms        41 µs       38 µs     6 µs   420 µs   3 µs   310 µs (260 µs)        818 µs  11.8 %
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import CASES  # noqa: E402

import nantrace  # noqa: E402
from nantrace.guard import Guard  # noqa: E402
from nantrace.step_capture import StepRecorder  # noqa: E402

TARGETS = {"_forward_pre": (StepRecorder, "forward_pre"), "_forward_post": (StepRecorder, "forward_post"),
           "_on_loss": (StepRecorder, "on_loss"), "_decide": (Guard, "decide"),
           "_prepare_update": (Guard, "_prepare_update"), "_finish_step": (Guard, "finish_step"),
           "_run_monitors": (Guard, "_run_monitors")}
"""The methods timed (the step's capture hooks, the decision, the bookkeeping), by the label shown."""
HOOKS = tuple(TARGETS)
"""``_run_monitors`` runs inside ``_finish_step`` (shown in brackets)."""

DETAIL = {
    "optimizer_pre (all)": ("nantrace.guard", "Guard", "_optimizer_pre"),
    "optimizer_post (all)": ("nantrace.guard", "Guard", "_optimizer_post"),
    "backward patch listeners": ("nantrace.step_capture", "StepRecorder", "on_loss"),
    "capture: RNG state": ("nantrace.capture", "RngState", "current"),
    "capture: autocast state": ("nantrace.capture", "AutocastState", "current"),
    "capture: buffers": ("nantrace.capture", "BufferPlan", "snapshot"),
    "capture: input/output extremes": ("nantrace.capture", None, "_extend_extremes"),
    "capture: finiteness flags (before issue 13 item 4)": ("nantrace.step_capture", None, "all_finite"),
    "capture: loss tape resume": ("nantrace.loss_tape", "LossTape", "resume"),
    "capture: reset": ("nantrace.step_capture", "StepRecorder", "reset"),
    "decide: gradient list": ("nantrace.decision", None, "gradients"),
    "decide: finiteness flags": ("nantrace.capture", "StepCapture", "finite_flags"),
    "decide: stage (norms, vector)": ("nantrace.decision", None, "stage"),
    "decide: read (host sync)": ("nantrace.decision", None, "read"),
    "decide: finish": ("nantrace.decision", None, "finish"),
    "decide: triage (spikes, divergence)": ("nantrace.decision", None, "triage"),
    "update check: before": ("nantrace.response.update_check", "UpdateCheck", "before_update"),
    "update check: after": ("nantrace.response.update_check", "UpdateCheck", "after_update"),
    "monitors: before_update": ("nantrace.dynamics._common", "SafeMonitor", "before_update"),
    "monitors: layers": ("nantrace.dynamics.layers", "LayerStatsMonitor", "_on_step"),
    "monitors: optimizer state": ("nantrace.dynamics.optimizer_state", "OptimizerStateMonitor", "_on_step"),
    "monitors: activations": ("nantrace.dynamics.activations", "ActivationMonitor", "_on_step"),
    "monitors: logits": ("nantrace.dynamics.logits", "LogitSaturationMonitor", "_on_step"),
    "monitors: clipping": ("nantrace.dynamics.clipping", "ClipMonitor", "_on_step"),
    "store: log_step": ("nantrace.storage.runstore", "RunStore", "log_step"),
    "guard: backward patch check (ensure)": ("nantrace.patches", "FunctionPatch", "ensure"),
    "guard: learning rates": ("nantrace.guard", "Guard", "_lrs"),
}
"""``--detail``: the parts inside the hooks, each timed on its own (label: module, class or
``None`` for a module-level function as the caller imported it, attribute)."""


def _timed(name: str, fn: Callable[..., Any], spent: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0

    wrapper.__name__ = fn.__name__
    return wrapper


def _detail_targets() -> dict[str, tuple[Any, str]]:
    import importlib

    out = {}
    for label, (module, cls, attr) in DETAIL.items():
        owner = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        if hasattr(owner, attr):  # an older nantrace may lack a part: it is left out of the table
            out[label] = (owner, attr)
    return out


def measure_model(name: str, *, steps: int, warmup: int, threads: int, detail: bool = False,
                  run_dir: str | None = None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    case = CASES[name]
    batches = case.batches(8)
    spent: dict[str, float] = defaultdict(float)
    targets = {**TARGETS, **(_detail_targets() if detail else {})}
    labels = tuple(targets)
    originals = {h: owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
                 for h, (owner, attr) in targets.items()}
    for h, fn in originals.items():
        wrapped = _timed(h, fn.__func__ if isinstance(fn, classmethod) else fn, spent)
        setattr(targets[h][0], targets[h][1], classmethod(wrapped) if isinstance(fn, classmethod) else wrapped)
    per_step: dict[str, list[float]] = defaultdict(list)
    plain: list[float] = []
    try:
        model = case.build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = nantrace.watch(model, opt, run_dir=run_dir, config=nantrace.Config(print_incidents=False))
        for i in range(warmup + steps):
            spent.clear()
            t0 = time.perf_counter()
            opt.zero_grad()
            case.loss(model, batches[i % len(batches)]).backward()
            opt.step()
            total = time.perf_counter() - t0
            if i >= warmup:
                for h in labels:
                    per_step[h].append(spent.get(h, 0.0))
                per_step["step"].append(total)
        guard.close()
        for i in range(warmup + steps):  # the same model, unwatched: the plain step in the same conditions
            t0 = time.perf_counter()
            opt.zero_grad()
            case.loss(model, batches[i % len(batches)]).backward()
            opt.step()
            if i >= warmup:
                plain.append(time.perf_counter() - t0)
    finally:
        for h, fn in originals.items():
            setattr(targets[h][0], targets[h][1], fn)
    med = {h: statistics.median(v) * 1e6 for h, v in per_step.items()}
    mean = {h: statistics.fmean(v) * 1e6 for h, v in per_step.items()}
    own = sum(med[h] for h in HOOKS if h != "_run_monitors")
    return {"model": name, "steps": steps, "plain_step_ms": statistics.median(plain) * 1e3,
            "watched_step_ms": med["step"] / 1e3, "hooks_us": {h: med[h] for h in HOOKS}, "guard_us": own,
            "share_of_plain": own / (statistics.median(plain) * 1e6),
            "detail_us": {h: (med[h], mean[h]) for h in labels if h not in HOOKS}}


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print("| model | plain step | forward_pre | forward_post | on_loss | decide | prepare_update | finish_step (of which monitors) | guard total | × plain step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = r["hooks_us"]
        print(f"| {r['model']} | {r['plain_step_ms']:.2f} ms | {h['_forward_pre']:.0f} µs | {h['_forward_post']:.0f} µs | "
              f"{h['_on_loss']:.0f} µs | {h['_decide']:.0f} µs | {h['_prepare_update']:.0f} µs | "
              f"{h['_finish_step']:.0f} µs ({h['_run_monitors']:.0f} µs) | {r['guard_us']:.0f} µs | "
              f"{r['share_of_plain'] * 100:.1f} % |")


def print_detail(rows: Sequence[dict[str, Any]]) -> None:
    """The parts inside the hooks: median and mean µs per step (the mean includes sampled steps)."""
    if not rows or not rows[0]["detail_us"]:
        return
    print()
    print("| part | " + " | ".join(f"{r['model']} median / mean µs" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label in DETAIL:
        if label not in rows[0]["detail_us"]:
            continue
        cells = [f"{r['detail_us'][label][0]:.1f} / {r['detail_us'][label][1]:.1f}" for r in rows]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--detail", action="store_true", help="also time the parts inside the hooks (DETAIL)")
    ap.add_argument("--run-dir", action="store_true", help="watch with a run directory (the run store's rows)")
    args = ap.parse_args(argv)
    import tempfile

    rows = []
    for m in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="nantrace-fixed-cost-") as tmp:
            rows.append(measure_model(m, steps=args.steps, warmup=args.warmup, threads=args.threads,
                                      detail=args.detail, run_dir=tmp if args.run_dir else None))
    print_table(rows)
    print_detail(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
