"""Run by tests/test_sync_free.py under torchrun (2 processes, gloo, CPU): DDP or FSDP2 training
with a fused AdamW, once synchronous and once sync-free, a NaN in rank 1's batch at step 5 only."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nantrace
from ddp_script import wrap  # the same DDP / FSDP2 wrapping as the other two-rank tests
from nantrace.testing.host_reads import HostReadCounter


def train(scenario: str, sync_free: bool, rank: int, run_dir: str) -> dict:
    torch.manual_seed(0)
    if scenario.endswith("_rank1"):  # ddp_script's models: a NaN born in rank 1's forward (log) or backward (sqrt)
        import ddp_script

        model = wrap(ddp_script.build(scenario), scenario.split("_")[0])
        w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    else:
        model = wrap(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), scenario)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = nantrace.Config(outputs={"print_incidents": False}, detection={"sync_free": sync_free})
    guard = nantrace.watch(model, opt, run_dir=run_dir, config=cfg)
    gen = torch.Generator().manual_seed(100 + rank)
    reads = []
    raised = None
    with HostReadCounter() as counter:
        for step in range(12):
            if scenario.endswith("_rank1"):
                x, y = ddp_script.batch(scenario, rank, step, gen, w)  # broken at step 3 on rank 1
            else:
                x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
                if step == 5 and rank == 1 and not scenario.endswith("divergence"):
                    x[2, 3] = float("nan")
                if scenario.endswith("divergence") and rank == 1 and step >= 4:  # only rank 1's loss grows
                    y = y * 8.0 ** (step - 3)
            counter.reset()
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            try:
                opt.step()
            except nantrace.NonFiniteError:  # every rank stops at the same step (the escalation ladder)
                raised = step
                break
            reads.append(len([e for e in counter.events if e.where.startswith("nantrace" + os.sep)]))
    failures = [f"{m.name}: {m.failed!r}" for m in guard.monitors if getattr(m, "failed", None)]
    guard.close()
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return {
        "incidents": [[i.step, i.kind, i.rank, str(i.action), i.cause, i.op, i.module, i.source] for i in guard.incidents],
        "peer": [i.details.get("peer_rank") for i in guard.incidents],
        "summaries": [i.summary for i in guard.incidents],
        "raised": raised,
        "reads": reads,
        "replicas_equal": bool(torch.equal(gathered[0], gathered[1])),
        "weights": flat.tolist(),
        "device_steps": guard.sync_free.steps if guard.sync_free is not None else 0,
        "monitor_failures": failures,
        "adam_stats_match": _adam_stats_match(opt),
    }


def _adam_stats_match(opt: torch.optim.Optimizer) -> bool | None:
    """Under FSDP2: the optimizer-state figures made from each rank's shards and combined across ranks equal
    those of the whole (gathered) state; ``None`` when the state is not sharded."""
    from nantrace.dynamics.optimizer_state import combine_shard_stats, shard_state_stats, tensor_state_stats

    states = [opt.state[p] for group in opt.param_groups for p in group["params"] if p in opt.state]
    if not states or not hasattr(states[0]["exp_avg"], "full_tensor"):
        return None
    local = torch.stack([shard_state_stats(s["exp_avg"].to_local(), s["exp_avg_sq"].to_local(), 1e-16) for s in states])
    combined = combine_shard_stats(local)
    whole = torch.stack([tensor_state_stats(s["exp_avg"].full_tensor(), s["exp_avg_sq"].full_tensor(), 1e-16)
                         for s in states])
    return bool(torch.allclose(combined, whole, rtol=1e-6))


def main(scenario: str, policy: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"sync": train(scenario, False, rank, os.path.join(out_dir, "sync")),
              "free": train(scenario, True, rank, os.path.join(out_dir, "free"))}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see ddp_script.py: gloo's threads may abort a rank during interpreter finalisation
