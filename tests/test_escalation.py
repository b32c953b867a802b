"""The escalation ladder (issue 12): one incident per episode, updated; skip budget -> rollback when
a snapshot exists -> pause; never skip forever silently."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import nantrace
from conftest import mlp
from nantrace.storage.runstore import RunStore


def _run(bad_steps, *, steps=30, policy="skip", run_dir=None, **cfg):
    """An MLP regression whose batch carries a NaN at ``bad_steps``; returns (guard, error)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = nantrace.Config(print_incidents=False, **cfg)
    guard = nantrace.watch(model, opt, on_anomaly=policy, run_dir=run_dir, config=config)
    g = torch.Generator().manual_seed(0)
    error = None
    try:
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            y = x.sum(1, keepdim=True)
            if step in bad_steps:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    except nantrace.NonFiniteError as exc:
        error = exc
    guard.close()
    return guard, error


def _summary(guard):
    return [(i.step, i.kind, i.action, i.details.get("count"), i.details.get("steps")) for i in guard.incidents]


@pytest.mark.parametrize("budget", [1, 3, 5, 10])
def test_consecutive_skips_become_one_incident_then_pause(budget, tmp_path):
    guard, error = _run(range(4, 100), skip_budget=budget, run_dir=tmp_path)
    skipped = list(range(4, 4 + budget))
    assert _summary(guard) == [(4, "nonfinite_input", "skipped", budget, skipped),
                               (4 + budget, "nonfinite_input", "paused", 1, [4 + budget])]
    assert error is not None and error.incident is guard.incidents[1]
    escalation = error.incident.details["escalation"]
    assert escalation["reason"] == f"{budget} consecutive skipped updates (Config.skip_budget = {budget})"
    assert escalation["episode"] == guard.incidents[0].id and escalation["skipped_updates"] == budget
    assert error.incident.bundle is not None and "Escalated after" in error.incident.summary
    assert guard.ladder.max_consecutive_skips == budget
    # the run store holds the same two incidents, the first with its final count
    stored = RunStore(tmp_path, readonly=True).incidents()
    assert [(i.id, i.details["count"]) for i in stored] == [(i.id, i.details["count"]) for i in guard.incidents]


def test_skips_that_are_not_consecutive_are_bounded_by_the_window():
    bad = set(range(2, 60, 2))  # every other step: never two skips in a row
    guard, error = _run(bad, steps=60, skip_window=20, skip_window_budget=4)
    assert _summary(guard) == [(2, "nonfinite_input", "skipped", 4, [2, 4, 6, 8]),
                               (10, "nonfinite_input", "paused", 1, [10])]
    assert error.incident.details["escalation"]["reason"] == (
        "4 skipped updates in the last 20 steps (Config.skip_window_budget = 4)")


def test_an_episode_ends_after_episode_gap_healthy_steps():
    guard, error = _run({3, 4, 5, 20, 21}, steps=35, episode_gap=10)
    assert error is None
    assert _summary(guard) == [(3, "nonfinite_input", "skipped", 3, [3, 4, 5]),
                               (20, "nonfinite_input", "skipped", 2, [20, 21])]
    assert not guard.ladder.open


def test_skip_with_snapshots_rolls_back_before_it_pauses():
    guard, error = _run(range(12, 100), steps=60, skip_snapshots=True, rollback_interval=5, skip_budget=3,
                        rollback_max_retries=2)
    # 3 skips, then a rollback; the data is still broken: the steps after it, and the second rollback, are
    # counted on the rollback's incident; after rollback_max_retries=2 rollbacks, pause
    assert [(i.step, i.action) for i in guard.incidents] == [(12, "skipped"), (15, "rolled_back"), (21, "paused")]
    rolled = guard.incidents[1]
    assert rolled.details["escalation"]["to"] == "rolled_back" and rolled.details["rollbacks"] == 2
    assert rolled.details["steps"] == [15, 16, 17, 18, 19, 20] and rolled.details["restored_to_step"] == 10
    assert rolled.summary.startswith("Escalated after 3 consecutive skipped updates")
    assert "2 rollback(s)" in error.incident.details["escalation"]["why_pause"]


def test_budget_zero_skips_forever_but_says_so():
    with pytest.warns(UserWarning, match="skip_budget=0 turns the escalation ladder off"):
        guard, error = _run(range(4, 30), skip_budget=0)
    assert error is None and _summary(guard) == [(4, "nonfinite_input", "skipped", 26, list(range(4, 30)))]


@pytest.mark.parametrize("policy, extra, expected", [
    # a finite divergence only logged: one incident counted step after step; the NaN it ends in is a new
    # incident of the episode (a new kind after applied steps), skipped 5 times, then the pause
    # (made below from the step where the same run without nantrace first turns NaN)
    ("skip", {"finite_anomaly_action": "log"}, None),
    # rollback: the divergence recurs from the restored state; 3 rollbacks on one incident, then pause
    ("rollback", {"rollback_interval": 10}, [(28, "loss_spike", "rolled_back", 3), (31, "loss_spike", "paused", 1)]),
])
def test_a_diverging_warmup_under_each_policy(policy, extra, expected, one_thread):
    from divergence_runs import RUNS, train

    result = train(RUNS["mlp_warmup_too_high"], seed=0,
                   guard_kwargs={"on_anomaly": policy, "config": nantrace.Config(print_incidents=False, **extra)})
    if policy == "skip":  # where the logged divergence turns NaN is the run's own (49 or 50 by the CPU's kernels)
        nan_at = train(RUNS["mlp_warmup_too_high"], seed=0).first_nonfinite
        expected = [(28, "loss_spike", "logged", nan_at - 28), (nan_at, "nonfinite_loss", "skipped", 5),
                    (nan_at + 5, "nonfinite_loss", "paused", 1)]
    assert [(i.step, i.kind, i.action, i.details["count"]) for i in result.guard.incidents] == expected
    assert isinstance(result.error, nantrace.NonFiniteError)


def test_raise_and_pause_policies_do_not_group():
    guard, error = _run(range(4, 30), policy="raise")
    assert [(i.step, i.action) for i in guard.incidents] == [(4, "raised")]


def test_config_validation():
    with pytest.raises(ValueError, match="skip_window_budget"):
        nantrace.Config(skip_window=5, skip_window_budget=6)
    with pytest.raises(ValueError, match="skip_budget"):
        nantrace.Config(skip_budget=-1)
    with pytest.raises(ValueError, match="divergence_steps"):
        nantrace.Config(divergence_steps=1)
