"""Where nantrace's step time goes on a GPU: device kernels and host time per step, by mode.

GPT-2 small (bf16 autocast, fused AdamW, eager), one process, the variants one after another
(each guard closed before the next variant starts): ``plain``, ``sync`` (the synchronous
check) and ``syncfree``. For each: wall time per step (CUDA events), device time per step
(the profiler's kernel time), kernels launched per step, host (CPU) time per step; then the
kernels and the host-side calls nantrace adds, largest first.

Usage (on a GPU)::

    python benchmarks/gpu_profile.py
    python benchmarks/gpu_profile.py --tiny --device cpu     # smoke run
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import GPT2_SMALL, TINY, _build, train_step  # noqa: E402


def _steps(model, opt, batches, n: int, device: torch.device) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        train_step(model, opt, batches[i % len(batches)], device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def run(variant: str, shape: dict[str, int], device: torch.device, steps: int):
    base, batches = _build(shape, device)
    model = base.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guard = None
    if variant != "plain":
        import nantrace

        guard = nantrace.watch(model, opt, config=nantrace.Config(
            outputs={"print_incidents": False}, detection={"sync_free": variant == "syncfree"}))
    _steps(model, opt, batches, 5, device)  # warm-up
    wall = _steps(model, opt, batches, steps, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _steps(model, opt, batches, steps, device)
    if guard is not None:
        guard.close()
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    host: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev and e.device_type is not None and "cuda" in str(e.device_type).lower():
            kernels[e.key][0] += e.count / steps
            kernels[e.key][1] += dev / steps
        else:
            host[e.key][0] += e.count / steps
            host[e.key][1] += e.self_cpu_time_total / steps
    return wall, kernels, host


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else GPT2_SMALL
    got = {v: run(v, shape, device, args.steps) for v in ("plain", "sync", "syncfree")}
    plain_k, plain_h = got["plain"][1], got["plain"][2]
    print("| variant | wall / step | device / step | kernels / step | host self time / step |")
    print("|---|---|---|---|---|")
    for v, (wall, kernels, host) in got.items():
        print(f"| {v} | {wall * 1e3:.2f} ms | {sum(k[1] for k in kernels.values()) / 1e3:.2f} ms | "
              f"{sum(k[0] for k in kernels.values()):.0f} | {sum(h[1] for h in host.values()) / 1e3:.2f} ms |")
    for v in ("sync", "syncfree"):
        _, kernels, host = got[v]
        print(f"\n{v}: device time added per step (kernel, calls, µs), largest first")
        extra = sorted(((k[1] - plain_k.get(name, [0, 0.0])[1], k[0] - plain_k.get(name, [0, 0.0])[0], name)
                        for name, k in kernels.items()), reverse=True)[:12]
        for us, calls, name in extra:
            print(f"  {us:9.1f} µs  {calls:+6.1f}  {name[:110]}")
        print(f"{v}: host self time added per step (call, count, µs), largest first")
        extra = sorted(((h[1] - plain_h.get(name, [0, 0.0])[1], h[0] - plain_h.get(name, [0, 0.0])[0], name)
                        for name, h in host.items()), reverse=True)[:15]
        for us, calls, name in extra:
            print(f"  {us:9.1f} µs  {calls:+6.1f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
