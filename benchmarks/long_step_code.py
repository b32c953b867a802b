"""What nantrace costs on step code of thousands of small torch calls (an RL update: GAE before the forward).

A PPO-style step: the behaviour policy's log-probabilities under ``no_grad``, a GAE loop over the rollout
(about 14 torch calls a transition, all on scalars), then the forward, the clipped-ratio loss and the update.
The step's code before the forward is taped by the prelude (its window starts over when full, carrying on
the calls whose outputs are still alive: ``LossTape._survivors``), so the cost is per torch call of the user's
code. Plain and nantrace run interleaved in one process (blocks of steps, the order alternating); the ratio
of medians is printed, next to an empty ``TorchFunctionMode`` over the same code (the floor any tape that
intercepts torch calls pays).

Usage::

    python benchmarks/long_step_code.py --rollout 160 --rounds 8
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import nantrace


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
        self.v = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pi(obs), self.v(obs).squeeze(-1)


class _Empty(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def ppo_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> None:
    obs, actions, rewards, dones = batch
    with torch.no_grad():
        logits, values = model(obs)
        old_logp = torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
    adv = torch.zeros_like(rewards)
    gae = torch.zeros(())
    for t in reversed(range(len(rewards) - 1)):
        delta = rewards[t] + 0.99 * values[t + 1] * (1 - dones[t]) - values[t]
        gae = delta + 0.99 * 0.95 * (1 - dones[t]) * gae
        adv[t] = gae
    opt.zero_grad()
    logits, v = model(obs)
    ratio = torch.exp(torch.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1) - old_logp)
    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + F.mse_loss(v, adv + values)
    loss.backward()
    opt.step()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollout", type=int, default=160, help="transitions a step (about 14 torch calls each)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    base = Policy()
    gen = torch.Generator().manual_seed(1)
    n = args.rollout
    batches = [(torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen), torch.randn(n, generator=gen),
                (torch.rand(n, generator=gen) < 0.05).float()) for _ in range(args.steps)]
    models = {k: copy.deepcopy(base) for k in ("plain", "empty_mode", "nantrace")}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    guard = nantrace.watch(models["nantrace"], opts["nantrace"], config=nantrace.Config(outputs={"print_incidents": False}))
    times: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for r in range(args.rounds + 1):
        for k in order[r % 3:] + order[:r % 3]:
            for b in batches:
                t0 = time.perf_counter()
                if k == "empty_mode":
                    with _Empty():
                        ppo_step(models[k], opts[k], b)
                else:
                    ppo_step(models[k], opts[k], b)
                if r:  # the first round warms up
                    times[k].append(time.perf_counter() - t0)
    guard.close()
    same = all(torch.equal(a, b) for a, b in zip(models["plain"].state_dict().values(),
                                                  models["nantrace"].state_dict().values()))
    plain = statistics.median(times["plain"])
    out = {"rollout": n, "steps_timed": len(times["plain"]), "incidents": len(guard.incidents), "same_weights": same,
           "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
           "ratio": {k: statistics.median(v) / plain for k, v in times.items()}}
    print(f"rollout {n} (~{14 * n} torch calls before the forward), {len(times['plain'])} steps each, "
          f"same weights as plain: {same}, incidents: {out['incidents']}")
    for k in models:
        print(f"  {k:10s} median {out['median_ms'][k]:7.2f} ms   x plain {out['ratio'][k]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
