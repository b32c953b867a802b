"""GPU overhead of nantrace on a GPT-2-small-sized model: step time and peak memory.

Grid: precision (``bf16``: autocast to bfloat16; ``fp16``: autocast to float16 with a
``torch.amp.GradScaler``) × mode (``eager``, ``compile``: ``torch.compile`` of the model) ×
tool (``plain``; ``nantrace``: ``nantrace.watch(model, optimizer, scaler=...)``, the
synchronous check, one host read per step; ``nantrace_syncfree``: the same with
``sync_free=True``, each step decided on the device, no host read (docs/sync_free.md; with
fp16 the GradScaler owns ``found_inf``, so it falls back to the synchronous check and the
table says so); ``detect_anomaly``: ``torch.autograd.detect_anomaly(check_nan=True)``). Every
cell trains its own copy of the same initial weights on the same batches (fused AdamW) in its
own process (its own dynamo cache and allocator: no tool's hooks, modes or compiled graphs
touch another's steps); tools of one (precision, mode) are interleaved in blocks of
``--steps-per-block`` steps, one process computing at a time, so the device's clocks and the
host's load hit them alike. Time is measured with CUDA events around
each block, synchronised only at its end (so a tool's own per-step host reads, which drain the
launch queue, are part of its time; on the CPU: ``perf_counter``), as time per step; peak
memory is ``torch.cuda.max_memory_allocated`` over the timed steps (on the CPU: not measured).
Weights of ``plain`` and each nantrace variant are compared at the end, by a hash of every
byte (nantrace must not change training).

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
import hashlib
import json
import multiprocessing as mp
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

TOOLS = ("plain", "nantrace", "nantrace_syncfree", "detect_anomaly", "plain_again")
"""``plain_again`` is a second plain run: a control for the weights check (under ``torch.compile``
a GPU's generated kernels may accumulate in a nondeterministic order, plain against plain)."""
DEFAULT_TOOLS = TOOLS[:4]
PRECISIONS = ("bf16", "fp16")
MODES = ("eager", "compile")
GPT2_SMALL = {"vocab": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "max_len": 1024, "batch": 8}
TINY = {"vocab": 128, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_len": 16, "batch": 2}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
               device: torch.device, dtype: torch.dtype = torch.bfloat16,
               scaler: torch.amp.GradScaler | None = None) -> None:
    """One language-model step under autocast: the loop every GPU benchmark here times (gpu.py,
    gpu_memory.py, gpu_profile.py)."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


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
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        anomaly = torch.autograd.detect_anomaly(check_nan=True) if self.tool == "detect_anomaly" else contextlib.nullcontext()
        with anomaly:
            train_step(self.run, self.opt, batch, self.device, dtype, self.scaler)

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


def _build(shape: dict[str, int], device: torch.device) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The same initial weights and batches in every worker (seeded, made on the CPU)."""
    torch.manual_seed(0)
    base = TinyGPT(vocab=shape["vocab"], d_model=shape["d_model"], n_layers=shape["n_layers"],
                   n_heads=shape["n_heads"], max_len=shape["max_len"])
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["max_len"] + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return base, batches


def _digest(model: torch.nn.Module) -> str:
    """A hash of every byte of the model's state (weights compared across processes, bit for bit)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(conn: Any, tool: str, precision: str, mode: str, shape: dict[str, int], device_name: str,
            compile_backend: str, recompile_limit: int) -> None:
    """One tool's process: its own model copy, dynamo cache and CUDA allocator, so that no tool's
    hooks, modes or compiled graphs touch another's steps; it runs the blocks the parent asks for."""
    try:
        device = torch.device(device_name)
        _raise_recompile_limit(recompile_limit)
        base, batches = _build(shape, device)
        cell = Cell(tool, base, precision, mode, device, compile_backend)
        while True:
            cmd, arg = conn.recv()
            if cmd == "warmup":
                for i in range(arg):
                    cell.step(batches[i % len(batches)])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                conn.send(("ok", None))
            elif cmd == "block":
                r, n = arg
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                cell.times.append(cell.block([batches[(r * n + i) % len(batches)] for i in range(n)]))
                if device.type == "cuda":
                    cell.peak = max(cell.peak, torch.cuda.max_memory_allocated(device))
                conn.send(("ok", None))
            elif cmd == "result":
                out = {"times": cell.times, "peak": cell.peak, "digest": _digest(cell.model),
                       "fingerprint": [t.detach().double().norm().item() for t in cell.model.state_dict().values()],
                       "incidents": len(cell.guard.incidents) if cell.guard is not None else None,
                       "decided_on_device": cell.decided_on_device}
                cell.close()
                conn.send(("ok", out))
                return
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the grid
        import traceback

        conn.send(("error", f"{tool} ({precision}, {mode}): {exc!r}\n{traceback.format_exc()}"))


def _raise_recompile_limit(limit: int) -> None:
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across releases
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


class _Workers:
    """The workers of one (precision, mode): the parent sends each command to one or all of them."""

    def __init__(self, args: argparse.Namespace, precision: str, mode: str, shape: dict[str, int]) -> None:
        ctx = mp.get_context("spawn")
        self.tools = list(args.tools)
        self.conns, self.procs = [], []
        for tool in self.tools:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, tool, precision, mode, shape, args.device,
                                                     args.compile_backend, 64), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def ask(self, i: int, cmd: str, arg: Any = None) -> Any:
        self.conns[i].send((cmd, arg))
        return self.answer(i)

    def answer(self, i: int) -> Any:
        status, value = self.conns[i].recv()
        if status != "ok":
            self.close()
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    shape = TINY if args.tiny else GPT2_SMALL
    base, _ = _build(shape, torch.device("cpu"))
    results: dict[str, Any] = {"model": shape, "parameters": sum(p.numel() for p in base.parameters()), "cells": []}
    del base
    for precision in args.precisions:
        for mode in args.modes:
            workers = _Workers(args, precision, mode, shape)
            for conn in workers.conns:  # warm-up (compilation, allocator, cuBLAS heuristics), all at once
                conn.send(("warmup", args.warmup))
            for i in range(len(workers.tools)):
                workers.answer(i)
            for r in range(args.rounds):
                for k in range(len(workers.tools)):
                    workers.ask((r + k) % len(workers.tools), "block", (r, args.steps_per_block))
            got = {tool: workers.ask(i, "result") for i, tool in enumerate(workers.tools)}
            workers.close()
            plain = got.get("plain")
            for tool, cell in got.items():
                med = statistics.median(cell["times"])
                results["cells"].append({
                    "precision": precision, "mode": mode, "tool": tool, "steps": len(cell["times"]),
                    "median_step_s": med,
                    "ratio_step": med / statistics.median(plain["times"]) if plain else None,
                    "peak_bytes": cell["peak"] or None,
                    "ratio_peak": cell["peak"] / plain["peak"] if plain and plain["peak"] else None,
                    "incidents": cell["incidents"],
                    "same_weights_as_plain": cell["digest"] == plain["digest"]
                    if plain is not None and tool != "plain" and tool != "detect_anomaly" else None,
                    "max_rel_norm_diff": max((abs(a - b) / max(abs(b), 1e-30) for a, b in
                                              zip(cell["fingerprint"], plain["fingerprint"])), default=0.0)
                    if plain is not None and tool != "plain" else None,
                    "decided_on_device": cell["decided_on_device"],
                })
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
        same = "" if c["same_weights_as_plain"] is None else ("yes" if c["same_weights_as_plain"] else
                                                               f"no (norms within {c['max_rel_norm_diff']:.1e})")
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
    ap.add_argument("--tools", type=lambda v: _csv(v, TOOLS), default=list(DEFAULT_TOOLS))
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
