"""Forwards of the watched model under ``torch.no_grad()`` inside a training step.

Semi-supervised pseudo-labels (FixMatch), a PPO policy's old log-probabilities and a
self-distillation target all run the watched model without gradients and feed what it returns
to the loss. A non-finite value born in such a pass used to reach the loss code as a tensor
from nowhere and be blamed on the batch (``nonfinite_input``). Those forwards are now kept
(at most ``NOGRAD_FORWARDS`` a step) and replayed under no_grad, so the origin is the op in
the model that made it; an evaluation pass between steps that feeds nothing is never blamed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from origin_markers import points_at
from nantrace.step_capture import NOGRAD_FORWARDS

BAD_STEP = 3
CONFIG = nantrace.Config(outputs={"print_incidents": False})


class L2Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)  # <origin:l2>


class Encoder(nn.Module):
    """Features normalised by hand (no eps): an all-zero input row is 0/0 in ``norm``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(10, 16, bias=False)
        self.norm = L2Norm()
        self.cls = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls(5.0 * self.norm(self.enc(x)))


class Policy(nn.Module):
    """Action probabilities by hand; its log is taken in ``logp`` (log 0 = -inf when a softmax underflows)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.logp = LogProb()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.logp(torch.softmax(self.body(obs), -1))


class LogProb(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return torch.log(p)  # <origin:logp>


def _fixmatch_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x_l, y_l, x_weak, x_strong = batch
    sup = F.cross_entropy(model(x_l), y_l)
    with torch.no_grad():
        probs = model(x_weak).softmax(-1)  # pseudo-labels from the weak view
    return sup - (probs * F.log_softmax(model(x_strong), -1)).sum(-1).mean()


def _fixmatch_batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(23)
    out = []
    for step in range(5):
        x_l, y_l = torch.randn(4, 10, generator=g), torch.randint(0, 4, (4,), generator=g)
        x_weak = torch.randn(6, 10, generator=g)
        if step == BAD_STEP:
            x_weak[2] = 0.0  # a blank unlabelled image
        out.append((x_l, y_l, x_weak, x_weak + 0.3 * torch.randn(6, 10, generator=g)))
    return out


def _ppo_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A clipped-free PPO objective with a KL penalty to the behaviour policy (old log-probabilities
    of every action, from the same network under no_grad, as a rollout worker computes them)."""
    obs, actions, adv = batch
    with torch.no_grad():
        old = model(obs)
    new = model(obs)
    ratio = torch.exp(new.gather(1, actions[:, None]) - old.gather(1, actions[:, None])).squeeze(1)
    kl = (old.exp() * (old - new)).sum(-1).mean()
    return -(ratio * adv).mean() + 0.1 * kl


def _ppo_batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(5):
        obs = torch.randn(8, 6, generator=g)
        if step == BAD_STEP:
            obs[3] = 1e4  # an unnormalised observation: the softmax underflows to exactly 0
        out.append((obs, torch.randint(0, 5, (8,), generator=g), torch.randn(8, generator=g)))
    return out


def _self_distillation_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The target is made from a no-grad pass before the step's forward (taped as the step's
    prelude): the NaN reaches the loss only through that code, not as the forward's output."""
    obs, _, _ = batch
    with torch.no_grad():
        old = model(obs)
        target = old.exp() * old  # p log p: 0 * -inf = NaN where the softmax underflowed
    return ((model(obs) - target) ** 2).mean()


PROGRAMS = {
    "fixmatch_pseudo_labels": (Encoder, _fixmatch_loss, _fixmatch_batches,
                               dict(kind="nonfinite_loss", phase="forward", op="aten.div.Tensor", module="norm",
                                    cause="zero_variance_norm", marker="l2")),
    "ppo_old_log_probs": (Policy, _ppo_loss, _ppo_batches,
                          dict(kind="nonfinite_loss", phase="forward", op="aten.log.default", module="logp",
                               cause="log_nonpositive", marker="logp")),
    "self_distillation_target": (Policy, _self_distillation_loss, _ppo_batches,
                                 dict(kind="nonfinite_loss", phase="forward", op="aten.log.default",
                                      module="logp", cause="log_nonpositive", marker="logp")),
}


def _train(program: str, replayable: bool, run_dir=None) -> list[nantrace.Incident]:
    make, loss_fn, batches, _ = PROGRAMS[program]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    with nantrace.watch(model, opt, config=CONFIG, run_dir=run_dir) as guard:
        step_loss = guard.replayable(loss_fn) if replayable else loss_fn
        for batch in batches():
            opt.zero_grad()
            step_loss(model, batch).backward()
            opt.step()
        return list(guard.incidents)


@pytest.mark.parametrize("replayable", [False, True], ids=["zero_code", "replayable"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_an_origin_in_a_no_grad_forward_is_found_in_the_model(one_thread, program, replayable):
    want = PROGRAMS[program][3]
    (got,) = _train(program, replayable)
    assert (got.step, got.kind, got.phase, got.op, got.module, got.cause, got.action) == (
        BAD_STEP, want["kind"], want["phase"], want["op"], want["module"], want["cause"], "skipped")
    assert points_at(got.source, __file__, want["marker"])


def test_the_bundle_replays_the_no_grad_forward_the_same_way(one_thread, tmp_path):
    (got,) = _train("fixmatch_pseudo_labels", False, run_dir=tmp_path)
    assert got.bundle is not None
    torch.manual_seed(0)
    again = nantrace.replay(got.bundle, model=Encoder())
    assert (again.op, again.module, again.cause) == (got.op, got.module, got.cause) == (
        "aten.div.Tensor", "norm", "zero_variance_norm")


def test_an_evaluation_pass_that_feeds_nothing_is_not_blamed(one_thread):
    """Between two steps the loop evaluates on held-out data under no_grad, one batch of which is
    corrupt (NaN); the training step then fails in its own loss code (log of 0). The origin is
    the loss code's log, not the evaluation's NaN; and steps whose only NaN is the evaluation's
    have no incident at all (evaluation is not training)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    held_out = [torch.randn(4, 6, generator=g) for _ in range(2 * NOGRAD_FORWARDS)]
    held_out[1][0, 0] = float("nan")
    with nantrace.watch(model, opt, config=CONFIG) as guard:
        for step in range(5):
            x, y = torch.randn(8, 6, generator=g), torch.rand(8, 3, generator=g)
            if step == BAD_STEP:
                y[0, 0] = 0.0
            opt.zero_grad()
            loss = -(y * torch.log(y)).sum() + F.mse_loss(model(x), y)  # <origin:entropy>
            loss.backward()
            opt.step()
            with torch.no_grad():
                [model(h).sum() for h in held_out]
        incidents = list(guard.incidents)
    assert len(incidents) == 1
    got = incidents[0]
    assert (got.step, got.kind, got.op, got.module, got.cause) == (
        BAD_STEP, "nonfinite_loss", "aten.log.default", None, "log_nonpositive")
    assert points_at(got.source, __file__, "entropy")
