"""Issue 12 figures on warm-up-too-high runs (tests/divergence_runs.py): the step of the first incident against
the first non-finite loss of the same run without nantrace, incidents per episode, the most skipped updates in a
row, under skip / skip+log / rollback / skip+snapshots. Run: PYTHONPATH=src python benchmarks/divergence_figures.py"""
import sys; import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch; torch.set_num_threads(1)
import nantrace
from divergence_runs import RUNS, train
for name in ("mlp_warmup_too_high", "relu_warmup_too_high"):
    for seed in range(3):
        ref = train(RUNS[name], seed=seed)
        for policy, extra in (("skip", {}), ("skip", {"finite_anomaly_action": "log"}), ("rollback", {"rollback_interval": 10}), ("skip", {"skip_snapshots": True, "rollback_interval": 10})):
            cfg = nantrace.Config(print_incidents=False, **extra)
            r = train(RUNS[name], seed=seed, guard_kwargs=dict(on_anomaly=policy, config=cfg))
            g = r.guard
            inc = g.incidents
            first = inc[0].step if inc else None
            print(f"{name} seed={seed} {policy}{extra}: first non-finite loss w/o guard={ref.first_nonfinite}; first incident={first} "
                  f"lead={ref.first_nonfinite - first if first is not None and ref.first_nonfinite is not None else None} incidents={len(inc)} "
                  f"max_consecutive_skips={g.ladder.max_consecutive_skips} stopped={type(r.error).__name__ if r.error else None} steps_run={g.step}")
            for i in inc:
                print("    ", i.step, i.kind, i.cause, i.action, i.details.get("count"), i.details.get("steps", [])[:12])
