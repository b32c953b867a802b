"""The loss tape itself: it records only the loss code, leaves the mode stack as it found it,
replays random calls with the real step's draws, and costs nothing outside its window."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import nantrace


class Recorder(TorchFunctionMode):
    """A user's own function mode, pushed inside the loss code."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, loss_code) -> None:
    opt.zero_grad()
    loss_code(model(x)).backward()
    opt.step()


def test_only_the_loss_code_is_taped_and_the_stack_is_left_clean():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    tape = guard.recorder.capture.tape
    prelude = guard.recorder.capture.prelude
    _step(model, opt, torch.randn(8, 4), lambda out: F.mse_loss(out, torch.zeros_like(out)))
    # the loss tape left the stack at backward(); after the update the prelude (the next step's code
    # before its forward) is the one nantrace mode there
    assert torch._C._len_torch_function_stack() == 1 and torch._C._get_function_stack_at(0) is prelude
    opt.zero_grad()
    x = torch.randn(8, 4)
    out = model(x * 0.5)
    assert torch._C._len_torch_function_stack() == 1 and torch._C._get_function_stack_at(0) is tape  # the loss code's
    assert [getattr(e.func, "__name__", "?") for e in prelude.entries] == ["randn", "mul"]  # not zero_grad's reads of .grad
    loss = F.mse_loss(out, torch.zeros_like(out))
    seen = [getattr(e.func, "__name__", "?") for e in tape.entries]
    assert seen == ["zeros_like", "mse_loss"] and tape.losses == []
    loss.backward()
    assert tape.loss is not None and len(tape.losses) == 1
    opt.step()
    with Recorder():  # a user's mode pushed above the tape, still open when the guard closes
        out = model(torch.randn(8, 4))
        guard.close()
        assert torch._C._len_torch_function_stack() == 1  # the user's mode stays, nantrace's is gone
    assert torch._C._len_torch_function_stack() == 0


def test_the_sampled_statistics_hooks_are_not_taped_as_loss_code():
    """On a sampled step the logits and activation statistics hooks run after the guard's own hook
    has resumed the loss tape: their ops (no_grad, amax, ...) are the guard's, not the user's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nantrace.watch(model, opt, config=nantrace.Config(
        outputs={"print_incidents": False}, dynamics={"logit_stats_every": 1, "activation_stats_every": 1}))
    for _ in range(2):
        tape = guard.recorder.capture.tape
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 10, (8,)))
        assert [getattr(e.func, "__name__", "?") for e in tape.entries] == ["randint", "cross_entropy"]
        loss.backward()
        opt.step()
    guard.close()
    summary = nantrace.dynamics.summary(guard)
    assert summary["logits"]["step"] is not None  # the hook ran (and the activation hooks on the sampled steps)


def test_a_watched_forward_ends_every_other_guards_prelude_but_not_its_loss_tape():
    """Two watched models trained in turn (an actor and a critic with their own optimizers): the
    actor's prelude (the code before its next forward) stops where the critic's forward begins, so
    it never tapes the critic's step; a watched model's forward inside another's loss code (the
    critic scoring the actor's action) is still taped as that loss code."""
    torch.manual_seed(0)
    actor, critic = nn.Sequential(nn.Linear(4, 2), nn.Tanh()), nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_a, opt_c = torch.optim.Adam(actor.parameters()), torch.optim.Adam(critic.parameters())
    a_guard = nantrace.watch(actor, opt_a, config=nantrace.Config(print_incidents=False))
    c_guard = nantrace.watch(critic, opt_c, config=nantrace.Config(print_incidents=False))
    a_prelude = a_guard.recorder.capture.prelude
    for _ in range(3):
        state = torch.randn(8, 4)
        # the actor's step: the critic's forward in its loss code is the actor's loss code
        opt_a.zero_grad()
        action = actor(state)
        a_tape = a_guard.recorder.capture.tape
        value = critic(torch.cat([state, action], dim=1))
        (-value.mean()).backward()
        names = [getattr(e.func, "__name__", "?") for e in a_tape.entries]
        assert names[:1] == ["cat"] and "linear" in names, names
        opt_a.step()
        # the critic's step, on a target: the actor's prelude has taped the target, not the critic
        target = torch.randn(8, 1) * 0.5
        opt_c.zero_grad()
        pred = critic(torch.cat([state, action.detach()], dim=1))
        assert not a_prelude.recording
        assert [getattr(e.func, "__name__", "?") for e in a_prelude.entries] == ["randn", "mul", "detach", "cat"]
        F.mse_loss(pred, target).backward()
        opt_c.step()
        assert [getattr(e.func, "__name__", "?") for e in a_prelude.entries] == ["randn", "mul", "detach", "cat"]
    a_guard.close()
    c_guard.close()
    assert torch._C._len_torch_function_stack() == 0
    assert a_guard.incidents == [] and c_guard.incidents == []


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def noisy_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x).expand(1, 4)
    noise = torch.rand(out.shape)  # drawn in the loss code, between two forwards
    chosen = (noise < 0.25).float()  # which entries the loss keeps depends on the draw
    anchor = model(x * 0).expand(1, 4)  # a second forward: its replay runs before the loss code's
    return ((out - anchor) * chosen).sum() / chosen.sum()  # 0/0 when nothing was chosen


def test_random_calls_in_the_loss_code_replay_with_the_real_draws():
    """Whether the loss is 0/0 depends on the noise drawn in the loss code: the replay must draw the
    same noise (the tape restores the RNG where recording started), or it would not reproduce: the
    second forward is replayed before the loss code, from an RNG state taken after the draw."""
    torch.manual_seed(0)
    model = Noisy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False))
    with guard:
        for step in range(60):
            opt.zero_grad()
            noisy_loss(model, torch.randn(1, 1)).backward()
            opt.step()
            if guard.incidents:
                break
    hits = [i for i in guard.incidents if i.kind == "nonfinite_loss"]
    assert hits, "no draw chose nothing in 60 steps"
    first = hits[0]
    assert (first.op, first.module, first.cause, first.transient) == ("aten.div.Tensor", None, "div_by_zero", False)


def test_a_compiled_loss_function_is_diagnosed_without_recompiling_for_the_tape(recwarn):
    """torch.compile'd loss code: dynamo does not trace into the tape (no recompilations of its
    handler); the compiled graph's calls are taped at run time and attributed to the user's file."""
    import torch._dynamo

    torch._dynamo.reset()

    @torch.compile(backend="aot_eager")
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y) + torch.log(out.softmax(-1)).mean() * 0

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, config=nantrace.Config(print_incidents=False)) as guard:
        for i in range(5):
            x = torch.randn(4, 8) * (1e4 if i == 3 else 1)  # softmax underflows to 0: log(0)
            opt.zero_grad()
            loss_fn(model(x), torch.randint(0, 4, (4,))).backward()
            opt.step()
    [inc] = guard.incidents
    assert (inc.step, inc.op, inc.module, inc.cause) == (3, "aten.log.default", None, "log_nonpositive")
    assert inc.source.startswith("tests/test_loss_tape.py:") or "test_loss_tape.py:" in inc.source
    assert not [w for w in recwarn if "recompile" in str(w.message).lower()]


def test_the_prelude_traces_a_value_made_before_the_forward_and_replays_without_side_effects(tmp_path):
    """PPO-shaped: advantages normalised before the policy's forward (std = 0 when every reward is
    equal), while between steps the loop clips weights in place, keeps an EMA and draws from its own
    generator. The incident names the division on its line (not "the batch"); the replay of the
    prelude touched none of the real state: the weights equal a run whose prelude is not taped."""
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def run(record: bool, run_dir=None) -> tuple[list, dict]:
        torch.manual_seed(0)
        policy = make()
        ema = [p.detach().clone() for p in policy.parameters()]
        opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
        guard = nantrace.watch(policy, opt, run_dir=run_dir, config=nantrace.Config(
            outputs={"print_incidents": False}, localisation={"record_loss_code": record}))
        gen = torch.Generator().manual_seed(3)
        for step in range(8):
            obs = torch.randn(32, 4, generator=gen)
            rewards = torch.ones(32) if step == 5 else torch.rand(32, generator=gen)
            adv = (rewards - rewards.mean()) / rewards.std()  # <origin:adv>
            opt.zero_grad()
            logp = torch.log_softmax(policy(obs), -1)[:, 0]
            (-(logp * adv).mean()).backward()
            opt.step()
            with torch.no_grad():
                for p, e in zip(policy.parameters(), ema):
                    p.data.clamp_(-0.5, 0.5)
                    e.mul_(0.9).add_(p, alpha=0.1)
        guard.close()
        return guard.incidents, {**policy.state_dict(), **{f"ema{i}": e for i, e in enumerate(ema)}}

    with_prelude, state = run(True, run_dir=tmp_path / "run")
    without, reference = run(False)
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    [incident] = with_prelude
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "# <origin:adv>" in text)
    assert (incident.step, incident.kind, incident.op, incident.cause) == (5, "nonfinite_loss", "aten.div.Tensor", "zero_variance_norm")
    assert incident.source.endswith(f"test_loss_tape.py:{line}")
    assert [(i.step, i.kind, i.cause) for i in without] == [(5, "nonfinite_loss", "unknown")]  # no tapes: no op
    # the bundle carries the prelude: replaying it names the same division on the same line
    again = nantrace.replay(incident.bundle, make())
    assert (again.kind, again.op, again.cause, again.source) == (incident.kind, incident.op, incident.cause, incident.source)


def test_code_between_micro_batches_is_loss_code_and_code_after_the_last_backward_is_not():
    """Under gradient accumulation the code between one micro-batch's backward() and the next forward
    (a statistic of the last micro-batch handed to the next) is loss code: kept, in order, before the
    next forward's calls. What runs after the step's last backward() (a long per-parameter loop over
    the gradients, clipping) is the gradient tape's: dropped from the loss tape when the optimizer
    steps, and a tape filled up by it alone is not marked truncated."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        tape = guard.recorder.capture.tape
        opt.zero_grad()
        x1, x2 = torch.randn(4, 4), torch.randn(4, 4)
        F.mse_loss(model(x1), torch.zeros(4, 1)).backward()
        scale = x1.std(0, keepdim=True)  # between the micro-batches
        out = model(x2 / scale)
        assert guard.recorder.capture.forwards[1].tape_at == 4  # zeros, mse_loss, std, div came before it
        F.mse_loss(out, torch.zeros(4, 1)).backward()
        loss_calls = [getattr(e.func, "__name__", "?") for e in tape.entries]
        assert loss_calls == ["zeros", "mse_loss", "std", "div", "zeros", "mse_loss"]
        from nantrace.loss_tape import MAX_ENTRIES

        for _ in range(MAX_ENTRIES // 4 + 1):  # after the last backward: a hand-written gradient transform, longer than the tape
            for p in model.parameters():
                p.grad.mul_(1.0)
        assert tape.truncated
        seen: list[tuple[list[str], bool]] = []
        opt.register_step_pre_hook(  # after the guard's own pre-hook, before the step ends and the tape resets
            lambda *_: seen.append(([getattr(e.func, "__name__", "?") for e in tape.entries], tape.truncated)))
        opt.step()
        assert seen == [(loss_calls, False)]
    finally:
        guard.close()


def test_every_replay_of_a_taped_draw_from_a_generator_draws_the_same_values() -> None:
    """The tape keeps a snapshot of a ``generator=`` argument; a replay draws from a copy of it, so a second replay
    (the float32 re-run, a bundle's replay) draws what the step drew, not the values after it."""
    from nantrace.localisation.loss_replay import _Decoder

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False}))
    try:
        opt.zero_grad()
        out = model(torch.randn(8, 4))
        noise = torch.rand(out.shape, generator=g)
        (out * noise).sum().backward()
        [taped] = [a for e in guard.recorder.tape.entries for a in (*e.args, *e.kwargs.values())
                   if isinstance(a, torch.Generator)]
        draws = [torch.rand(out.shape, generator=_Decoder({}, set(), [], {})(taped)) for _ in range(2)]
        assert torch.equal(draws[0], noise) and torch.equal(draws[1], noise)
        opt.step()
    finally:
        guard.close()
