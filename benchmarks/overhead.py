"""Step-time and peak-memory overhead of nantrace against a plain loop and other tools.

Variants, each training its own identical copy of the model (same initial weights, same
batches in the same order, AdamW), on the CPU:

- ``plain``           zero_grad, forward, loss, backward, optimizer.step(); nothing hooked
- ``nantrace``        the same loop under ``nantrace.watch(model, optimizer)`` (defaults)
- ``nantrace_store``  the same with ``run_dir=`` a temporary directory: the run store's rows
                      (one step row and the per-layer rows, one SQLite transaction) every step
- ``nantrace_notape`` the defaults without the loss tape (``localisation.record_loss_code=False``)
- ``nantrace_sync``   the defaults with ``detection.sync_free=False``; with ``--fused`` (every
                      variant's AdamW fused) the ``nantrace`` variant runs ``sync_free=True``
                      (each step decided on the device, docs/sync_free.md; "auto" keeps the
                      synchronous check on the CPU), and this one is what it is compared with
- ``detect_anomaly``  the same loop inside ``torch.autograd.detect_anomaly(check_nan=True)``
- ``hf_debug``        ``transformers.debug_utils.DebugUnderflowOverflow(model)`` attached

The variants are interleaved round-robin (each round runs one block of steps of every
variant, the first variant rotating), so machine noise hits them alike. Two isolation modes:

- ``--isolation process`` (default): one long-lived worker process per variant, each with
  its tool attached ONCE for the whole run (one guard, as in a real run: periodic
  statistics and warm-up-dependent checks happen at their real frequency); the parent
  runs the blocks one at a time, so only one worker computes at any moment. The plain
  worker never imports nantrace: nothing can be hooked there.
- ``--isolation block``: a single process; the tool is attached before each block and
  removed after it (a fresh guard per block, so per-run state restarts every block).

Peak memory is measured apart, one fresh subprocess per (model, variant) pair.

Usage::

    python benchmarks/overhead.py                        # everything, ~8-10 min on 2 idle cores
    python benchmarks/overhead.py --models gpt --variants plain,nantrace --rounds 40
    python benchmarks/overhead.py --no-memory --json runs/bench/overhead.json
    python benchmarks/overhead.py --fused --variants plain,nantrace,nantrace_sync --no-memory   # sync-free vs sync

    # prints, per model and variant (figures here are illustrative):
    #  model  variant    median ms  IQR ms          × plain: medians  per round [95% CI]    mean ms  × plain: means [95% CI]
    #  gpt    plain         190.2   188.9 – 192.0   1.000             1.000                  191.0   1.000
    #  gpt    nantrace      195.5   193.6 – 198.0   1.028             1.026 [1.019, 1.033]   196.9   1.031 [1.022, 1.040]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Captured before anything could patch them: the plain variant is checked against these.
_ORIGINAL_AUTOGRAD_BACKWARD = torch.autograd.backward
_ORIGINAL_TENSOR_BACKWARD = torch.Tensor.backward

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import CASES, BenchCase, num_parameters  # noqa: E402

VARIANTS = ("plain", "nantrace", "nantrace_store", "nantrace_notape", "nantrace_sync", "detect_anomaly", "hf_debug")
GUARDED = ("nantrace", "nantrace_store", "nantrace_notape", "nantrace_sync")
FUSED_ENV = "NANTRACE_BENCH_FUSED"
"""Set to 1 by ``--fused``: every variant's AdamW is fused (an environment variable, so workers inherit it)."""
"""Variants under ``nantrace.watch``: defaults, and defaults plus a run directory (SQLite rows every step)."""
DEFAULT_STEPS = {"gpt": 5, "cnn": 15, "mlp": 30}
"""Timed steps per variant block, per model (``--steps-per-round`` overrides all)."""
DEFAULT_ROUNDS = 24
N_BATCHES = 16
LR = 3e-4
TIMING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""glibc settings for every timed process: a fixed mmap threshold (32 MiB, glibc's maximum) and
no trimming, so freed tensor memory is reused without page faults. glibc's default adapts
its thresholds to each process's allocation history, which left some processes re-faulting
~2,000 pages per step (MLP: ~30% slower) and others not: a per-process bias larger than
the effects measured here. Fixed, every process behaves alike, as in a long-running job."""
MEM_CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc for the memory subprocesses: every allocation >= 64 KiB is its own mmap, unmapped when
freed, so RSS follows the live tensors instead of what the allocator keeps (repeatably)."""


# =========================================================================== cleanliness
class CleanlinessError(RuntimeError):
    """A hook, mode or patch is active where the benchmark requires none."""


def leftover_hooks(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """Every hook, patch or mode that would make a step differ from a plain one."""
    found: list[str] = []
    if torch.autograd.backward is not _ORIGINAL_AUTOGRAD_BACKWARD:
        found.append(f"torch.autograd.backward is patched ({torch.autograd.backward!r})")
    if torch.Tensor.backward is not _ORIGINAL_TENSOR_BACKWARD:
        found.append("torch.Tensor.backward is patched")
    if torch.is_anomaly_enabled():
        found.append("autograd anomaly detection is enabled")
    from torch.nn.modules import module as module_mod

    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called"):
        if getattr(module_mod, attr, None):
            found.append(f"torch.nn.modules.module.{attr} is not empty")
    for name, mod in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(mod, attr, None):
                found.append(f"module {name or '<root>'!r} has {attr}: {len(getattr(mod, attr))}")
        if "forward" in mod.__dict__:
            found.append(f"module {name or '<root>'!r} has an instance-level forward (patched)")
    for name, p in model.named_parameters():
        if getattr(p, "_backward_hooks", None):
            found.append(f"parameter {name!r} has tensor hooks")
        if getattr(p, "_post_accumulate_grad_hooks", None):
            found.append(f"parameter {name!r} has post-accumulate-grad hooks")
    if optimizer is not None:
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_load_state_dict_post_hooks"):
            if getattr(optimizer, attr, None):
                found.append(f"optimizer has {attr}: {len(getattr(optimizer, attr))}")
        if "step" in optimizer.__dict__:
            found.append("optimizer has an instance-level step (patched)")
        from torch.optim import optimizer as optim_mod

        for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            if getattr(optim_mod, attr, None):
                found.append(f"torch.optim.optimizer.{attr} is not empty")
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        found.append(f"a TorchDispatchMode is active: {_get_current_dispatch_mode()!r}")
    if torch.overrides._get_current_function_mode() is not None:
        found.append("a TorchFunctionMode is active")
    return found


def assert_clean(model: nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    found = leftover_hooks(model, optimizer)
    if found:
        raise CleanlinessError(f"{what}: " + "; ".join(found))


# =========================================================================== one variant
@dataclass
class Runner:
    """One variant's own model copy, optimizer, batch cursor and tool."""

    variant: str
    case: BenchCase
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    cursor: int = 0
    attached: bool = False
    incidents: int = 0
    attach_ms: list[float] = field(default_factory=list)
    detach_ms: list[float] = field(default_factory=list)
    guard_steps: list[int] = field(default_factory=list)
    _tool: Any = None
    _hf_debugger: Any = None
    _run_dirs: list[str] = field(default_factory=list)

    def step(self) -> tuple[float, float]:
        """One training step: (wall seconds, process CPU seconds)."""
        batch = self.batches[self.cursor % len(self.batches)]
        self.cursor += 1
        if self._tool is not None and self.variant in GUARDED:
            self.guard_steps.append(self._tool.step)
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.case.loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        t1 = time.perf_counter()
        return t1 - t0, time.process_time() - c0

    def check_clean(self, what: str) -> None:
        assert_clean(self.model, self.optimizer, f"{self.variant} variant {what}")

    def attach(self) -> None:
        """Turn the variant's tool on (untimed)."""
        assert not self.attached
        t0 = time.perf_counter()
        if self.variant == "plain":
            self.check_clean("before its block")
        elif self.variant in GUARDED:
            import nantrace

            self.check_clean("before nantrace.watch()")
            run_dir = None
            if self.variant == "nantrace_store":
                run_dir = tempfile.mkdtemp(prefix="nantrace-bench-run-")
                self._run_dirs.append(run_dir)
            config = None
            if self.variant == "nantrace_notape":  # the loss tape's share of the overhead
                config = nantrace.Config(localisation={"record_loss_code": False})
            if self.variant == "nantrace_sync":  # the synchronous check, to compare the sync-free mode with
                config = nantrace.Config(detection={"sync_free": False})
            elif self.variant == "nantrace" and os.environ.get(FUSED_ENV) == "1":
                config = nantrace.Config(detection={"sync_free": True})
            t0 = time.perf_counter()
            self._tool = nantrace.watch(self.model, self.optimizer, run_dir=run_dir, config=config)
            if torch.autograd.backward is _ORIGINAL_AUTOGRAD_BACKWARD:
                raise CleanlinessError("nantrace.watch() returned but torch.autograd.backward is not intercepted")
        elif self.variant == "detect_anomaly":
            self.check_clean("before detect_anomaly")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._tool = torch.autograd.detect_anomaly(check_nan=True)
                self._tool.__enter__()
        elif self.variant == "hf_debug":
            # DebugUnderflowOverflow has no remove(): it hooks this variant's own model copy
            # for good; no other variant ever runs that copy.
            if self._hf_debugger is None:
                from transformers.debug_utils import DebugUnderflowOverflow

                self._hf_debugger = DebugUnderflowOverflow(self.model)
        else:  # pragma: no cover - validated by the CLI
            raise ValueError(f"unknown variant {self.variant!r}")
        self.attach_ms.append((time.perf_counter() - t0) * 1e3)
        self.attached = True

    def detach(self) -> None:
        """Turn the tool off and check that nothing is left behind (untimed)."""
        assert self.attached
        t0 = time.perf_counter()
        if self.variant in GUARDED:
            self.incidents += len(self._tool.incidents)
            self._tool.close()
            self._tool = None
            for run_dir in self._run_dirs:
                shutil.rmtree(run_dir, ignore_errors=True)
            self._run_dirs.clear()
        elif self.variant == "detect_anomaly":
            self._tool.__exit__(None, None, None)
            self._tool = None
        self.detach_ms.append((time.perf_counter() - t0) * 1e3)
        self.attached = False
        if self.variant != "hf_debug":
            self.check_clean("after its tool was removed" if self.variant != "plain" else "after its block")

    @contextlib.contextmanager
    def on(self) -> Any:
        self.attach()
        try:
            yield self
        finally:
            self.detach()


def make_runner(case: BenchCase, variant: str, seed: int) -> Runner:
    model = copy.deepcopy(case.build(seed=seed))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=os.environ.get(FUSED_ENV) == "1" or None)
    return Runner(variant, case, model, opt, case.batches(N_BATCHES, seed=seed + 1))


def max_param_difference(sa: dict[str, torch.Tensor], sb: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k, t in sa.items():
        if t.is_floating_point():
            worst = max(worst, float((t - sb[k]).abs().max()))
        elif not torch.equal(t, sb[k]):
            worst = math.inf
    return worst


# =========================================================================== statistics
def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), ``xs`` non-empty."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval for the median from order statistics
    (binomial, no normality assumption); ``None`` when there are too few values."""
    n = len(xs)
    s = sorted(xs)
    for j in range(n // 2, -1, -1):  # symmetric interval [s[j], s[n-1-j]], widening
        k = n - 1 - j
        if k < j:
            continue
        cover = sum(math.comb(n, i) for i in range(j + 1, k + 1)) / 2**n
        if cover >= level:
            return s[j], s[k]
    return None


def ratio_of_sums_ci(num: Sequence[float], den: Sequence[float], level: float = 0.95,
                     resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap over rounds of sum(num) / sum(den)."""
    rng = random.Random(seed)
    n = len(num)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        stats.append(sum(num[i] for i in idx) / sum(den[i] for i in idx))
    return quantile(stats, (1 - level) / 2), quantile(stats, 1 - (1 - level) / 2)


def summarise(times: dict[str, list[list[float]]]) -> dict[str, dict[str, Any]]:
    """Per variant: median, IQR and mean (ms); ratios to plain of the medians, of the
    per-round block medians (median over rounds, 95% CI) and of the means (the amortised
    cost, rare expensive steps included; paired bootstrap CI over rounds)."""
    out: dict[str, dict[str, Any]] = {}
    plain = times.get("plain")
    plain_flat = [t for r in plain for t in r] if plain else []
    for v, rounds in times.items():
        flat = [t for r in rounds for t in r]
        med = statistics.median(flat)
        row: dict[str, Any] = {
            "steps": len(flat),
            "rounds": len(rounds),
            "median_ms": med * 1e3,
            "q1_ms": quantile(flat, 0.25) * 1e3,
            "q3_ms": quantile(flat, 0.75) * 1e3,
            "min_ms": min(flat) * 1e3,
            "max_ms": max(flat) * 1e3,
            "mean_ms": statistics.fmean(flat) * 1e3,
        }
        if plain:
            row["ratio_of_medians"] = med / statistics.median(plain_flat)
            per_round = [statistics.median(r) / statistics.median(p) for r, p in zip(rounds, plain)]
            row["per_round_ratios"] = per_round
            row["per_round_ratio_median"] = statistics.median(per_round)
            row["per_round_ratio_q1"] = quantile(per_round, 0.25)
            row["per_round_ratio_q3"] = quantile(per_round, 0.75)
            ci = median_ci(per_round)
            row["per_round_ratio_ci95"] = list(ci) if ci else None
            row["ratio_of_means"] = statistics.fmean(flat) / statistics.fmean(plain_flat)
            row["ratio_of_means_ci95"] = list(ratio_of_sums_ci([sum(r) for r in rounds], [sum(p) for p in plain]))
        out[v] = row
    return out


# =========================================================================== timing
class Worker:
    """A variant living in its own process; one block at a time, on request."""

    def __init__(self, name: str, variant: str, seed: int, threads: int | None) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", name, variant, "--seed", str(seed)]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        self.variant = variant
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, bufsize=1)
        self.ready = self._reply()

    def _died(self) -> RuntimeError:
        self.proc.wait()
        self.stderr.seek(0)
        return RuntimeError(f"{self.variant} worker died (exit code {self.proc.returncode}):\n{self.stderr.read()[-6000:]}")

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._died()
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.variant} worker failed:\n{msg['error']}")
        return msg

    def request(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise self._died() from None
        return self._reply()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def worker_main(name: str, variant: str, seed: int) -> int:
    """The worker's side: build, attach once, run blocks on request, detach and report."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr

    def send(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import nantrace  # noqa: F401  every worker imports the same modules (nothing is hooked by importing)
        import transformers.debug_utils  # noqa: F401

        runner = make_runner(CASES[name], variant, seed)
        runner.attach()
        send({"ready": True, "pid": os.getpid(), "attach_ms": runner.attach_ms[-1]})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "run":
                if variant == "plain":
                    runner.check_clean("before its block")
                gc.collect()
                wall, cpu = [], []
                for _ in range(cmd["n"]):
                    w, c = runner.step()
                    wall.append(w)
                    cpu.append(c)
                if variant == "plain":
                    runner.check_clean("after its block")
                send({"wall": wall, "cpu": cpu})
            elif cmd["cmd"] == "finish":
                runner.detach()
                torch.save(runner.model.state_dict(), cmd["save"])
                send({"incidents": runner.incidents, "detach_ms": runner.detach_ms[-1], "steps_trained": runner.cursor,
                      "guard_steps": runner.guard_steps, "nantrace_imported": "nantrace" in sys.modules})
                return 0
    except Exception:
        send({"error": traceback.format_exc()})
        return 1
    return 0


def time_model(name: str, variants: Sequence[str], *, isolation: str, rounds: int, steps: int, warmup: int,
               block_warmup: int, seed: int, threads: int | None, log: Callable[[str], None]) -> dict[str, Any]:
    case = CASES[name]
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    cpu: dict[str, list[list[float]]] = {v: [] for v in variants}
    load: list[dict[str, Any]] = []
    extra: dict[str, dict[str, Any]] = {v: {} for v in variants}
    states: dict[str, dict[str, torch.Tensor]] = {}

    if isolation == "process":
        workers = {}
        try:
            for v in variants:
                workers[v] = Worker(name, v, seed, threads)
                extra[v]["attach_ms"] = workers[v].ready["attach_ms"]

            def run_block(v: str, n: int) -> tuple[list[float], list[float]]:
                reply = workers[v].request(cmd="run", n=n)
                return reply["wall"], reply["cpu"]

            for _ in range(warmup):
                for v in variants:
                    run_block(v, 1)
            _rounds(variants, rounds, steps, run_block, times, cpu, load, name, log)
            with tempfile.TemporaryDirectory() as tmp:
                for v in variants:
                    path = os.path.join(tmp, f"{v}.pt")
                    done = workers[v].request(cmd="finish", save=path)
                    states[v] = torch.load(path)
                    extra[v].update(detach_ms=done["detach_ms"], incidents=done["incidents"],
                                    steps_trained=done["steps_trained"], nantrace_imported=done["nantrace_imported"])
                    if v in GUARDED:
                        extra[v]["guard_steps"] = done["guard_steps"]
        finally:
            for w in workers.values():
                w.close()
    else:
        runners = {v: make_runner(case, v, seed) for v in variants}

        def run_block(v: str, n: int) -> tuple[list[float], list[float]]:
            with runners[v].on():
                for _ in range(block_warmup):
                    runners[v].step()
                pairs = [runners[v].step() for _ in range(n)]
            return [p[0] for p in pairs], [p[1] for p in pairs]

        for _ in range(warmup):
            for v in variants:
                with runners[v].on():
                    runners[v].step()
        _rounds(variants, rounds, steps, run_block, times, cpu, load, name, log)
        for v, r in runners.items():
            states[v] = r.model.state_dict()
            extra[v].update(attach_ms=statistics.median(r.attach_ms), detach_ms=statistics.median(r.detach_ms),
                            incidents=r.incidents, steps_trained=r.cursor)

    summary = summarise(times)
    cpu_summary = summarise(cpu)
    for v in variants:
        summary[v].update({k: x for k, x in extra[v].items() if k != "guard_steps"})
        summary[v]["cpu_median_ms"] = cpu_summary[v]["median_ms"]
        summary[v]["cpu_per_round_ratio_median"] = cpu_summary[v].get("per_round_ratio_median")
        summary[v]["cpu_per_round_ratio_ci95"] = cpu_summary[v].get("per_round_ratio_ci95")
        summary[v]["cpu_ratio_of_means"] = cpu_summary[v].get("ratio_of_means")
    identical = {v: max_param_difference(states["plain"], states[v]) for v in variants if v != "plain"}
    return {
        "model": name,
        "description": case.description,
        "parameters": num_parameters(case.build(seed)),
        "isolation": isolation,
        "rounds": rounds,
        "steps_per_round": steps,
        "warmup_steps": warmup,
        "block_warmup_steps": block_warmup if isolation == "block" else 0,
        "order": "round-robin, first variant rotated each round",
        "times_s": times,
        "cpu_times_s": cpu,
        "nantrace_guard_steps": extra.get("nantrace", {}).get("guard_steps"),
        "per_round_load": load,
        "summary": summary,
        "max_abs_param_diff_vs_plain": identical,
    }


def _rounds(variants: Sequence[str], rounds: int, steps: int,
            run_block: Callable[[str, int], tuple[list[float], list[float]]],
            times: dict[str, list[list[float]]], cpu: dict[str, list[list[float]]], load: list[dict[str, Any]],
            name: str, log: Callable[[str], None]) -> None:
    for r in range(rounds):
        c0 = proc_stat_cpu()
        k = r % len(variants)
        for v in list(variants[k:]) + list(variants[:k]):  # rotate who goes first
            wall, c = run_block(v, steps)
            times[v].append(wall)
            cpu[v].append(c)
        load.append({"loadavg_1min": os.getloadavg()[0], "steal_share": steal_share(c0, proc_stat_cpu())})
        log(f"  {name} round {r + 1:>2}/{rounds}: " + "  ".join(
            f"{v} {statistics.median(times[v][-1]) * 1e3:7.2f}" for v in variants)
            + f"  (block medians, ms; load {load[-1]['loadavg_1min']:.1f})")


# =========================================================================== profile
def _is_nantrace(filename: str) -> bool:
    parts = Path(filename).parts
    return "nantrace" in parts and "benchmarks" not in parts


def profile_nantrace(name: str, *, steps: int, seed: int) -> dict[str, Any]:
    """cProfile ``steps`` steps of the nantrace variant (one guard, after one warm-up step).

    nantrace's own time = cumulative time of every nantrace function called from outside
    nantrace (hooks, the backward listener), plus the backward interceptor's own time (its
    cumulative time holds the whole backward pass). cProfile inflates Python-heavy code:
    read the shares as an upper bound and the ranking as the useful part.
    """
    import cProfile
    import pstats

    runner = make_runner(CASES[name], "nantrace", seed)
    with runner.on():
        runner.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            runner.step()
        prof.disable()
        wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own_total = 0.0
    rows = []
    for (fname, line, func), (_cc, ncalls, tottime, cumtime, callers) in stats.items():
        if not _is_nantrace(fname):
            continue
        rows.append({"function": f"{Path(fname).parent.name}/{Path(fname).name}:{line}({func})",
                     "calls_per_step": ncalls / steps, "cum_ms_per_step": cumtime / steps * 1e3,
                     "own_ms_per_step": tottime / steps * 1e3})
        is_interceptor = Path(fname).name == "patches.py" and func == "backward"
        from_outside = all(not _is_nantrace(c[0]) or (Path(c[0]).name == "patches.py" and c[2] == "backward")
                           for c in callers)
        if is_interceptor:
            own_total += tottime
        elif from_outside:
            own_total += cumtime
    rows.sort(key=lambda r: -r["cum_ms_per_step"])
    return {"model": name, "steps": steps, "step_ms_under_profiler": wall / steps * 1e3,
            "nantrace_ms_per_step": own_total / steps * 1e3, "nantrace_share": own_total / wall, "functions": rows}


def print_profile(prof: dict[str, Any], top: int = 18) -> None:
    print(f"\nprofile {prof['model']}: {prof['steps']} steps, {prof['step_ms_under_profiler']:.2f} ms/step under cProfile; "
          f"inside nantrace {prof['nantrace_ms_per_step']:.3f} ms/step ({100 * prof['nantrace_share']:.1f}% of the step)")
    print(f"  {'cum ms/step':>11} {'own ms/step':>11} {'calls/step':>10}  function")
    for r in prof["functions"][:top]:
        print(f"  {r['cum_ms_per_step']:11.3f} {r['own_ms_per_step']:11.3f} {r['calls_per_step']:10.2f}  {r['function']}")


# =========================================================================== memory
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: ``echo 5 > /proc/PID/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RSS reflects what is in use."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def mem_child(name: str, variant: str, steps: int, seed: int) -> dict[str, Any]:
    """In a fresh process: peak RSS of ``steps`` training steps minus the RSS just before.

    A throw-away copy first runs two steps of the same variant and is freed: that touches
    the code pages of every kernel and imports whatever the tools import lazily, so the
    working set counts allocations (activations, gradients, optimizer state, what a tool
    keeps), not first-touch library pages.
    """
    import nantrace  # noqa: F401  imported by every variant, so the baselines match
    import transformers.debug_utils  # noqa: F401

    case = CASES[name]
    scratch = make_runner(case, variant, seed)
    with scratch.on():
        for _ in range(2):
            scratch.step()
    del scratch
    gc.collect()
    _malloc_trim()
    runner = make_runner(case, variant, seed)
    with runner.on():
        gc.collect()
        _malloc_trim()
        baseline = _status_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        reset = _reset_peak()
        for _ in range(steps):
            runner.step()
        hwm = _status_kib("VmHWM") if reset else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak = hwm if hwm is not None else maxrss
    return {
        "model": name, "variant": variant, "steps": steps, "baseline_kib": baseline, "peak_kib": peak,
        "working_set_kib": peak - baseline, "ru_maxrss_kib": maxrss,
        "peak_source": "VmHWM after clear_refs reset" if hwm is not None else "ru_maxrss (lifetime peak)",
        "incidents": runner.incidents,
    }


def measure_memory(models: Sequence[str], variants: Sequence[str], *, repeats: int, steps: int, seed: int,
                   threads: int | None, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env = {**os.environ, **MEM_CHILD_ENV}
    for name in models:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(repeats):
            k = rep % len(variants)
            for v in list(variants[k:]) + list(variants[:k]):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--_mem-child", name, v,
                       "--mem-steps", str(steps), "--seed", str(seed)]
                if threads is not None:
                    cmd += ["--threads", str(threads)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise RuntimeError(f"memory child {name}/{v} failed:\n{proc.stderr[-4000:]}")
                runs[v].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        summary: dict[str, Any] = {}
        for v in variants:
            summary[v] = {
                "working_set_mib": statistics.median(r["working_set_kib"] for r in runs[v]) / 1024,
                "peak_mib": statistics.median(r["peak_kib"] for r in runs[v]) / 1024,
                "baseline_mib": statistics.median(r["baseline_kib"] for r in runs[v]) / 1024,
                "working_set_spread_mib": (max(r["working_set_kib"] for r in runs[v])
                                           - min(r["working_set_kib"] for r in runs[v])) / 1024,
            }
        for v in variants:
            summary[v]["working_set_ratio"] = summary[v]["working_set_mib"] / summary["plain"]["working_set_mib"]
            summary[v]["peak_ratio"] = summary[v]["peak_mib"] / summary["plain"]["peak_mib"]
        log(f"  memory {name}: " + "  ".join(f"{v} {summary[v]['working_set_mib']:.1f} MiB" for v in variants))
        out[name] = {"runs": runs, "summary": summary}
    return out


# =========================================================================== machine
def proc_stat_cpu() -> dict[str, int] | None:
    """Aggregate CPU jiffies from /proc/stat (steal = time a VM's vCPUs waited for the host)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: int(v) for n, v in zip(names, fields)}


def steal_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    if not before or not after:
        return None
    total = sum(after.values()) - sum(before.values())
    return (after["steal"] - before["steal"]) / total if total > 0 else None


def environment(threads_set: int | None) -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "threads_set_by_flag": threads_set,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "malloc_env": {k: os.environ.get(k) for k in TIMING_MALLOC_ENV},
    }
    with contextlib.suppress(Exception):
        import hashlib

        import nantrace

        env["nantrace"] = nantrace.__version__
        root = Path(nantrace.__file__).parent
        digest = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
        env["nantrace_source_sha256"] = digest.hexdigest()[:16]  # which code was measured
    with contextlib.suppress(Exception):
        import transformers

        env["transformers"] = transformers.__version__
    with contextlib.suppress(Exception):
        rev = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--", "../src"],
                               capture_output=True, text=True)
        env["git_commit"] = (rev.stdout.strip() or None)
        env["src_dirty"] = bool(dirty.stdout.strip())
    return env


# =========================================================================== report
def _ratio_ci(value: float | None, ci: Sequence[float] | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def print_report(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    env = results["environment"]
    console.print(
        f"[bold]nantrace overhead[/bold]  cpu={env['cpu']!s} ({env['cpus_available']} usable cores)  "
        f"torch={env['torch']}  threads={env['torch_threads']} (interop {env['torch_interop_threads']}"
        f"{', set by --threads' if env['threads_set_by_flag'] else ', torch default'})  "
        f"transformers={env.get('transformers')}  nantrace={env.get('nantrace')} "
        f"(git {env.get('git_commit')}{', src modified' if env.get('src_dirty') else ''}, "
        f"source {env.get('nantrace_source_sha256')})"
    )
    if results.get("timing"):
        first = next(iter(results["timing"].values()))
        table = Table(title=f"Step time (CPU; isolation={first['isolation']}; variants interleaved round-robin)")
        for col, just in [("model", "left"), ("variant", "left"), ("steps", "right"), ("median ms", "right"),
                          ("IQR ms", "right"), ("× plain: medians", "right"),
                          ("× plain: per-round median [95% CI]", "right"), ("mean ms", "right"),
                          ("× plain: means [95% CI]", "right"), ("CPU time × plain (per round)", "right")]:
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for name, res in results["timing"].items():
            for i, (v, row) in enumerate(res["summary"].items()):
                table.add_row(
                    name if i == 0 else "", v, str(row["steps"]), f"{row['median_ms']:.2f}",
                    f"{row['q1_ms']:.2f} – {row['q3_ms']:.2f}",
                    f"{row['ratio_of_medians']:.3f}",
                    _ratio_ci(row["per_round_ratio_median"], row["per_round_ratio_ci95"] if v != "plain" else None),
                    f"{row['mean_ms']:.2f}",
                    _ratio_ci(row["ratio_of_means"], row["ratio_of_means_ci95"] if v != "plain" else None),
                    _ratio_ci(row.get("cpu_per_round_ratio_median"), None),
                )
            table.add_section()
        console.print(table)
        for name, res in results["timing"].items():
            notes = [f"{v} {'identical' if d == 0 else f'max |Δparam| {d:.2e}'}"
                     for v, d in res["max_abs_param_diff_vs_plain"].items()]
            console.print(f"  {name}: weights after training vs plain: " + "; ".join(notes))
            nt = res["summary"].get("nantrace")
            if nt:
                console.print(f"  {name}: nantrace watch() {nt['attach_ms']:.2f} ms, close() {nt['detach_ms']:.3f} ms "
                              f"(untimed), incidents {nt['incidents']}")
            loads = [r["loadavg_1min"] for r in res["per_round_load"]]
            steals = [r["steal_share"] for r in res["per_round_load"] if r["steal_share"] is not None]
            busy = max(loads) > (env["cpus_available"] or 1) + 0.5
            console.print(f"  {name}: 1-min load average during the rounds: median {statistics.median(loads):.1f}, "
                          f"max {max(loads):.1f}" + (f"; CPU steal median {100 * statistics.median(steals):.1f}%" if steals else "")
                          + ("  [bold red]machine was busy: step times are unreliable[/bold red]" if busy else ""))
    if results.get("memory"):
        table = Table(title="Peak memory (one fresh process per model × variant; median of repeats)")
        for col in ("model", "variant", "training working set MiB", "× plain", "spread MiB", "process peak MiB", "× plain "):
            table.add_column(col, justify="left" if col in ("model", "variant") else "right")
        for name, res in results["memory"].items():
            for i, (v, row) in enumerate(res["summary"].items()):
                table.add_row(name if i == 0 else "", v, f"{row['working_set_mib']:.1f}", f"{row['working_set_ratio']:.3f}",
                              f"{row['working_set_spread_mib']:.1f}", f"{row['peak_mib']:.1f}", f"{row['peak_ratio']:.3f}")
            table.add_section()
        console.print(table)
        console.print("  working set = peak RSS during the measured steps minus RSS right before them (model, optimizer, "
                      "data and tool set up; code pages already touched); process peak = the peak RSS itself. "
                      "spread = max - min over repeats.")


# =========================================================================== CLI
def _csv(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad) or '(none)'}; expected a comma-separated subset of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,cnn,mlp", type=lambda s: _csv(s, tuple(CASES), "model"),
                   help="comma-separated models from benchmarks/models.py (default: gpt,cnn,mlp)")
    p.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: _csv(s, VARIANTS, "variant"),
                   help="comma-separated variants (default: all); plain is always added, ratios need it")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help=f"round-robin rounds per model (default {DEFAULT_ROUNDS})")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help="timed steps per variant block; default per model: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()))
    p.add_argument("--isolation", choices=("process", "block"), default="process",
                   help="process: one long-lived worker per variant, tool attached once (default); "
                        "block: one process, tool attached and removed around every block")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant before round 1 (default 3)")
    p.add_argument("--block-warmup", type=int, default=1,
                   help="--isolation block only: untimed steps at the start of every block, after the tool is attached (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N); default: leave torch's default")
    p.add_argument("--seed", type=int, default=0, help="weights seed (batches use seed+1)")
    p.add_argument("--json", type=Path, default=None, help="write every raw step time and summary to this JSON file")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure peak memory in subprocesses (default on; --no-memory to skip)")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                   help="run the step-time benchmark (default on; --no-timing for memory only)")
    p.add_argument("--mem-repeats", type=int, default=2, help="subprocess runs per model x variant (default 2; median kept)")
    p.add_argument("--mem-steps", type=int, default=10, help="training steps in each memory subprocess (default 10)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also cProfile STEPS steps of the nantrace variant per model and print where its time goes (default off)")
    p.add_argument("--fixed-malloc", action=argparse.BooleanOptionalAction, default=True,
                   help="re-run under fixed glibc malloc settings (see TIMING_MALLOC_ENV) so every process allocates "
                        "alike (default on; --no-fixed-malloc keeps the environment's)")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines on stderr")
    p.add_argument("--fused", action="store_true",
                   help="fused AdamW in every variant (nantrace's default then decides each step on the device)")
    p.add_argument("--_mem-child", nargs=2, metavar=("MODEL", "VARIANT"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--_worker", nargs=2, metavar=("MODEL", "VARIANT"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "plain" in args.variants:
        args.variants.remove("plain")
    args.variants.insert(0, "plain")
    for name in ("rounds", "mem_repeats", "mem_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "block_warmup", "profile"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.steps_per_round is not None and args.steps_per_round < 1:
        p.error("--steps-per-round must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fused:
        os.environ[FUSED_ENV] = "1"
    if (argv is None and args.fixed_malloc and not args._worker and not args._mem_child
            and any(os.environ.get(k) != v for k, v in TIMING_MALLOC_ENV.items())):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TIMING_MALLOC_ENV})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
    if args._worker:
        return worker_main(args._worker[0], args._worker[1], args.seed)
    if args._mem_child:
        name, variant = args._mem_child
        print(json.dumps(mem_child(name, variant, args.mem_steps, args.seed)))
        return 0

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    env = environment(args.threads)
    log(f"torch {env['torch']}, {env['torch_threads']} intra-op threads "
        f"({'set by --threads' if args.threads else 'torch default'}), {env['cpus_available']} usable cores, cpu {env['cpu']}")
    results: dict[str, Any] = {"environment": env, "argv": sys.argv, "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")}}
    t_start = time.perf_counter()
    cpu_before = proc_stat_cpu()
    if args.timing:
        results["timing"] = {}
        for name in args.models:
            steps = args.steps_per_round or DEFAULT_STEPS.get(name, 20)
            log(f"timing {name}: {args.rounds} rounds x {steps} steps x {len(args.variants)} variants, isolation {args.isolation}")
            t0, c0 = time.perf_counter(), proc_stat_cpu()
            res = time_model(name, args.variants, isolation=args.isolation, rounds=args.rounds, steps=steps,
                             warmup=args.warmup, block_warmup=args.block_warmup, seed=args.seed, threads=args.threads, log=log)
            res["wall_s"] = time.perf_counter() - t0
            res["cpu_steal_share"] = steal_share(c0, proc_stat_cpu())
            results["timing"][name] = res
            log(f"  {name} done in {res['wall_s']:.0f} s")
    if args.memory:
        log(f"memory: {args.mem_repeats} subprocess runs x {args.mem_steps} steps per model x variant")
        results["memory"] = measure_memory(args.models, args.variants, repeats=args.mem_repeats, steps=args.mem_steps,
                                           seed=args.seed, threads=args.threads, log=log)
    if args.profile:
        results["profile"] = {name: profile_nantrace(name, steps=args.profile, seed=args.seed) for name in args.models}
    results["wall_s"] = time.perf_counter() - t_start
    results["cpu_steal_share"] = steal_share(cpu_before, proc_stat_cpu())
    print_report(results)
    for prof in results.get("profile", {}).values():
        print_profile(prof)
    steal = results["cpu_steal_share"]
    print(f"total wall time {results['wall_s']:.0f} s"
          + (f"; CPU steal (host contention) {100 * steal:.1f}% of CPU time" if steal is not None else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"raw figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
