"""Replays that behave: no echo of the user's prints, logs and warnings (issue 11), a model that
cannot be re-run gets a diagnosis that says so, and a bundle of another format says which
version it needs (issue 9)."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

import nantrace

log = logging.getLogger("user.model")


class Chatty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forward called")
        log.warning("logged in forward")
        warnings.warn("warned in forward", UserWarning)
        return torch.log(self.fc(x))  # negative arguments: NaN


def chatty_loss(out: torch.Tensor) -> torch.Tensor:
    print("loss called")
    return out.sum()


def test_prints_logs_and_warnings_appear_once_per_real_call(capsys, caplog, recwarn):
    torch.manual_seed(0)
    model = Chatty()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="user.model"):
        with nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False)) as guard:
            opt.zero_grad()
            chatty_loss(model(torch.randn(2, 4))).backward()
            opt.step()
    [incident] = guard.incidents
    assert incident.op == "aten.log.default" and incident.details["ops_replayed"] > 0  # it was replayed
    out = capsys.readouterr().out
    assert out.count("forward called") == 1 and out.count("loss called") == 1, out
    assert [r.getMessage() for r in caplog.records if r.name == "user.model"] == ["logged in forward"]
    assert [str(w.message) for w in recwarn if "warned in forward" in str(w.message)] == ["warned in forward"]
    assert logging.root.manager.disable == logging.NOTSET  # logging switched back on after the replay


class OneShot(nn.Module):
    """A model with a side effect: its second call (the replay) raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("generator already exhausted")
        return torch.log(self.fc(x))


def test_a_model_that_cannot_be_replayed_gets_a_diagnosis_that_says_so():
    torch.manual_seed(0)
    model = OneShot()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False)) as guard:
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    [incident] = guard.incidents
    assert incident.action == "skipped" and "localisation_error" not in incident.details
    assert incident.details["not_replayable"] == "RuntimeError: generator already exhausted"
    assert "could not be replayed" in incident.summary and "generator already exhausted" in incident.summary


def test_a_bundle_of_another_format_says_which_version_it_needs(tmp_path):
    import json

    import pytest

    torch.manual_seed(0)
    model = Chatty()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, run_dir=tmp_path / "run", config=nantrace.Config(print_incidents=False)) as guard:
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    bundle = guard.incidents[0].bundle
    env_path = tmp_path / "run" / "incidents" / bundle.rpartition("/")[2] / "env.json"
    env = json.loads(env_path.read_text())
    env["format_version"] = 99
    env_path.write_text(json.dumps(env))
    with pytest.raises(ValueError, match=r"bundle format 99 .* reads formats 1\.\.1: upgrade nantrace"):
        nantrace.replay(bundle, model=Chatty())
    del env["format_version"]
    env_path.write_text(json.dumps(env))
    with pytest.raises(ValueError, match="no valid format_version"):
        nantrace.replay(bundle, model=Chatty())


def test_a_replay_puts_back_every_tensor_it_wrote_in_place():
    """``rerun_scope``'s write guard: a parameter the forward updates itself (a momentum encoder), a
    tensor outside the model that the replayed code fills, and a view of one are put back as they
    were; what the replay made itself is not kept."""
    from nantrace.localisation.rerun import WriteGuard

    outside = torch.arange(6.0).reshape(2, 3).clone()
    param = nn.Parameter(torch.ones(3), requires_grad=False)
    before = (outside.clone(), param.detach().clone())
    guard = WriteGuard()
    with guard:
        made = torch.zeros(3)
        made.add_(1.0)  # the replay's own tensor: not kept
        with torch.no_grad():
            param.mul_(0.5).add_(2.0)  # two writes: the value before the first is kept
        outside[1].fill_(-1.0)  # a write into a view keeps its base
        torch._foreach_mul_([outside], 3.0)
    assert [t is outside or t is param for t, _ in guard.kept] == [True, True]
    assert not torch.equal(outside, before[0]) and not torch.equal(param, before[1])
    guard.restore()
    assert torch.equal(outside, before[0]) and torch.equal(param.detach(), before[1])
    assert torch.equal(made, torch.ones(3))


def test_a_diagnosis_leaves_a_momentum_encoder_as_a_run_that_skipped_the_step():
    """MoCo-style: the forward moves a frozen key encoder towards the query encoder in place. The
    failing step is replayed to diagnose it, and the key encoder must not move a second time."""

    class Momentum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(4, 4)
            self.k = nn.Linear(4, 4)
            for p in self.k.parameters():
                p.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                    pk.mul_(0.9).add_(pq.detach(), alpha=0.1)
            return self.q(x) * self.k(x).detach()

    def run(watched: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Momentum()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randn(3, 4, generator=g)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if step == 2:
                loss = loss + torch.log(torch.zeros(()))  # the step fails in the loss code
            loss.backward()
            if guard is None and step == 2:
                continue  # what nantrace does: skip the update
            opt.step()
        if guard is not None:
            assert len(guard.incidents) == 1
            guard.close()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, watched = run(False), run(True)
    assert all(torch.equal(plain[k], watched[k]) for k in plain)
