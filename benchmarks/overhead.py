"""Step-time and peak-memory overhead of nantrace against a plain loop and other tools.

Variants, each training its own identical copy of the model (same initial weights, same
batches, same order), timed in ONE process and interleaved round-robin so that machine
noise (frequency changes, neighbours, thermal drift) hits every variant alike:

- ``plain``           zero_grad, forward, loss, backward, AdamW step; nothing hooked
- ``nantrace``        the same loop under ``nantrace.watch(model, optimizer)`` (defaults)
- ``detect_anomaly``  the same loop inside ``torch.autograd.detect_anomaly(check_nan=True)``
- ``hf_debug``        ``transformers.debug_utils.DebugUnderflowOverflow(model)`` attached

Peak memory is measured apart, one fresh subprocess per (model, variant) pair.

Usage::

    python benchmarks/overhead.py                        # everything, ~8-10 min on 2 cores
    python benchmarks/overhead.py --models gpt --variants plain,nantrace --rounds 10
    python benchmarks/overhead.py --no-memory --json runs/bench/overhead.json

    # prints, per model and variant (figures here are illustrative):
    #  model  variant         median ms   IQR ms          × plain  per-round × [95% CI]
    #  gpt    plain               190.2   188.9 – 192.0    1.000   1.000
    #  gpt    nantrace            197.5   ...              1.038   1.036 [1.02, 1.05]
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
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
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

VARIANTS = ("plain", "nantrace", "detect_anomaly", "hf_debug")
DEFAULT_STEPS = {"gpt": 5, "cnn": 15, "mlp": 30}
"""Timed steps per variant block, per model (``--steps-per-round`` overrides all)."""
DEFAULT_ROUNDS = 24
N_BATCHES = 16
LR = 3e-4


# =========================================================================== variants
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
    for name, p in model.named_parameters():
        if getattr(p, "_backward_hooks", None):
            found.append(f"parameter {name!r} has tensor hooks")
        if getattr(p, "_post_accumulate_grad_hooks", None):
            found.append(f"parameter {name!r} has post-accumulate-grad hooks")
    if optimizer is not None:
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            if getattr(optimizer, attr, None):
                found.append(f"optimizer has {attr}: {len(getattr(optimizer, attr))}")
        from torch.optim import optimizer as optim_mod

        for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            if getattr(optim_mod, attr, None):
                found.append(f"torch.optim.optimizer.{attr} is not empty")
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        found.append(f"a TorchDispatchMode is active: {_get_current_dispatch_mode()!r}")
    if torch._C._is_torch_function_mode_enabled() and torch.overrides._get_current_function_mode() is not None:
        found.append("a TorchFunctionMode is active")
    return found


def assert_clean(model: nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    found = leftover_hooks(model, optimizer)
    if found:
        raise CleanlinessError(f"{what}: " + "; ".join(found))


@dataclass
class Runner:
    """One variant's own model copy, optimizer and batch cursor."""

    variant: str
    case: BenchCase
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Any]
    cursor: int = 0
    hf_debugger: Any = None
    incidents: int = 0
    attach_ms: list[float] = field(default_factory=list)
    detach_ms: list[float] = field(default_factory=list)
    _guard: Any = None

    cpu_times: list[float] = field(default_factory=list)

    def step(self) -> float:
        """One training step; its wall time in seconds (its process CPU time goes to ``cpu_times``)."""
        batch = self.batches[self.cursor % len(self.batches)]
        self.cursor += 1
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.case.loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        t1 = time.perf_counter()
        self.cpu_times.append(time.process_time() - c0)
        return t1 - t0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The variant's tooling, on for one block of steps (setup and tear-down untimed)."""
        if self.variant == "plain":
            assert_clean(self.model, self.optimizer, "plain variant before its block")
            yield
            assert_clean(self.model, self.optimizer, "plain variant after its block")
        elif self.variant == "nantrace":
            import nantrace

            assert_clean(self.model, self.optimizer, "nantrace variant before watch()")
            t0 = time.perf_counter()
            guard = nantrace.watch(self.model, self.optimizer)
            self.attach_ms.append((time.perf_counter() - t0) * 1e3)
            self._guard = guard
            try:
                if torch.autograd.backward is _ORIGINAL_AUTOGRAD_BACKWARD:
                    raise CleanlinessError("nantrace.watch() returned but torch.autograd.backward is not intercepted")
                yield
            finally:
                self.incidents += len(guard.incidents)
                t0 = time.perf_counter()
                guard.close()
                self.detach_ms.append((time.perf_counter() - t0) * 1e3)
                self._guard = None
            assert_clean(self.model, self.optimizer, "nantrace variant after guard.close()")
        elif self.variant == "detect_anomaly":
            assert_clean(self.model, self.optimizer, "detect_anomaly variant before its block")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.autograd.detect_anomaly(check_nan=True):
                    yield
        elif self.variant == "hf_debug":
            # DebugUnderflowOverflow has no remove(): it hooks this variant's own model copy
            # for good; no other variant ever runs that copy.
            if self.hf_debugger is None:
                from transformers.debug_utils import DebugUnderflowOverflow

                t0 = time.perf_counter()
                self.hf_debugger = DebugUnderflowOverflow(self.model)
                self.attach_ms.append((time.perf_counter() - t0) * 1e3)
            yield
        else:  # pragma: no cover - validated by the CLI
            raise ValueError(f"unknown variant {self.variant!r}")


def make_runners(case: BenchCase, variants: Sequence[str], seed: int) -> dict[str, Runner]:
    template = case.build(seed=seed)
    batches = case.batches(N_BATCHES, seed=seed + 1)
    runners = {}
    for v in variants:
        model = copy.deepcopy(template)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        runners[v] = Runner(v, case, model, opt, batches)
    return runners


def max_param_difference(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
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
    best = None
    for j in range(n // 2, -1, -1):  # symmetric interval [s[j], s[n-1-j]]
        k = n - 1 - j
        if k < j:
            continue
        cover = sum(math.comb(n, i) for i in range(j + 1, k + 1)) / 2**n
        if cover >= level:
            best = (s[j], s[k])
            break
    return best


def summarise(times: dict[str, list[list[float]]]) -> dict[str, dict[str, Any]]:
    """Per variant: pooled median and IQR (ms), ratio of medians to plain, and the median
    of per-round ratios (variant block median / plain block median, same round)."""
    out: dict[str, dict[str, Any]] = {}
    plain = times.get("plain")
    plain_med = statistics.median([t for r in plain for t in r]) if plain else None
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
            "mean_ms": statistics.fmean(flat) * 1e3,
        }
        if plain:
            row["ratio_of_medians"] = med / plain_med
            per_round = [statistics.median(r) / statistics.median(p) for r, p in zip(rounds, plain)]
            row["per_round_ratios"] = per_round
            row["per_round_ratio_median"] = statistics.median(per_round)
            row["per_round_ratio_q1"] = quantile(per_round, 0.25)
            row["per_round_ratio_q3"] = quantile(per_round, 0.75)
            ci = median_ci(per_round)
            row["per_round_ratio_ci95"] = list(ci) if ci else None
        out[v] = row
    return out


# =========================================================================== timing
def time_model(name: str, variants: Sequence[str], *, rounds: int, steps: int, warmup: int,
               block_warmup: int, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    case = CASES[name]
    runners = make_runners(case, variants, seed)
    # Global warm-up: every variant, round-robin, untimed (allocator, caches, lazy init).
    for _ in range(warmup):
        for v in variants:
            with runners[v].active():
                runners[v].step()
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    cpu: dict[str, list[list[float]]] = {v: [] for v in variants}
    load: list[dict[str, Any]] = []
    for r in range(rounds):
        c0 = proc_stat_cpu()
        k = r % len(variants)
        order = list(variants[k:]) + list(variants[:k])  # rotate who goes first
        for v in order:
            runner = runners[v]
            gc.collect()
            with runner.active():
                for _ in range(block_warmup):
                    runner.step()
                runner.cpu_times.clear()
                times[v].append([runner.step() for _ in range(steps)])
                cpu[v].append(list(runner.cpu_times))
        load.append({"loadavg_1min": os.getloadavg()[0], "steal_share": steal_share(c0, proc_stat_cpu())})
        log(f"  {name} round {r + 1:>2}/{rounds}: " + "  ".join(
            f"{v} {statistics.median(times[v][-1]) * 1e3:7.2f}" for v in variants)
            + f"  (block medians, ms; load {load[-1]['loadavg_1min']:.1f})")
    summary = summarise(times)
    cpu_summary = summarise(cpu)
    for v in variants:
        summary[v]["cpu_median_ms"] = cpu_summary[v]["median_ms"]
        summary[v]["cpu_ratio_of_medians"] = cpu_summary[v].get("ratio_of_medians")
        summary[v]["cpu_per_round_ratio_median"] = cpu_summary[v].get("per_round_ratio_median")
        summary[v]["cpu_per_round_ratio_ci95"] = cpu_summary[v].get("per_round_ratio_ci95")
        summary[v]["cpu_q1_ms"] = cpu_summary[v]["q1_ms"]
        summary[v]["cpu_q3_ms"] = cpu_summary[v]["q3_ms"]
    identical = {}
    if "plain" in runners:
        for v in variants:
            if v != "plain":
                identical[v] = max_param_difference(runners["plain"].model, runners[v].model)
    for v in variants:
        summary[v]["attach_ms_median"] = statistics.median(runners[v].attach_ms) if runners[v].attach_ms else None
        summary[v]["detach_ms_median"] = statistics.median(runners[v].detach_ms) if runners[v].detach_ms else None
        summary[v]["incidents"] = runners[v].incidents
        summary[v]["steps_trained"] = runners[v].cursor
    return {
        "model": name,
        "description": case.description,
        "parameters": num_parameters(runners[variants[0]].model),
        "rounds": rounds,
        "steps_per_round": steps,
        "warmup_steps": warmup,
        "block_warmup_steps": block_warmup,
        "order": "round-robin, first variant rotated each round",
        "times_s": times,
        "cpu_times_s": cpu,
        "per_round_load": load,
        "summary": summary,
        "max_abs_param_diff_vs_plain": identical,
    }


# =========================================================================== profile
def _is_nantrace(filename: str) -> bool:
    parts = Path(filename).parts
    return "nantrace" in parts and "benchmarks" not in parts


def profile_nantrace(name: str, *, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """cProfile the nantrace variant: time spent inside nantrace per step, by function.

    nantrace's own time = cumulative time of every nantrace function that is called from
    outside nantrace (hooks, the backward listener), plus the interceptor's own time
    (its cumulative time holds the whole backward pass). cProfile inflates Python-heavy
    code, so read the shares as an upper bound and the ranking as the useful part.
    """
    import cProfile
    import pstats

    runner = make_runners(CASES[name], ["nantrace"], seed)["nantrace"]
    with runner.active():
        for _ in range(warmup):
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
        short = f"{Path(fname).parent.name}/{Path(fname).name}:{line}({func})"
        rows.append({"function": short, "calls_per_step": ncalls / steps,
                     "cum_ms_per_step": cumtime / steps * 1e3, "own_ms_per_step": tottime / steps * 1e3})
        is_interceptor = Path(fname).name == "_interception.py" and func == "_backward"
        from_outside = all(not _is_nantrace(c[0]) or (Path(c[0]).name == "_interception.py" and c[2] == "_backward")
                           for c in callers)
        if is_interceptor:
            own_total += tottime
        elif from_outside:
            own_total += cumtime
    rows.sort(key=lambda r: -r["cum_ms_per_step"])
    return {"model": name, "steps": steps, "step_ms_under_profiler": wall / steps * 1e3,
            "nantrace_ms_per_step": own_total / steps * 1e3, "nantrace_share": own_total / wall, "functions": rows}


def print_profile(prof: dict[str, Any], top: int = 15) -> None:
    print(f"\nprofile {prof['model']}: {prof['steps']} steps, {prof['step_ms_under_profiler']:.2f} ms/step under cProfile; "
          f"inside nantrace {prof['nantrace_ms_per_step']:.3f} ms/step ({100 * prof['nantrace_share']:.1f}% of the step)")
    print(f"  {'cum ms/step':>11} {'own ms/step':>11} {'calls/step':>10}  function")
    for r in prof["functions"][:top]:
        print(f"  {r['cum_ms_per_step']:11.3f} {r['own_ms_per_step']:11.3f} {r['calls_per_step']:10.1f}  {r['function']}")


# =========================================================================== memory
def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
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


def mem_child(name: str, variant: str, steps: int, seed: int) -> dict[str, Any]:
    """Run in a fresh process: peak RSS of ``steps`` training steps minus the RSS just before."""
    import nantrace  # noqa: F401  imported by every variant, so the baselines match
    import transformers.debug_utils  # noqa: F401

    case = CASES[name]
    runner = make_runners(case, [variant], seed)[variant]
    with runner.active():
        gc.collect()
        baseline = _rss_kib()
        reset = _reset_peak()
        for _ in range(steps):
            runner.step()
        hwm = _hwm_kib() if reset else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak = hwm if hwm is not None else maxrss
    return {
        "model": name,
        "variant": variant,
        "steps": steps,
        "baseline_kib": baseline,
        "peak_kib": peak,
        "working_set_kib": peak - baseline,
        "ru_maxrss_kib": maxrss,
        "peak_source": "VmHWM after clear_refs reset" if hwm is not None else "ru_maxrss (lifetime peak)",
        "incidents": runner.incidents,
    }


def measure_memory(models: Sequence[str], variants: Sequence[str], *, repeats: int, steps: int, seed: int,
                   threads: int | None, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in models:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(repeats):
            k = rep % len(variants)
            for v in list(variants[k:]) + list(variants[:k]):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--_mem-child", name, v,
                       "--mem-steps", str(steps), "--seed", str(seed)]
                if threads is not None:
                    cmd += ["--threads", str(threads)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"memory child {name}/{v} failed:\n{proc.stderr[-4000:]}")
                runs[v].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        summary: dict[str, Any] = {}
        for v in variants:
            ws = statistics.median(r["working_set_kib"] for r in runs[v])
            peak = statistics.median(r["peak_kib"] for r in runs[v])
            summary[v] = {"working_set_mib": ws / 1024, "peak_mib": peak / 1024,
                          "baseline_mib": statistics.median(r["baseline_kib"] for r in runs[v]) / 1024}
        if "plain" in summary:
            for v in variants:
                summary[v]["working_set_ratio"] = summary[v]["working_set_mib"] / summary["plain"]["working_set_mib"]
                summary[v]["peak_ratio"] = summary[v]["peak_mib"] / summary["plain"]["peak_mib"]
        log(f"  memory {name}: " + "  ".join(f"{v} {summary[v]['working_set_mib']:.1f} MiB" for v in variants))
        out[name] = {"runs": runs, "summary": summary}
    return out


# =========================================================================== report
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
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "threads_set_by_flag": threads_set,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    with contextlib.suppress(Exception):
        import nantrace

        env["nantrace"] = nantrace.__version__
        import hashlib

        root = Path(nantrace.__file__).parent
        digest = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
        env["nantrace_source_sha256"] = digest.hexdigest()[:16]  # the code measured (the tree moves)
    with contextlib.suppress(Exception):
        import transformers

        env["transformers"] = transformers.__version__
    with contextlib.suppress(Exception):
        rev = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        env["git_commit"] = rev.stdout.strip() or None
    return env


def _ratio_ci(median: float | None, ci: Sequence[float] | None) -> str:
    if median is None:
        return "n/a"
    return f"{median:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{median:.3f}"


def print_report(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    env = results["environment"]
    console.print(
        f"[bold]nantrace overhead[/bold]  cpu={env['cpu']!s} ({env['cpus_available']} usable cores)  "
        f"torch={env['torch']}  threads={env['torch_threads']} (interop {env['torch_interop_threads']})  "
        f"transformers={env.get('transformers')}  nantrace={env.get('nantrace')}"
    )
    if results.get("timing"):
        table = Table(title="Step time (CPU, one process, variants interleaved round-robin)")
        for col, just in [("model", "left"), ("variant", "left"), ("steps", "right"), ("median ms", "right"),
                          ("IQR ms (q1 – q3)", "right"), ("× plain (medians)", "right"),
                          ("× plain per round: median [95% CI]", "right"), ("per-round IQR", "right"),
                          ("CPU-time × plain per round [95% CI]", "right")]:
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for name, res in results["timing"].items():
            for v, row in res["summary"].items():
                ratio = row.get("ratio_of_medians")
                ci = row.get("per_round_ratio_ci95")
                table.add_row(
                    name if v == next(iter(res["summary"])) else "",
                    v,
                    str(row["steps"]),
                    f"{row['median_ms']:.2f}",
                    f"{row['q1_ms']:.2f} – {row['q3_ms']:.2f}",
                    f"{ratio:.3f}" if ratio is not None else "n/a",
                    _ratio_ci(row.get("per_round_ratio_median"), ci),
                    f"{row['per_round_ratio_q1']:.3f} – {row['per_round_ratio_q3']:.3f}" if ratio is not None else "n/a",
                    _ratio_ci(row.get("cpu_per_round_ratio_median"), row.get("cpu_per_round_ratio_ci95")),
                )
            table.add_section()
        console.print(table)
        for name, res in results["timing"].items():
            notes = []
            for v, d in res["max_abs_param_diff_vs_plain"].items():
                notes.append(f"{v} {'identical' if d == 0 else f'max |Δparam| {d:.2e}'}")
            nt = res["summary"].get("nantrace")
            if nt:
                notes.append(f"nantrace watch() {nt['attach_ms_median']:.2f} ms, close() {nt['detach_ms_median']:.3f} ms "
                             f"(untimed), incidents {nt['incidents']}")
            console.print(f"  {name}: weights after training vs plain: " + "; ".join(notes))
            loads = [r["loadavg_1min"] for r in res["per_round_load"]]
            steals = [r["steal_share"] for r in res["per_round_load"] if r["steal_share"] is not None]
            busy = max(loads) > (env["cpus_available"] or 1) + 0.5
            console.print(f"  {name}: 1-min load average during rounds: median {statistics.median(loads):.1f}, max {max(loads):.1f}"
                          + (f"; CPU steal median {100 * statistics.median(steals):.1f}%" if steals else "")
                          + ("  [bold red]machine was busy: step times are unreliable[/bold red]" if busy else ""))
    if results.get("memory"):
        table = Table(title="Peak memory (one fresh process per model × variant; median of repeats)")
        for col in ("model", "variant", "training working set MiB", "× plain", "process peak MiB", "× plain "):
            table.add_column(col, justify="left" if col in ("model", "variant") else "right")
        for name, res in results["memory"].items():
            first = True
            for v, row in res["summary"].items():
                table.add_row(name if first else "", v, f"{row['working_set_mib']:.1f}",
                              f"{row.get('working_set_ratio', float('nan')):.3f}", f"{row['peak_mib']:.1f}",
                              f"{row.get('peak_ratio', float('nan')):.3f}")
                first = False
            table.add_section()
        console.print(table)
        console.print("  working set = peak RSS during the measured steps minus RSS right before them "
                      "(model, optimizer, data and tool already set up); process peak = the peak RSS itself.")


# =========================================================================== CLI
def _csv(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none)'}; expected a comma-separated subset of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,cnn,mlp", type=lambda s: _csv(s, tuple(CASES), "model"),
                   help="comma-separated models from benchmarks/models.py (default: gpt,cnn,mlp)")
    p.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: _csv(s, VARIANTS, "variant"),
                   help="comma-separated variants (default: all); plain is always added, ratios need it")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help=f"round-robin rounds per model (default {DEFAULT_ROUNDS})")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help="timed steps per variant block; default per model: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()))
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant before round 1 (default 3)")
    p.add_argument("--block-warmup", type=int, default=1,
                   help="untimed steps at the start of every block, after the tool is attached (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N); default: leave torch's default")
    p.add_argument("--seed", type=int, default=0, help="weights seed (batches use seed+1)")
    p.add_argument("--json", type=Path, default=None, help="write every raw step time and summary to this JSON file")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure peak memory in subprocesses (default on; --no-memory to skip)")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                   help="run the step-time benchmark (default on; --no-timing for memory only)")
    p.add_argument("--mem-repeats", type=int, default=3, help="subprocess runs per model x variant (default 3; median kept)")
    p.add_argument("--mem-steps", type=int, default=10, help="training steps in each memory subprocess (default 10)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also cProfile STEPS steps of the nantrace variant per model and print where its time goes (default off)")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines on stderr")
    p.add_argument("--_mem-child", nargs=2, metavar=("MODEL", "VARIANT"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    else:
        args.variants.remove("plain")
        args.variants.insert(0, "plain")
    for name in ("rounds", "warmup", "mem_repeats", "mem_steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.steps_per_round is not None and args.steps_per_round < 1:
        p.error("--steps-per-round must be >= 1")
    if args.block_warmup < 0:
        p.error("--block-warmup must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")
    if args._mem_child:
        name, variant = args._mem_child
        print(json.dumps(mem_child(name, variant, args.mem_steps, args.seed)))
        return 0

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    env = environment(args.threads)
    log(f"torch {env['torch']}, {env['torch_threads']} intra-op threads ({'set by --threads' if args.threads else 'torch default'}), "
        f"{env['cpus_available']} usable cores, cpu {env['cpu']}")
    results: dict[str, Any] = {"environment": env, "argv": sys.argv, "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "_mem_child"}}
    t_start = time.perf_counter()
    cpu_before = proc_stat_cpu()
    if args.timing:
        results["timing"] = {}
        for name in args.models:
            steps = args.steps_per_round or DEFAULT_STEPS.get(name, 20)
            log(f"timing {name}: {args.rounds} rounds x {steps} steps x {len(args.variants)} variants")
            t0, c0 = time.perf_counter(), proc_stat_cpu()
            results["timing"][name] = time_model(
                name, args.variants, rounds=args.rounds, steps=steps, warmup=args.warmup,
                block_warmup=args.block_warmup, seed=args.seed, log=log)
            results["timing"][name]["wall_s"] = time.perf_counter() - t0
            results["timing"][name]["cpu_steal_share"] = steal_share(c0, proc_stat_cpu())
            log(f"  {name} done in {results['timing'][name]['wall_s']:.0f} s")
    if args.memory:
        log(f"memory: {args.mem_repeats} subprocess runs x {args.mem_steps} steps per model x variant")
        results["memory"] = measure_memory(args.models, args.variants, repeats=args.mem_repeats, steps=args.mem_steps,
                                           seed=args.seed, threads=args.threads, log=log)
    if args.profile:
        results["profile"] = {name: profile_nantrace(name, steps=args.profile, warmup=max(args.warmup, 1), seed=args.seed)
                              for name in args.models}
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
