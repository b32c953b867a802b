"""What nantrace costs per step and per incident as the number of ranks grows (docs/scale.md).

Launches ``torchrun --nproc-per-node W`` (gloo, CPU, one thread per rank) for each W in
``--world``, wrapping the model in DDP or FSDP2. Each rank trains a small MLP (AdamW) under
``nantrace.watch(..., run_dir=...)`` for ``--steps`` steps; at ``--incident-step`` rank 1's
batch carries a NaN. Per rank and per step it records what is deterministic:

- host reads made by nantrace (:class:`nantrace.testing.host_reads.HostReadCounter`),
- collectives issued by nantrace itself (``torch.distributed.all_reduce`` called from
  ``nantrace/distributed.py``: the step's agreement vector, or the rare-path rounds) and the
  bytes they carry (the gradients' own all-reduce or reduce-scatter is training's, not counted),
- the run store's size (``nantrace.db`` and its WAL, SQLite pages) and, exactly, the bytes of
  its incident rows; the incident bundles' size and whether each rank wrote a full bundle or a
  pointer (``--bundle-ranks``: ``Config.outputs.bundle_ranks``, default: nantrace's own);
- on rank 0, the size of ``nantrace report run_dir`` (the HTML file),

and, as a rough indication only, the time spent in ``Guard.decide`` (this 2-core machine is
shared: timings are not reproducible; counts and bytes are).

Usage::

    python benchmarks/scale.py --world 2,4,8 --wrapper ddp,fsdp --json /tmp/scale.json
    python benchmarks/scale.py --world 2,4,8 --wrapper ddp --bundle-ranks origin --json /tmp/origin.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _written(bundle: str | None) -> str | None:
    """What an incident's ``bundle`` path holds: ``"full"``, ``"pointer"`` or ``None`` (nothing written)."""
    if bundle is None:
        return None
    return "pointer" if (Path(bundle) / "pointer.json").is_file() else "full"


def _incident_row_bytes(db: Path) -> int:
    """Bytes of the incident records in the run store (the JSON of each row, history included)."""
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT coalesce(sum(length(data)), 0) FROM incidents").fetchone()[0])
    finally:
        conn.close()


def worker(wrapper: str, steps: int, incident_step: int, out_dir: str, bundle_ranks: str | None) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import nantrace
    from nantrace.guard import Guard
    from nantrace.testing.host_reads import HostReadCounter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

    collectives: list[tuple[str, int]] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        caller = sys._getframe(1)
        if caller.f_code.co_filename.endswith(os.path.join("nantrace", "distributed.py")) and \
                caller.f_code.co_name in ("_start", "agree", "combine_shards"):
            collectives.append((caller.f_code.co_name, tensor.numel() * tensor.element_size()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    decide_time = [0.0]
    decide_name = "decide" if hasattr(Guard, "decide") else "_decide"  # renamed from _decide
    real_decide = getattr(Guard, decide_name)

    def timed_decide(self, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return real_decide(self, **kw)
        finally:
            decide_time[0] += time.perf_counter() - t0

    setattr(Guard, decide_name, timed_decide)
    run_dir = Path(out_dir) / f"w{world}-{wrapper}" / "run"
    outputs: dict[str, Any] = {"print_incidents": False}
    if bundle_ranks:
        outputs["bundle_ranks"] = bundle_ranks
    guard = nantrace.watch(wrapped, opt, run_dir=str(run_dir), config=nantrace.Config(outputs=outputs))
    gen = torch.Generator().manual_seed(100 + rank)
    rows = []
    with HostReadCounter() as reads:
        for step in range(steps):
            x, y = torch.randn(32, 32, generator=gen), torch.randn(32, 1, generator=gen)
            if step == incident_step and rank == 1:
                x[3, 7] = float("nan")
            reads.reset()
            collectives.clear()
            decide_time[0] = 0.0
            opt.zero_grad()
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            rows.append({
                "step": step,
                "nantrace_reads": sum(1 for e in reads.events if e.where.startswith("nantrace" + os.sep)),
                "collectives": [name for name, _ in collectives],
                "bytes": sum(b for _, b in collectives),
                "decide_us": decide_time[0] * 1e6,
            })
    incidents = [[i.step, i.kind, i.rank, i.action, _written(i.bundle)] for i in guard.incidents]
    guard.close()
    dist.all_reduce = real_all_reduce
    mine = Path(guard.run_dir)
    store = sum(p.stat().st_size for p in mine.glob("nantrace.db*"))
    bundles = _dir_bytes(mine / "incidents")
    dist.barrier()  # every rank's store is closed before rank 0 renders its report
    report_bytes = None
    if rank == 0:
        from nantrace.report.render import render_report

        report_bytes = Path(render_report(mine, mine / "report.html")).stat().st_size
    result = {"rank": rank, "world": world, "wrapper": wrapper, "rows": rows, "incidents": incidents,
              "store_bytes": store, "incident_row_bytes": _incident_row_bytes(mine / "nantrace.db"),
              "bundle_bytes": bundles, "report_bytes": report_bytes, "run_dir": str(mine),
              "parameters": sum(p.numel() for p in model.parameters())}
    (Path(out_dir) / f"w{world}-{wrapper}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, wrapper: str, *, steps: int, incident_step: int, out_dir: str,
           bundle_ranks: str | None = None) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", NANTRACE_SCALE_WORKER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE), "--wrapper", wrapper, "--steps", str(steps),
           "--incident-step", str(incident_step), "--out", out_dir] + (
               ["--bundle-ranks", bundle_ranks] if bundle_ranks else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return [json.loads((Path(out_dir) / f"w{world}-{wrapper}-rank{r}.json").read_text()) for r in range(world)]


def summarise(ranks: list[dict[str, Any]], incident_step: int) -> dict[str, Any]:
    steady = [row for r in ranks for row in r["rows"] if row["step"] != incident_step and row["step"] > 0]
    at = [next(row for row in r["rows"] if row["step"] == incident_step) for r in ranks]
    return {
        "world": ranks[0]["world"], "wrapper": ranks[0]["wrapper"], "parameters": ranks[0]["parameters"],
        "steady_reads": sorted({row["nantrace_reads"] for row in steady}),
        "steady_collectives": sorted({tuple(row["collectives"]) for row in steady}),
        "steady_bytes": sorted({row["bytes"] for row in steady}),
        "incident_reads": sorted({row["nantrace_reads"] for row in at}),
        "incident_collectives": sorted({tuple(row["collectives"]) for row in at}),
        "incident_bytes": sorted({row["bytes"] for row in at}),
        "incidents": {r["rank"]: r["incidents"] for r in ranks},
        "store_bytes": {r["rank"]: r["store_bytes"] for r in ranks},
        "incident_row_bytes": {r["rank"]: r["incident_row_bytes"] for r in ranks},
        "bundle_bytes": {r["rank"]: r["bundle_bytes"] for r in ranks},
        "bundle_total": sum(r["bundle_bytes"] for r in ranks),
        "report_bytes": ranks[0]["report_bytes"],
        "decide_us_median": statistics.median(row["decide_us"] for row in steady),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="2,4,8")
    ap.add_argument("--wrapper", default="ddp,fsdp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--incident-step", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bundle-ranks", default=None, choices=("auto", "origin", "all"),
                    help="Config.outputs.bundle_ranks (default: nantrace's own default)")
    args = ap.parse_args(argv)
    if os.environ.get("NANTRACE_SCALE_WORKER"):
        worker(args.wrapper, args.steps, args.incident_step, args.out, args.bundle_ranks)
        return 0
    out = args.out or tempfile.mkdtemp(prefix="nantrace-scale-")
    summaries = []
    for wrapper in args.wrapper.split(","):
        for world in (int(w) for w in args.world.split(",")):
            summary = summarise(launch(world, wrapper, steps=args.steps, incident_step=args.incident_step, out_dir=out,
                                       bundle_ranks=args.bundle_ranks), args.incident_step)
            summaries.append(summary)
            print(json.dumps(summary), flush=True)
    print(f"load average: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
