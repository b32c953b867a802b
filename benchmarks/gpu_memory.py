"""Where nantrace's extra peak GPU memory comes from, by configuration (GPT-2 small, bf16).

Each variant trains a fresh copy of the model for a few steps in its own process and reports
``torch.cuda.max_memory_allocated`` over the steps after the first, against the plain loop;
``norm64`` / ``norm32`` time nothing and measure the peak of one ``_foreach_norm`` over the
model's gradients accumulated in float64 / float32 (the sync-free mode's exact norms).

Usage (on a GPU)::

    python benchmarks/gpu_memory.py                  # every variant
    python benchmarks/gpu_memory.py --tiny --device cpu   # smoke run (no memory figures on the CPU)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import GPT2_SMALL, TINY, _build, train_step  # noqa: E402

VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "sync": {"detection": {"sync_free": False}},
    "syncfree": {"detection": {"sync_free": True}},
    "syncfree_no_output_grads": {"detection": {"sync_free": True}, "localisation": {"keep_output_grads": False}},
    "syncfree_no_tape": {"detection": {"sync_free": True}, "localisation": {"record_loss_code": False}},
    "syncfree_neither": {"detection": {"sync_free": True},
                         "localisation": {"keep_output_grads": False, "record_loss_code": False}},
}


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _variant(name: str, shape: dict[str, int], device_name: str, steps: int, out: Any) -> None:
    device = torch.device(device_name)
    base, batches = _build(shape, device)
    model = base.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if name in ("norm64", "norm32"):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        dtype = torch.float64 if name == "norm64" else torch.float32
        torch._foreach_norm([p.grad for p in model.parameters()], 2, dtype=dtype)
        out.put((name, _peak(device) - before))
        return
    guard = None
    if VARIANTS[name] is not None:
        import nantrace

        guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}, **VARIANTS[name]))
    for i in range(steps):
        if i == 1 and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        train_step(model, opt, batches[i % len(batches)], device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out.put((name, _peak(device)))
    if guard is not None:
        guard.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    shape = TINY if args.tiny else GPT2_SMALL
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results = {}
    for name in [*VARIANTS, "norm64", "norm32"]:
        proc = ctx.Process(target=_variant, args=(name, shape, args.device, args.steps, queue))
        proc.start()
        got, peak = queue.get()
        proc.join()
        results[got] = peak
    plain = results["plain"]
    print("| variant | peak memory | over plain |")
    print("|---|---|---|")
    for name, peak in results.items():
        extra = f"{(peak - plain) / 2**20:+.0f} MiB ({peak / plain:.3f}×)" if plain else "n/a"
        if name.startswith("norm"):
            extra = "(transient of one _foreach_norm)"
        print(f"| {name} | {peak / 2**20:.0f} MiB | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
