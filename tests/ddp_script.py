"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU).

Arguments: SCENARIO POLICY OUT_DIR [BUNDLE_RANKS] (``Config.outputs.bundle_ranks``, default: nantrace's).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nantrace


def make_model() -> nn.Module:
    """The model every scenario trains (``nantrace replay --model ddp_script:make_model`` rebuilds it)."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class Log(nn.Module):
    """log of the batch: NaN in the forward when a value is negative (rank 1's batch only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Magnitude(nn.Module):
    """The rows' Euclidean norm: finite at an all-zero row, but its derivative there is infinite."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((h * h).sum(-1, keepdim=True))


def build(scenario: str) -> nn.Module:
    """The scenario's model (seeded: the same weights on every rank and in the test process)."""
    torch.manual_seed(0)
    if scenario.endswith("log_rank1"):
        return nn.Sequential(Log(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if scenario.endswith("sqrt_rank1"):
        return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), Magnitude(), nn.Linear(1, 1))
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(scenario: str, rank: int, step: int, gen: torch.Generator, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch of this rank; rank 1's is broken at step 3 (and on, for ``broken_rank1``)."""
    x = torch.randn(16, 8, generator=gen)
    y = x @ w + 0.1 * torch.randn(16, 1, generator=gen)
    if scenario.endswith("log_rank1"):
        x = x.abs() + 0.5
    if rank == 1 and step == 3 and scenario in ("nan_input_rank1", "fsdp_nan_input_rank1", "rewatch_nan_rank1"):
        x[2, 5] = float("nan")
    if rank == 1 and step >= 3 and scenario == "broken_rank1":  # rank 1's data stays broken: the ladder escalates
        x[2, 5] = float("nan")
    if rank == 1 and step == 3 and scenario.endswith("log_rank1"):  # finite input, NaN from log in the forward
        x[2, 5] = -1.0
    if rank == 1 and step == 3 and scenario.endswith("sqrt_rank1"):  # finite forward, NaN born in the backward
        x[2] = 0.0
    if rank == 1 and step == 45 and scenario == "loss_spike_rank1":
        y = y * 100
    return x, y


def loss_of(scenario: str, rank: int, step: int, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The step's loss; for ``*lossfn_rank1`` the loss code itself takes the log of a weight that is
    negative on rank 1 at step 3 (the model's outputs stay finite)."""
    loss = F.mse_loss(out, y)
    if scenario.endswith("lossfn_rank1"):
        weights = torch.ones(out.shape[0])
        if rank == 1 and step == 3:
            weights[4] = -1.0
        loss = loss + torch.log(weights).mean()
    return loss


def wrap(model: nn.Module, scenario: str) -> nn.Module:
    if scenario.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    return DDP(model)


def count_reads(scenario: str, out_dir: str) -> None:
    """Host reads per step (tests/test_host_reads.py): 4 steps of plain DDP/FSDP2 training, then
    12 under ``nantrace.watch`` (defaults, AdamW), every step counted on every rank."""
    from nantrace.testing.host_reads import HostReadCounter

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    wrapped = wrap(model, scenario)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    guard = None
    per_step = []
    with HostReadCounter() as reads:
        for step in range(16):
            if step == 4:
                guard = nantrace.watch(wrapped, opt, config=nantrace.Config(print_incidents=False))
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 1, generator=gen)
            reads.reset()
            opt.zero_grad()
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            per_step.append({"watched": guard is not None, "total": reads.count,
                             "nantrace": [f"{e.how}@{e.where.rsplit(':', 1)[0]}" for e in reads.events
                                          if e.where.startswith("nantrace" + os.sep)]})
    assert guard is not None
    result = {"rank": rank, "steps": per_step, "incidents": len(guard.incidents), "sharded": guard.sharded,
              "local_grad_check": guard.checks_local_grads}
    guard.close()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    del wrapped, opt, guard, model
    gc.collect()
    dist.destroy_process_group()


def same_numerics(scenario: str, out_dir: str) -> None:
    """FSDP2 trained for 6 healthy steps with nantrace watching and without it: the weights must be
    the same bit for bit; after ``guard.close()`` no parameter group keeps nantrace's reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule

    rank = dist.get_rank()
    finals = []
    for watched in (True, False):
        model = build("fsdp_sqrt_rank1")
        wrapped = wrap(model, "fsdp")
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        guard = nantrace.watch(wrapped, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
        gen = torch.Generator().manual_seed(100 + rank)
        w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
        for step in range(6):
            x, y = batch("healthy", rank, step, gen, w)
            opt.zero_grad()
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
        checked = guard.checks_local_grads if guard is not None else None
        if guard is not None:
            guard.close()
        comms = [type(g._reduce_scatter_comm).__name__ for m in wrapped.modules() if isinstance(m, FSDPModule)
                 for g in m._get_fsdp_state()._fsdp_param_groups]
        finals.append((torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]), checked, comms))
    result = {"rank": rank, "bitwise_equal": bool(torch.equal(finals[0][0], finals[1][0])),
              "local_grad_check": finals[0][1], "comms_after_close": finals[0][2]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def raise_together(scenario: str, out_dir: str) -> None:
    """Every rank's loss code raises at step 2 (a class index out of range): under FSDP2 the
    exception is recorded without a replay (one rank replaying alone could wait in collectives
    the others are not in), and no rank hangs."""
    rank = dist.get_rank()
    wrapped = wrap(build(scenario), scenario)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    guard = nantrace.watch(wrapped, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    gen = torch.Generator().manual_seed(100 + rank)
    raised = None
    try:
        with guard:
            for step in range(4):
                x = torch.randn(16, 8, generator=gen)
                target = torch.randint(0, 1, (16,)) + (5 if step == 2 else 0)  # one output: only class 0 exists
                opt.zero_grad()
                F.cross_entropy(wrapped(x), target).backward()
                opt.step()
    except IndexError as exc:
        raised = str(exc)
    result = {"rank": rank, "raised": raised, "steps": guard.step,
              "incidents": [[i.step, i.kind, i.cause, i.details.get("localisation"), i.details.get("exception")]
                            for i in guard.incidents]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(scenario: str, policy: str, out_dir: str, bundle_ranks: str | None = None) -> None:
    dist.init_process_group("gloo")
    if scenario.endswith("_reads"):
        count_reads(scenario, out_dir)
        return
    if scenario == "fsdp_numerics":
        same_numerics(scenario, out_dir)
        return
    if scenario == "fsdp_raise_together":
        raise_together(scenario, out_dir)
        return
    rank = dist.get_rank()
    model = build(scenario)
    ddp = wrap(model, scenario)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    if scenario == "rewatch_nan_rank1":  # an earlier guard registered the comm hook, then closed
        nantrace.watch(ddp, opt, config=nantrace.Config(print_incidents=False)).close()
    outputs = {"print_incidents": False} | ({"bundle_ranks": bundle_ranks} if bundle_ranks else {})
    guard = nantrace.watch(ddp, opt, run_dir=f"{out_dir}/run", on_anomaly=policy,
                           config=nantrace.Config(outputs=outputs))
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    steps = {"loss_spike_rank1": 60, "broken_rank1": 20}.get(scenario, 8)
    raised = raised_step = None
    for step in range(steps):
        x, y = batch(scenario, rank, step, gen, w)
        opt.zero_grad()
        loss_of(scenario, rank, step, ddp(x), y).backward()
        try:
            opt.step()
        except nantrace.NonFiniteError as exc:
            raised = exc.incident.kind
            raised_step = exc.incident.step
            break
    layer_norms_match = None
    layers = next((m for m in guard.monitors if type(m).__name__ == "LayerStatsMonitor"), None)
    if raised is None and layers is not None and layers.latest is not None:
        # the per-layer gradient norms of the last step must be the model's, not this rank's shard's
        full = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).norm().item() for p in model.parameters()]
        layer_norms_match = bool(np.allclose(layers.index.combine(full), layers.latest.grad_norm, rtol=1e-5))
    guard.close()
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    result = {
        "rank": rank,
        "incidents": [[i.step, i.kind, i.rank, i.action, i.cause, i.op, i.module, i.phase] for i in guard.incidents],
        "summaries": [i.summary for i in guard.incidents],
        "details": [{k: v for k, v in i.details.items() if k in ("origin_ranks", "localisation", "localisation_error",
                                                                 "replayed_unit", "not_replayable")}
                    for i in guard.incidents],
        "sources": [i.source for i in guard.incidents],
        "replicas_equal": bool(torch.equal(gathered[0], gathered[1])),
        "finite": bool(torch.isfinite(flat).all()),
        "steps": guard.step,
        "raised": raised,
        "raised_step": raised_step,
        "counts": [i.details.get("count") for i in guard.incidents],
        "local_grad_check": guard.checks_local_grads,
        "run_dir": guard.run_dir,
        "sharded": guard.sharded,
        "layer_norms_match": layer_norms_match,
        "monitor_failures": [f"{m.name}: {m.failed!r}" for m in guard.monitors if getattr(m, "failed", None)],
    }
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    # Tear down in a fixed order on every rank: no rank leaves while a peer still talks to it,
    # and no DDP reducer outlives the process group into interpreter shutdown.
    dist.barrier()
    del ddp, opt, guard, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # Everything under test is done and written. Skip interpreter finalisation, where gloo's
    # C++ threads have been seen to abort a rank at exit ("terminate called without an active
    # exception") after a clean run: that race is torch's, not what these tests check.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
