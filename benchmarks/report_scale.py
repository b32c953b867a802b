"""Time ``nantrace report`` on a large synthetic run: 100,000 steps × 200 layers.

Writes a synthetic run store (steps, per-layer statistics, sampled activation statistics
and a few incidents, with NaN/Inf values, skipped steps, a dead layer and a gradient
explosion in it), then renders the report and prints how long it took and how large the
HTML file is. The store is written with plain ``executemany`` in one transaction, so
writing it takes a fraction of the time the guard would need.

Usage::

    python benchmarks/report_scale.py                          # 100,000 × 200, in a temp dir
    python benchmarks/report_scale.py --steps 20000 --layers 50 --keep runs/bench/scale
    python benchmarks/report_scale.py --json runs/bench/report_scale.json
    python benchmarks/report_scale.py --keep /tmp/scale            # keep the store, then:
    python benchmarks/report_scale.py --reuse /tmp/scale --exact   # every layer row aggregated

    # prints e.g.
    #  store  100000 steps × 200 layers (20,000,000 layer rows) written in 49.2 s, 696.1 MB
    #  report 9.5 s, 12.1 MB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from nantrace.incident import Incident
from nantrace.report.render import render_report
from nantrace.storage.runstore import DB_NAME, RunStore

_CHUNK = 500  # steps per executemany batch of layer rows


def _incident(step: int, kind: str, cause: str, **fields: object) -> Incident:
    base: dict[str, object] = dict(
        step=step, kind=kind, phase="backward", op=None, module=None, source=None, rank=0, cause=cause,
        summary=f"synthetic {kind} at step {step}", fix="synthetic: nothing to fix", action="skipped",
    )
    base.update(fields)
    return Incident(**base)  # type: ignore[arg-type]


def write_store(run_dir: Path, steps: int, layers: int, seed: int = 0) -> dict[str, float]:
    """Write a synthetic run of ``steps`` × ``layers`` into ``run_dir``; return its shape figures."""
    rng = np.random.default_rng(seed)
    explode = int(steps * 0.61)
    nan_step = int(steps * 0.25)
    dead_from = int(steps * 0.40)
    dead_layer = min(17, layers - 1)
    activations = min(50, layers)
    act_every = 100

    with RunStore(run_dir) as store:
        store.set_meta("model_class", "SyntheticNet")
        store.set_meta("optimizer_class", "AdamW")
        store.set_meta("policy", "skip")
        store.set_meta("scaler", True)
        store.set_meta("num_parameters", layers * 1_000_000)
        store.set_meta("nantrace_version", "synthetic")
        store.set_meta("torch_version", "synthetic")
        store.set_meta("layer_names", [f"blocks.{i // 4}.{('attn.qkv', 'attn.out', 'mlp.0', 'mlp.2')[i % 4]}" for i in range(layers)])
        store.set_meta("activation_names", [f"blocks.{i}" for i in range(activations)])
        store.log_incident(_incident(nan_step, "nonfinite_loss", "log_nonpositive", phase="forward",
                                     op="aten.log.default", module="head", source="train.py:42"))
        store.log_incident(_incident(explode, "nonfinite_grad", "gradient_explosion", module=f"blocks.{(layers - 1) // 4}"))
        store.log_incident(_incident(int(steps * 0.9), "loss_spike", "loss_divergence", phase=None, action="logged"))

    idx = np.arange(steps)
    loss = 3.0 * np.exp(-idx / (steps / 5)) + 0.2 + 0.05 * rng.standard_normal(steps)
    grad = np.exp(0.3 * rng.standard_normal(steps))
    grad[explode - 100:explode] *= np.geomspace(1, 1e6, 100)
    param = 100 + idx / steps
    lr = np.minimum(1.0, (idx + 1) / (steps / 50)) * 3e-4 * (0.5 * (1 + np.cos(math.pi * idx / steps)))
    scale = 2.0 ** (16 - (idx // 5000) % 4)
    scaler_skips = set(range(2500, steps, 5000))
    spike = int(steps * 0.9)
    loss[spike] *= 20
    loss_obj = loss.astype(object)
    grad_obj = grad.astype(object)
    loss_obj[nan_step] = "nan"
    grad_obj[nan_step] = "nan"
    grad_obj[explode] = math.inf
    t0 = 1.7e9

    def step_rows():
        for s in range(steps):
            bad = s in (nan_step, explode)
            skipped = bad or s in scaler_skips
            action = "skipped" if bad else ("scaler_skip" if s in scaler_skips else None)
            yield (s, t0 + s * 0.1, loss_obj[s], grad_obj[s], float(param[s]),
                   json.dumps([float(lr[s]), float(lr[s]) * 0.1]), float(scale[s]), int(skipped), action, None)

    conn = sqlite3.connect(run_dir / DB_NAME, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT OR REPLACE INTO steps(step, time, loss, grad_norm, param_norm, lr, scale, skipped, action, incident)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        step_rows(),
    )
    base = np.exp(rng.uniform(-4, 1, layers))
    layer_ids = np.tile(np.arange(layers), _CHUNK)
    for start in range(0, steps, _CHUNK):
        n = min(_CHUNK, steps - start)
        st = np.repeat(np.arange(start, start + n), layers)
        lay = layer_ids[: n * layers]
        g = base[lay] * np.exp(0.2 * rng.standard_normal(n * layers))
        u = 1e-3 * np.exp(0.3 * rng.standard_normal(n * layers))
        p = 10.0 + 0.0 * g
        near = (st >= explode - 100) & (st <= explode) & (lay >= layers * 3 // 4)
        g[near] *= np.geomspace(1, 1e6, 101)[st[near] - (explode - 100)]
        dead = (st >= dead_from) & (lay == dead_layer)
        g[dead] = 0.0
        u[dead] = 0.0
        g_obj: list[object] = g.tolist()
        u_obj: list[object] = u.tolist()
        for i in np.flatnonzero(st == nan_step).tolist():
            g_obj[i] = "nan"
            u_obj[i] = "nan"
        for i in np.flatnonzero((st == explode) & (lay >= layers * 3 // 4)).tolist():
            g_obj[i] = math.inf
            u_obj[i] = "nan"
        conn.executemany(
            "INSERT INTO layer_stats(step, layer, grad_norm, param_norm, update_ratio) VALUES (?, ?, ?, ?, ?)",
            zip(st.tolist(), lay.tolist(), g_obj, p.tolist(), u_obj),
        )
    act_steps = np.arange(0, steps, act_every)
    st = np.repeat(act_steps, activations)
    lay = np.tile(np.arange(activations), len(act_steps))
    a = np.exp(rng.uniform(0, 3, activations))[lay] * np.exp(0.1 * rng.standard_normal(len(st)))
    conn.executemany(
        "INSERT INTO activation_stats(step, layer, absmax, nonfinite) VALUES (?, ?, ?, ?)",
        zip(st.tolist(), lay.tolist(), a.tolist(), [0] * len(st)),
    )
    conn.execute("COMMIT")
    conn.close()
    return {"steps": steps, "layers": layers, "layer_rows": steps * layers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--keep", type=Path, default=None, help="write the run here and keep it (default: a temp dir, removed)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--reuse", type=Path, default=None, help="render this existing run directory instead of writing one")
    parser.add_argument("--exact", action="store_true", help="aggregate every per-layer row (no step sampling)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="nantrace-report-scale-") as tmp:
        if args.reuse is not None:
            run_dir, write_s = args.reuse, 0.0
            with RunStore(run_dir, readonly=True) as store:
                args.steps = len(store.steps())
                args.layers = len(store.get_meta("layer_names") or [])
        else:
            run_dir = args.keep if args.keep is not None else Path(tmp) / "run"
            if (run_dir / DB_NAME).exists():
                raise SystemExit(f"{run_dir} already holds a run store; choose an empty --keep directory")
            t0 = time.perf_counter()
            write_store(run_dir, args.steps, args.layers)
            write_s = time.perf_counter() - t0
        db_mb = os.path.getsize(run_dir / DB_NAME) / 1e6
        print(f"store  {args.steps} steps × {args.layers} layers ({args.steps * args.layers:,} layer rows)"
              + (f" written in {write_s:.1f} s" if write_s else " (reused)") + f", {db_mb:.1f} MB")
        t0 = time.perf_counter()
        kept = args.keep is not None or args.reuse is not None
        out = render_report(run_dir, None if kept else Path(tmp) / "report.html",
                            max_exact_layer_rows=10**12 if args.exact else None)
        render_s = time.perf_counter() - t0
        html_mb = out.stat().st_size / 1e6
        print(f"report {render_s:.1f} s, {html_mb:.1f} MB{' (exact per-layer maxima)' if args.exact else ''}"
              + (f"  ->  {out}" if kept else ""))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "steps": args.steps, "layers": args.layers, "write_store_s": round(write_s, 2),
                "store_mb": round(db_mb, 1), "render_s": round(render_s, 2), "html_mb": round(html_mb, 2),
                "exact": args.exact, "load_average": os.getloadavg()[0],
                "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
            }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
