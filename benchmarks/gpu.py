"""GPU overhead of nantrace on a GPT-2-small-sized model: step time and peak memory.

Grid: precision (``bf16``: autocast to bfloat16; ``fp16``: autocast to float16 with a
``torch.amp.GradScaler``) × mode (``eager``, ``compile``: ``torch.compile`` of the model) ×
tool (``plain``; ``nantrace``: ``nantrace.watch(model, optimizer, scaler=...)``, the
synchronous check, one host read per step; ``nantrace_syncfree``: the same with
``sync_free=True``, each step decided on the device, no host read (docs/sync_free.md; with
fp16 the GradScaler owns ``found_inf``, so it falls back to the synchronous check and the
table says so); ``detect_anomaly``: ``torch.autograd.detect_anomaly(check_nan=True)``). Every
cell trains its own copy of the same initial weights on the same batches (fused AdamW); tools of
one (precision, mode) are interleaved in blocks of ``--steps-per-block`` steps, so the
device's clocks and the host's load hit them alike. Time is measured with CUDA events around
each block, synchronised only at its end (so a tool's own per-step host reads, which drain the
launch queue, are part of its time; on the CPU: ``perf_counter``), as time per step; peak
memory is ``torch.cuda.max_memory_allocated`` over the timed steps (on the CPU: not measured).
Weights of ``plain`` and each nantrace variant are compared at the end (nantrace must not
change training).

Default model: 12 layers, d_model 768, 12 heads, sequence 1024, vocabulary 50257 (GPT-2
small, 124 M parameters with the untied head here: 163 M), batch 8.

Usage::

    python benchmarks/gpu.py                                    # on a GPU: the whole grid
    python benchmarks/gpu.py --precisions bf16 --modes eager --steps-per-block 5 --rounds 10
    python benchmarks/gpu.py --tiny --device cpu --rounds 1     # smoke test (tests/test_benchmarks.py)

    # prints a markdown table for docs/benchmarks.md:
    # | precision | mode | tool | median step | × plain | peak memory | × plain | weights = plain | host reads |
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import TinyGPT  # noqa: E402

TOOLS = ("plain", "nantrace", "nantrace_syncfree", "detect_anomaly")
PRECISIONS = ("bf16", "fp16")
MODES = ("eager", "compile")
GPT2_SMALL = {"vocab": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "max_len": 1024, "batch": 8}
TINY = {"vocab": 128, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_len": 16, "batch": 2}


class Cell:
    """One tool's copy of the model, optimizer, scaler and (for nantrace) guard."""

    def __init__(self, tool: str, base: torch.nn.Module, precision: str, mode: str, device: torch.device,
                 compile_backend: str) -> None:
        self.tool = tool
        self.precision = precision
        self.device = device
        self.model = copy.deepcopy(base).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.run = torch.compile(self.model, backend=compile_backend) if mode == "compile" else self.model
        self.guard = None
        if tool.startswith("nantrace"):
            import nantrace

            sync_free = False
            if tool == "nantrace_syncfree":  # required where it can be exact; with a GradScaler it cannot
                sync_free = True if self.scaler is None else "auto"
            config = nantrace.Config(outputs={"print_incidents": False}, detection={"sync_free": sync_free})
            self.guard = nantrace.watch(self.run, self.opt, scaler=self.scaler, config=config)
        self.times: list[float] = []
        self.peak = 0

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        anomaly = torch.autograd.detect_anomaly(check_nan=True) if self.tool == "detect_anomaly" else contextlib.nullcontext()
        with anomaly:
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=dtype):
                logits = self.run(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                loss.backward()
                self.opt.step()

    def block(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Time per step of a block of steps, synchronised only at its end."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for batch in batches:
            self.step(batch)
        if cuda:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / len(batches)
        return (time.perf_counter() - t0) / len(batches)

    @property
    def decided_on_device(self) -> bool | None:
        """Whether the guard decides steps on the device (sync-free mode); ``None`` without a guard."""
        return None if self.guard is None else self.guard.sync_free is not None

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    shape = TINY if args.tiny else GPT2_SMALL
    torch.manual_seed(0)
    base = TinyGPT(vocab=shape["vocab"], d_model=shape["d_model"], n_layers=shape["n_layers"],
                   n_heads=shape["n_heads"], max_len=shape["max_len"])
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["max_len"] + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    results: dict[str, Any] = {"model": shape, "parameters": sum(p.numel() for p in base.parameters()), "cells": []}
    for precision in args.precisions:
        for mode in args.modes:
            cells = [Cell(t, base, precision, mode, device, args.compile_backend) for t in args.tools]
            for cell in cells:  # warm-up (compilation, allocator, cuBLAS heuristics)
                for i in range(args.warmup):
                    cell.step(batches[i % len(batches)])
            if device.type == "cuda":
                torch.cuda.synchronize()
            for r in range(args.rounds):
                order = cells[r % len(cells):] + cells[: r % len(cells)]
                for cell in order:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    block = [batches[(r * args.steps_per_block + i) % len(batches)] for i in range(args.steps_per_block)]
                    cell.times.append(cell.block(block))
                    if device.type == "cuda":
                        cell.peak = max(cell.peak, torch.cuda.max_memory_allocated(device))
            by_tool = {c.tool: c for c in cells}
            plain = by_tool.get("plain")
            for cell in cells:
                med = statistics.median(cell.times)
                results["cells"].append({
                    "precision": precision, "mode": mode, "tool": cell.tool, "steps": len(cell.times),
                    "median_step_s": med,
                    "ratio_step": med / statistics.median(plain.times) if plain else None,
                    "peak_bytes": cell.peak or None,
                    "ratio_peak": cell.peak / plain.peak if plain and plain.peak else None,
                    "incidents": len(cell.guard.incidents) if cell.guard is not None else None,
                    "same_weights_as_plain": all(torch.equal(a, b) for a, b in zip(
                        plain.model.state_dict().values(), cell.model.state_dict().values()))
                    if plain is not None and cell.tool.startswith("nantrace") else None,
                    "decided_on_device": cell.decided_on_device,
                })
                cell.close()
            del cells, by_tool, plain
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results["environment"] = {
        "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "load_average": os.getloadavg(),
    }
    return results


def print_table(results: dict[str, Any]) -> None:
    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    print(f"model: {results['model']}, {results['parameters'] / 1e6:.1f} M parameters; {results['environment']}")
    print("| precision | mode | tool | median step | × plain | peak memory | × plain | weights = plain | host reads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in results["cells"]:
        peak = "n/a" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**20:.0f} MiB"
        same = "" if c["same_weights_as_plain"] is None else ("yes" if c["same_weights_as_plain"] else "**NO**")
        reads = {None: "", True: "0 / step (sync-free)", False: "1 / step"}[c.get("decided_on_device")]
        print(f"| {c['precision']} | {c['mode']} | {c['tool']} | {c['median_step_s'] * 1e3:.2f} ms | "
              f"{fmt(c['ratio_step'], '.3f')} | {peak} | {fmt(c['ratio_peak'], '.3f')} | {same} | {reads} |")


def _csv(value: str, allowed: Sequence[str]) -> list[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    return items


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, d_model 32 model (smoke test)")
    ap.add_argument("--precisions", type=lambda v: _csv(v, PRECISIONS), default=list(PRECISIONS))
    ap.add_argument("--modes", type=lambda v: _csv(v, MODES), default=list(MODES))
    ap.add_argument("--tools", type=lambda v: _csv(v, TOOLS), default=list(TOOLS))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps-per-block", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend ('eager' for a CPU smoke test)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
    results = run_grid(args)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
