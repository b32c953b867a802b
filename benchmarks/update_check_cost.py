"""What the optimizer-phase update check costs (``nantrace.response.update_check``).

Three copies of the same model train side by side in one process, blocks of steps interleaved
round-robin (the order rotating each round):

- ``plain``      AdamW, nothing hooked;
- ``proven``     ``nantrace.watch`` with AdamW: the update is proven finite from the step's
                 norms (``update_bounds``): nothing copied, nothing read after the update;
- ``checked``    ``nantrace.watch`` with a one-line AdamW subclass, which nantrace cannot bound:
                 every update copies the weights and optimizer state before it
                 (``_foreach_copy_``) and checks them after it (one ``_foreach_norm``, one read).

For both guarded variants the time spent inside ``UpdateCheck.before_update`` and
``after_update`` is measured directly (perf_counter around each call), and the memory the
copies hold is ``UpdateCheck.held_bytes``. The whole-step ratios to ``plain`` carry the
machine's noise; the per-call times are the check's own cost.

Usage::

    python benchmarks/update_check_cost.py --rounds 20                 # tiny GPT, 5 steps per block
    python benchmarks/update_check_cost.py --model mlp --rounds 20 --json /tmp/uc.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import CASES  # noqa: E402


class OpaqueAdamW(torch.optim.AdamW):
    """AdamW under another name: nantrace does not bound subclasses (they may override step)."""


def _timed(fn: Any, sink: list[float]) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=sorted(CASES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import nantrace

    case = CASES[args.model]
    batches = case.batches(16, seed=1)
    variants: dict[str, dict[str, Any]] = {}
    for name, opt_cls in (("plain", torch.optim.AdamW), ("proven", torch.optim.AdamW), ("checked", OpaqueAdamW)):
        model = case.build(seed=0)
        opt = opt_cls(model.parameters(), lr=1e-4)
        v: dict[str, Any] = {"model": model, "opt": opt, "times": [], "before": [], "after": [], "cursor": 0}
        if name != "plain":
            guard = nantrace.watch(model, opt)
            check = guard.update_check
            check.before_update = _timed(check.before_update, v["before"])  # type: ignore[method-assign]
            check.after_update = _timed(check.after_update, v["after"])  # type: ignore[method-assign]
            v["guard"] = guard
        variants[name] = v

    def block(v: dict[str, Any], record: bool) -> None:
        for _ in range(args.steps):
            x, y = batches[v["cursor"] % len(batches)]
            v["cursor"] += 1
            t0 = time.perf_counter()
            v["opt"].zero_grad(set_to_none=True)
            case.loss_fn(v["model"](x), y).backward()
            v["opt"].step()
            if record:
                v["times"].append(time.perf_counter() - t0)

    names = list(variants)
    for name in names:  # warm-up
        block(variants[name], record=False)
    for name in names[1:]:
        variants[name]["before"].clear()
        variants[name]["after"].clear()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            block(variants[name], record=True)

    plain = statistics.median(variants["plain"]["times"])
    weights = sum(p.numel() * p.element_size() for p in variants["plain"]["model"].parameters())
    opt = variants["plain"]["opt"]
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    out: dict[str, Any] = {"model": args.model, "rounds": args.rounds, "steps_per_block": args.steps,
                           "threads": args.threads, "weights_bytes": weights, "adam_state_bytes": state,
                           "plain_median_ms": plain * 1e3, "variants": {}}
    print(f"{args.model}: weights {weights / 2**20:.1f} MiB, AdamW state {state / 2**20:.1f} MiB; "
          f"{args.rounds} rounds x {args.steps} steps, {args.threads} threads")
    print(f"{'variant':8s} {'median step ms':>15s} {'x plain':>8s} {'before_update ms':>17s} {'after_update ms':>16s} "
          f"{'check share':>12s} {'copies held':>12s}")
    for name in names:
        v = variants[name]
        med = statistics.median(v["times"])
        before = statistics.median(v["before"]) * 1e3 if v["before"] else 0.0
        after = statistics.median(v["after"]) * 1e3 if v["after"] else 0.0
        held = v["guard"].update_check.held_bytes if "guard" in v else 0
        share = (before + after) / (plain * 1e3)
        incidents = len(v["guard"].incidents) if "guard" in v else 0
        out["variants"][name] = {"median_ms": med * 1e3, "ratio": med / plain, "before_update_ms": before,
                                 "after_update_ms": after, "check_share_of_plain_step": share, "held_bytes": held,
                                 "incidents": incidents}
        print(f"{name:8s} {med * 1e3:15.1f} {med / plain:8.3f} {before:17.3f} {after:16.3f} {share:12.2%} "
              f"{held / 2**20:9.1f} MiB")
        if "guard" in v:
            v["guard"].close()
    same = all(torch.equal(a, b) for a, b in zip(variants["plain"]["model"].parameters(),
                                                 variants["checked"]["model"].parameters()))
    out["checked_weights_identical_to_plain"] = same
    print(f"weights of 'checked' bit-identical to 'plain': {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
