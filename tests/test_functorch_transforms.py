"""A model run inside a ``torch.func`` transform (per-sample gradients by ``vmap(grad(functional_call))``,
as DP-SGD does): nothing of nantrace keeps the transform's wrapped tensors (the model's forward hooks and
the tapes let calls at a functorch level pass), so the user's program runs as without nantrace, and a
failure born in the code that turns the per-sample gradients into ``p.grad`` is found there. The same holds for
any step whose own code writes ``p.grad`` with no ``backward()`` (an evolution strategy scoring its candidates
under ``torch.no_grad()``): the prelude's replay names the op and line (docs/diagnosis.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nantrace
from origin_markers import points_at

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]
FAIL = 2


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _sample_loss(model: nn.Module):
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0))
    return loss


def _dp_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: float,
             *, pad: bool) -> None:
    """One step of normalised DP-SGD: per-sample gradients, each scaled to length ``clip`` by its own norm
    (not clipped: normalised), averaged."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(_sample_loss(model)), in_dims=(None, 0, 0))(params, x, y)
    if pad:  # a padded last batch: the padding rows' gradients are zeroed before clipping
        per_sample = {k: torch.cat([g[:-2], torch.zeros_like(g[-2:])]) for k, g in per_sample.items()}
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    factor = clip / norms  # <origin:dp_factor>
    opt.zero_grad()
    for name, p in model.named_parameters():
        g = per_sample[name]
        p.grad = (g * factor.view(-1, *[1] * (g.dim() - 1))).mean(0)
    opt.step()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("watched", [False, True])
def test_a_healthy_dp_sgd_run_is_untouched(watched: bool) -> None:
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
    try:
        for step in range(4):
            _dp_step(model, opt, *_batch(step), clip=1.0, pad=False)
    finally:
        if guard is not None:
            guard.close()
    reference = Tagger()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        _dp_step(reference, ref_opt, *_batch(step), clip=1.0, pad=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    if guard is not None:
        assert guard.incidents == [] and guard.recorder.capture.forwards == []


def test_a_zero_per_sample_norm_is_found_in_the_clipping_code() -> None:
    """The padded rows' per-sample gradient is 0: clip / 0 = inf, and 0 * inf = NaN in their scaled
    gradient, averaged into every p.grad. The NaN is born in the code between the transform and
    optimizer.step(); the per-sample gradients come out of the transform finite."""
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before: list[torch.Tensor] = []
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(FAIL + 2):
            if step == FAIL:
                before = [p.detach().clone() for p in model.parameters()]
            _dp_step(model, opt, *_batch(step), clip=1.0, pad=step == FAIL)
            if step == FAIL:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was skipped
    first: Any = guard.incidents[0]
    # No forward of the model and no backward() ran outside the transform: the code that wrote p.grad is replayed
    # from the prelude on its real inputs. `clip / norms` is `norms.reciprocal() * clip` in ATen: the reciprocal of
    # the zero norm made the inf (the origin rule), and its divisor is a norm of gradients (docs/diagnosis.md's
    # provenance rule): zero_variance_norm. Phase backward: the step's gradients are what its code made
    # non-finite, as for code between backward() and optimizer.step() (API.md's phase of a gradient); no module
    # ran it.
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action) == \
        (FAIL, "nonfinite_grad", "backward", "aten.reciprocal.default", None, "zero_variance_norm", "skipped")
    assert points_at(first.source, __file__, "dp_factor"), first.source
    assert first.transient is False


POPULATION = 6


def _fitness(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A candidate's score: its accuracy on the batch (a step function of the weights)."""
    logits = functional_call(model, params, (x,))
    return (logits.argmax(1) == y).float().mean()


def _es_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, sigma: float,
             gen: torch.Generator) -> None:
    """One step of evolution strategies: candidates around the weights, scored under no_grad, the gradient
    estimated from the noise weighted by the standardised fitness and written into p.grad (no backward())."""
    base = {k: v.detach() for k, v in model.named_parameters()}
    noise = {k: torch.randn((POPULATION, *v.shape), generator=gen) for k, v in base.items()}
    with torch.no_grad():
        scores = torch.stack([_fitness(model, {k: v + sigma * noise[k][i] for k, v in base.items()}, x, y)
                              for i in range(POPULATION)])
    weights = (scores - scores.mean()) / scores.std()  # <origin:es_weights>
    opt.zero_grad()
    for name, p in model.named_parameters():
        eps = noise[name]
        p.grad = -(eps * weights.view(-1, *[1] * (eps.dim() - 1))).mean(0) / sigma
    opt.step()


def _es_run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, fail: int | None) -> None:
    """ES on the tagger; at step ``fail`` the noise scale has been annealed so far that every candidate predicts
    as the weights do: all score the same, the fitness std is 0."""
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        _es_step(model, opt, *_batch(step), sigma=1e-7 if step == fail else 0.5, gen=gen)


@pytest.mark.parametrize("watched", [False, True])
def test_a_healthy_evolution_strategies_run_is_untouched(watched: bool) -> None:
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) if watched else None
    try:
        _es_run(model, opt, 4, None)
    finally:
        if guard is not None:
            guard.close()
    reference = Tagger()
    _es_run(reference, torch.optim.SGD(reference.parameters(), lr=0.1), 4, None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    if guard is not None:
        assert guard.incidents == []


def test_a_zero_fitness_std_is_found_in_the_evolution_strategies_code() -> None:
    """Only no-grad forwards of the model run (the candidates' evaluation: they make no gradient) and no
    backward(): the step's own code wrote p.grad, from fitness-weighted noise divided by the fitness std, 0 when
    every candidate scores the same; (0 - 0) / 0 is NaN in every gradient."""
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        _es_run(model, opt, FAIL + 2, FAIL)
    first: Any = guard.incidents[0]
    # the divisor is the std of a constant slice (the provenance rule): zero_variance_norm; phase and module as
    # for the DP-SGD step above
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action) == \
        (FAIL, "nonfinite_grad", "backward", "aten.div.Tensor", None, "zero_variance_norm", "skipped")
    assert points_at(first.source, __file__, "es_weights"), first.source
    assert first.transient is False


def test_a_nan_from_inside_the_transform_is_not_blamed_on_the_clipping_code() -> None:
    """A NaN in the batch comes out of the transform in the per-sample gradients: the taped code that wrote p.grad
    received it non-finite from code nothing taped, so no op of that code is named, nor is the step transient."""
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        for step in range(FAIL + 1):
            x, y = _batch(step)
            if step == FAIL:
                x[1, 2] = float("nan")
            _dp_step(model, opt, x, y, clip=1.0, pad=False)
    first: Any = guard.incidents[0]
    assert (first.step, first.kind, first.op, first.cause, first.action) == \
        (FAIL, "nonfinite_grad", None, "unknown", "skipped")
    assert first.transient is not True
    assert "not taped" in first.details["localisation"], first.details


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


def _meta_step(model: nn.Module, opt: torch.optim.Optimizer, support: Any, query: Any) -> None:
    """One first-order-free MAML step with a normalised inner update: the fast weights move by a fixed
    length along the support gradient (written as ``g / ||g||``), and the query loss is taken on them
    through ``functional_call`` (the model never runs on its own parameters in the outer loss)."""
    params = dict(model.named_parameters())
    xs, ys = support
    inner = ((functional_call(model, params, (xs,)) - ys) ** 2).mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    fast = {n: p - 0.1 * g / norm for (n, p), g in zip(params.items(), grads)}  # <origin:inner_step>
    xq, yq = query
    opt.zero_grad()
    ((functional_call(model, fast, (xq,)) - yq) ** 2).mean().backward()
    opt.step()


def _task(step: int) -> tuple[Any, Any]:
    """A sine-regression task: (support, query), each (inputs, targets)."""
    g = torch.Generator().manual_seed(step)
    xs, xq = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    return (xs, torch.sin(xs.sum(1))), (xq, torch.sin(xq.sum(1)))


def test_a_forward_on_fast_weights_is_replayed_on_them() -> None:
    """The query forward runs through ``functional_call`` on fast weights the loss code made: the recorder
    keeps them with the forward (``ForwardRecord.substitutes``; a forward on the model's own parameters
    keeps none), and the replay runs on the replayed fast weights. A support set the model already fits
    exactly (a zero support gradient: 0/0 in the normalised inner step) is found at the division."""
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    subs: list[Any] = []
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        def keep(*_: Any) -> None:  # after the guard's own pre-hook, before the step ends and its capture resets
            if not subs:
                subs.extend(f.substitutes for f in guard.recorder.capture.forwards)

        opt.register_step_pre_hook(keep)
        for step in range(FAIL + 2):
            support, query = _task(step)
            if step == FAIL:  # the support targets are the model's own predictions: a zero inner gradient
                with torch.no_grad():
                    support = (support[0], model(support[0]).detach())
            _meta_step(model, opt, support, query)
    names = {n for n, _ in model.named_parameters()}
    # the support forward ran on the model's own parameters (functional_call with them): nothing to keep
    assert len(subs) == 2 and subs[0] is None and set(subs[1]) == names
    first: Any = guard.incidents[0]
    assert (first.step, first.kind, first.phase, first.op, first.module, first.cause, first.action) == \
        (FAIL, "nonfinite_loss", "forward", "aten.div.Tensor", None, "zero_variance_norm", "skipped")
    assert points_at(first.source, __file__, "inner_step"), first.source
    assert first.transient is False


def test_a_plain_forward_records_no_substitutes() -> None:
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        assert [f.substitutes for f in guard.recorder.capture.forwards] == [None]
        opt.step()


def test_a_replaced_parameter_is_no_substitution() -> None:
    """A parameter the user replaces outright (a re-initialised head) is the model's own from then on:
    no forward records stand-ins for it, and the one identity test per forward follows the new one."""
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with nantrace.watch(model, opt, config=nantrace.Config(outputs={"print_incidents": False})) as guard:
        model.body[0].weight = nn.Parameter(torch.randn(16, 3))  # the first parameter: the one probed
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        assert [f.substitutes for f in guard.recorder.capture.forwards] == [None]
