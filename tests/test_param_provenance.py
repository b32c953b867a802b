"""Parameters known finite from their provenance (nantrace/detection/param_provenance.py).

The step check reads every parameter only every ``Config.detection.param_check_every`` steps;
between, a parameter is known finite from where its value came from (the last read, then only
updates proven or checked finite) and a write outside the optimizer is found by its version
counter or storage pointer (a write through ``.data`` by the alias a tape saw taken). Shown here on
training loops shaped like real programs (an MLP classifier, a tiny GPT, a VAE, a WGAN critic with
weight clipping, a mean-teacher student):

- an independent oracle (the test's own ``torch.isfinite`` over every parameter right before
  ``optimizer.step()``) predicts every incident, step for step, for every kind of write, and
  the old every-step read (``param_check_every=1``) reports exactly the same incidents;
- a write through ``.data`` is seen by the step's tapes and read at the next check; without them
  (``record_loss_code=False``) provenance cannot see it, and a value nothing reads, or one written
  after the backward, is reported where the design says: the next full read, the next step;
- the cadence of full reads, the reads a legitimate in-place write costs, the cases where the
  tracker is off, and that nothing of it changes a single bit of the weights;
- the run store's ``param_norm`` curve: on the full-read steps, equal to a float64 reference.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace
from nantrace.storage.runstore import RunStore

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 40
EVERY = 16  # the default cadence (DetectionConfig.param_check_every)


# ---------------------------------------------------------------------------- the programs
class Classifier(nn.Module):
    """A small MLP classifier; ``aux`` is a head left over from an earlier experiment: in the
    optimizer (``model.parameters()``), never called, so its gradient stays ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)
        self.aux = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class TinyGPT(nn.Module):
    """Token and position embeddings, one pre-norm causal attention block, a final LayerNorm and
    a head tied to the token embedding: the shape of a small GPT."""

    def __init__(self, vocab: int = 24, dim: int = 16, ctx: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(ctx, dim) * 0.02)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, named "tok.weight"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.tok(ids) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.lnf(x))


class VAE(nn.Module):
    def __init__(self, d: int = 16, h: int = 32, z: int = 4) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(d, h), nn.Linear(h, z), nn.Linear(h, z)
        self.dec1, self.dec2 = nn.Linear(z, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = F.relu(self.enc(x))
        mu, logvar = self.mu(hidden), self.logvar(hidden)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)  # the global RNG, as VAEs do
        return self.dec2(F.relu(self.dec1(z))), mu, logvar


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.leaky_relu(self.fc2(F.leaky_relu(self.fc1(x), 0.2)), 0.2))


class Program:
    """One training program: ``model``/``opt`` are what nantrace watches; ``backward(step)`` does
    the watched step's zero_grad, forward and backward; ``after(step)`` whatever the program does
    after the watched ``optimizer.step()``; ``state()`` every tensor the run ends with."""

    model: nn.Module
    opt: torch.optim.Optimizer
    guard: Any = None
    scaler: Any = None

    def backward(self, step: int) -> None:
        raise NotImplementedError

    def step(self) -> None:
        self.opt.step()

    def after(self, step: int) -> None:
        pass

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


class ClassifierProgram(Program):
    def __init__(self, opt: Callable[[Any], torch.optim.Optimizer] | None = None) -> None:
        torch.manual_seed(0)
        self.model = Classifier()
        self.opt = (opt or (lambda ps: torch.optim.AdamW(ps, lr=3e-3)))(self.model.parameters())
        self.gen = torch.Generator().manual_seed(1)
        self.centres = torch.randn(5, 12, generator=self.gen) * 2

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 5, (32,), generator=self.gen)
        return self.centres[y] + torch.randn(32, 12, generator=self.gen), y

    def backward(self, step: int) -> None:
        x, y = self.batch()
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(x), y).backward()


class GPTProgram(Program):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TinyGPT()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(2)

    def backward(self, step: int) -> None:
        start = torch.randint(0, 24, (8, 1), generator=self.gen)
        seq = (start + torch.arange(9) * 3) % 24  # a learnable pattern: +3 mod 24
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(seq[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)


class VAEProgram(Program):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = VAE()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(3)
        self.basis = torch.randn(4, 16, generator=self.gen)

    def backward(self, step: int) -> None:
        x = torch.sigmoid(torch.randn(32, 4, generator=self.gen) @ self.basis)
        self.opt.zero_grad(set_to_none=True)
        logits, mu, logvar = self.model(x)
        recon = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
        (recon + kl).backward()


class WGANProgram(Program):
    """The original WGAN: the critic (watched) is clipped to [-c, c] after each of its updates,
    in place under ``no_grad`` (a legitimate write outside the optimizer, every step); the
    generator is trained after it, unwatched."""

    def __init__(self, clip: Callable[[str], bool] = lambda name: True, c: float = 0.01) -> None:
        torch.manual_seed(0)
        self.model = Critic()
        self.gen_net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, betas=(0.5, 0.9))
        self.opt_g = torch.optim.Adam(self.gen_net.parameters(), lr=1e-4, betas=(0.5, 0.9))
        self.clipped = [p for name, p in self.model.named_parameters() if clip(name)]
        self.c = c
        self.gen = torch.Generator().manual_seed(4)

    def backward(self, step: int) -> None:
        real = torch.randn(32, 8, generator=self.gen) * 0.5 + 1.0
        fake = self.gen_net(torch.randn(32, 4, generator=self.gen)).detach()
        self.opt.zero_grad(set_to_none=True)
        (self.model(fake).mean() - self.model(real).mean()).backward()

    def after(self, step: int) -> None:
        with torch.no_grad():
            for p in self.clipped:
                p.clamp_(-self.c, self.c)
        self.opt_g.zero_grad(set_to_none=True)
        (-self.model(self.gen_net(torch.randn(32, 4, generator=self.gen))).mean()).backward()
        self.opt_g.step()

    def state(self) -> dict[str, torch.Tensor]:
        return {**super().state(), **{f"G.{k}": v.clone() for k, v in self.gen_net.state_dict().items()}}


class MeanTeacherProgram(Program):
    """A student (watched) trained on labels plus consistency with an EMA teacher; the teacher is
    updated in place after every student update and is in no optimizer."""

    def __init__(self, weight_decay: float = 0.0) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        self.teacher = copy.deepcopy(self.model).requires_grad_(False)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay,
                                   nesterov=True)
        self.gen = torch.Generator().manual_seed(5)

    def backward(self, step: int) -> None:
        x = torch.randn(32, 10, generator=self.gen)
        y = (x[:, :4]).argmax(1)
        noisy = x + 0.1 * torch.randn(32, 10, generator=self.gen)
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            target = self.teacher(noisy).softmax(-1)
        loss = F.cross_entropy(self.model(x), y) + F.mse_loss(self.model(noisy).softmax(-1), target)
        loss.backward()

    def after(self, step: int) -> None:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.model.parameters()):
                t.lerp_(s, 0.01)

    def state(self) -> dict[str, torch.Tensor]:
        return {**super().state(), **{f"teacher.{k}": v.clone() for k, v in self.teacher.state_dict().items()}}


class TanhRegressorProgram(Program):
    """A tanh MLP regressor under AdamW (its decoupled decay never mixes a parameter into the state)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(6)

    def backward(self, step: int) -> None:
        x = torch.randn(32, 10, generator=self.gen)
        self.opt.zero_grad(set_to_none=True)
        F.mse_loss(self.model(x), x[:, :1].sin()).backward()


PROGRAMS: dict[str, Callable[[], Program]] = {
    "classifier": ClassifierProgram, "gpt": GPTProgram, "vae": VAEProgram, "wgan": WGANProgram,
    "mean_teacher": MeanTeacherProgram,
}


# ---------------------------------------------------------------------------- writes between steps
def _set(t: torch.Tensor, index: tuple[int, ...], value: float) -> None:
    t[index] = value


def corrupt(model: nn.Module, name: str, how: str, value: float, rng: random.Random) -> None:
    """Write ``value`` into one element (or a slice) of the parameter ``name``, one of five ways."""
    p = dict(model.named_parameters())[name]
    index = tuple(rng.randrange(n) for n in p.shape)
    if how == "no_grad_index":  # bumps the version counter
        with torch.no_grad():
            _set(p, index, value)
    elif how == "detach_fill_slice":  # detach() shares the version counter
        p.detach()[index[:1]].fill_(value)
    elif how == "load_state_dict":  # copy_ into every parameter
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        for key, v in model.state_dict().items():
            if v.data_ptr() == p.data_ptr():  # every key of the parameter (a tied head has its own)
                _set(sd[key], index, value)
        model.load_state_dict(sd)
    elif how == "new_data":  # a new storage, the version counter untouched
        t = p.detach().clone()
        _set(t, index, value)
        p.data = t
    elif how == "data_index":  # through .data: no mark at all
        _set(p.data, index, value)
    else:
        raise AssertionError(how)


MARKED = ("no_grad_index", "detach_fill_slice", "load_state_dict", "new_data")
HOWS = (*MARKED, "data_index")


def oracle(model: nn.Module) -> list[dict[str, Any]]:
    """The non-finite parameters, by the test's own reading (no nantrace code)."""
    return [{"name": name, "nan": int(torch.isnan(p).sum()), "inf": int(torch.isinf(p).sum()), "numel": p.numel(),
             "shape": list(p.shape)}
            for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def expected_incident(step: int, bad: list[dict[str, Any]]) -> tuple:
    return (step, "nonfinite_param", "nonfinite_param", None, bad[0]["name"].rpartition(".")[0], "raised", bad)


def incident_tuple(i: Any) -> tuple:
    return (i.step, i.kind, i.cause, i.phase, i.module, i.action, i.details.get("nonfinite_params"))


def config(every: int = EVERY, preset: str = "default", **detection: Any) -> nantrace.Config:
    return nantrace.Config.preset(preset, detection={"param_check_every": every, **detection},
                                  outputs={"print_incidents": False})


def untaped(every: int = EVERY) -> nantrace.Config:
    """No tapes (``record_loss_code=False``): nothing sees ``.data`` taken, a write through it leaves no mark."""
    return config(every).replace(localisation={"record_loss_code": False})


def train(prog: Program, *, every: int | None = EVERY, steps: int = STEPS, cfg: nantrace.Config | None = None,
          writes: dict[int, Callable[[Program], None]] | None = None,
          late_writes: dict[int, Callable[[Program], None]] | None = None, run_dir: Any = None,
          before_step: Callable[[int, Program], None] | None = None,
          after_step: Callable[[int, Program], None] | None = None, on_anomaly: str = "skip") -> dict[str, Any]:
    """Run ``prog`` for ``steps`` steps, watched with ``param_check_every=every`` (``None``: unwatched).

    ``writes[step]`` runs at the start of that step (between steps), ``late_writes[step]`` after
    its backward. Right before each ``optimizer.step()`` the oracle reads the parameters
    (``predicted``: the incident every step with a non-finite parameter must raise), then
    ``before_step(step, prog)`` runs; ``after_step(step, prog)`` runs right after an
    ``optimizer.step()`` that returned (``prog.guard`` is the guard). When the guard raises, the
    non-finite elements are put back to their values before the last write (the user repairing
    the weights) and the run goes on, so each write is one event; a write the guard misses stays,
    and the oracle predicts it again at every later step."""
    writes, late_writes = writes or {}, late_writes or {}
    guard = None
    if every is not None:
        guard = nantrace.watch(prog.model, prog.opt, prog.scaler, config=cfg or config(every), run_dir=run_dir,
                               on_anomaly=on_anomaly)
    prog.guard = guard
    raised: list[tuple] = []
    predicted: list[tuple] = []
    pending: dict[str, torch.Tensor] = {}
    for step in range(steps):
        if step in writes:
            pending = {k: v.detach().clone() for k, v in prog.model.named_parameters()}
            writes[step](prog)
        prog.backward(step)
        if step in late_writes:
            pending = {k: v.detach().clone() for k, v in prog.model.named_parameters()}
            late_writes[step](prog)
        bad = oracle(prog.model)
        if bad:
            predicted.append(expected_incident(step, bad))
        if before_step is not None:
            before_step(step, prog)
        try:
            prog.step()
        except nantrace.NonFiniteError as err:
            raised.append(incident_tuple(err.incident))
            with torch.no_grad():
                for name, p in prog.model.named_parameters():
                    if name in pending:
                        p.copy_(torch.where(torch.isfinite(p), p, pending[name]))
            pending = {}
        else:
            if after_step is not None:
                after_step(step, prog)
            prog.after(step)
    if guard is not None:
        guard.close()
    return {
        "raised": raised, "predicted": predicted, "guard": guard, "state": prog.state(),
        "incidents": [incident_tuple(i) for i in guard.incidents] if guard is not None else [],
    }


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def full_reads(steps: int, every: int = EVERY, troubled: Any = (), lost: Any = ()) -> list[int]:
    """The steps whose check reads every parameter, by the design: the first; ``every`` steps after
    the last such; a step with anything non-finite (``troubled``: every parameter is read before
    the triage); the step after one whose read found a parameter non-finite (``lost``: no bound)."""
    full: list[int] = []
    for step in range(steps):
        if not full or step - full[-1] >= every or step in troubled or step - 1 in lost:
            full.append(step)
    return full


def next_full(step: int, every: int = EVERY) -> int:
    """The first step at or after ``step`` whose check reads every parameter (a healthy run)."""
    return -(-step // every) * every


# ---------------------------------------------------------------------------- 1. the oracle
def _plan(program: str, seed: int) -> dict[int, Callable[[Program], None]]:
    """Five writes at random steps (seeded), each a random parameter, each of the five ways once
    (in a random order); NaN or ±inf for the marked writes, NaN through ``.data`` into a parameter
    the forward reads (a NaN there makes the step non-finite whatever element it is: the tied
    embedding is read whole by the head)."""
    rng = random.Random(f"{program}/{seed}")
    names = [n for n, _ in PROGRAMS[program]().model.named_parameters()]
    read = [n for n in names if not n.startswith("aux.")]  # the classifier's unused head: see the next test
    steps = sorted(rng.sample(range(1, STEPS), len(HOWS)))
    hows = rng.sample(HOWS, len(HOWS))
    plan = {}
    for step, how in zip(steps, hows):
        name = rng.choice(read if how == "data_index" else names)
        value = math.nan if how == "data_index" else rng.choice([math.nan, math.inf, -math.inf])
        plan[step] = (lambda prog, name=name, how=how, value=value, seed=rng.random():
                      corrupt(prog.model, name, how, value, random.Random(seed)))
        plan[step].__doc__ = f"{how} {name}={value}"
    return plan


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_every_write_is_reported_at_the_step_the_oracle_predicts(program, seed):
    plan = _plan(program, seed)
    ours = train(PROGRAMS[program](), writes=plan)
    old = train(PROGRAMS[program](), every=1, writes=plan)
    described = {step: plan[step].__doc__ for step in plan}
    # the oracle: every write left a non-finite parameter right before that step's optimizer.step()
    # (the WGAN's clipping turns an earlier ±inf into ±c only after the step, so all are seen)
    assert [p[0] for p in ours["predicted"]] == sorted(plan), described
    assert ours["raised"] == ours["predicted"], described
    assert ours["incidents"] == ours["predicted"], described  # nothing else was reported
    # the every-step read (the old behaviour): the same incidents, the same weights after the repairs
    assert old["predicted"] == ours["predicted"] and old["raised"] == ours["raised"]
    assert old["incidents"] == ours["incidents"]
    assert same_tensors(old["state"], ours["state"])
    # the reads: every parameter on the cadence, at each step that found one non-finite and at the
    # step after it (that read lost the bound); only the written ones (or none) at the others
    raised = [r[0] for r in ours["raised"]]
    full = full_reads(STEPS, troubled=raised, lost=raised)
    prov = ours["guard"].judge.provenance
    assert prov.enabled and (prov.full_steps, prov.partial_steps) == (len(full), STEPS - len(full))
    assert not old["guard"].judge.provenance.enabled


# ---------------------------------------------------------------------------- 2. what no step reads
def _unused_head(prog: Program) -> None:
    prog.model.aux.weight.data.fill_(math.nan)


def _saturated_inf(prog: Program) -> None:
    """A +inf in the first layer of a tanh network: tanh(±inf) = ±1 and its derivative 0, so the
    forward, the loss and every gradient stay finite."""
    prog.model[0].weight.data[3, 7] = math.inf


@pytest.mark.parametrize("program, write, name, counts", [
    (ClassifierProgram, _unused_head, "aux.weight", (96, 0)),
    (TanhRegressorProgram, _saturated_inf, "0.weight", (0, 1)),
])
@pytest.mark.parametrize("at", [3, 16, 17, 31])
def test_a_value_no_step_reads_is_reported_at_the_next_full_read(program, write, name, counts, at):
    shape = list(dict(program().model.named_parameters())[name].shape)
    want = {"name": name, "nan": counts[0], "inf": counts[1], "numel": math.prod(shape), "shape": shape}
    for every, step in ((EVERY, next_full(at)), (1, at)):
        run = train(program(), every=every, writes={at: write}, cfg=untaped(every))
        assert run["predicted"][0] == expected_incident(at, [want])  # the oracle sees it at once
        assert run["raised"] == run["incidents"] == [expected_incident(step, [want])], every
    seen = train(program(), writes={at: write})  # the prelude saw .data taken and the alias written: a mark
    assert seen["raised"] == seen["incidents"] == [expected_incident(at, [want])]


def test_a_write_through_data_after_the_backward_is_reported_one_step_later():
    """Without tapes: no mark, and no effect on the step it lands in (its forward and backward are done):
    the update runs (AdamW writes NaN only where the NaN already was), and the next step's forward is
    non-finite, so every parameter is read: ``nonfinite_param`` one step after the write. With them, the
    gradient tape saw ``.data`` taken: a mark, read at that step's own check."""
    want = [{"name": "fc2.weight", "nan": 1, "inf": 0, "numel": 1024, "shape": [32, 32]}]

    def late(prog: Program) -> None:
        prog.model.fc2.weight.data[4, 9] = math.nan

    ours = train(ClassifierProgram(), late_writes={5: late}, steps=12, cfg=untaped())
    old = train(ClassifierProgram(), every=1, late_writes={5: late}, steps=12)
    assert old["predicted"] == old["raised"] == old["incidents"] == [expected_incident(5, want)]
    assert ours["predicted"] == [expected_incident(5, want), expected_incident(6, want)]
    assert ours["raised"] == ours["incidents"] == [expected_incident(6, want)]
    taped = train(ClassifierProgram(), late_writes={5: late}, steps=12)
    assert taped["predicted"] == taped["raised"] == taped["incidents"] == [expected_incident(5, want)]


# ---------------------------------------------------------------------------- 3. the cadence and the reads
def _count_norms(monkeypatch) -> list[list[int]]:
    """The tensor count of every ``torch._foreach_norm`` call, per step: ``train``'s ``before_step``
    (right before ``optimizer.step()``) must append a new list each step."""
    steps: list[list[int]] = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        steps[-1].append(len(tensors))  # nothing before the first step's before_step may call it
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    return steps


def _minimal(every: int = EVERY, **detection: Any) -> nantrace.Config:
    return config(every, preset="minimal", **detection)


@pytest.mark.parametrize("every", [2, 5, 16, 40])
def test_a_healthy_run_reads_every_parameter_on_the_cadence_only(monkeypatch, every):
    prog = ClassifierProgram()
    n = len(list(prog.model.parameters()))
    n_grads = n - 2  # aux has no gradient
    counts = _count_norms(monkeypatch)
    run = train(prog, cfg=_minimal(every), before_step=lambda step, p: counts.append([]))
    assert run["incidents"] == [] and run["predicted"] == []
    prov = run["guard"].judge.provenance
    full = [s for s in range(STEPS) if s % every == 0]
    assert (prov.full_steps, prov.partial_steps) == (len(full), STEPS - len(full))
    # a full read: every gradient and every parameter in one call (the totals are taken on the host); between: the gradients
    assert counts == [[n_grads + n] if s in full else [n_grads] for s in range(STEPS)]


@pytest.mark.parametrize("clip, clipped", [
    (lambda name: True, 6),                        # the WGAN paper: every critic parameter
    (lambda name: name.endswith("weight"), 3),     # some code bases clip the weights only
], ids=["clip_all", "clip_weights"])
def test_a_legitimate_in_place_write_is_read_at_the_next_step(monkeypatch, clip, clipped):
    prog = WGANProgram(clip)
    n = len(list(prog.model.parameters()))
    counts = _count_norms(monkeypatch)
    run = train(prog, cfg=_minimal(), before_step=lambda step, p: counts.append([]))
    assert run["incidents"] == [] and run["predicted"] == []
    prov = run["guard"].judge.provenance
    assert (prov.full_steps, prov.partial_steps) == (3, STEPS - 3)
    # the generator's own optimizer runs no foreach_norm of nantrace's (it is not watched)
    assert counts == [[2 * n] if s % EVERY == 0 else [n + clipped] for s in range(STEPS)]
    # and the bytes are those of the unwatched program
    assert same_tensors(run["state"], train(WGANProgram(clip), every=None)["state"])


def test_the_parameters_a_step_reads_are_those_written_outside_the_optimizer():
    """``plan()`` names exactly the written parameters: the clipped ones, nothing else."""
    prog = WGANProgram(lambda name: name.startswith("fc2"))
    plans: list[list[int] | None] = []
    guard = nantrace.watch(prog.model, prog.opt, config=_minimal())
    prov = guard.judge.provenance
    real = prov.plan
    prov.plan = lambda: plans.append(real()) or plans[-1]  # type: ignore[method-assign]
    for step in range(20):
        prog.backward(step)
        prog.opt.step()
        prog.after(step)
    guard.close()
    names = [name for name, _ in prog.model.named_parameters()]
    fc2 = [names.index("fc2.weight"), names.index("fc2.bias")]
    assert plans == [None] + [fc2] * 15 + [None] + [fc2] * 3


# ---------------------------------------------------------------------------- 4. where it is off
@pytest.mark.parametrize("make, cfg, enabled", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=1e-2), _minimal(), False),  # L2 into the moments
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), _minimal(check_updates=False), False),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), _minimal(1), False),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), nantrace.Config.preset("thorough", outputs={"print_incidents": False}),
     False),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=1e-2, decoupled_weight_decay=True), _minimal(), True),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2), _minimal(), True),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-2), _minimal(), False),  # L2 into the buffer
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), _minimal(), True),
], ids=["adam_l2", "check_updates_off", "every_1", "thorough", "adam_decoupled", "adamw", "sgd_l2", "sgd"])
def test_where_the_tracker_is_off_every_step_reads_every_parameter(monkeypatch, tmp_path, make, cfg, enabled):
    prog = ClassifierProgram(make)
    n = len(list(prog.model.parameters()))
    counts = _count_norms(monkeypatch)
    run = train(prog, cfg=cfg, run_dir=tmp_path, steps=20,
                before_step=lambda step, p: counts.append([]))
    assert run["incidents"] == []
    prov = run["guard"].judge.provenance
    assert prov.enabled is enabled
    with RunStore(tmp_path, readonly=True) as store:
        present = [r["param_norm"] is not None for r in store.steps()]
    if enabled:
        assert (prov.full_steps, prov.partial_steps) == (2, 18)
        assert present == [s % EVERY == 0 for s in range(20)]
    else:
        assert (prov.full_steps, prov.partial_steps) == (0, 0)  # not tracking: nothing counted
        assert present == [True] * 20
        step_check = [c[:1] for c in counts]  # the step check's call (thorough adds its statistics after it)
        inputs = 1 if cfg.detection.check_inputs else 0  # the model's input, in the same call (its norm)
        assert step_check == [[n - 2 + n + inputs]] * 20


def test_the_thorough_preset_reads_every_parameter():
    assert nantrace.Config.preset("thorough").detection.param_check_every == 1
    assert nantrace.Config().detection.param_check_every == EVERY
    with pytest.raises(ValueError):
        config(0)


# ---------------------------------------------------------------------------- 5. fused AdamW
def test_fused_adamw_needs_no_extra_reads_and_changes_no_bit(monkeypatch):
    """The fused kernel does not bump the version counters: nothing marks its writes, and nothing
    needs to (the guard knows the update from its own hook)."""
    fused = lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05, fused=True)  # noqa: E731
    probe = ClassifierProgram(fused)
    probe.backward(0)
    before = [p._version for p in probe.model.parameters()]
    probe.opt.step()
    assert [p._version for p in probe.model.parameters()] == before  # the premise

    prog = ClassifierProgram(fused)
    n_grads = len(list(prog.model.parameters())) - 2
    counts = _count_norms(monkeypatch)
    run = train(prog, cfg=_minimal(), before_step=lambda step, p: counts.append([]))
    assert run["incidents"] == []
    prov = run["guard"].judge.provenance
    assert (prov.full_steps, prov.partial_steps) == (3, STEPS - 3)
    assert [c for s, c in enumerate(counts) if s % EVERY] == [[n_grads]] * (STEPS - 3)
    monkeypatch.undo()
    assert same_tensors(run["state"], train(ClassifierProgram(fused), every=None)["state"])
    assert same_tensors(run["state"], train(ClassifierProgram(fused), every=1)["state"])


# ---------------------------------------------------------------------------- 6. the weights
def _bound_holds(bounds: list[float | None]) -> Callable[[int, Program], None]:
    """After each update: the carried bound (what the next step's proof starts from) bounds every
    parameter element, measured by the test in float64."""

    def check(step: int, prog: Program) -> None:
        bound = prog.guard.judge.provenance.bound
        bounds.append(bound)
        top = max(float(p.detach().double().abs().max()) for p in prog.opt.param_groups[0]["params"])
        assert bound is not None and top <= bound, (step, top, bound)

    return check


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_weights_are_bit_identical_to_the_every_step_read_and_to_no_guard(program):
    bounds: list[float | None] = []
    ours = train(PROGRAMS[program](), after_step=_bound_holds(bounds))
    assert ours["incidents"] == [] and len(bounds) == STEPS
    prov = ours["guard"].judge.provenance
    assert (prov.full_steps, prov.partial_steps) == (3, STEPS - 3)
    assert same_tensors(ours["state"], train(PROGRAMS[program](), every=1)["state"])
    assert same_tensors(ours["state"], train(PROGRAMS[program](), every=None)["state"])


# ---------------------------------------------------------------------------- 7. the run store
@pytest.mark.parametrize("program", ["gpt", "vae"])
def test_the_stored_parameter_norm_is_there_on_the_full_reads_and_exact(tmp_path, program):
    reference: list[float] = []

    def norm(step: int, prog: Program) -> None:
        reference.append(math.sqrt(math.fsum(float(p.detach().double().pow(2).sum()) for p in prog.opt.param_groups[0]["params"])))

    run = train(PROGRAMS[program](), run_dir=tmp_path, before_step=norm)
    assert run["incidents"] == []
    with RunStore(tmp_path, readonly=True) as store:
        rows = store.steps()
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["param_norm"] is not None for r in rows] == [s % EVERY == 0 for s in range(STEPS)]
    for r in rows:
        if r["param_norm"] is not None:
            assert r["param_norm"] == pytest.approx(reference[r["step"]], rel=1e-5)
    # the report draws the parameter norm through the steps that read it: a line, not 15 gaps in 16
    from nantrace.report.data import load_report_data

    for buckets in (10_000, 8):  # every step drawn, and min/max/last per bucket of 5 steps
        curve = next(c for c in load_report_data(tmp_path, max_curve_buckets=buckets).curves if c.key == "param_norm")
        assert list(curve.x) == [0, 16, 32] and all(math.isfinite(v) for v in curve.y)
    # what a trainer's logger gets: the last read norm and the step it was read at
    last = run["guard"].last_step
    assert (last["step"], last["param_norm_step"]) == (STEPS - 1, 32)
    assert last["param_norm"] == pytest.approx(reference[32], rel=1e-5)


# ---------------------------------------------------------------------------- more programs
def test_a_layer_reinitialised_mid_run_is_read_and_widens_the_bound():
    """Fine-tuning phases re-initialise a head (``reset_parameters``, ``nn.init``): in place under
    ``no_grad``, so marked; the next step reads exactly those tensors, and the carried bound (SGD's
    is tight: the last norm plus one step) grows to cover their new, larger values."""
    prog = MeanTeacherProgram()
    names = [n for n, _ in prog.model.named_parameters()]
    plans: list[list[int] | None] = []

    def reinit(p: Program) -> None:
        p.model[0].reset_parameters()
        nn.init.normal_(p.model[0].weight, std=50.0)

    def spy(step: int, p: Program) -> None:
        prov = p.guard.judge.provenance
        if not hasattr(prov, "spied"):
            real, prov.spied = prov.plan, True
            prov.plan = lambda: plans.append(real()) or plans[-1]

    bounds: list[float | None] = []
    ours = train(prog, writes={10: reinit}, before_step=spy, after_step=_bound_holds(bounds))
    assert ours["incidents"] == [] and ours["predicted"] == []
    assert plans == [None] + [[]] * 9 + [[names.index("0.weight"), names.index("0.bias")]] + [[]] * 5 + [None] \
        + [[]] * 15 + [None] + [[]] * 7
    assert bounds[9] < 50.0 < bounds[10]  # the re-initialised weights, not the old bound, bound step 10's update
    assert same_tensors(ours["state"], train(MeanTeacherProgram(), every=1, writes={10: reinit})["state"])
    assert same_tensors(ours["state"], train(MeanTeacherProgram(), every=None, writes={10: reinit})["state"])


@pytest.mark.parametrize("policy, action", [("skip", "skipped"), ("rollback", "rolled_back")])
def test_a_nonfinite_batch_reads_every_parameter_and_restarts_the_cadence(tmp_path, policy, action):
    """A step with anything non-finite reads every parameter before the triage: the incident is the
    batch's (not the parameters'), the full read restarts the cadence (the run store's
    ``param_norm`` shows it), and a rollback's ``load_state_dict`` is read at the next step."""
    cfg = config().replace(response={"rollback_interval": 5})
    reference: dict[int, float] = {}

    def nan_batch(p: Program) -> None:
        real = p.batch

        def once() -> tuple[torch.Tensor, torch.Tensor]:
            p.batch = real
            x, y = real()
            x[3, 5] = math.nan
            return x, y

        p.batch = once

    def norm(step: int, p: Program) -> None:
        reference[step] = math.sqrt(math.fsum(float(q.detach().double().pow(2).sum()) for q in p.model.parameters()))

    ours = train(ClassifierProgram(), cfg=cfg, on_anomaly=policy, writes={12: nan_batch}, run_dir=tmp_path / "ours",
                 before_step=norm)
    old = train(ClassifierProgram(), cfg=cfg.replace(detection={"param_check_every": 1}), on_anomaly=policy,
                writes={12: nan_batch})
    assert ours["incidents"] == old["incidents"] == [(12, "nonfinite_input", "nonfinite_input", "data", None, action, None)]
    assert ours["predicted"] == [] and same_tensors(ours["state"], old["state"])
    full = full_reads(STEPS, troubled=[12])
    assert full == [0, 12, 28]
    prov = ours["guard"].judge.provenance
    assert (prov.full_steps, prov.partial_steps) == (len(full), STEPS - len(full))
    with RunStore(tmp_path / "ours", readonly=True) as store:
        rows = store.steps()
    assert [r["step"] for r in rows if r["param_norm"] is not None] == full
    for r in rows:
        if r["param_norm"] is not None:
            assert r["param_norm"] == pytest.approx(reference[r["step"]], rel=1e-5)


def test_a_grad_scaler_run_is_unchanged(tmp_path):
    """Mixed precision with a GradScaler: the scaler's calibration skips (non-finite scaled
    gradients) are troubled steps, read in full; the updates through ``scaler.step`` are tracked;
    the weights and the scaler's state are those of the every-step read and of no guard."""

    class AMPProgram(ClassifierProgram):
        def __init__(self) -> None:
            super().__init__()
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=8)

        def backward(self, step: int) -> None:
            x, y = self.batch()
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(self.model(x).float(), y)
            self.scaler.scale(loss).backward()

        def step(self) -> None:
            self.scaler.step(self.opt)
            self.scaler.update()

        def state(self) -> dict[str, torch.Tensor]:
            return {**super().state(), "scale": self.scaler.get_scale() * torch.ones(())}

    ours = train(AMPProgram(), run_dir=tmp_path)
    with RunStore(tmp_path, readonly=True) as store:
        rows = store.steps()
    skipped = [r["step"] for r in rows if r["skipped"]]
    assert ours["incidents"] == [] and skipped and len(rows) == STEPS
    full = full_reads(STEPS, troubled=skipped)
    prov = ours["guard"].judge.provenance
    assert (prov.full_steps, prov.partial_steps) == (len(full), STEPS - len(full))
    assert [r["step"] for r in rows if r["param_norm"] is not None] == full
    assert same_tensors(ours["state"], train(AMPProgram(), every=1)["state"])
    assert same_tensors(ours["state"], train(AMPProgram(), every=None)["state"])


@pytest.mark.parametrize("weight_decay", [1e-4, 0.0])
def test_an_unread_value_never_reaches_the_optimizer_state(weight_decay):
    """A value no step's forward reads and no mark announces (a +inf through ``.data`` into a
    saturated tanh unit). Under L2 weight decay the update would fold it into the momentum buffer
    (inf - lr·inf = NaN in the weight, inf in the buffer): the tracker is off there, so the check
    reads every parameter every step and raises before that update, as the every-step read does.
    Without weight decay the update leaves the inf where it is (inf - lr·finite) and the buffer
    finite: without tapes it is found at the next full read, and the incident says since when the
    parameters were known finite; with them, the prelude saw the ``.data`` write: at once."""
    want_inf = [{"name": "0.weight", "nan": 0, "inf": 1, "numel": 320, "shape": [32, 10]}]
    buffers: dict[int, dict[int, bool]] = {}

    def buffer(step: int, p: Program) -> None:
        state = p.opt.state.get(p.model[0].weight, {})
        buffers.setdefault(p.guard.judge.provenance.every, {})[step] = bool(
            torch.isfinite(state["momentum_buffer"]).all()) if state else True

    class Student(MeanTeacherProgram):
        def after(self, step: int) -> None:  # no teacher: the student alone
            pass

    ours = train(Student(weight_decay), writes={17: _saturated_inf}, steps=34, before_step=buffer,
                 cfg=None if weight_decay else untaped())
    old = train(Student(weight_decay), every=1, writes={17: _saturated_inf}, steps=34, before_step=buffer)
    assert old["raised"] == old["incidents"] == [expected_incident(17, want_inf)]
    assert buffers[1] == dict.fromkeys(range(34), True)
    assert buffers[EVERY] == dict.fromkeys(range(34), True)  # the inf never reaches the buffer
    prov = ours["guard"].judge.provenance
    if weight_decay:
        assert not prov.enabled and ours["raised"] == ours["incidents"] == [expected_incident(17, want_inf)]
        return
    assert prov.enabled and ours["raised"] == ours["incidents"] == [expected_incident(32, want_inf)]
    incident = ours["guard"].incidents[0]
    assert incident.details["params_last_read"] == 16 and incident.details["last_update"] == 31
    assert "read finite at step 16" in incident.summary and "leaves no mark" in incident.summary
    taped = train(Student(weight_decay), writes={17: _saturated_inf}, steps=34)
    assert taped["raised"] == taped["incidents"] == [expected_incident(17, want_inf)]