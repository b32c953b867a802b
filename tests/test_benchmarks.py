"""The benchmark scripts run end to end and check what they must (no timing is asserted).

Each benchmark also verifies that nantrace leaves training unchanged: the weights after
training with and without the guard are compared. These smoke runs keep that check, and the
scripts themselves, working; their figures live in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(args: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args, "--json", str(out)], capture_output=True, text=True,
                          timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_overhead_benchmark_trains_identical_weights_with_and_without_the_guard(tmp_path):
    res = _run([str(BENCH / "overhead.py"), "--models", "mlp", "--variants", "plain,nantrace_store",
                "--rounds", "2", "--steps-per-round", "3", "--warmup", "1", "--no-memory", "--quiet"], tmp_path)
    model = res["timing"]["mlp"]
    assert model["max_abs_param_diff_vs_plain"] == {"nantrace_store": 0.0}  # the guard with its run store and bundles
    for variant in ("plain", "nantrace_store"):
        assert model["summary"][variant]["steps"] == 6
        assert model["summary"][variant]["incidents"] == 0


def test_ddp_benchmark_trains_identical_weights_on_two_gloo_ranks(tmp_path):
    res = _run([str(BENCH / "ddp_overhead.py"), "--model", "mlp", "--rounds", "1", "--steps", "3", "--warmup", "1"],
               tmp_path)
    assert res["identical_weights"] is True and res["incidents"] == 0
    assert [len(res["raw_times"][v][0]) for v in ("plain", "nantrace")] == [3, 3]
    assert res["guard_steps"] == 1 + 3  # warm-up, then one block


def test_update_check_benchmark_keeps_training_identical(tmp_path):
    res = _run([str(BENCH / "update_check_cost.py"), "--model", "mlp", "--rounds", "2", "--steps", "2", "--threads", "1"],
               tmp_path)
    assert res["checked_weights_identical_to_plain"] is True
    assert res["variants"]["proven"]["held_bytes"] == 0 and res["variants"]["checked"]["held_bytes"] > 0
    assert res["variants"]["checked"]["incidents"] == res["variants"]["proven"]["incidents"] == 0

def test_gpu_benchmark_runs_its_grid_on_a_tiny_model_on_the_cpu(tmp_path):
    """benchmarks/gpu.py is meant for a GPU; here only its grid, its table and its weight
    check run (tiny model, eager compile backend), no timing is judged. One process per tool and
    cell: the compiled half of the grid (its eager half is the same step without ``torch.compile``), nantrace's
    tools and plain (``detect_anomaly`` is torch's own, timed on a GPU only)."""
    res = _run([str(BENCH / "gpu.py"), "--tiny", "--device", "cpu", "--rounds", "1", "--steps-per-block", "2",
                "--warmup", "1", "--compile-backend", "eager", "--modes", "compile",
                "--tools", "plain,nantrace,nantrace_syncfree"], tmp_path)
    cells = {(c["precision"], c["mode"], c["tool"]): c for c in res["cells"]}
    assert set(cells) == {(p, m, t) for p in ("bf16", "fp16") for m in ("compile",)
                          for t in ("plain", "nantrace", "nantrace_syncfree")}
    for (precision, mode, tool), c in cells.items():
        assert c["steps"] == 1 and c["median_step_s"] > 0  # one timed block of 2 steps
        if tool.startswith("nantrace"):
            assert c["same_weights_as_plain"] is True and c["incidents"] == 0, (precision, mode, tool)
        # sync-free where it is exact (bf16); fp16's GradScaler owns found_inf: the synchronous check
        assert c["decided_on_device"] == ({"nantrace": False, "nantrace_syncfree": precision == "bf16"}.get(tool))


def test_long_step_code_benchmark_trains_identical_weights(tmp_path):
    res = _run([str(BENCH / "long_step_code.py"), "--rollout", "90", "--rounds", "1", "--steps", "2"], tmp_path)
    assert res["same_weights"] is True and res["incidents"] == 0 and res["steps_timed"] == 2
    assert set(res["ratio"]) == {"plain", "empty_mode", "nantrace"}
